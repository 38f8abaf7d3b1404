//! Retrying a prefill that keeps failing its handshake: capped
//! exponential back-off, and a WARN log at most once per period that says
//! how many failures it stands for.
//!
//! Hand-written rather than `governor` (which the service uses for its
//! heartbeats): governor keeps its own clock, and this logic is tested on
//! tokio's paused clock, whose `Instant` is what it takes here.

use std::time::Duration;

use tokio::time::Instant;

/// What to do after a failed attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AfterFailure {
    /// Pause before the next attempt.
    pub pause: Duration,
    /// `Some(n)`: log a WARN now; `n` failures since the previous WARN
    /// were not logged. `None`: stay quiet (rate limit).
    pub warn: Option<u64>,
    /// Failures in a row, this one included.
    pub in_a_row: u64,
}

/// Back-off and log rate limit for one prefill address. See the module
/// docs.
#[derive(Clone, Debug)]
pub struct Retry {
    first: Duration,
    max: Duration,
    warn_every: Duration,
    next: Duration,
    in_a_row: u64,
    last_warn: Option<Instant>,
    quiet: u64,
}

impl Retry {
    /// Pauses start at `first` and double up to `max`; at most one WARN
    /// per `warn_every`.
    pub fn new(first: Duration, max: Duration, warn_every: Duration) -> Retry {
        let first = first.max(Duration::from_millis(1));
        Retry {
            first,
            max: max.max(first),
            warn_every,
            next: first,
            in_a_row: 0,
            last_warn: None,
            quiet: 0,
        }
    }

    /// Records a failed attempt at `now`.
    pub fn failed(&mut self, now: Instant) -> AfterFailure {
        self.in_a_row += 1;
        let pause = self.next;
        self.next = self.next.saturating_mul(2).min(self.max);
        let due = self
            .last_warn
            .is_none_or(|t| now.saturating_duration_since(t) >= self.warn_every);
        let warn = if due {
            self.last_warn = Some(now);
            Some(std::mem::take(&mut self.quiet))
        } else {
            self.quiet += 1;
            None
        };
        AfterFailure {
            pause,
            warn,
            in_a_row: self.in_a_row,
        }
    }

    /// Records a success: the next failure starts from `first` again and
    /// is logged at once. Returns the failures in a row it ended.
    pub fn succeeded(&mut self) -> u64 {
        self.next = self.first;
        self.last_warn = None;
        self.quiet = 0;
        std::mem::take(&mut self.in_a_row)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Drives a prefill that fails every attempt for `for_how_long` of
    /// paused time, sleeping each pause; returns the pauses and the WARNs.
    async fn fail_for(r: &mut Retry, for_how_long: Duration) -> (Vec<Duration>, Vec<u64>) {
        let start = Instant::now();
        let (mut pauses, mut warns) = (Vec::new(), Vec::new());
        while start.elapsed() < for_how_long {
            let a = r.failed(Instant::now());
            pauses.push(a.pause);
            warns.extend(a.warn);
            tokio::time::sleep(a.pause).await;
        }
        (pauses, warns)
    }

    #[tokio::test(start_paused = true)]
    async fn pauses_double_up_to_the_cap_and_a_success_starts_over() {
        let mut r = Retry::new(ms(250), ms(8000), Duration::from_secs(60));
        let (pauses, _) = fail_for(&mut r, Duration::from_secs(60)).await;
        assert_eq!(
            &pauses[..7],
            &[
                ms(250),
                ms(500),
                ms(1000),
                ms(2000),
                ms(4000),
                ms(8000),
                ms(8000)
            ]
        );
        assert!(pauses.iter().all(|p| *p <= ms(8000)));
        // 60 s of failures: attempts at 0, 0.25, 0.75, 1.75, 3.75, 7.75 s,
        // then every 8 s up to 55.75 s: 12 attempts, not the 240 of a
        // fixed 250 ms.
        assert_eq!(pauses.len(), 12);
        assert_eq!(r.succeeded(), 12);
        assert_eq!(r.failed(Instant::now()).pause, ms(250));
    }

    #[tokio::test(start_paused = true)]
    async fn at_most_one_warn_per_period_and_it_counts_the_quiet_failures() {
        let mut r = Retry::new(ms(100), ms(100), Duration::from_secs(10));
        // A fixed 100 ms pause: 10 failures a second for 30 s.
        let (pauses, warns) = fail_for(&mut r, Duration::from_secs(30)).await;
        assert_eq!(pauses.len(), 300);
        // WARNs at 0 s, 10 s, 20 s; each after the first stands for the
        // 99 failures not logged since the one before.
        assert_eq!(warns, vec![0, 99, 99]);
        // A success lets the next failure warn at once.
        r.succeeded();
        assert_eq!(r.failed(Instant::now()).warn, Some(0));
    }

    #[tokio::test(start_paused = true)]
    async fn edge_values_do_not_spin_or_overflow() {
        // A zero first pause is raised to 1 ms; a cap under it to it.
        let mut r = Retry::new(Duration::ZERO, Duration::ZERO, Duration::ZERO);
        let a = r.failed(Instant::now());
        assert_eq!(a.pause, ms(1));
        assert_eq!(r.failed(Instant::now()).pause, ms(1));
        // warn_every zero: every failure warns.
        assert_eq!(r.failed(Instant::now()).warn, Some(0));
        // A huge cap: doubling saturates instead of overflowing.
        let mut r = Retry::new(ms(1), Duration::MAX, Duration::MAX);
        for _ in 0..200 {
            let _ = r.failed(Instant::now());
        }
    }
}

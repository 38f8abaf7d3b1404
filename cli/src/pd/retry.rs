//! Retrying a prefill that keeps failing its handshake: capped
//! exponential back-off (`backon`'s, no jitter, no limit on attempts; the
//! pauses are a plain iterator, slept on tokio's clock by the caller).
//! (How often a failure is logged is the decoder's
//! [`nixl_keepalive::log_limit::LogLimiter`], per failure reason.)

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};

/// What to do after a failed attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AfterFailure {
    /// Pause before the next attempt.
    pub pause: Duration,
    /// Failures in a row, this one included.
    pub in_a_row: u64,
}

/// Back-off for one prefill address. See the module docs.
#[derive(Debug)]
pub struct Retry {
    builder: ExponentialBuilder,
    pauses: <ExponentialBuilder as BackoffBuilder>::Backoff,
    max: Duration,
    in_a_row: u64,
}

impl Retry {
    /// Pauses start at `first` and double up to `max`.
    pub fn new(first: Duration, max: Duration) -> Retry {
        let first = first.max(Duration::from_millis(1));
        let max = max.max(first);
        let builder = backoff(first, max);
        Retry {
            builder,
            pauses: builder.build(),
            max,
            in_a_row: 0,
        }
    }

    /// Records a failed attempt.
    pub fn failed(&mut self) -> AfterFailure {
        self.in_a_row += 1;
        AfterFailure {
            // Never `None` (no limit on attempts or total delay).
            pause: self.pauses.next().unwrap_or(self.max),
            in_a_row: self.in_a_row,
        }
    }

    /// Records a success: the next failure starts from `first` again.
    /// Returns the failures in a row it ended.
    pub fn succeeded(&mut self) -> u64 {
        self.pauses = self.builder.build();
        std::mem::take(&mut self.in_a_row)
    }
}

/// Pauses from `first`, doubling up to `max`, without end and without
/// jitter: what every retry of the command line uses (this module's, the
/// demo's reconnects).
pub fn backoff(first: Duration, max: Duration) -> ExponentialBuilder {
    ExponentialBuilder::new()
        .with_min_delay(first)
        .with_max_delay(max)
        .with_factor(2.0)
        .without_max_times()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Drives a prefill that fails every attempt for `for_how_long` of
    /// paused time, sleeping each pause; returns the pauses.
    async fn fail_for(r: &mut Retry, for_how_long: Duration) -> Vec<Duration> {
        let start = Instant::now();
        let mut pauses = Vec::new();
        while start.elapsed() < for_how_long {
            let a = r.failed();
            pauses.push(a.pause);
            tokio::time::sleep(a.pause).await;
        }
        pauses
    }

    #[tokio::test(start_paused = true)]
    async fn pauses_double_up_to_the_cap_and_a_success_starts_over() {
        let mut r = Retry::new(ms(250), ms(8000));
        let pauses = fail_for(&mut r, Duration::from_secs(60)).await;
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
        assert_eq!(r.failed().pause, ms(250));
    }

    #[tokio::test(start_paused = true)]
    async fn edge_values_do_not_spin_or_overflow() {
        // A zero first pause is raised to 1 ms; a cap under it to it.
        let mut r = Retry::new(Duration::ZERO, Duration::ZERO);
        assert_eq!(r.failed().pause, ms(1));
        assert_eq!(r.failed().pause, ms(1));
        // A huge cap: doubling saturates instead of overflowing.
        let mut r = Retry::new(ms(1), Duration::MAX);
        for _ in 0..200 {
            let _ = r.failed();
        }
    }
}

//! Retrying a prefill that keeps failing its handshake: capped
//! exponential back-off (`backon`'s, no limit on attempts; the pauses are
//! a plain iterator, slept on tokio's clock by the caller), per claimant
//! and with jitter:
//!
//! - **per claimant**: the back-off is earned by whoever answered at the
//!   address (an engine id and incarnation, or nobody). A new engine id
//!   or incarnation there starts fresh: a prefill that starts where a
//!   broken or conflicting one was is not made to wait for the other's
//!   failures.
//! - **jitter**: each pause is drawn from the upper half of the doubling
//!   step, `[d/2, d)` (`rand`'s thread generator, so every reader has its
//!   own draws): retries to many dead members spread out instead of
//!   running in lockstep. (`backon`'s own jitter draws from a fixed seed
//!   without its `std` feature, the same sequence in every reader, and
//!   adds up to a whole step above the cap.)
//!
//! (How often a failure is logged is the decoder's
//! [`nixl_keepalive::log_limit::LogLimiter`], per address and reason.)

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

/// Who answered at an address: the engine id and incarnation its
/// handshake reply named, `None` when nobody answered (or the reply could
/// not be read). The unit a back-off is earned by.
pub type Claimant = Option<(String, u64)>;

/// Back-off for one prefill address, per claimant. See the module docs.
#[derive(Debug)]
pub struct Retry {
    builder: ExponentialBuilder,
    pauses: <ExponentialBuilder as BackoffBuilder>::Backoff,
    max: Duration,
    in_a_row: u64,
    /// Who earned the failures so far.
    claimant: Claimant,
    jitter: bool,
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
            claimant: None,
            jitter: true,
        }
    }

    /// The same without jitter: each pause the whole doubling step (for
    /// tests of the steps).
    pub fn without_jitter(mut self) -> Retry {
        self.jitter = false;
        self
    }

    /// Records a failed attempt by whoever failed the last one.
    pub fn failed(&mut self) -> AfterFailure {
        self.in_a_row += 1;
        // Never `None` (no limit on attempts or total delay).
        let step = self.pauses.next().unwrap_or(self.max);
        let pause = if self.jitter {
            step.mul_f64(0.5 + rand::random::<f64>() / 2.0)
        } else {
            step
        };
        AfterFailure {
            pause,
            in_a_row: self.in_a_row,
        }
    }

    /// Records a failed attempt by `claimant`: another claimant than the
    /// one whose failures the back-off holds starts it fresh.
    pub fn failed_by(&mut self, claimant: Claimant) -> AfterFailure {
        if claimant != self.claimant {
            self.pauses = self.builder.build();
            self.in_a_row = 0;
            self.claimant = claimant;
        }
        self.failed()
    }

    /// Who earned the failures so far.
    pub fn claimant(&self) -> &Claimant {
        &self.claimant
    }

    /// Records a success: the next failure starts from `first` again.
    /// Returns the failures in a row it ended.
    pub fn succeeded(&mut self) -> u64 {
        self.pauses = self.builder.build();
        self.claimant = None;
        std::mem::take(&mut self.in_a_row)
    }
}

/// Pauses from `first`, doubling up to `max`, without end (the steps;
/// [`Retry`] draws its jitter within each): what every retry of the
/// command line uses (this module's, the demo's reconnects).
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
        let mut r = Retry::new(ms(250), ms(8000)).without_jitter();
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
    async fn a_new_claimant_at_an_address_starts_fresh_and_the_same_one_keeps_its_back_off() {
        // Issue 30, item 8: before, a conflict at an address made the next,
        // honest claimant there wait out the other's back-off.
        let mut r = Retry::new(ms(250), ms(4000)).without_jitter();
        let broken: Claimant = Some(("p".into(), 1));
        for _ in 0..5 {
            r.failed_by(broken.clone());
        }
        assert_eq!(r.failed_by(broken.clone()).pause, ms(4000), "earned");
        // The same engine id restarted (another incarnation): fresh.
        let after = r.failed_by(Some(("p".into(), 2)));
        assert_eq!((after.pause, after.in_a_row), (ms(250), 1));
        // Nobody at the address any more: fresh too.
        assert_eq!(r.failed_by(None).pause, ms(250));
        assert_eq!(r.failed_by(None).pause, ms(500));
    }

    #[test]
    fn retries_of_many_dead_members_are_spread_not_in_lockstep() {
        // 1,000 readers, each failing 6 times from the same instant: with
        // jitter their attempts fall at many different times, within the
        // upper half of each step.
        let mut attempts = std::collections::BTreeSet::new();
        for _ in 0..1000 {
            let mut r = Retry::new(ms(250), ms(4000));
            let mut at = Duration::ZERO;
            for step in [250, 500, 1000, 2000, 4000, 4000] {
                let p = r.failed_by(None).pause;
                assert!(
                    p >= ms(step / 2) && p < ms(step),
                    "{p:?} for a {step} ms step"
                );
                at += p;
            }
            attempts.insert(at.as_millis());
        }
        // Without jitter all 1,000 fall on one millisecond; with it they
        // spread over seconds (1,000 draws over about 5,900 ms collide
        // now and then).
        assert!(attempts.len() > 700, "{} distinct times", attempts.len());
        let spread = attempts.last().unwrap() - attempts.first().unwrap();
        assert!(spread > 2000, "spread over {spread} ms");
    }

    #[tokio::test(start_paused = true)]
    async fn edge_values_do_not_spin_or_overflow() {
        // A zero first pause is raised to 1 ms; a cap under it to it.
        let mut r = Retry::new(Duration::ZERO, Duration::ZERO).without_jitter();
        assert_eq!(r.failed().pause, ms(1));
        assert_eq!(r.failed().pause, ms(1));
        // A huge cap: doubling saturates instead of overflowing.
        let mut r = Retry::new(ms(1), Duration::MAX);
        for _ in 0..200 {
            let _ = r.failed();
        }
    }
}

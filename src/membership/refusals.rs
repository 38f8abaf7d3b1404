//! How often refused records are reported: each key and refusal's first
//! occurrence is reported and its repeats within [`LOG_PERIOD`] only counted
//! ([`LogLimiter`], the budget every refusal of the service and the
//! command line shares), and over all keys at most a burst then one a
//! second (governor's cell rate, on tokio's clock, paused in tests), so a
//! flood of broken records costs a few log lines a second however many
//! there are, and a record flapped a thousand times costs one line per
//! period, not one per put.

use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::FakeRelativeClock;
use governor::middleware::NoOpMiddleware;
use governor::nanos::Nanos;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use tokio::time::Instant;

use crate::log_limit::{LogLimiter, LOG_KEYS, LOG_PERIOD};

/// Refused records reported (logged at WARN and sent as
/// [`MembershipUpdate::BadValue`](super::MembershipUpdate::BadValue)) at once before the rate applies.
pub const REFUSALS_BURST: u32 = 10;
/// After the burst, one refused record reported per this period; the
/// others are counted, and the next report says how many.
pub const REFUSALS_PERIOD: Duration = Duration::from_secs(1);

/// Longest part of a key remembered by the per-key budget: a hostile key
/// of a kilobyte costs no more than this.
const KEY_REMEMBERED: usize = 256;

/// Counts refusals and says which may be reported.
pub(super) struct RefusalLog {
    /// Per key and refusal (a digest of its text: two different faults
    /// of one key are two refusals): the first reported, repeats counted.
    per_key: LogLimiter<(String, u64)>,
    limiter: RateLimiter<NotKeyed, InMemoryState, FakeRelativeClock, NoOpMiddleware<Nanos>>,
    clock: FakeRelativeClock,
    origin: Instant,
    clock_at: Duration,
    unreported: u64,
}

impl RefusalLog {
    pub(super) fn new(origin: Instant) -> Self {
        let quota = Quota::with_period(REFUSALS_PERIOD)
            .expect("a non-zero period")
            .allow_burst(NonZeroU32::new(REFUSALS_BURST).expect("a non-zero burst"));
        let clock = FakeRelativeClock::default();
        RefusalLog {
            per_key: LogLimiter::new(LOG_PERIOD, LOG_KEYS),
            limiter: RateLimiter::direct_with_clock(quota, clock.clone()),
            clock,
            origin,
            clock_at: Duration::ZERO,
            unreported: 0,
        }
    }

    /// Counts one refusal of `key` for `refusal` (the error's text) at
    /// `now`; `Some(n)` when it may be reported, `n` being the refusals
    /// since the last report that were not (of any key).
    pub(super) fn refused(&mut self, key: &str, refusal: &str, now: Instant) -> Option<u64> {
        let since = now.saturating_duration_since(self.origin);
        if since > self.clock_at {
            self.clock.advance(since - self.clock_at);
            self.clock_at = since;
        }
        let mut end = key.len().min(KEY_REMEMBERED);
        while !key.is_char_boundary(end) {
            end -= 1;
        }
        let digest = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            refusal.hash(&mut h);
            h.finish()
        };
        if self
            .per_key
            .admit((key[..end].to_string(), digest), now)
            .is_none()
        {
            self.unreported += 1;
            return None;
        }
        match self.limiter.check() {
            Ok(()) => Some(std::mem::take(&mut self.unreported)),
            Err(_) => {
                self.unreported += 1;
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_key_flapped_a_thousand_times_is_one_report_per_period_and_another_key_still_gets_its_first(
    ) {
        let start = Instant::now();
        let mut log = RefusalLog::new(start);
        let mut reported = 0;
        for i in 0..1000u64 {
            let now = start + Duration::from_millis(i);
            if log.refused("/p/flapped", "not_canonical", now).is_some() {
                reported += 1;
            }
        }
        assert_eq!(reported, 1, "one report for a second of flapping");
        // Another key's first refusal is not hidden by the first key's.
        let now = start + Duration::from_millis(1000);
        assert_eq!(log.refused("/p/other", "not_canonical", now), Some(999));
        // After the period the flapped key is reported again.
        assert!(log
            .refused("/p/flapped", "not_canonical", start + LOG_PERIOD)
            .is_some());
    }
}

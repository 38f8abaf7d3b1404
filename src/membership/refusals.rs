//! How often refused records are reported: governor's cell rate, on
//! tokio's clock (paused in tests), so a flood of broken records costs a
//! few log lines a second however many there are.

use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::FakeRelativeClock;
use governor::middleware::NoOpMiddleware;
use governor::nanos::Nanos;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use tokio::time::Instant;

use super::{REFUSALS_BURST, REFUSALS_PERIOD};

/// Counts refusals and says which may be reported.
pub(super) struct RefusalLog {
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
            limiter: RateLimiter::direct_with_clock(quota, clock.clone()),
            clock,
            origin,
            clock_at: Duration::ZERO,
            unreported: 0,
        }
    }

    /// Counts one refusal at `now`; `Some(n)` when it may be reported,
    /// `n` being the refusals since the last report that were not.
    pub(super) fn refused(&mut self, now: Instant) -> Option<u64> {
        let since = now.saturating_duration_since(self.origin);
        if since > self.clock_at {
            self.clock.advance(since - self.clock_at);
            self.clock_at = since;
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

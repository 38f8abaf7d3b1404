//! The per-engine notification rate cap (governor), on the core's clock.
//!
//! governor's default clock is the wall clock; here it sees exactly the
//! `now` the driver passes in (tokio's clock converted, paused in tests). Each
//! registration's limiter state (GCRA's one number, the theoretical arrival
//! time) lives in its own record ([`RateState`] in the core's peer table),
//! not in a keyed store of its own: a heartbeat's check touches the record
//! it already has in hand, with no second table, lock or lookup (they were
//! a twentieth of the service's CPU at 10k engines), and a released
//! registration's state goes with its record. governor runs the algorithm
//! on a one-slot store the core fills before each check and empties after.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use governor::clock::{Clock, FakeRelativeClock};
use governor::middleware::NoOpMiddleware;
use governor::nanos::Nanos;
use governor::state::{NotKeyed, StateStore};
use governor::{Quota, RateLimiter};
use std::time::Instant;

use crate::config::Config;

/// A registration's limiter state: none until its first round, and again
/// once it is released (its key forgotten). GCRA's theoretical arrival
/// time in nanoseconds since the core's start, [`NO_STATE`] for none: a
/// sentinel rather than an `Option`, 8 bytes of every record instead of
/// 16; an arrival time of `u64::MAX` nanoseconds would be 584 years after
/// the service started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RateState(u64);

impl Default for RateState {
    fn default() -> Self {
        RateState(NO_STATE)
    }
}

impl RateState {
    /// Whether the registration has limiter state (a key, in governor's
    /// terms).
    pub(crate) fn is_some(&self) -> bool {
        self.0 != NO_STATE
    }

    /// Forgets the state (the registration is released).
    pub(crate) fn forget(&mut self) {
        self.0 = NO_STATE;
    }
}

/// The one slot governor reads and writes during a check: the state of the
/// registration being checked, put in just before and taken out just after
/// (`u64::MAX`: no state yet). Only the core's thread uses it.
#[derive(Clone)]
struct Slot(Arc<AtomicU64>);

const NO_STATE: u64 = u64::MAX;

impl StateStore for Slot {
    type Key = NotKeyed;

    fn measure_and_replace<T, F, E>(&self, _key: &NotKeyed, f: F) -> Result<T, E>
    where
        F: Fn(Option<Nanos>) -> Result<(T, Nanos), E>,
    {
        let now = self.0.load(Ordering::Relaxed);
        let (out, state) = f((now != NO_STATE).then(|| Nanos::from(now)))?;
        self.0.store(state.into(), Ordering::Relaxed);
        Ok(out)
    }
}

/// The rate cap: governor's GCRA over each registration's [`RateState`].
pub(crate) struct RateCap {
    limiter: RateLimiter<NotKeyed, Slot, FakeRelativeClock, NoOpMiddleware<Nanos>>,
    slot: Slot,
    clock: FakeRelativeClock,
    origin: Instant,
    clock_at: Duration,
}

impl RateCap {
    pub(crate) fn new(config: &Config, origin: Instant) -> Self {
        let burst = NonZeroU32::new(config.rate_burst).expect("validated burst");
        let quota = Quota::with_period(config.rate_period)
            .expect("validated period")
            .allow_burst(burst);
        let slot = Slot(Arc::new(AtomicU64::new(NO_STATE)));
        let clock = FakeRelativeClock::default();
        RateCap {
            limiter: RateLimiter::new(quota, slot.clone(), clock.clone()),
            slot,
            clock,
            origin,
            clock_at: Duration::ZERO,
        }
    }

    /// `Ok` if the registration whose limiter state is `state` may get a
    /// notification round at `now` (and counts it in `state`), else how
    /// long until it may.
    pub(crate) fn check(&mut self, state: &mut RateState, now: Instant) -> Result<(), Duration> {
        let since = now.saturating_duration_since(self.origin);
        if since > self.clock_at {
            self.clock.advance(since - self.clock_at);
            self.clock_at = since;
        }
        self.slot.0.store(state.0, Ordering::Relaxed);
        let verdict = self
            .limiter
            .check()
            .map_err(|not_until| not_until.wait_time_from(self.clock.now()));
        state.0 = self.slot.0.swap(NO_STATE, Ordering::Relaxed);
        verdict
    }
}

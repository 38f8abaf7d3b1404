//! The per-engine notification rate cap (governor), on the core's clock.
//!
//! governor's default clock is the wall clock; here it sees exactly the
//! `now` the driver passes in (tokio's clock, paused in tests). Its keyed
//! state lives in a store the core can forget a released registration's key
//! in at once (governor's own stores only forget idle keys in bulk).

use crate::registration::RegistrationId;
use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use governor::clock::{Clock, FakeRelativeClock};
use governor::middleware::NoOpMiddleware;
use governor::nanos::Nanos;
use governor::state::StateStore;
use governor::{Quota, RateLimiter};
use tokio::time::Instant;

use crate::config::Config;

#[derive(Clone, Default)]
struct LimiterKeys(Arc<Mutex<HashMap<RegistrationId, Nanos, foldhash::fast::RandomState>>>);

impl StateStore for LimiterKeys {
    type Key = RegistrationId;

    fn measure_and_replace<T, F, E>(&self, key: &RegistrationId, f: F) -> Result<T, E>
    where
        F: Fn(Option<Nanos>) -> Result<(T, Nanos), E>,
    {
        use std::collections::hash_map::Entry;
        // One lookup per check (a get and an insert were two cache misses
        // at 10k engines).
        let mut keys = self.0.lock().expect("limiter keys poisoned");
        match keys.entry(*key) {
            Entry::Occupied(mut slot) => {
                let (out, state) = f(Some(*slot.get()))?;
                slot.insert(state);
                Ok(out)
            }
            Entry::Vacant(slot) => {
                let (out, state) = f(None)?;
                slot.insert(state);
                Ok(out)
            }
        }
    }
}

/// The rate cap: one key per registration that has had a round.
pub(crate) struct RateCap {
    limiter: RateLimiter<RegistrationId, LimiterKeys, FakeRelativeClock, NoOpMiddleware<Nanos>>,
    keys: LimiterKeys,
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
        let keys = LimiterKeys::default();
        let clock = FakeRelativeClock::default();
        RateCap {
            limiter: RateLimiter::new(quota, keys.clone(), clock.clone()),
            keys,
            clock,
            origin,
            clock_at: Duration::ZERO,
        }
    }

    /// `Ok` if `serial` may get a notification round at `now` (and counts
    /// it), else how long until it may.
    pub(crate) fn check(&mut self, serial: RegistrationId, now: Instant) -> Result<(), Duration> {
        let since = now.saturating_duration_since(self.origin);
        if since > self.clock_at {
            self.clock.advance(since - self.clock_at);
            self.clock_at = since;
        }
        self.limiter
            .check_key(&serial)
            .map_err(|not_until| not_until.wait_time_from(self.clock.now()))
    }

    /// Forgets a released registration's key.
    pub(crate) fn forget(&self, serial: RegistrationId) {
        self.keys
            .0
            .lock()
            .expect("limiter keys poisoned")
            .remove(&serial);
    }

    /// Keys held.
    pub(crate) fn len(&self) -> usize {
        self.keys.0.lock().expect("limiter keys poisoned").len()
    }
}

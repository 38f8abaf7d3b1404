//! The core's own timers besides the per-engine heartbeat schedule, in one
//! table (quinn-proto's `TimerTable` is the model): each timer is a slot
//! that is set, stopped or expired, and [`TimerTable::next`] is the
//! earliest of them. The heartbeat schedule stays apart in `schedule.rs`:
//! it holds one deadline per engine, bucketed in slots.

use std::time::Duration;

use std::time::Instant;

/// A timer the core owns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Timer {
    /// The gauges' census ([`crate::Config::metrics_period`]).
    Census,
    /// The read-stall check on its own period.
    StallCheck,
    /// A stall that may be decided before the next periodic check: the
    /// earliest moment an engine's quiet stretch reaches the bound, or now
    /// when a read was given up as timed out.
    StallMark,
    /// The shutdown drain deadline: past it, reads still in flight are no
    /// longer waited for.
    Drain,
}

impl Timer {
    const ALL: [Timer; 4] = [
        Timer::Census,
        Timer::StallCheck,
        Timer::StallMark,
        Timer::Drain,
    ];
}

/// When each [`Timer`] fires next, if it is set.
#[derive(Debug, Default)]
pub(super) struct TimerTable {
    due: [Option<Instant>; Timer::ALL.len()],
}

impl TimerTable {
    /// Sets `timer` to fire at `at` (replacing any earlier setting).
    pub(super) fn set(&mut self, timer: Timer, at: Instant) {
        self.due[timer as usize] = Some(at);
    }

    /// Sets or stops `timer`.
    pub(super) fn set_or_stop(&mut self, timer: Timer, at: Option<Instant>) {
        self.due[timer as usize] = at;
    }

    /// Stops `timer`.
    pub(super) fn stop(&mut self, timer: Timer) {
        self.due[timer as usize] = None;
    }

    /// When `timer` fires, if set.
    pub(super) fn get(&self, timer: Timer) -> Option<Instant> {
        self.due[timer as usize]
    }

    /// Whether `timer` is set and due at `now`.
    pub(super) fn is_expired(&self, timer: Timer, now: Instant) -> bool {
        self.get(timer).is_some_and(|due| due <= now)
    }

    /// The earliest timer set.
    pub(super) fn next(&self) -> Option<Instant> {
        self.due.iter().flatten().min().copied()
    }

    /// Serves a periodic timer that fired: sets it one `period` after its
    /// deadline, or after `now` when it is a whole period or more behind
    /// (a stalled driver catches up with one firing, never a burst).
    /// Returns whether it was due.
    pub(super) fn rearm_periodic(&mut self, timer: Timer, now: Instant, period: Duration) -> bool {
        let Some(due) = self.get(timer).filter(|&due| due <= now) else {
            return false;
        };
        self.set(
            timer,
            if now - due < period {
                due + period
            } else {
                now + period
            },
        );
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_is_the_earliest_timer_set_and_stopped_ones_do_not_count() {
        let t0 = Instant::now();
        let mut timers = TimerTable::default();
        assert_eq!(timers.next(), None);
        timers.set(Timer::Drain, t0 + Duration::from_secs(5));
        timers.set(Timer::Census, t0 + Duration::from_secs(2));
        assert_eq!(timers.next(), Some(t0 + Duration::from_secs(2)));
        timers.stop(Timer::Census);
        assert_eq!(timers.next(), Some(t0 + Duration::from_secs(5)));
        assert!(!timers.is_expired(Timer::Drain, t0));
        assert!(timers.is_expired(Timer::Drain, t0 + Duration::from_secs(5)));
        assert!(!timers.is_expired(Timer::StallMark, t0 + Duration::from_secs(99)));
    }

    #[test]
    fn a_periodic_timer_keeps_its_phase_and_catches_up_without_a_burst() {
        let t0 = Instant::now();
        let period = Duration::from_secs(1);
        let mut timers = TimerTable::default();
        timers.set(Timer::Census, t0 + period);
        assert!(!timers.rearm_periodic(Timer::Census, t0, period), "not due");
        // Served 300 ms late: the next firing keeps the phase.
        assert!(timers.rearm_periodic(Timer::Census, t0 + Duration::from_millis(1300), period));
        assert_eq!(timers.get(Timer::Census), Some(t0 + 2 * period));
        // Served 5 periods late: one firing, the next a period from now.
        let late = t0 + Duration::from_secs(7);
        assert!(timers.rearm_periodic(Timer::Census, late, period));
        assert_eq!(timers.get(Timer::Census), Some(late + period));
    }
}

//! Log lines about what peers and clients do, bounded: one line per key
//! (a peer and a reason) per period, and that line says how many
//! occurrences it stands for.
//!
//! A peer that fails the same way a thousand times a second must not
//! write a thousand lines a second (a broken prefill once produced 1,235
//! `transient_error` lines in 16 s), and one noisy peer must not hide
//! another's first refusal (one WARN per 30 s for everything showed only
//! the latest). So each key has its own budget: its first occurrence is
//! logged at once; later ones within [`LogLimiter::period`] are counted,
//! not logged; the first one after the period is logged with the count of
//! those it stands for. Keys are whatever names a peer and a reason: an
//! `(EngineId, &'static str)`, an `(IpAddr, &'static str)`.
//!
//! Over all keys, one [`LineBudget`] caps the lines a process writes per
//! second: a flood of first occurrences (10,000 dead members, each a new
//! key) costs at most [`LINES_PER_SECOND`] lines a second, and one line
//! per second says how many were suppressed. The command line puts its
//! whole log through it; the per-key budget decides what is worth a
//! line, the global one how many lines there may be.
//!
//! Synchronous and clock-free like the core: every call takes `now`, a
//! `std::time::Instant` or tokio's (converted: paused-clock tests pass
//! tokio's and see the same budget). Memory
//! is bounded: at most [`LogLimiter::capacity`] keys are remembered; when
//! every slot is taken by keys logged within the period, a new key's
//! occurrences are counted in [`LogLimiter::overflow`] instead of logged.
//!
//! # Using it
//!
//! ```
//! use std::time::Duration;
//! use nixl_keepalive::log_limit::LogLimiter;
//! use tokio::time::Instant;
//!
//! let mut limiter = LogLimiter::new(Duration::from_secs(10), 1024);
//! let now = Instant::now();
//! for _ in 0..3 {
//!     if let Some(suppressed) = limiter.admit(("engine-a", "agent_mismatch"), now) {
//!         // One line, with the count it stands for.
//!         tracing::warn!(engine = "engine-a", reason = "agent_mismatch", suppressed, "registration refused");
//!     }
//! }
//! // The first was logged, the other two are counted: the next line for
//! // this key (after the period) says `suppressed = 2`.
//! let later = now + Duration::from_secs(10);
//! assert_eq!(limiter.admit(("engine-a", "agent_mismatch"), later), Some(2));
//! // Another reason of the same peer has its own budget.
//! assert_eq!(limiter.admit(("engine-a", "load_refused"), later), Some(0));
//! ```

use std::collections::HashMap;
use std::hash::Hash;
use std::time::Duration;

use std::time::Instant;

/// The period the service and the command line use: one line per peer and
/// reason per 10 s.
pub const LOG_PERIOD: Duration = Duration::from_secs(10);

/// The keys the service and the command line remember at most.
pub const LOG_KEYS: usize = 1024;

/// One line per key per period, counting what it stands for. See the
/// [module docs](self).
///
/// Keys are hashed with the standard library's seeded hasher: they may
/// come from peers.
#[derive(Debug)]
pub struct LogLimiter<K> {
    period: Duration,
    capacity: usize,
    entries: HashMap<K, Entry>,
    overflow: u64,
}

/// [`LogLimiter::standard`].
impl<K: Hash + Eq> Default for LogLimiter<K> {
    fn default() -> Self {
        Self::standard()
    }
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    /// When this key's last line was written.
    logged_at: Instant,
    /// Occurrences since then not written.
    suppressed: u64,
}

impl<K: Hash + Eq> LogLimiter<K> {
    /// One line per key per `period`, remembering at most `capacity` keys
    /// (at least one).
    pub fn new(period: Duration, capacity: usize) -> Self {
        LogLimiter {
            period,
            capacity: capacity.max(1),
            entries: HashMap::new(),
            overflow: 0,
        }
    }

    /// The period of [`LOG_PERIOD`] and the capacity of [`LOG_KEYS`].
    pub fn standard() -> Self {
        Self::new(LOG_PERIOD, LOG_KEYS)
    }

    /// The shortest time between two lines of one key.
    pub fn period(&self) -> Duration {
        self.period
    }

    /// The most keys remembered.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// One occurrence of `key` at `now`. `Some(n)`: write the line now,
    /// saying it stands for `n` more occurrences of this key that were not
    /// written since its previous line (0 for the first). `None`: stay
    /// quiet; the occurrence is counted and reported by the key's next
    /// line (or by [`LogLimiter::flush`]).
    pub fn admit(&mut self, key: K, now: impl Into<Instant>) -> Option<u64> {
        let now = now.into();
        if let Some(entry) = self.entries.get_mut(&key) {
            if now.saturating_duration_since(entry.logged_at) >= self.period {
                entry.logged_at = now;
                return Some(std::mem::take(&mut entry.suppressed));
            }
            entry.suppressed += 1;
            return None;
        }
        if self.entries.len() >= self.capacity {
            // Forget the keys whose period is over: a key that comes back
            // is logged as new. Their untold counts are summed in the
            // overflow.
            let period = self.period;
            let mut dropped = 0;
            self.entries.retain(|_, e| {
                let keep = now.saturating_duration_since(e.logged_at) < period;
                if !keep {
                    dropped += e.suppressed;
                }
                keep
            });
            self.overflow += dropped;
            if self.entries.len() >= self.capacity {
                self.overflow += 1;
                return None;
            }
        }
        self.entries.insert(
            key,
            Entry {
                logged_at: now,
                suppressed: 0,
            },
        );
        Some(0)
    }

    /// The keys whose period is over and that have occurrences not yet
    /// written, with their counts, which are reset: for a caller with a
    /// timer of its own, to write what a burst left untold once it ends.
    pub fn flush(&mut self, now: impl Into<Instant>) -> Vec<(K, u64)>
    where
        K: Clone,
    {
        let now = now.into();
        let mut told = Vec::new();
        for (key, e) in self.entries.iter_mut() {
            if e.suppressed > 0 && now.saturating_duration_since(e.logged_at) >= self.period {
                told.push((key.clone(), std::mem::take(&mut e.suppressed)));
                e.logged_at = now;
            }
        }
        told
    }

    /// Forgets every key `gone` says is gone (a released engine, say),
    /// untold counts and all.
    pub fn forget(&mut self, mut gone: impl FnMut(&K) -> bool) {
        self.entries.retain(|k, _| !gone(k));
    }

    /// Occurrences never written because every slot was taken, or counted
    /// for a key that was forgotten to make room: over the limiter's
    /// life.
    pub fn overflow(&self) -> u64 {
        self.overflow
    }

    /// Keys remembered now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// No key is remembered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// The most log lines the command line writes per second, by default
/// (`NIXL_KEEPALIVE_LOG_LINES_PER_SEC` overrides it).
pub const LINES_PER_SECOND: u32 = 100;

/// A cap on lines per second over a whole log, whatever they are about:
/// within each second the first `per_second` lines are written, the rest
/// counted; the first line of the next second (or [`LineBudget::flush`])
/// says how many were suppressed. See the [module docs](self).
#[derive(Debug)]
pub struct LineBudget {
    per_second: u32,
    window: Option<Instant>,
    written: u32,
    suppressed: u64,
    total_suppressed: u64,
}

/// What [`LineBudget::admit`] says about one line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Line {
    /// Write it; first write a line saying `suppressed` lines were not
    /// written in the last second (when it is not 0).
    Write {
        /// Lines suppressed since the last summary.
        suppressed: u64,
    },
    /// Over the budget: do not write it (it is counted).
    Suppress,
}

impl LineBudget {
    /// At most `per_second` lines a second (at least 1).
    pub fn new(per_second: u32) -> Self {
        LineBudget {
            per_second: per_second.max(1),
            window: None,
            written: 0,
            suppressed: 0,
            total_suppressed: 0,
        }
    }

    /// The cap.
    pub fn per_second(&self) -> u32 {
        self.per_second
    }

    fn roll(&mut self, now: Instant) -> u64 {
        let over = self
            .window
            .is_none_or(|w| now.saturating_duration_since(w) >= Duration::from_secs(1));
        if !over {
            return 0;
        }
        self.window = Some(now);
        self.written = 0;
        std::mem::take(&mut self.suppressed)
    }

    /// One line at `now`.
    pub fn admit(&mut self, now: impl Into<Instant>) -> Line {
        let now = now.into();
        let suppressed = self.roll(now);
        if self.written < self.per_second {
            self.written += 1;
            Line::Write { suppressed }
        } else {
            self.suppressed += 1;
            self.total_suppressed += 1;
            Line::Suppress
        }
    }

    /// When the second with suppressed lines is over: how many, to be
    /// said in a line of its own (a burst that ended is told without
    /// waiting for the next line). `None` otherwise.
    pub fn flush(&mut self, now: impl Into<Instant>) -> Option<u64> {
        let now = now.into();
        if self.suppressed == 0 {
            return None;
        }
        match self.roll(now) {
            0 => None,
            n => Some(n),
        }
    }

    /// Lines suppressed over the budget's life.
    pub fn total_suppressed(&self) -> u64 {
        self.total_suppressed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thirty_thousand_lines_in_forty_seconds_become_the_budget_and_one_summary_a_second() {
        // 10,000 dead members once gave 30,013 lines in 40 s.
        let mut b = LineBudget::new(100);
        let start = Instant::now();
        let (mut written, mut summaries, mut told) = (0u64, 0u64, 0u64);
        for i in 0..30_013u64 {
            let now = start + Duration::from_micros(i * 40_000_000 / 30_013);
            if let Line::Write { suppressed } = b.admit(now) {
                written += 1;
                if suppressed > 0 {
                    summaries += 1;
                    told += suppressed;
                }
            }
        }
        if let Some(n) = b.flush(start + Duration::from_secs(41)) {
            summaries += 1;
            told += n;
        }
        assert!(written <= 100 * 41, "{written}");
        assert!(summaries <= 41, "{summaries}");
        assert_eq!(written + told, 30_013, "every line written or told");
        assert_eq!(b.total_suppressed(), told);
    }

    #[test]
    fn under_the_budget_every_line_is_written_and_nothing_is_flushed() {
        let mut b = LineBudget::new(3);
        let now = Instant::now();
        for _ in 0..3 {
            assert_eq!(b.admit(now), Line::Write { suppressed: 0 });
        }
        assert_eq!(b.flush(now + Duration::from_secs(5)), None);
        assert_eq!(b.admit(now), Line::Suppress, "the fourth in one second");
        assert_eq!(
            b.admit(now + Duration::from_secs(5)),
            Line::Write { suppressed: 1 },
            "a new second says what the last one suppressed"
        );
        assert_eq!(LineBudget::new(0).per_second(), 1);
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_thousand_identical_errors_a_second_make_one_line_per_period_with_the_count() {
        let mut l = LogLimiter::new(Duration::from_secs(10), 16);
        let start = Instant::now();
        let mut lines = Vec::new();
        // 1,235 errors in 16 s, as the broken prefill produced.
        for i in 0..1235u64 {
            let now = start + ms(i * 16_000 / 1235);
            if let Some(n) = l.admit(("p", "transient_error"), now) {
                lines.push(n);
            }
        }
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(lines[0], 0);
        // The second line stands for every error of the first period.
        assert!(lines[1] > 700, "{lines:?}");
        // The tail is told by a flush after the period.
        let tail: u64 = l
            .flush(start + Duration::from_secs(40))
            .iter()
            .map(|(_, n)| n)
            .sum();
        assert_eq!(lines[1] + tail + 2, 1235);
    }

    #[test]
    fn each_peer_and_reason_has_its_own_budget() {
        let mut l = LogLimiter::new(Duration::from_secs(10), 16);
        let now = Instant::now();
        assert_eq!(l.admit(("a", "x"), now), Some(0));
        assert_eq!(l.admit(("a", "x"), now), None);
        assert_eq!(l.admit(("a", "y"), now), Some(0));
        assert_eq!(l.admit(("b", "x"), now), Some(0));
        l.forget(|(peer, _)| *peer == "a");
        assert_eq!(l.admit(("a", "x"), now), Some(0));
    }

    #[test]
    fn memory_is_bounded_and_what_does_not_fit_is_counted() {
        let mut l = LogLimiter::new(Duration::from_secs(10), 4);
        let now = Instant::now();
        for k in 0..4 {
            assert_eq!(l.admit(k, now), Some(0));
        }
        // Full of keys logged within the period: a new key is counted.
        assert_eq!(l.admit(99, now), None);
        assert_eq!(l.overflow(), 1);
        assert_eq!(l.len(), 4);
        // Once their period is over they make room.
        assert_eq!(l.admit(99, now + Duration::from_secs(10)), Some(0));
        assert!(l.len() <= 4);
        // A zero capacity still remembers one key.
        let mut l = LogLimiter::new(Duration::ZERO, 0);
        assert_eq!(l.capacity(), 1);
        assert_eq!(l.admit(1, now), Some(0));
        assert_eq!(l.admit(1, now), Some(0), "a zero period logs everything");
    }
}

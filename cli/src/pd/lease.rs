//! The prefill's request leases, with vLLM's rules: a request's KV blocks
//! are held from when it is scheduled (`RQ:<id>`) for one lease; an `HB:`
//! naming it sets its expiry to `max(old, now + 2/3 lease)`; unknown ids
//! are ignored; its read completion (`RD:<id>`) frees its blocks; a lease
//! that ran out frees them when the prefill next sweeps ([`Leases::expire`]).
//! As in vLLM's prefill, which handles the notifications that arrived
//! before it looks for expired requests, a request is held until that
//! sweep: an `HB:` or `RD:` handled before it still finds the request (a
//! prefill that was frozen handles what arrived meanwhile first). A read
//! completion that arrives after the sweep freed its request's blocks is a
//! read of freed (in vLLM: possibly reused) memory, and is what this table
//! exists to catch.
//!
//! Pure: every call takes `now`, so the rules are tested without a clock.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The most requests held at once, and the most expired ones remembered:
/// a peer that schedules without end cannot grow the table past this.
pub const MAX_REQUESTS: usize = 100_000;

/// How a read completion (`RD:`) matched the leases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadDone {
    /// The request held a live lease; its blocks are freed now.
    InTime,
    /// The request's lease had run out this long before: its blocks had
    /// been freed when they were read.
    AfterExpiry {
        /// How long before the completion the lease ran out.
        expired_for: Duration,
    },
    /// A request this prefill never scheduled, or one already completed.
    Unknown,
}

/// Counts of what the table saw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LeaseCounts {
    /// Requests scheduled (`RQ:`).
    pub scheduled: u64,
    /// Lease extensions (one per known id per `HB:`).
    pub extended: u64,
    /// Ids named by an `HB:` that held no live lease (ignored).
    pub ignored: u64,
    /// Reads completed within their lease.
    pub completed: u64,
    /// Leases that ran out (their blocks freed).
    pub expired: u64,
    /// Reads completed after their lease ran out.
    pub late_reads: u64,
    /// Read completions of requests never scheduled or already completed.
    pub unknown_reads: u64,
    /// Requests refused because [`MAX_REQUESTS`] were already held.
    pub refused: u64,
}

/// The leases of one prefill process. See the module docs.
#[derive(Debug)]
pub struct Leases {
    lease: Duration,
    live: HashMap<String, Instant>,
    /// Expired requests and when they ran out, kept for `history` so a
    /// late completion is recognised; older records are dropped (a
    /// completion later than that counts as unknown).
    expired: HashMap<String, Instant>,
    history: Duration,
    counts: LeaseCounts,
}

impl Leases {
    /// An empty table with leases of `lease`.
    pub fn new(lease: Duration) -> Leases {
        Leases {
            lease,
            live: HashMap::new(),
            expired: HashMap::new(),
            history: lease * 10,
            counts: LeaseCounts::default(),
        }
    }

    /// Counts so far.
    pub fn counts(&self) -> LeaseCounts {
        self.counts
    }

    /// Requests whose lease has not run out at `now`.
    pub fn live(&self, now: Instant) -> usize {
        self.live.values().filter(|&&t| t > now).count()
    }

    /// `RQ:<id>`: the request's blocks are held until `now + lease`. A
    /// request scheduled again keeps the later expiry. Returns false (and
    /// holds nothing) when [`MAX_REQUESTS`] are already held.
    pub fn schedule(&mut self, id: &str, now: Instant) -> bool {
        if self.live.len() >= MAX_REQUESTS && !self.live.contains_key(id) {
            self.counts.refused += 1;
            return false;
        }
        self.counts.scheduled += 1;
        self.expired.remove(id);
        let until = now + self.lease;
        let t = self.live.entry(id.to_string()).or_insert(until);
        *t = (*t).max(until);
        true
    }

    /// `HB:<ids>`: each live id's expiry becomes `max(old, now + 2/3
    /// lease)`; ids without a live lease are ignored. Returns the ids
    /// extended.
    pub fn heartbeat<'a>(
        &mut self,
        ids: impl IntoIterator<Item = &'a str>,
        now: Instant,
    ) -> Vec<&'a str> {
        let until = now + self.lease * 2 / 3;
        let mut extended = Vec::new();
        for id in ids {
            // Held until swept, as in vLLM (see the module docs).
            match self.live.get_mut(id) {
                Some(t) => {
                    *t = (*t).max(until);
                    extended.push(id);
                }
                None => self.counts.ignored += 1,
            }
        }
        self.counts.extended += extended.len() as u64;
        extended
    }

    /// `RD:<id>`: the request's read completed. Frees its blocks. A
    /// request whose lease ran out but that no sweep has freed yet still
    /// holds its blocks: in time (see the module docs).
    pub fn read_done(&mut self, id: &str, now: Instant) -> ReadDone {
        let _ = now;
        if self.live.remove(id).is_some() {
            self.counts.completed += 1;
            return ReadDone::InTime;
        }
        if let Some(t) = self.expired.remove(id) {
            self.counts.late_reads += 1;
            return ReadDone::AfterExpiry {
                expired_for: now.saturating_duration_since(t),
            };
        }
        self.counts.unknown_reads += 1;
        ReadDone::Unknown
    }

    /// Frees the blocks of every request whose lease ran out by `now`;
    /// returns them with how long ago each ran out.
    pub fn expire(&mut self, now: Instant) -> Vec<(String, Duration)> {
        let mut gone = Vec::new();
        self.live.retain(|id, t| {
            if *t > now {
                return true;
            }
            gone.push((id.clone(), now - *t));
            false
        });
        for (id, ago) in &gone {
            // Past the bound a late completion counts as unknown instead.
            if self.expired.len() < MAX_REQUESTS {
                self.expired.insert(id.clone(), now - *ago);
            }
        }
        self.counts.expired += gone.len() as u64;
        let history = self.history;
        self.expired
            .retain(|_, t| now.saturating_duration_since(*t) < history);
        gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(30);

    #[test]
    fn a_read_within_the_lease_frees_the_request() {
        let t0 = Instant::now();
        let mut l = Leases::new(LEASE);
        l.schedule("a", t0);
        assert_eq!(l.live(t0), 1);
        assert_eq!(
            l.read_done("a", t0 + Duration::from_secs(29)),
            ReadDone::InTime
        );
        assert_eq!(l.live(t0), 0);
        // Completed: a second completion, or a heartbeat, no longer knows it.
        assert_eq!(
            l.read_done("a", t0 + Duration::from_secs(29)),
            ReadDone::Unknown
        );
        assert!(l.heartbeat(["a"], t0 + Duration::from_secs(29)).is_empty());
        assert!(l.expire(t0 + Duration::from_secs(100)).is_empty());
        let c = l.counts();
        assert_eq!(
            (c.completed, c.unknown_reads, c.ignored, c.expired),
            (1, 1, 1, 0)
        );
    }

    #[test]
    fn a_heartbeat_extends_to_two_thirds_of_a_lease_never_shortens_and_ignores_unknown_ids() {
        let t0 = Instant::now();
        let mut l = Leases::new(LEASE);
        l.schedule("a", t0);
        // At t0+1s: now + 20s < t0 + 30s: the expiry stays t0 + 30s.
        let ext = l.heartbeat(["a", "nobody", ""], t0 + Duration::from_secs(1));
        assert_eq!(ext, ["a"]);
        assert_eq!(l.counts().ignored, 2);
        assert!(
            l.expire(t0 + Duration::from_secs(30)).len() == 1,
            "not shortened, not lengthened"
        );
        let mut l = Leases::new(LEASE);
        l.schedule("a", t0);
        l.heartbeat(["a"], t0 + Duration::from_secs(25));
        // Extended to t0 + 25s + 20s = t0 + 45s.
        assert!(l.expire(t0 + Duration::from_secs(44)).is_empty());
        let gone = l.expire(t0 + Duration::from_secs(46));
        assert_eq!(gone, vec![("a".to_string(), Duration::from_secs(1))]);
    }

    #[test]
    fn what_arrives_before_the_sweep_still_finds_its_request_and_a_read_after_it_is_caught() {
        let t0 = Instant::now();
        let mut l = Leases::new(LEASE);
        l.schedule("swept", t0);
        l.schedule("unswept", t0);
        l.schedule("renewed", t0);
        // Past the expiry, before any sweep (a prefill frozen meanwhile
        // handles what arrived first): the request still holds its blocks,
        // and a heartbeat still renews it, as in vLLM.
        assert_eq!(
            l.read_done("unswept", t0 + Duration::from_secs(31)),
            ReadDone::InTime
        );
        assert_eq!(
            l.heartbeat(["renewed"], t0 + Duration::from_secs(31)),
            ["renewed"]
        );
        // The sweep frees what ran out and was not renewed.
        let gone = l.expire(t0 + Duration::from_secs(32));
        assert_eq!(gone, vec![("swept".to_string(), Duration::from_secs(2))]);
        assert_eq!(
            l.read_done("swept", t0 + Duration::from_secs(35)),
            ReadDone::AfterExpiry {
                expired_for: Duration::from_secs(5)
            }
        );
        let c = l.counts();
        assert_eq!((c.late_reads, c.expired, c.completed), (1, 1, 1));
    }

    #[test]
    fn a_peer_scheduling_without_end_is_capped() {
        let t0 = Instant::now();
        let mut l = Leases::new(LEASE);
        for i in 0..MAX_REQUESTS {
            assert!(l.schedule(&i.to_string(), t0));
        }
        assert!(!l.schedule("one-more", t0), "over the cap");
        assert!(
            l.schedule("0", t0),
            "rescheduling a held request is no growth"
        );
        assert_eq!(l.counts().refused, 1);
        assert_eq!(l.live(t0), MAX_REQUESTS);
        // Expired, they are remembered up to the same bound, then freed.
        assert_eq!(l.expire(t0 + LEASE).len(), MAX_REQUESTS);
        assert!(l.schedule("after", t0 + LEASE));
        assert!(l.expired.len() <= MAX_REQUESTS);
    }

    #[test]
    fn expired_records_are_bounded_and_a_lease_at_its_exact_end_is_gone() {
        let t0 = Instant::now();
        let mut l = Leases::new(LEASE);
        l.schedule("edge", t0);
        // At exactly now + lease the blocks are freed.
        assert_eq!(l.live(t0 + LEASE), 0);
        assert_eq!(l.expire(t0 + LEASE).len(), 1);
        l.expire(t0 + LEASE * 20);
        assert!(l.expired.is_empty(), "history kept past its bound");
        assert_eq!(l.read_done("edge", t0 + LEASE * 20), ReadDone::Unknown);
    }
}

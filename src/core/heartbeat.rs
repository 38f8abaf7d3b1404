//! Heartbeats and leases: every live registration gets a round per
//! interval (+/- jitter, in [`super::HEARTBEAT_SLOT`] slots of the
//! [`super::schedule::Schedule`]), never two rounds at once, at most the
//! rate cap ([`super::rate::RateCap`]); lease renewals the runtime asks for
//! share the cap. A round's text is vLLM's `HB:` with the registration's
//! pending request ids, split to stay small.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::Rng;
use std::time::Instant;

use super::count::Summed;
use super::key::PeerKey;
use super::rate::{RateCap, RateState};
use super::schedule::{self, Schedule};
use super::{Call, Count, HeartbeatMessages};
use crate::config::Config;
use crate::names::AgentName;
use nixl_status::NixlStatus;

/// The most bytes of one `HB:` notification. A round whose request ids do
/// not fit in one is split over several (see [`heartbeat_messages`]): each
/// notification stays one small message whatever the number of requests
/// pending (10,000 pending ids once made one notification of 400 KB).
/// With ids of at most [`crate::lease::MAX_REQUEST_ID`] bytes, each
/// notification carries at least 31 of them.
pub const MAX_HEARTBEAT_BYTES: usize = 8 * 1024;

/// vLLM's lease-renewal text for `requests`, split to fit: each
/// notification is `HB:` and comma-separated request ids, at most
/// [`MAX_HEARTBEAT_BYTES`] long; the ids go in order, each whole and in
/// exactly one notification; no ids is one `HB:` (nothing after the
/// colon). vLLM's prefill extends each id an `HB:` names and ignores
/// unknown ones, so several notifications renew exactly what one would:
/// every one of them is a valid `HB:` on its own. The rate cap counts the
/// round, not its notifications.
///
/// Request ids are checked where they enter
/// ([`crate::KeepaliveHandle::add_leases`]: at most
/// [`crate::lease::MAX_REQUEST_ID`] bytes, no `,`): an id that could not
/// fit even alone is not sent.
pub fn heartbeat_messages<'a>(requests: impl IntoIterator<Item = &'a String>) -> Vec<Vec<u8>> {
    const PREFIX: &[u8] = b"HB:";
    let mut messages = Vec::new();
    let mut message = PREFIX.to_vec();
    for r in requests {
        let id = r.as_bytes();
        if PREFIX.len() + id.len() > MAX_HEARTBEAT_BYTES {
            continue;
        }
        let comma = usize::from(message.len() > PREFIX.len());
        if message.len() + comma + id.len() > MAX_HEARTBEAT_BYTES {
            messages.push(std::mem::replace(&mut message, PREFIX.to_vec()));
        }
        if message.len() > PREFIX.len() {
            message.push(b',');
        }
        message.extend_from_slice(id);
    }
    if messages.is_empty() || message.len() > PREFIX.len() {
        messages.push(message);
    }
    messages
}

/// One round's notifications, shared: [`HeartbeatMessages::Idle`] when no
/// request is pending.
pub(super) fn heartbeat_round(requests: &BTreeSet<String>) -> HeartbeatMessages {
    if requests.is_empty() {
        return HeartbeatMessages::Idle;
    }
    HeartbeatMessages::Leases(
        heartbeat_messages(requests)
            .into_iter()
            .map(Vec::into_boxed_slice)
            .collect(),
    )
}

/// How a round's deadline may be served (see [`super::HEARTBEAT_SLOT`]).
#[derive(Clone, Copy, Debug)]
pub(super) enum Deadline {
    /// Within half a slot either side: a jittered round, whose exact time
    /// nothing depends on.
    Near,
    /// Not before it: a round the rate cap deferred (it would only be
    /// deferred again), or one put off because the last is still out.
    NotBefore,
}

/// What the heartbeat rule decides on: when each registration's next
/// round is due (the slot [`Schedule`]), whether the rate cap lets one go
/// ([`RateCap`]), the randomness its jitter and first offsets are drawn
/// from, and the per-round counts summed for the metrics. Its own so that
/// nothing but a heartbeat moves a registration in the schedule or draws
/// from the generator (a seed then reproduces every round).
pub(super) struct Heartbeats {
    schedule: Schedule<PeerKey>,
    rate: RateCap,
    rng: StdRng,
    summed: Summed,
    /// The config's interval (`None`: no periodic rounds) and jitter.
    interval: Option<Duration>,
    jitter: Duration,
}

impl Heartbeats {
    /// The heartbeats of `config`, their clock starting at `now`, drawing
    /// from `rng`.
    pub(super) fn new(config: &Config, now: Instant, rng: StdRng) -> Self {
        Heartbeats {
            schedule: Schedule::new(now, schedule::slot_for(config.heartbeat_interval)),
            rate: RateCap::new(config, now),
            rng,
            summed: Summed::default(),
            interval: config.heartbeat_interval,
            jitter: config.jitter,
        }
    }

    /// The earliest slot with a round in it.
    pub(super) fn next(&self) -> Option<Instant> {
        self.schedule.next()
    }

    /// The earliest slot due at `now`, with the records whose rounds it
    /// holds (each checked by the caller against its own `next_heartbeat`:
    /// a key moved since is stale). Hand the vector back with
    /// [`Heartbeats::recycle`].
    pub(super) fn pop_due(&mut self, now: Instant) -> Option<(Instant, Vec<PeerKey>)> {
        self.schedule.pop_due(now)
    }

    /// A slot's vector, served: kept for the next slot's keys.
    pub(super) fn recycle(&mut self, keys: Vec<PeerKey>) {
        self.schedule.recycle(keys);
    }

    /// The rounds scheduled.
    pub(super) fn scheduled(&self) -> usize {
        self.schedule.len()
    }

    /// The next summed count to hand out, if any is pending.
    pub(super) fn take_count(&mut self) -> Option<Count> {
        self.summed.take()
    }

    /// Whether the rate cap lets a round of the registration whose limiter
    /// is `state` go at `now`; if not, how long until it would (and the
    /// deferral is counted).
    fn admit(&mut self, state: &mut RateState, now: Instant) -> Result<(), Duration> {
        self.rate.check(state, now).inspect_err(|_| {
            self.summed.heartbeats_deferred += 1;
        })
    }

    /// A round came back with `sent` notifications accepted.
    pub(super) fn sent(&mut self, sent: usize) {
        self.summed.heartbeats_sent += sent as u64;
    }

    /// When, within one `interval`, a new registration's first round is
    /// due: spread, so that engines registered together do not all beat
    /// together.
    fn first_offset(&mut self, interval: Duration) -> Duration {
        interval.mul_f64(self.rng.random::<f64>())
    }

    /// The gap to the next round: uniform over `interval` +/- `jitter`, in
    /// whole nanoseconds (floating point here was a measurable share of a
    /// round).
    fn gap(&mut self, interval: Duration, jitter: Duration) -> Duration {
        if jitter.is_zero() {
            return interval;
        }
        let span = u64::try_from(jitter.as_nanos() * 2).unwrap_or(u64::MAX);
        (interval + Duration::from_nanos(self.rng.random_range(0..=span))).saturating_sub(jitter)
    }

    /// Puts the record at `key` in the slot for `at`, out of the slot
    /// `from` it was in; returns the new slot.
    fn place(
        &mut self,
        key: PeerKey,
        from: Option<Instant>,
        at: Instant,
        deadline: Deadline,
    ) -> Instant {
        if let Some(slot) = from {
            self.schedule.remove(key, slot);
        }
        match deadline {
            Deadline::Near => self.schedule.insert_near(key, at),
            Deadline::NotBefore => self.schedule.insert(key, at),
        }
    }

    /// Takes the record at `key` out of its `slot`.
    fn unplace(&mut self, key: PeerKey, slot: Instant) {
        self.schedule.remove(key, slot);
    }
}

/// The KV leases a registration's heartbeats name, and the round built for
/// them. Most engines never have one (their round is the static `HB:`), so
/// the set lives behind one pointer: a record without leases pays 8 bytes
/// for it, not the 48 of a set and a cached round.
#[derive(Default)]
pub(super) struct Leases(Option<Box<LeaseSet>>);

struct LeaseSet {
    requests: BTreeSet<String>,
    /// The round for `requests`, built at the first round after they
    /// change (`None` until then).
    round: Option<HeartbeatMessages>,
}

impl Leases {
    /// Adds request ids; the next round names them.
    fn extend(&mut self, requests: Vec<String>) {
        if requests.is_empty() {
            return;
        }
        let set = self.0.get_or_insert_with(|| {
            Box::new(LeaseSet {
                requests: BTreeSet::new(),
                round: None,
            })
        });
        set.requests.extend(requests);
        set.round = None;
    }

    /// Removes request ids; the next round no longer names them.
    fn remove(&mut self, requests: &[String]) {
        let Some(set) = self.0.as_mut() else {
            return;
        };
        for r in requests {
            if set.requests.remove(r) {
                set.round = None;
            }
        }
        if set.requests.is_empty() {
            self.0 = None;
        }
    }

    /// Drops every lease (the registration is going).
    fn clear(&mut self) {
        self.0 = None;
    }

    /// The request ids, in order.
    fn iter(&self) -> impl Iterator<Item = &String> + '_ {
        self.0.iter().flat_map(|set| set.requests.iter())
    }

    /// The heartbeat round for these leases: `HB:` alone without any, else
    /// built once per change and shared by the rounds until the next.
    fn round(&mut self) -> HeartbeatMessages {
        let Some(set) = self.0.as_mut() else {
            return HeartbeatMessages::Idle;
        };
        set.round
            .get_or_insert_with(|| heartbeat_round(&set.requests))
            .clone()
    }
}

/// A registration's part of the heartbeat rule, kept in its record so that
/// a round touches one record (the locality measured at 10k engines): its
/// slot in the schedule, whether a round is out, a renewal wanted, the
/// last round's outcome, its leases, the agents' second reference a round
/// carries, and its limiter state. Its fields are this rule's alone: the
/// flow (`flow.rs`) asks [`Heartbeats`] for each decision about it.
#[derive(Default)]
pub(super) struct Beat {
    /// The schedule slot of the next round, if one is scheduled: the token
    /// that finds it in the [`Schedule`].
    next: Option<Instant>,
    in_flight: bool,
    /// A lease renewal was asked for and has not gone out yet.
    renewal_wanted: bool,
    last: Option<(Instant, NixlStatus)>,
    leases: Leases,
    /// A second reference to the registration's agents that a round takes
    /// with it and gives back with its outcome (`None` while a round is
    /// out): a round costs no reference count. Cloning the agents for each
    /// round was an atomic increment on a line the pool's threads had just
    /// written (their drop), a tenth of the driver's time at 10k engines.
    round_agents: Option<Arc<[AgentName]>>,
    /// The rate cap's state for this registration (its limiter key).
    rate: RateState,
}

impl Beat {
    /// When the last round came back, and its status.
    pub(super) fn last(&self) -> Option<(Instant, NixlStatus)> {
        self.last
    }

    /// The slot of the next round, if one is scheduled.
    pub(super) fn next(&self) -> Option<Instant> {
        self.next
    }

    /// The lease request ids the rounds name, in order.
    pub(super) fn leases(&self) -> impl Iterator<Item = &String> + '_ {
        self.leases.iter()
    }

    /// Whether the registration holds a limiter key.
    pub(super) fn has_limiter(&self) -> bool {
        self.rate.is_some()
    }

    /// Whether a renewal waits for the round out to come back.
    pub(super) fn wants_renewal(&self) -> bool {
        self.renewal_wanted
    }

    /// Adds lease request ids; the next round names them.
    pub(super) fn add_leases(&mut self, requests: Vec<String>) {
        self.leases.extend(requests);
    }

    /// Removes lease request ids.
    pub(super) fn remove_leases(&mut self, requests: &[String]) {
        self.leases.remove(requests);
    }

    /// Whether the round in `slot` is this registration's (a key moved
    /// since is stale): if so, it is taken out of the record.
    pub(super) fn take_due(&mut self, slot: Instant) -> bool {
        let due = self.next == Some(slot);
        if due {
            self.next = None;
        }
        due
    }

    /// Forgets the limiter key (the registration is released).
    pub(super) fn forget_limiter(&mut self) {
        self.rate.forget();
    }

    /// The fields a round reads at its send and at its result, which the
    /// compiler spreads over the record's lines (see
    /// [`super::peer::PeerTable::warm`]).
    #[inline]
    pub(super) fn touch(&self) -> impl Copy {
        (
            self.next,
            self.in_flight,
            self.round_agents.is_some(),
            self.rate.is_some(),
            self.last.is_some(),
        )
    }
}

/// What a renewal the runtime asked for became.
pub(super) enum Renewal<R> {
    /// A round now.
    Send(Call<R>),
    /// A round is out: it goes as soon as that one is back, which the
    /// driver hands over at once.
    Expedite,
    /// A round is out and a renewal already waits for it; or the rate cap
    /// put the round off to when it allows one.
    Waiting,
}

impl Heartbeats {
    /// The round of the record at `key` in the slot due at `due` (`now`
    /// being later, the schedule runs from the deadline so that serving
    /// delays never add up): a call, unless a round is still out (tried
    /// again one interval on: rounds never stack on one engine) or the
    /// rate cap defers it.
    pub(super) fn due<R>(
        &mut self,
        beat: &mut Beat,
        key: PeerKey,
        now: Instant,
        due: Instant,
        agents: &Arc<[AgentName]>,
    ) -> Option<Call<R>> {
        let due = due.min(now);
        if beat.in_flight {
            if let Some(interval) = self.interval {
                self.schedule(beat, key, now + interval, Deadline::NotBefore);
            }
            return None;
        }
        match self.admit(&mut beat.rate, now) {
            Ok(()) => Some(self.send(beat, key, due, agents)),
            Err(wait) => {
                self.schedule(beat, key, now + wait, Deadline::NotBefore);
                None
            }
        }
    }

    /// A renewal of the record at `key` the runtime asked for at `now`.
    pub(super) fn renew<R>(
        &mut self,
        beat: &mut Beat,
        key: PeerKey,
        now: Instant,
        agents: &Arc<[AgentName]>,
    ) -> Renewal<R> {
        if beat.in_flight {
            if beat.renewal_wanted {
                return Renewal::Waiting;
            }
            beat.renewal_wanted = true;
            return Renewal::Expedite;
        }
        match self.admit(&mut beat.rate, now) {
            Ok(()) => Renewal::Send(self.send(beat, key, now, agents)),
            Err(wait) => {
                beat.renewal_wanted = true;
                let at = now + wait;
                if beat.next.is_none_or(|next| at < next) {
                    self.schedule(beat, key, at, Deadline::NotBefore);
                }
                Renewal::Waiting
            }
        }
    }

    /// A round now; the next is due one interval (+/- jitter) after
    /// `base`: the deadline this round was due at, or now for a renewal.
    fn send<R>(
        &mut self,
        beat: &mut Beat,
        key: PeerKey,
        base: Instant,
        agents: &Arc<[AgentName]>,
    ) -> Call<R> {
        beat.in_flight = true;
        beat.renewal_wanted = false;
        let messages = beat.leases.round();
        let agents = beat.round_agents.take().unwrap_or_else(|| agents.clone());
        match self.interval {
            Some(interval) => {
                let next = self.gap(interval, self.jitter);
                self.schedule(beat, key, base + next, Deadline::Near);
            }
            None => self.unschedule(beat, key),
        }
        Call::Heartbeat {
            key,
            agents,
            messages,
        }
    }

    /// A round came back at `now`: `sent` notifications accepted, `status`
    /// the one that speaks for the round, the agents' reference returned.
    pub(super) fn round_back(
        &mut self,
        beat: &mut Beat,
        now: Instant,
        sent: usize,
        agents: Arc<[AgentName]>,
        status: NixlStatus,
    ) {
        self.sent(sent);
        beat.in_flight = false;
        beat.round_agents = Some(agents);
        beat.last = Some((now, status));
    }

    /// A new registration's first round, spread within one interval:
    /// engines registered together must not all beat together.
    pub(super) fn first(&mut self, beat: &mut Beat, key: PeerKey, now: Instant) {
        if let Some(interval) = self.interval {
            let offset = self.first_offset(interval);
            self.schedule(beat, key, now + offset, Deadline::Near);
        }
    }

    /// Puts the record at `key` in the slot for `at` (out of the one it
    /// was in).
    fn schedule(&mut self, beat: &mut Beat, key: PeerKey, at: Instant, deadline: Deadline) {
        let from = beat.next.take();
        beat.next = Some(self.place(key, from, at, deadline));
    }

    /// No more rounds for the record at `key` (it was marked): out of the
    /// schedule, its leases dropped.
    pub(super) fn stop(&mut self, beat: &mut Beat, key: PeerKey) {
        beat.leases.clear();
        self.unschedule(beat, key);
    }

    /// The record at `key` out of the schedule.
    fn unschedule(&mut self, beat: &mut Beat, key: PeerKey) {
        if let Some(slot) = beat.next.take() {
            self.unplace(key, slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Deadline, HeartbeatMessages, Heartbeats, Leases};
    use crate::config::Config;
    use crate::core::key::PeerKey;
    use crate::core::rate::RateState;
    use crate::core::Count;
    use crate::registration::RegistrationId;
    use rand::SeedableRng;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    fn heartbeats(config: &Config, now: Instant) -> Heartbeats {
        Heartbeats::new(config, now, rand::rngs::StdRng::seed_from_u64(7))
    }

    #[test]
    fn a_deferred_round_is_counted_and_says_how_long_to_wait() {
        let now = Instant::now();
        let config = Config::builder()
            .rate_limit(Duration::from_secs(1), 1)
            .build()
            .expect("valid");
        let mut hb = heartbeats(&config, now);
        let mut state = RateState::default();
        assert_eq!(hb.admit(&mut state, now), Ok(()));
        let wait = hb.admit(&mut state, now).expect_err("over the cap");
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_secs(1),
            "{wait:?}"
        );
        assert_eq!(
            hb.admit(&mut state, now + wait),
            Ok(()),
            "allowed after the wait"
        );
        hb.sent(3);
        assert_eq!(hb.take_count(), Some(Count::HeartbeatsSent(3)));
        assert_eq!(hb.take_count(), Some(Count::HeartbeatsDeferred(1)));
        assert_eq!(hb.take_count(), None, "each sum handed out once");
    }

    #[test]
    fn gaps_stay_within_the_jitter_and_first_rounds_within_one_interval() {
        let now = Instant::now();
        let mut hb = heartbeats(&Config::default(), now);
        let interval = Duration::from_secs(5);
        let jitter = Duration::from_millis(500);
        assert_eq!(
            hb.gap(interval, Duration::ZERO),
            interval,
            "no jitter: exact"
        );
        let gaps: Vec<Duration> = (0..200).map(|_| hb.gap(interval, jitter)).collect();
        assert!(gaps
            .iter()
            .all(|&g| g >= interval - jitter && g <= interval + jitter));
        assert!(gaps.iter().any(|&g| g != gaps[0]), "the jitter varies");
        let offsets: Vec<Duration> = (0..200).map(|_| hb.first_offset(interval)).collect();
        assert!(offsets.iter().all(|&o| o < interval));
        assert!(
            offsets.iter().any(|&o| o > interval / 2),
            "spread over the interval"
        );
    }

    #[test]
    fn a_placed_round_moves_out_of_its_old_slot() {
        let now = Instant::now();
        let mut hb = heartbeats(&Config::default(), now);
        let key = PeerKey::detached(RegistrationId(1));
        let first = hb.place(key, None, now + Duration::from_secs(1), Deadline::NotBefore);
        let second = hb.place(
            key,
            Some(first),
            now + Duration::from_secs(2),
            Deadline::Near,
        );
        assert_eq!(hb.scheduled(), 1, "one round per record");
        assert_eq!(hb.next(), Some(second));
        assert!(hb.pop_due(now + Duration::from_millis(1500)).is_none());
        let (slot, keys) = hb.pop_due(second).expect("due");
        assert_eq!((slot, keys), (second, vec![key]));
        let third = hb.place(key, None, now + Duration::from_secs(3), Deadline::Near);
        hb.unplace(key, third);
        assert_eq!((hb.scheduled(), hb.next()), (0, None));
    }

    fn texts(round: &HeartbeatMessages) -> Vec<String> {
        round
            .iter()
            .map(|m| String::from_utf8(m.to_vec()).unwrap())
            .collect()
    }

    fn ids(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    /// The set is allocated with the first lease and dropped with the
    /// last; the round is built once per change and shared until the next;
    /// removing what is not there, or adding nothing, changes nothing.
    #[test]
    fn leases_live_behind_one_pointer_only_while_there_are_some() {
        let mut leases = Leases::default();
        assert!(matches!(leases.round(), HeartbeatMessages::Idle));
        leases.extend(vec![]);
        assert!(leases.0.is_none(), "adding nothing allocates nothing");
        leases.remove(&ids(&["r9"]));
        assert!(leases.0.is_none());

        leases.extend(ids(&["r2", "r1"]));
        let first = leases.round();
        assert_eq!(texts(&first), ["HB:r1,r2"]);
        match (&first, &leases.round()) {
            (HeartbeatMessages::Leases(a), HeartbeatMessages::Leases(b)) => {
                assert!(Arc::ptr_eq(a, b), "built once, shared until a change")
            }
            other => panic!("{other:?}"),
        }
        leases.remove(&ids(&["r9"]));
        assert!(
            matches!((&first, &leases.round()), (HeartbeatMessages::Leases(a), HeartbeatMessages::Leases(b)) if Arc::ptr_eq(a, b)),
            "removing an unknown id keeps the round"
        );
        leases.remove(&ids(&["r1"]));
        assert_eq!(texts(&leases.round()), ["HB:r2"]);
        assert_eq!(leases.iter().collect::<Vec<_>>(), ["r2"]);
        leases.remove(&ids(&["r2"]));
        assert!(leases.0.is_none(), "the last lease gone, the set is freed");
        assert!(matches!(leases.round(), HeartbeatMessages::Idle));

        leases.extend(ids(&["r3"]));
        leases.clear();
        assert!(leases.0.is_none() && leases.iter().next().is_none());
    }
}

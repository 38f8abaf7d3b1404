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
use super::directory::Holder;
use super::key::PeerKey;
use super::rate::{RateCap, RateState};
use super::schedule::{self, Schedule};
use super::{Action, Call, Core, Count, HeartbeatMessages, RoundResults};
use crate::config::Config;
use crate::event::{Event, Source};
use crate::registration::RegistrationId;
use crate::transport::{AgentName, EngineId, Suspicion};
use nixl_agent::NixlStatus;

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
    pub(super) fn admit(&mut self, state: &mut RateState, now: Instant) -> Result<(), Duration> {
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
    pub(super) fn first_offset(&mut self, interval: Duration) -> Duration {
        interval.mul_f64(self.rng.random::<f64>())
    }

    /// The gap to the next round: uniform over `interval` +/- `jitter`, in
    /// whole nanoseconds (floating point here was a measurable share of a
    /// round).
    pub(super) fn gap(&mut self, interval: Duration, jitter: Duration) -> Duration {
        if jitter.is_zero() {
            return interval;
        }
        let span = u64::try_from(jitter.as_nanos() * 2).unwrap_or(u64::MAX);
        (interval + Duration::from_nanos(self.rng.random_range(0..=span))).saturating_sub(jitter)
    }

    /// Puts the record at `key` in the slot for `at`, out of the slot
    /// `from` it was in; returns the new slot.
    pub(super) fn place(
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
    pub(super) fn unplace(&mut self, key: PeerKey, slot: Instant) {
        self.schedule.remove(key, slot);
    }
}

impl<R> Core<R> {
    pub(super) fn live_serial(&self, id: &EngineId) -> Option<RegistrationId> {
        let serial = self.directory.serial_of(id)?;
        self.peers
            .get(&serial)
            .filter(|p| p.is_live())
            .map(|_| serial)
    }

    pub(super) fn add_leases(
        &mut self,
        now: Instant,
        id: &EngineId,
        requests: Vec<String>,
        renew_now: bool,
    ) {
        let Some(serial) = self.live_serial(id) else {
            tracing::debug!(engine = %id, "lease for an engine that is not live: ignored");
            return;
        };
        let peer = self.peers.get_mut(&serial).expect("live serial");
        peer.leases.extend(requests);
        if renew_now {
            self.renew(now, serial);
        }
    }

    pub(super) fn remove_leases(&mut self, id: &EngineId, requests: &[String]) {
        if let Some(peer) = (self.directory.serial_of(id)).and_then(|s| self.peers.get_mut(&s)) {
            peer.leases.remove(requests);
        }
    }

    /// The transport saw a connection fail: the engine holding its agent
    /// gets a round now (under its rate cap), whose REMOTE_DISCONNECT, if
    /// any, marks it by the usual rules. Nothing is marked here: a live
    /// peer's false alarm costs one round. A failure the transport could
    /// not name checks every live engine.
    pub(super) fn suspect(&mut self, now: Instant, suspicion: Suspicion) {
        let status = suspicion.ucs_status.map(|s| s.name());
        let Some(agent) = suspicion.agent else {
            self.count(Count::EndpointFailure("unnamed"));
            let live: Vec<RegistrationId> = self
                .peers
                .keys()
                .copied()
                .filter(|s| self.peers.get(s).is_some_and(|p| p.is_live()))
                .collect();
            tracing::debug!(ucs_status = ?status, engines = live.len(), "an endpoint failed, whose is not known: every live engine gets a heartbeat now");
            for serial in live {
                self.renew(now, serial);
            }
            return;
        };
        let serial = match self.directory.holder(&agent) {
            Some(Holder::Registration(serial)) => serial,
            _ => {
                self.count(Count::EndpointFailure("not_held"));
                tracing::debug!(%agent, ucs_status = ?status, "an endpoint of an agent no engine holds failed: ignored");
                return;
            }
        };
        match self.peers.get(&serial) {
            Some(peer) if peer.is_live() => {
                tracing::debug!(engine = %peer.id(), %agent, ucs_status = ?status, "UCX failed an endpoint of the engine: heartbeat now");
                self.count(Count::EndpointFailure("probed"));
                self.renew(now, serial);
            }
            _ => self.count(Count::EndpointFailure("not_live")),
        }
    }

    pub(super) fn heartbeat_due(&mut self, now: Instant, key: PeerKey, due: Instant) {
        let Some(peer) = self.peers.at_mut(key) else {
            return;
        };
        if !peer.is_live() {
            return;
        }
        // The schedule runs from the deadline, not from when the timer was
        // served, so serving delays (and the slot rounding) never add up.
        let due = due.min(now);
        if peer.heartbeat_in_flight {
            // The previous round has not come back (a slow or hung call):
            // never stack rounds on one engine. Try again next period.
            if let Some(interval) = self.config.heartbeat_interval {
                self.schedule_at(key, now + interval, Deadline::NotBefore);
            }
            return;
        }
        match self.heartbeats.admit(&mut peer.rate, now) {
            Ok(()) => self.send_at(due, key),
            Err(wait) => {
                self.schedule_at(key, now + wait, Deadline::NotBefore);
            }
        }
    }

    pub(super) fn renew(&mut self, now: Instant, serial: RegistrationId) {
        let peer = self.peers.get_mut(&serial).expect("live serial");
        if peer.heartbeat_in_flight {
            if !peer.renewal_wanted {
                peer.renewal_wanted = true;
                self.actions.push_back(Action::Expedite { serial });
            }
            return;
        }
        match self.heartbeats.admit(&mut peer.rate, now) {
            Ok(()) => self.send_heartbeat(now, serial),
            Err(wait) => {
                let peer = self.peers.get_mut(&serial).expect("live serial");
                peer.renewal_wanted = true;
                let at = now + wait;
                if peer.next_heartbeat.is_none_or(|next| at < next) {
                    self.schedule_heartbeat(serial, at, Deadline::NotBefore);
                }
            }
        }
    }

    /// Sends a round now; the next is due one interval (+/- jitter) after
    /// `base`: the deadline this round was due at, or now for a renewal.
    pub(super) fn send_heartbeat(&mut self, base: Instant, serial: RegistrationId) {
        let key = self.peers.key(serial).expect("live serial");
        self.send_at(base, key);
    }

    /// [`Core::send_heartbeat`] for the record at `key`.
    fn send_at(&mut self, base: Instant, key: PeerKey) {
        let peer = self.peers.at_mut(key).expect("live serial");
        peer.heartbeat_in_flight = true;
        peer.renewal_wanted = false;
        let messages = peer.leases.round();
        let agents = peer
            .round_agents
            .take()
            .unwrap_or_else(|| peer.agents.clone());
        self.calls.push(Call::Heartbeat {
            key,
            agents,
            messages,
        });
        match self.config.heartbeat_interval {
            Some(interval) => {
                let next = self.heartbeats.gap(interval, self.config.jitter);
                self.schedule_at(key, base + next, Deadline::Near);
            }
            None => self.unschedule_at(key),
        }
    }

    pub(super) fn heartbeat_done(
        &mut self,
        now: Instant,
        key: PeerKey,
        results: RoundResults,
        agents: Arc<[AgentName]>,
    ) {
        let serial = key.serial;
        let RoundResults {
            sent,
            failed,
            panicked,
        } = results;
        self.heartbeats.sent(sent);
        let Some(peer) = self.peers.at_mut(key) else {
            return;
        };
        peer.heartbeat_in_flight = false;
        peer.round_agents = Some(agents);
        let status = failed
            .iter()
            .map(|(_, e)| e.status)
            .find(|s| s.is_remote_disconnect())
            .or(failed.first().map(|(_, e)| e.status))
            .unwrap_or(NixlStatus::SUCCESS);
        peer.last_heartbeat = Some((now, status));
        // The engine id only where a panic is reported: cloning it for
        // every result was a shared reference count touched per heartbeat
        // (a cache miss at 10k engines).
        for (agent, p) in panicked {
            let engine = self.peers[&serial].id().clone();
            self.count(Count::TransportPanicked("genNotif"));
            tracing::error!(%engine, %agent, message = %p.message, "the transport panicked in genNotif: counted, engine kept");
            self.emit(Event::TransportPanicked {
                engine,
                registration: serial,
                call: "genNotif",
                message: p.message,
            });
        }
        for (agent, e) in &failed {
            self.on_status(now, serial, Source::Heartbeat, Some(agent), e.status);
        }
        let peer = self.peers.at_mut(key).expect("still here");
        if peer.is_live() && peer.renewal_wanted {
            self.renew(now, serial);
        }
    }

    pub(super) fn schedule_heartbeat(
        &mut self,
        serial: RegistrationId,
        at: Instant,
        deadline: Deadline,
    ) {
        if let Some(key) = self.peers.key(serial) {
            self.schedule_at(key, at, deadline);
        }
    }

    /// Puts the record at `key` in the schedule's slot for `at` (out of
    /// the one it was in).
    fn schedule_at(&mut self, key: PeerKey, at: Instant, deadline: Deadline) {
        let Some(peer) = self.peers.at_mut(key) else {
            return;
        };
        let from = peer.next_heartbeat.take();
        peer.next_heartbeat = Some(self.heartbeats.place(key, from, at, deadline));
    }

    pub(super) fn unschedule_heartbeat(&mut self, serial: RegistrationId) {
        if let Some(key) = self.peers.key(serial) {
            self.unschedule_at(key);
        }
    }

    fn unschedule_at(&mut self, key: PeerKey) {
        if let Some(slot) = self.peers.at_mut(key).and_then(|p| p.next_heartbeat.take()) {
            self.heartbeats.unplace(key, slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Deadline, Heartbeats};
    use crate::config::Config;
    use crate::core::key::PeerKey;
    use crate::core::rate::RateState;
    use crate::core::Count;
    use crate::registration::RegistrationId;
    use rand::SeedableRng;
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
}

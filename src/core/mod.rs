//! The keepalive rules, closed in one synchronous state machine.
//!
//! Built the way quinn-proto and foca are: the core never reads a clock,
//! sleeps, spawns or calls NIXL. Every input carries `now`
//! ([`Core::handle`]); every decision comes out as an [`Action`]
//! ([`Core::poll_action`]), what the metrics count included
//! ([`Count`]): the core touches no metrics recorder and no token of the
//! runtime's handles, the driver does. The core owns its timers (the
//! heartbeat schedule, and one [`TimerTable`] for the gauges' period, the
//! stall checks and the shutdown deadline) and says when it next needs the
//! clock ([`Core::poll_timeout`], then
//! [`Core::handle_timeout`]). Randomness (the heartbeat jitter) is
//! injected. The tokio driver (`service`) only carries inputs in, sleeps to
//! the deadline, and carries actions out; it imports the core, never the
//! other way round, and so does the offload queue. The core's clock is
//! plain `std::time::Instant` values the driver hands in (tokio's clock,
//! converted: paused in tests, so virtual time reaches the core as it
//! is); the core never reads a clock and does not depend on tokio
//! (`tests/layout.rs` checks it). It reads each registration's reads
//! through [`ReadAccounting`] (`R` is what a registration hands the
//! transport, `A` its accounting): the driver's is the lock-free cell,
//! the core's tests use a plain one.
//!
//! Every flow is in `flow.rs`; each rule's state and decisions are in the
//! rule's own file (see `flow.rs` for the map).
//!
//! # The rules
//!
//! - Every engine gets a heartbeat round per interval (+/- jitter, rounded
//!   to [`HEARTBEAT_SLOT`]), never two rounds at once, at most the rate
//!   cap; lease renewals the runtime asks for share the cap.
//! - One classifier judges every status (`fate.rs`'s `classify`): REMOTE_DISCONNECT
//!   marks the engine unreachable and fails its reads; everything else is
//!   counted, never a release.
//! - A marked registration is released (one transport call) once no read
//!   is in flight and no handshake is pending at its address, and never
//!   before. A handshake that is loading the very engine id again does not
//!   hold it back: it is waiting for that release.
//! - An engine id is held by at most one registration. Loading it again
//!   ([`Input::Claim`]) marks the old one, whatever state it is in,
//!   and is answered once it is released. A registration of an id still
//!   held waits for the old one's release.
//! - A new engine id at a known address replaces the engine there.
//! - Agent names are unique over all registrations.
//! - Shutdown marks everything, activates nothing, refuses what waits,
//!   releases each engine as its reads end, and stops waiting at the drain
//!   deadline.

mod accounting;
mod calls;
mod claims;
mod count;
mod directory;
mod fate;
mod flow;
mod given_up;
mod heartbeat;
mod identity;
mod key;
mod peer;
mod rate;
mod report;
mod schedule;
mod stall;
#[cfg(test)]
mod tests;
mod timers;

use crate::registration::RegistrationId;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use rand::rngs::StdRng;
use std::time::Instant;

pub(crate) use calls::{Call, CallOutcome, HeartbeatMessages, Panicked, RoundResults};
pub(crate) use count::Count;
pub use heartbeat::{heartbeat_messages, MAX_HEARTBEAT_BYTES};
#[cfg(test)]
pub(crate) use key::PeerKey;
pub use schedule::HEARTBEAT_SLOT;
pub(crate) use stall::MAX_STALL_CHECK_PERIOD;
use stall::{stall_check_period, StallWatch};

use crate::config::Config;
use crate::error::{ClaimRefused, Conflict, RegisterError};
use crate::event::{Event, Source};
use crate::log_limit::LogLimiter;
use crate::names::{AgentName, EngineId, PeerAddr};
use crate::registration::{Claim, Departure, GoneMode, PeerRef, Registration};
use crate::snapshot::{EngineSnapshot, Snapshot};
pub(crate) use accounting::{ReadAccounting, Wake};
use directory::Directory;
use fate::Releases;
use given_up::GivenUpBook;
use heartbeat::Heartbeats;
use identity::ConflictLog;
use peer::PeerTable;
use timers::{Timer, TimerTable};

/// The core's maps: keyed by registration serials, ticket numbers and names
/// the runtime handed over, hashed with foldhash (SipHash was a tenth of the
/// service's CPU at 10k engines).
type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// A handshake, as the core knows it: unique per process (the default,
/// 0, is older than any).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct TicketId(pub(crate) u64);

/// A question the runtime waits on (a claim, a registration): the driver
/// keeps the reply channel under it until the core answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct RequestId(pub(crate) u64);

/// Everything that can happen to the core, besides time passing.
pub(crate) enum Input<R, A> {
    /// A handshake with `address` started: until it ends, the release of a
    /// marked engine there waits (the runtime may still be deciding whether
    /// the engine there is new). `declared`: the address is the peer's own
    /// word, not where the runtime reached it.
    HandshakeStarted {
        ticket: TicketId,
        address: PeerAddr,
        declared: bool,
    },
    /// The handshake `ticket` found `claim` at its address and wants to
    /// load it. Answered under `request` ([`Answer::Load`],
    /// [`Answer::Current`] or [`Answer::ClaimRefused`]), at once or once
    /// the engine id is free.
    Claim {
        ticket: TicketId,
        request: RequestId,
        claim: Claim,
    },
    /// The loading handshake `ticket` claims one more agent name.
    /// Answered with [`Answer::AgentClaimed`].
    ClaimAgent {
        ticket: TicketId,
        request: RequestId,
        agent: AgentName,
    },
    /// The handshake `ticket` ended without registering.
    HandshakeFinished { ticket: TicketId },
    /// A registration, through the handshake `ticket` whose claim was
    /// granted, or on its own. Answered with [`Answer::Registered`] or
    /// [`Answer::Refused`].
    Register {
        request: RequestId,
        ticket: Option<TicketId>,
        registration: Registration<R>,
        cell: Arc<A>,
    },
    /// A read handle's wake-up: a transfer's status, or a drained engine.
    Read(Wake),
    /// Lease request ids to renew with each heartbeat of an engine.
    AddLeases {
        engine: EngineId,
        requests: Vec<String>,
        renew_now: bool,
    },
    /// Lease request ids to stop renewing.
    RemoveLeases {
        engine: EngineId,
        requests: Vec<String>,
    },
    /// The router or orchestrator says a peer is gone.
    PeerGone { peer: PeerRef, mode: GoneMode },
    /// A membership record went away.
    MemberGone {
        departure: Departure,
        mode: GoneMode,
    },
    /// The transport saw a peer's connection fail: check it now.
    Suspect(crate::transport::Suspicion),
    /// A transport call came back.
    CallDone(CallOutcome),
    /// The service is stopping.
    Shutdown,
}

/// The core's answer to a question the runtime waits on.
pub(crate) enum Answer<R, A> {
    /// The claim is granted: load.
    Load,
    /// This engine incarnation is registered at this address already:
    /// nothing to load.
    Current(Arc<A>),
    /// The claim is refused.
    ClaimRefused(ClaimRefused),
    /// The extra agent name is this handshake's now, or another's.
    AgentClaimed(Result<(), Conflict>),
    /// The registration is active.
    Registered(Arc<A>),
    /// The registration was not taken.
    Refused(RegisterError<R>),
    /// The handshake ended before the answer: nobody waits for it.
    Withdrawn,
}

/// A decision of the core, for the driver to carry out. Transport calls
/// are not among them: they come out as one batch ([`Core::take_calls`]).
pub(crate) enum Action<R, A> {
    /// A registration is active: list it where it is looked up by id
    /// (before its event goes out).
    Activated { cell: Arc<A> },
    /// Answer the question `request`.
    Answer {
        request: RequestId,
        answer: Answer<R, A>,
    },
    /// The registration `serial` of `engine` is gone: forget it wherever
    /// it is looked up by id (before its event goes out).
    Forget {
        engine: EngineId,
        serial: RegistrationId,
    },
    /// Tell the runtime's read handles of this registration that its
    /// reads have failed ([`crate::TransferGuard::failed`]), before the event
    /// that says so goes out.
    FailReads { cell: Arc<A> },
    /// The registration's release came back from the transport:
    /// [`crate::EngineRef::released`] and the given-up reads' destinations
    /// resolve (`transfers_ended`: the release ended every transfer still
    /// running to the engine), before the `Released` event goes out.
    ReleaseFinished { cell: Arc<A>, transfers_ended: bool },
    /// A renewal waits for the round of `serial` now in flight: hand its
    /// result over as soon as it is back (a round that only succeeds
    /// otherwise waits for the driver's next wake-up).
    Expedite { serial: RegistrationId },
    /// Count it in the metrics.
    Count(Count),
    /// Publish an event.
    Emit(Event),
}

/// The core. It keeps what every rule shares (the config, the peer
/// table, the decisions not yet taken, the timers, the transient-error
/// limiter, the silent-peer note) and composes one type per rule's own
/// state, each with its fields private to the rule's file (a
/// registration's part of each rule is in its record, `peer.rs`): a
/// rule's file shows everything it may touch, and each type is tested
/// alone. Its flows are written in `flow.rs`.
pub(crate) struct Core<R, A> {
    config: Config,
    peers: PeerTable<R, A>,
    actions: VecDeque<Action<R, A>>,
    /// Transport calls decided and not yet taken, in order: kept apart from
    /// the other actions so that a slot's rounds go to the offload queue as
    /// one vector, moved rather than copied call by call.
    calls: Vec<Call<R>>,
    /// Every timer but the heartbeat schedule.
    timers: TimerTable,
    /// Lines about transient errors: one per registration, status and
    /// source per period.
    transient_log: LogLimiter<(RegistrationId, i32, Source)>,
    /// Appended to a live engine's "why not released" (the snapshot's).
    silent_peer_note: String,
    /// Which registration each engine id, address and agent name maps
    /// to, and the handshakes in progress (`directory.rs`).
    directory: Directory,
    /// The conflicts seen, so that each is news once (`identity.rs`).
    conflicts: ConflictLog,
    /// The heartbeat schedule, the rate cap, the jitter's randomness and
    /// the summed counts (`heartbeat.rs`).
    heartbeats: Heartbeats,
    /// The stall rule's judge and its episodes (`stall.rs`).
    stalls: StallWatch,
    /// Releases in flight and the shutdown (`fate.rs`).
    releases: Releases,
    /// Given-up transfers still running (`given_up.rs`).
    given_up: GivenUpBook,
}

impl<R, A: ReadAccounting> Core<R, A> {
    /// The slots each per-engine and per-handshake table holds (its
    /// capacity), by name: what the tables keep after departures.
    #[cfg(test)]
    pub(crate) fn footprint(&self) -> Vec<(&'static str, usize)> {
        let peers = [
            ("peers", self.peers.capacity()),
            ("peers.index", self.peers.index_capacity()),
        ];
        peers
            .into_iter()
            .chain(self.directory.footprint())
            .collect()
    }

    /// A core with `config`, its clock starting at `now`, drawing jitter
    /// from `rng`.
    pub(crate) fn new(config: Config, now: Instant, rng: StdRng) -> Self {
        Core {
            heartbeats: Heartbeats::new(&config, now, rng),
            timers: {
                let mut timers = TimerTable::default();
                timers.set_or_stop(Timer::Census, config.metrics_period.map(|p| now + p));
                timers.set_or_stop(
                    Timer::StallCheck,
                    config.read_stall.map(|b| now + stall_check_period(b)),
                );
                timers
            },
            stalls: StallWatch::default(),
            config,
            peers: PeerTable::default(),
            directory: Directory::default(),
            conflicts: ConflictLog::default(),
            actions: VecDeque::new(),
            calls: Vec::new(),
            silent_peer_note: "UCX settings not given to the service".to_string(),
            releases: Releases::default(),
            given_up: GivenUpBook::default(),
            transient_log: LogLimiter::standard(),
        }
    }

    /// Whether the transport's release ends the transfers still running to
    /// an engine: decides what a given-up read's destination becomes
    /// ([`crate::Destination`]).
    pub(crate) fn set_release_ends_transfers(&mut self, ends: bool) {
        self.releases.set_ends_transfers(ends);
    }

    /// Sets the note a live engine's snapshot carries about silent peers.
    pub(crate) fn set_silent_peer_note(&mut self, note: String) {
        self.silent_peer_note = note;
    }

    /// The next decision to carry out, if any.
    pub(crate) fn poll_action(&mut self) -> Option<Action<R, A>> {
        self.actions
            .pop_front()
            .or_else(|| self.heartbeats.take_count().map(Action::Count))
    }

    /// The transport calls decided since the last take, in order, to be
    /// made off the async threads; carried out after the other actions.
    pub(crate) fn take_calls(&mut self) -> Vec<Call<R>> {
        let capacity = self.calls.len();
        std::mem::replace(&mut self.calls, Vec::with_capacity(capacity))
    }

    /// When the core next needs [`Core::handle_timeout`].
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        [self.heartbeats.next(), self.timers.next()]
            .into_iter()
            .flatten()
            .min()
    }

    /// Whether a shutdown has begun and nothing is left to wait for at
    /// `now`: the driver may stop and hand back what is left.
    pub(crate) fn is_stopped(&self, now: Instant) -> bool {
        self.releases.is_stopped(now, self.peers.is_empty())
    }

    /// Counts of registrations by state and reads in flight, for the
    /// gauges. Walks every engine: called at the metrics period.
    pub(crate) fn census(&self) -> ([usize; 6], u64) {
        let mut by_state = [0usize; 6];
        let mut reads = 0;
        for peer in self.peers.values() {
            by_state[peer.cell.state() as usize] += 1;
            reads += peer.cell.reads_in_flight();
        }
        (by_state, reads)
    }

    /// The table as it is now; each engine's line is `report.rs`'s.
    pub(crate) fn snapshot(&self, now: Instant) -> Snapshot {
        let report = report::Context {
            now,
            given_up: &self.given_up,
            directory: &self.directory,
            read_stall: self.config.read_stall,
            silent_peer_note: &self.silent_peer_note,
        };
        let mut engines: Vec<EngineSnapshot> =
            self.peers.values().map(|p| report.engine(p)).collect();
        engines.sort_by(|a, b| a.engine.cmp(&b.engine));
        Snapshot {
            engines,
            handshakes_pending: self.directory.handshakes_pending(),
            waiting_for_reload: self.directory.waiting_for_reload(),
            silent_peer_note: self.silent_peer_note.clone(),
            limiter_keys: self.peers.values().filter(|p| p.beat.has_limiter()).count(),
            heartbeat_timers: self.heartbeats.scheduled(),
            // Filled in by the driver, which holds them.
            detection_bound: None,
            transport: Default::default(),
        }
    }

    /// What a shutdown could not release: registrations still held, each
    /// once, resources and all; and the engines whose release was handed
    /// to the transport but had not come back.
    pub(crate) fn into_unreleased(self) -> (Vec<Registration<R>>, Vec<EngineId>) {
        let mut unreleased = Vec::new();
        let mut unfinished = Vec::new();
        for p in self.peers.into_values() {
            let engine = p.cell.id().clone();
            match p.fate.into_resources() {
                Some(resources) => unreleased.push(Registration {
                    engine,
                    incarnation: p.who.incarnation(),
                    agents: p.who.agents().to_vec(),
                    address: p.who.into_address(),
                    resources,
                }),
                None => unfinished.push(engine),
            }
        }
        unreleased.sort_by(|a, b| a.engine.cmp(&b.engine));
        unfinished.sort();
        (unreleased, unfinished)
    }

    fn emit(&mut self, event: Event) {
        self.actions.push_back(Action::Emit(event));
    }

    fn answer(&mut self, request: RequestId, answer: Answer<R, A>) {
        self.actions.push_back(Action::Answer { request, answer });
    }

    fn count(&mut self, count: Count) {
        self.actions.push_back(Action::Count(count));
    }
}

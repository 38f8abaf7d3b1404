//! The keepalive rules, closed in one synchronous state machine.
//!
//! Built the way quinn-proto and foca are: the core never reads a clock,
//! sleeps, spawns or calls NIXL. Every input carries `now`
//! ([`Core::handle`]); every decision comes out as an [`Action`]
//! ([`Core::poll_action`]); the core owns its timers (the heartbeat
//! schedule, the gauges' period, the shutdown deadline) and says when it
//! next needs the clock ([`Core::poll_timeout`], then
//! [`Core::handle_timeout`]). Randomness (the heartbeat jitter) is
//! injected. The tokio driver (`service`) only carries inputs in, sleeps to
//! the deadline, and carries actions out; it imports the core, never the
//! other way round, and so does the offload queue.
//!
//! # The rules
//!
//! - Every engine gets a heartbeat round per interval (+/- jitter, rounded
//!   to [`HEARTBEAT_SLOT`]), never two rounds at once, at most the rate
//!   cap; lease renewals the runtime asks for share the cap.
//! - One classifier judges every status ([`classify`]): REMOTE_DISCONNECT
//!   marks the engine unreachable and fails its reads; everything else is
//!   counted, never a release.
//! - A marked registration is released (one transport call) once no read
//!   is in flight and no handshake is pending at its address, and never
//!   before. A handshake that is loading the very engine id again does not
//!   hold it back: it is waiting for that release.
//! - An engine id is held by at most one registration. Loading it again
//!   ([`Input::ReadyToLoad`]) marks the old one, whatever state it is in,
//!   and is answered once it is released. A registration of an id still
//!   held waits for the old one's release.
//! - A new engine id at a known address replaces the engine there.
//! - Agent names are unique over all registrations.
//! - Shutdown marks everything, activates nothing, refuses what waits,
//!   releases each engine as its reads end, and stops waiting at the drain
//!   deadline.

mod calls;
pub(crate) mod cell;
mod classify;
mod identity;
mod peer;
mod rate;
mod schedule;
#[cfg(test)]
mod tests;

use crate::registration::RegistrationId;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::Rng;
use tokio::time::Instant;

pub(crate) use calls::{Call, CallOutcome, HeartbeatMessages, Panicked, RoundResults};
pub(crate) use cell::{EngineCell, Wake, WakeSink};
pub(crate) use classify::{classify, Verdict};
pub use schedule::HEARTBEAT_SLOT;

use crate::config::{Config, StallAction};
use crate::engine::GiveUp;
use crate::error::{ClaimRefused, Conflict, RegisterError};
use crate::event::{Event, ReleaseReason, Source, WaitedFor};
use crate::log_limit::LogLimiter;
use crate::registration::{Claim, Departure, GoneMode, PeerRef, Registration};
use crate::snapshot::{EngineSnapshot, HeartbeatSnapshot, Snapshot};
use crate::state::EngineState;
use crate::telemetry;
use crate::transport::{AgentName, EngineId, PeerAddr, ReleaseStep};
use crate::NixlStatus;
use identity::{Holder, Ticket};
use peer::{Mark, Peer};
use rate::RateCap;
use schedule::Schedule;

/// The core's maps: keyed by registration serials, ticket numbers and names
/// the runtime handed over, hashed with foldhash (SipHash was a tenth of the
/// service's CPU at 10k engines).
type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// A handshake, as the core knows it: unique per process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct TicketId(pub(crate) u64);

/// A question the runtime waits on (a claim, a registration): the driver
/// keeps the reply channel under it until the core answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct RequestId(pub(crate) u64);

/// Everything that can happen to the core, besides time passing.
pub(crate) enum Input<R> {
    /// A handshake with `address` started: until it ends, the release of a
    /// marked engine there waits (the runtime may still be deciding whether
    /// the engine there is new).
    HandshakeStarted { ticket: TicketId, address: PeerAddr },
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
        cell: Arc<EngineCell>,
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
    /// A transport call came back.
    CallDone(CallOutcome),
    /// The service is stopping.
    Shutdown,
}

/// The core's answer to a question the runtime waits on.
pub(crate) enum Answer<R> {
    /// The claim is granted: load.
    Load,
    /// This engine incarnation is registered at this address already:
    /// nothing to load.
    Current(Arc<EngineCell>),
    /// The claim is refused.
    ClaimRefused(ClaimRefused),
    /// The extra agent name is this handshake's now, or another's.
    AgentClaimed(Result<(), Conflict>),
    /// The registration is active.
    Registered(Arc<EngineCell>),
    /// The registration was not taken.
    Refused(RegisterError<R>),
    /// The handshake ended before the answer: nobody waits for it.
    Withdrawn,
}

/// A decision of the core, for the driver to carry out.
pub(crate) enum Action<R> {
    /// Make these transport calls off the async threads.
    Call(Call<R>),
    /// A registration is active: list it where it is looked up by id
    /// (before its event goes out).
    Activated { cell: Arc<EngineCell> },
    /// Answer the question `request`.
    Answer {
        request: RequestId,
        answer: Answer<R>,
    },
    /// The registration `serial` of `engine` is gone: forget it wherever
    /// it is looked up by id (before its event goes out).
    Forget { engine: EngineId, serial: RegistrationId },
    /// Publish an event.
    Emit(Event),
}

/// Where a shutdown stands.
struct Stopping {
    /// Past this, reads still in flight (and releases still running) are no
    /// longer waited for.
    deadline: Instant,
    /// The deadline has been served by [`Core::handle_timeout`].
    expired: bool,
}

/// The core: the peer table, the handshakes, the timers.
pub(crate) struct Core<R> {
    config: Config,
    peers: Map<RegistrationId, Peer<R>>,
    /// The registration each engine id holds now (at most one).
    by_id: Map<EngineId, RegistrationId>,
    /// The registration each address maps to now.
    by_addr: Map<PeerAddr, RegistrationId>,
    /// Who holds each agent name: a registration or a granted load.
    agents: Map<AgentName, Holder>,
    tickets: Map<TicketId, Ticket>,
    /// Handshakes in progress per address.
    handshakes: Map<PeerAddr, usize>,
    /// Marked registrations whose release waits for a handshake at their
    /// address.
    held: Map<PeerAddr, BTreeSet<RegistrationId>>,
    /// The one granted load of each engine id.
    loads: Map<EngineId, TicketId>,
    /// Claims waiting for an engine id, in arrival order.
    waiting: Map<EngineId, VecDeque<TicketId>>,
    /// Conflicts seen, and how often: each is logged once.
    conflicts: Map<Conflict, u64>,
    /// The newest handshake started so far.
    newest_ticket: TicketId,
    schedule: Schedule,
    rate: RateCap,
    rng: StdRng,
    actions: VecDeque<Action<R>>,
    /// The message of an engine without leases, shared by all of them.
    idle_message: HeartbeatMessages,
    /// Appended to a live engine's "why not released".
    silent_peer_note: String,
    census_due: Option<Instant>,
    /// When the read-stall check runs next on its own period.
    stall_check_due: Option<Instant>,
    /// When a stall may be decided before that: the earliest moment an
    /// engine's quiet stretch reaches the bound, or now when a read was
    /// given up as timed out (the runtime's verdict is judged at once).
    stall_mark_due: Option<Instant>,
    /// A decoder-wide stall (suspects, but no engine completing) is going
    /// on and has been warned about: once per episode.
    decoder_stuck: bool,
    /// The transport's release ends the transfers still running to the
    /// engine ([`crate::Transport::release_ends_transfers`]).
    release_ends_transfers: bool,
    releases_in_flight: usize,
    stopping: Option<Stopping>,
    /// Lines about transient errors: one per registration, status and
    /// source per period.
    transient_log: LogLimiter<(RegistrationId, i32, Source)>,
}

impl<R> Core<R> {
    /// A core with `config`, its clock starting at `now`, drawing jitter
    /// from `rng`.
    pub(crate) fn new(config: Config, now: Instant, rng: StdRng) -> Self {
        Core {
            rate: RateCap::new(&config, now),
            schedule: Schedule::new(now),
            census_due: config.metrics_period.map(|p| now + p),
            stall_check_due: config.read_stall.map(|b| now + stall_check_period(b)),
            stall_mark_due: None,
            decoder_stuck: false,
            release_ends_transfers: false,
            config,
            peers: Map::default(),
            by_id: Map::default(),
            by_addr: Map::default(),
            agents: Map::default(),
            tickets: Map::default(),
            handshakes: Map::default(),
            held: Map::default(),
            loads: Map::default(),
            waiting: Map::default(),
            conflicts: Map::default(),
            newest_ticket: TicketId(0),
            rng,
            actions: VecDeque::new(),
            idle_message: heartbeat_round(&BTreeSet::new()),
            silent_peer_note: "UCX settings not given to the service".to_string(),
            releases_in_flight: 0,
            stopping: None,
            transient_log: LogLimiter::standard(),
        }
    }

    /// Whether the transport's release ends the transfers still running to
    /// an engine: decides what a given-up read's destination becomes
    /// ([`crate::Destination`]).
    pub(crate) fn set_release_ends_transfers(&mut self, ends: bool) {
        self.release_ends_transfers = ends;
    }

    /// Sets the note a live engine's snapshot carries about silent peers.
    pub(crate) fn set_silent_peer_note(&mut self, note: String) {
        self.silent_peer_note = note;
    }

    /// The next decision to carry out, if any.
    pub(crate) fn poll_action(&mut self) -> Option<Action<R>> {
        self.actions.pop_front()
    }

    /// When the core next needs [`Core::handle_timeout`].
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        let drain = self
            .stopping
            .as_ref()
            .filter(|s| !s.expired && !self.is_stopped_before_deadline())
            .map(|s| s.deadline);
        [
            self.schedule.next(),
            self.census_due,
            self.stall_check_due,
            self.stall_mark_due,
            drain,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Whether a shutdown has begun and nothing is left to wait for at
    /// `now`: the driver may stop and hand back what is left.
    pub(crate) fn is_stopped(&self, now: Instant) -> bool {
        match &self.stopping {
            None => false,
            Some(s) => s.expired || now >= s.deadline || self.is_stopped_before_deadline(),
        }
    }

    /// Nothing left to wait for: no release running, and every registration
    /// released.
    fn is_stopped_before_deadline(&self) -> bool {
        self.stopping.is_some() && self.releases_in_flight == 0 && self.peers.is_empty()
    }

    /// Time has passed: serves every timer due at `now`.
    pub(crate) fn handle_timeout(&mut self, now: Instant) {
        if let Some(stopping) = self.stopping.as_mut().filter(|s| now >= s.deadline) {
            if !stopping.expired {
                stopping.expired = true;
                tracing::warn!("shutdown drain deadline passed: what still has reads in flight is handed back unreleased");
            }
        }
        while let Some((slot, serials)) = self.schedule.pop_due(now) {
            for serial in serials {
                let Some(peer) = self.peers.get_mut(&serial) else {
                    continue;
                };
                if peer.next_heartbeat == Some(slot) {
                    peer.next_heartbeat = None;
                    self.heartbeat_due(now, serial, slot);
                }
            }
        }
        if let Some(bound) = self.config.read_stall {
            let periodic = self.stall_check_due.filter(|&due| due <= now);
            if periodic.is_some() || self.stall_mark_due.is_some_and(|due| due <= now) {
                self.check_stalls(now, bound);
            }
            if let Some(due) = periodic {
                let period = stall_check_period(bound);
                self.stall_check_due = Some(if now - due < period {
                    due + period
                } else {
                    now + period
                });
            }
        }
        if let (Some(due), Some(period)) = (self.census_due, self.config.metrics_period) {
            if due <= now {
                let (by_state, reads) = self.census();
                telemetry::census(by_state, reads);
                // From the deadline, unless far behind: never a burst.
                self.census_due = Some(if now - due < period {
                    due + period
                } else {
                    now + period
                });
            }
        }
    }

    /// Handles one input at `now`.
    pub(crate) fn handle(&mut self, now: Instant, input: Input<R>) {
        match input {
            Input::HandshakeStarted { ticket, address } => self.handshake_started(ticket, address),
            Input::Claim {
                ticket,
                request,
                claim,
            } => self.claim(now, ticket, request, claim),
            Input::ClaimAgent {
                ticket,
                request,
                agent,
            } => self.claim_agent(ticket, request, agent),
            Input::HandshakeFinished { ticket } => self.handshake_finished(now, ticket),
            Input::Register {
                request,
                ticket,
                registration,
                cell,
            } => self.register(now, request, ticket, registration, cell),
            Input::Read(Wake::Drained(serial)) => self.try_release(now, serial),
            Input::Read(Wake::TransferResult(serial, status)) => {
                self.status(now, serial, Source::Transfer, None, status)
            }
            Input::Read(Wake::GivenUp {
                serial,
                why,
                unanswered,
                done,
            }) => self.read_given_up(now, serial, why, unanswered, done),
            Input::AddLeases {
                engine,
                requests,
                renew_now,
            } => self.add_leases(now, &engine, requests, renew_now),
            Input::RemoveLeases { engine, requests } => self.remove_leases(&engine, &requests),
            Input::PeerGone { peer, mode } => self.peer_gone(now, peer, mode),
            Input::MemberGone { departure, mode } => self.member_gone(now, departure, mode),
            Input::CallDone(CallOutcome::Heartbeat { serial, results }) => {
                self.heartbeat_done(now, serial, results)
            }
            Input::CallDone(CallOutcome::Release { serial, steps }) => {
                self.release_done(now, serial, steps)
            }
            Input::Shutdown => self.shutdown(now),
        }
    }

    fn emit(&mut self, event: Event) {
        self.actions.push_back(Action::Emit(event));
    }

    // ----- statuses and leases -----

    /// A status from `source` for registration `serial` (and `agent`, for
    /// a heartbeat). The one place a status is acted on.
    fn status(
        &mut self,
        now: Instant,
        serial: RegistrationId,
        source: Source,
        agent: Option<&AgentName>,
        status: NixlStatus,
    ) {
        let verdict = classify(status);
        if verdict == Verdict::Fine {
            return;
        }
        telemetry::status_error(source, status);
        let Some(peer) = self.peers.get_mut(&serial) else {
            return;
        };
        let engine = peer.id().clone();
        match verdict {
            Verdict::Fine => {}
            Verdict::Disconnect => {
                if peer.is_live() {
                    tracing::warn!(%engine, ?agent, %source, %status, raw = status.raw(), "REMOTE_DISCONNECT: engine unreachable");
                    self.emit(Event::Unreachable {
                        engine,
                        registration: serial,
                        status,
                        source,
                    });
                    self.mark(now, serial, ReleaseReason::Unreachable);
                }
            }
            Verdict::MetadataGone => {
                if peer.is_live() {
                    tracing::warn!(%engine, ?agent, %source, %status, raw = status.raw(), "NOT_FOUND for the engine's own agent: NIXL no longer holds its metadata; released and connected again");
                    self.mark(now, serial, ReleaseReason::MetadataLost);
                }
            }
            Verdict::Transient => {
                peer.transient_errors += 1;
                // One line per engine, status and source per period, with
                // the count it stands for; every one is counted and is an
                // event.
                let key = (serial, status.raw(), source);
                if let Some(suppressed) = self.transient_log.admit(key, now) {
                    tracing::info!(%engine, ?agent, %source, %status, raw = status.raw(), suppressed, total = peer.transient_errors, "an error that is not a disconnect: counted, engine kept");
                }
                self.emit(Event::TransientError {
                    engine,
                    registration: serial,
                    status,
                    source,
                });
            }
        }
    }

    fn live_serial(&self, id: &EngineId) -> Option<RegistrationId> {
        let serial = *self.by_id.get(id)?;
        self.peers
            .get(&serial)
            .filter(|p| p.is_live())
            .map(|_| serial)
    }

    fn add_leases(&mut self, now: Instant, id: &EngineId, requests: Vec<String>, renew_now: bool) {
        let Some(serial) = self.live_serial(id) else {
            tracing::debug!(engine = %id, "lease for an engine that is not live: ignored");
            return;
        };
        let peer = self.peers.get_mut(&serial).expect("live serial");
        if !requests.is_empty() {
            peer.leases.extend(requests);
            peer.message = None;
        }
        if renew_now {
            self.renew(now, serial);
        }
    }

    fn remove_leases(&mut self, id: &EngineId, requests: &[String]) {
        if let Some(peer) = self.by_id.get(id).and_then(|s| self.peers.get_mut(s)) {
            for r in requests {
                if peer.leases.remove(r) {
                    peer.message = None;
                }
            }
        }
    }

    // ----- heartbeats -----

    fn heartbeat_due(&mut self, now: Instant, serial: RegistrationId, due: Instant) {
        let Some(peer) = self.peers.get(&serial) else {
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
                self.schedule_heartbeat(serial, now + interval);
            }
            return;
        }
        match self.rate.check(serial, now) {
            Ok(()) => self.send_heartbeat(due, serial),
            Err(wait) => {
                telemetry::heartbeat_deferred();
                self.schedule_heartbeat(serial, now + wait);
            }
        }
    }

    fn renew(&mut self, now: Instant, serial: RegistrationId) {
        let peer = self.peers.get_mut(&serial).expect("live serial");
        if peer.heartbeat_in_flight {
            peer.renewal_wanted = true;
            return;
        }
        match self.rate.check(serial, now) {
            Ok(()) => self.send_heartbeat(now, serial),
            Err(wait) => {
                telemetry::heartbeat_deferred();
                let peer = self.peers.get_mut(&serial).expect("live serial");
                peer.renewal_wanted = true;
                let at = now + wait;
                if peer.next_heartbeat.is_none_or(|next| at < next) {
                    self.schedule_heartbeat(serial, at);
                }
            }
        }
    }

    /// Sends a round now; the next is due one interval (+/- jitter) after
    /// `base`: the deadline this round was due at, or now for a renewal.
    fn send_heartbeat(&mut self, base: Instant, serial: RegistrationId) {
        let peer = self.peers.get_mut(&serial).expect("live serial");
        peer.heartbeat_in_flight = true;
        peer.renewal_wanted = false;
        let messages = match &peer.message {
            Some(messages) => messages.clone(),
            None => {
                let messages = if peer.leases.is_empty() {
                    self.idle_message.clone()
                } else {
                    heartbeat_round(&peer.leases)
                };
                peer.message = Some(messages.clone());
                messages
            }
        };
        let agents = peer.agents.clone();
        self.actions.push_back(Action::Call(Call::Heartbeat {
            serial,
            agents,
            messages,
        }));
        match self.config.heartbeat_interval {
            Some(interval) => {
                let jitter = self.config.jitter.as_secs_f64();
                let delta = if jitter > 0.0 {
                    self.rng.random_range(-jitter..=jitter)
                } else {
                    0.0
                };
                let next = Duration::from_secs_f64((interval.as_secs_f64() + delta).max(0.0));
                self.schedule_heartbeat(serial, base + next);
            }
            None => self.unschedule_heartbeat(serial),
        }
    }

    fn heartbeat_done(&mut self, now: Instant, serial: RegistrationId, results: RoundResults) {
        let RoundResults {
            sent,
            failed,
            panicked,
        } = results;
        telemetry::heartbeats_sent(sent);
        let Some(peer) = self.peers.get_mut(&serial) else {
            return;
        };
        peer.heartbeat_in_flight = false;
        let status = failed
            .iter()
            .map(|(_, e)| e.status)
            .find(|s| s.is_remote_disconnect())
            .or(failed.first().map(|(_, e)| e.status))
            .unwrap_or(NixlStatus::SUCCESS);
        peer.last_heartbeat = Some((now, status));
        let engine = peer.id().clone();
        for (agent, p) in panicked {
            telemetry::transport_panicked("genNotif");
            tracing::error!(%engine, %agent, message = %p.message, "the transport panicked in genNotif: counted, engine kept");
            self.emit(Event::TransportPanicked {
                engine: engine.clone(),
                registration: serial,
                call: "genNotif",
                message: p.message,
            });
        }
        for (agent, e) in &failed {
            self.status(now, serial, Source::Heartbeat, Some(agent), e.status);
        }
        let peer = self.peers.get(&serial).expect("still here");
        if peer.is_live() && peer.renewal_wanted {
            self.renew(now, serial);
        }
    }

    fn schedule_heartbeat(&mut self, serial: RegistrationId, at: Instant) {
        self.unschedule_heartbeat(serial);
        if let Some(peer) = self.peers.get_mut(&serial) {
            peer.next_heartbeat = Some(self.schedule.insert(serial, at));
        }
    }

    fn unschedule_heartbeat(&mut self, serial: RegistrationId) {
        if let Some(slot) = self
            .peers
            .get_mut(&serial)
            .and_then(|p| p.next_heartbeat.take())
        {
            self.schedule.remove(serial, slot);
        }
    }

    // ----- hung peers -----

    /// The read-stall check: finds live registrations whose reads stopped
    /// completing, and judges them.
    ///
    /// An engine is *quiet* while it has a read outstanding (in flight, or
    /// given up unanswered) and no completion has been seen; its quiet
    /// stretch starts when that was first seen (a check, or a give-up),
    /// never earlier, so a read that began just before a check is not
    /// counted from an older check. A quiet engine is a suspect once its
    /// stretch reaches `bound`, or at once when the runtime gave up one of
    /// its reads as timed out with none of its reads completing meanwhile
    /// (the runtime's own bound). Slow is not hung: one completion, however
    /// late, ends the stretch.
    ///
    /// A suspect is judged stalled only when the stall is its own: another
    /// engine's completion was seen within the last check period, or no
    /// other engine has a read outstanding to compare with. When others
    /// have reads outstanding and none completes, the decoder itself looks
    /// stuck: nobody is blamed, and that is warned about once per episode.
    ///
    /// Every engine is sampled first and judged after, so the verdicts do
    /// not depend on the order of the walk; suspects are judged (and their
    /// events emitted) in registration order, so a seed reproduces them.
    fn check_stalls(&mut self, now: Instant, bound: Duration) {
        /// What the sampling found of one suspect.
        struct Suspect {
            serial: RegistrationId,
            reads: u64,
            quiet: Duration,
            given_up: u64,
            completing: bool,
        }
        let window = stall_check_period(bound);
        let mut outstanding = 0usize;
        let mut completing = 0usize;
        let mut suspects = Vec::new();
        let mut next_due: Option<Instant> = None;
        for (&serial, peer) in self.peers.iter_mut() {
            if !peer.is_live() {
                continue;
            }
            let (reads, done) = peer.cell.progress();
            let p = &mut peer.progress;
            if done != p.done_seen {
                p.completed(now, done, reads);
            } else if !p.outstanding(reads) {
                p.quiet_since = None;
                p.reported = false;
            } else if p.quiet_since.is_none() {
                p.quiet_since = Some(now);
            }
            let is_completing = p.last_completion.is_some_and(|at| now - at <= window);
            outstanding += usize::from(p.outstanding(reads));
            completing += usize::from(is_completing);
            let Some(since) = p.quiet_since.filter(|_| !p.reported) else {
                continue;
            };
            let quiet = now - since;
            if quiet >= bound || p.timed_out > 0 {
                suspects.push(Suspect {
                    serial,
                    reads,
                    quiet,
                    given_up: p.timed_out,
                    completing: is_completing,
                });
            } else {
                let due = since + bound;
                next_due = Some(next_due.map_or(due, |d| d.min(due)));
            }
        }
        self.stall_mark_due = next_due;
        suspects.sort_unstable_by_key(|s| s.serial);
        let mut unjudged = 0usize;
        for suspect in suspects {
            // Every suspect has a read outstanding.
            let others_outstanding = outstanding > 1;
            let others_completing = completing > usize::from(suspect.completing);
            if others_outstanding && !others_completing {
                unjudged += 1;
                continue;
            }
            self.stalled(
                now,
                suspect.serial,
                suspect.reads,
                suspect.quiet,
                suspect.given_up,
            );
        }
        if unjudged > 0 && !self.decoder_stuck {
            telemetry::decoder_stuck();
            tracing::warn!(
                engines = unjudged,
                outstanding,
                bound = ?bound,
                "reads of every engine with reads outstanding stopped completing: the decoder itself looks stuck, no engine is blamed (warned once until a read completes again)"
            );
        }
        self.decoder_stuck = unjudged > 0;
    }

    /// A suspect judged stalled: reported once per stall, and with the
    /// `fail` action marked, its reads failed, released once they end.
    fn stalled(&mut self, now: Instant, serial: RegistrationId, reads: u64, quiet: Duration, given_up: u64) {
        let peer = self.peers.get_mut(&serial).expect("judged while live");
        peer.progress.reported = true;
        let engine = peer.id().clone();
        let action = self.config.stall_action;
        telemetry::read_stall(action.as_str());
        tracing::warn!(%engine, reads, ?quiet, given_up, action = action.as_str(), "reads stopped completing: the peer is hung");
        self.emit(Event::Stalled {
            engine,
            registration: serial,
            reads_in_flight: reads,
            stalled_for: quiet,
            given_up,
            failed: action == StallAction::Fail,
        });
        if action == StallAction::Fail {
            self.mark(now, serial, ReleaseReason::Stalled);
        }
    }

    /// The runtime gave up a read of registration `serial` in progress.
    /// Not a completion. Unanswered (no read of the engine completed while
    /// it was in flight, and none since the last check: the core's own
    /// sample, which cannot wrap within a check period, confirms the
    /// read's), it is evidence: it keeps the engine's quiet stretch going
    /// with no read in flight, and a timed-out one is judged at once.
    fn read_given_up(
        &mut self,
        now: Instant,
        serial: RegistrationId,
        why: GiveUp,
        unanswered: bool,
        done: u64,
    ) {
        telemetry::read_given_up(why, unanswered);
        let Some(peer) = self.peers.get_mut(&serial) else {
            return;
        };
        if !peer.is_live() || self.config.read_stall.is_none() {
            return;
        }
        let reads = peer.cell.reads_in_flight();
        let engine = peer.id().clone();
        let p = &mut peer.progress;
        let mut answered = !unanswered;
        if done != p.done_seen {
            // Completions since the last check, before this read began or
            // while it was in flight: the engine answers.
            p.completed(now, done, reads);
            answered = true;
        }
        if answered {
            tracing::debug!(%engine, why = why.as_str(), "read given up at an engine that completes reads: not evidence of a stall");
            return;
        }
        p.unanswered += 1;
        p.quiet_since.get_or_insert(now);
        tracing::info!(%engine, why = why.as_str(), unanswered = p.unanswered, "read given up unanswered: counted against the engine, not as a completion");
        if why == GiveUp::TimedOut {
            p.timed_out += 1;
            self.stall_mark_due = Some(now);
        }
    }

    /// The release of `peer` came back: the runtime's given-up reads of it
    /// learn what their destination buffers may become.
    fn release_finished(&self, cell: &EngineCell, clean: bool) {
        cell.release_finished(clean && self.release_ends_transfers);
    }

    // ----- marking and releasing -----

    /// Marks a live registration: no new reads, no more heartbeats;
    /// released as soon as it is idle. The first mark stands.
    fn mark(&mut self, now: Instant, serial: RegistrationId, reason: ReleaseReason) {
        let Some(peer) = self.peers.get_mut(&serial) else {
            return;
        };
        if !peer.is_live() {
            return;
        }
        let state = match reason {
            ReleaseReason::Unreachable | ReleaseReason::MetadataLost => EngineState::Unreachable,
            ReleaseReason::Replaced | ReleaseReason::Reregistered => EngineState::Replaced,
            ReleaseReason::PeerGone | ReleaseReason::Shutdown => EngineState::Retiring,
            ReleaseReason::Stalled => EngineState::Stalled,
        };
        let reads = peer.cell.mark(state).unwrap_or(0);
        peer.mark = Some(Mark {
            reason,
            at: now,
            reads_at_mark: reads,
            held_by_handshake: false,
        });
        peer.leases.clear();
        peer.message = None;
        tracing::info!(engine = %peer.id(), registration = %serial, state = state.as_str(), reads_in_flight = reads, "engine marked for release");
        self.unschedule_heartbeat(serial);
        if matches!(
            reason,
            ReleaseReason::Unreachable | ReleaseReason::Stalled | ReleaseReason::MetadataLost
        ) {
            // UCX has failed the endpoint, the peer is hung, or NIXL holds
            // no metadata for it: no read in flight will complete.
            self.fail_reads(serial);
        }
        self.try_release(now, serial);
    }

    fn fail_reads(&mut self, serial: RegistrationId) {
        let Some(peer) = self.peers.get(&serial) else {
            return;
        };
        peer.cell.fail_reads();
        let count = peer.cell.reads_in_flight();
        if count > 0 {
            let engine = peer.id().clone();
            tracing::warn!(%engine, count, "reads in flight failed");
            self.emit(Event::ReadsFailed {
                engine,
                registration: serial,
                count,
            });
        }
    }

    /// Releases a marked registration if no read is in flight and no
    /// handshake holds it back. Decided here; the transport is called by
    /// the driver after.
    fn try_release(&mut self, now: Instant, serial: RegistrationId) {
        let Some(peer) = self.peers.get(&serial) else {
            return;
        };
        if peer.mark.is_none() || peer.is_releasing() {
            return;
        }
        // A pending handshake may yet decide the engine at this address is
        // new, so the old one waits; not when somebody is waiting to load
        // this very engine id again (they wait for this release), and not
        // once the service is stopping (nothing new will register).
        let held = self.stopping.is_none()
            && self.handshakes.contains_key(&peer.address)
            && !self.reload_wanted(peer.id());
        if held {
            let address = peer.address.clone();
            let peer = self.peers.get_mut(&serial).expect("checked");
            peer.mark.as_mut().expect("checked").held_by_handshake = true;
            self.held.entry(address).or_default().insert(serial);
            return;
        }
        if peer.cell.try_release().is_err() {
            return; // the last read to end wakes us
        }
        let peer = self.peers.get_mut(&serial).expect("checked");
        let engine = peer.id().clone();
        let waited = now.saturating_duration_since(peer.mark.as_ref().expect("checked").at);
        tracing::debug!(%engine, ?waited, "releasing");
        let resources = peer.resources.take().expect("checked above");
        let agents = peer.agents.clone();
        self.rate.forget(serial);
        self.releases_in_flight += 1;
        self.actions.push_back(Action::Call(Call::Release {
            serial,
            engine,
            agents,
            resources,
        }));
    }

    fn release_done(
        &mut self,
        now: Instant,
        serial: RegistrationId,
        steps: Result<Vec<ReleaseStep>, Panicked>,
    ) {
        let Some(peer) = self.peers.remove(&serial) else {
            return;
        };
        self.releases_in_flight -= 1;
        let engine = peer.id().clone();
        let mark = peer.mark.expect("released registrations are marked");
        let mut endpoints_left_open = 0u32;
        let (failed_steps, panicked) = match steps {
            Ok(steps) => {
                let mut failed = 0;
                for step in &steps {
                    endpoints_left_open += step.endpoints_left_open();
                    if step.status == NixlStatus::ERR_NOT_FOUND {
                        tracing::debug!(%engine, target = ?step.target, "already dropped by NIXL: counts as released");
                    } else if !step.status.is_ok() {
                        failed += 1;
                        telemetry::release_step_failed(step.status);
                        tracing::error!(%engine, target = ?step.target, status = %step.status, raw = step.status.raw(), "release step failed");
                    }
                }
                (failed, false)
            }
            Err(p) => {
                telemetry::transport_panicked("release");
                tracing::error!(%engine, message = %p.message, "the transport panicked while releasing: its resources are consumed, not retried");
                self.emit(Event::TransportPanicked {
                    engine: engine.clone(),
                    registration: serial,
                    call: "release",
                    message: p.message,
                });
                (0, true)
            }
        };
        self.release_finished(&peer.cell, failed_steps == 0 && !panicked);
        let since_mark = now.saturating_duration_since(mark.at);
        telemetry::released(mark.reason, since_mark);
        tracing::info!(%engine, registration = %serial, reason = mark.reason.as_str(), after = ?since_mark, failed_steps, panicked, "engine released");
        // Gone from the directory before the event: whoever sees it finds
        // the successor, if any, never the released registration.
        self.actions.push_back(Action::Forget {
            engine: engine.clone(),
            serial,
        });
        self.emit(Event::Released {
            engine: engine.clone(),
            registration: serial,
            reason: mark.reason,
            waited_for: WaitedFor {
                duration: since_mark,
                reads_in_flight_at_mark: mark.reads_at_mark,
                handshake: mark.held_by_handshake,
            },
            failed_steps,
            panicked,
            endpoints_left_open,
        });
        self.forget_registration(now, serial, &engine, &peer.address, &peer.agents);
    }

    /// The service is stopping: every live registration is marked (each
    /// idle one is released now), what waits is refused, and nothing is
    /// activated any more. [`Core::into_unreleased`] hands back the rest.
    fn shutdown(&mut self, now: Instant) {
        if self.stopping.is_some() {
            return;
        }
        self.stopping = Some(Stopping {
            deadline: now + self.config.shutdown_drain,
            expired: false,
        });
        tracing::info!(drain = ?self.config.shutdown_drain, "stopping: marking every engine; each is released as its reads end");
        // Claims waiting for an engine id are refused; granted loads may
        // still register (the service then releases them like the rest).
        let mut waiting: Vec<TicketId> = std::mem::take(&mut self.waiting)
            .into_values()
            .flatten()
            .collect();
        waiting.sort_unstable();
        for ticket in waiting {
            if let Some(t) = self.tickets.get_mut(&ticket) {
                if let identity::Stage::Waiting { request, .. } =
                    std::mem::replace(&mut t.stage, identity::Stage::Answered)
                {
                    self.actions.push_back(Action::Answer {
                        request,
                        answer: Answer::ClaimRefused(ClaimRefused::Stopped(crate::ServiceStopped)),
                    });
                }
            }
        }
        let mut serials: Vec<RegistrationId> = self.peers.keys().copied().collect();
        serials.sort_unstable();
        for serial in serials {
            self.mark(now, serial, ReleaseReason::Shutdown);
            // Marked earlier and held by a handshake: not any more.
            self.try_release(now, serial);
        }
        self.held.clear();
    }

    /// What a shutdown could not release: registrations still held, each
    /// once, resources and all; and the engines whose release was handed
    /// to the transport but had not come back.
    pub(crate) fn into_unreleased(self) -> (Vec<Registration<R>>, Vec<EngineId>) {
        let mut unreleased = Vec::new();
        let mut unfinished = Vec::new();
        for p in self.peers.into_values() {
            let engine = p.cell.id().clone();
            match p.resources {
                Some(resources) => unreleased.push(Registration {
                    engine,
                    incarnation: p.incarnation,
                    address: p.address,
                    agents: p.agents.to_vec(),
                    resources,
                }),
                None => unfinished.push(engine),
            }
        }
        unreleased.sort_by(|a, b| a.engine.cmp(&b.engine));
        unfinished.sort();
        (unreleased, unfinished)
    }

    // ----- introspection -----

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

    /// The table as it is now.
    pub(crate) fn snapshot(&self, now: Instant) -> Snapshot {
        let mut engines: Vec<EngineSnapshot> = self
            .peers
            .values()
            .map(|p| self.engine_snapshot(now, p))
            .collect();
        engines.sort_by(|a, b| a.engine.cmp(&b.engine));
        let mut handshakes_pending: Vec<(PeerAddr, usize)> = self
            .handshakes
            .iter()
            .map(|(a, n)| (a.clone(), *n))
            .collect();
        handshakes_pending.sort();
        let mut waiting: Vec<EngineId> = self.waiting.keys().cloned().collect();
        waiting.sort();
        waiting.dedup();
        Snapshot {
            engines,
            handshakes_pending,
            waiting_for_reload: waiting,
            silent_peer_note: self.silent_peer_note.clone(),
            limiter_keys: self.rate.len(),
            heartbeat_timers: self.schedule.len(),
            // Filled in by the driver, which holds them.
            detection_bound: None,
            transport: Default::default(),
        }
    }

    /// What a live engine's snapshot says about its reads and the stall
    /// check.
    fn stall_note(&self, now: Instant, p: &Peer<R>, reads: u64) -> String {
        let progress = &p.progress;
        if reads == 0 && progress.unanswered == 0 {
            return "no read in flight: a frozen idle prefill is invisible to UCX on shm/tcp, and only a membership signal or the router (peer_gone) can retire it".to_string();
        }
        let given_up = match progress.unanswered {
            0 => String::new(),
            n => format!(", {n} given up unanswered"),
        };
        let Some(bound) = self.config.read_stall else {
            return format!("{reads} read(s) in flight{given_up}; the read-stall check is off");
        };
        match progress.quiet_since {
            Some(since) => format!(
                "{reads} read(s) in flight{given_up}, none completed for at least {:?}; stalled after {bound:?} without a completion",
                now.saturating_duration_since(since)
            ),
            None => format!(
                "{reads} read(s) in flight{given_up}, completing; stalled after {bound:?} without a completion"
            ),
        }
    }

    fn engine_snapshot(&self, now: Instant, p: &Peer<R>) -> EngineSnapshot {
        let reads = p.cell.reads_in_flight();
        let last_heartbeat = p.last_heartbeat.map(|(at, status)| HeartbeatSnapshot {
            ago: now.saturating_duration_since(at),
            status,
        });
        let why = match &p.mark {
            None => {
                let last = match &last_heartbeat {
                    Some(h) => format!("last heartbeat {} {:?} ago", h.status.name(), h.ago),
                    None => "no heartbeat yet".to_string(),
                };
                let reads_note = self.stall_note(now, p, reads);
                format!(
                    "live: no REMOTE_DISCONNECT seen ({last}); {reads_note}; a silent peer is reported by UCX: {}",
                    self.silent_peer_note
                )
            }
            Some(_) if p.is_releasing() => {
                "releasing: the transport is giving back its NIXL state".into()
            }
            Some(m) => {
                let mut held = Vec::new();
                if reads > 0 {
                    held.push(format!("{reads} read(s) in flight"));
                }
                if self
                    .held
                    .get(&p.address)
                    .is_some_and(|s| s.contains(&p.cell.serial()))
                {
                    if let Some(n) = self.handshakes.get(&p.address) {
                        held.push(format!("{n} handshake(s) pending at {}", p.address));
                    }
                }
                format!(
                    "{}: release waits for {}",
                    m.reason.as_str(),
                    if held.is_empty() {
                        "nothing (about to be released)".to_string()
                    } else {
                        held.join(" and ")
                    }
                )
            }
        };
        EngineSnapshot {
            engine: p.id().clone(),
            address: p.address.clone(),
            incarnation: p.incarnation,
            agents: p.agents.to_vec(),
            state: p.cell.state(),
            reads_in_flight: reads,
            leases: p.leases.iter().cloned().collect(),
            last_heartbeat,
            next_heartbeat_in: p.next_heartbeat.map(|at| at.saturating_duration_since(now)),
            transient_errors: p.transient_errors,
            why,
        }
    }
}

/// The longest period of the read-stall check, whatever the bound: the
/// completed count must not be able to wrap between two checks (see
/// `cell.rs`).
pub(crate) const MAX_STALL_CHECK_PERIOD: Duration = Duration::from_secs(60);

// The proof, checked by the compiler: wrapping the completed count within
// one check period would take more than 10^9 completions a second.
const _: () = assert!(
    MAX_STALL_CHECK_PERIOD.as_secs() * 1_000_000_000 < 1 << cell::DONE_BITS,
    "the completed count could wrap between two stall checks"
);

/// How often the read-stall check runs for a `bound`: four times per bound
/// (at most every [`MAX_STALL_CHECK_PERIOD`]). An engine's quiet stretch is
/// first seen at most one period after it began and is judged exactly one
/// bound after that, so a stall is found within 1.25 bounds (while other
/// engines' reads complete at least once a period).
fn stall_check_period(bound: Duration) -> Duration {
    (bound / 4).clamp(HEARTBEAT_SLOT, MAX_STALL_CHECK_PERIOD)
}

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

/// One round's notifications, shared.
fn heartbeat_round<'a>(requests: impl IntoIterator<Item = &'a String>) -> HeartbeatMessages {
    heartbeat_messages(requests)
        .into_iter()
        .map(Vec::into_boxed_slice)
        .collect()
}

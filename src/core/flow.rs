//! The flows that cross the rules, in one place (quinn-proto's
//! `connection/mod.rs` is the model): what happens to the core, from time
//! passing or an input, read top to bottom. Each rule keeps its own state
//! and decides (`heartbeat.rs`, `fate.rs`, `stall.rs`, `identity.rs`, the
//! `Directory`); only this file carries one rule's decision to the next:
//!
//! - a status: `on_status` -> `classify` -> `mark` -> the heartbeats stop
//!   -> the reads failed -> `try_release` -> a `Call::Release`;
//! - a claim: `claim` -> `judge` (`Who::judge` against a live engine) ->
//!   a load granted -> `register` -> `activate` -> the first round (the
//!   handshake flow, whole in `claims.rs`: it shares no step with the
//!   others but the `mark` of a replaced engine and the release it waits
//!   for);
//! - a retirement: `peer_gone`, `member_gone` -> `mark`;
//! - the stall check: `Progress::sample` per engine -> `StallWatch::judge`
//!   -> `stalled` -> `mark`.
//!
//! `docs/architecture.md` walks one heartbeat that finds a dead prefill and
//! one release through it, step by step.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::accounting::ReadAccounting;
use super::directory::Holder;
use super::fate::{classify, fails_reads, marked_state, round_status, step_failed, Verdict};
use super::heartbeat::Renewal;
use super::key::PeerKey;
use super::stall::{stall_check_period, Check, Suspect};
use super::timers::Timer;
use super::{Action, Answer, Call, CallOutcome, Core, Count, Input, Panicked, RoundResults, Wake};
use crate::config::StallAction;
use crate::error::ClaimRefused;
use crate::event::{Event, ReleaseReason, Source};
use crate::give_up::GiveUp;
use crate::names::{AgentName, EngineId};
use crate::registration::{Departure, GoneMode, PeerRef, RegistrationId};
use crate::transport::{ReleaseStep, Suspicion};
use nixl_status::NixlStatus;

impl<R, A: ReadAccounting> Core<R, A> {
    // ---- What happens to the core: time passing, and its inputs ----

    /// Time has passed: serves every timer due at `now`.
    pub(crate) fn handle_timeout(&mut self, now: Instant) {
        if self.timers.is_expired(Timer::Drain, now) {
            self.timers.stop(Timer::Drain);
            self.releases.deadline_passed();
            tracing::warn!("shutdown drain deadline passed: what still has reads in flight is handed back unreleased");
        }
        while let Some((slot, keys)) = self.heartbeats.pop_due(now) {
            for &key in &keys {
                self.peers.warm(key);
            }
            for &key in &keys {
                let Some(peer) = self.peers.at_mut(key) else {
                    continue;
                };
                if peer.beat.take_due(slot) {
                    self.heartbeat_due(now, key, slot);
                }
            }
            self.heartbeats.recycle(keys);
        }
        if let Some(bound) = self.config.read_stall {
            let marking = self.timers.is_expired(Timer::StallMark, now);
            let periodic =
                self.timers
                    .rearm_periodic(Timer::StallCheck, now, stall_check_period(bound));
            if periodic || marking {
                self.check_stalls(now, bound);
            }
        }
        if let Some(period) = self.config.metrics_period {
            if self.timers.rearm_periodic(Timer::Census, now, period) {
                let (by_state, reads) = self.census();
                self.count(Count::Census { by_state, reads });
            }
        }
    }

    /// Handles a batch of call results at `now`, in order. Their records
    /// are touched first, all of them (see [`super::peer::PeerTable::warm`]): at
    /// 10k engines the wait for each result's record was most of the
    /// core's time per heartbeat.
    pub(crate) fn handle_results(&mut self, now: Instant, results: &mut Vec<CallOutcome>) {
        for result in results.iter() {
            if let CallOutcome::Heartbeat { key, .. } = result {
                self.peers.warm(*key);
            }
        }
        for result in results.drain(..) {
            self.handle(now, Input::CallDone(result));
        }
    }

    /// Handles one input at `now`.
    pub(crate) fn handle(&mut self, now: Instant, input: Input<R, A>) {
        match input {
            Input::HandshakeStarted {
                ticket,
                address,
                declared,
            } => self.directory.ticket_started(ticket, address, declared),
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
            } => match ticket {
                Some(ticket) => self.register_loaded(now, request, ticket, registration, cell),
                None => self.register_alone(now, request, registration, cell),
            },
            Input::Read(wake) => self.read_woke(now, wake),
            Input::AddLeases {
                engine,
                requests,
                renew_now,
            } => self.add_leases(now, &engine, requests, renew_now),
            Input::RemoveLeases { engine, requests } => self.remove_leases(&engine, &requests),
            Input::PeerGone { peer, mode } => self.peer_gone(now, peer, mode),
            Input::MemberGone { departure, mode } => self.member_gone(now, departure, mode),
            Input::Suspect(suspicion) => self.suspect(now, suspicion),
            Input::CallDone(CallOutcome::Heartbeat {
                key,
                results,
                agents,
            }) => self.heartbeat_done(now, key, results, agents),
            Input::CallDone(CallOutcome::Release { serial, steps }) => {
                self.release_done(now, serial, steps)
            }
            Input::Shutdown => self.shutdown(now),
        }
    }

    /// A read handle's wake-up: a marked registration's read ended, a
    /// transfer's error status, a read given up or its end.
    fn read_woke(&mut self, now: Instant, wake: Wake) {
        match wake {
            Wake::Drained(serial) => self.try_release(now, serial),
            Wake::TransferResult(serial, status) => {
                self.transfer_may_be_running(serial);
                self.on_status(now, serial, Source::Transfer, None, status)
            }
            Wake::GivenUp {
                serial,
                why,
                unanswered,
                done,
                token,
                blocks,
            } => {
                self.transfer_may_be_running(serial);
                let gauges = self.given_up.given_up(now, serial, token, blocks);
                self.count(gauges);
                self.read_given_up(now, serial, why, unanswered, done)
            }
            Wake::GivenUpEnded { token, over, .. } => {
                for count in self.given_up.ended(now, token, over).into_iter().flatten() {
                    self.count(count);
                }
            }
        }
    }

    // ---- Heartbeats and leases ----

    fn live_serial(&self, id: &EngineId) -> Option<RegistrationId> {
        let serial = self.directory.serial_of(id)?;
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
        peer.beat.add_leases(requests);
        if renew_now {
            self.renew(now, serial);
        }
    }

    fn remove_leases(&mut self, id: &EngineId, requests: &[String]) {
        if let Some(peer) = (self.directory.serial_of(id)).and_then(|s| self.peers.get_mut(&s)) {
            peer.beat.remove_leases(requests);
        }
    }

    /// The transport saw a connection fail: the engine holding its agent
    /// gets a round now (under its rate cap), whose REMOTE_DISCONNECT, if
    /// any, marks it by the usual rules. Nothing is marked here: a live
    /// peer's false alarm costs one round. A failure the transport could
    /// not name checks every live engine.
    fn suspect(&mut self, now: Instant, suspicion: Suspicion) {
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

    /// The round of the record at `key` was due at `due` (the slot's
    /// deadline): the heartbeat rule decides whether it goes now.
    fn heartbeat_due(&mut self, now: Instant, key: PeerKey, due: Instant) {
        let Some(peer) = self.peers.at_mut(key).filter(|p| p.is_live()) else {
            return;
        };
        let agents = peer.who.agents();
        if let Some(call) = self.heartbeats.due(&mut peer.beat, key, now, due, agents) {
            self.calls.push(call);
        }
    }

    /// A round the runtime asked for (a lease renewal, a suspicion) of a
    /// live registration.
    pub(super) fn renew(&mut self, now: Instant, serial: RegistrationId) {
        let key = self.peers.key(serial).expect("live serial");
        let peer = self.peers.at_mut(key).expect("live serial");
        let agents = peer.who.agents();
        match self.heartbeats.renew(&mut peer.beat, key, now, agents) {
            Renewal::Send(call) => self.calls.push(call),
            Renewal::Expedite => self.actions.push_back(Action::Expedite { serial }),
            Renewal::Waiting => {}
        }
    }

    /// A round came back: its status (a REMOTE_DISCONNECT among them
    /// first) goes to the one place statuses are acted on, which may mark
    /// the engine; a renewal that waited for the round goes now.
    fn heartbeat_done(
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
        let Some(peer) = self.peers.at_mut(key) else {
            self.heartbeats.sent(sent);
            return;
        };
        let status = round_status(failed.iter().map(|(_, e)| e.status));
        self.heartbeats
            .round_back(&mut peer.beat, now, sent, agents, status);
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
        if peer.is_live() && peer.beat.wants_renewal() {
            self.renew(now, serial);
        }
    }

    // ---- Statuses: the one place a status is acted on (status) ----

    /// A status from `source` for registration `serial` (and `agent`, for
    /// a heartbeat). The one place a status is acted on.
    fn on_status(
        &mut self,
        now: Instant,
        serial: RegistrationId,
        source: Source,
        agent: Option<&AgentName>,
        status: NixlStatus,
    ) {
        let Some(verdict) = classify(status) else {
            return;
        };
        self.count(Count::StatusError { source, status });
        let Some(peer) = self.peers.get_mut(&serial) else {
            return;
        };
        let engine = peer.id().clone();
        match verdict {
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
                let total = peer.fate.transient_error();
                // One line per engine, status and source per period, with
                // the count it stands for; every one is counted and is an
                // event.
                let key = (serial, status.raw(), source);
                if let Some(suppressed) = self.transient_log.admit(key, now) {
                    tracing::info!(%engine, ?agent, %source, %status, raw = status.raw(), suppressed, total, "an error that is not a disconnect: counted, engine kept");
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

    // ---- Marks and releases ----

    /// Marks a live registration: no new reads, no more heartbeats; its
    /// reads failed where none will complete; released as soon as it is
    /// idle. The first mark stands.
    pub(super) fn mark(&mut self, now: Instant, serial: RegistrationId, reason: ReleaseReason) {
        let Some(key) = self.peers.key(serial) else {
            return;
        };
        let peer = self.peers.at_mut(key).expect("held");
        if !peer.is_live() {
            return;
        }
        let handshakes_before = self.directory.open_at(peer.who.address());
        let state = marked_state(reason);
        let reads = peer.cell.mark(state).unwrap_or(0);
        peer.fate.mark(now, reason, reads, handshakes_before);
        tracing::info!(engine = %peer.id(), registration = %serial, state = state.as_str(), reads_in_flight = reads, "engine marked for release");
        self.heartbeats.stop(&mut peer.beat, key);
        if fails_reads(reason) {
            self.fail_reads(serial);
        }
        self.try_release(now, serial);
    }

    fn fail_reads(&mut self, serial: RegistrationId) {
        let Some(peer) = self.peers.get(&serial) else {
            return;
        };
        let cell = peer.cell.clone();
        let count = cell.reads_in_flight();
        let engine = peer.id().clone();
        self.actions.push_back(Action::FailReads { cell });
        if count > 0 {
            tracing::warn!(%engine, count, "reads in flight failed");
            self.emit(Event::ReadsFailed {
                engine,
                registration: serial,
                count,
            });
        }
    }

    /// A read of the registration was given up, or ended with an error:
    /// its transfer may still be running at the peer, so the release will
    /// leave the engine's connections to UCX ([`crate::transport::Transfers`]).
    fn transfer_may_be_running(&mut self, serial: RegistrationId) {
        if let Some(peer) = self.peers.get_mut(&serial) {
            peer.fate.transfer_may_be_running();
        }
    }

    /// Releases a marked registration if no handshake holds it back
    /// (`Fate::held_by_handshake`) and no read is in flight. Decided here;
    /// the transport is called by the driver after.
    pub(super) fn try_release(&mut self, now: Instant, serial: RegistrationId) {
        let Some(peer) = self.peers.get(&serial) else {
            return;
        };
        if peer.is_live() || peer.is_releasing() {
            return;
        }
        let stopping = self.releases.is_stopping();
        let reload_wanted = self.directory.is_waited_for(peer.id());
        let directory = &self.directory;
        let fate = &mut self.peers.get_mut(&serial).expect("checked").fate;
        if fate.held_by_handshake(stopping, reload_wanted, |t| directory.is_open(t)) {
            let address = self.peers[&serial].who.address().clone();
            self.directory.hold(&address, serial);
            return;
        }
        let peer = self.peers.get_mut(&serial).expect("checked");
        if peer.cell.try_release().is_err() {
            return; // the last read to end wakes us
        }
        let engine = peer.id().clone();
        let (resources, transfers, waited) = peer.fate.hand_over(now);
        tracing::debug!(%engine, ?waited, "releasing");
        let agents = peer.who.agents().clone();
        peer.beat.forget_limiter();
        self.releases.started();
        self.calls.push(Call::Release {
            serial,
            engine,
            agents,
            resources,
            transfers,
        });
    }

    /// A release came back: counted, its failed steps logged, its engine
    /// forgotten by id before the `Released` event goes out.
    fn release_done(
        &mut self,
        now: Instant,
        serial: RegistrationId,
        steps: Result<Vec<ReleaseStep>, Panicked>,
    ) {
        let Some(peer) = self.peers.remove(&serial) else {
            return;
        };
        self.releases.finished();
        let engine = peer.id().clone();
        let (failed_steps, panicked, endpoints_left_open) = match steps {
            Ok(steps) => {
                let (failed, left_open) = self.release_steps(&engine, &steps);
                (failed, false, left_open)
            }
            Err(p) => {
                self.count(Count::TransportPanicked("release"));
                tracing::error!(%engine, message = %p.message, "the transport panicked while releasing: its resources are consumed, not retried");
                self.emit(Event::TransportPanicked {
                    engine: engine.clone(),
                    registration: serial,
                    call: "release",
                    message: p.message,
                });
                (0, true, 0)
            }
        };
        self.actions.push_back(Action::ReleaseFinished {
            cell: peer.cell.clone(),
            transfers_ended: self
                .releases
                .transfers_ended(failed_steps == 0 && !panicked),
        });
        let served = peer.fate.served(now);
        self.count(Count::Released {
            reason: served.reason,
            since_mark: served.since_mark,
        });
        tracing::info!(%engine, registration = %serial, reason = served.reason.as_str(), after = ?served.since_mark, failed_steps, panicked, "engine released");
        // Gone from the directory before the event: whoever sees it finds
        // the successor, if any, never the released registration.
        self.actions.push_back(Action::Forget {
            engine: engine.clone(),
            serial,
        });
        self.emit(Event::Released {
            engine: engine.clone(),
            registration: serial,
            reason: served.reason,
            waited_for: served.waited_for,
            failed_steps,
            panicked,
            endpoints_left_open,
        });
        let who = peer.who;
        self.forget_registration(now, serial, &engine, who.address(), who.agents());
    }

    /// A release's steps: the failed ones (`step_failed`) counted and
    /// logged; the endpoints left open.
    fn release_steps(&mut self, engine: &EngineId, steps: &[ReleaseStep]) -> (usize, u32) {
        let failed: Vec<&ReleaseStep> = steps.iter().filter(|s| step_failed(s)).collect();
        for step in &failed {
            self.count(Count::ReleaseStepFailed(step.status));
            tracing::error!(%engine, target = ?step.target, status = %step.status, raw = step.status.raw(), "release step failed");
        }
        let left_open = steps.iter().map(ReleaseStep::endpoints_left_open).sum();
        (failed.len(), left_open)
    }

    /// The service is stopping: every live registration is marked (each
    /// idle one is released now), what waits is refused, and nothing is
    /// activated any more. [`Core::into_unreleased`] hands back the rest.
    fn shutdown(&mut self, now: Instant) {
        let deadline = now + self.config.shutdown_drain;
        if !self.releases.stop(deadline) {
            return;
        }
        self.timers.set(Timer::Drain, deadline);
        tracing::info!(drain = ?self.config.shutdown_drain, "stopping: marking every engine; each is released as its reads end");
        // Claims waiting for an engine id are refused; granted loads may
        // still register (the service then releases them like the rest).
        for ticket in self.directory.take_waiting() {
            if let Some((_, request)) = self.directory.take_waiting_claim(ticket) {
                self.actions.push_back(Action::Answer {
                    request,
                    answer: Answer::ClaimRefused(ClaimRefused::Stopped(
                        crate::error::ServiceStopped,
                    )),
                });
            }
        }
        let mut serials: Vec<RegistrationId> = self.peers.keys().copied().collect();
        serials.sort_unstable();
        for serial in serials {
            self.mark(now, serial, ReleaseReason::Shutdown);
            // Marked earlier and held by a handshake: not any more.
            self.try_release(now, serial);
        }
        self.directory.clear_holds();
    }

    // ---- Stalls: the periodic check and its marks (stall) ----

    /// The read-stall check (the rule is `stall.rs`'s [`Check`]): every
    /// live engine sampled, then the suspects judged, the stalled marked.
    fn check_stalls(&mut self, now: Instant, bound: Duration) {
        let mut check = Check::new(now, bound);
        for (&serial, peer) in self.peers.iter_mut().filter(|(_, p)| p.is_live()) {
            check.sample(serial, &mut peer.progress, peer.cell.progress());
        }
        self.timers.set_or_stop(Timer::StallMark, check.next_due());
        let outstanding = check.outstanding();
        let judgement = self.stalls.judge(check);
        for suspect in judgement.stalled {
            self.stalled(now, suspect);
        }
        if judgement.stuck_began {
            self.count(Count::DecoderStuck);
            tracing::warn!(
                engines = judgement.unjudged,
                outstanding,
                bound = ?bound,
                "reads of every engine with reads outstanding stopped completing: the decoder itself looks stuck, no engine is blamed (warned once until a read completes again)"
            );
        }
    }

    /// A suspect judged stalled: reported once per stall, and with the
    /// `fail` action marked, its reads failed, released once they end.
    fn stalled(&mut self, now: Instant, suspect: Suspect) {
        let Suspect {
            serial,
            reads,
            quiet,
            given_up,
            ..
        } = suspect;
        let peer = self.peers.get_mut(&serial).expect("judged while live");
        peer.progress.reported();
        let engine = peer.id().clone();
        let action = self.config.stall_action;
        self.count(Count::ReadStall(action.as_str()));
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

    /// The runtime gave up a read of registration `serial` in progress:
    /// not a completion; evidence for the stall rule when unanswered (no
    /// read of the engine completed while it was in flight:
    /// `Progress::given_up`), judged at once when it timed out.
    fn read_given_up(
        &mut self,
        now: Instant,
        serial: RegistrationId,
        why: GiveUp,
        unanswered: bool,
        done: u64,
    ) {
        self.count(Count::ReadGivenUp { why, unanswered });
        let Some(peer) = self.peers.get_mut(&serial) else {
            return;
        };
        if !peer.is_live() || self.config.read_stall.is_none() {
            return;
        }
        let reads = peer.cell.reads_in_flight();
        let engine = peer.id().clone();
        let timed_out = why == GiveUp::TimedOut;
        let Some(unanswered) = peer
            .progress
            .given_up(now, reads, done, unanswered, timed_out)
        else {
            tracing::debug!(%engine, why = why.as_str(), "read given up at an engine that completes reads: not evidence of a stall");
            return;
        };
        tracing::info!(%engine, why = why.as_str(), unanswered, "read given up unanswered: counted against the engine, not as a completion");
        if timed_out {
            self.timers.set(Timer::StallMark, now);
        }
    }

    // ----- retirement by others -----

    /// The router or orchestrator says a peer is gone: authoritative.
    fn peer_gone(&mut self, now: Instant, peer: PeerRef, mode: GoneMode) {
        let serial = match &peer {
            PeerRef::Engine(id) => self.directory.serial_of(id),
            PeerRef::Address(addr) => self.directory.serial_at(addr),
        };
        let Some(serial) = serial.filter(|s| self.peers.contains_key(s)) else {
            tracing::debug!(?peer, "peer gone: not a known peer, nothing to do");
            return;
        };
        self.retire(now, serial, mode);
    }

    /// A membership record went away: the engine is retired unless the
    /// record is not its registration's (`Who::departed`).
    fn member_gone(&mut self, now: Instant, departure: Departure, mode: GoneMode) {
        let Some(serial) = self.directory.serial_of(&departure.engine) else {
            tracing::debug!(engine = %departure.engine, "membership record gone for an engine not registered: nothing to do");
            return;
        };
        let peer = &self.peers[&serial];
        if let Some(conflict) = peer
            .is_live()
            .then(|| peer.who.departed(&departure))
            .flatten()
        {
            self.conflict(conflict, "membership");
            return;
        }
        self.retire(now, serial, mode);
    }

    fn retire(&mut self, now: Instant, serial: RegistrationId, mode: GoneMode) {
        let p = &self.peers[&serial];
        if p.is_live() {
            let engine = p.id().clone();
            tracing::info!(%engine, ?mode, "peer gone: retiring");
            self.emit(Event::Retiring {
                engine,
                registration: serial,
                fail_reads: mode == GoneMode::Fail,
            });
            self.mark(now, serial, ReleaseReason::PeerGone);
        }
        if mode == GoneMode::Fail {
            self.fail_reads(serial);
        }
    }
}

//! The flows that cross the rules, in one place (quinn-proto's
//! `connection/mod.rs` is the model): what happens to the core, from time
//! passing or an input, read top to bottom. Each rule keeps its own state
//! and decides (`heartbeat.rs`, `fate.rs`, `stall.rs`, `identity.rs`, the
//! `Directory`); only this file carries one rule's decision to the next:
//!
//! - a status: `on_status` -> `classify` -> `mark` -> the heartbeats stop
//!   -> the reads failed -> `try_release` -> a `Call::Release`;
//! - a claim: `claim` -> `judge` (`Who::judge` against a live engine) ->
//!   a load granted -> `register` -> `activate` -> the first round;
//! - a retirement: `peer_gone`, `member_gone` -> `mark`;
//! - the stall check: `Progress::sample` per engine -> `StallWatch::judge`
//!   -> `stalled` -> `mark`.
//!
//! `docs/architecture.md` walks one heartbeat that finds a dead prefill and
//! one release through it, step by step.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::accounting::ReadAccounting;
use super::directory::{Holder, Stage, Ticket};
use super::fate::{classify, fails_reads, marked_state, round_status, step_failed, Verdict};
use super::heartbeat::Renewal;
use super::identity::{
    address_in_use, agent_in_use, engine_in_use, malformed, Against, Judged, Who,
};
use super::key::PeerKey;
use super::peer::Peer;
use super::stall::{stall_check_period, Check, Suspect};
use super::timers::Timer;
use super::{
    Action, Answer, Call, CallOutcome, Core, Count, Input, Panicked, RequestId, RoundResults,
    TicketId, Wake,
};
use crate::config::StallAction;
use crate::error::{ClaimRefused, Conflict, RegisterError};
use crate::event::{Event, ReleaseReason, Source};
use crate::give_up::GiveUp;
use crate::names::{AgentName, EngineId, PeerAddr};
use crate::registration::{Claim, Departure, GoneMode, PeerRef, Registration, RegistrationId};
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
    fn renew(&mut self, now: Instant, serial: RegistrationId) {
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
    fn mark(&mut self, now: Instant, serial: RegistrationId, reason: ReleaseReason) {
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
    fn try_release(&mut self, now: Instant, serial: RegistrationId) {
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

    // ---- Handshakes: claims judged before any load (handshake) ----

    /// The conflict of `engine` declaring `address` when a live engine of
    /// another id holds it, if it does; the holder is asked at once (a
    /// heartbeat, under its rate cap) whether it is still there.
    fn declared_address_conflict(
        &mut self,
        now: Instant,
        address: &PeerAddr,
        engine: &EngineId,
    ) -> Option<Conflict> {
        let holder = self.directory.serial_at(address)?;
        let peer = self.peers.get(&holder).filter(|p| p.is_live())?;
        let conflict = address_in_use(engine, address, peer.id())?;
        self.renew(now, holder);
        Some(conflict)
    }

    /// The handshake `ticket` found `claim` at its address.
    fn claim(&mut self, now: Instant, ticket: TicketId, request: RequestId, claim: Claim) {
        if self.releases.is_stopping() {
            self.answer(
                request,
                Answer::ClaimRefused(ClaimRefused::Stopped(crate::error::ServiceStopped)),
            );
            return;
        }
        let Some(t) = self.directory.ticket(ticket) else {
            // Its guard is gone already: nobody waits for the answer.
            self.answer(request, Answer::Withdrawn);
            return;
        };
        if !matches!(t.stage, Stage::Started) {
            self.answer(
                request,
                Answer::ClaimRefused(ClaimRefused::Invalid {
                    engine: claim.engine,
                    reason: "this handshake has claimed an engine already".into(),
                }),
            );
            return;
        }
        if let Some(reason) = malformed(&claim.engine, &claim.agents) {
            tracing::warn!(engine = %claim.engine, address = %t.address, %reason, "handshake claim refused: malformed");
            self.directory.set_stage(ticket, Stage::Answered);
            self.answer(
                request,
                Answer::ClaimRefused(ClaimRefused::Invalid {
                    engine: claim.engine,
                    reason,
                }),
            );
            return;
        }
        let engine = claim.engine.clone();
        if self.directory.has_queue(&engine) {
            // Others came first: in arrival order.
            self.directory
                .set_stage(ticket, Stage::Waiting { claim, request });
            self.directory.queue(&engine, ticket);
            return;
        }
        if let Judged::Wait = self.judge(now, ticket, claim, request) {
            self.directory.queue(&engine, ticket);
        }
    }

    /// Judges a claim against what is registered and loading now. Answers
    /// it, or sets it waiting (the caller queues it).
    fn judge(
        &mut self,
        now: Instant,
        ticket: TicketId,
        claim: Claim,
        request: RequestId,
    ) -> Judged {
        let t = self.directory.ticket(ticket).expect("judged tickets exist");
        let (address, declared) = (t.address.clone(), t.declared);
        let engine = claim.engine.clone();
        if self.directory.is_loading(&engine) {
            return self.wait(ticket, request, claim);
        }
        if let Some(serial) = self.directory.serial_of(&engine) {
            let peer = &self.peers[&serial];
            if peer.is_live() {
                match peer.who.judge(&claim, &address, ticket) {
                    Against::Refused(conflict) => {
                        return self.refuse_claim(ticket, request, conflict)
                    }
                    Against::Current => {
                        let cell = peer.cell.clone();
                        self.directory.set_stage(ticket, Stage::Answered);
                        tracing::debug!(%engine, %address, "handshake found the engine already registered: nothing to load");
                        self.answer(request, Answer::Current(cell));
                        return Judged::Answered;
                    }
                    Against::NewProcess { old, new } => {
                        tracing::info!(%engine, %address, ?old, ?new, "engine answered its handshake as a new process: its registration goes first");
                        // Waited for before the mark: no handshake holds
                        // back the release this claim waits for.
                        self.directory.expect_reload(&engine);
                        self.mark(now, serial, ReleaseReason::Reregistered);
                    }
                }
            }
            // Marked now or before: it is released (its reads drained)
            // before this claim is judged again. A handshake does not hold
            // it back: this one waits for exactly that release.
            let judged = self.wait(ticket, request, claim);
            self.directory.expect_reload(&engine);
            self.try_release(now, serial);
            return judged;
        }
        let address_conflict = declared
            .then(|| self.declared_address_conflict(now, &address, &engine))
            .flatten();
        if let Some(conflict) =
            address_conflict.or_else(|| self.agent_conflict(&engine, &claim.agents))
        {
            return self.refuse_claim(ticket, request, conflict);
        }
        self.directory.grant(ticket, claim);
        self.answer(request, Answer::Load);
        Judged::Answered
    }

    /// The claim waits for its engine id (a load in progress, or a release).
    fn wait(&mut self, ticket: TicketId, request: RequestId, claim: Claim) -> Judged {
        let stage = Stage::Waiting { claim, request };
        self.directory.set_stage(ticket, stage);
        Judged::Wait
    }

    fn refuse_claim(&mut self, ticket: TicketId, request: RequestId, conflict: Conflict) -> Judged {
        self.directory.set_stage(ticket, Stage::Answered);
        self.conflict(conflict.clone(), "handshake");
        self.answer(
            request,
            Answer::ClaimRefused(ClaimRefused::Conflict(conflict)),
        );
        Judged::Answered
    }

    /// The loading handshake `ticket` claims one more agent name (NIXL's
    /// load named another agent than the reply did: the runtime may unload
    /// it only if it is its own).
    fn claim_agent(&mut self, ticket: TicketId, request: RequestId, agent: AgentName) {
        let Some(Ticket {
            stage: Stage::Loading { claim, extra },
            ..
        }) = self.directory.ticket(ticket)
        else {
            self.answer(request, Answer::Withdrawn);
            return;
        };
        let engine = claim.engine.clone();
        if claim.agents.contains(&agent) || extra.contains(&agent) {
            self.answer(request, Answer::AgentClaimed(Ok(())));
            return;
        }
        if let Some(holder) = self.holder_of(&agent).cloned() {
            let conflict = Conflict::AgentInUse {
                agent,
                claimed_by: engine,
                holder,
            };
            self.conflict(conflict.clone(), "handshake");
            self.answer(request, Answer::AgentClaimed(Err(conflict)));
            return;
        }
        self.directory.claim_extra(ticket, agent);
        self.answer(request, Answer::AgentClaimed(Ok(())));
    }

    /// The handshake `ticket` ended (registered, or dropped at any step).
    fn handshake_finished(&mut self, now: Instant, ticket: TicketId) {
        let Some(t) = self.directory.end_ticket(ticket) else {
            return;
        };
        match t.stage {
            Stage::Started | Stage::Answered => {}
            Stage::Waiting { request, .. } => self.answer(request, Answer::Withdrawn),
            // Its load is over: the claims waiting for the id are next.
            Stage::Loading { claim, .. } => self.engine_moved(now, claim.engine),
        }
        // The registrations this address holds back are judged again:
        // each that is still held goes back on the list.
        for serial in self.directory.handshake_gone(&t.address) {
            self.try_release(now, serial);
        }
    }

    /// Something changed for `engine` (a load ended, a registration was
    /// released): the claims waiting for it are judged again, in order,
    /// until one must wait again.
    fn engine_moved(&mut self, now: Instant, engine: EngineId) {
        while let Some(ticket) = self.directory.next_waiting(&engine) {
            let Some((claim, request)) = self.directory.take_waiting_claim(ticket) else {
                continue;
            };
            if let Judged::Wait = self.judge(now, ticket, claim, request) {
                self.directory.requeue_first(&engine, ticket);
                return;
            }
        }
        self.directory.queue_served(&engine);
    }

    // ---- Identity: registrations, activations, retirements (identity) ----

    /// Records a conflict: counted every time; logged and published as
    /// the [`ConflictLog`](super::identity::ConflictLog) decides.
    fn conflict(&mut self, conflict: Conflict, source: &'static str) {
        self.count(Count::IdentityConflict(conflict.kind()));
        if self.conflicts.note(&conflict, source) {
            self.emit(Event::Conflict { conflict });
        }
    }

    /// The engine holding an agent name, if anyone does.
    fn holder_of(&self, agent: &AgentName) -> Option<&EngineId> {
        match self.directory.holder(agent)? {
            Holder::Registration(serial) => self.peers.get(&serial).map(|p| p.id()),
            Holder::Load(ticket) => self.directory.loading_engine(ticket),
        }
    }

    /// The first agent of `agents` held by an engine other than `engine`.
    fn agent_conflict(&self, engine: &EngineId, agents: &[AgentName]) -> Option<Conflict> {
        agent_in_use(engine, agents, |agent| self.holder_of(agent))
    }

    // ----- registrations -----

    /// A registration through the handshake `ticket` whose claim was
    /// granted.
    fn register_loaded(
        &mut self,
        now: Instant,
        request: RequestId,
        ticket: TicketId,
        registration: Registration<R>,
        cell: Arc<A>,
    ) {
        let Some(declared) = self.directory.granted(ticket, &registration) else {
            let error = RegisterError::Invalid {
                registration,
                reason: "it is not what its handshake claimed".into(),
            };
            tracing::warn!(%error, "registration refused");
            self.answer(request, Answer::Refused(error));
            self.handshake_finished(now, ticket);
            return;
        };
        // Another engine may have registered at a declared address since
        // the claim was granted (two declaring it at once).
        let conflict = declared
            .then(|| {
                self.declared_address_conflict(now, &registration.address, &registration.engine)
            })
            .flatten();
        if let Some(conflict) = conflict {
            self.conflict(conflict.clone(), "register");
            let error = RegisterError::Conflict {
                registration,
                conflict,
            };
            self.answer(request, Answer::Refused(error));
            self.handshake_finished(now, ticket);
            return;
        }
        let engine = registration.engine.clone();
        let serial = cell.serial();
        self.directory.load_registered(ticket, &engine);
        self.activate(now, request, registration, cell);
        if self.releases.is_stopping() {
            // Loaded under a granted claim while the service stopped: the
            // service owns it now and gives it back like every other.
            self.mark(now, serial, ReleaseReason::Shutdown);
        }
        self.handshake_finished(now, ticket);
        self.engine_moved(now, engine);
    }

    /// A registration on its own: claimed and activated at once.
    fn register_alone(
        &mut self,
        now: Instant,
        request: RequestId,
        registration: Registration<R>,
        cell: Arc<A>,
    ) {
        if self.releases.is_stopping() {
            self.answer(
                request,
                Answer::Refused(RegisterError::Stopped(registration)),
            );
            return;
        }
        if let Some(reason) = malformed(&registration.engine, &registration.agents) {
            let error = RegisterError::Invalid {
                registration,
                reason,
            };
            tracing::warn!(%error, "registration refused");
            self.answer(request, Answer::Refused(error));
            return;
        }
        let engine = &registration.engine;
        let registered = self.directory.serial_of(engine);
        let conflict = engine_in_use(
            engine,
            registered.map(|s| self.peers[&s].who.address()),
            self.directory.load_address(engine),
            self.directory.is_waited_for(engine),
            &registration.address,
        )
        .or_else(|| self.agent_conflict(engine, &registration.agents));
        if let Some(conflict) = conflict {
            self.conflict(conflict.clone(), "register");
            self.answer(
                request,
                Answer::Refused(RegisterError::Conflict {
                    registration,
                    conflict,
                }),
            );
            return;
        }
        self.activate(now, request, registration, cell);
    }

    fn activate(
        &mut self,
        now: Instant,
        request: RequestId,
        registration: Registration<R>,
        cell: Arc<A>,
    ) {
        let serial = cell.serial();
        let Registration {
            engine,
            incarnation,
            address,
            agents,
            resources,
        } = registration;
        tracing::info!(%engine, %address, ?incarnation, agents = agents.len(), registration = %serial, "engine registered");
        self.conflicts.forget(&engine);
        let previous = self.directory.activate(serial, &engine, &address, &agents);
        let who = Who::new(
            address.clone(),
            incarnation,
            agents,
            self.directory.newest_ticket(),
        );
        self.peers
            .insert(serial, Peer::new(cell.clone(), who, resources));
        let key = self.peers.key(serial).expect("just inserted");
        let peer = self.peers.at_mut(key).expect("just inserted");
        self.heartbeats.first(&mut peer.beat, key, now);
        // In the directory first, then the event, then the caller's answer:
        // whoever sees the event finds the engine by id, and whoever holds
        // the answer can already see the event.
        self.actions
            .push_back(Action::Activated { cell: cell.clone() });
        self.emit(Event::Registered {
            engine: engine.clone(),
            registration: serial,
            address: address.clone(),
        });
        self.answer(request, Answer::Registered(cell));
        if let Some(old) = previous {
            if let Some(old_peer) = self.peers.get(&old) {
                let old_id = old_peer.id().clone();
                if old_id != engine && old_peer.is_live() {
                    tracing::warn!(old = %old_id, new = %engine, %address, "a new engine id answered at a known address: the old engine was replaced");
                    self.emit(Event::Replaced {
                        old: old_id,
                        old_registration: old,
                        new: engine.clone(),
                        address,
                    });
                    self.mark(now, old, ReleaseReason::Replaced);
                }
            }
        }
    }

    /// A registration was released: its names and its id are free.
    fn forget_registration(
        &mut self,
        now: Instant,
        serial: RegistrationId,
        engine: &EngineId,
        address: &PeerAddr,
        agents: &[AgentName],
    ) {
        if self.directory.forget(serial, engine, address, agents) {
            self.engine_moved(now, engine.clone());
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

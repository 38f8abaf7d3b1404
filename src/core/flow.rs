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
use super::fate::{classify, fails_reads, marked_state, Verdict};
use super::heartbeat::Renewal;
use super::identity::{malformed, Against, Judged, Notice, Who};
use super::key::PeerKey;
use super::peer::Peer;
use super::stall::{stall_check_period, Quiet, Suspect};
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
use crate::snapshot::{EngineSnapshot, HeartbeatSnapshot, Snapshot};
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
            } => self.handshake_started(ticket, address, declared),
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
        peer.beat.add_leases(requests);
        if renew_now {
            self.renew(now, serial);
        }
    }

    pub(super) fn remove_leases(&mut self, id: &EngineId, requests: &[String]) {
        if let Some(peer) = (self.directory.serial_of(id)).and_then(|s| self.peers.get_mut(&s)) {
            peer.beat.remove_leases(requests);
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
        let Some(peer) = self.peers.at_mut(key) else {
            self.heartbeats.sent(sent);
            return;
        };
        let status = failed
            .iter()
            .map(|(_, e)| e.status)
            .find(|s| s.is_remote_disconnect())
            .or(failed.first().map(|(_, e)| e.status))
            .unwrap_or(NixlStatus::SUCCESS);
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
    pub(super) fn on_status(
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
        self.count(Count::StatusError { source, status });
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

    pub(super) fn fail_reads(&mut self, serial: RegistrationId) {
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
    pub(super) fn transfer_may_be_running(&mut self, serial: RegistrationId) {
        if let Some(peer) = self.peers.get_mut(&serial) {
            peer.fate.transfer_may_be_running();
        }
    }

    /// Releases a marked registration if no read is in flight and no
    /// handshake holds it back. Decided here; the transport is called by
    /// the driver after.
    pub(super) fn try_release(&mut self, now: Instant, serial: RegistrationId) {
        let Some(peer) = self.peers.get(&serial) else {
            return;
        };
        if peer.is_live() || peer.is_releasing() {
            return;
        }
        // A handshake that was pending when the engine was marked may yet
        // decide the engine at this address is new, so the old one waits;
        // not for a handshake begun after the mark (a loop of them would
        // hold a dead prefill's memory for as long as it runs), not when
        // somebody is waiting to load this very engine id again (they wait
        // for this release), and not once the service is stopping
        // (nothing new will register).
        let held = !self.releases.is_stopping()
            && peer
                .fate
                .handshakes_before()
                .iter()
                .any(|&t| self.directory.is_open(t))
            && !self.reload_wanted(peer.id());
        if held {
            let address = peer.who.address().clone();
            self.peers.get_mut(&serial).expect("checked").fate.held();
            self.directory.hold(&address, serial);
            return;
        }
        if peer.cell.try_release().is_err() {
            return; // the last read to end wakes us
        }
        let peer = self.peers.get_mut(&serial).expect("checked");
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
    pub(super) fn release_done(
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

    /// A release's steps: the failed ones (a NIXL `NOT_FOUND` counts as
    /// released: NIXL had dropped it already) counted and logged; the
    /// endpoints left open.
    fn release_steps(&mut self, engine: &EngineId, steps: &[ReleaseStep]) -> (usize, u32) {
        let mut failed = 0;
        let mut endpoints_left_open = 0u32;
        for step in steps {
            endpoints_left_open += step.endpoints_left_open();
            if step.status == NixlStatus::ERR_NOT_FOUND {
                tracing::debug!(%engine, target = ?step.target, "already dropped by NIXL: counts as released");
            } else if !step.status.is_ok() {
                failed += 1;
                self.count(Count::ReleaseStepFailed(step.status));
                tracing::error!(%engine, target = ?step.target, status = %step.status, raw = step.status.raw(), "release step failed");
            }
        }
        (failed, endpoints_left_open)
    }

    /// The service is stopping: every live registration is marked (each
    /// idle one is released now), what waits is refused, and nothing is
    /// activated any more. [`Core::into_unreleased`] hands back the rest.
    pub(super) fn shutdown(&mut self, now: Instant) {
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

    // ---- Stalls: the periodic check and its marks (stall) ----

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
    pub(super) fn check_stalls(&mut self, now: Instant, bound: Duration) {
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
            let sample = peer.progress.sample(now, reads, done, bound, window);
            outstanding += usize::from(sample.outstanding);
            completing += usize::from(sample.completing);
            match sample.quiet {
                Quiet::No => {}
                Quiet::Suspect { quiet, given_up } => suspects.push(Suspect {
                    serial,
                    reads,
                    quiet,
                    given_up,
                    completing: sample.completing,
                }),
                Quiet::JudgedAt(due) => next_due = Some(next_due.map_or(due, |d| d.min(due))),
            }
        }
        self.timers.set_or_stop(Timer::StallMark, next_due);
        let judgement = self.stalls.judge(suspects, outstanding, completing);
        for suspect in judgement.stalled {
            self.stalled(
                now,
                suspect.serial,
                suspect.reads,
                suspect.quiet,
                suspect.given_up,
            );
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
    pub(super) fn stalled(
        &mut self,
        now: Instant,
        serial: RegistrationId,
        reads: u64,
        quiet: Duration,
        given_up: u64,
    ) {
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

    /// The runtime gave up a read of registration `serial` in progress.
    /// Not a completion. Unanswered (no read of the engine completed while
    /// it was in flight: the read's own count at its begin against the
    /// count now), it is evidence: it keeps the engine's quiet stretch going
    /// with no read in flight, and a timed-out one is judged at once.
    /// Completions the core has not sampled yet are taken in first, but
    /// they do not answer the read: they may predate its begin (a read
    /// that began after the last completion of a prefill that then froze,
    /// and timed out before the next stall check, is still unanswered).
    /// The read's count cannot have wrapped while it was in flight: that
    /// takes 2^36 completions of one engine during one read.
    pub(super) fn read_given_up(
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

    pub(super) fn handshake_started(
        &mut self,
        ticket: TicketId,
        address: PeerAddr,
        declared: bool,
    ) {
        self.directory.ticket_started(ticket, address, declared);
    }

    /// The conflict of `engine` declaring `address` when a live engine of
    /// another id holds it, if it does; the holder is asked at once (a
    /// heartbeat, under its rate cap) whether it is still there.
    pub(super) fn declared_address_conflict(
        &mut self,
        now: Instant,
        address: &PeerAddr,
        engine: &EngineId,
    ) -> Option<Conflict> {
        let holder = self.directory.serial_at(address)?;
        let peer = self.peers.get(&holder)?;
        if !peer.is_live() || peer.id() == engine {
            return None;
        }
        let conflict = Conflict::AddressInUse {
            address: address.clone(),
            claimed_by: engine.clone(),
            holder: peer.id().clone(),
        };
        self.renew(now, holder);
        Some(conflict)
    }

    /// The handshake `ticket` found `claim` at its address.
    pub(super) fn claim(
        &mut self,
        now: Instant,
        ticket: TicketId,
        request: RequestId,
        claim: Claim,
    ) {
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
    pub(super) fn claim_agent(&mut self, ticket: TicketId, request: RequestId, agent: AgentName) {
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
    pub(super) fn handshake_finished(&mut self, now: Instant, ticket: TicketId) {
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
    pub(super) fn engine_moved(&mut self, now: Instant, engine: EngineId) {
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

    /// Someone waits to load `engine`: its registration must not be held
    /// back by a handshake (they wait for exactly that release).
    pub(super) fn reload_wanted(&self, engine: &EngineId) -> bool {
        self.directory.is_waited_for(engine)
    }

    // ---- Identity: registrations, activations, retirements (identity) ----

    pub(super) fn answer(&mut self, request: RequestId, answer: Answer<R, A>) {
        self.actions.push_back(Action::Answer { request, answer });
    }

    /// Records a conflict: counted every time (the metric, and the count
    /// kept in the [`super::identity::ConflictLog`]), logged at WARN and published the
    /// first time only; the repeats are DEBUG lines with the running count.
    /// The WARN is keyed by engine and kind, not by the whole conflict
    /// (see [`Notice::New`]); each is still an event and counted.
    pub(super) fn conflict(&mut self, conflict: Conflict, source: &'static str) {
        self.count(Count::IdentityConflict(conflict.kind()));
        let kind = conflict.kind();
        match self.conflicts.record(&conflict) {
            Notice::Again { times } => {
                tracing::debug!(kind, source, %conflict, times, "identity conflict again");
                return;
            }
            Notice::New { distinct: 1, .. } => {
                tracing::warn!(kind, source, %conflict, "identity conflict: the newcomer is refused, the registered engine kept (logged once per engine and kind; counted in nixl_keepalive_identity_conflicts_total)");
            }
            Notice::New {
                distinct,
                warn: true,
            } => {
                tracing::warn!(kind, source, %conflict, distinct, "identity conflicts of this engine and kind so far (the others at DEBUG)");
            }
            Notice::New {
                distinct,
                warn: false,
            } => {
                tracing::debug!(kind, source, %conflict, distinct, "another identity conflict of this engine and kind");
            }
        }
        self.emit(Event::Conflict { conflict });
    }

    /// The engine holding an agent name, if anyone does.
    pub(super) fn holder_of(&self, agent: &AgentName) -> Option<&EngineId> {
        match self.directory.holder(agent)? {
            Holder::Registration(serial) => self.peers.get(&serial).map(|p| p.id()),
            Holder::Load(ticket) => self.directory.loading_engine(ticket),
        }
    }

    /// The first agent of `agents` held by an engine other than `engine`.
    pub(super) fn agent_conflict(
        &self,
        engine: &EngineId,
        agents: &[AgentName],
    ) -> Option<Conflict> {
        agents.iter().find_map(|agent| {
            let holder = self.holder_of(agent)?;
            (holder != engine).then(|| Conflict::AgentInUse {
                agent: agent.clone(),
                claimed_by: engine.clone(),
                holder: holder.clone(),
            })
        })
    }

    // ----- registrations -----

    /// A registration: through the handshake `ticket` whose claim was
    /// granted, or on its own (claimed and activated at once).
    pub(super) fn register(
        &mut self,
        now: Instant,
        request: RequestId,
        ticket: Option<TicketId>,
        registration: Registration<R>,
        cell: Arc<A>,
    ) {
        match ticket {
            Some(ticket) => self.register_loaded(now, request, ticket, registration, cell),
            None => self.register_alone(now, request, registration, cell),
        }
    }

    pub(super) fn register_loaded(
        &mut self,
        now: Instant,
        request: RequestId,
        ticket: TicketId,
        registration: Registration<R>,
        cell: Arc<A>,
    ) {
        let (granted, declared) = match self.directory.ticket(ticket) {
            Some(Ticket {
                stage: Stage::Loading { claim, .. },
                address,
                declared,
            }) => (
                *claim == registration.claim() && *address == registration.address,
                *declared,
            ),
            _ => (false, false),
        };
        if !granted {
            let error = RegisterError::Invalid {
                registration,
                reason: "it is not what its handshake claimed".into(),
            };
            tracing::warn!(%error, "registration refused");
            self.answer(request, Answer::Refused(error));
            self.handshake_finished(now, ticket);
            return;
        }
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

    pub(super) fn register_alone(
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
        let in_use = self
            .directory
            .serial_of(engine)
            .map(|s| self.peers[&s].who.address().clone())
            .or_else(|| self.directory.load_address(engine).cloned())
            .or_else(|| {
                self.directory
                    .is_waited_for(engine)
                    .then(|| registration.address.clone())
            });
        let conflict = match in_use {
            Some(address) => Some(Conflict::EngineInUse {
                engine: engine.clone(),
                address,
            }),
            None => self.agent_conflict(engine, &registration.agents),
        };
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

    pub(super) fn activate(
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
    pub(super) fn forget_registration(
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
    pub(super) fn peer_gone(&mut self, now: Instant, peer: PeerRef, mode: GoneMode) {
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

    /// A membership record went away: the engine is retired only if the
    /// record is its own registration's (same address, and the same
    /// incarnation when both are known). Anything else is a conflict.
    pub(super) fn member_gone(&mut self, now: Instant, departure: Departure, mode: GoneMode) {
        let Some(serial) = self.directory.serial_of(&departure.engine) else {
            tracing::debug!(engine = %departure.engine, "membership record gone for an engine not registered: nothing to do");
            return;
        };
        let peer = &self.peers[&serial];
        if peer.is_live() {
            let conflict = if *peer.who.address() != departure.address {
                Some(Conflict::RecordAddress {
                    engine: departure.engine.clone(),
                    record: departure.address.clone(),
                    registered: peer.who.address().clone(),
                })
            } else {
                match (departure.incarnation, peer.who.incarnation()) {
                    (Some(record), Some(registered)) if record != registered => {
                        Some(Conflict::RecordIncarnation {
                            engine: departure.engine.clone(),
                            record,
                            registered,
                        })
                    }
                    _ => None,
                }
            };
            if let Some(conflict) = conflict {
                self.conflict(conflict, "membership");
                return;
            }
        }
        self.retire(now, serial, mode);
    }

    pub(super) fn retire(&mut self, now: Instant, serial: RegistrationId, mode: GoneMode) {
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

    // ---- The table as the operator reads it: why each engine is kept, and the gauges' counts (report) ----

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

    pub(super) fn engine_snapshot(&self, now: Instant, p: &Peer<R, A>) -> EngineSnapshot {
        let reads = p.cell.reads_in_flight();
        let last_heartbeat = p.beat.last().map(|(at, status)| HeartbeatSnapshot {
            ago: now.saturating_duration_since(at),
            status,
        });
        let why = match p.fate.reason() {
            None => {
                let last = match &last_heartbeat {
                    Some(h) => format!("last heartbeat {} {:?} ago", h.status.name(), h.ago),
                    None => "no heartbeat yet".to_string(),
                };
                let reads_note = p.progress.note(now, reads, self.config.read_stall);
                format!(
                    "live: no REMOTE_DISCONNECT seen ({last}); {reads_note}; a silent peer is reported by UCX: {}",
                    self.silent_peer_note
                )
            }
            Some(_) if p.is_releasing() => {
                "releasing: the transport is giving back its NIXL state".into()
            }
            Some(reason) => {
                let mut held = Vec::new();
                if reads > 0 {
                    held.push(format!("{reads} read(s) in flight"));
                }
                if let Some((n, oldest)) = self.given_up.oldest(now, p.cell.serial()) {
                    held.push(format!(
                        "{n} given-up transfer(s) to end (they complete if it resumes, fail if it dies; the oldest held {oldest:?})"
                    ));
                }
                if let Some(n) = self.directory.holding(p.who.address(), p.cell.serial()) {
                    held.push(format!("{n} handshake(s) pending at {}", p.who.address()));
                }
                format!(
                    "{}: release waits for {}",
                    reason.as_str(),
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
            address: p.who.address().clone(),
            incarnation: p.who.incarnation(),
            agents: p.who.agents().to_vec(),
            state: p.cell.state(),
            reads_in_flight: reads,
            given_up: self.given_up.of(now, p.cell.serial()),
            leases: p.beat.leases().cloned().collect(),
            last_heartbeat,
            next_heartbeat_in: p.beat.next().map(|at| at.saturating_duration_since(now)),
            transient_errors: p.fate.transient_errors(),
            why,
        }
    }
}

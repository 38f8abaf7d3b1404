//! The handshake flow, every step of it in order (the other flows are in
//! `flow.rs`): a handshake's claim judged against what is registered and
//! loading (`claim` -> `judge`: `Who::judge` against a live engine, the
//! declared address, the agent names), a load granted or waiting for its
//! engine id, then the registration (`register_loaded`, `register_alone`)
//! -> `activate` -> the engine's first heartbeat round; and, at a release,
//! its names and id freed for the claims waiting on them. Each decision is
//! its rule's (`identity.rs`, the `Directory`); this file carries one to
//! the next.

use std::sync::Arc;
use std::time::Instant;

use super::accounting::ReadAccounting;
use super::directory::{Holder, Stage, Ticket};
use super::identity::{
    address_in_use, agent_in_use, engine_in_use, malformed, Against, Judged, Who,
};
use super::peer::Peer;
use super::{Action, Answer, Core, Count, RequestId, TicketId};
use crate::error::{ClaimRefused, Conflict, RegisterError};
use crate::event::{Event, ReleaseReason};
use crate::names::{AgentName, EngineId, PeerAddr};
use crate::registration::{Claim, Registration, RegistrationId};

impl<R, A: ReadAccounting> Core<R, A> {
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
    pub(super) fn conflict(&mut self, conflict: Conflict, source: &'static str) {
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
    pub(super) fn register_loaded(
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
}

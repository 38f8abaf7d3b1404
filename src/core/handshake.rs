//! Handshakes in progress: each a ticket at an address, its claim judged
//! against the identities ([`super::identity`]) before anything is loaded,
//! one load in progress per engine id (later claims wait in order), and
//! what a handshake that ends leaves to judge again (the releases its
//! address held back).
//!
//! **A declared address is not evidence.** A handshake the runtime made by
//! reaching an address (pull mode: the decode dials the prefill; the
//! `decode --push` pair: the prefill dials the decode) learns who answers
//! there, so a new engine id there replaces the old one. A peer that
//! *declares* its address (SGLang's decode registers its own
//! `rank_ip:rank_port`) says only what it claims: two hosts advertising one
//! address would otherwise get a healthy engine released. Its claim at an
//! address a live engine of another id holds is refused as
//! [`Conflict::AddressInUse`], and the holder is asked at once (a
//! heartbeat): a holder that is gone answers REMOTE_DISCONNECT and is
//! released, and a claim after that is granted; a live one stays.

use std::time::Instant;

use super::directory::{Stage, Ticket};
use super::identity::{malformed, Judged};
use super::{Answer, Core, RequestId, TicketId};
use crate::error::{ClaimRefused, Conflict};
use crate::event::ReleaseReason;
use crate::registration::Claim;
use crate::transport::{AgentName, EngineId, PeerAddr};

impl<R> Core<R> {
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
        let wait = |core: &mut Self, claim: Claim| {
            let stage = Stage::Waiting { claim, request };
            core.directory.set_stage(ticket, stage);
            Judged::Wait
        };
        if self.directory.is_loading(&engine) {
            return wait(self, claim);
        }
        if let Some(serial) = self.directory.serial_of(&engine) {
            let peer = &self.peers[&serial];
            if peer.is_live() {
                if peer.address != address {
                    let conflict = Conflict::EngineElsewhere {
                        engine,
                        address,
                        live_at: peer.address.clone(),
                    };
                    return self.refuse_claim(ticket, request, conflict);
                }
                match (claim.incarnation, peer.incarnation) {
                    (Some(new), Some(old)) if new == old => {
                        if *claim.agents != *peer.agents {
                            let conflict = Conflict::AgentsChanged {
                                engine,
                                incarnation: new,
                            };
                            return self.refuse_claim(ticket, request, conflict);
                        }
                        let cell = peer.cell.clone();
                        self.directory.set_stage(ticket, Stage::Answered);
                        tracing::debug!(%engine, %address, "handshake found the engine already registered: nothing to load");
                        self.answer(request, Answer::Current(cell));
                        return Judged::Answered;
                    }
                    (_, registered) if ticket <= peer.registered_after => {
                        let conflict = Conflict::StaleReply {
                            engine,
                            address,
                            registered,
                        };
                        return self.refuse_claim(ticket, request, conflict);
                    }
                    (new, old) => {
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
            let judged = wait(self, claim);
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
}

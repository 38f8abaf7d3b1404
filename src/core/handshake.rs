//! Handshakes in progress: each a ticket at an address, its claim judged
//! against the identities ([`super::identity`]) before anything is loaded,
//! one load in progress per engine id (later claims wait in order), and
//! what a handshake that ends leaves to judge again (the releases its
//! address held back).

use std::collections::VecDeque;

use std::time::Instant;

use super::identity::{malformed, Holder, Judged, Stage, Ticket};
use super::{Answer, Core, RequestId, TicketId};
use crate::error::{ClaimRefused, Conflict};
use crate::event::ReleaseReason;
use crate::registration::Claim;
use crate::transport::{AgentName, EngineId, PeerAddr};

impl<R> Core<R> {
    pub(super) fn handshake_started(&mut self, ticket: TicketId, address: PeerAddr) {
        self.newest_ticket = self.newest_ticket.max(ticket);
        *self.handshakes.entry(address.clone()).or_default() += 1;
        self.tickets.insert(
            ticket,
            Ticket {
                address,
                stage: Stage::Started,
            },
        );
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
        let Some(t) = self.tickets.get_mut(&ticket) else {
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
            t.stage = Stage::Answered;
            tracing::warn!(engine = %claim.engine, address = %t.address, %reason, "handshake claim refused: malformed");
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
        if self.waiting.get(&engine).is_some_and(|q| !q.is_empty()) {
            // Others came first: in arrival order.
            t.stage = Stage::Waiting { claim, request };
            self.waiting.entry(engine).or_default().push_back(ticket);
            return;
        }
        if let Judged::Wait = self.judge(now, ticket, claim, request) {
            self.waiting.entry(engine).or_default().push_back(ticket);
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
        let address = self.tickets[&ticket].address.clone();
        let engine = claim.engine.clone();
        let wait = |core: &mut Self, claim: Claim| {
            core.tickets
                .get_mut(&ticket)
                .expect("judged tickets exist")
                .stage = Stage::Waiting { claim, request };
            Judged::Wait
        };
        if self.loads.contains_key(&engine) {
            return wait(self, claim);
        }
        if let Some(&serial) = self.by_id.get(&engine) {
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
                        self.tickets.get_mut(&ticket).expect("exists").stage = Stage::Answered;
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
                        self.waiting.entry(engine.clone()).or_default();
                        self.mark(now, serial, ReleaseReason::Reregistered);
                    }
                }
            }
            // Marked now or before: it is released (its reads drained)
            // before this claim is judged again. A handshake does not hold
            // it back: this one waits for exactly that release.
            let judged = wait(self, claim);
            self.waiting.entry(engine).or_default();
            self.try_release(now, serial);
            return judged;
        }
        if let Some(conflict) = self.agent_conflict(&engine, &claim.agents) {
            return self.refuse_claim(ticket, request, conflict);
        }
        self.loads.insert(engine, ticket);
        for agent in &claim.agents {
            self.agents.insert(agent.clone(), Holder::Load(ticket));
        }
        self.tickets.get_mut(&ticket).expect("exists").stage = Stage::Loading {
            claim,
            extra: Vec::new(),
        };
        self.answer(request, Answer::Load);
        Judged::Answered
    }

    fn refuse_claim(&mut self, ticket: TicketId, request: RequestId, conflict: Conflict) -> Judged {
        self.tickets.get_mut(&ticket).expect("exists").stage = Stage::Answered;
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
        }) = self.tickets.get(&ticket)
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
        self.agents.insert(agent.clone(), Holder::Load(ticket));
        if let Some(Ticket {
            stage: Stage::Loading { extra, .. },
            ..
        }) = self.tickets.get_mut(&ticket)
        {
            extra.push(agent);
        }
        self.answer(request, Answer::AgentClaimed(Ok(())));
    }

    /// The handshake `ticket` ended (registered, or dropped at any step).
    pub(super) fn handshake_finished(&mut self, now: Instant, ticket: TicketId) {
        let Some(t) = self.tickets.remove(&ticket) else {
            return;
        };
        match t.stage {
            Stage::Started | Stage::Answered => {}
            Stage::Waiting { claim, request } => {
                if let Some(queue) = self.waiting.get_mut(&claim.engine) {
                    queue.retain(|&w| w != ticket);
                    if queue.is_empty() {
                        self.waiting.remove(&claim.engine);
                    }
                }
                self.answer(request, Answer::Withdrawn);
            }
            Stage::Loading { claim, extra } => {
                // Dropped after its claim was granted: whatever it loaded,
                // the runtime gives back; the names are free again.
                for agent in claim.agents.iter().chain(&extra) {
                    if self.agents.get(agent) == Some(&Holder::Load(ticket)) {
                        self.agents.remove(agent);
                    }
                }
                if self.loads.get(&claim.engine) == Some(&ticket) {
                    self.loads.remove(&claim.engine);
                }
                self.engine_moved(now, claim.engine);
            }
        }
        let count = self
            .handshakes
            .get_mut(&t.address)
            .expect("every ticket counts at its address");
        *count -= 1;
        if *count == 0 {
            self.handshakes.remove(&t.address);
        }
        // The registrations this address holds back are judged again: a
        // handshake begun before their mark may have been the last that
        // held them, whatever later ones are still open (each that is
        // still held goes back on the list).
        for serial in self
            .held_by_handshake
            .remove(&t.address)
            .unwrap_or_default()
        {
            self.try_release(now, serial);
        }
        // A burst of handshakes (10,000 members joining) leaves these
        // tables sized for the burst; they give their buckets back.
        crate::shrink::after_removal(&mut self.tickets);
        crate::shrink::after_removal(&mut self.handshakes);
        crate::shrink::after_removal(&mut self.held_by_handshake);
        crate::shrink::after_removal(&mut self.loads);
        crate::shrink::after_removal(&mut self.waiting);
        crate::shrink::after_removal(&mut self.agents);
    }

    /// Something changed for `engine` (a load ended, a registration was
    /// released): the claims waiting for it are judged again, in order,
    /// until one must wait again.
    pub(super) fn engine_moved(&mut self, now: Instant, engine: EngineId) {
        while let Some(ticket) = self.waiting.get_mut(&engine).and_then(VecDeque::pop_front) {
            let Some(Ticket {
                stage: stage @ Stage::Waiting { .. },
                ..
            }) = self.tickets.get_mut(&ticket)
            else {
                continue;
            };
            let Stage::Waiting { claim, request } = std::mem::replace(stage, Stage::Answered)
            else {
                unreachable!("matched above")
            };
            if let Judged::Wait = self.judge(now, ticket, claim, request) {
                self.waiting
                    .entry(engine.clone())
                    .or_default()
                    .push_front(ticket);
                return;
            }
        }
        if self.waiting.get(&engine).is_some_and(VecDeque::is_empty) {
            self.waiting.remove(&engine);
        }
    }

    /// Someone waits to load `engine`: its registration must not be held
    /// back by a handshake (they wait for exactly that release).
    pub(super) fn reload_wanted(&self, engine: &EngineId) -> bool {
        self.waiting.contains_key(engine)
    }
}

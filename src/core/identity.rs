//! Who a prefill is: the one place where identities are arbitrated, for
//! every source (handshakes, registrations without one, membership
//! records, the router).
//!
//! A prefill has four identities: its address, its engine id, its
//! incarnation (one process start) and its NIXL agent names. NIXL keeps
//! exactly one metadata entry per agent name and cannot load over one, so
//! the rules are:
//!
//! - **An agent name is claimed before any NIXL load of it**, by exactly
//!   one registration or load in progress ([`Holder`]). A claim naming an
//!   agent held by another engine is refused before anything is loaded;
//!   nothing is ever invalidated that its owner did not load.
//! - **One engine id has at most one load in progress.** A second claim of
//!   it waits, in arrival order, until the first registers or is dropped;
//!   it is then judged against what is registered.
//! - **Only authoritative evidence retires a live engine**: a handshake at
//!   its own address answering another engine id (replaced) or another
//!   incarnation (restarted), REMOTE_DISCONNECT, a stall, the router, or
//!   the removal of the membership record that is its own (same engine id,
//!   address and incarnation). Everything that merely disagrees (the same
//!   engine id live at another address, a record of another incarnation
//!   or address) is a [`Conflict`]: refused, logged once with both sides
//!   named, counted, and never a release.
//! - **The same incarnation at the same address is the engine already
//!   there**: a second handshake of it (two readers of one prefill, a
//!   probe) gets the registered engine back and loads nothing.
//!
//! Addresses are compared in their canonical form ([`PeerAddr`]); names
//! are resolved by the caller ([`PeerAddr::resolve`]).

use crate::registration::RegistrationId;
use std::collections::VecDeque;
use std::sync::Arc;

use tokio::time::Instant;

use super::cell::EngineCell;
use super::{Action, Answer, Core, Count, RequestId, TicketId};
use crate::error::{ClaimRefused, Conflict, RegisterError};
use crate::event::{Event, ReleaseReason};
use crate::registration::{Claim, Departure, GoneMode, PeerRef, Registration};
use crate::text::{check_name, MAX_AGENT_NAME, MAX_ENGINE_ID, MAX_RANKS};
use crate::transport::{AgentName, EngineId, PeerAddr};

/// A handshake in progress.
pub(super) struct Ticket {
    pub(super) address: PeerAddr,
    pub(super) stage: Stage,
}

/// Where a handshake is.
pub(super) enum Stage {
    /// Started; it has not said whom it found.
    Started,
    /// Its claim waits for the engine id: a load of it is in progress, or
    /// its registration is being released first.
    Waiting { claim: Claim, request: RequestId },
    /// Its claim was granted: it may load, and holds the claim's agent
    /// names (and any more it claimed while loading).
    Loading { claim: Claim, extra: Vec<AgentName> },
    /// Answered (the engine already registered, or refused): only its end
    /// is left.
    Answered,
}

/// Who holds an agent name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Holder {
    /// A registration (live, marked or being released), by serial.
    Registration(RegistrationId),
    /// A handshake whose claim was granted and that is loading.
    Load(TicketId),
}

/// How a claim was judged.
enum Judged {
    /// Answered: granted, the engine already there, or refused.
    Answered,
    /// It must wait for the engine id.
    Wait,
}

/// Conflicts remembered for logging once; past this many the memory is
/// cleared (a hostile source cannot grow it).
const CONFLICTS_REMEMBERED: usize = 1024;

/// Why a claim or registration is malformed, if it is.
pub(super) fn malformed(engine: &EngineId, agents: &[AgentName]) -> Option<String> {
    if let Err(e) = check_name("engine id", engine.as_str(), MAX_ENGINE_ID) {
        return Some(e.to_string());
    }
    if agents.is_empty() {
        return Some("it names no agent".into());
    }
    if agents.len() > usize::from(MAX_RANKS) {
        return Some(format!(
            "it names {} agents; at most {MAX_RANKS} ranks are accepted",
            agents.len()
        ));
    }
    for (i, agent) in agents.iter().enumerate() {
        if let Err(e) = check_name("agent name", agent.as_str(), MAX_AGENT_NAME) {
            return Some(e.to_string());
        }
        if agents[..i].contains(agent) {
            return Some(format!("agent {agent} is named for two ranks"));
        }
    }
    None
}

impl<R> Core<R> {
    fn answer(&mut self, request: RequestId, answer: Answer<R>) {
        self.actions.push_back(Action::Answer { request, answer });
    }

    /// Records a conflict: counted every time (the metric, and the count
    /// kept here), logged at WARN and published the first time only; the
    /// repeats are DEBUG lines with the running count.
    pub(super) fn conflict(&mut self, conflict: Conflict, source: &'static str) {
        self.count(Count::IdentityConflict(conflict.kind()));
        if self.conflicts.len() >= CONFLICTS_REMEMBERED && !self.conflicts.contains_key(&conflict) {
            self.conflicts.clear();
        }
        let seen = self.conflicts.entry(conflict.clone()).or_insert(0);
        *seen += 1;
        let seen = *seen;
        if seen == 1 {
            // The WARN is keyed by engine and kind, not by the whole
            // conflict: a stream of stale incarnations (or replies) of one
            // engine is one WARN, then one at the 2nd, 4th, 8th, ... distinct
            // one (and every 1,000th) with the count; each is still an event
            // and counted.
            let key = (conflict.kind(), conflict.engine().clone());
            if self.conflict_lines.len() >= CONFLICTS_REMEMBERED
                && !self.conflict_lines.contains_key(&key)
            {
                self.conflict_lines.clear();
            }
            let distinct = self.conflict_lines.entry(key).or_insert(0);
            *distinct += 1;
            let distinct = *distinct;
            if distinct == 1 {
                tracing::warn!(kind = conflict.kind(), source, %conflict, "identity conflict: the newcomer is refused, the registered engine kept (logged once per engine and kind; counted in nixl_keepalive_identity_conflicts_total)");
            } else if distinct.is_power_of_two() || distinct % 1000 == 0 {
                tracing::warn!(kind = conflict.kind(), source, %conflict, distinct, "identity conflicts of this engine and kind so far (the others at DEBUG)");
            } else {
                tracing::debug!(kind = conflict.kind(), source, %conflict, distinct, "another identity conflict of this engine and kind");
            }
            self.emit(Event::Conflict { conflict });
        } else {
            tracing::debug!(kind = conflict.kind(), source, %conflict, times = seen, "identity conflict again");
        }
    }

    /// Forgets the conflicts that name `engine` as the newcomer: the next
    /// one is news again.
    fn forget_conflicts(&mut self, engine: &EngineId) {
        if !self.conflicts.is_empty() {
            self.conflicts.retain(|c, _| c.engine() != engine);
        }
    }

    /// The engine holding an agent name, if anyone does.
    fn holder_of(&self, agent: &AgentName) -> Option<&EngineId> {
        match self.agents.get(agent)? {
            Holder::Registration(serial) => self.peers.get(serial).map(|p| p.id()),
            Holder::Load(ticket) => match &self.tickets.get(ticket)?.stage {
                Stage::Loading { claim, .. } => Some(&claim.engine),
                _ => None,
            },
        }
    }

    /// The first agent of `agents` held by an engine other than `engine`.
    fn agent_conflict(&self, engine: &EngineId, agents: &[AgentName]) -> Option<Conflict> {
        agents.iter().find_map(|agent| {
            let holder = self.holder_of(agent)?;
            (holder != engine).then(|| Conflict::AgentInUse {
                agent: agent.clone(),
                claimed_by: engine.clone(),
                holder: holder.clone(),
            })
        })
    }

    // ----- handshakes -----

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
        if self.stopping.is_some() {
            self.answer(
                request,
                Answer::ClaimRefused(ClaimRefused::Stopped(crate::ServiceStopped)),
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

    // ----- registrations -----

    /// A registration: through the handshake `ticket` whose claim was
    /// granted, or on its own (claimed and activated at once).
    pub(super) fn register(
        &mut self,
        now: Instant,
        request: RequestId,
        ticket: Option<TicketId>,
        registration: Registration<R>,
        cell: Arc<EngineCell>,
    ) {
        match ticket {
            Some(ticket) => self.register_loaded(now, request, ticket, registration, cell),
            None => self.register_alone(now, request, registration, cell),
        }
    }

    fn register_loaded(
        &mut self,
        now: Instant,
        request: RequestId,
        ticket: TicketId,
        registration: Registration<R>,
        cell: Arc<EngineCell>,
    ) {
        let granted = match self.tickets.get(&ticket) {
            Some(Ticket {
                stage: Stage::Loading { claim, .. },
                address,
            }) => *claim == registration.claim() && *address == registration.address,
            _ => false,
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
        let engine = registration.engine.clone();
        let serial = cell.serial();
        self.loads.remove(&engine);
        let stage = self
            .tickets
            .get_mut(&ticket)
            .map(|t| std::mem::replace(&mut t.stage, Stage::Answered));
        if let Some(Stage::Loading { extra, .. }) = stage {
            // Extra names it claimed are the runtime's to give back by now.
            for agent in extra {
                if self.agents.get(&agent) == Some(&Holder::Load(ticket)) {
                    self.agents.remove(&agent);
                }
            }
        }
        self.activate(now, request, registration, cell);
        if self.stopping.is_some() {
            // Loaded under a granted claim while the service stopped: the
            // service owns it now and gives it back like every other.
            self.mark(now, serial, ReleaseReason::Shutdown);
        }
        self.handshake_finished(now, ticket);
        self.engine_moved(now, engine);
    }

    fn register_alone(
        &mut self,
        now: Instant,
        request: RequestId,
        registration: Registration<R>,
        cell: Arc<EngineCell>,
    ) {
        if self.stopping.is_some() {
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
            .by_id
            .get(engine)
            .map(|s| self.peers[s].address.clone())
            .or_else(|| {
                self.loads
                    .get(engine)
                    .map(|t| self.tickets[t].address.clone())
            })
            .or_else(|| {
                self.waiting
                    .contains_key(engine)
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

    fn activate(
        &mut self,
        now: Instant,
        request: RequestId,
        registration: Registration<R>,
        cell: Arc<EngineCell>,
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
        self.forget_conflicts(&engine);
        self.by_id.insert(engine.clone(), serial);
        for agent in &agents {
            self.agents
                .insert(agent.clone(), Holder::Registration(serial));
        }
        let previous = self.by_addr.insert(address.clone(), serial);
        self.peers.insert(
            serial,
            super::peer::Peer::new(
                now,
                cell.clone(),
                address.clone(),
                incarnation,
                self.newest_ticket,
                agents,
                resources,
            ),
        );
        if let Some(interval) = self.config.heartbeat_interval {
            // Spread first heartbeats over one interval: engines registered
            // together must not all beat together.
            let offset = interval.mul_f64(rand::Rng::random::<f64>(&mut self.rng));
            self.schedule_heartbeat(serial, now + offset, super::heartbeat::Deadline::Near);
        }
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
        if let Some(old) = previous.filter(|&old| old != serial) {
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
        for agent in agents {
            if self.agents.get(agent) == Some(&Holder::Registration(serial)) {
                self.agents.remove(agent);
            }
        }
        if self.by_addr.get(address) == Some(&serial) {
            self.by_addr.remove(address);
        }
        if self.by_id.get(engine) == Some(&serial) {
            self.by_id.remove(engine);
            self.engine_moved(now, engine.clone());
        }
        // After mass departures (10,000 members that left) the tables give
        // their buckets back.
        crate::shrink::after_removal(&mut self.agents);
        crate::shrink::after_removal(&mut self.by_addr);
        crate::shrink::after_removal(&mut self.by_id);
    }

    // ----- retirement by others -----

    /// The router or orchestrator says a peer is gone: authoritative.
    pub(super) fn peer_gone(&mut self, now: Instant, peer: PeerRef, mode: GoneMode) {
        let serial = match &peer {
            PeerRef::Engine(id) => self.by_id.get(id).copied(),
            PeerRef::Address(addr) => self.by_addr.get(addr).copied(),
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
        let Some(&serial) = self.by_id.get(&departure.engine) else {
            tracing::debug!(engine = %departure.engine, "membership record gone for an engine not registered: nothing to do");
            return;
        };
        let peer = &self.peers[&serial];
        if peer.is_live() {
            let conflict = if peer.address != departure.address {
                Some(Conflict::RecordAddress {
                    engine: departure.engine.clone(),
                    record: departure.address.clone(),
                    registered: peer.address.clone(),
                })
            } else {
                match (departure.incarnation, peer.incarnation) {
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

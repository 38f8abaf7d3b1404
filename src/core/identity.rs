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
use std::sync::Arc;

use std::time::Instant;

use super::{Action, Answer, Core, Count, RequestId, TicketId};
use crate::error::{Conflict, RegisterError};
use crate::event::{Event, ReleaseReason};
use crate::read_accounting::cell::EngineCell;
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
pub(super) enum Judged {
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
    pub(super) fn answer(&mut self, request: RequestId, answer: Answer<R>) {
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
    pub(super) fn forget_conflicts(&mut self, engine: &EngineId) {
        if !self.conflicts.is_empty() {
            self.conflicts.retain(|c, _| c.engine() != engine);
        }
    }

    /// The engine holding an agent name, if anyone does.
    pub(super) fn holder_of(&self, agent: &AgentName) -> Option<&EngineId> {
        match self.agents.get(agent)? {
            Holder::Registration(serial) => self.peers.get(serial).map(|p| p.id()),
            Holder::Load(ticket) => match &self.tickets.get(ticket)?.stage {
                Stage::Loading { claim, .. } => Some(&claim.engine),
                _ => None,
            },
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
        cell: Arc<EngineCell>,
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
        cell: Arc<EngineCell>,
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

    pub(super) fn activate(
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
            let offset = self.heartbeats.first_offset(interval);
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
}

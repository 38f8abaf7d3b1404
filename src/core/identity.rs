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

use super::directory::{Holder, Stage, Ticket};
use super::{Action, Answer, Core, Count, Map, RequestId, TicketId};
use crate::error::{Conflict, RegisterError};
use crate::event::{Event, ReleaseReason};
use crate::read_accounting::cell::EngineCell;
use crate::registration::{Departure, GoneMode, PeerRef, Registration};
use crate::text::{check_name, MAX_AGENT_NAME, MAX_ENGINE_ID, MAX_RANKS};
use crate::transport::{AgentName, EngineId, PeerAddr};

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

/// How a conflict is told, as [`ConflictLog::record`] decides it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Notice {
    /// News: this conflict was not seen before (or was forgotten). It is
    /// published; `distinct` counts the news of its engine and kind so
    /// far, and `warn` says whether its line is a WARN (the 1st, 2nd, 4th,
    /// 8th, ... and every 1,000th) or a DEBUG.
    New { distinct: u64, warn: bool },
    /// This very conflict again, the `times`th time: a DEBUG line only.
    Again { times: u64 },
}

/// The conflicts seen, remembered so that each is news once, and the
/// news per engine and kind, so that a stream of them (stale incarnations
/// or replies of one engine) is a few WARN lines, not one each. Both
/// memories are bounded ([`CONFLICTS_REMEMBERED`]): past it, cleared.
#[derive(Default)]
pub(super) struct ConflictLog {
    /// Conflicts seen, and how often.
    seen: Map<Conflict, u64>,
    /// Distinct conflicts per (kind, engine), for the WARN lines.
    lines: Map<(&'static str, EngineId), u64>,
}

impl ConflictLog {
    /// Records one sighting of `conflict` and says how to tell it.
    pub(super) fn record(&mut self, conflict: &Conflict) -> Notice {
        if self.seen.len() >= CONFLICTS_REMEMBERED && !self.seen.contains_key(conflict) {
            self.seen.clear();
        }
        let times = self.seen.entry(conflict.clone()).or_insert(0);
        *times += 1;
        if *times > 1 {
            return Notice::Again { times: *times };
        }
        let key = (conflict.kind(), conflict.engine().clone());
        if self.lines.len() >= CONFLICTS_REMEMBERED && !self.lines.contains_key(&key) {
            self.lines.clear();
        }
        let distinct = self.lines.entry(key).or_insert(0);
        *distinct += 1;
        let distinct = *distinct;
        let warn = distinct.is_power_of_two() || distinct % 1000 == 0;
        Notice::New { distinct, warn }
    }

    /// Forgets the conflicts that name `engine` as the newcomer: the next
    /// one is news again.
    pub(super) fn forget(&mut self, engine: &EngineId) {
        if !self.seen.is_empty() {
            self.seen.retain(|c, _| c.engine() != engine);
        }
    }

    /// Every sighting remembered, summed.
    #[cfg(test)]
    pub(super) fn sightings(&self) -> u64 {
        self.seen.values().sum()
    }
}

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
    /// kept in the [`ConflictLog`]), logged at WARN and published the
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
            .directory
            .serial_of(engine)
            .map(|s| self.peers[&s].address.clone())
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
        self.conflicts.forget(&engine);
        let previous = self.directory.activate(serial, &engine, &address, &agents);
        self.peers.insert(
            serial,
            super::peer::Peer::new(
                now,
                cell.clone(),
                address.clone(),
                incarnation,
                self.directory.newest_ticket(),
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

#[cfg(test)]
mod tests {
    use super::{ConflictLog, Notice, CONFLICTS_REMEMBERED};
    use crate::error::Conflict;
    use crate::transport::{EngineId, PeerAddr};

    /// The conflict of `engine` registering again while in use at
    /// address `n`: one engine and kind, a distinct conflict per `n`.
    fn in_use(engine: &str, n: usize) -> Conflict {
        Conflict::EngineInUse {
            engine: EngineId::from(engine),
            address: PeerAddr::new(format!("10.0.{}.{}:5600", n / 256, n % 256)),
        }
    }

    #[test]
    fn a_conflict_is_news_once_and_then_counted_again() {
        let mut log = ConflictLog::default();
        let c = in_use("p", 1);
        let news = Notice::New {
            distinct: 1,
            warn: true,
        };
        assert_eq!(log.record(&c), news);
        assert_eq!(log.record(&c), Notice::Again { times: 2 });
        assert_eq!(log.record(&c), Notice::Again { times: 3 });
        assert_eq!(log.sightings(), 3);
        assert_eq!(
            log.record(&in_use("q", 1)),
            news,
            "another engine's is news"
        );
    }

    #[test]
    fn distinct_conflicts_of_one_engine_warn_at_powers_of_two_and_thousands() {
        let mut log = ConflictLog::default();
        let warned: Vec<u64> = (1..=1000)
            .filter_map(|n| match log.record(&in_use("p", n)) {
                Notice::New { distinct, warn } => {
                    assert_eq!(distinct, n as u64, "every one is news");
                    warn.then_some(distinct)
                }
                Notice::Again { .. } => panic!("{n} is distinct"),
            })
            .collect();
        assert_eq!(warned, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000]);
    }

    #[test]
    fn forgetting_an_engine_makes_its_conflicts_news_again() {
        let mut log = ConflictLog::default();
        let (p, q) = (in_use("p", 1), in_use("q", 1));
        log.record(&p);
        log.record(&q);
        log.forget(&EngineId::from("p"));
        assert_eq!(
            log.record(&p),
            Notice::New {
                distinct: 2,
                warn: true
            },
            "news again, counted among the engine's distinct ones"
        );
        assert_eq!(log.record(&q), Notice::Again { times: 2 }, "q's kept");
    }

    #[test]
    fn past_the_cap_the_memory_is_cleared_and_old_conflicts_are_news() {
        let mut log = ConflictLog::default();
        let engines: Vec<String> = (0..=CONFLICTS_REMEMBERED)
            .map(|n| format!("e{n}"))
            .collect();
        for engine in &engines[..CONFLICTS_REMEMBERED] {
            log.record(&in_use(engine, 0));
        }
        let first = in_use(&engines[0], 0);
        assert_eq!(
            log.record(&first),
            Notice::Again { times: 2 },
            "at the cap, kept"
        );
        let news = Notice::New {
            distinct: 1,
            warn: true,
        };
        assert_eq!(log.record(&in_use(&engines[CONFLICTS_REMEMBERED], 0)), news);
        assert_eq!(log.sightings(), 1, "cleared for the newcomer");
        assert_eq!(log.record(&first), news, "forgotten, news again");
    }
}

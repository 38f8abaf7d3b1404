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
//!   one registration or load in progress ([`super::directory::Holder`]). A claim naming an
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

use std::sync::Arc;

use super::{Map, TicketId};
use crate::error::Conflict;
use crate::names::{AgentName, EngineId, PeerAddr};
use crate::registration::{Claim, Departure, Incarnation};
use crate::text::{check_name, MAX_AGENT_NAME, MAX_ENGINE_ID, MAX_RANKS};

/// A registration's identities, kept in its record: the address it is
/// known at, its incarnation, its agent names, and the newest handshake
/// begun before it was activated. Set once at activation: every change of
/// identity is a new registration, so nothing here is written after.
pub(super) struct Who {
    address: PeerAddr,
    incarnation: Option<Incarnation>,
    agents: Arc<[AgentName]>,
    /// The newest handshake started when it was activated: a handshake no
    /// newer than this began before the registration existed.
    registered_after: TicketId,
}

impl Who {
    pub(super) fn new(
        address: PeerAddr,
        incarnation: Option<Incarnation>,
        agents: Vec<AgentName>,
        registered_after: TicketId,
    ) -> Self {
        Who {
            address,
            incarnation,
            agents: agents.into(),
            registered_after,
        }
    }

    pub(super) fn address(&self) -> &PeerAddr {
        &self.address
    }

    pub(super) fn into_address(self) -> PeerAddr {
        self.address
    }

    pub(super) fn incarnation(&self) -> Option<Incarnation> {
        self.incarnation
    }

    pub(super) fn agents(&self) -> &Arc<[AgentName]> {
        &self.agents
    }

    /// Judges `claim`, found at `address` by the handshake `ticket`,
    /// against this live registration of the same engine id: another
    /// address is a conflict; the same incarnation is this engine (unless
    /// its agents changed); a reply older than the registration is stale;
    /// anything else is a new process at the engine's own address.
    pub(super) fn judge(&self, claim: &Claim, address: &PeerAddr, ticket: TicketId) -> Against {
        let engine = claim.engine.clone();
        if *address != self.address {
            return Against::Refused(Conflict::EngineElsewhere {
                engine,
                address: address.clone(),
                live_at: self.address.clone(),
            });
        }
        match (claim.incarnation, self.incarnation) {
            (Some(new), Some(old)) if new == old => {
                if *claim.agents != *self.agents {
                    return Against::Refused(Conflict::AgentsChanged {
                        engine,
                        incarnation: new,
                    });
                }
                Against::Current
            }
            (_, registered) if ticket <= self.registered_after => {
                Against::Refused(Conflict::StaleReply {
                    engine,
                    address: address.clone(),
                    registered,
                })
            }
            (new, old) => Against::NewProcess { old, new },
        }
    }
}

impl Who {
    /// Judges a membership record's `departure` of this live
    /// registration's engine id: the engine is retired only if the record
    /// is its own registration's (the same address, and the same
    /// incarnation when both are known); anything else is a conflict, and
    /// the engine stays.
    pub(super) fn departed(&self, departure: &Departure) -> Option<Conflict> {
        if self.address != departure.address {
            return Some(Conflict::RecordAddress {
                engine: departure.engine.clone(),
                record: departure.address.clone(),
                registered: self.address.clone(),
            });
        }
        match (departure.incarnation, self.incarnation) {
            (Some(record), Some(registered)) if record != registered => {
                Some(Conflict::RecordIncarnation {
                    engine: departure.engine.clone(),
                    record,
                    registered,
                })
            }
            _ => None,
        }
    }
}

/// Where `engine` is in use, for a registration without a handshake of
/// its own: registered (at `registered_at`), being loaded (at
/// `loading_at`), or waited for by claims (at the newcomer's own
/// `address`, which the waiting claims were made at). In use, it is
/// refused: a registration alone never replaces anything.
pub(super) fn engine_in_use(
    engine: &EngineId,
    registered_at: Option<&PeerAddr>,
    loading_at: Option<&PeerAddr>,
    waited_for: bool,
    address: &PeerAddr,
) -> Option<Conflict> {
    let at = registered_at
        .or(loading_at)
        .or(waited_for.then_some(address))?;
    Some(Conflict::EngineInUse {
        engine: engine.clone(),
        address: at.clone(),
    })
}

/// The conflict of `engine` declaring `address`, which the live engine
/// `holder` holds, unless it is the same engine.
pub(super) fn address_in_use(
    engine: &EngineId,
    address: &PeerAddr,
    holder: &EngineId,
) -> Option<Conflict> {
    (holder != engine).then(|| Conflict::AddressInUse {
        address: address.clone(),
        claimed_by: engine.clone(),
        holder: holder.clone(),
    })
}

/// The first of `agents` held by an engine other than `engine`
/// (`holder_of` says who holds a name), as the conflict it is.
pub(super) fn agent_in_use<'a>(
    engine: &EngineId,
    agents: &[AgentName],
    holder_of: impl Fn(&AgentName) -> Option<&'a EngineId>,
) -> Option<Conflict> {
    agents.iter().find_map(|agent| {
        let holder = holder_of(agent)?;
        (holder != engine).then(|| Conflict::AgentInUse {
            agent: agent.clone(),
            claimed_by: engine.clone(),
            holder: holder.clone(),
        })
    })
}

/// How a claim of a live registration's engine id is judged against it.
pub(super) enum Against {
    /// It disagrees with the registration: refused, never a release.
    Refused(Conflict),
    /// The same incarnation at the same address: the engine already
    /// there, nothing to load.
    Current,
    /// The engine answered its own address as a new process: the
    /// registration goes first.
    NewProcess {
        old: Option<Incarnation>,
        new: Option<Incarnation>,
    },
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

    /// Records a conflict seen by `source` and logs it as [`Self::record`]
    /// decides: a WARN the first time, then at growing intervals per
    /// engine and kind (keyed by engine and kind, not by the whole
    /// conflict, so a stream of them is a few lines), DEBUG otherwise.
    /// Whether it is news, to be published as an event.
    pub(super) fn note(&mut self, conflict: &Conflict, source: &'static str) -> bool {
        let kind = conflict.kind();
        match self.record(conflict) {
            Notice::Again { times } => {
                tracing::debug!(kind, source, %conflict, times, "identity conflict again");
                return false;
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
        true
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

#[cfg(test)]
mod tests {
    use super::{ConflictLog, Notice, CONFLICTS_REMEMBERED};
    use crate::error::Conflict;
    use crate::names::{EngineId, PeerAddr};

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

//! Errors the service's API returns. Each variant says what happened to
//! the state.

use std::fmt;

use crate::names::{AgentName, EngineId, PeerAddr};
use crate::registration::{Incarnation, Registration};
use crate::snapshot::EngineSnapshot;
use crate::state::EngineState;
use crate::transport::{ReleaseStep, Transport};

/// A read was not started: the engine is no longer one a decoder may read
/// from. Nothing was counted; no transfer should be posted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("read from engine {engine} refused: the engine is {state}")]
#[non_exhaustive]
pub struct ReadRefused {
    /// The engine the read was for.
    pub engine: EngineId,
    /// Why: the engine's state when the read was refused.
    pub state: EngineState,
}

/// The service has stopped (shut down or panicked), or is stopping; the
/// request was not carried out and nothing changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the keepalive service has stopped")]
pub struct ServiceStopped;

/// Two sources claim one identity of a prefill (an agent name, an engine
/// id, an address, an incarnation). The service refuses the newcomer,
/// logs the conflict once with both sides named, counts it
/// (`nixl_keepalive_identity_conflicts_total{kind}`) and publishes
/// [`crate::Event::Conflict`]: a conflict is never resolved by releasing
/// the engine already registered.
#[derive(Clone, Debug, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
pub enum Conflict {
    /// An agent name of the claim belongs to another engine's
    /// registration or load in progress: loading it would load over (or
    /// next to) that engine's metadata, and releasing either would
    /// invalidate the other's. A replayed handshake reply, or two prefills
    /// configured with one agent name.
    #[error("agent {agent} claimed by engine {claimed_by} belongs to engine {holder}")]
    AgentInUse {
        /// The agent name.
        agent: AgentName,
        /// The engine the refused claim was for.
        claimed_by: EngineId,
        /// The engine that holds the name.
        holder: EngineId,
    },
    /// The engine id is live at another address: two prefills started with
    /// one `--engine-id`, a replayed reply, or one prefill reached under
    /// two addresses that do not resolve to one. Only a handshake at the
    /// engine's own address may replace or reload it.
    #[error("engine {engine} answered at {address} but is live at {live_at}")]
    EngineElsewhere {
        /// The engine id.
        engine: EngineId,
        /// Where the refused claim came from.
        address: PeerAddr,
        /// Where its registration is.
        live_at: PeerAddr,
    },
    /// The address is the newcomer's own word ([`crate::KeepaliveHandle::handshake_declared`]:
    /// a peer that declares where it is, as SGLang's decode does, instead
    /// of one the runtime reached there), and a live engine of another id
    /// holds it. A declaration is not evidence that the engine there was
    /// replaced (two hosts advertising one address would release a healthy
    /// one); the holder is asked at once (a heartbeat), and a claim made
    /// after its release is granted.
    #[error("engine {claimed_by} declared {address}, where engine {holder} is live")]
    AddressInUse {
        /// The declared address.
        address: PeerAddr,
        /// The engine the refused claim was for.
        claimed_by: EngineId,
        /// The live engine registered there.
        holder: EngineId,
    },
    /// A handshake that started before the engine's current registration
    /// was made answered with another incarnation: its reply may predate
    /// that registration (a slow or racing handshake), so it is not taken
    /// as a restart. A fresh handshake is judged again.
    #[error("engine {engine}: a handshake at {address} that began before its registration answered another incarnation")]
    StaleReply {
        /// The engine id.
        engine: EngineId,
        /// The handshake's address.
        address: PeerAddr,
        /// The incarnation registered now, if known.
        registered: Option<Incarnation>,
    },
    /// The same engine incarnation answered with other agent names.
    #[error("engine {engine} incarnation {incarnation} answered with other agent names than its registration's")]
    AgentsChanged {
        /// The engine id.
        engine: EngineId,
        /// The incarnation.
        incarnation: Incarnation,
    },
    /// A registration without a handshake ([`crate::KeepaliveHandle::register`])
    /// for an engine id that is registered or being loaded: its metadata
    /// is loaded already, over the other's. Load engine ids that may come
    /// back through [`crate::KeepaliveHandle::handshake`].
    #[error("engine {engine} is registered or being loaded already (at {address})")]
    EngineInUse {
        /// The engine id.
        engine: EngineId,
        /// The address of the registration or load that holds it.
        address: PeerAddr,
    },
    /// A membership record names the engine at another address than its
    /// registration's: not evidence about the engine that is registered.
    #[error("a membership record of engine {engine} names {record}, its registration is at {registered}")]
    RecordAddress {
        /// The engine id.
        engine: EngineId,
        /// The record's address.
        record: PeerAddr,
        /// The registration's address.
        registered: PeerAddr,
    },
    /// A membership record of another incarnation than the registered
    /// one: a dead predecessor's record expiring late, or a newer process
    /// not handshaken yet. Not evidence about the registered process.
    #[error("a membership record of engine {engine} names incarnation {record}, the registered one is {registered}")]
    RecordIncarnation {
        /// The engine id.
        engine: EngineId,
        /// The record's incarnation.
        record: Incarnation,
        /// The registration's.
        registered: Incarnation,
    },
}

impl Conflict {
    /// A short name, for logs and the metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Conflict::AgentInUse { .. } => "agent_in_use",
            Conflict::EngineElsewhere { .. } => "engine_elsewhere",
            Conflict::AddressInUse { .. } => "address_in_use",
            Conflict::AgentsChanged { .. } => "agents_changed",
            Conflict::StaleReply { .. } => "stale_reply",
            Conflict::EngineInUse { .. } => "engine_in_use",
            Conflict::RecordAddress { .. } => "record_address",
            Conflict::RecordIncarnation { .. } => "record_incarnation",
        }
    }

    /// The engine the conflict is about (the newcomer's).
    pub fn engine(&self) -> &EngineId {
        match self {
            Conflict::AgentInUse { claimed_by, .. } | Conflict::AddressInUse { claimed_by, .. } => {
                claimed_by
            }
            Conflict::EngineElsewhere { engine, .. }
            | Conflict::StaleReply { engine, .. }
            | Conflict::AgentsChanged { engine, .. }
            | Conflict::EngineInUse { engine, .. }
            | Conflict::RecordAddress { engine, .. }
            | Conflict::RecordIncarnation { engine, .. } => engine,
        }
    }
}

/// A handshake's claim was not granted: nothing may be loaded. Nothing in
/// the peer table changed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClaimRefused {
    /// The service is stopping or has stopped.
    #[error(transparent)]
    Stopped(#[from] ServiceStopped),
    /// The claim conflicts with an engine registered or being loaded.
    #[error("identity conflict: {0}")]
    Conflict(Conflict),
    /// The claim itself is malformed (no agents, an agent named twice, a
    /// name that is empty, too long or not printable).
    #[error("claim of engine {engine} refused: {reason}")]
    Invalid {
        /// The engine id claimed.
        engine: EngineId,
        /// What is wrong with it.
        reason: String,
    },
    /// [`crate::Handshake::ready_to_load_within`] waited its limit for an
    /// older registration of the claimed engine id to be released, and it
    /// was not. Nothing was loaded; the handshake has ended.
    #[error(transparent)]
    ReleaseHeld(Box<ReleaseHeld>),
}

/// A bounded claim ran out waiting for the release of the engine id's
/// older registration (another incarnation at the address, or one marked
/// dead or replaced).
///
/// Why this is an error and not a longer wait: that release waits for the
/// registration's transfers (reads in flight, given-up reads still
/// running) to end, and only the runtime ends them (`ReadGuard::finish`,
/// `GivenUpRead::ended`), from whatever task or thread polls them. A
/// runtime that handshakes on that very thread would wait for itself for
/// good (issue 58: a decode re-handshaking a stalled prefill whose
/// given-up READ only its handshaking thread polled). The error names
/// what holds the release, so the fix is plain: poll those transfers
/// before handshaking again, or handshake where nothing else waits.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReleaseHeld {
    /// The engine id claimed.
    pub engine: EngineId,
    /// The handshake's address.
    pub address: PeerAddr,
    /// How long the claim waited.
    pub waited: std::time::Duration,
    /// The older registration as the service reported it when the wait ran
    /// out. `None`: no registration of the id was left (another handshake
    /// of it is loading, or the release came just as the wait ran out).
    pub holder: Option<EngineSnapshot>,
}

impl ReleaseHeld {
    /// Given-up transfers still running, and the blocks they hold.
    pub fn given_up(&self) -> (u64, u64) {
        self.holder.as_ref().map_or((0, 0), |e| {
            (
                e.given_up.len() as u64,
                e.given_up.iter().map(|g| g.blocks).sum(),
            )
        })
    }
}

impl fmt::Display for ReleaseHeld {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let waited = self.waited.as_secs_f64();
        let Some(e) = &self.holder else {
            return write!(
                f,
                "ready_to_load of engine {} at {} waited {waited:.1} s and the service names no \
                 registration of it: another handshake of the id is loading it, or its release \
                 came as the wait ran out. Nothing was loaded; the handshake has ended: \
                 handshake again",
                self.engine, self.address
            );
        };
        write!(
            f,
            "ready_to_load of engine {} at {} waited {waited:.1} s for its older registration \
             (state {}) to be released, held by {} read(s) in flight",
            self.engine,
            self.address,
            e.state.as_str(),
            e.reads_in_flight
        )?;
        let (given_up, blocks) = self.given_up();
        if let Some(oldest) = e.given_up.iter().map(|g| g.held_for).max() {
            write!(
                f,
                ", {given_up} of them given up (holding {blocks} block(s), the oldest for {:.1} s)",
                oldest.as_secs_f64()
            )?;
        }
        write!(
            f,
            ": {}. Only the runtime ends them (a read's finish, a given-up read's end); if this \
             thread is the one that polls them, poll them before handshaking again, or \
             handshake where nothing else waits. Nothing was loaded; the handshake has ended",
            e.why
        )
    }
}

impl std::error::Error for ReleaseHeld {}

/// A registration the service did not take. The registration comes back
/// whole: its metadata is loaded and its dlists prepped, so the caller
/// gives them back (or retries). Nothing in the peer table changed.
#[non_exhaustive]
pub enum RegisterError<R> {
    /// The service is stopping or has stopped: nothing is activated any
    /// more.
    Stopped(Registration<R>),
    /// It conflicts with an engine registered or being loaded (see
    /// [`Conflict`]). Give back its dlists; invalidate only the agents
    /// the conflict does not name as another engine's.
    Conflict {
        /// The registration, untouched.
        registration: Registration<R>,
        /// What it conflicts with.
        conflict: Conflict,
    },
    /// The service task ended (it panicked or was aborted) while it held
    /// the registration: the registration was dropped, not released.
    ServiceGone {
        /// The engine the registration was for.
        engine: EngineId,
    },
    /// The registration itself is malformed (no agents, one agent named
    /// twice, a name that is not printable).
    Invalid {
        /// The registration, untouched.
        registration: Registration<R>,
        /// What is wrong with it.
        reason: String,
    },
}

impl<R> RegisterError<R> {
    /// The registration that was refused, to give back its resources
    /// (`None` when the service task ended holding it).
    pub fn into_registration(self) -> Option<Registration<R>> {
        match self {
            RegisterError::Stopped(registration)
            | RegisterError::Conflict { registration, .. }
            | RegisterError::Invalid { registration, .. } => Some(registration),
            RegisterError::ServiceGone { .. } => None,
        }
    }

    /// Gives back what the refused registration holds, as the runtime
    /// must (the service never took it): releases its resources and
    /// invalidates its agents' remote metadata through `transport`, except
    /// an agent the conflict names as another engine's (invalidating it
    /// would close that healthy engine's endpoints). Returns the release
    /// steps, empty when the service task ended holding the registration
    /// ([`RegisterError::ServiceGone`]: nothing came back to give).
    /// Blocking: [`Transport::release`] calls into NIXL.
    pub fn give_back<T>(self, transport: &T) -> Vec<ReleaseStep>
    where
        T: Transport<Resources = R> + ?Sized,
    {
        let held = match &self {
            RegisterError::Conflict {
                conflict: Conflict::AgentInUse { agent, .. },
                ..
            } => Some(agent.clone()),
            _ => None,
        };
        match self.into_registration() {
            Some(r) => {
                let agents: Vec<AgentName> = r
                    .agents
                    .into_iter()
                    .filter(|a| Some(a) != held.as_ref())
                    .collect();
                transport.release(&r.engine, &agents, r.resources)
            }
            None => Vec::new(),
        }
    }

    /// The engine the refused registration was for.
    pub fn engine(&self) -> &EngineId {
        match self {
            RegisterError::Stopped(registration)
            | RegisterError::Conflict { registration, .. }
            | RegisterError::Invalid { registration, .. } => &registration.engine,
            RegisterError::ServiceGone { engine } => engine,
        }
    }
}

impl<R> fmt::Display for RegisterError<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RegisterError::Stopped(r) => write!(
                f,
                "registration of engine {} refused: the keepalive service is stopping or stopped",
                r.engine
            ),
            RegisterError::Conflict {
                registration,
                conflict,
            } => write!(
                f,
                "registration of engine {} refused: identity conflict: {conflict}",
                registration.engine
            ),
            RegisterError::ServiceGone { engine } => write!(
                f,
                "registration of engine {engine} lost: the keepalive service task ended while holding it"
            ),
            RegisterError::Invalid {
                registration,
                reason,
            } => write!(
                f,
                "registration of engine {} refused: {reason}",
                registration.engine
            ),
        }
    }
}

impl<R> fmt::Debug for RegisterError<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RegisterError({self})")
    }
}

impl<R> std::error::Error for RegisterError<R> {}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wait ran out just as the older registration was released (or
    /// while another handshake of the id loads it): nothing to name, and
    /// the text says to handshake again rather than to poll reads.
    #[test]
    fn a_release_held_with_no_registration_left_says_to_handshake_again() {
        let held = ReleaseHeld {
            engine: EngineId::from("p"),
            address: PeerAddr::from("10.0.0.1:5600"),
            waited: std::time::Duration::from_millis(5_049),
            holder: None,
        };
        assert_eq!(held.given_up(), (0, 0));
        let text = ClaimRefused::ReleaseHeld(Box::new(held)).to_string();
        assert!(
            text.starts_with("ready_to_load of engine p at 10.0.0.1:5600 waited 5.0 s"),
            "{text}"
        );
        assert!(text.contains("names no registration of it"), "{text}");
        assert!(text.ends_with("handshake again"), "{text}");
        assert!(!text.contains("poll them"), "{text}");
    }
}

//! Transport calls as data: what the core asks the driver to run off the
//! async threads, and what comes back.

use super::key::PeerKey;
use crate::registration::RegistrationId;
use std::sync::Arc;

use crate::names::{AgentName, EngineId};
use crate::transport::{ReleaseStep, Transfers, TransportError};

/// A transport call the core wants made. The driver runs it on a blocking
/// worker (it is blocking FFI that may never return) and hands the
/// [`CallOutcome`] back as an input.
pub(crate) enum Call<R> {
    /// One heartbeat round: every one of `messages` (vLLM's `HB:`, split
    /// to a bounded size) to every agent of the registration. `agents` is
    /// the record's own round copy, moved here and back with the outcome.
    Heartbeat {
        /// The registration (`key.serial`) and where its record is:
        /// handed back with the outcome.
        key: PeerKey,
        agents: Arc<[AgentName]>,
        messages: HeartbeatMessages,
    },
    /// Give back a registration's NIXL state.
    Release {
        serial: RegistrationId,
        engine: EngineId,
        agents: Arc<[AgentName]>,
        resources: R,
        /// Whether the release may cut the engine's connections.
        transfers: Transfers,
    },
}

impl<R> Call<R> {
    /// The registration the call is for.
    pub(crate) fn serial(&self) -> RegistrationId {
        match self {
            Call::Heartbeat { key, .. } => key.serial,
            Call::Release { serial, .. } => *serial,
        }
    }
}

/// The notifications of one heartbeat round, shared by the rounds that
/// follow until the engine's leases change.
#[derive(Clone, Debug)]
pub(crate) enum HeartbeatMessages {
    /// `HB:` naming nothing: what an engine without leases gets. Static,
    /// so the many idle engines' rounds share no reference count (one
    /// shared `Arc` was a cache line bouncing between the driver, which
    /// cloned it, and the pool's threads, which dropped it, every
    /// heartbeat).
    Idle,
    /// The round of an engine with leases, shared until they change.
    Leases(Arc<[Box<[u8]>]>),
}

impl HeartbeatMessages {
    /// The notifications of the round, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &[u8]> {
        let (idle, leases): (Option<&[u8]>, &[Box<[u8]>]) = match self {
            HeartbeatMessages::Idle => (Some(b"HB:"), &[]),
            HeartbeatMessages::Leases(m) => (None, m),
        };
        idle.into_iter().chain(leases.iter().map(|m| &m[..]))
    }
}

/// A transport call panicked. The panic is caught at the call (a blocking
/// worker must not die with jobs behind it) and reported as what it is,
/// never turned into a made-up NIXL status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Panicked {
    /// The panic's message, when it was text.
    pub(crate) message: String,
}

impl Panicked {
    /// From a caught panic's payload.
    pub(crate) fn from_payload(payload: &(dyn std::any::Any + Send)) -> Self {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a text message".to_string());
        Panicked { message }
    }
}

/// One heartbeat round's results: how many notifications NIXL accepted,
/// and those that failed or panicked (the first per agent: an agent's
/// other notifications of the round are not sent after one fails), in
/// agent order. A round where every
/// agent accepted allocates nothing.
#[derive(Debug, Default)]
pub(crate) struct RoundResults {
    /// Notifications accepted.
    pub(crate) sent: usize,
    /// Notifications that failed, with their agent.
    pub(crate) failed: Vec<(AgentName, TransportError)>,
    /// Notifications whose call panicked, with their agent.
    pub(crate) panicked: Vec<(AgentName, Panicked)>,
}

impl RoundResults {
    /// Every notification of the round was accepted: nothing the core must
    /// act on soon (the round is over, and counted).
    pub(crate) fn only_successes(&self) -> bool {
        self.failed.is_empty() && self.panicked.is_empty()
    }
}

/// What a call came back with.
pub(crate) enum CallOutcome {
    /// A heartbeat round's results, and the agent names the round carried,
    /// handed back to the registration's record for its next round.
    Heartbeat {
        key: PeerKey,
        results: RoundResults,
        agents: Arc<[AgentName]>,
    },
    /// A release's steps, or the panic that cut it short.
    Release {
        serial: RegistrationId,
        steps: Result<Vec<ReleaseStep>, Panicked>,
    },
}

impl CallOutcome {
    /// The registration the call was for.
    pub(crate) fn serial(&self) -> RegistrationId {
        match self {
            CallOutcome::Heartbeat { key, .. } => key.serial,
            CallOutcome::Release { serial, .. } => *serial,
        }
    }
}

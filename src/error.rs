//! Errors the service's API returns. Each variant says what happened to
//! the state.

use std::fmt;

use crate::registration::Registration;
use crate::state::EngineState;
use crate::transport::{AgentName, EngineId};

/// A read was not started: the engine is no longer one a decoder may read
/// from. Nothing was counted; no transfer should be posted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("read from engine {engine} refused: the engine is {state}")]
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

/// A registration the service did not take. The registration comes back
/// whole: its metadata is loaded and its dlists prepped, so the caller
/// gives them back (or retries). Nothing in the peer table changed.
pub enum RegisterError<R> {
    /// The service is stopping or has stopped: nothing is activated any
    /// more.
    Stopped(Registration<R>),
    /// One of its agent names is held by another engine's registration:
    /// releasing either would invalidate the other's metadata.
    AgentInUse {
        /// The registration, untouched.
        registration: Registration<R>,
        /// The agent name in use.
        agent: AgentName,
        /// The engine that holds it.
        holder: EngineId,
    },
    /// The handshake said it would load another engine id than this
    /// registration names.
    NotThisEngine {
        /// The registration, untouched.
        registration: Registration<R>,
        /// The engine id the handshake was made ready for.
        expected: EngineId,
    },
    /// The service task ended (it panicked or was aborted) while it held
    /// the registration: the registration was dropped, not released.
    ServiceGone {
        /// The engine the registration was for.
        engine: EngineId,
    },
    /// The registration itself is malformed (no agents, or one agent named
    /// twice).
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
            | RegisterError::AgentInUse { registration, .. }
            | RegisterError::NotThisEngine { registration, .. }
            | RegisterError::Invalid { registration, .. } => Some(registration),
            RegisterError::ServiceGone { .. } => None,
        }
    }

    /// The engine the refused registration was for.
    pub fn engine(&self) -> &EngineId {
        match self {
            RegisterError::Stopped(registration)
            | RegisterError::AgentInUse { registration, .. }
            | RegisterError::NotThisEngine { registration, .. }
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
            RegisterError::AgentInUse {
                registration,
                agent,
                holder,
            } => write!(
                f,
                "registration of engine {} refused: its agent {agent} is already registered by engine {holder}",
                registration.engine
            ),
            RegisterError::NotThisEngine {
                registration,
                expected,
            } => write!(
                f,
                "registration of engine {} refused: the handshake was made ready to load engine {expected}",
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

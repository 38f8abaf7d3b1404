//! Errors the service's API returns. Each variant says what happened to
//! the state: none of them changes the peer table.

use crate::engine::EngineState;
use crate::transport::EngineId;

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

/// The service task has stopped (shut down or panicked); the request was
/// not carried out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the keepalive service has stopped")]
pub struct ServiceStopped;

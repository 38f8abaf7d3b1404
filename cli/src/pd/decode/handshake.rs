//! The side channel's handshake as the decode side sees it: one request,
//! one reply, no NIXL ([`fetch`]), and why a handshake did not complete
//! ([`HandshakeError`], also what loading a reply into NIXL fails with).

use std::time::Duration;

use nixl_agent::cuda::CudaError;
use nixl_agent::NixlError;
use nixl_keepalive::text::Escaped;
use nixl_keepalive::{EngineId, PeerAddr, ServiceStopped};
use tokio::net::TcpStream;

use crate::pd::wire::{self, HandshakeReply, WireError};

/// A handshake that did not complete. Nothing stays loaded.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// Nobody answered at the address (refused, reset, timed out).
    #[error("cannot reach {address}: {source}")]
    Connect {
        /// The address.
        address: PeerAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The prefill's reply broke the protocol (counted and logged).
    #[error("bad reply from {address}: {source}")]
    Wire {
        /// The address.
        address: PeerAddr,
        /// What was wrong.
        source: WireError,
    },
    /// NIXL refused the metadata or a dlist (raw status kept); whatever
    /// had been loaded was invalidated again.
    #[error("loading {engine}: {source}")]
    Load {
        /// The engine.
        engine: EngineId,
        /// NIXL's error.
        source: NixlError,
    },
    /// The metadata named another agent than the reply did. What was
    /// loaded under the reply's own (claimed) names was invalidated; the
    /// name NIXL loaded instead was unloaded only if the service granted
    /// it to this handshake (it may be another engine's: NIXL keeps one
    /// entry for identical metadata, and unloading it would cut that
    /// engine off).
    #[error(
        "metadata for rank {rank} names agent {}, the reply said {}",
        Escaped(got),
        Escaped(expected)
    )]
    AgentMismatch {
        /// The rank.
        rank: usize,
        /// The agent the reply listed.
        expected: String,
        /// The agent the metadata named.
        got: String,
    },
    /// Who the prefill says it is conflicts with an engine already
    /// registered or being loaded (the service logged it once and counted
    /// it); nothing was loaded.
    #[error(transparent)]
    Conflict(nixl_keepalive::Conflict),
    /// The reply's identity is malformed (the service refused the claim).
    #[error("{0}")]
    Invalid(String),
    /// Two ranks of the reply name one agent (see the protocol). Caught by
    /// the wire decoder; checked again for replies built in code.
    #[error("{engine}: ranks {first} and {second} both name agent {:?}; each rank must have its own agent", Escaped(agent))]
    DuplicateAgent {
        /// The engine.
        engine: EngineId,
        /// The first rank naming it.
        first: usize,
        /// The second.
        second: usize,
        /// The agent.
        agent: String,
    },
    /// The keepalive service has stopped.
    #[error(transparent)]
    Stopped(#[from] ServiceStopped),
    /// The keepalive service refused the registration (what was loaded
    /// was given back).
    #[error("{0}")]
    Refused(String),
    /// GPU landing slots could not be had (`--memory vram`); whatever had
    /// been loaded was invalidated again.
    #[error("loading {engine}: GPU landing slots: {source}")]
    Memory {
        /// The engine.
        engine: EngineId,
        /// The driver's error.
        source: CudaError,
    },
}

impl HandshakeError {
    /// The `reason` label of `nixl_keepalive_pd_handshake_failures_total`
    /// (see [the list](super#what-is-counted)).
    pub fn reason(&self) -> &'static str {
        match self {
            HandshakeError::Connect { .. } => "connect",
            HandshakeError::Wire { source, .. } => match source {
                WireError::Io(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => "eof",
                WireError::Io(_) => "io",
                WireError::Timeout(_) => "timeout",
                _ => "bad_frame",
            },
            HandshakeError::Load { .. } => "load",
            HandshakeError::AgentMismatch { .. } => "agent_mismatch",
            HandshakeError::DuplicateAgent { .. } => "duplicate_agent",
            HandshakeError::Stopped(_) => "stopped",
            HandshakeError::Refused(_) => "refused",
            HandshakeError::Conflict(_) => "conflict",
            HandshakeError::Invalid(_) => "invalid",
            HandshakeError::Memory { .. } => "memory",
        }
    }
}

/// Asks the prefill at `address` for its engine id, metadata and layout.
pub async fn fetch(
    address: &PeerAddr,
    timeout: Duration,
) -> Result<HandshakeReply, HandshakeError> {
    let connect = tokio::time::timeout(timeout, TcpStream::connect(address.as_str()))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"))
        .and_then(|r| r)
        .map_err(|source| HandshakeError::Connect {
            address: address.clone(),
            source,
        })?;
    let mut stream = connect;
    let wire_err = |source| HandshakeError::Wire {
        address: address.clone(),
        source,
    };
    wire::write_frame(&mut stream, &wire::encode_request())
        .await
        .map_err(wire_err)?;
    let reply = wire::read_frame(&mut stream, wire::MAX_FRAME, timeout)
        .await
        .and_then(|p| wire::decode_reply(&p));
    match reply {
        Ok(r) => Ok(r),
        Err(e) => {
            if !matches!(e, WireError::Io(_) | WireError::Timeout(_)) {
                crate::pd::bad_frame("decode", address.as_str(), &e);
            }
            Err(wire_err(e))
        }
    }
}

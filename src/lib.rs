//! nixl-keepalive (crate docs to come).
#![forbid(unsafe_code)]

pub mod transport;

pub use nixl_sys::NixlStatus;
pub use transport::{AgentName, EngineId, PeerAddr, ReleaseStep, ReleaseTarget, Transport, TransportError};
pub use ucx_sys::UcsStatus;

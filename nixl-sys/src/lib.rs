//! Bindings to the NIXL runtime that keep NIXL's raw status codes.
//!
//! The runtime is found and loaded at run time, so this crate builds on a
//! machine without NIXL. Install the pinned runtime with
//! `scripts/install-nixl.sh`, or point `NIXL_PREFIX` at another install.
//!
//! NIXL's released C API (1.5.x) folds most failures, among them
//! `REMOTE_DISCONNECT`, into one generic code. This crate reaches the C++
//! members whose status matters through a small C++ shim (its own
//! declarations, member addresses resolved at run time) and uses the C API
//! for the rest; on a runtime with the newer 1:1 C API it uses that
//! throughout. Either way statuses arrive as one type, [`NixlStatus`], in
//! the C++ numbering, and become [`NixlError`] in one place.
//!
//! # Releasing a peer
//!
//! [`Agent::invalidate_remote_metadata`] also closes the peer's UCX
//! endpoints at once, live peer or dead, and says what it closed
//! ([`EndpointCloses`]): NIXL 1.5.1 alone closes a live peer's endpoint in
//! UCX's flush mode, which keeps it (and its TCP socket) until the agent is
//! destroyed. See [`endpoints`] for how, and [`Agent::ucx_endpoints`] for
//! UCX's own view of an agent's endpoints.
//!
//! # Thread safety
//!
//! A NIXL agent's default thread-sync mode is NONE (no locking). This crate
//! only creates agents in a locking mode, [`ThreadSync::Rw`] (default) or
//! [`ThreadSync::Strict`]; that is what makes [`Agent`] `Send + Sync`.
//! Share an `Agent` freely; drive each [`XferRequest`] from one thread at a
//! time (its methods take `&mut self`).
//!
//! # Progress thread
//!
//! NIXL's progress thread busy-polls a core by default. The default here is
//! [`ProgressThread::Off`]: no CPU while idle, and UCX progresses inside
//! NIXL calls (`get_notifs`, transfer status, notifications), so a process
//! must call into its agent regularly, also to serve peers' READs. Measured
//! with the 1.5.1 wheel, two idle connected agents in one process: off 0%,
//! polling without delay 67% of a core (on a busy 2-core machine), 100 µs
//! delay 4.3%, 1 ms 3.7%, 10 ms 0.7%. For an agent that does not call into
//! NIXL on its own, use [`ProgressThread::Polling`] with a delay of about
//! 1 ms.

#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

mod agent;
pub mod cuda;
pub mod endpoints;
mod error;
mod runtime;
mod sockets;
mod status;
/// Test support for the real runtime (feature `testing`): not part of the
/// binding's API, for this workspace's tests and anyone testing against
/// the real runtime the same way.
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use agent::{
    Agent, AgentConfig, Desc, DlistHandle, DramRegistration, MemType, Notification, ProgressThread,
    ThreadSync, XferRequest, XferState,
};
pub use endpoints::{
    BadEpCloseSetting, EndpointCloseMode, EndpointCloser, EndpointCloses, UcxEndpoint, UcxEndpoints,
};
pub use error::{check_agent_name, AgentNameProblem, LoadError, NixlError, Refusal, StatusSource};
pub use runtime::{ApiKind, Runtime, DEFAULT_RUNTIME_DIR, PREFIX_ENV};
pub use sockets::Connections;
pub use status::NixlStatus;

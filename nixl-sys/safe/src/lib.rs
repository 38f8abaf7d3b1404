//! Safe NIXL agents that keep NIXL's raw status codes: the safe half of
//! the binding whose raw half is `nixl-sys`.
//!
//! [`Agent`] owns a NIXL agent with the UCX backend and every handle made
//! from it (registrations, dlist handles, transfer requests), each released
//! once, on drop. The runtime is found and loaded at run time by
//! `nixl-sys` ([`Runtime::get`]), so this crate builds on a machine without
//! NIXL. Install the pinned runtime with `scripts/install-nixl.sh`, or
//! point `NIXL_PREFIX` at another install. What a user needs from
//! `nixl-sys` is re-exported here ([`Runtime`], [`NixlStatus`],
//! [`LoadError`], ...): depend on this crate alone.
//!
//! NIXL's released C API (1.5.x) folds most failures, among them
//! `REMOTE_DISCONNECT`, into one generic code. `nixl-sys` reaches the C++
//! members whose status matters through a small C++ shim and uses the C
//! API for the rest; on a runtime with the newer 1:1 C API it uses that
//! throughout. Either way statuses arrive as one type, [`NixlStatus`], in
//! the C++ numbering, with where they came from ([`StatusSource`]), and
//! become [`NixlError`] in one place.
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
mod binding;
pub mod cuda;
pub mod endpoints;
mod error;
pub mod failures;
mod foreign;
pub mod gpu;
mod sockets;
/// Test support for the real runtime (feature `testing`; `nixl-sys`'s,
/// re-exported): not part of the binding's API, for this workspace's tests
/// and anyone testing against the real runtime the same way.
#[cfg(feature = "testing")]
pub mod testing {
    pub use nixl_sys::testing::{
        fail_when_required_and_missing, real_runtime, BUILT_WITH_RUNTIME, FAKE_CUDA_DIR,
        REQUIRE_REAL_ENV,
    };
}

pub use agent::{
    Agent, AgentConfig, Desc, DlistHandle, DramRegistration, MemType, Notification, ProgressThread,
    ThreadSync, XferRequest, XferState,
};
pub use endpoints::{
    BadEpCloseSetting, EndpointCloseMode, EndpointCloser, EndpointCloses, UcxEndpoint, UcxEndpoints,
};
pub use error::{check_agent_name, AgentNameProblem, NixlError, Refusal};
pub use foreign::LoadedConnections;
pub use nixl_sys::{
    ApiKind, LoadError, NixlStatus, Runtime, StatusSource, DEFAULT_RUNTIME_DIR, PREFIX_ENV,
};
pub use sockets::Connections;

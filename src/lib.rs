//! nixl-keepalive: notices when a NIXL prefill peer is gone and gives its
//! memory back, fast, without ever pulling state out from under a transfer
//! that is still running.
//!
//! A decode engine pulls KV cache from prefill engines with NIXL READs.
//! When a prefill dies or restarts, the decoder's NIXL agent keeps the dead
//! peer's remote metadata, UCX endpoints and unpacked remote keys; on
//! multi-node NVLink those keys map the dead prefill's GPU memory, and the
//! restarted prefill cannot get it back. This crate is a background service
//! the decoder runtime spawns as a tokio task. It:
//!
//! - heartbeats every known prefill engine on its own jittered schedule,
//!   rate limited per engine; the heartbeat is vLLM's lease renewal
//!   (`HB:` + request ids), so prefills already understand it;
//! - tells REMOTE_DISCONNECT (from heartbeats and from transfer results)
//!   apart from every other error, keeping the raw NIXL status;
//! - releases a dead, replaced or retired engine (dlist handles, remote
//!   metadata, timers, limiter keys) as soon as no read from it is in
//!   flight and no handshake is pending at its address, and never before;
//! - notices a prefill that came back at the same `host:port` under a new
//!   engine id.
//!
//! # Pull and push
//!
//! The service is role-neutral: it keeps alive and releases *peers*, the
//! engines whose memory the embedding runtime transfers with. In pull mode
//! (above, vLLM's default) that is a decode embedding it for its prefills;
//! in push mode (SGLang's NIXL path) a prefill embeds it for every decode
//! it WRITEs into, guards each write with [`EngineRef::begin_write`] (the
//! same guard as a read), and a dead decode's metadata and keys are given
//! back as a dead prefill's are. Where the docs say prefill, read the peer.
//!
//! # Embedding it
//!
//! ```
//! use std::sync::Arc;
//! use nixl_keepalive::fake::{FakeConfig, FakeUcx};
//! use nixl_keepalive::{Config, Event, NixlStatus, PeerAddr, Ready};
//! use tokio_util::sync::CancellationToken;
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! // The transport: the real `NixlTransport` in production; the fake here.
//! let ucx = FakeUcx::new(FakeConfig::default());
//! let address = PeerAddr::from("10.0.0.7:5600");
//! let prefill = ucx.spawn_prefill(address.clone(), 2);
//!
//! // 1. Spawn the service (configuration from NIXL_KEEPALIVE_* variables).
//! let config = Config::from_env().expect("bad NIXL_KEEPALIVE_* value");
//! let shutdown = CancellationToken::new();
//! let (keepalive, task) = nixl_keepalive::spawn(Arc::new(ucx.clone()), config, shutdown.clone());
//! let mut events = keepalive.subscribe();
//!
//! // 2. Connect (or reconnect, or reload a pinned id): the handshake
//! //    protocol. Who the prefill says it is is arbitrated before anything
//! //    is loaded; an old registration of its id goes first.
//! let handshake = keepalive.handshake(address.clone());
//! let metadata = ucx.fetch_metadata(&address).unwrap(); // the side channel
//! let engine = match handshake.ready_to_load(metadata.claim()).await.unwrap() {
//!     Ready::Current(engine) => engine, // this process is registered already
//!     Ready::Load(ready) => {
//!         let loaded = ucx.load_metadata(&metadata).unwrap(); // loadRemoteMD + prepXferDlist
//!         ready.register(loaded.resources).await.unwrap()
//!     }
//! };
//!
//! // 3. Wrap every read: the engine is never released while a guard lives.
//! let read = engine.begin_read().expect("engine is live");
//! ucx.crash(&prefill); // the prefill dies mid-transfer
//! let status = ucx.read(&prefill); // what getXferStatus says
//! // 4. Report how the transfer ended: REMOTE_DISCONNECT marks the engine.
//! read.finish(status);
//!
//! // 5. Listen to events to fail requests instead of letting them hang.
//! loop {
//!     match events.recv().await.unwrap() {
//!         Event::Unreachable { status, .. } => assert_eq!(status, NixlStatus::ERR_REMOTE_DISCONNECT),
//!         Event::Released { engine, .. } => { assert_eq!(engine, prefill); break; }
//!         _ => {}
//!     }
//! }
//! assert!(engine.begin_read().is_err());
//! shutdown.cancel();
//! let stopped = task.await.unwrap();
//! assert!(stopped.unreleased.is_empty());
//! ucx.assert_nothing_leaked();
//! # }
//! ```
//!
//! # One identity per prefill
//!
//! Who a prefill is (address, engine id, incarnation, agent names) is
//! arbitrated in one place for every source: a handshake's
//! [`Claim`] is judged before anything is loaded
//! ([`Handshake::ready_to_load`]), membership records are judged against
//! the registration they name ([`KeepaliveHandle::member_gone`]). Only
//! authoritative evidence retires a live engine; anything that merely
//! disagrees is a [`Conflict`]: refused, logged once, counted, never a
//! release. The rules are in the repository's `docs/design/identity.md`.
//!
//! # Features
//!
//! None by default: the service, [`Transport`] and
//! [`transport::nixl::NixlTransport`]. `fake`: the fault-injecting fake UCX
//! (`nixl_keepalive::fake`), for tests. `membership`: cluster membership
//! (`nixl_keepalive::membership`: the source trait, the in-memory store,
//! the reconciler). `etcd`: the etcd source and prefill registration (its
//! build runs `protoc`). `serde`: `Serialize` for [`Event`]. `control`: the
//! control server (`nixl_keepalive::control`): the router's endpoint, the
//! snapshot and `/metrics` over HTTP, on axum.
//!
//! # An API that grows
//!
//! Events, errors and the reports the service hands out are
//! `#[non_exhaustive]`: match the variants you act on and end with
//! `_ => {}`, name fields with `..`. The calls that hand the service
//! something to do return [`ServiceStopped`] (or an error that holds it)
//! once it has stopped, rather than dropping the request silently.
//!
//! # How it is built
//!
//! The rules live in one synchronous state machine, the core (`src/core/`):
//! every input carries `now`, every decision comes out as an action, it
//! owns its timers and takes its randomness from outside, and it imports
//! neither the driver nor the offload queue. The driver ([`Keepalive`])
//! owns tokio's clock, the transport and the channels, sleeps to the core's
//! next deadline and carries out its actions. Reads are counted per
//! registration by the thread that reads first with plain stores, by the
//! others with one atomic word, a `membarrier` on the service's side
//! keeping the two honest ([`EngineRef::begin_read`]), so the hot path
//! takes no lock and, on its usual thread, no locked instruction. Transport calls are blocking FFI; they run on
//! blocking workers in batches, and a watchdog gives the calls queued
//! behind a hung one a worker of their own.
#![forbid(unsafe_code)]
#![deny(missing_docs, unreachable_pub)]

pub mod config;
#[cfg(feature = "control")]
pub mod control;
mod core;
mod driver;
mod error;
mod event;
#[cfg(feature = "fake")]
pub mod fake;
mod give_up;
pub mod lease;
// Hidden modules: public only because the workspace's command line, tests,
// benchmarks and fuzz target share them; no embedding API, no promise
// across releases. `log_limit`: the CLI rate-limits its own log lines with
// it. `text`: the CLI checks and escapes peers' names with it (its error
// type, part of the API, is re-exported as `NameError`). `ucx::time`: the
// CLI's demo flags and the fuzz target parse UCX times with it (its types
// in the API are re-exported from `ucx::settings`).
#[doc(hidden)]
pub mod log_limit;
#[cfg(feature = "membership")]
pub mod membership;
mod names;
mod read_accounting;
mod registration;
mod shrink;
mod snapshot;
mod state;
mod telemetry;
#[doc(hidden)]
pub mod text;
pub mod transport;
pub mod ucx;

pub use crate::core::HEARTBEAT_SLOT;
pub use config::{Config, ConfigBuilder, ConfigError, ConfigErrors, StallAction};
pub use driver::engine_ref::{
    Destination, EngineRef, GivenUpRead, OwnedReadGuard, OwnedTransferGuard, OwnedWriteGuard,
    ReadGuard, TransferGuard, WriteGuard, MAX_READS_IN_FLIGHT,
};
pub use driver::handle::{Handshake, KeepaliveHandle, Ready, ReadyToLoad};
#[doc(hidden)]
pub use driver::offload::HUNG_AFTER;
pub use driver::service::{spawn, Keepalive, Stopped};
pub use error::{ClaimRefused, Conflict, ReadRefused, RegisterError, ReleaseHeld, ServiceStopped};
pub use event::{Event, EventField, ReleaseReason, Source, WaitedFor};
pub use give_up::GiveUp;
pub use lease::LeaseError;
pub use registration::{
    Claim, Departure, GoneMode, Incarnation, PeerRef, Registration, RegistrationId,
};
pub use snapshot::{
    CallInFlight, DetectionSummary, EngineSnapshot, GivenUpSnapshot, HeartbeatSnapshot, Snapshot,
    TransportSnapshot,
};
pub use state::EngineState;
pub use text::NameError;

pub use nixl_status::NixlStatus;
pub use nixl_status::UcsStatus;
pub use transport::{
    AgentName, EndpointClose, EngineId, FailureWatch, GpuMappings, PeerAddr, ReleaseStep,
    ReleaseTarget, ResolveError, Suspicion, Suspicions, Transfers, Transport, TransportError,
};

//! Raw bindings to the NIXL runtime, loaded at run time, that keep NIXL's
//! raw status codes.
//!
//! This is the `-sys` half of the binding: it finds and loads the runtime
//! ([`Runtime::get`]), holds its function tables ([`Capi`], and the C++
//! members reached through the crate's C++ shim) and offers the calls whose
//! status matters as `unsafe fn`s on [`Runtime`], each returning the raw
//! status as [`NixlStatus`] (C++ numbering) with the interface it came
//! through ([`StatusSource`]). It also loads the endpoint-close interposer
//! ([`endpoints`]) and the CUDA driver's table ([`cuda`]). It owns no NIXL
//! object: handles are plain pointers whose lifetimes the caller manages.
//!
//! Use the safe crate, `nixl-agent` (folder `nixl-sys/safe/` of the
//! repository), instead: its `Agent` owns every handle, turns statuses into
//! errors in one place, and re-exports what users need from here.
//!
//! The runtime is found and loaded at run time, so this crate builds on a
//! machine without NIXL. Install the pinned runtime with
//! `scripts/install-nixl.sh`, or point `NIXL_PREFIX` at another install.
//!
//! NIXL's released C API (1.5.x) folds most failures, among them
//! `REMOTE_DISCONNECT`, into one generic code. This crate reaches the C++
//! members whose status matters through a small C++ shim (its own
//! declarations, member addresses resolved at run time, the handles'
//! layout checked against the loaded runtime before anything uses it) and
//! uses the C API for the rest; on a runtime with the newer 1:1 C API it
//! uses that throughout.

#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

pub mod cuda;
pub mod endpoints;
mod error;
pub mod gpu;
mod locate;
mod runtime;
mod status;
/// Test support for the real runtime (feature `testing`): not part of the
/// binding's API, for this workspace's tests and anyone testing against
/// the real runtime the same way (`nixl-agent` re-exports it).
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use endpoints::{BadEpCloseSetting, EndpointCloseMode};
pub use error::LoadError;
pub use nixl_status::NixlStatus;
pub use runtime::{
    ApiKind, Capi, CapiAgentConfig, CapiHandle, CapiStatus, RawStatus, Runtime,
    DEFAULT_RUNTIME_DIR, PREFIX_ENV,
};
pub use status::StatusSource;

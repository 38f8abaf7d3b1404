//! Bindings to the NIXL runtime that keep NIXL's raw status codes.
//!
//! The runtime is found and loaded at run time, so this crate builds on a
//! machine without NIXL.

mod status;

pub use status::NixlStatus;

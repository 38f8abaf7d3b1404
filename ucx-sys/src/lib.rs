//! Bindings to UCX: the status table, and (when a UCX library can be
//! loaded at run time) its version, status strings and configuration.

mod status;

pub use status::UcsStatus;

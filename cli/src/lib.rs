//! The parts of the `nixl-keepalive` command line that its tests drive
//! too: real prefill and decode processes on the NIXL runtime ([`pd`]).
//!
//! Kept out of the `nixl-keepalive` library, so that a decoder runtime that
//! depends on the library pulls only the service, the transport trait and
//! `NixlTransport`: no side channel, no CLI dependencies, no tokio
//! test-util.
#![forbid(unsafe_code)]

pub mod pd;

//! The driver: everything that runs the core's rules in a tokio process.
//! `service` is the task (it owns tokio's clock, sleeps to the core's
//! next deadline, hands the core its inputs and carries its actions out);
//! `handle` is what the runtime holds (the one input channel, the
//! handshake protocol as calls and guards); `engine` is a registered
//! engine's reference and its read guards (the hot path, counting in
//! [`crate::read_accounting`]); `offload` is the pool that runs the
//! transport's blocking calls and the watchdog that finds the hung ones.
//! The core never imports any of them.

pub(crate) mod engine_ref;
pub(crate) mod handle;
pub(crate) mod offload;
pub(crate) mod service;

use crate::read_accounting::cell::EngineCell;

/// The core as the driver runs it: over the real read accounting (the
/// cells the runtime's threads count in).
pub(crate) type Core<R> = crate::core::Core<R, EngineCell>;
/// An input to [`Core`].
pub(crate) type Input<R> = crate::core::Input<R, EngineCell>;
/// An answer of [`Core`].
pub(crate) type Answer<R> = crate::core::Answer<R, EngineCell>;
/// An action of [`Core`].
pub(crate) type Action<R> = crate::core::Action<R, EngineCell>;

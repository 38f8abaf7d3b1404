//! What the service object, its handshakes and its events share: the
//! library's handle, the transport, and the registrations made through
//! this binding. Its own module so that the service object
//! (`keepalive`) and the handshake protocol (`protocol`) both depend on it
//! and not on each other.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use nixl_keepalive::{EngineId, EngineRef, EngineState, KeepaliveHandle, Stopped};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::engine::{Engine, Identity};
use crate::transport::{PyResources, PyTransport};

/// What the service object, its handshakes and its events share.
pub(crate) struct Shared {
    pub(crate) handle: KeepaliveHandle<PyResources>,
    pub(crate) transport: Arc<PyTransport>,
    /// Registrations made through this binding, by engine id: the latest
    /// one of each id, with what the library does not keep.
    pub(crate) registry: Mutex<HashMap<EngineId, (EngineRef, Identity)>>,
    pub(crate) shutdown: CancellationToken,
    /// Cancelled once the service task has ended.
    pub(crate) stopped: CancellationToken,
    pub(crate) task: Mutex<Option<JoinHandle<Stopped<PyResources>>>>,
}

impl Shared {
    /// Starts the stop (the shutdown token) and takes the service task to
    /// wait on: `None` once a `close` has taken it already.
    pub(crate) fn begin_close(&self) -> Option<JoinHandle<Stopped<PyResources>>> {
        self.shutdown.cancel();
        self.task.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Keeps what the binding knows of a new registration; forgets
    /// released ones.
    pub(crate) fn remember(&self, engine: EngineRef, identity: Identity) -> Engine {
        let mut reg = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        reg.retain(|_, (e, _)| e.state() != EngineState::Released);
        reg.insert(engine.id().clone(), (engine.clone(), identity.clone()));
        Engine {
            inner: engine,
            identity,
        }
    }

    /// The `Engine` for `engine`, a registration the library answered
    /// with: what this binding knows of it when it made it, else `claimed`.
    pub(crate) fn current(&self, engine: EngineRef, claimed: Identity) -> Engine {
        let reg = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        let identity = match reg.get(engine.id()) {
            Some((e, identity)) if e.same_registration(&engine) => identity.clone(),
            _ => claimed,
        };
        Engine {
            inner: engine,
            identity,
        }
    }

    pub(crate) fn lookup(&self, engine: &EngineId) -> Option<Engine> {
        {
            let reg = self.registry.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((e, identity)) = reg.get(engine) {
                if e.state() != EngineState::Released {
                    return Some(Engine {
                        inner: e.clone(),
                        identity: identity.clone(),
                    });
                }
            }
        }
        self.handle.engine(engine).map(|inner| Engine {
            inner,
            identity: Identity {
                address: String::new(),
                agents: Vec::new(),
                incarnation: None,
            },
        })
    }
}

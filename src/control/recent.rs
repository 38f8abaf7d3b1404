//! What the fault-tolerance route remembers of the releases: an engine
//! a router names after its release is `released`, not `unknown`.

use std::collections::{HashMap, VecDeque};

use tokio::sync::broadcast;

use crate::{EngineId, Event, KeepaliveHandle, PeerAddr, RegistrationId};

/// Releases remembered, to answer `released` rather than `unknown`.
pub(super) const RECENT: usize = 1024;

/// The engines released since the server started (the last [`RECENT`]),
/// with their addresses where their registration was seen: read from the
/// service's events when a request needs them, so a release the service
/// has announced is seen by the next request.
pub(crate) struct Recent {
    events: broadcast::Receiver<Event>,
    /// Registrations seen registering and not yet released: their
    /// addresses (a release's event names none).
    addresses: HashMap<RegistrationId, (EngineId, PeerAddr)>,
    /// Oldest first.
    released: VecDeque<(EngineId, Option<PeerAddr>)>,
}

impl Recent {
    /// Subscribed to `handle`'s events from now on.
    pub(crate) fn new<R: Send + 'static>(handle: &KeepaliveHandle<R>) -> Recent {
        Recent {
            events: handle.subscribe(),
            addresses: HashMap::new(),
            released: VecDeque::new(),
        }
    }

    /// Reads the events announced since the last call.
    pub(super) fn catch_up<R: Send + 'static>(&mut self, handle: &KeepaliveHandle<R>) {
        let mut lagged = false;
        loop {
            match self.events.try_recv() {
                Ok(Event::Registered {
                    engine,
                    registration,
                    address,
                    ..
                }) => {
                    self.addresses.insert(registration, (engine, address));
                }
                Ok(Event::Released {
                    engine,
                    registration,
                    ..
                }) => {
                    let address = self.addresses.remove(&registration).map(|(_, a)| a);
                    if self.released.len() == RECENT {
                        self.released.pop_front();
                    }
                    self.released.push_back((engine, address));
                }
                Ok(_) => {}
                Err(broadcast::error::TryRecvError::Lagged(_)) => lagged = true,
                Err(_) => break,
            }
        }
        if lagged {
            // Releases were missed: forget the registrations that are no
            // longer registered (their release cannot be told any more),
            // so the table holds live registrations only.
            self.addresses.retain(|registration, (engine, _)| {
                handle
                    .engine(engine)
                    .is_some_and(|e| e.registration() == *registration)
            });
        }
    }

    pub(super) fn engine_released(&self, engine: &EngineId) -> bool {
        self.released.iter().any(|(e, _)| e == engine)
    }

    pub(super) fn address_released(&self, address: &PeerAddr) -> bool {
        self.released
            .iter()
            .any(|(_, a)| a.as_ref() == Some(address))
    }
}

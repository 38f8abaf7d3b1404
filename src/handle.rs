//! The decoder runtime's side of the service: [`KeepaliveHandle`], and the
//! reconnect protocol as types ([`Handshake`] then [`ReadyToLoad`]).
//!
//! Everything the handle and the read guards tell the service goes through
//! one channel, so the service sees it in the order it was said: a
//! handshake's end never arrives before its start, a transfer's error never
//! after the read's end.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use tokio::sync::{broadcast, mpsc, oneshot};

use crate::core::{EngineCell, Input, Wake, WakeSink};
use crate::engine::{EngineRef, ReadGuard};
use crate::error::{ReadRefused, RegisterError, ServiceStopped};
use crate::event::Event;
use crate::lease::{check_request_id, RequestIdError};
use crate::registration::{GoneMode, PeerRef, Registration};
use crate::snapshot::Snapshot;
use crate::state::EngineState;
use crate::transport::{EngineId, PeerAddr};

/// What the handle sends the driver.
pub(crate) enum Msg<R> {
    /// An input that wants no answer.
    Input(Input<R>),
    /// A handshake is ready to load `engine`; answered once it may.
    ReadyToLoad {
        ticket: u64,
        engine: EngineId,
        done: oneshot::Sender<Result<(), ServiceStopped>>,
    },
    /// A registration; answered with the engine or the refusal.
    Register {
        ticket: Option<u64>,
        registration: Registration<R>,
        cell: Arc<EngineCell>,
        done: oneshot::Sender<Result<EngineRef, RegisterError<R>>>,
    },
    /// The table as it is now.
    Snapshot(oneshot::Sender<Snapshot>),
}

impl<R: Send + 'static> WakeSink for mpsc::UnboundedSender<Msg<R>> {
    fn wake(&self, wake: Wake) {
        // A stopped service is waiting for nothing.
        let _ = self.send(Msg::Input(Input::Read(wake)));
    }
}

/// Engines by id, for runtimes that look them up instead of keeping the
/// [`EngineRef`]. Written by the driver at activation and release only.
pub(crate) type Directory = Arc<RwLock<HashMap<EngineId, EngineRef>>>;

/// Handshake tickets: unique per process.
static NEXT_TICKET: AtomicU64 = AtomicU64::new(1);

/// The decoder runtime's side of the service. Cheap to clone; every method
/// is non-blocking except the `async` ones, which wait for the service.
pub struct KeepaliveHandle<R> {
    pub(crate) inbox: mpsc::UnboundedSender<Msg<R>>,
    pub(crate) sink: Arc<dyn WakeSink>,
    pub(crate) events: broadcast::Sender<Event>,
    pub(crate) directory: Directory,
}

impl<R> Clone for KeepaliveHandle<R> {
    fn clone(&self) -> Self {
        KeepaliveHandle {
            inbox: self.inbox.clone(),
            sink: self.sink.clone(),
            events: self.events.clone(),
            directory: self.directory.clone(),
        }
    }
}

impl<R: Send + 'static> KeepaliveHandle<R> {
    /// Starts a handshake with the prefill at `address`: the way to connect
    /// to an engine, reconnect to an address, or reload a pinned engine id.
    ///
    /// ```text
    /// let handshake = keepalive.handshake(address);         // 1. before the side channel
    /// let reply = side_channel(address).await?;             //    (who is there?)
    /// let ready = handshake.ready_to_load(&reply.engine).await?;  // 2. its old registration goes first
    /// let loaded = load_metadata_and_prep_dlists(&reply)?;  //    loadRemoteMD, prepXferDlist
    /// let engine = ready.register(registration(loaded)).await?;   // 3. live; the handshake ends
    /// ```
    ///
    /// Until the handshake ends, a marked engine at `address` is not
    /// released: the runtime may still be deciding whether the engine there
    /// is new. [`Handshake::ready_to_load`] lifts that for the engine id it
    /// names: whatever state that id's registration is in (live, marked,
    /// held by this very handshake), it is released (reads drained first)
    /// before the call resolves, so NIXL never loads metadata over loaded
    /// metadata and nothing waits for itself. Dropping the handshake at any
    /// step ends it; nothing is registered.
    pub fn handshake(&self, address: PeerAddr) -> Handshake<R> {
        let ticket = NEXT_TICKET.fetch_add(1, Ordering::Relaxed);
        let _ = self.inbox.send(Msg::Input(Input::HandshakeStarted {
            ticket,
            address: address.clone(),
        }));
        Handshake {
            ticket: Some(ticket),
            address,
            handle: self.clone(),
        }
    }

    /// Registers an engine whose metadata is loaded and dlists prepped,
    /// without a handshake of its own: a handshake, made ready for its id
    /// and registered at once. If the id is still held by an older
    /// registration, that one is released first and this resolves after;
    /// since the metadata is already loaded by then, use
    /// [`KeepaliveHandle::handshake`] for engine ids that may come back.
    ///
    /// Cancel safety: see [`ReadyToLoad::register`].
    pub async fn register(
        &self,
        registration: Registration<R>,
    ) -> Result<EngineRef, RegisterError<R>> {
        let handshake = self.handshake(registration.address.clone());
        match handshake.ready_to_load(&registration.engine).await {
            Ok(ready) => ready.register(registration).await,
            Err(ServiceStopped) => Err(RegisterError::Stopped(registration)),
        }
    }

    /// The registered engine `engine`, if any.
    pub fn engine(&self, engine: &EngineId) -> Option<EngineRef> {
        self.directory
            .read()
            .expect("directory poisoned")
            .get(engine)
            .cloned()
    }

    /// Starts a read from `engine` by id. Keeping the [`EngineRef`] and
    /// calling [`EngineRef::begin_read`] skips the lookup.
    pub fn begin_read(&self, engine: &EngineId) -> Result<ReadGuard, ReadRefused> {
        match self.engine(engine) {
            Some(e) => e.begin_read(),
            None => Err(ReadRefused {
                engine: engine.clone(),
                state: EngineState::Released,
            }),
        }
    }

    /// Renews these lease request ids with every heartbeat to `engine`
    /// until removed. With `renew_now`, a renewal goes out as soon as the
    /// engine's rate cap allows.
    ///
    /// Each id must be 1 to [`crate::lease::MAX_REQUEST_ID`] bytes of
    /// printable text without `,` (the separator of `HB:`'s ids): the
    /// first id that is not is in the error, and none of them is added.
    pub fn add_leases(
        &self,
        engine: &EngineId,
        requests: Vec<String>,
        renew_now: bool,
    ) -> Result<(), RequestIdError> {
        for id in &requests {
            check_request_id(id)?;
        }
        self.input(Input::AddLeases {
            engine: engine.clone(),
            requests,
            renew_now,
        });
        Ok(())
    }

    /// Asks for a lease renewal to `engine` as soon as its rate cap allows.
    pub fn renew_leases(&self, engine: &EngineId) {
        self.input(Input::AddLeases {
            engine: engine.clone(),
            requests: Vec::new(),
            renew_now: true,
        });
    }

    /// Stops renewing these lease request ids.
    pub fn remove_leases(&self, engine: &EngineId, requests: Vec<String>) {
        self.input(Input::RemoveLeases {
            engine: engine.clone(),
            requests,
        });
    }

    /// The router or orchestrator says a peer is gone. Idempotent; a no-op
    /// for unknown peers. `Fail` after `Drain` fails the reads still in
    /// flight.
    pub fn peer_gone(&self, peer: PeerRef, mode: GoneMode) {
        self.input(Input::PeerGone { peer, mode });
    }

    /// Events from now on. A subscriber slower than the event capacity
    /// misses the oldest and is told how many (`RecvError::Lagged`).
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.events.subscribe()
    }

    /// The table as it is now.
    ///
    /// Cancel safe.
    pub async fn snapshot(&self) -> Result<Snapshot, ServiceStopped> {
        let (done, wait) = oneshot::channel();
        self.inbox
            .send(Msg::Snapshot(done))
            .map_err(|_| ServiceStopped)?;
        wait.await.map_err(|_| ServiceStopped)
    }

    fn input(&self, input: Input<R>) {
        // A stopped service has nothing left to act on.
        let _ = self.inbox.send(Msg::Input(input));
    }
}

/// A handshake in progress (see [`KeepaliveHandle::handshake`]). Dropping
/// it ends the handshake.
#[must_use = "dropping the handshake ends it at once"]
pub struct Handshake<R: Send + 'static> {
    ticket: Option<u64>,
    address: PeerAddr,
    handle: KeepaliveHandle<R>,
}

impl<R: Send + 'static> Handshake<R> {
    /// The address this handshake is with.
    pub fn address(&self) -> &PeerAddr {
        &self.address
    }

    /// The handshake found `engine` at its address and will load its
    /// metadata. Resolves once no registration of `engine` is held: an
    /// old one, whatever its state, is marked (if live), its reads drain,
    /// and it is released first. Resolves at once for an id not
    /// registered.
    ///
    /// Only call it when the engine is to be loaded again: for a live
    /// engine id that is the engine already connected (same process), drop
    /// the handshake instead.
    ///
    /// Cancel safety: dropping the future ends the handshake; a mark it
    /// made stands.
    pub async fn ready_to_load(
        mut self,
        engine: &EngineId,
    ) -> Result<ReadyToLoad<R>, ServiceStopped> {
        let ticket = self.ticket.expect("a live handshake has its ticket");
        let (done, wait) = oneshot::channel();
        self.handle
            .inbox
            .send(Msg::ReadyToLoad {
                ticket,
                engine: engine.clone(),
                done,
            })
            .map_err(|_| ServiceStopped)?;
        wait.await.map_err(|_| ServiceStopped)??;
        let ticket = self.ticket.take();
        Ok(ReadyToLoad {
            handshake: Handshake {
                ticket,
                address: self.address.clone(),
                handle: self.handle.clone(),
            },
            engine: engine.clone(),
        })
    }

    /// Ends the handshake (as dropping it does).
    pub fn finish(self) {}
}

impl<R: Send + 'static> Drop for Handshake<R> {
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            let _ = self
                .handle
                .inbox
                .send(Msg::Input(Input::HandshakeFinished { ticket }));
        }
    }
}

/// A handshake whose engine id is free to load: load its metadata, prep its
/// dlists, then [`ReadyToLoad::register`]. Dropping it ends the handshake
/// with nothing registered.
#[must_use = "dropping it ends the handshake without registering"]
pub struct ReadyToLoad<R: Send + 'static> {
    handshake: Handshake<R>,
    engine: EngineId,
}

impl<R: Send + 'static> ReadyToLoad<R> {
    /// The engine id that may be loaded.
    pub fn engine(&self) -> &EngineId {
        &self.engine
    }

    /// Registers the engine loaded under this handshake and ends the
    /// handshake. The registration must be for [`ReadyToLoad::engine`].
    /// Refused registrations come back whole in the error, to give their
    /// resources back; a registration whose caller stopped waiting is
    /// handed back in [`crate::Stopped::unreleased`] at shutdown.
    ///
    /// Cancel safety: once polled, the registration is with the service;
    /// dropping the future does not undo it (find the engine with
    /// [`KeepaliveHandle::engine`]).
    pub async fn register(
        mut self,
        registration: Registration<R>,
    ) -> Result<EngineRef, RegisterError<R>> {
        let handle = self.handshake.handle.clone();
        let ticket = self.handshake.ticket.take();
        let engine = registration.engine.clone();
        let cell = EngineCell::new(engine.clone(), handle.sink.clone());
        let (done, wait) = oneshot::channel();
        let msg = Msg::Register {
            ticket,
            registration,
            cell,
            done,
        };
        if let Err(mpsc::error::SendError(msg)) = handle.inbox.send(msg) {
            let Msg::Register { registration, .. } = msg else {
                unreachable!("sent a registration")
            };
            return Err(RegisterError::Stopped(registration));
        }
        wait.await
            .unwrap_or(Err(RegisterError::ServiceGone { engine }))
    }
}

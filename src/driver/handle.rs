//! The decoder runtime's side of the service: [`KeepaliveHandle`], and the
//! reconnect protocol as types ([`Handshake`] then [`ReadyToLoad`]).
//!
//! Everything the handle and the read guards tell the service goes through
//! one channel, so the service sees it in the order it was said: a
//! handshake's end never arrives before its start, a transfer's error never
//! after the read's end.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use tokio::sync::{broadcast, mpsc, oneshot};

use super::{Answer, Input};
use crate::core::{RequestId, TicketId};
use crate::driver::engine_ref::{EngineRef, OwnedReadGuard};
use crate::error::{ClaimRefused, ReadRefused, RegisterError, ReleaseHeld, ServiceStopped};
use crate::event::Event;
use crate::lease::{check_request_id, LeaseError};
use crate::read_accounting::cell::{EngineCell, Wake, WakeSink};
use crate::registration::{Claim, Departure, GoneMode, PeerRef, Registration};
use crate::snapshot::Snapshot;
use crate::state::EngineState;
use crate::transport::{AgentName, EngineId, PeerAddr};

/// What the handle sends the driver.
pub(crate) enum Msg<R> {
    /// An input that wants no answer.
    Input(Input<R>),
    /// An input that is a question (it carries `request`): the core's
    /// answer goes to `reply`. The driver keeps `reply` until the core
    /// answers; every question is answered (or withdrawn) exactly once.
    Ask {
        request: RequestId,
        input: Input<R>,
        reply: oneshot::Sender<Answer<R>>,
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
pub(crate) type EngineIndex = Arc<RwLock<HashMap<EngineId, EngineRef>>>;

/// Handshake tickets and questions: unique per process.
static NEXT_TICKET: AtomicU64 = AtomicU64::new(1);
static NEXT_REQUEST: AtomicU64 = AtomicU64::new(1);

fn next_request() -> RequestId {
    RequestId(NEXT_REQUEST.fetch_add(1, Ordering::Relaxed))
}

/// The decoder runtime's side of the service. Cheap to clone; every method
/// is non-blocking except the `async` ones, which wait for the service.
pub struct KeepaliveHandle<R> {
    pub(crate) inbox: mpsc::UnboundedSender<Msg<R>>,
    pub(crate) sink: Arc<dyn WakeSink>,
    pub(crate) events: broadcast::Sender<Event>,
    pub(crate) engines: EngineIndex,
    /// Registrations refused because the service had stopped, whose
    /// futures were dropped before they could hand them back
    /// ([`KeepaliveHandle::take_handed_back`]).
    pub(crate) handed_back: HandedBack<R>,
}

/// Where a refused registration goes when nobody is left to take it from
/// its future: shared by every clone of a handle.
pub(crate) type HandedBack<R> = Arc<Mutex<Vec<Registration<R>>>>;

impl<R> Clone for KeepaliveHandle<R> {
    fn clone(&self) -> Self {
        KeepaliveHandle {
            inbox: self.inbox.clone(),
            sink: self.sink.clone(),
            events: self.events.clone(),
            engines: self.engines.clone(),
            handed_back: self.handed_back.clone(),
        }
    }
}

/// A registration the stopped service refused, on its way back to the
/// caller in a future's `RegisterError::Stopped`. Dropped before it got
/// there (the future dropped unpolled), it goes to the handle's
/// [`KeepaliveHandle::take_handed_back`] instead of being lost: every
/// registration handed to the library ends exactly once.
struct Refused<R> {
    registration: Option<Registration<R>>,
    handed_back: HandedBack<R>,
}

impl<R> Refused<R> {
    fn take(mut self) -> Registration<R> {
        self.registration.take().expect("taken once")
    }
}

impl<R> Drop for Refused<R> {
    fn drop(&mut self) {
        if let Some(registration) = self.registration.take() {
            tracing::warn!(
                engine = %registration.engine,
                "a registration refused by the stopped service was dropped unread: kept for take_handed_back()"
            );
            self.handed_back
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(registration);
        }
    }
}

impl<R: Send + 'static> KeepaliveHandle<R> {
    /// Starts a handshake with the prefill at `address`: the way to connect
    /// to an engine, reconnect to an address, or reload a pinned engine id.
    ///
    /// ```text
    /// let handshake = keepalive.handshake(address);          // 1. before the side channel
    /// let reply = side_channel(address).await?;              //    who is there?
    /// match handshake.ready_to_load(reply.claim()).await? {  // 2. the identity is arbitrated
    ///     Ready::Current(engine) => engine,                  //    this process is registered: load nothing
    ///     Ready::Load(ready) => {
    ///         let loaded = load_metadata_and_prep_dlists(&reply)?;  // loadRemoteMD, prepXferDlist
    ///         ready.register(loaded).await?                  // 3. live; the handshake ends
    ///     }
    /// }
    /// ```
    ///
    /// `address` should be canonical ([`PeerAddr::resolve`]): aliases of one
    /// prefill must be one address. Until the handshake ends, a marked
    /// engine at `address` is not released: the runtime may still be
    /// deciding whether the engine there is new.
    /// [`Handshake::ready_to_load`] arbitrates who the prefill says it is
    /// before anything is loaded (see the crate's identity rules): its
    /// agent names are claimed for this handshake alone, an older
    /// registration of the engine id is released first (reads drained), a
    /// second load of one id waits for the first, and a conflict with a
    /// registered engine is refused without touching it. Dropping the
    /// handshake at any step ends it; nothing is registered.
    pub fn handshake(&self, address: PeerAddr) -> Handshake<R> {
        self.start_handshake(address, false)
    }

    /// Starts a handshake with a peer at the address it *declares* (SGLang's
    /// decode registers its own `rank_ip:rank_port` with the prefill), not
    /// one the runtime reached: the same steps as
    /// [`KeepaliveHandle::handshake`], but a declaration is not evidence
    /// that the engine there was replaced. A claim of another engine id at
    /// an address a live engine holds is refused
    /// ([`Conflict::AddressInUse`](crate::Conflict::AddressInUse)) and the
    /// holder is sent a heartbeat at once: when it is gone, it is released
    /// on that heartbeat's REMOTE_DISCONNECT, and a handshake after the
    /// release (wait for [`EngineRef::released`]) is granted. Two peers
    /// declaring one address never get the healthy one released.
    pub fn handshake_declared(&self, address: PeerAddr) -> Handshake<R> {
        self.start_handshake(address, true)
    }

    fn start_handshake(&self, address: PeerAddr, declared: bool) -> Handshake<R> {
        let ticket = TicketId(NEXT_TICKET.fetch_add(1, Ordering::Relaxed));
        let _ = self.inbox.send(Msg::Input(Input::HandshakeStarted {
            ticket,
            address: address.clone(),
            declared,
        }));
        Handshake {
            ticket: Some(ticket),
            address,
            handle: self.clone(),
        }
    }

    /// Registers an engine whose metadata is loaded and dlists prepped,
    /// without a handshake of its own: its identity is claimed and it is
    /// activated at once. Refused ([`RegisterError::Conflict`]) when its
    /// engine id is registered or being loaded, or one of its agent names
    /// belongs to another engine: its metadata was loaded without the
    /// service's arbitration, so it cannot wait for an old registration's
    /// release (that release would invalidate what it loaded). Load engine
    /// ids that may come back through [`KeepaliveHandle::handshake`].
    ///
    /// Cancel safety: the registration is with the service when this
    /// returns, before the future is first polled; dropping the future
    /// loses nothing (an activated engine is found with
    /// [`KeepaliveHandle::engine`], a refused one is handed back in
    /// [`crate::Stopped::unreleased`]; one refused because the service
    /// had stopped already is kept for
    /// [`KeepaliveHandle::take_handed_back`]).
    pub fn register(
        &self,
        registration: Registration<R>,
    ) -> impl std::future::Future<Output = Result<EngineRef, RegisterError<R>>> + Send + 'static
    {
        self.send_registration(None, registration)
    }

    fn send_registration(
        &self,
        ticket: Option<TicketId>,
        registration: Registration<R>,
    ) -> impl std::future::Future<Output = Result<EngineRef, RegisterError<R>>> + Send + 'static
    {
        let engine = registration.engine.clone();
        let cell = EngineCell::new(engine.clone(), self.sink.clone());
        let request = next_request();
        let (reply, answer) = oneshot::channel();
        let sent = self
            .inbox
            .send(Msg::Ask {
                request,
                input: Input::Register {
                    request,
                    ticket,
                    registration,
                    cell,
                },
                reply,
            })
            .map_err(|mpsc::error::SendError(msg)| match msg {
                Msg::Ask {
                    input: Input::Register { registration, .. },
                    ..
                } => Refused {
                    registration: Some(registration),
                    handed_back: self.handed_back.clone(),
                },
                _ => unreachable!("sent a registration"),
            });
        async move {
            sent.map_err(|refused| RegisterError::Stopped(refused.take()))?;
            match answer.await {
                Ok(Answer::Registered(cell)) => Ok(EngineRef { cell }),
                Ok(Answer::Refused(error)) => Err(error),
                _ => Err(RegisterError::ServiceGone { engine }),
            }
        }
    }

    /// Registrations that were refused because the service had stopped and
    /// whose futures were dropped before they said so
    /// (`drop(handle.register(r))` after the stop): taken out here, once
    /// each. Give each back as you would [`crate::Stopped::unreleased`].
    /// Empty while the service runs (a running service answers every
    /// registration: activated, or handed back in its `Stopped`).
    pub fn take_handed_back(&self) -> Vec<Registration<R>> {
        std::mem::take(&mut *self.handed_back.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// A question to the service: the answer, or `None` when the service
    /// has stopped.
    async fn ask(&self, input: impl FnOnce(RequestId) -> Input<R>) -> Option<Answer<R>> {
        let request = next_request();
        let (reply, answer) = oneshot::channel();
        self.inbox
            .send(Msg::Ask {
                request,
                input: input(request),
                reply,
            })
            .ok()?;
        answer.await.ok()
    }

    /// The membership plane says a record is gone (its key was deleted,
    /// its lease expired, a fresh list no longer has it). The engine is
    /// retired (in `mode`) only if the record is its registration's own:
    /// the same address and, when both are known, the same incarnation. A
    /// record that disagrees with the registration (a dead predecessor's
    /// record expiring late, one engine id listed at two addresses) is an
    /// identity conflict: counted, logged once, never a release. A no-op
    /// for engines not registered.
    ///
    /// [`ServiceStopped`] when the service is no longer running: nothing
    /// was retired by this call (a stopped service released or handed back
    /// every engine already).
    pub fn member_gone(&self, departure: Departure, mode: GoneMode) -> Result<(), ServiceStopped> {
        self.input(Input::MemberGone { departure, mode })
    }

    /// The registered engine `engine`, if any.
    pub fn engine(&self, engine: &EngineId) -> Option<EngineRef> {
        self.engines
            .read()
            .expect("engine index poisoned")
            .get(engine)
            .cloned()
    }

    /// Starts a read from `engine` by id. Keeping the [`EngineRef`] and
    /// calling [`EngineRef::begin_read`] skips the lookup (and the guard's
    /// own reference to the registration: this guard owns one).
    pub fn begin_read(&self, engine: &EngineId) -> Result<OwnedReadGuard, ReadRefused> {
        match self.engine(engine) {
            Some(e) => e.begin_read_owned(),
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
    /// first id that is not is in the error
    /// ([`LeaseError::RequestId`]), and none of them is added.
    /// [`LeaseError::Stopped`] when the service is no longer running:
    /// nothing will renew them.
    pub fn add_leases(
        &self,
        engine: &EngineId,
        requests: Vec<String>,
        renew_now: bool,
    ) -> Result<(), LeaseError> {
        for id in &requests {
            check_request_id(id)?;
        }
        self.input(Input::AddLeases {
            engine: engine.clone(),
            requests,
            renew_now,
        })?;
        Ok(())
    }

    /// Asks for a lease renewal to `engine` as soon as its rate cap allows.
    /// [`ServiceStopped`] when the service is no longer running: no
    /// renewal will go out.
    pub fn renew_leases(&self, engine: &EngineId) -> Result<(), ServiceStopped> {
        self.input(Input::AddLeases {
            engine: engine.clone(),
            requests: Vec::new(),
            renew_now: true,
        })
    }

    /// Stops renewing these lease request ids. [`ServiceStopped`] when the
    /// service is no longer running (it renews nothing any more).
    pub fn remove_leases(
        &self,
        engine: &EngineId,
        requests: Vec<String>,
    ) -> Result<(), ServiceStopped> {
        self.input(Input::RemoveLeases {
            engine: engine.clone(),
            requests,
        })
    }

    /// The router or orchestrator says a peer is gone. Idempotent; a no-op
    /// for unknown peers. `Fail` after `Drain` fails the reads still in
    /// flight.
    ///
    /// [`ServiceStopped`] when the service is no longer running: the call
    /// changed nothing (a stopped service released or handed back every
    /// engine already), so a router can tell "noted" from "nobody there".
    pub fn peer_gone(&self, peer: PeerRef, mode: GoneMode) -> Result<(), ServiceStopped> {
        self.input(Input::PeerGone { peer, mode })
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

    /// Hands `input` to the driver; refused once the driver is gone (the
    /// service stopped: nothing is left to act on it).
    fn input(&self, input: Input<R>) -> Result<(), ServiceStopped> {
        self.inbox
            .send(Msg::Input(input))
            .map_err(|_| ServiceStopped)
    }
}

/// A handshake in progress (see [`KeepaliveHandle::handshake`]). Dropping
/// it ends the handshake.
#[must_use = "dropping the handshake ends it at once"]
pub struct Handshake<R: Send + 'static> {
    ticket: Option<TicketId>,
    address: PeerAddr,
    handle: KeepaliveHandle<R>,
}

impl<R: Send + 'static> Handshake<R> {
    /// The address this handshake is with.
    pub fn address(&self) -> &PeerAddr {
        &self.address
    }

    /// The handshake found `claim` at its address and wants to load it.
    /// Resolves once the service has judged the claim (see the crate's
    /// identity rules):
    /// - [`Ready::Load`]: load the metadata, prep the dlists, then
    ///   [`ReadyToLoad::register`]. The claim's agent names are this
    ///   handshake's alone until it registers or is dropped; an older
    ///   registration of the engine id (another incarnation at this
    ///   address, or marked) was released first, its reads drained; a
    ///   second load of one engine id waited for the first.
    /// - [`Ready::Current`]: this engine incarnation (same id, same agents)
    ///   is registered at this address already: load nothing, use it. The
    ///   handshake has ended.
    /// - [`ClaimRefused::Conflict`]: an agent name belongs to another
    ///   engine, or the engine id is live at another address. Nothing was
    ///   touched; the conflict is logged once and counted. Retry later
    ///   with back-off, never in a loop.
    ///
    /// Cancel safety: dropping the future ends the handshake; a mark it
    /// made stands; nothing was loaded under it.
    pub async fn ready_to_load(mut self, claim: Claim) -> Result<Ready<R>, ClaimRefused> {
        let ticket = self.ticket.expect("a live handshake has its ticket");
        let answer = self
            .handle
            .ask(|request| Input::Claim {
                ticket,
                request,
                claim: claim.clone(),
            })
            .await;
        match answer {
            Some(Answer::Load) => {
                let ticket = self.ticket.take();
                Ok(Ready::Load(ReadyToLoad {
                    handshake: Handshake {
                        ticket,
                        address: self.address.clone(),
                        handle: self.handle.clone(),
                    },
                    claim,
                }))
            }
            Some(Answer::Current(cell)) => Ok(Ready::Current(EngineRef { cell })),
            Some(Answer::ClaimRefused(refused)) => Err(refused),
            _ => Err(ClaimRefused::Stopped(ServiceStopped)),
        }
    }

    /// [`Handshake::ready_to_load`], waiting at most `limit` for the claim
    /// to be judged. Past it the claim is refused with
    /// [`ClaimRefused::ReleaseHeld`], which names the older registration
    /// of the engine id whose release the claim waited for, and the reads
    /// that hold it (from a snapshot taken as the wait ran out).
    ///
    /// Use this wherever the task or thread that handshakes is also one
    /// that ends transfers (finishes reads, reports given-up reads ended):
    /// a replaced registration is released only once its transfers end,
    /// so an unbounded wait there waits for itself. A claim that waits on
    /// nothing is judged at once; `limit` bounds only that release wait
    /// (and the service's answer). `Duration::ZERO` refuses any claim the
    /// service does not answer before the first poll, which is every
    /// claim: pass a real bound (the Python binding's default is 5 s,
    /// vLLM's own handshake timeout). A limit too long for the clock
    /// (`Duration::MAX`) waits as [`Handshake::ready_to_load`] does.
    ///
    /// Cancel safety: as [`Handshake::ready_to_load`]; running out ends
    /// the handshake the same way (a mark it made stands; nothing was
    /// loaded under it).
    pub async fn ready_to_load_within(
        self,
        claim: Claim,
        limit: std::time::Duration,
    ) -> Result<Ready<R>, ClaimRefused> {
        let handle = self.handle.clone();
        let address = self.address.clone();
        let engine = claim.engine.clone();
        let started = tokio::time::Instant::now();
        match tokio::time::timeout(limit, self.ready_to_load(claim)).await {
            Ok(judged) => judged,
            Err(_elapsed) => {
                // The claim's future is dropped: the handshake has ended.
                let waited = started.elapsed();
                let snapshot = handle.snapshot().await?;
                Err(ClaimRefused::ReleaseHeld(Box::new(ReleaseHeld {
                    holder: snapshot.engine(&engine).cloned(),
                    engine,
                    address,
                    waited,
                })))
            }
        }
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

/// What [`Handshake::ready_to_load`] decided.
#[must_use = "a granted claim holds its agent names until it registers or is dropped"]
pub enum Ready<R: Send + 'static> {
    /// Load the claimed engine, then register it.
    Load(ReadyToLoad<R>),
    /// This engine incarnation is registered at this address already:
    /// nothing to load.
    Current(EngineRef),
}

/// A handshake whose claim was granted: load its metadata, prep its
/// dlists, then [`ReadyToLoad::register`]. Its agent names are its alone
/// until then. Dropping it ends the handshake with nothing registered
/// (give back what was loaded first).
#[must_use = "dropping it ends the handshake without registering"]
pub struct ReadyToLoad<R: Send + 'static> {
    handshake: Handshake<R>,
    claim: Claim,
}

impl<R: Send + 'static> ReadyToLoad<R> {
    /// The claim that was granted.
    pub fn claim(&self) -> &Claim {
        &self.claim
    }

    /// The engine id that may be loaded.
    pub fn engine(&self) -> &EngineId {
        &self.claim.engine
    }

    /// The handshake's address.
    pub fn address(&self) -> &PeerAddr {
        &self.handshake.address
    }

    /// Claims one more agent name for this handshake: NIXL's load named
    /// another agent than the prefill's reply did (a misconfigured or
    /// hostile prefill), and the runtime wants to unload it. `Ok` means
    /// the name is this handshake's, so invalidating it harms nobody;
    /// [`ClaimRefused::Conflict`] means it belongs to another engine: do
    /// not invalidate it (NIXL kept one entry for both loads).
    pub async fn claim_agent(&self, agent: AgentName) -> Result<(), ClaimRefused> {
        let ticket = self
            .handshake
            .ticket
            .expect("a granted handshake has its ticket");
        match self
            .handshake
            .handle
            .ask(|request| Input::ClaimAgent {
                ticket,
                request,
                agent,
            })
            .await
        {
            Some(Answer::AgentClaimed(Ok(()))) => Ok(()),
            Some(Answer::AgentClaimed(Err(conflict))) => Err(ClaimRefused::Conflict(conflict)),
            _ => Err(ClaimRefused::Stopped(ServiceStopped)),
        }
    }

    /// Registers the engine loaded under this handshake, with what the
    /// transport must free at its release, and ends the handshake. Never
    /// refused for who it is (that was decided at the claim); a service
    /// that is stopping takes it and releases it with the rest.
    ///
    /// Ordering: when the future resolves, the engine is in the engine index
    /// ([`KeepaliveHandle::engine`]) and its [`crate::Event::Registered`]
    /// has been published: a subscriber that drains its events right after
    /// finds it.
    ///
    /// Cancel safety: the registration is with the service when this
    /// returns, before the future is first polled: dropping the future
    /// loses nothing (find the engine with [`KeepaliveHandle::engine`]).
    /// Only a service that has already stopped hands it back
    /// ([`RegisterError::Stopped`]; with the future dropped unpolled, through
    /// [`KeepaliveHandle::take_handed_back`]).
    pub fn register(
        mut self,
        resources: R,
    ) -> impl std::future::Future<Output = Result<EngineRef, RegisterError<R>>> + Send + 'static
    {
        let ticket = self.handshake.ticket.take();
        let registration = Registration::new(
            self.claim.clone(),
            self.handshake.address.clone(),
            resources,
        );
        self.handshake
            .handle
            .send_registration(ticket, registration)
    }
}

//! One engine's start-up on the decode side: the side-channel reply, then
//! the library's handshake protocol in one straight line
//! ([`super::Decoder::connect`]: `handshake`, `ready_to_load`, the load,
//! `register`), and what a reader keeps of the result ([`Connected`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use nixl_keepalive::transport::nixl::RemoteDlists;
use nixl_keepalive::{
    AgentName, Claim, ClaimRefused, EngineId, EngineRef, EngineState, Incarnation, PeerAddr, Ready,
    ReadyToLoad,
};

use super::handshake::{fetch, HandshakeError};
use super::remote::RemoteEngine;
use super::Decoder;
use crate::pd::wire::HandshakeReply;

/// The claim a handshake reply makes: who the prefill says it is, before
/// anything of it is loaded.
pub fn claim_of(reply: &HandshakeReply) -> Claim {
    Claim {
        engine: EngineId::new(reply.engine.as_str()),
        incarnation: Some(Incarnation(reply.incarnation)),
        agents: reply
            .ranks
            .iter()
            .map(|r| AgentName::new(r.agent.as_str()))
            .collect(),
    }
}

/// What a handshake found.
pub enum Found {
    /// A new engine (or a new incarnation of one) was loaded and registered.
    New(Connected),
    /// The engine and incarnation already connected are still there.
    Unchanged,
}

/// A registered engine and what reads from it need.
#[derive(Clone)]
pub struct Connected {
    /// The service's reference (reads are guarded through it).
    pub engine: EngineRef,
    /// The loaded engine.
    pub remote: Arc<RemoteEngine>,
}

impl Decoder {
    /// One handshake with `address`, through the library's protocol.
    /// `current` is what this caller has connected there: the same engine
    /// id and incarnation, still live, is [`Found::Unchanged`]. Any
    /// other registration of the engine id found is released first
    /// (`ready_to_load`), whatever its state: NIXL must not load metadata
    /// over loaded metadata.
    ///
    /// A handshake that fails is counted in
    /// `nixl_keepalive_pd_handshake_failures_total{reason}`.
    ///
    /// Cancel safety: a cancelled handshake may leave metadata loaded and
    /// unregistered; run it to the end.
    pub async fn connect(
        &self,
        address: &PeerAddr,
        current: Option<&Connected>,
    ) -> Result<Found, HandshakeError> {
        self.connect_by(address, current).await.0
    }

    /// [`Decoder::connect`], and who answered: the engine id and
    /// incarnation of the reply, `None` when no reply was read. A failure
    /// is earned by that claimant ([`crate::pd::retry::Retry::failed_by`]).
    pub async fn connect_by(
        &self,
        address: &PeerAddr,
        current: Option<&Connected>,
    ) -> (Result<Found, HandshakeError>, crate::pd::retry::Claimant) {
        let mut claimant = None;
        let result = self.handshake(address, current, &mut claimant).await;
        if let Err(e) = &result {
            metrics::counter!("nixl_keepalive_pd_handshake_failures_total", "reason" => e.reason())
                .increment(1);
        }
        (result, claimant)
    }

    /// One engine's start-up, in order (see `connect`): the library's
    /// ticket first (`handshake`: a release racing this one is ordered
    /// before or after it), the side-channel reply, the claim
    /// (`ready_to_load`: NIXL must not load metadata over loaded
    /// metadata), the load, `register`. Each step that fails ends it
    /// with nothing of it left loaded.
    async fn handshake(
        &self,
        address: &PeerAddr,
        current: Option<&Connected>,
        claimant: &mut crate::pd::retry::Claimant,
    ) -> Result<Found, HandshakeError> {
        let handshake = self.handle.handshake(address.clone());
        let reply = fetch(address, self.options.handshake_timeout).await?;
        *claimant = Some((reply.engine.clone(), reply.incarnation));
        let ready = match handshake.ready_to_load(claim_of(&reply)).await {
            Ok(Ready::Load(ready)) => ready,
            Ok(Ready::Current(engine)) => return self.registered_already(&engine, current),
            Err(refused) => return Err(claim_refused(refused)),
        };
        let remote = match self.load(address, reply).await {
            Ok(remote) => remote,
            Err(e) => {
                if let HandshakeError::AgentMismatch { got, .. } = &e {
                    self.unload_stray(&ready, address, got).await;
                }
                return Err(e);
            }
        };
        let engine = match ready.register(remote.dlists.clone()).await {
            Ok(engine) => engine,
            Err(refused) => {
                let text = refused.to_string();
                // Loaded but not registered: give it back here.
                let transport = self.transport.clone();
                let _ = tokio::task::spawn_blocking(move || refused.give_back(&*transport)).await;
                return Err(HandshakeError::Refused(text));
            }
        };
        self.stats.handshakes.fetch_add(1, Ordering::Relaxed);
        tracing::info!(engine = %remote.engine, %address, ranks = remote.agents.len(), "engine loaded and registered");
        let connected = Connected {
            engine,
            remote: Arc::new(remote),
        };
        self.remember(&connected);
        Ok(Found::New(connected))
    }

    /// This process has `engine` registered already: nothing to load. It
    /// is `current`'s registration ([`Found::Unchanged`]), another
    /// reader's of this decoder (that reader's [`Connected`]), or another
    /// runtime's of this agent (refused).
    fn registered_already(
        &self,
        engine: &EngineRef,
        current: Option<&Connected>,
    ) -> Result<Found, HandshakeError> {
        if current.is_some_and(|c| c.engine.same_registration(engine)) {
            return Ok(Found::Unchanged);
        }
        match self.loaded(engine) {
            Some(connected) => Ok(Found::New(connected)),
            None => Err(HandshakeError::Invalid(format!(
                "engine {} is registered by another runtime of this agent",
                engine.id()
            ))),
        }
    }

    /// Loads `reply` into the decode agent on a blocking thread (NIXL's
    /// loads block): the step between the library's `ready_to_load` and
    /// `register`, with the options' slots, memory and check.
    async fn load(
        &self,
        address: &PeerAddr,
        reply: HandshakeReply,
    ) -> Result<RemoteEngine, HandshakeError> {
        let agent = self.transport.agent().clone();
        let addr = address.clone();
        let slots = self.options.reads_in_flight.max(1);
        let memory = self.options.memory;
        let check = self.options.check;
        tokio::task::spawn_blocking(move || {
            RemoteEngine::load_in(&agent, addr, &reply, slots, memory).map(|r| {
                if check {
                    r
                } else {
                    r.unchecked()
                }
            })
        })
        .await
        .expect("load does not panic")
    }

    /// NIXL loaded an agent name `got` the reply did not claim: unloads it
    /// only if it is nobody else's (granted to this handshake now), else
    /// leaves it for its owner and says so.
    async fn unload_stray(&self, ready: &ReadyToLoad<RemoteDlists>, address: &PeerAddr, got: &str) {
        let stray = AgentName::new(got);
        match ready.claim_agent(stray.clone()).await {
            Ok(()) => {
                let agent = self.transport.agent().clone();
                let _ = tokio::task::spawn_blocking(move || {
                    agent.invalidate_remote_metadata(stray.as_str())
                })
                .await;
            }
            Err(e) => {
                tracing::warn!(%address, agent = %stray, error = %e, "the reply's metadata named another engine's agent: left loaded for its owner");
            }
        }
    }

    /// Keeps what reads from a registration need, for any reader that
    /// finds the engine registered already (two readers of one prefill).
    fn remember(&self, connected: &Connected) {
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        loaded.retain(|c| c.engine.state() != EngineState::Released);
        loaded.push(connected.clone());
    }

    /// What this decoder loaded for `engine`'s registration, if anything.
    fn loaded(&self, engine: &EngineRef) -> Option<Connected> {
        self.loaded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|c| c.engine.same_registration(engine))
            .cloned()
    }
}

/// Why the library refused a claim, as a handshake error. Nothing was
/// loaded: a refusal this build does not know is refused as invalid.
fn claim_refused(refused: ClaimRefused) -> HandshakeError {
    match refused {
        ClaimRefused::Conflict(conflict) => HandshakeError::Conflict(conflict),
        ClaimRefused::Invalid { reason, .. } => HandshakeError::Invalid(reason),
        ClaimRefused::Stopped(stopped) => HandshakeError::Stopped(stopped),
        other => HandshakeError::Invalid(other.to_string()),
    }
}

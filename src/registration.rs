//! What the runtime hands the service: a registration after a handshake,
//! and the router's "peer gone". Leaf types, named by the core and the
//! handle alike.

use crate::transport::{AgentName, EngineId, PeerAddr};

/// What the decoder runtime hands over after a successful handshake.
#[derive(Debug)]
pub struct Registration<R> {
    /// The engine id the prefill reported (and the runtime checked).
    pub engine: EngineId,
    /// Its side-channel address.
    pub address: PeerAddr,
    /// Its NIXL agent names, one per remote rank. Heartbeats go to each;
    /// each one's remote metadata is invalidated at release. Unique: no
    /// two ranks, and no two engines, share one.
    pub agents: Vec<AgentName>,
    /// What the transport must free at release (prepped dlist handles...).
    pub resources: R,
}

/// Which peer a "peer gone" message means.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PeerRef {
    /// By engine id.
    Engine(EngineId),
    /// By side-channel address: the engine registered there now.
    Address(PeerAddr),
}

/// What to do with reads in flight from a peer that is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GoneMode {
    /// Let reads in flight finish, then release.
    Drain,
    /// Report reads in flight failed at once; release as soon as their
    /// guards drop.
    Fail,
}

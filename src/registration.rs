//! What the runtime hands the service: who a peer (a prefill, or in push
//! mode a decode) says it is (a
//! [`Claim`], before anything is loaded), the registration after its
//! metadata is loaded, and the router's or the membership plane's "peer
//! gone". Leaf types, named by the core and the handle alike.

use std::fmt;

use crate::names::{AgentName, EngineId, PeerAddr};

/// One registration: a unique number per registration in this process,
/// never reused. The unit of an engine's lifecycle: a pinned engine id that
/// is loaded again is another registration, so events, references and
/// reports name the registration they are about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegistrationId(pub(crate) u64);

impl RegistrationId {
    /// The number.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for RegistrationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// One start of a prefill process: a random number it draws at start-up
/// and reports in its handshake (and in its membership record). The same
/// engine id with another incarnation is the same engine restarted (a
/// pinned id); the same incarnation is the same process, whatever address
/// it was reached at.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Incarnation(pub u64);

impl fmt::Debug for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#018x}", self.0)
    }
}

impl fmt::Display for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#018x}", self.0)
    }
}

/// Who the prefill at a handshake's address says it is, before anything
/// of it is loaded: the identity the service arbitrates
/// ([`crate::Handshake::ready_to_load`]). Every agent name is claimed here,
/// before NIXL loads it, so that no two registrations or loads ever share
/// one (NIXL keeps one metadata entry per agent name: one release would
/// invalidate the other's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    /// The engine id its handshake reported.
    pub engine: EngineId,
    /// Its incarnation, when the side channel reports one. Without it, the
    /// same engine id answering again at its address is taken as a
    /// restart and loaded again.
    pub incarnation: Option<Incarnation>,
    /// Its NIXL agent names, one per rank, in rank order.
    pub agents: Vec<AgentName>,
}

/// A registered engine: a granted [`Claim`] at an address, with what the
/// transport must free at release. Comes back whole in every refusal and
/// in [`crate::Stopped::unreleased`], so its resources can be given back.
#[derive(Debug)]
pub struct Registration<R> {
    /// The engine id the prefill reported.
    pub engine: EngineId,
    /// Its incarnation, if known.
    pub incarnation: Option<Incarnation>,
    /// Its side-channel address: the address of the handshake that loaded
    /// it.
    pub address: PeerAddr,
    /// Its NIXL agent names, one per remote rank. Heartbeats go to each;
    /// each one's remote metadata is invalidated at release. Unique: no
    /// two ranks, and no two engines, share one.
    pub agents: Vec<AgentName>,
    /// What the transport must free at release (prepped dlist handles...).
    pub resources: R,
}

impl<R> Registration<R> {
    /// A registration of `claim` at `address` with `resources`.
    pub fn new(claim: Claim, address: PeerAddr, resources: R) -> Self {
        Registration {
            engine: claim.engine,
            incarnation: claim.incarnation,
            address,
            agents: claim.agents,
            resources,
        }
    }

    /// Who it says it is.
    pub fn claim(&self) -> Claim {
        Claim {
            engine: self.engine.clone(),
            incarnation: self.incarnation,
            agents: self.agents.clone(),
        }
    }
}

/// Which peer a "peer gone" message means.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PeerRef {
    /// By engine id.
    Engine(EngineId),
    /// By side-channel address: the engine registered there now.
    Address(PeerAddr),
}

/// A membership record that went away (its key was deleted, its lease
/// expired, or a fresh list no longer has it): what the record said. The
/// service retires the engine only if this record is the one of its
/// registration (same engine id, address and, when both are known,
/// incarnation); a record that merely disagrees is a conflict, logged and
/// counted, never a release ([`crate::KeepaliveHandle::member_gone`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Departure {
    /// The engine id the record named.
    pub engine: EngineId,
    /// The incarnation the record named, if any.
    pub incarnation: Option<Incarnation>,
    /// The address the record named (as resolved when it was announced).
    pub address: PeerAddr,
}

/// What to do with reads in flight from a peer that is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GoneMode {
    /// Let reads in flight finish, then release.
    Drain,
    /// Report reads in flight failed at once; release as soon as their
    /// guards drop.
    Fail,
}

impl GoneMode {
    /// `drain` or `fail`: the word the router's requests and the logs use.
    pub fn as_str(self) -> &'static str {
        match self {
            GoneMode::Drain => "drain",
            GoneMode::Fail => "fail",
        }
    }
}

//! What the fake remembers: every call, and what is still held.

use std::borrow::Cow;

use tokio::time::Instant;

use crate::transport::{AgentName, EngineId};
use nixl_status::NixlStatus;
use nixl_status::UcsStatus;

/// A NIXL operation the fake performed on the decode side's agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FakeOp {
    /// `loadRemoteMD` for one remote agent (part of a handshake).
    LoadRemoteMd,
    /// `prepXferDlist` for one remote rank (part of a handshake).
    PrepXferDlist,
    /// `genNotif` to one remote agent ([`crate::Transport::notify`]).
    Notify,
    /// A READ transfer from one remote agent, posted and polled to its end
    /// ([`super::FakeUcx::read`]).
    Read,
    /// A push-mode WRITE into one remote agent, posted and polled to its
    /// end ([`super::FakeUcx::write`]).
    Write,
    /// `releasedDlistH` for one prepped handle ([`crate::Transport::release`]).
    ReleaseDlist,
    /// `invalidateRemoteMD` for one remote agent ([`crate::Transport::release`]).
    InvalidateRemoteMd,
    /// The connections to one remote agent cut right after its
    /// invalidation, as the NIXL transport does when the service says
    /// every transfer with the engine ended ([`crate::Transfers::Ended`]).
    ShutConnections,
}

/// One recorded call.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct FakeCall {
    /// The virtual time at which the call completed (for a blocked notify:
    /// when it was let go).
    pub at: Instant,
    /// What was called.
    pub op: FakeOp,
    /// The prefill engine the call addressed, when the fake knows it.
    pub engine: Option<EngineId>,
    /// The remote agent the call addressed, when it addressed one.
    pub agent: Option<AgentName>,
    /// The notification text for [`FakeOp::Notify`]; empty otherwise.
    pub message: Vec<u8>,
    /// The UCX status the simulated UCX operation completed with, or `None`
    /// when NIXL answered without reaching UCX (metadata not loaded,
    /// endpoint already failed, bookkeeping calls such as a release).
    pub ucs: Option<UcsStatus>,
    /// The NIXL status the call returned (for a notify, `IN_PROG` already
    /// reported as `SUCCESS`, as NIXL does).
    pub status: NixlStatus,
}

impl FakeCall {
    /// The message as text (lossy UTF-8), e.g. `HB:req-1,req-2`.
    pub fn message_str(&self) -> Cow<'_, str> {
        String::from_utf8_lossy(&self.message)
    }
}

/// NIXL state the decode side still holds for remote engines: loaded and
/// not invalidated, prepared and not released.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// Remote agents whose metadata is loaded (one per remote rank).
    pub remote_metadata: usize,
    /// Prepped descriptor-list handles not yet released.
    pub dlist_handles: usize,
}

impl Held {
    /// Nothing is held.
    pub fn is_empty(&self) -> bool {
        self.remote_metadata == 0 && self.dlist_handles == 0
    }
}

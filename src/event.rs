//! What the service tells the decoder runtime, so that it can fail
//! requests instead of letting them hang.

use std::time::Duration;

use crate::error::Conflict;
use crate::registration::RegistrationId;
use crate::transport::{EngineId, PeerAddr};
use crate::NixlStatus;

/// Where a status came from. One classifier judges every status
/// whatever its source; the source only says where it was seen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    /// A heartbeat notification (`genNotif`).
    Heartbeat,
    /// A transfer's result (`postXferReq` / `getXferStatus`), reported by
    /// the runtime through its read guard or engine reference.
    Transfer,
}

impl Source {
    /// A short lowercase name, used in logs and as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Heartbeat => "heartbeat",
            Source::Transfer => "transfer",
        }
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why an engine was released.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReleaseReason {
    /// A heartbeat or transfer returned REMOTE_DISCONNECT.
    Unreachable,
    /// A new engine id registered at its address.
    Replaced,
    /// The same engine id registered again (a pinned id came back).
    Reregistered,
    /// The router or orchestrator said the peer is gone.
    PeerGone,
    /// The service shut down.
    Shutdown,
    /// Its reads in flight stopped completing (a hung peer).
    Stalled,
    /// A transfer or notification to one of its own agents answered
    /// NOT_FOUND: NIXL no longer holds its metadata (invalidated or
    /// re-registered under it). Released and connected again, never kept
    /// as if healthy.
    MetadataLost,
}

impl ReleaseReason {
    /// A short lowercase name, used in logs and as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            ReleaseReason::Unreachable => "unreachable",
            ReleaseReason::Replaced => "replaced",
            ReleaseReason::Reregistered => "reregistered",
            ReleaseReason::PeerGone => "peer_gone",
            ReleaseReason::Shutdown => "shutdown",
            ReleaseReason::Stalled => "stalled",
            ReleaseReason::MetadataLost => "metadata_lost",
        }
    }
}

/// What a release waited for between the engine being marked and its NIXL
/// state being handed to the transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct WaitedFor {
    /// From the mark to the start of the release.
    pub duration: Duration,
    /// Reads that were in flight when the engine was marked.
    pub reads_in_flight_at_mark: u64,
    /// Whether a handshake at the engine's address held the release back.
    pub handshake: bool,
}

/// One thing that happened to a peer. Subscribe with
/// [`crate::KeepaliveHandle::subscribe`]. Every event about an engine names
/// the registration it is about: the unit of an engine's lifecycle (see
/// [`crate::EngineRef::registration`], [`crate::EngineRef::released`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// An engine registered after its handshake.
    Registered {
        /// The engine.
        engine: EngineId,
        /// The registration this is about (a pinned engine id loaded
        /// again is another registration).
        registration: RegistrationId,
        /// Its side-channel address.
        address: PeerAddr,
    },
    /// A heartbeat or transfer returned REMOTE_DISCONNECT.
    Unreachable {
        /// The engine.
        engine: EngineId,
        /// The registration this is about (a pinned engine id loaded
        /// again is another registration).
        registration: RegistrationId,
        /// The raw status that said so.
        status: NixlStatus,
        /// Where it was seen.
        source: Source,
    },
    /// A new engine id registered at a known address (or the same id again:
    /// then `old == new`).
    Replaced {
        /// The engine that was at the address.
        old: EngineId,
        /// Its registration, which is released once idle.
        old_registration: RegistrationId,
        /// The engine there now.
        new: EngineId,
        /// The address.
        address: PeerAddr,
    },
    /// The router or orchestrator said the engine is gone.
    Retiring {
        /// The engine.
        engine: EngineId,
        /// The registration this is about (a pinned engine id loaded
        /// again is another registration).
        registration: RegistrationId,
        /// Whether its reads were failed at once.
        fail_reads: bool,
    },
    /// An engine's reads stopped completing while the decoder's other
    /// reads went on: for the read-stall bound, or a read the runtime gave
    /// up as timed out got no answer. The peer is alive to UCX but hung
    /// (frozen, deadlocked, NIC gone). With the `fail` action its reads are
    /// failed and it is released once they end; with `report` it is only
    /// reported (once per stall).
    Stalled {
        /// The engine.
        engine: EngineId,
        /// The registration this is about (a pinned engine id loaded
        /// again is another registration).
        registration: RegistrationId,
        /// Reads in flight when it was found stalled.
        reads_in_flight: u64,
        /// How long at least it has had a read outstanding and no read
        /// completed (from when the service first saw it: the stall began
        /// at most one check period earlier).
        stalled_for: Duration,
        /// Reads the runtime gave up as timed out, unanswered, since the
        /// engine's last completion (the runtime's verdict; 0 when the
        /// read-stall bound decided).
        given_up: u64,
        /// Whether its reads were failed (action `fail`).
        failed: bool,
    },
    /// Reads in flight from an engine were failed (unreachable, or gone in
    /// `fail` mode); their guards report `is_failed()`.
    ReadsFailed {
        /// The engine.
        engine: EngineId,
        /// The registration this is about (a pinned engine id loaded
        /// again is another registration).
        registration: RegistrationId,
        /// How many reads were in flight.
        count: u64,
    },
    /// An error that is not a disconnect: counted, logged, never a release.
    TransientError {
        /// The engine.
        engine: EngineId,
        /// The registration this is about (a pinned engine id loaded
        /// again is another registration).
        registration: RegistrationId,
        /// The raw status.
        status: NixlStatus,
        /// Where it was seen.
        source: Source,
    },
    /// The engine's NIXL state was given back.
    Released {
        /// The engine.
        engine: EngineId,
        /// The registration this is about (a pinned engine id loaded
        /// again is another registration).
        registration: RegistrationId,
        /// Why.
        reason: ReleaseReason,
        /// What the release waited for.
        waited_for: WaitedFor,
        /// Release steps that failed with something other than NOT_FOUND.
        failed_steps: usize,
        /// The transport panicked while releasing: what it had done is
        /// unknown, and nothing is retried (its resources were consumed).
        panicked: bool,
        /// UCX endpoints the release could not close (NIXL's own close
        /// mode keeps a live peer's endpoint, and its socket, until the
        /// agent is destroyed; see the README, "Releases leave nothing
        /// behind"). 0 when every endpoint was closed or none was observed.
        endpoints_left_open: u32,
    },
    /// Two sources claimed one identity (see [`Conflict`]): the newcomer
    /// was refused, the registered engine kept. Published once per
    /// conflict (both sides the same); repeats are only counted.
    Conflict {
        /// What collided.
        conflict: Conflict,
    },
    /// A transport call panicked. Not a disconnect: the engine is kept
    /// (a heartbeat) or counted as released (a release, see
    /// [`Event::Released::panicked`]).
    TransportPanicked {
        /// The engine the call was for.
        engine: EngineId,
        /// Its registration.
        registration: RegistrationId,
        /// The call: `genNotif` or `release`.
        call: &'static str,
        /// The panic's message, when it was text.
        message: String,
    },
}

impl Event {
    /// The registration the event is about: for [`Event::Replaced`] the
    /// old one (the registration that goes); `None` for a
    /// [`Event::Conflict`], which is refused before any registration
    /// exists. Lets a caller follow one registration's lifecycle without
    /// matching every variant.
    pub fn registration(&self) -> Option<RegistrationId> {
        match self {
            Event::Registered { registration, .. }
            | Event::Unreachable { registration, .. }
            | Event::Retiring { registration, .. }
            | Event::Stalled { registration, .. }
            | Event::ReadsFailed { registration, .. }
            | Event::TransientError { registration, .. }
            | Event::Released { registration, .. }
            | Event::TransportPanicked { registration, .. } => Some(*registration),
            Event::Replaced {
                old_registration, ..
            } => Some(*old_registration),
            Event::Conflict { .. } => None,
        }
    }
}

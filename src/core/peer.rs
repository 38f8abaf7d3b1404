//! One registration as the core keeps it.

use std::collections::BTreeSet;
use std::sync::Arc;

use tokio::time::Instant;

use super::cell::EngineCell;
use super::TicketId;
use crate::event::ReleaseReason;
use crate::registration::Incarnation;
use crate::transport::{AgentName, EngineId, PeerAddr};
use crate::NixlStatus;

/// Why a registration was marked, and what its release has waited for.
pub(super) struct Mark {
    pub(super) reason: ReleaseReason,
    pub(super) at: Instant,
    pub(super) reads_at_mark: u64,
    pub(super) held_by_handshake: bool,
}

/// A registration: live, or marked and waiting for its release.
pub(super) struct Peer<R> {
    pub(super) cell: Arc<EngineCell>,
    pub(super) address: PeerAddr,
    pub(super) incarnation: Option<Incarnation>,
    /// The newest handshake started when it was activated: a handshake no
    /// newer than this began before the registration existed.
    pub(super) registered_after: TicketId,
    /// Shared with every heartbeat round in flight: no copy per round.
    pub(super) agents: Arc<[AgentName]>,
    /// `None` once handed to the transport.
    pub(super) resources: Option<R>,
    pub(super) mark: Option<Mark>,
    pub(super) leases: BTreeSet<String>,
    /// The heartbeat message for `leases`, built at the first round after
    /// they change (`None` until then).
    pub(super) message: Option<Arc<[u8]>>,
    /// The schedule slot of the next heartbeat, if one is scheduled: the
    /// token that finds it in the [`super::schedule::Schedule`].
    pub(super) next_heartbeat: Option<Instant>,
    pub(super) heartbeat_in_flight: bool,
    /// A lease renewal was asked for and has not gone out yet.
    pub(super) renewal_wanted: bool,
    pub(super) last_heartbeat: Option<(Instant, NixlStatus)>,
    pub(super) transient_errors: u64,
    pub(super) progress: Progress,
}

/// What the stall check last saw of a registration's reads.
pub(super) struct Progress {
    /// The wrapping count of reads completed, as last seen.
    pub(super) done_seen: u64,
    /// Since when no read has completed while reads were in flight: the
    /// last check that saw a completion, or no read in flight.
    pub(super) since: Instant,
    /// The last check that saw a read complete.
    pub(super) last_completion: Option<Instant>,
    /// The current stall has been reported.
    pub(super) reported: bool,
}

impl<R> Peer<R> {
    pub(super) fn new(
        now: Instant,
        cell: Arc<EngineCell>,
        address: PeerAddr,
        incarnation: Option<Incarnation>,
        registered_after: TicketId,
        agents: Vec<AgentName>,
        resources: R,
    ) -> Self {
        let (_, done_seen) = cell.progress();
        Peer {
            progress: Progress {
                done_seen,
                since: now,
                last_completion: None,
                reported: false,
            },
            cell,
            address,
            incarnation,
            registered_after,
            agents: agents.into(),
            resources: Some(resources),
            mark: None,
            leases: BTreeSet::new(),
            message: None,
            next_heartbeat: None,
            heartbeat_in_flight: false,
            renewal_wanted: false,
            last_heartbeat: None,
            transient_errors: 0,
        }
    }

    pub(super) fn id(&self) -> &EngineId {
        self.cell.id()
    }

    pub(super) fn is_live(&self) -> bool {
        self.mark.is_none()
    }

    /// Handed to the transport (or being).
    pub(super) fn is_releasing(&self) -> bool {
        self.resources.is_none()
    }
}

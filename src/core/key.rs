//! Where a registration's record is in the core's peer table.

use crate::registration::RegistrationId;

/// Where a registration's record is: its id, and the slot that holds it.
/// The heartbeat schedule and the rounds in flight carry it, so a round
/// reaches its record without the index (a second cache miss per
/// heartbeat at 10k engines). A slot freed and reused holds another id:
/// `PeerTable::at_mut` (`core/peer.rs`) checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PeerKey {
    pub(crate) serial: RegistrationId,
    pub(super) slot: usize,
}

impl PeerKey {
    /// A key that names no record (tests of the offload queue).
    #[cfg(test)]
    pub(crate) fn detached(serial: RegistrationId) -> Self {
        PeerKey {
            serial,
            slot: usize::MAX,
        }
    }
}

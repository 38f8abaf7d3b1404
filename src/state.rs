//! Where an engine is in its life. A leaf: the core, the handles, the
//! errors and the snapshot all name it.

use std::fmt;

/// Where an engine is in its life, as the service sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum EngineState {
    /// Registered and answering: reads may start.
    Live,
    /// A heartbeat or transfer returned REMOTE_DISCONNECT: UCX has failed
    /// the endpoint. Released once idle.
    Unreachable,
    /// Another engine registered at its address, or its engine id is being
    /// loaded again. Released once idle.
    Replaced,
    /// The router or orchestrator said it is gone, or the service is
    /// stopping. Released once idle.
    Retiring,
    /// Its reads in flight stopped completing for longer than the
    /// read-stall bound while the decoder's other reads went on (a hung
    /// peer: frozen, deadlocked, lost its NIC): its reads are failed, and
    /// it is released once their guards drop.
    Stalled,
    /// Its NIXL state has been given back (or is being given back).
    Released,
}

impl EngineState {
    const ALL: [EngineState; 6] = [
        EngineState::Live,
        EngineState::Unreachable,
        EngineState::Replaced,
        EngineState::Retiring,
        EngineState::Stalled,
        EngineState::Released,
    ];

    /// A short lowercase name, used in logs and as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            EngineState::Live => "live",
            EngineState::Unreachable => "unreachable",
            EngineState::Replaced => "replaced",
            EngineState::Retiring => "retiring",
            EngineState::Stalled => "stalled",
            EngineState::Released => "released",
        }
    }

    /// Every state, in order.
    pub fn all() -> [EngineState; 6] {
        Self::ALL
    }

    /// The state with this index (`state as usize`), if any.
    pub(crate) fn from_index(index: usize) -> Option<EngineState> {
        Self::ALL.get(index).copied()
    }
}

impl fmt::Display for EngineState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

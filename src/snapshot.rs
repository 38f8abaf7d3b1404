//! The table as the operator sees it: per engine, its state and, above
//! all, why it has or has not been released.

use std::fmt;
use std::time::Duration;

use crate::registration::Incarnation;
use crate::state::EngineState;
use crate::transport::{AgentName, EngineId, PeerAddr};
use crate::NixlStatus;

/// The last heartbeat round of an engine.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HeartbeatSnapshot {
    /// How long ago it came back.
    pub ago: Duration,
    /// Its status: the disconnect or first error among the agents, else
    /// SUCCESS.
    pub status: NixlStatus,
}

/// A given-up transfer still running (see `GivenUpRead`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct GivenUpSnapshot {
    /// Since its read was given up.
    pub held_for: Duration,
    /// The destination blocks it holds, in the runtime's unit (0: not
    /// said).
    pub blocks: u64,
}

/// One engine of the table.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EngineSnapshot {
    /// Engine id.
    pub engine: EngineId,
    /// Side-channel address.
    pub address: PeerAddr,
    /// The process's incarnation, when its handshake reported one.
    pub incarnation: Option<Incarnation>,
    /// Agent names.
    pub agents: Vec<AgentName>,
    /// State.
    pub state: EngineState,
    /// Reads in flight (given-up transfers still running included).
    pub reads_in_flight: u64,
    /// Given-up transfers still running, oldest first: their requests were
    /// failed, their destinations are held, and the engine is not released
    /// until each ends.
    pub given_up: Vec<GivenUpSnapshot>,
    /// Lease request ids renewed with each heartbeat.
    pub leases: Vec<String>,
    /// The last heartbeat round, if any came back.
    pub last_heartbeat: Option<HeartbeatSnapshot>,
    /// When the next heartbeat is due, if one is scheduled.
    pub next_heartbeat_in: Option<Duration>,
    /// Errors that were not disconnects (counted, never a release).
    pub transient_errors: u64,
    /// In words: why the engine is kept, or what its release waits for.
    pub why: String,
}

/// The whole table.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Snapshot {
    /// Engines, by id.
    pub engines: Vec<EngineSnapshot>,
    /// Handshakes in progress, by address.
    pub handshakes_pending: Vec<(PeerAddr, usize)>,
    /// Engine ids whose new registration waits for the old one's release.
    pub waiting_for_reload: Vec<EngineId>,
    /// What the UCX settings in force say about frozen or silent peers.
    pub silent_peer_note: String,
    /// Rate-limiter keys held: one per engine that has had a round and
    /// has not been released.
    pub limiter_keys: usize,
    /// Heartbeat timers armed: one per live engine with a schedule.
    pub heartbeat_timers: usize,
    /// The worst-case time to release a dead peer with the settings in
    /// force, when the service was given them.
    pub detection_bound: Option<DetectionSummary>,
    /// The transport calls' thread pool: threads, calls waiting, calls in
    /// flight and which of them are hung.
    pub transport: TransportSnapshot,
}

/// The pool the service runs transport calls on (at most 2048 threads,
/// one per hung call).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct TransportSnapshot {
    /// Threads started and not exited (busy or idle).
    pub threads: usize,
    /// Threads waiting for a call.
    pub idle: usize,
    /// The most threads the pool runs.
    pub cap: usize,
    /// Calls waiting for a thread.
    pub queued: usize,
    /// Calls ever counted hung (each once, after 1 s in flight).
    pub hung_total: u64,
    /// Calls in flight, the longest first.
    pub in_flight: Vec<CallInFlight>,
}

impl TransportSnapshot {
    /// The calls in flight that are hung.
    pub fn hung(&self) -> impl Iterator<Item = &CallInFlight> {
        self.in_flight.iter().filter(|c| c.hung)
    }
}

/// A transport call in flight.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CallInFlight {
    /// The engine it is for.
    pub engine: EngineId,
    /// `genNotif` (a heartbeat round) or `release`.
    pub call: &'static str,
    /// How long it has been inside the transport (wall clock).
    pub age: Duration,
    /// In flight for 1 s or more: hung.
    pub hung: bool,
}

/// The detection bounds, as numbers: one per kind of dead peer (see
/// [`crate::ucx::settings`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DetectionSummary {
    /// A crashed peer (process gone): the first operation after the crash,
    /// at most one heartbeat gap when idle; `None` when heartbeats are off.
    pub crashed: Option<Duration>,
    /// A silent peer (partition): UCX keepalive plus the timeout of the
    /// slowest transport in use; `None` when unbounded.
    pub silent: Option<Duration>,
    /// A frozen peer with reads in flight: 1.25 read-stall bounds plus
    /// slack; `None` with the read-stall check off. A frozen idle peer has
    /// no bound in the service.
    pub frozen: Option<Duration>,
}

impl fmt::Display for DetectionSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text =
            |d: Option<Duration>| d.map_or("never".to_string(), crate::ucx::settings::secs_text);
        write!(
            f,
            "crashed {}, silent {}, frozen with reads in flight {}",
            text(self.crashed),
            text(self.silent),
            text(self.frozen)
        )
    }
}

impl Snapshot {
    /// The engine `id`, if the table holds it.
    pub fn engine(&self, id: &EngineId) -> Option<&EngineSnapshot> {
        self.engines.iter().find(|e| &e.engine == id)
    }
}

impl fmt::Display for Snapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(bound) = &self.detection_bound {
            writeln!(f, "detection bounds: {bound}")?;
        }
        writeln!(
            f,
            "{:<24} {:<22} {:<12} {:>5}  why",
            "engine", "address", "state", "reads"
        )?;
        for e in &self.engines {
            writeln!(
                f,
                "{:<24} {:<22} {:<12} {:>5}  {}",
                e.engine.as_str(),
                e.address.as_str(),
                e.state.as_str(),
                e.reads_in_flight,
                e.why
            )?;
        }
        Ok(())
    }
}

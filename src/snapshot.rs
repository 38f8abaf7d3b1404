//! The table as the operator sees it: per engine, its state and, above
//! all, why it has or has not been released.

use std::fmt;
use std::time::Duration;

use crate::names::{AgentName, EngineId, PeerAddr};
use crate::registration::Incarnation;
use crate::state::EngineState;
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

/// The shapes of the table's JSON, borrowed from the snapshot.
#[cfg(feature = "serde")]
mod json {
    use std::time::Duration;

    use super::EngineSnapshot;

    pub(super) fn ms(d: Duration) -> u64 {
        u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
    }

    #[derive(serde::Serialize)]
    pub(super) struct Engine<'a> {
        pub(super) engine: &'a str,
        pub(super) address: &'a str,
        /// The process start the registration is of (a restart at the same
        /// address is a new one), as its handshake sent it; `null` when it
        /// carried none.
        pub(super) incarnation: Option<String>,
        pub(super) agents: Vec<&'a str>,
        pub(super) state: &'static str,
        pub(super) reads_in_flight: u64,
        pub(super) given_up: Vec<GivenUp>,
        pub(super) leases: &'a [String],
        pub(super) last_heartbeat: Option<Heartbeat>,
        pub(super) next_heartbeat_in_ms: Option<u64>,
        pub(super) transient_errors: u64,
        pub(super) why: &'a str,
    }

    #[derive(serde::Serialize)]
    pub(super) struct GivenUp {
        pub(super) held_for_ms: u64,
        pub(super) blocks: u64,
    }

    #[derive(serde::Serialize)]
    pub(super) struct Heartbeat {
        pub(super) ago_ms: u64,
        pub(super) status: i32,
        pub(super) status_name: &'static str,
    }

    #[derive(serde::Serialize)]
    pub(super) struct Table<'a> {
        pub(super) engines: &'a [EngineSnapshot],
        pub(super) handshakes_pending: Vec<Pending<'a>>,
        pub(super) waiting_for_reload: Vec<&'a str>,
        pub(super) silent_peer_note: &'a str,
        pub(super) limiter_keys: usize,
        pub(super) heartbeat_timers: usize,
        pub(super) detection_bound_ms: Option<Bounds>,
        pub(super) transport: Transport<'a>,
    }

    #[derive(serde::Serialize)]
    pub(super) struct Pending<'a> {
        pub(super) address: &'a str,
        pub(super) count: usize,
    }

    #[derive(serde::Serialize)]
    pub(super) struct Bounds {
        pub(super) crashed: Option<u64>,
        pub(super) silent: Option<u64>,
        pub(super) frozen: Option<u64>,
    }

    #[derive(serde::Serialize)]
    pub(super) struct Transport<'a> {
        pub(super) threads: usize,
        pub(super) idle: usize,
        pub(super) cap: usize,
        pub(super) queued: usize,
        pub(super) hung_total: u64,
        pub(super) in_flight: Vec<Call<'a>>,
    }

    #[derive(serde::Serialize)]
    pub(super) struct Call<'a> {
        pub(super) engine: &'a str,
        pub(super) call: &'static str,
        pub(super) age_ms: u64,
        pub(super) hung: bool,
    }
}

/// The table's one JSON rendering: what `GET /v1/snapshot` answers and
/// what the Python package's `Keepalive.snapshot()` returns, key for key
/// (one rendering, so a router and an in-process caller never see two
/// shapes of one table). Times are whole milliseconds under `_ms` keys; a
/// status is its raw number with its name beside it (`"status": -10,
/// "status_name": "NIXL_ERR_REMOTE_DISCONNECT"`), as in the events' JSON;
/// an incarnation is a decimal string (JSON numbers lose precision above
/// 2^53).
#[cfg(feature = "serde")]
impl serde::Serialize for Snapshot {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let t = &self.transport;
        json::Table {
            engines: &self.engines,
            handshakes_pending: self
                .handshakes_pending
                .iter()
                .map(|(a, n)| json::Pending {
                    address: a.as_str(),
                    count: *n,
                })
                .collect(),
            waiting_for_reload: self.waiting_for_reload.iter().map(|e| e.as_str()).collect(),
            silent_peer_note: &self.silent_peer_note,
            limiter_keys: self.limiter_keys,
            heartbeat_timers: self.heartbeat_timers,
            detection_bound_ms: self.detection_bound.map(|d| json::Bounds {
                crashed: d.crashed.map(json::ms),
                silent: d.silent.map(json::ms),
                frozen: d.frozen.map(json::ms),
            }),
            transport: json::Transport {
                threads: t.threads,
                idle: t.idle,
                cap: t.cap,
                queued: t.queued,
                hung_total: t.hung_total,
                in_flight: t
                    .in_flight
                    .iter()
                    .map(|c| json::Call {
                        engine: c.engine.as_str(),
                        call: c.call,
                        age_ms: json::ms(c.age),
                        hung: c.hung,
                    })
                    .collect(),
            },
        }
        .serialize(serializer)
    }
}

/// One engine of the table's JSON rendering (`Snapshot`'s `Serialize`).
#[cfg(feature = "serde")]
impl serde::Serialize for EngineSnapshot {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        json::Engine {
            engine: self.engine.as_str(),
            address: self.address.as_str(),
            incarnation: self.incarnation.map(|i| i.0.to_string()),
            agents: self.agents.iter().map(|a| a.as_str()).collect(),
            state: self.state.as_str(),
            reads_in_flight: self.reads_in_flight,
            given_up: self
                .given_up
                .iter()
                .map(|g| json::GivenUp {
                    held_for_ms: json::ms(g.held_for),
                    blocks: g.blocks,
                })
                .collect(),
            leases: &self.leases,
            last_heartbeat: self.last_heartbeat.as_ref().map(|h| json::Heartbeat {
                ago_ms: json::ms(h.ago),
                status: h.status.raw(),
                status_name: h.status.name(),
            }),
            next_heartbeat_in_ms: self.next_heartbeat_in.map(json::ms),
            transient_errors: self.transient_errors,
            why: &self.why,
        }
        .serialize(serializer)
    }
}

#[cfg(all(test, feature = "serde", feature = "membership"))]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_json_is_milliseconds_raw_statuses_with_names_and_every_given_up_transfer() {
        let engine = EngineSnapshot {
            engine: EngineId::from("p-1"),
            address: PeerAddr::from("10.0.0.1:5600"),
            incarnation: Some(Incarnation(u64::MAX)),
            agents: vec![AgentName::from("p-1-rank0")],
            state: EngineState::Stalled,
            reads_in_flight: 2,
            given_up: vec![GivenUpSnapshot {
                held_for: Duration::from_micros(12_900),
                blocks: 3,
            }],
            leases: vec!["req-1".into()],
            last_heartbeat: Some(HeartbeatSnapshot {
                ago: Duration::from_millis(40),
                status: NixlStatus::ERR_REMOTE_DISCONNECT,
            }),
            next_heartbeat_in: None,
            transient_errors: 1,
            why: "stalled: ...".into(),
        };
        let snapshot = Snapshot {
            engines: vec![engine],
            handshakes_pending: vec![(PeerAddr::from("10.0.0.2:5600"), 1)],
            detection_bound: Some(DetectionSummary {
                crashed: Some(Duration::from_secs(2)),
                silent: None,
                frozen: Some(Duration::from_millis(12_500)),
            }),
            ..Snapshot::default()
        };
        let json = serde_json::to_value(&snapshot).unwrap();
        assert_eq!(
            json["engines"][0],
            serde_json::json!({
                "engine": "p-1",
                "address": "10.0.0.1:5600",
                "incarnation": "18446744073709551615",
                "agents": ["p-1-rank0"],
                "state": "stalled",
                "reads_in_flight": 2,
                "given_up": [{"held_for_ms": 12, "blocks": 3}],
                "leases": ["req-1"],
                "last_heartbeat": {"ago_ms": 40, "status": -10, "status_name": "NIXL_ERR_REMOTE_DISCONNECT"},
                "next_heartbeat_in_ms": null,
                "transient_errors": 1,
                "why": "stalled: ...",
            })
        );
        assert_eq!(
            json["handshakes_pending"],
            serde_json::json!([{"address": "10.0.0.2:5600", "count": 1}])
        );
        assert_eq!(
            json["detection_bound_ms"],
            serde_json::json!({"crashed": 2000, "silent": null, "frozen": 12500})
        );
        let keys: Vec<&str> = json
            .as_object()
            .unwrap()
            .keys()
            .map(|k| k.as_str())
            .collect();
        let mut expected = vec![
            "engines",
            "handshakes_pending",
            "waiting_for_reload",
            "silent_peer_note",
            "limiter_keys",
            "heartbeat_timers",
            "detection_bound_ms",
            "transport",
        ];
        expected.sort_unstable();
        assert_eq!(keys, expected);
    }
}

//! The table as the operator reads it: per registration, its state and,
//! above all, why it is kept or what its release waits for; and the counts
//! the gauges show.

use std::time::Instant;

use super::peer::Peer;
use super::Core;
use crate::snapshot::{EngineSnapshot, HeartbeatSnapshot, Snapshot};

impl<R> Core<R> {
    /// Counts of registrations by state and reads in flight, for the
    /// gauges. Walks every engine: called at the metrics period.
    pub(crate) fn census(&self) -> ([usize; 6], u64) {
        let mut by_state = [0usize; 6];
        let mut reads = 0;
        for peer in self.peers.values() {
            by_state[peer.cell.state() as usize] += 1;
            reads += peer.cell.reads_in_flight();
        }
        (by_state, reads)
    }

    /// The table as it is now.
    pub(crate) fn snapshot(&self, now: Instant) -> Snapshot {
        let mut engines: Vec<EngineSnapshot> = self
            .peers
            .values()
            .map(|p| self.engine_snapshot(now, p))
            .collect();
        engines.sort_by(|a, b| a.engine.cmp(&b.engine));
        Snapshot {
            engines,
            handshakes_pending: self.directory.handshakes_pending(),
            waiting_for_reload: self.directory.waiting_for_reload(),
            silent_peer_note: self.silent_peer_note.clone(),
            limiter_keys: self.peers.values().filter(|p| p.rate.is_some()).count(),
            heartbeat_timers: self.heartbeats.scheduled(),
            // Filled in by the driver, which holds them.
            detection_bound: None,
            transport: Default::default(),
        }
    }

    pub(super) fn engine_snapshot(&self, now: Instant, p: &Peer<R>) -> EngineSnapshot {
        let reads = p.cell.reads_in_flight();
        let last_heartbeat = p.last_heartbeat.map(|(at, status)| HeartbeatSnapshot {
            ago: now.saturating_duration_since(at),
            status,
        });
        let why = match &p.mark {
            None => {
                let last = match &last_heartbeat {
                    Some(h) => format!("last heartbeat {} {:?} ago", h.status.name(), h.ago),
                    None => "no heartbeat yet".to_string(),
                };
                let reads_note = self.stall_note(now, p, reads);
                format!(
                    "live: no REMOTE_DISCONNECT seen ({last}); {reads_note}; a silent peer is reported by UCX: {}",
                    self.silent_peer_note
                )
            }
            Some(_) if p.is_releasing() => {
                "releasing: the transport is giving back its NIXL state".into()
            }
            Some(m) => {
                let mut held = Vec::new();
                if reads > 0 {
                    held.push(format!("{reads} read(s) in flight"));
                }
                if let Some((n, oldest)) = self.given_up.oldest(now, p.cell.serial()) {
                    held.push(format!(
                        "{n} given-up transfer(s) to end (they complete if it resumes, fail if it dies; the oldest held {oldest:?})"
                    ));
                }
                if let Some(n) = self.directory.holding(&p.address, p.cell.serial()) {
                    held.push(format!("{n} handshake(s) pending at {}", p.address));
                }
                format!(
                    "{}: release waits for {}",
                    m.reason.as_str(),
                    if held.is_empty() {
                        "nothing (about to be released)".to_string()
                    } else {
                        held.join(" and ")
                    }
                )
            }
        };
        EngineSnapshot {
            engine: p.id().clone(),
            address: p.address.clone(),
            incarnation: p.incarnation,
            agents: p.agents.to_vec(),
            state: p.cell.state(),
            reads_in_flight: reads,
            given_up: self.given_up.of(now, p.cell.serial()),
            leases: p.leases.iter().cloned().collect(),
            last_heartbeat,
            next_heartbeat_in: p.next_heartbeat.map(|at| at.saturating_duration_since(now)),
            transient_errors: p.transient_errors,
            why,
        }
    }
}

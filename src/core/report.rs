//! The table as the operator reads it: each engine's line of the
//! snapshot, and the sentence that says why the engine is kept. Rendering
//! only: it reads what the rules hold and decides nothing, so the flows
//! (`flow.rs`) never wait behind a page of text.

use std::time::{Duration, Instant};

use super::accounting::ReadAccounting;
use super::directory::Directory;
use super::given_up::GivenUpBook;
use super::peer::Peer;
use crate::event::ReleaseReason;
use crate::snapshot::{EngineSnapshot, HeartbeatSnapshot};

/// What an engine's line reads besides its own record: the core's shared
/// tables, borrowed for one snapshot.
pub(super) struct Context<'a> {
    pub(super) now: Instant,
    pub(super) given_up: &'a GivenUpBook,
    pub(super) directory: &'a Directory,
    pub(super) read_stall: Option<Duration>,
    pub(super) silent_peer_note: &'a str,
}

impl Context<'_> {
    /// The engine of record `p` as the snapshot shows it.
    pub(super) fn engine<R, A: ReadAccounting>(&self, p: &Peer<R, A>) -> EngineSnapshot {
        let now = self.now;
        let reads = p.cell.reads_in_flight();
        let last_heartbeat = p.beat.last().map(|(at, status)| HeartbeatSnapshot {
            ago: now.saturating_duration_since(at),
            status,
        });
        let why = match p.fate.reason() {
            None => self.why_live(p, reads, last_heartbeat.as_ref()),
            Some(_) if p.is_releasing() => {
                "releasing: the transport is giving back its NIXL state".into()
            }
            Some(reason) => self.why_held(p, reads, reason),
        };
        EngineSnapshot {
            engine: p.id().clone(),
            address: p.who.address().clone(),
            incarnation: p.who.incarnation(),
            agents: p.who.agents().to_vec(),
            state: p.cell.state(),
            reads_in_flight: reads,
            given_up: self.given_up.of(now, p.cell.serial()),
            leases: p.beat.leases().cloned().collect(),
            last_heartbeat,
            next_heartbeat_in: p.beat.next().map(|at| at.saturating_duration_since(now)),
            transient_errors: p.fate.transient_errors(),
            why,
        }
    }

    /// Why a live engine is kept: no disconnect seen, its reads, and what
    /// would find it silent.
    fn why_live<R, A: ReadAccounting>(
        &self,
        p: &Peer<R, A>,
        reads: u64,
        last_heartbeat: Option<&HeartbeatSnapshot>,
    ) -> String {
        let last = match last_heartbeat {
            Some(h) => format!("last heartbeat {} {:?} ago", h.status.name(), h.ago),
            None => "no heartbeat yet".to_string(),
        };
        let reads_note = p.progress.note(self.now, reads, self.read_stall);
        format!(
            "live: no REMOTE_DISCONNECT seen ({last}); {reads_note}; a silent peer is reported by UCX: {}",
            self.silent_peer_note
        )
    }

    /// Why a marked engine is not released yet: what its release waits for.
    fn why_held<R, A: ReadAccounting>(
        &self,
        p: &Peer<R, A>,
        reads: u64,
        reason: ReleaseReason,
    ) -> String {
        let mut held = Vec::new();
        if reads > 0 {
            held.push(format!("{reads} read(s) in flight"));
        }
        if let Some((n, oldest)) = self.given_up.oldest(self.now, p.cell.serial()) {
            held.push(format!(
                "{n} given-up transfer(s) to end (they complete if it resumes, fail if it dies; the oldest held {oldest:?})"
            ));
        }
        if let Some(n) = self.directory.holding(p.who.address(), p.cell.serial()) {
            held.push(format!("{n} handshake(s) pending at {}", p.who.address()));
        }
        format!(
            "{}: release waits for {}",
            reason.as_str(),
            if held.is_empty() {
                "nothing (about to be released)".to_string()
            } else {
                held.join(" and ")
            }
        )
    }
}

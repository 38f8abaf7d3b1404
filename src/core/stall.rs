//! Hung peers: registrations whose reads in flight stopped completing
//! while the decoder's other reads went on, or whose reads the runtime gave
//! up as timed out. UCX reports none of these on shared memory or TCP.
//!
//! The clock of a stall starts when a quiet stretch is first seen (at
//! most one check period after it began) and is judged exactly one bound
//! later: never early, within 1.25 bounds. No engine is blamed while no
//! engine completes anything (the decoder itself is stuck; warned once per
//! episode).

use std::time::Duration;

use std::time::Instant;

use super::peer::Peer;
use super::timers::Timer;
use super::{Core, Count, HEARTBEAT_SLOT};
use crate::config::StallAction;
use crate::event::{Event, ReleaseReason};
use crate::give_up::GiveUp;
use crate::registration::RegistrationId;

/// The longest period of the read-stall check, whatever the bound: the
/// completed count must not be able to wrap between two checks (see
/// `cell.rs`).
pub(crate) const MAX_STALL_CHECK_PERIOD: Duration = Duration::from_secs(60);

/// How often the read-stall check runs for a `bound`: four times per bound
/// (at most every [`MAX_STALL_CHECK_PERIOD`]). An engine's quiet stretch is
/// first seen at most one period after it began and is judged exactly one
/// bound after that, so a stall is found within 1.25 bounds (while other
/// engines' reads complete at least once a period).
pub(super) fn stall_check_period(bound: Duration) -> Duration {
    (bound / 4).clamp(HEARTBEAT_SLOT, MAX_STALL_CHECK_PERIOD)
}

// The proof, checked by the compiler: wrapping the completed count within
// one check period would take more than 10^9 completions a second.
const _: () = assert!(
    MAX_STALL_CHECK_PERIOD.as_secs() * 1_000_000_000 < 1 << crate::read_accounting::cell::DONE_BITS,
    "the completed count could wrap between two stall checks"
);

/// What the sampling found of one suspect: quiet for `quiet` with
/// `reads` in flight (`given_up` of them given up as timed out), and
/// whether it itself completed a read within the last check period.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Suspect {
    pub(super) serial: RegistrationId,
    pub(super) reads: u64,
    pub(super) quiet: Duration,
    pub(super) given_up: u64,
    pub(super) completing: bool,
}

/// What one check's judgement found.
#[derive(Debug, PartialEq)]
pub(super) struct Judgement {
    /// The suspects whose stall is their own, in registration order.
    pub(super) stalled: Vec<Suspect>,
    /// Suspects nobody blames: the decoder itself looks stuck.
    pub(super) unjudged: usize,
    /// A decoder-wide stall began with this check: warned once per
    /// episode.
    pub(super) stuck_began: bool,
}

/// The stall rule's judge: whether a suspect's stall is its own or the
/// decoder's, and whether a decoder-wide stall is an episode already
/// warned about. Its own so that the judgement (the part that must not
/// blame an engine for the decoder's own stall) is tested without a core.
#[derive(Default)]
pub(super) struct StallWatch {
    /// A decoder-wide stall (suspects, but no engine completing) is going
    /// on and has been warned about: once per episode.
    decoder_stuck: bool,
}

impl StallWatch {
    /// Judges one check's `suspects`, given the live engines with a read
    /// `outstanding` and those `completing` within the last period (each
    /// suspect among the first, and among the second if it completed). A
    /// suspect is stalled when another engine completed, or when no other
    /// has a read outstanding to compare with; otherwise nobody is blamed.
    pub(super) fn judge(
        &mut self,
        mut suspects: Vec<Suspect>,
        outstanding: usize,
        completing: usize,
    ) -> Judgement {
        suspects.sort_unstable_by_key(|s| s.serial);
        let mut unjudged = 0usize;
        suspects.retain(|suspect| {
            let others_outstanding = outstanding > 1;
            let others_completing = completing > usize::from(suspect.completing);
            let blamed = !others_outstanding || others_completing;
            unjudged += usize::from(!blamed);
            blamed
        });
        let stuck_began = unjudged > 0 && !self.decoder_stuck;
        self.decoder_stuck = unjudged > 0;
        Judgement {
            stalled: suspects,
            unjudged,
            stuck_began,
        }
    }
}

impl<R> Core<R> {
    /// The read-stall check: finds live registrations whose reads stopped
    /// completing, and judges them.
    ///
    /// An engine is *quiet* while it has a read outstanding (in flight, or
    /// given up unanswered) and no completion has been seen; its quiet
    /// stretch starts when that was first seen (a check, or a give-up),
    /// never earlier, so a read that began just before a check is not
    /// counted from an older check. A quiet engine is a suspect once its
    /// stretch reaches `bound`, or at once when the runtime gave up one of
    /// its reads as timed out with none of its reads completing meanwhile
    /// (the runtime's own bound). Slow is not hung: one completion, however
    /// late, ends the stretch.
    ///
    /// A suspect is judged stalled only when the stall is its own: another
    /// engine's completion was seen within the last check period, or no
    /// other engine has a read outstanding to compare with. When others
    /// have reads outstanding and none completes, the decoder itself looks
    /// stuck: nobody is blamed, and that is warned about once per episode.
    ///
    /// Every engine is sampled first and judged after, so the verdicts do
    /// not depend on the order of the walk; suspects are judged (and their
    /// events emitted) in registration order, so a seed reproduces them.
    pub(super) fn check_stalls(&mut self, now: Instant, bound: Duration) {
        let window = stall_check_period(bound);
        let mut outstanding = 0usize;
        let mut completing = 0usize;
        let mut suspects = Vec::new();
        let mut next_due: Option<Instant> = None;
        for (&serial, peer) in self.peers.iter_mut() {
            if !peer.is_live() {
                continue;
            }
            let (reads, done) = peer.cell.progress();
            let p = &mut peer.progress;
            if done != p.done_seen {
                p.completed(now, done, reads);
            } else if !p.outstanding(reads) {
                p.quiet_since = None;
                p.reported = false;
            } else if p.quiet_since.is_none() {
                p.quiet_since = Some(now);
            }
            let is_completing = p.last_completion.is_some_and(|at| now - at <= window);
            outstanding += usize::from(p.outstanding(reads));
            completing += usize::from(is_completing);
            let Some(since) = p.quiet_since.filter(|_| !p.reported) else {
                continue;
            };
            let quiet = now - since;
            if quiet >= bound || p.timed_out > 0 {
                suspects.push(Suspect {
                    serial,
                    reads,
                    quiet,
                    given_up: u64::from(p.timed_out),
                    completing: is_completing,
                });
            } else {
                let due = since + bound;
                next_due = Some(next_due.map_or(due, |d| d.min(due)));
            }
        }
        self.timers.set_or_stop(Timer::StallMark, next_due);
        let judgement = self.stalls.judge(suspects, outstanding, completing);
        for suspect in judgement.stalled {
            self.stalled(
                now,
                suspect.serial,
                suspect.reads,
                suspect.quiet,
                suspect.given_up,
            );
        }
        if judgement.stuck_began {
            self.count(Count::DecoderStuck);
            tracing::warn!(
                engines = judgement.unjudged,
                outstanding,
                bound = ?bound,
                "reads of every engine with reads outstanding stopped completing: the decoder itself looks stuck, no engine is blamed (warned once until a read completes again)"
            );
        }
    }

    /// A suspect judged stalled: reported once per stall, and with the
    /// `fail` action marked, its reads failed, released once they end.
    pub(super) fn stalled(
        &mut self,
        now: Instant,
        serial: RegistrationId,
        reads: u64,
        quiet: Duration,
        given_up: u64,
    ) {
        let peer = self.peers.get_mut(&serial).expect("judged while live");
        peer.progress.reported = true;
        let engine = peer.id().clone();
        let action = self.config.stall_action;
        self.count(Count::ReadStall(action.as_str()));
        tracing::warn!(%engine, reads, ?quiet, given_up, action = action.as_str(), "reads stopped completing: the peer is hung");
        self.emit(Event::Stalled {
            engine,
            registration: serial,
            reads_in_flight: reads,
            stalled_for: quiet,
            given_up,
            failed: action == StallAction::Fail,
        });
        if action == StallAction::Fail {
            self.mark(now, serial, ReleaseReason::Stalled);
        }
    }

    /// The runtime gave up a read of registration `serial` in progress.
    /// Not a completion. Unanswered (no read of the engine completed while
    /// it was in flight: the read's own count at its begin against the
    /// count now), it is evidence: it keeps the engine's quiet stretch going
    /// with no read in flight, and a timed-out one is judged at once.
    /// Completions the core has not sampled yet are taken in first, but
    /// they do not answer the read: they may predate its begin (a read
    /// that began after the last completion of a prefill that then froze,
    /// and timed out before the next stall check, is still unanswered).
    /// The read's count cannot have wrapped while it was in flight: that
    /// takes 2^36 completions of one engine during one read.
    pub(super) fn read_given_up(
        &mut self,
        now: Instant,
        serial: RegistrationId,
        why: GiveUp,
        unanswered: bool,
        done: u64,
    ) {
        self.count(Count::ReadGivenUp { why, unanswered });
        let Some(peer) = self.peers.get_mut(&serial) else {
            return;
        };
        if !peer.is_live() || self.config.read_stall.is_none() {
            return;
        }
        let reads = peer.cell.reads_in_flight();
        let engine = peer.id().clone();
        let p = &mut peer.progress;
        if done != p.done_seen {
            // Completions since the last check: before this read began or
            // while it was in flight (the read's own count tells which).
            p.completed(now, done, reads);
        }
        if !unanswered {
            tracing::debug!(%engine, why = why.as_str(), "read given up at an engine that completes reads: not evidence of a stall");
            return;
        }
        p.unanswered = p.unanswered.saturating_add(1);
        p.quiet_since.get_or_insert(now);
        tracing::info!(%engine, why = why.as_str(), unanswered = p.unanswered, "read given up unanswered: counted against the engine, not as a completion");
        if why == GiveUp::TimedOut {
            p.timed_out = p.timed_out.saturating_add(1);
            self.timers.set(Timer::StallMark, now);
        }
    }

    /// What a live engine's snapshot says about its reads and the stall
    /// check.
    pub(super) fn stall_note(&self, now: Instant, p: &Peer<R>, reads: u64) -> String {
        let progress = &p.progress;
        if reads == 0 && progress.unanswered == 0 {
            return "no read in flight: a frozen idle prefill is invisible to UCX on shm/tcp, and only a membership signal or the router (peer_gone) can retire it".to_string();
        }
        let given_up = match progress.unanswered {
            0 => String::new(),
            n => format!(", {n} given up unanswered"),
        };
        let Some(bound) = self.config.read_stall else {
            return format!("{reads} read(s) in flight{given_up}; the read-stall check is off");
        };
        match progress.quiet_since {
            Some(since) => format!(
                "{reads} read(s) in flight{given_up}, none completed for at least {:?}; stalled after {bound:?} without a completion",
                now.saturating_duration_since(since)
            ),
            None => format!(
                "{reads} read(s) in flight{given_up}, completing; stalled after {bound:?} without a completion"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{StallWatch, Suspect};
    use crate::registration::RegistrationId;
    use std::time::Duration;

    fn suspect(serial: u64, completing: bool) -> Suspect {
        Suspect {
            serial: RegistrationId(serial),
            reads: 1,
            quiet: Duration::from_secs(10),
            given_up: 0,
            completing,
        }
    }

    #[test]
    fn a_suspect_alone_with_reads_outstanding_is_stalled() {
        let mut watch = StallWatch::default();
        let judged = watch.judge(vec![suspect(1, false)], 1, 0);
        assert_eq!(judged.stalled, vec![suspect(1, false)]);
        assert_eq!((judged.unjudged, judged.stuck_began), (0, false));
    }

    #[test]
    fn suspects_are_stalled_in_registration_order_while_another_engine_completes() {
        let mut watch = StallWatch::default();
        let judged = watch.judge(vec![suspect(3, false), suspect(2, false)], 3, 1);
        let serials: Vec<u64> = judged.stalled.iter().map(|s| s.serial.get()).collect();
        assert_eq!(serials, [2, 3]);
    }

    #[test]
    fn a_suspect_s_own_completion_does_not_count_as_another_s() {
        let mut watch = StallWatch::default();
        let judged = watch.judge(vec![suspect(1, true)], 2, 1);
        assert!(
            judged.stalled.is_empty(),
            "only its own completion was seen"
        );
        assert_eq!(judged.unjudged, 1);
    }

    #[test]
    fn a_decoder_wide_stall_is_one_episode_until_a_check_blames_nobody_else() {
        let mut watch = StallWatch::default();
        let stuck = || vec![suspect(1, false), suspect(2, false)];
        let first = watch.judge(stuck(), 2, 0);
        assert!(first.stalled.is_empty(), "nobody is blamed");
        assert_eq!((first.unjudged, first.stuck_began), (2, true));
        assert!(
            !watch.judge(stuck(), 2, 0).stuck_began,
            "warned once per episode"
        );
        assert!(
            !watch.judge(Vec::new(), 2, 1).stuck_began,
            "the episode ended"
        );
        assert!(
            watch.judge(stuck(), 2, 0).stuck_began,
            "a new episode is news"
        );
    }
}

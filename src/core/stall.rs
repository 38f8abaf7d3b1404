//! Hung peers: registrations whose reads in flight stopped completing
//! while the decoder's other reads went on, or whose reads the runtime gave
//! up as timed out. UCX reports none of these on shared memory or TCP.
//!
//! The clock of a stall starts when a quiet stretch is first seen (at
//! most one check period after it began) and is judged exactly one bound
//! later: never early, within 1.25 bounds. No engine is blamed while no
//! engine completes anything (the decoder itself is stuck; warned once per
//! episode).

use std::time::{Duration, Instant};

use super::HEARTBEAT_SLOT;
use crate::registration::RegistrationId;

/// The longest period of the read-stall check, whatever the bound: the
/// completed count must not be able to wrap between two checks (the read
/// accounting proves it holds for its count's width).
pub(crate) const MAX_STALL_CHECK_PERIOD: Duration = Duration::from_secs(60);

/// How often the read-stall check runs for a `bound`: four times per bound
/// (at most every [`MAX_STALL_CHECK_PERIOD`]). An engine's quiet stretch is
/// first seen at most one period after it began and is judged exactly one
/// bound after that, so a stall is found within 1.25 bounds (while other
/// engines' reads complete at least once a period).
pub(super) fn stall_check_period(bound: Duration) -> Duration {
    (bound / 4).clamp(HEARTBEAT_SLOT, MAX_STALL_CHECK_PERIOD)
}

/// What the stall check knows of a registration's reads, kept in its
/// record.
///
/// The check samples the registration's counts (reads in flight, completed
/// count) at its own times and hears of given-up reads when they happen,
/// so every time kept here is *when it was seen*: a completion seen at a
/// check happened at or before it, a read seen in flight began at or
/// before it. The stall clock therefore starts as late as the evidence
/// allows, and a mark is never early.
pub(super) struct Progress {
    /// The wrapping count of reads completed, as last seen.
    done_seen: u64,
    /// Since when the engine has had a read outstanding (in flight, or
    /// given up unanswered) and no completion: the first time that was
    /// seen. `None` while it has none (idle, or a completion seen since).
    quiet_since: Option<Instant>,
    /// When a completion was last seen.
    last_completion: Option<Instant>,
    /// Reads given up unanswered since the last completion: they keep the
    /// stall clock running with no read in flight. 32 bits (saturating):
    /// a count, not an identity; the stall check marks the engine long
    /// before 4 * 10^9 of them.
    unanswered: u32,
    /// Of those, timed out: the runtime's own verdict, judged at the next
    /// check.
    timed_out: u32,
    /// The current quiet stretch has been reported (once per stall).
    reported: bool,
}

/// One registration as a check sampled it.
pub(super) struct Sample {
    /// A read outstanding: in flight, or given up unanswered.
    pub(super) outstanding: bool,
    /// A completion seen within the last check period.
    pub(super) completing: bool,
    pub(super) quiet: Quiet,
}

/// Where a sampled registration's quiet stretch stands.
pub(super) enum Quiet {
    /// Not quiet, or its stall was reported already.
    No,
    /// Quiet for `quiet` (or with reads given up as timed out,
    /// `given_up`): a suspect, to be judged.
    Suspect { quiet: Duration, given_up: u64 },
    /// Quiet, and judged at this time unless a completion comes first.
    JudgedAt(Instant),
}

impl Progress {
    /// A registration whose completed count is `done_seen`.
    pub(super) fn new(done_seen: u64) -> Self {
        Progress {
            done_seen,
            quiet_since: None,
            last_completion: None,
            unanswered: 0,
            timed_out: 0,
            reported: false,
        }
    }

    /// A completion was seen at `now` (the completed count is `done`),
    /// with `reads` in flight: the quiet stretch ends; with reads still in
    /// flight a new one starts now.
    fn completed(&mut self, now: Instant, done: u64, reads: u64) {
        self.done_seen = done;
        self.last_completion = Some(now);
        self.unanswered = 0;
        self.timed_out = 0;
        self.reported = false;
        self.quiet_since = (reads > 0).then_some(now);
    }

    /// A read outstanding: in flight now, or given up unanswered.
    fn outstanding(&self, reads: u64) -> bool {
        reads > 0 || self.unanswered > 0
    }

    /// A check at `now` sees `reads` in flight and the completed count
    /// `done`; a quiet stretch of `bound` makes a suspect, and a
    /// completion within `window` (the check period) counts as completing.
    pub(super) fn sample(
        &mut self,
        now: Instant,
        reads: u64,
        done: u64,
        bound: Duration,
        window: Duration,
    ) -> Sample {
        if done != self.done_seen {
            self.completed(now, done, reads);
        } else if !self.outstanding(reads) {
            self.quiet_since = None;
            self.reported = false;
        } else if self.quiet_since.is_none() {
            self.quiet_since = Some(now);
        }
        let outstanding = self.outstanding(reads);
        let completing = self.last_completion.is_some_and(|at| now - at <= window);
        let quiet = match self.quiet_since.filter(|_| !self.reported) {
            None => Quiet::No,
            Some(since) if now - since >= bound || self.timed_out > 0 => Quiet::Suspect {
                quiet: now - since,
                given_up: u64::from(self.timed_out),
            },
            Some(since) => Quiet::JudgedAt(since + bound),
        };
        Sample {
            outstanding,
            completing,
            quiet,
        }
    }

    /// The current stall was reported: not again until a completion.
    pub(super) fn reported(&mut self) {
        self.reported = true;
    }

    /// A read was given up at `now`, the engine's completed count being
    /// `done` and `reads` in flight. Completions not sampled yet are taken
    /// in first, but they do not answer the read: they may predate its
    /// begin (a read that began after the last completion of a prefill
    /// that then froze, and timed out before the next stall check, is
    /// still unanswered). An answered read is no evidence (`None`); an
    /// `unanswered` one (the read's own count at its begin against the
    /// count now, which cannot have wrapped: that takes 2^36 completions
    /// of one engine during one read) keeps the quiet stretch going with
    /// no read in flight, and a `timed_out` one is judged at the next
    /// check. Returns the reads given up unanswered so far.
    pub(super) fn given_up(
        &mut self,
        now: Instant,
        reads: u64,
        done: u64,
        unanswered: bool,
        timed_out: bool,
    ) -> Option<u32> {
        if done != self.done_seen {
            self.completed(now, done, reads);
        }
        if !unanswered {
            return None;
        }
        self.unanswered = self.unanswered.saturating_add(1);
        self.quiet_since.get_or_insert(now);
        if timed_out {
            self.timed_out = self.timed_out.saturating_add(1);
        }
        Some(self.unanswered)
    }

    /// What a live engine's snapshot says about its reads (`reads` in
    /// flight) and the stall check (`bound`, if on).
    pub(super) fn note(&self, now: Instant, reads: u64, bound: Option<Duration>) -> String {
        if reads == 0 && self.unanswered == 0 {
            return "no read in flight: a frozen idle prefill is invisible to UCX on shm/tcp, and only a membership signal or the router (peer_gone) can retire it".to_string();
        }
        let given_up = match self.unanswered {
            0 => String::new(),
            n => format!(", {n} given up unanswered"),
        };
        let Some(bound) = bound else {
            return format!("{reads} read(s) in flight{given_up}; the read-stall check is off");
        };
        match self.quiet_since {
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

/// One read-stall check: finds live registrations whose reads stopped
/// completing, for [`StallWatch::judge`].
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
/// Every engine is sampled first and judged after, so the verdicts do
/// not depend on the order of the walk.
pub(super) struct Check {
    now: Instant,
    bound: Duration,
    /// The period a completion counts for ([`stall_check_period`]).
    window: Duration,
    /// Live engines with a read outstanding.
    outstanding: usize,
    /// Live engines that completed a read within the window.
    completing: usize,
    suspects: Vec<Suspect>,
    /// The earliest time a quiet engine not yet a suspect is judged.
    next_due: Option<Instant>,
}

impl Check {
    /// A check at `now` against the stall `bound`.
    pub(super) fn new(now: Instant, bound: Duration) -> Self {
        Check {
            now,
            bound,
            window: stall_check_period(bound),
            outstanding: 0,
            completing: 0,
            suspects: Vec::new(),
            next_due: None,
        }
    }

    /// Samples the live registration `serial` with `reads` in flight and
    /// `done` completed so far.
    pub(super) fn sample(
        &mut self,
        serial: RegistrationId,
        progress: &mut Progress,
        (reads, done): (u64, u64),
    ) {
        let sample = progress.sample(self.now, reads, done, self.bound, self.window);
        self.outstanding += usize::from(sample.outstanding);
        self.completing += usize::from(sample.completing);
        match sample.quiet {
            Quiet::No => {}
            Quiet::Suspect { quiet, given_up } => self.suspects.push(Suspect {
                serial,
                reads,
                quiet,
                given_up,
                completing: sample.completing,
            }),
            Quiet::JudgedAt(due) => {
                self.next_due = Some(self.next_due.map_or(due, |d| d.min(due)));
            }
        }
    }

    /// When the next quiet engine becomes a suspect, if one will.
    pub(super) fn next_due(&self) -> Option<Instant> {
        self.next_due
    }

    /// The live engines with a read outstanding.
    pub(super) fn outstanding(&self) -> usize {
        self.outstanding
    }
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
    /// Judges a check's suspects: a suspect is stalled (its stall is its
    /// own) when another engine's completion was seen within the last
    /// check period, or no other engine has a read outstanding to compare
    /// with. When others have reads outstanding and none completes, the
    /// decoder itself looks stuck: nobody is blamed, and that is warned
    /// about once per episode. Suspects are judged in registration order,
    /// so a seed reproduces the events.
    pub(super) fn judge(&mut self, check: Check) -> Judgement {
        self.judge_suspects(check.suspects, check.outstanding, check.completing)
    }

    /// Judges `suspects`, given the live engines with a read `outstanding`
    /// and those `completing` within the last period (each suspect among
    /// the first, and among the second if it completed).
    fn judge_suspects(
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
        let judged = watch.judge_suspects(vec![suspect(1, false)], 1, 0);
        assert_eq!(judged.stalled, vec![suspect(1, false)]);
        assert_eq!((judged.unjudged, judged.stuck_began), (0, false));
    }

    #[test]
    fn suspects_are_stalled_in_registration_order_while_another_engine_completes() {
        let mut watch = StallWatch::default();
        let judged = watch.judge_suspects(vec![suspect(3, false), suspect(2, false)], 3, 1);
        let serials: Vec<u64> = judged.stalled.iter().map(|s| s.serial.get()).collect();
        assert_eq!(serials, [2, 3]);
    }

    #[test]
    fn a_suspect_s_own_completion_does_not_count_as_another_s() {
        let mut watch = StallWatch::default();
        let judged = watch.judge_suspects(vec![suspect(1, true)], 2, 1);
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
        let first = watch.judge_suspects(stuck(), 2, 0);
        assert!(first.stalled.is_empty(), "nobody is blamed");
        assert_eq!((first.unjudged, first.stuck_began), (2, true));
        assert!(
            !watch.judge_suspects(stuck(), 2, 0).stuck_began,
            "warned once per episode"
        );
        assert!(
            !watch.judge_suspects(Vec::new(), 2, 1).stuck_began,
            "the episode ended"
        );
        assert!(
            watch.judge_suspects(stuck(), 2, 0).stuck_began,
            "a new episode is news"
        );
    }
}

//! Hung peers: reads that stop completing, the stall clock, and reads
//! given up as evidence.

use super::*;

// ----- hung peers (read stalls) -----

/// Runs `seconds` of virtual time in 1 s steps; each step, `step` may
/// start and end reads.
fn run(h: &mut Harness, seconds: u64, mut step: impl FnMut(&mut Harness, u64)) {
    for t in 0..seconds {
        step(h, t);
        h.advance(SECOND);
        h.complete(NixlStatus::SUCCESS);
    }
}

fn stalls(h: &mut Harness) -> Vec<(EngineId, bool)> {
    h.events()
        .into_iter()
        .filter_map(|e| match e {
            Event::Stalled { engine, failed, .. } => Some((engine, failed)),
            _ => None,
        })
        .collect()
}

#[test]
fn reads_that_stop_completing_while_others_complete_mark_the_engine_stalled() {
    let mut h = harness();
    let hung = h.live("hung", at(1), 1);
    let fine = h.live("fine", at(2), 2);
    hung.begin_read().unwrap();
    run(&mut h, 9, |_, _| {
        fine.begin_read().unwrap();
        fine.end_read(fine.begun_here());
    });
    assert_eq!(hung.state(), EngineState::Live, "not before the bound");
    run(&mut h, 4, |_, _| {
        fine.begin_read().unwrap();
        fine.end_read(fine.begun_here());
    });
    assert_eq!(hung.state(), EngineState::Stalled);
    assert!(hung.reads_failed().is_set(), "its reads are failed");
    assert_eq!(fine.state(), EngineState::Live);
    // The runtime abandons the read: released like any other.
    h.end_read(&hung);
    assert_eq!(h.released(), vec![1]);
    let events = h.events();
    assert!(events.iter().any(|e| matches!(
        e,
        Event::Released {
            reason: ReleaseReason::Stalled,
            ..
        }
    )));
}

#[test]
fn a_slow_peer_whose_reads_complete_however_slowly_is_never_marked() {
    let mut h = harness();
    let slow = h.live("slow", at(1), 1);
    let fine = h.live("fine", at(2), 2);
    slow.begin_read().unwrap();
    slow.begin_read().unwrap();
    // One of its two reads completes every 9 s (the bound is 10 s) and is
    // replaced by a new one: always reads in flight, always progressing.
    run(&mut h, 120, |_, t| {
        fine.begin_read().unwrap();
        fine.end_read(fine.begun_here());
        if t % 9 == 8 {
            slow.end_read(slow.begun_here());
            slow.begin_read().unwrap();
        }
    });
    assert_eq!(slow.state(), EngineState::Live);
    assert!(stalls(&mut h).is_empty());
}

#[test]
fn when_no_read_of_any_engine_completes_the_decoder_is_stuck_and_no_engine_is_blamed() {
    let mut h = harness();
    let a = h.live("a", at(1), 1);
    let b = h.live("b", at(2), 2);
    a.begin_read().unwrap();
    b.begin_read().unwrap();
    run(&mut h, 60, |_, _| {});
    assert_eq!(a.state(), EngineState::Live);
    assert_eq!(b.state(), EngineState::Live);
    assert!(stalls(&mut h).is_empty());
}

#[test]
fn a_single_engine_with_nothing_to_compare_with_is_marked_when_its_reads_stall() {
    let mut h = harness();
    let only = h.live("only", at(1), 1);
    only.begin_read().unwrap();
    run(&mut h, 13, |_, _| {});
    assert_eq!(only.state(), EngineState::Stalled);
    assert_eq!(stalls(&mut h), vec![(id("only"), true)]);
}

#[test]
fn with_the_report_action_a_stall_is_reported_once_and_the_engine_kept() {
    let mut config = config();
    config.stall_action = crate::config::StallAction::Report;
    let mut h = harness_with(config);
    let hung = h.live("hung", at(1), 1);
    hung.begin_read().unwrap();
    run(&mut h, 30, |_, _| {});
    assert_eq!(hung.state(), EngineState::Live);
    assert_eq!(stalls(&mut h), vec![(id("hung"), false)], "once per stall");
    // It completes, then stalls again: reported again.
    hung.end_read(hung.begun_here());
    hung.begin_read().unwrap();
    run(&mut h, 30, |_, _| {});
    assert_eq!(stalls(&mut h), vec![(id("hung"), false)]);
}

#[test]
fn an_idle_live_engine_says_only_membership_or_the_router_can_retire_it() {
    let mut h = harness();
    h.live("idle", at(1), 1);
    let snapshot = h.core.snapshot(h.now);
    let why = &snapshot.engines[0].why;
    assert!(
        why.contains("only a membership signal or the router"),
        "{why}"
    );
}

// ----- the stall clock, right by construction -----

/// One completed read (begun and ended at once).
fn complete_one(cell: &PlainReads) {
    let begun = cell.begin_read().unwrap();
    cell.end_read(begun);
}

/// The `Stalled` events decided since the last take, with their fields.
fn stalled_events(h: &mut Harness) -> Vec<(EngineId, Duration, u64)> {
    h.events()
        .into_iter()
        .filter_map(|e| match e {
            Event::Stalled {
                engine,
                stalled_for,
                given_up,
                ..
            } => Some((engine, stalled_for, given_up)),
            _ => None,
        })
        .collect()
}

/// Steps the clock in `step`s until `until`; before each step `f` may
/// start and end reads. Heartbeats are answered. Returns when the
/// registration behind `watch` left `Live`, if it did.
fn step_until(
    h: &mut Harness,
    until: Instant,
    step: Duration,
    watch: &PlainReads,
    mut f: impl FnMut(&mut Harness, Instant),
) -> Option<Instant> {
    while h.now < until {
        let now = h.now;
        f(h, now);
        h.advance(step);
        h.complete(NixlStatus::SUCCESS);
        if watch.state() != EngineState::Live {
            return Some(h.now);
        }
    }
    None
}

#[test]
fn a_read_begun_1ms_before_a_check_is_marked_no_sooner_than_the_bound_and_its_stalled_for_is_true()
{
    let bound = Duration::from_secs(10);
    let mut h = harness();
    let t0 = h.now;
    let hung = h.live("hung", at(1), 1);
    let fine = h.live("fine", at(2), 2);
    // The stall check runs every 2.5 s from t0: the read begins 1 ms
    // before the first one.
    h.advance(Duration::from_millis(2499));
    h.events();
    let begun = h.now;
    hung.begin_read().unwrap();
    let marked = step_until(
        &mut h,
        t0 + bound * 2,
        Duration::from_millis(10),
        &hung,
        |_, _| complete_one(&fine),
    )
    .expect("marked");
    let in_flight = marked - begun;
    assert!(
        in_flight >= bound,
        "marked after the read was in flight for {in_flight:?} only (bound {bound:?})"
    );
    assert!(in_flight <= bound + bound / 4, "marked late: {in_flight:?}");
    let events = stalled_events(&mut h);
    assert_eq!(events.len(), 1, "{events:?}");
    let (engine, stalled_for, given_up) = &events[0];
    assert_eq!((engine, *given_up), (&id("hung"), 0));
    assert!(
        *stalled_for <= in_flight && *stalled_for >= bound,
        "stalled_for {stalled_for:?} for a read in flight {in_flight:?}"
    );
}

#[test]
fn a_read_begun_just_after_a_check_is_marked_within_a_quarter_bound_past_the_bound() {
    let bound = Duration::from_secs(10);
    let mut h = harness();
    let t0 = h.now;
    let hung = h.live("hung", at(1), 1);
    let fine = h.live("fine", at(2), 2);
    h.advance(Duration::from_millis(2501));
    let begun = h.now;
    hung.begin_read().unwrap();
    let marked = step_until(
        &mut h,
        t0 + bound * 2,
        Duration::from_millis(10),
        &hung,
        |_, _| complete_one(&fine),
    )
    .expect("marked");
    assert!(marked - begun <= bound + bound / 4, "{:?}", marked - begun);
    assert!(marked - begun >= bound);
}

#[test]
fn when_every_engine_stops_completing_at_once_no_engine_is_blamed_whichever_read_began_first() {
    let mut h = harness();
    let t0 = h.now;
    let a = h.live("a", at(1), 1);
    let b = h.live("b", at(2), 2);
    // Each has a long read in flight throughout; both complete short reads
    // until the decoder stops at about 7.5 s: a's last completion is seen
    // by the check at 7.5 s, b's by the one at 10 s.
    a.begin_read().unwrap();
    b.begin_read().unwrap();
    let marked = step_until(
        &mut h,
        t0 + Duration::from_secs(90),
        Duration::from_millis(100),
        &a,
        |_, now| {
            if now < t0 + Duration::from_millis(7400) {
                complete_one(&a);
            }
            if now < t0 + Duration::from_millis(7600) {
                complete_one(&b);
            }
        },
    );
    assert_eq!(marked, None, "a was blamed for the decoder's stall");
    assert_eq!(b.state(), EngineState::Live);
    assert!(stalled_events(&mut h).is_empty());
}

#[test]
fn an_engine_completing_exactly_2_pow_24_reads_between_two_checks_is_not_stalled() {
    let mut h = harness();
    let t0 = h.now;
    let busy = h.live("busy", at(1), 1);
    busy.begin_read().unwrap();
    let marked = step_until(
        &mut h,
        t0 + Duration::from_secs(60),
        Duration::from_millis(2500),
        &busy,
        |_, _| busy.add_completions(1 << 24),
    );
    assert_eq!(
        marked, None,
        "completing 2^24 reads per check looked like none"
    );
    assert!(stalled_events(&mut h).is_empty());
}

/// Runs `f` with the core's WARN lines captured; returns them.
fn warnings_of(f: impl FnOnce()) -> String {
    use std::io::Write;
    use std::sync::Mutex;
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);
    impl Write for Buffer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buffer = Buffer::default();
    let writer = buffer.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
    text
}

#[test]
fn the_decoder_is_stuck_warning_comes_once_per_episode() {
    let mut log = String::new();
    let mut h = harness();
    let t0 = h.now;
    let a = h.live("a", at(1), 1);
    let b = h.live("b", at(2), 2);
    a.begin_read().unwrap();
    b.begin_read().unwrap();
    log += &warnings_of(|| {
        // Nothing completes for 60 s: one episode.
        step_until(
            &mut h,
            t0 + Duration::from_secs(60),
            Duration::from_millis(500),
            &a,
            |_, _| {},
        );
        // Reads complete again, then stop again: a second one.
        complete_one(&a);
        complete_one(&b);
        step_until(
            &mut h,
            t0 + Duration::from_secs(120),
            Duration::from_millis(500),
            &a,
            |_, _| {},
        );
    });
    let episodes = log.matches("the decoder itself looks stuck").count();
    assert_eq!(episodes, 2, "{log}");
    assert_eq!(a.state(), EngineState::Live);
    assert!(stalled_events(&mut h).is_empty());
}

#[test]
fn a_stall_reported_only_is_warned_once_per_stall() {
    let mut config = config();
    config.stall_action = crate::config::StallAction::Report;
    let mut h = harness_with(config);
    let t0 = h.now;
    let hung = h.live("hung", at(1), 1);
    hung.begin_read().unwrap();
    let log = warnings_of(|| {
        step_until(
            &mut h,
            t0 + Duration::from_secs(120),
            Duration::from_millis(500),
            &hung,
            |_, _| {},
        );
    });
    assert_eq!(log.matches("the peer is hung").count(), 1, "{log}");
    assert_eq!(stalled_events(&mut h).len(), 1);
}

// ----- given-up reads: evidence, not completions -----

#[test]
fn a_read_given_up_as_timed_out_unanswered_while_others_complete_stalls_its_engine_at_once() {
    let mut h = harness();
    let t0 = h.now;
    let hung = h.live("hung", at(1), 1);
    let fine = h.live("fine", at(2), 2);
    let begun = hung.begin_read().unwrap();
    let second = hung.begin_read().unwrap();
    // The runtime's read timeout (5 s) is shorter than the bound (10 s).
    step_until(
        &mut h,
        t0 + Duration::from_secs(5),
        Duration::from_millis(100),
        &hung,
        |_, _| complete_one(&fine),
    );
    assert_eq!(hung.state(), EngineState::Live);
    h.events();
    let first = h.give_up(&hung, GiveUp::TimedOut, begun);
    h.advance(Duration::ZERO);
    assert_eq!(hung.state(), EngineState::Stalled, "judged at once");
    assert!(hung.reads_failed().is_set(), "its other reads are failed");
    let events = stalled_events(&mut h);
    assert_eq!(events.len(), 1);
    let (engine, stalled_for, given_up) = &events[0];
    assert_eq!((engine, *given_up), (&id("hung"), 1));
    assert!(*stalled_for <= Duration::from_secs(5), "{stalled_for:?}");
    // The other read is given up too (the service failed it). Both
    // transfers may still run: the engine is fenced, not released, until
    // each ends (the prefill resumed: the first completes) or is
    // abandoned.
    let other = h.give_up(&hung, GiveUp::Cancelled, second);
    assert!(h.released().is_empty(), "fenced by its given-up transfers");
    h.end_given_up(&hung, begun, first, true);
    assert!(h.released().is_empty(), "one still running");
    h.end_given_up(&hung, second, other, false);
    assert_eq!(h.released(), vec![1]);
    assert_eq!(fine.state(), EngineState::Live);
}

#[test]
fn a_timed_out_read_that_began_after_the_last_completion_is_evidence_before_any_stall_check() {
    // vLLM's shape: one read completes, the prefill freezes, the next
    // read times out (2 s) before the core's next stall check (every
    // 2.5 s at a 10 s bound) has sampled that completion. The completion
    // predates the read: the read is unanswered and judged at once.
    let mut h = harness();
    let hung = h.live("hung", at(1), 1);
    h.advance(Duration::from_millis(300));
    complete_one(&hung);
    let begun = hung.begin_read().unwrap();
    h.advance(Duration::from_secs(2));
    let token = h.give_up(&hung, GiveUp::TimedOut, begun);
    h.advance(Duration::ZERO);
    let stalled = stalled_events(&mut h);
    assert_eq!(stalled.len(), 1, "judged at once");
    assert_eq!(stalled[0].2, 1, "on the evidence of the one timed-out read");
    assert!(
        h.released().is_empty(),
        "fenced: the given-up READ may still run"
    );
    assert_eq!(hung.state(), EngineState::Stalled);
    // The prefill died: the READ fails, and the engine goes.
    h.end_given_up(&hung, begun, token, false);
    assert_eq!(h.released(), vec![1]);
    assert_eq!(hung.state(), EngineState::Released);
}

#[test]
fn a_read_given_up_at_an_engine_that_completed_another_meanwhile_is_not_evidence() {
    let mut h = harness();
    let t0 = h.now;
    let slowish = h.live("slowish", at(1), 1);
    let fine = h.live("fine", at(2), 2);
    let stuck_read = slowish.begin_read().unwrap();
    let marked = step_until(
        &mut h,
        t0 + Duration::from_secs(5),
        Duration::from_millis(100),
        &slowish,
        |_, now| {
            complete_one(&fine);
            if now == t0 + Duration::from_secs(4) {
                complete_one(&slowish);
            }
        },
    );
    assert_eq!(marked, None);
    h.give_up(&slowish, GiveUp::TimedOut, stuck_read);
    h.advance(Duration::from_secs(1));
    assert_eq!(slowish.state(), EngineState::Live);
    assert!(stalled_events(&mut h).is_empty());
}

#[test]
fn reads_given_up_cancelled_are_not_completions_the_stall_clock_keeps_running() {
    let bound = Duration::from_secs(10);
    let mut h = harness();
    let t0 = h.now;
    let hung = h.live("hung", at(1), 1);
    let fine = h.live("fine", at(2), 2);
    let begun_at = h.now;
    let begun = hung.begin_read().unwrap();
    step_until(
        &mut h,
        t0 + Duration::from_secs(3),
        Duration::from_millis(100),
        &hung,
        |_, _| complete_one(&fine),
    );
    // Cancelled by the runtime: no verdict, no completion either; the
    // transfer still counts until it ends.
    let token = h.give_up(&hung, GiveUp::Cancelled, begun);
    assert_eq!(hung.state(), EngineState::Live);
    let marked = step_until(
        &mut h,
        t0 + bound * 2,
        Duration::from_millis(100),
        &hung,
        |_, _| complete_one(&fine),
    )
    .expect("the given-up read still counts against it");
    assert!(marked - begun_at >= bound);
    assert!(marked - begun_at <= bound + bound / 4);
    // Fenced until the given-up transfer is abandoned (or ends).
    assert_eq!(hung.state(), EngineState::Stalled);
    h.end_given_up(&hung, begun, token, false);
    assert_eq!(h.released(), vec![1]);
    assert_eq!(hung.state(), EngineState::Released);
    assert!(h.events().iter().any(|e| matches!(
        e,
        Event::Released {
            reason: ReleaseReason::Stalled,
            ..
        }
    )));
}

#[test]
fn reads_given_up_timed_out_everywhere_while_nothing_completes_blame_no_engine() {
    let mut h = harness();
    let t0 = h.now;
    let a = h.live("a", at(1), 1);
    let b = h.live("b", at(2), 2);
    let ra = a.begin_read().unwrap();
    let rb = b.begin_read().unwrap();
    h.advance(Duration::from_secs(5));
    h.give_up(&a, GiveUp::TimedOut, ra);
    h.give_up(&b, GiveUp::TimedOut, rb);
    let marked = step_until(
        &mut h,
        t0 + Duration::from_secs(60),
        Duration::from_millis(500),
        &a,
        |_, _| {},
    );
    assert_eq!(marked, None);
    assert_eq!(b.state(), EngineState::Live);
    assert!(stalled_events(&mut h).is_empty());
}

#[test]
fn a_single_engine_whose_read_timed_out_unanswered_is_stalled_there_is_nothing_to_compare_with() {
    let mut h = harness();
    let only = h.live("only", at(1), 1);
    let r = only.begin_read().unwrap();
    h.advance(Duration::from_secs(5));
    let token = h.give_up(&only, GiveUp::TimedOut, r);
    h.advance(Duration::ZERO);
    // Marked stalled; handed to the release once the transfer ended.
    assert_eq!(only.state(), EngineState::Stalled);
    assert_eq!(stalled_events(&mut h).len(), 1);
    h.end_given_up(&only, r, token, true);
    assert_eq!(h.released(), vec![1]);
}

#[test]
fn with_the_read_stall_check_off_a_given_up_read_marks_nothing() {
    let mut config = config();
    config.read_stall = None;
    let mut h = harness_with(config);
    let only = h.live("only", at(1), 1);
    let r = only.begin_read().unwrap();
    h.advance(Duration::from_secs(5));
    h.give_up(&only, GiveUp::TimedOut, r);
    h.advance(Duration::from_secs(60));
    assert_eq!(only.state(), EngineState::Live);
}

#[test]
fn a_given_up_reads_destination_is_decided_when_the_release_comes_back() {
    for ends in [false, true] {
        let mut h = harness();
        h.core.set_release_ends_transfers(ends);
        let only = h.live("only", at(1), 1);
        let r = only.begin_read().unwrap();
        h.advance(Duration::from_secs(5));
        let token = h.give_up(&only, GiveUp::TimedOut, r);
        h.advance(Duration::ZERO);
        assert_eq!(only.state(), EngineState::Stalled, "fenced while watched");
        // Abandoned: nobody watches it end; the release decides.
        h.end_given_up(&only, r, token, false);
        assert_eq!(
            only.state(),
            EngineState::Released,
            "decided and handed over"
        );
        assert!(
            !only.release_done().is_set(),
            "not before the transport came back"
        );
        assert_eq!(h.released(), vec![1]);
        assert!(only.release_done().is_set());
        assert_eq!(only.transfers_ended(), ends);
    }
}

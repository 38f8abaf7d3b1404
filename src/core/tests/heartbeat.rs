//! The heartbeat rules: every engine heartbeated on its schedule, rate
//! limited, disconnects released, other errors counted.

use super::*;

// ----- the seeds' three cases -----

#[test]
fn every_known_engine_gets_a_heartbeat_every_interval_within_the_jitter() {
    let mut h = harness();
    h.live("p", at(1), 1);
    h.live("q", at(2), 2);
    let mut rounds = 0;
    for _ in 0..60 {
        h.advance(SECOND);
        rounds += h.complete(NixlStatus::SUCCESS).1;
    }
    // 60 s at one round per 5 s (+/- 0.5 s) each: 11 to 13 rounds per engine.
    assert!((22..=26).contains(&rounds), "{rounds} rounds");
}

#[test]
fn a_peer_whose_heartbeat_returns_remote_disconnect_is_released() {
    let mut h = harness();
    let cell = h.live("p", at(1), 1);
    h.advance(Duration::from_secs(6));
    h.complete(NixlStatus::ERR_REMOTE_DISCONNECT);
    let events = h.events();
    assert!(events.iter().any(|e| matches!(e, Event::Unreachable { source: Source::Heartbeat, status, .. } if *status == NixlStatus::ERR_REMOTE_DISCONNECT)));
    assert_eq!(cell.state(), EngineState::Released);
    assert_eq!(h.released(), vec![1]);
    let events = h.events();
    assert!(events.iter().any(|e| matches!(
        e,
        Event::Released {
            reason: ReleaseReason::Unreachable,
            ..
        }
    )));
}

/// The core counts through actions (the driver records them): per
/// heartbeat numbers summed into one count per batch, the rest one by one,
/// the gauges on their own timer; and the runtime's handles hear of failed
/// reads and a finished release only through actions, in order before the
/// events that say so.
#[test]
fn counts_and_handle_signals_come_out_as_actions_in_order() {
    let mut config = config();
    config.metrics_period = Some(Duration::from_secs(10));
    let mut h = harness_with(config);
    let cells: Vec<_> = (1..=3)
        .map(|n| h.live(&format!("p{n}"), at(n), u32::from(n)))
        .collect();
    h.advance(Duration::from_secs(6));
    // One batch of results, as the driver takes them in before it carries
    // out what the core decided.
    for call in h.calls() {
        let Call::Heartbeat { key, agents, .. } = call else {
            panic!("only heartbeats are due");
        };
        let results = RoundResults {
            sent: 1,
            ..RoundResults::default()
        };
        h.core.handle(
            h.now,
            Input::CallDone(CallOutcome::Heartbeat {
                key,
                results,
                agents,
            }),
        );
    }
    h.collect();
    let sent: Vec<_> = h
        .counts
        .drain(..)
        .filter(|c| matches!(c, Count::HeartbeatsSent(_)))
        .collect();
    assert_eq!(
        sent,
        vec![Count::HeartbeatsSent(3)],
        "one summed count for the batch"
    );

    cells[0].begin_read().unwrap();
    h.advance(Duration::from_secs(5));
    let mut saw_census = false;
    for c in h.counts.drain(..) {
        if let Count::Census { by_state, reads } = c {
            assert_eq!(by_state[EngineState::Live as usize], 3);
            assert_eq!(reads, 1);
            saw_census = true;
        }
    }
    assert!(saw_census, "the census timer fired at 10 s");

    h.complete(NixlStatus::SUCCESS);
    h.take();
    h.transfer(&cells[0], NixlStatus::ERR_REMOTE_DISCONNECT);
    assert!(
        cells[0].reads_failed().is_set(),
        "carried out like the driver"
    );
    assert!(h.counts.contains(&Count::StatusError {
        source: Source::Transfer,
        status: NixlStatus::ERR_REMOTE_DISCONNECT,
    }));
    assert!(!cells[0].release_done().is_set(), "a read still holds it");
    h.end_read(&cells[0]);
    assert_eq!(h.released(), vec![1]);
    assert!(cells[0].release_done().is_set());
    assert!(h.counts.iter().any(|c| matches!(
        c,
        Count::Released {
            reason: ReleaseReason::Unreachable,
            ..
        }
    )));
}

#[test]
fn a_disconnected_engine_is_kept_while_a_read_is_in_flight_and_released_when_it_ends() {
    let mut h = harness();
    let cell = h.live("p", at(1), 1);
    cell.begin_read().unwrap();
    h.transfer(&cell, NixlStatus::ERR_REMOTE_DISCONNECT);
    assert_eq!(cell.state(), EngineState::Unreachable);
    assert!(cell.reads_failed().is_set(), "reads in flight are failed");
    assert!(h.released().is_empty(), "never with a read in flight");
    h.end_read(&cell);
    assert_eq!(h.released(), vec![1]);
}

#[test]
fn the_heartbeat_is_rate_limited_per_engine_with_renewals_deferred_not_lost() {
    let mut h = harness();
    let cell = h.live("p", at(1), 1);
    for _ in 0..5 {
        h.input(Input::AddLeases {
            engine: id("p"),
            requests: vec![],
            renew_now: true,
        });
        h.complete(NixlStatus::SUCCESS);
    }
    // Burst 2, then the cap: 2 rounds now, the third waits.
    h.take();
    assert!(cell.state() == EngineState::Live);
    h.advance(Duration::from_millis(999));
    let (_, rounds) = h.complete(NixlStatus::SUCCESS);
    assert_eq!(rounds, 0, "nothing before the cap allows");
    h.advance(Duration::from_millis(20));
    let (_, rounds) = h.complete(NixlStatus::SUCCESS);
    assert_eq!(rounds, 1, "the deferred renewal goes out once");
}

#[test]
fn errors_that_are_not_disconnects_are_counted_and_never_release() {
    let mut h = harness();
    let cell = h.live("p", at(1), 1);
    for status in [
        NixlStatus::ERR_BACKEND,
        NixlStatus::ERR_NOT_ALLOWED,
        NixlStatus::ERR_CANCELED,
    ] {
        h.transfer(&cell, status);
        h.advance(Duration::from_secs(6));
        h.complete(status);
    }
    assert_eq!(cell.state(), EngineState::Live);
    let transient = h
        .events()
        .into_iter()
        .filter(|e| matches!(e, Event::TransientError { .. }))
        .count();
    assert!(transient >= 6, "{transient}");
}

/// Rounds go to the slot nearest their deadline: consecutive rounds of an
/// engine are an interval apart give or take the jitter and half a slot,
/// and on average exactly an interval (rounding up added half a slot to
/// every round).
#[test]
fn each_round_is_served_within_half_a_slot_of_its_deadline_and_the_schedule_does_not_drift() {
    // Off the slot grid, so that rounding up would show.
    let interval = Duration::from_millis(1003);
    let jitter = Duration::from_millis(105);
    let mut h = harness_with(
        Config::builder()
            .heartbeat_interval(Some(interval))
            .jitter(jitter)
            .rate_limit(Duration::from_millis(100), 2)
            .metrics_period(None)
            .build()
            .unwrap(),
    );
    h.live("p", at(1), 1);
    let mut sent = Vec::new();
    while sent.len() < 3001 {
        let due = h.core.poll_timeout().expect("a round is scheduled");
        h.advance(due - h.now);
        if h.complete(NixlStatus::SUCCESS).1 > 0 {
            sent.push(h.now);
        }
    }
    let half = HEARTBEAT_SLOT / 2;
    let gaps: Vec<Duration> = sent.windows(2).map(|w| w[1] - w[0]).collect();
    for gap in &gaps {
        assert!(
            *gap + jitter + half >= interval && *gap <= interval + jitter + half,
            "a gap of {gap:?}"
        );
    }
    // Rounding up would add 10 ms to the mean; the jitter's own spread
    // over 3,000 rounds is about 1 ms.
    let mean = gaps.iter().sum::<Duration>() / gaps.len() as u32;
    assert!(
        mean.abs_diff(interval) <= Duration::from_millis(4),
        "mean gap {mean:?}"
    );
}

/// At the shortest interval the slot is half of it: rounds keep their
/// interval, and a round that does not come back is not retried in a loop
/// (a round put off goes to the next boundary, never one already due).
#[test]
fn the_shortest_interval_keeps_its_rounds_and_a_hung_round_does_not_spin() {
    let config = || {
        Config::builder()
            .heartbeat_interval(Some(crate::config::MIN_PERIOD))
            .jitter(Duration::from_millis(1))
            .rate_limit(crate::config::MIN_PERIOD, 2)
            .metrics_period(None)
            .build()
            .unwrap()
    };
    let mut h = harness_with(config());
    h.live("p", at(1), 1);
    let mut rounds = 0;
    for _ in 0..1000 {
        h.advance(Duration::from_millis(1));
        rounds += h.complete(NixlStatus::SUCCESS).1;
    }
    // 1 s at one round per 10 ms (+/- 1 ms), each in a 5 ms slot.
    assert!((95..=105).contains(&rounds), "{rounds} rounds");

    let mut h = harness_with(config());
    h.live("p", at(1), 1);
    h.advance(SECOND);
    assert_eq!(h.calls().len(), 1, "one round, hung");
}

#[test]
fn a_heartbeat_round_never_stacks_on_one_that_has_not_come_back() {
    let mut h = harness();
    h.live("p", at(1), 1);
    h.advance(Duration::from_secs(6));
    assert_eq!(h.calls().len(), 1);
    // The call hangs: 30 s later still no second round.
    h.advance(Duration::from_secs(30));
    assert!(h.calls().is_empty());
}

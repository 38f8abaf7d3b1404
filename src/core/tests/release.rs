//! The release rules: when a marked engine's state may go, what holds it,
//! what the release says of its connections; shutdown and timers.

use super::*;

// ----- release rules -----

#[test]
fn a_replaced_engine_is_released_only_after_its_reads_and_pending_handshakes_end() {
    let mut h = harness();
    let old = h.live("old", at(1), 1);
    old.begin_read().unwrap();
    let other = h.handshake(at(1));
    h.register_with(None, registration("new", at(1), 2));
    assert_eq!(old.state(), EngineState::Replaced);
    assert!(h
        .events()
        .iter()
        .any(|e| matches!(e, Event::Replaced { old: o, new: n, .. } if *o == id("old") && *n == id("new"))));
    h.end_read(&old);
    assert!(
        h.released().is_empty(),
        "a handshake is pending at the address"
    );
    h.input(Input::HandshakeFinished { ticket: other });
    assert_eq!(h.released(), vec![1]);
    match &h.events()[..] {
        [Event::Released {
            reason: ReleaseReason::Replaced,
            waited_for,
            ..
        }, ..] => {
            assert!(waited_for.handshake);
            assert_eq!(waited_for.reads_in_flight_at_mark, 1);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn handshakes_begun_after_the_mark_never_hold_the_release() {
    // Two staggered loops of handshakes at a frozen prefill's address,
    // as a decoder re-handshaking on `ReadRefused` makes: only the one
    // open at the mark holds the release, however long the loops run.
    let mut h = harness();
    let frozen = h.live("frozen", at(1), 1);
    let before = h.handshake(at(1));
    h.input(Input::PeerGone {
        peer: PeerRef::Engine(id("frozen")),
        mode: GoneMode::Fail,
    });
    assert_eq!(frozen.state(), EngineState::Retiring);
    let mut open = vec![h.handshake(at(1))];
    for _ in 0..5 {
        open.push(h.handshake(at(1)));
        let oldest = open.remove(0);
        h.finish(oldest);
        assert!(
            h.released().is_empty(),
            "the handshake open at the mark still holds it"
        );
    }
    h.finish(before);
    assert_eq!(
        h.released(),
        vec![1],
        "released once the last handshake begun before the mark ended, with {} later ones open",
        open.len()
    );
    match &h.events()[..] {
        [.., Event::Released { waited_for, .. }] => assert!(waited_for.handshake),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_mark_with_only_later_handshakes_open_is_released_at_once() {
    let mut h = harness();
    let _frozen = h.live("frozen", at(1), 1);
    h.input(Input::PeerGone {
        peer: PeerRef::Engine(id("frozen")),
        mode: GoneMode::Drain,
    });
    assert_eq!(h.released(), vec![1]);
    // And the other way round: marked while idle, a handshake begun
    // after the mark at the same address does not bring the hold back.
    let _second = h.live("second", at(2), 2);
    let later = h.handshake(at(2));
    h.input(Input::PeerGone {
        peer: PeerRef::Address(at(2)),
        mode: GoneMode::Drain,
    });
    assert!(
        h.released().is_empty(),
        "a handshake open at the mark holds it (it may find the engine new)"
    );
    let after = h.handshake(at(2));
    h.finish(later);
    assert_eq!(
        h.released(),
        vec![2],
        "the later handshake does not hold it"
    );
    h.finish(after);
}

#[test]
fn a_registration_without_a_handshake_of_a_held_id_is_refused_and_handed_back() {
    let mut h = harness();
    let first = h.live("p", at(1), 1);
    first.begin_read().unwrap();
    let (request, _) = h.register_with(None, registration("p", at(1), 2));
    match h.answer(request) {
        Some(Answer::Refused(RegisterError::Conflict {
            registration,
            conflict: Conflict::EngineInUse { engine, .. },
        })) => {
            assert_eq!(engine, id("p"));
            assert_eq!(registration.resources, 2, "handed back whole");
        }
        other => panic!("{}", describe(&other)),
    }
    assert_eq!(
        first.state(),
        EngineState::Live,
        "the registered one is kept"
    );
}

#[test]
fn peer_gone_drains_reads_or_fails_them_and_ignores_unknown_peers() {
    let mut h = harness();
    let a = h.live("a", at(1), 1);
    let b = h.live("b", at(2), 2);
    a.begin_read().unwrap();
    b.begin_read().unwrap();
    h.input(Input::PeerGone {
        peer: PeerRef::Engine(id("nobody")),
        mode: GoneMode::Fail,
    });
    h.input(Input::PeerGone {
        peer: PeerRef::Engine(id("a")),
        mode: GoneMode::Drain,
    });
    h.input(Input::PeerGone {
        peer: PeerRef::Address(at(2)),
        mode: GoneMode::Fail,
    });
    assert_eq!(a.state(), EngineState::Retiring);
    assert!(!a.reads_failed().is_set(), "drain lets reads finish");
    assert!(b.reads_failed().is_set(), "fail fails them at once");
    // Idempotent: the same again changes nothing; fail after drain fails.
    h.input(Input::PeerGone {
        peer: PeerRef::Engine(id("a")),
        mode: GoneMode::Fail,
    });
    assert!(a.reads_failed().is_set());
    assert!(h.released().is_empty());
    h.end_read(&a);
    h.end_read(&b);
    let mut released = h.released();
    released.sort();
    assert_eq!(released, vec![1, 2]);
    let retiring = h
        .events()
        .into_iter()
        .filter(|e| matches!(e, Event::Retiring { .. }))
        .count();
    assert_eq!(retiring, 2, "one event per engine");
}

#[test]
fn a_release_may_cut_connections_only_when_every_transfer_ended_here_with_success() {
    let mut h = harness();
    let settled = h.live("settled", at(1), 1);
    let given_up = h.live("given-up", at(2), 2);
    let failed = h.live("failed", at(3), 3);
    let idle = h.live("idle", at(4), 4);
    // settled: two reads, both ended with SUCCESS.
    for _ in 0..2 {
        settled.begin_read().unwrap();
        h.end_read(&settled);
    }
    // given-up: one completes, the next is given up (the peer may still
    // be sending it), answered or not.
    given_up.begin_read().unwrap();
    h.end_read(&given_up);
    let begun = given_up.begin_read().unwrap();
    let token = h.give_up(&given_up, GiveUp::Cancelled, begun);
    h.end_given_up(&given_up, begun, token, false);
    // failed: a read that ended with an error that is not a disconnect
    // (the engine stays live).
    failed.begin_read().unwrap();
    h.transfer(&failed, NixlStatus::ERR_BACKEND);
    h.end_read(&failed);
    assert_eq!(failed.state(), EngineState::Live);
    for engine in ["settled", "given-up", "failed", "idle"] {
        h.input(Input::PeerGone {
            peer: PeerRef::Engine(id(engine)),
            mode: GoneMode::Drain,
        });
    }
    let _ = h.released();
    let mut said = std::mem::take(&mut h.release_transfers);
    said.sort_by_key(|(r, _)| *r);
    assert_eq!(
        said,
        vec![
            (1, Transfers::Ended),
            (2, Transfers::MayBeRunning),
            (3, Transfers::MayBeRunning),
            (4, Transfers::Ended),
        ]
    );
    // A new registration of an id starts with nothing given up.
    let again = h.live("given-up", at(2), 5);
    again.begin_read().unwrap();
    h.end_read(&again);
    h.input(Input::PeerGone {
        peer: PeerRef::Engine(id("given-up")),
        mode: GoneMode::Drain,
    });
    let _ = h.released();
    assert_eq!(h.release_transfers, vec![(5, Transfers::Ended)]);
    drop((settled, given_up, failed, idle));
}

#[test]
fn ten_thousand_engines_that_left_give_their_tables_back() {
    // Issue 30, item 10d: after 10,000 members joined and left, the core's
    // tables still had room for 10,000.
    let mut h = harness();
    let address = |n: u32| {
        PeerAddr::new(format!(
            "10.{}.{}.{}:5600",
            n >> 16,
            (n >> 8) & 255,
            n & 255
        ))
    };
    let mut cells = Vec::new();
    for n in 0..10_000u32 {
        cells.push(h.connect(&format!("e{n}"), address(n), n));
        h.take();
    }
    let full = h.core.footprint();
    assert!(full.iter().any(|&(_, c)| c >= 10_000), "{full:?}");
    // All leave but the first three.
    for n in 3..10_000u32 {
        h.input(Input::PeerGone {
            peer: PeerRef::Engine(id(&format!("e{n}"))),
            mode: GoneMode::Drain,
        });
    }
    assert_eq!(h.released().len(), 9_997);
    for (table, slots) in h.core.footprint() {
        assert!(
            slots <= 256,
            "{table} keeps {slots} slots for 3 engines (full: {full:?})"
        );
    }
    // The three that stayed are whole.
    for cell in &cells[..3] {
        assert!(h.core.peers.contains_key(&cell.serial()));
        assert_eq!(cell.state(), EngineState::Live);
    }
}

#[test]
fn a_read_given_up_after_the_mark_still_keeps_the_connections() {
    let mut h = harness();
    let cell = h.live("a", at(1), 1);
    let begun = cell.begin_read().unwrap();
    h.input(Input::PeerGone {
        peer: PeerRef::Engine(id("a")),
        mode: GoneMode::Drain,
    });
    assert!(
        h.released().is_empty(),
        "a read in flight holds the release"
    );
    let token = h.give_up(&cell, GiveUp::TimedOut, begun);
    assert!(
        h.released().is_empty(),
        "a given-up transfer still fences it"
    );
    h.end_given_up(&cell, begun, token, false);
    assert_eq!(h.released(), vec![1]);
    assert_eq!(h.release_transfers, vec![(1, Transfers::MayBeRunning)]);
}

#[test]
fn given_up_transfers_fence_their_engine_are_in_its_snapshot_and_counted_once() {
    let mut h = harness();
    let cell = h.live("frozen", at(1), 1);
    let other = h.live("other", at(2), 2);
    let a = cell.begin_read().unwrap();
    let b = cell.begin_read().unwrap();
    let c = other.begin_read().unwrap();
    let ta = cell.give_up(GiveUp::TimedOut, a, 4);
    h.deliver();
    h.advance(Duration::from_secs(2));
    let tb = cell.give_up(GiveUp::Cancelled, b, 2);
    let tc = other.give_up(GiveUp::Cancelled, c, 1);
    h.deliver();
    let counts = std::mem::take(&mut h.counts);
    assert!(
        counts.contains(&Count::GivenUpHeld {
            transfers: 3,
            blocks: 7
        }),
        "{counts:?}"
    );
    let snap = h.core.snapshot(h.now);
    let frozen = snap
        .engines
        .iter()
        .find(|e| e.engine == id("frozen"))
        .unwrap();
    assert_eq!(frozen.reads_in_flight, 2);
    assert_eq!(frozen.given_up.len(), 2);
    assert_eq!(frozen.given_up[0].blocks, 4, "oldest first");
    assert_eq!(frozen.given_up[0].held_for, Duration::from_secs(2));
    assert_eq!(frozen.given_up[1].held_for, Duration::ZERO);
    // Retired by the router: fenced, and the snapshot says by what.
    h.input(Input::PeerGone {
        peer: PeerRef::Engine(id("frozen")),
        mode: GoneMode::Drain,
    });
    assert!(h.released().is_empty());
    let why = &h.core.snapshot(h.now).engines[0].why;
    assert!(why.contains("2 given-up transfer(s) to end"), "{why}");
    // One ends (the prefill resumed), twice: counted once.
    h.advance(Duration::from_secs(1));
    cell.end_given_up(a, ta, true, true);
    h.deliver();
    let counts = std::mem::take(&mut h.counts);
    assert!(counts.contains(&Count::GivenUpEnded {
        over: true,
        held_for: Duration::from_secs(3)
    }));
    assert!(counts.contains(&Count::GivenUpHeld {
        transfers: 2,
        blocks: 3
    }));
    assert!(h.released().is_empty(), "the other still runs");
    cell.end_given_up(b, tb, false, false);
    h.deliver();
    assert_eq!(h.released(), vec![1]);
    // The other engine's given-up transfer is untouched by all this.
    assert_eq!(other.state(), EngineState::Live);
    assert_eq!(other.reads_in_flight(), 1);
    other.end_given_up(c, tc, true, true);
    h.deliver();
    assert_eq!(other.reads_in_flight(), 0);
    assert!(std::mem::take(&mut h.counts).contains(&Count::GivenUpHeld {
        transfers: 0,
        blocks: 0
    }));
}

#[test]
fn agent_names_are_unique_over_engines_and_ranks() {
    let mut h = harness();
    h.live("victim", at(1), 1);
    let mut hostile = registration("hostile", at(2), 2);
    hostile.agents = vec![AgentName::from("victim-rank0")];
    let (request, _) = h.register_with(None, hostile);
    match h.answer(request) {
        Some(Answer::Refused(RegisterError::Conflict {
            registration,
            conflict: Conflict::AgentInUse { agent, holder, .. },
        })) => {
            assert_eq!(agent.as_str(), "victim-rank0");
            assert_eq!(holder, id("victim"));
            assert_eq!(registration.resources, 2, "handed back whole");
        }
        other => panic!("{}", describe(&other)),
    }
    let mut twice = registration("twice", at(3), 3);
    twice.agents = vec![AgentName::from("x"), AgentName::from("x")];
    let (request, _) = h.register_with(None, twice);
    assert!(matches!(
        h.answer(request),
        Some(Answer::Refused(RegisterError::Invalid { .. }))
    ));
    let mut forged = registration("p\nevent: released engine=victim", at(4), 4);
    forged.agents = vec![AgentName::from("forged")];
    let (request, _) = h.register_with(None, forged);
    match h.answer(request) {
        Some(Answer::Refused(RegisterError::Invalid { reason, .. })) => {
            assert!(reason.contains("control character"), "{reason}")
        }
        other => panic!("{}", describe(&other)),
    }
}

#[test]
fn a_registration_through_a_handshake_must_be_what_it_claimed_at_its_address() {
    let mut h = harness();
    let healthy = h.live("q", at(2), 9);
    let ticket = h.handshake(at(1));
    let request = h.claim(ticket, claim("p", 1));
    assert!(h.answered_load(request));
    // The same engine, but naming another address (where a healthy engine
    // lives): refused, and the healthy engine is not replaced.
    let (request, _) = h.register_with(Some(ticket), registration("p", at(2), 1));
    assert!(matches!(
        h.answer(request),
        Some(Answer::Refused(RegisterError::Invalid { .. }))
    ));
    assert_eq!(healthy.state(), EngineState::Live);
    assert!(h
        .events()
        .iter()
        .all(|e| !matches!(e, Event::Replaced { .. })));
    h.assert_no_ticket_state();
}

#[test]
fn a_release_that_panics_is_reported_as_a_panic_and_the_id_is_free_again() {
    let mut h = harness();
    let cell = h.live("p", at(1), 1);
    let ticket = h.handshake(at(1));
    let request = h.claim(ticket, claim("p", 2));
    assert_eq!(cell.state(), EngineState::Released);
    let serial = match h.calls().pop() {
        Some(Call::Release { serial, .. }) => serial,
        _ => panic!("released"),
    };
    h.input(Input::CallDone(CallOutcome::Release {
        serial,
        steps: Err(Panicked {
            message: "boom".into(),
        }),
    }));
    let events = h.events();
    assert!(events.iter().any(|e| matches!(e, Event::TransportPanicked { call: "release", message, .. } if message == "boom")));
    assert!(events.iter().any(|e| matches!(
        e,
        Event::Released {
            panicked: true,
            failed_steps: 0,
            ..
        }
    )));
    assert!(h.answered_load(request));
    assert!(h.core.snapshot(h.now).engines.is_empty());
}

// ----- shutdown and timers -----

#[test]
fn shutdown_releases_idle_engines_waits_for_reads_and_refuses_handshakes() {
    let mut h = harness();
    let idle = h.live("idle", at(1), 1);
    let busy = h.live("busy", at(2), 2);
    busy.begin_read().unwrap();
    let ticket = h.handshake(at(2));
    h.input(Input::Shutdown);
    assert_eq!(idle.state(), EngineState::Released);
    assert_eq!(h.released(), vec![1]);
    let request = h.claim(ticket, claim("x", 1));
    assert!(matches!(
        h.answer(request),
        Some(Answer::ClaimRefused(ClaimRefused::Stopped(_)))
    ));
    assert!(!h.core.is_stopped(h.now));
    h.advance(Duration::from_secs(1));
    // The read ends within the drain: released even with a handshake open.
    h.end_read(&busy);
    assert_eq!(h.released(), vec![2]);
    assert!(h.core.is_stopped(h.now));
    let (unreleased, unfinished) = h.core.into_unreleased();
    assert!(unreleased.is_empty() && unfinished.is_empty());
}

#[test]
fn a_marked_engine_leaves_the_schedule_and_the_next_deadline_follows() {
    let mut config = config();
    config.read_stall = None;
    let mut h = harness_with(config);
    let p = h.live("p", at(1), 1);
    let first = h.core.poll_timeout().expect("scheduled");
    assert!(first <= h.now + Duration::from_secs(5));
    assert_eq!(h.core.snapshot(h.now).heartbeat_timers, 1);
    h.input(Input::PeerGone {
        peer: PeerRef::Engine(p.id().clone()),
        mode: GoneMode::Drain,
    });
    assert_eq!(h.core.snapshot(h.now).heartbeat_timers, 0);
    assert_eq!(h.core.poll_timeout(), None, "nothing left to time");
}

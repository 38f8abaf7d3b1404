//! Identity: one prefill, one identity (issue 14), and the defects of
//! issue 8 that were races between handshakes and releases.

use super::*;

// ----- the four defects of issue 8 -----

#[test]
fn reconnecting_to_a_pinned_id_marked_unreachable_under_our_own_handshake_does_not_deadlock() {
    let mut h = harness();
    let cell = h.live("p", at(1), 1);
    cell.begin_read().unwrap();
    cell.begin_read().unwrap();
    // One read ends with REMOTE_DISCONNECT: marked unreachable.
    h.transfer(&cell, NixlStatus::ERR_REMOTE_DISCONNECT);
    h.end_read(&cell);
    // The runtime starts its reconnect; then the last read ends. A
    // handshake begun after the mark does not hold the release.
    let ticket = h.handshake(at(1));
    h.end_read(&cell);
    assert_eq!(h.released(), vec![1]);
    // The handshake finds the same id: loaded again, after the release.
    let request = h.claim(ticket, claim("p", 2));
    assert!(h.answered_load(request));
    let (request, _) = h.register_with(Some(ticket), registration("p", at(1), 2));
    assert!(h.registered(request));
    assert!(h.core.snapshot(h.now).handshakes_pending.is_empty());
    h.assert_no_ticket_state();
}

#[test]
fn shutdown_refuses_waiting_claims_and_hands_back_each_unreleased_once() {
    let mut h = harness();
    let first = h.live("p", at(1), 1);
    first.begin_read().unwrap();
    let busy = h.live("busy", at(2), 3);
    busy.begin_read().unwrap();
    // A restart of p waits for the old registration's reads.
    let ticket = h.handshake(at(1));
    let waiting = h.claim(ticket, claim("p", 2));
    assert!(h.answer(waiting).is_none(), "waits for the old release");
    h.input(Input::Shutdown);
    assert!(matches!(
        h.answer(waiting),
        Some(Answer::ClaimRefused(ClaimRefused::Stopped(_)))
    ));
    h.end_read(&first);
    assert_eq!(h.released(), vec![1]);
    assert!(
        !h.has_action(|a| matches!(a, Action::Activated { .. })),
        "nothing activated"
    );
    // A registration after the stop began is refused too.
    let (request, _) = h.register_with(None, registration("late", at(3), 4));
    assert!(
        matches!(h.answer(request), Some(Answer::Refused(RegisterError::Stopped(r))) if r.resources == 4)
    );
    h.finish(ticket);
    assert!(!h.core.is_stopped(h.now), "a read is still in flight");
    h.advance(Duration::from_secs(5));
    assert!(h.core.is_stopped(h.now), "the drain deadline passed");
    let (unreleased, unfinished) = h.core.into_unreleased();
    let kept: Vec<Res> = unreleased.iter().map(|r| r.resources).collect();
    assert_eq!(kept, vec![3], "exactly the busy engine, once");
    assert!(unfinished.is_empty());
}

#[test]
fn a_load_granted_before_shutdown_is_taken_and_released_by_the_service_exactly_once() {
    let mut h = harness();
    let ticket = h.handshake(at(1));
    let request = h.claim(ticket, claim("p", 1));
    assert!(h.answered_load(request));
    h.input(Input::Shutdown);
    // Its metadata is loaded by now: the service takes it and gives it back.
    let (request, cell) = h.register_with(Some(ticket), registration("p", at(1), 1));
    assert!(h.registered(request));
    assert_eq!(h.released(), vec![1]);
    assert_eq!(cell.state(), EngineState::Released);
    assert!(h.core.is_stopped(h.now));
    let (unreleased, unfinished) = h.core.into_unreleased();
    assert!(unreleased.is_empty() && unfinished.is_empty());
}

#[test]
fn a_late_transfer_report_from_an_old_registration_never_touches_its_successor() {
    let mut h = harness();
    let old = h.live("p", at(1), 1);
    let ticket = h.handshake(at(1));
    let request = h.claim(ticket, claim("p", 2));
    assert_eq!(h.released(), vec![1]);
    assert!(h.answered_load(request));
    h.register_with(Some(ticket), registration("p", at(1), 2));
    h.take();
    // The old process's transfer reports a disconnect, late.
    h.transfer(&old, NixlStatus::ERR_REMOTE_DISCONNECT);
    let snapshot = h.core.snapshot(h.now);
    assert_eq!(snapshot.engines.len(), 1);
    assert_eq!(snapshot.engines[0].state, EngineState::Live);
    assert!(h.events().is_empty());
}

// ----- identity: one prefill, one identity (issue 14) -----

#[test]
fn not_found_for_a_live_engines_own_agent_releases_it_and_fails_its_reads() {
    let mut h = harness();
    let cell = h.live("p", at(1), 1);
    cell.begin_read().unwrap();
    h.transfer(&cell, NixlStatus::ERR_NOT_FOUND);
    assert_eq!(cell.state(), EngineState::Unreachable, "marked, never kept");
    assert!(cell.reads_failed().is_set());
    h.end_read(&cell);
    assert_eq!(h.released(), vec![1]);
    assert!(h.events().iter().any(|e| matches!(
        e,
        Event::Released {
            reason: ReleaseReason::MetadataLost,
            ..
        }
    )));
    // From a heartbeat too.
    let cell = h.live("q", at(2), 2);
    h.advance(Duration::from_secs(6));
    h.complete(NixlStatus::ERR_NOT_FOUND);
    assert_eq!(cell.state(), EngineState::Released);
}

#[test]
fn two_claims_of_one_engine_id_at_once_load_it_once_and_the_second_finds_it_registered() {
    let mut h = harness();
    let a = h.handshake(at(1));
    let b = h.handshake(at(1));
    let first = h.claim(a, claim("p", 1));
    let second = h.claim(b, claim("p", 1));
    assert!(h.answered_load(first));
    assert!(
        h.answer(second).is_none(),
        "one load per engine id: it waits"
    );
    let (request, cell) = h.register_with(Some(a), registration("p", at(1), 1));
    assert!(h.registered(request));
    // Same engine, same incarnation, same address: nothing to load.
    match h.answer(second) {
        Some(Answer::Current(c)) => assert_eq!(c.serial(), cell.serial()),
        other => panic!("{}", describe(&other)),
    }
    h.finish(b);
    h.advance(Duration::from_secs(30));
    h.complete(NixlStatus::SUCCESS);
    assert_eq!(
        cell.state(),
        EngineState::Live,
        "never marked, never released"
    );
    assert!(h.released().is_empty());
    h.assert_no_ticket_state();
}

#[test]
fn a_second_claim_waiting_on_a_dropped_load_is_granted_and_nothing_of_the_first_stays() {
    let mut h = harness();
    let a = h.handshake(at(1));
    let b = h.handshake(at(1));
    let first = h.claim(a, claim("p", 1));
    let second = h.claim(b, claim("p", 1));
    assert!(h.answered_load(first));
    // The first handshake's future is dropped after its grant.
    h.finish(a);
    assert!(h.answered_load(second), "the id is free again");
    let (request, _) = h.register_with(Some(b), registration("p", at(1), 1));
    assert!(h.registered(request));
    h.assert_no_ticket_state();
}

#[test]
fn a_dropped_future_at_each_step_leaves_no_state_and_every_registration_ends_once() {
    let mut h = harness();
    let old = h.live("p", at(1), 1);
    old.begin_read().unwrap();
    // Started, then dropped.
    let t = h.handshake(at(1));
    h.finish(t);
    // Waiting behind the old registration's read, then dropped.
    let t = h.handshake(at(1));
    let waiting = h.claim(t, claim("p", 2));
    assert!(h.answer(waiting).is_none());
    h.finish(t);
    assert!(matches!(h.answer(waiting), Some(Answer::Withdrawn)));
    // Granted, then dropped before registering.
    h.end_read(&old);
    assert_eq!(h.released(), vec![1], "the old one was marked and goes");
    let t = h.handshake(at(1));
    let granted = h.claim(t, claim("p", 3));
    assert!(h.answered_load(granted));
    h.finish(t);
    h.assert_no_ticket_state();
    // A claim of a handshake already gone is withdrawn, not answered.
    let gone = h.claim(t, claim("p", 4));
    assert!(matches!(h.answer(gone), Some(Answer::Withdrawn)));
    // A fresh one registers; shutdown then releases it: each ended once.
    let cell = h.connect("p", at(1), 5);
    h.input(Input::Shutdown);
    assert_eq!(h.released(), vec![5]);
    assert_eq!(cell.state(), EngineState::Released);
    let (unreleased, unfinished) = h.core.into_unreleased();
    assert!(unreleased.is_empty() && unfinished.is_empty());
}

#[test]
fn a_reply_naming_another_engines_agent_is_refused_before_any_load_and_the_victim_stays_live() {
    let mut h = harness();
    let victim = h.connect("victim", at(1), 1);
    let t = h.handshake(at(2));
    let request = h.claim(
        t,
        Claim {
            engine: id("hostile"),
            incarnation: Some(Incarnation(7)),
            agents: agents("victim"),
        },
    );
    let conflict = h.refused_conflict(request);
    assert_eq!(
        conflict,
        Conflict::AgentInUse {
            agent: AgentName::from("victim-rank0"),
            claimed_by: id("hostile"),
            holder: id("victim"),
        }
    );
    h.finish(t);
    assert!(h.released().is_empty(), "nothing invalidated");
    assert_eq!(victim.state(), EngineState::Live);
    h.advance(Duration::from_secs(6));
    assert_eq!(h.complete(NixlStatus::SUCCESS).1, 1, "still heartbeated");
    h.assert_no_ticket_state();
}

#[test]
fn a_replayed_reply_at_another_address_is_refused_and_the_engine_stays_live() {
    let mut h = harness();
    let healthy = h.connect("p", at(1), 1);
    // Same engine id, incarnation and agents, from another address.
    let t = h.handshake(at(2));
    let request = h.claim(t, claim("p", 1));
    assert_eq!(
        h.refused_conflict(request),
        Conflict::EngineElsewhere {
            engine: id("p"),
            address: at(2),
            live_at: at(1),
        }
    );
    h.finish(t);
    // And a second prefill started with the same --engine-id elsewhere.
    let t = h.handshake(at(3));
    let request = h.claim(t, claim("p", 99));
    assert!(matches!(
        h.refused_conflict(request),
        Conflict::EngineElsewhere { .. }
    ));
    h.finish(t);
    assert_eq!(healthy.state(), EngineState::Live);
    assert!(h.released().is_empty());
    h.assert_no_ticket_state();
}

#[test]
fn a_new_incarnation_at_the_engines_own_address_is_a_restart_released_before_it_loads() {
    let mut h = harness();
    let old = h.connect("p", at(1), 1);
    old.begin_read().unwrap();
    let t = h.handshake(at(1));
    let request = h.claim(t, claim("p", 2));
    assert_eq!(old.state(), EngineState::Replaced);
    assert!(h.answer(request).is_none(), "waits for the old reads");
    h.end_read(&old);
    assert_eq!(h.released(), vec![1]);
    assert!(h.answered_load(request));
}

#[test]
fn a_handshake_older_than_the_registration_cannot_retire_it_with_its_stale_reply() {
    let mut h = harness();
    // A slow handshake starts (its reply is of an older process)...
    let slow = h.handshake(at(1));
    // ...meanwhile another handshake registers the current process.
    let current = h.connect("p", at(1), 2);
    let request = h.claim(slow, claim("p", 1));
    assert!(matches!(
        h.refused_conflict(request),
        Conflict::StaleReply { .. }
    ));
    h.finish(slow);
    assert_eq!(current.state(), EngineState::Live);
    // A fresh handshake that finds another process is a restart.
    let fresh = h.handshake(at(1));
    h.claim(fresh, claim("p", 3));
    assert_eq!(current.state(), EngineState::Released);
}

#[test]
fn the_same_agents_under_another_incarnation_claimed_while_the_old_is_marked_wait_then_load() {
    let mut h = harness();
    let old = h.connect("p", at(1), 1);
    h.transfer(&old, NixlStatus::ERR_REMOTE_DISCONNECT);
    assert_eq!(h.released(), vec![1]);
    h.take();
    let cell = h.connect("p", at(1), 2);
    assert_eq!(cell.state(), EngineState::Live);
}

#[test]
fn the_same_incarnation_with_other_agents_is_a_conflict() {
    let mut h = harness();
    let healthy = h.connect("p", at(1), 1);
    let t = h.handshake(at(1));
    let mut c = claim("p", 1);
    c.agents = vec![AgentName::from("other")];
    let request = h.claim(t, c);
    assert!(matches!(
        h.refused_conflict(request),
        Conflict::AgentsChanged { .. }
    ));
    h.finish(t);
    assert_eq!(healthy.state(), EngineState::Live);
}

#[test]
fn an_extra_agent_name_is_granted_only_when_nobody_holds_it() {
    let mut h = harness();
    h.connect("victim", at(1), 1);
    let t = h.handshake(at(2));
    let request = h.claim(t, claim("p", 2));
    assert!(h.answered_load(request));
    let request = RequestId(h.next_id());
    h.input(Input::ClaimAgent {
        ticket: t,
        request,
        agent: AgentName::from("victim-rank0"),
    });
    assert!(matches!(
        h.answer(request),
        Some(Answer::AgentClaimed(Err(Conflict::AgentInUse { .. })))
    ));
    let request = RequestId(h.next_id());
    h.input(Input::ClaimAgent {
        ticket: t,
        request,
        agent: AgentName::from("stray"),
    });
    assert!(matches!(
        h.answer(request),
        Some(Answer::AgentClaimed(Ok(())))
    ));
    // Held while loading: another claim of it is refused.
    let u = h.handshake(at(3));
    let request = h.claim(
        u,
        Claim {
            engine: id("r"),
            incarnation: None,
            agents: vec![AgentName::from("stray")],
        },
    );
    assert!(matches!(
        h.refused_conflict(request),
        Conflict::AgentInUse { .. }
    ));
    h.finish(u);
    h.finish(t);
    h.assert_no_ticket_state();
}

#[test]
fn a_conflict_is_published_once_and_counted_every_time() {
    let mut h = harness();
    h.connect("p", at(1), 1);
    h.events();
    for _ in 0..5 {
        let t = h.handshake(at(2));
        let request = h.claim(t, claim("p", 1));
        h.refused_conflict(request);
        h.finish(t);
    }
    let published = h
        .events()
        .into_iter()
        .filter(|e| matches!(e, Event::Conflict { .. }))
        .count();
    assert_eq!(published, 1);
    assert_eq!(h.core.conflicts.sightings(), 5);
}

#[test]
fn membership_retires_an_engine_only_with_its_own_record() {
    let mut h = harness();
    let cell = h.connect("p", at(1), 1);
    let gone = |engine: &str, incarnation: u64, address: PeerAddr| Input::MemberGone {
        departure: Departure {
            engine: id(engine),
            incarnation: Some(Incarnation(incarnation)),
            address,
        },
        mode: GoneMode::Drain,
    };
    // A dead predecessor's record expiring late.
    h.input(gone("p", 0, at(1)));
    // A record of the same id at another address.
    h.input(gone("p", 1, at(2)));
    // A record of an engine not registered.
    h.input(gone("nobody", 1, at(1)));
    assert_eq!(cell.state(), EngineState::Live);
    let conflicts: Vec<&'static str> = h
        .events()
        .iter()
        .filter_map(|e| match e {
            Event::Conflict { conflict } => Some(conflict.kind()),
            _ => None,
        })
        .collect();
    assert_eq!(conflicts, vec!["record_incarnation", "record_address"]);
    // Its own record: retired. A record without an incarnation that
    // matches the address counts as its own.
    h.input(gone("p", 1, at(1)));
    assert_eq!(h.released(), vec![1]);
    let other = h.connect("q", at(3), 3);
    h.input(Input::MemberGone {
        departure: Departure {
            engine: id("q"),
            incarnation: None,
            address: at(3),
        },
        mode: GoneMode::Drain,
    });
    assert_eq!(other.state(), EngineState::Released);
}

#[test]
fn a_new_engine_id_at_an_address_replaces_only_through_a_registration_there() {
    let mut h = harness();
    let old = h.connect("old", at(1), 1);
    // A handshake at the address answers a new id: authoritative.
    h.connect("new", at(1), 2);
    assert_eq!(old.state(), EngineState::Released);
    assert_eq!(h.released(), vec![1]);
}

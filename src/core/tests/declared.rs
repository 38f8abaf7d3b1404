//! Declared addresses: a peer's own word of where it is (SGLang's decode
//! registers its `rank_ip:rank_port`) never retires the live engine there;
//! the holder is asked, and only its own answer releases it.

use super::*;

/// The heartbeat rounds decided since the last look (left for `complete`).
fn probes(h: &mut Harness) -> usize {
    let calls = h.calls();
    let rounds = calls
        .iter()
        .filter(|c| matches!(c, Call::Heartbeat { .. }))
        .count();
    h.calls = calls;
    rounds
}

fn address_in_use(conflict: &Conflict, holder: &str, claimed_by: &str) -> bool {
    matches!(conflict, Conflict::AddressInUse { holder: hd, claimed_by: c, address }
        if hd.as_str() == holder && c.as_str() == claimed_by && *address == at(1))
}

/// `engine` declares at(1), held by "decode-a": refused, the handshake ended.
fn refused_declaring(h: &mut Harness, engine: &str) {
    let t = h.handshake_declared(at(1));
    let request = h.claim(t, claim(engine, 2));
    let conflict = h.refused_conflict(request);
    assert!(
        address_in_use(&conflict, "decode-a", engine),
        "{conflict:?}"
    );
    h.finish(t);
}

#[test]
fn a_declaration_of_a_live_engines_address_is_refused_and_the_engine_is_asked_and_kept() {
    let mut h = harness();
    let healthy = h.connect("decode-a", at(1), 1);
    healthy.begin_read().unwrap();
    h.calls();
    let t = h.handshake_declared(at(1));
    let request = h.claim(t, claim("decode-b", 2));
    let conflict = h.refused_conflict(request);
    assert!(
        address_in_use(&conflict, "decode-a", "decode-b"),
        "{conflict:?}"
    );
    assert_eq!(probes(&mut h), 1, "the holder is heartbeated at once");
    // It answers: nothing changes for it.
    h.complete(NixlStatus::SUCCESS);
    h.finish(t);
    assert_eq!(healthy.state(), EngineState::Live);
    assert!(h.released().is_empty());
    let events = h.events();
    assert!(events.iter().any(|e| matches!(e, Event::Conflict { .. })));
    assert!(!events.iter().any(|e| matches!(e, Event::Replaced { .. })));
    h.assert_no_ticket_state();
    // The same declaration again: refused again, the holder asked again.
    refused_declaring(&mut h, "decode-b");
    assert_eq!(probes(&mut h), 1);
    assert_eq!(healthy.state(), EngineState::Live);
}

#[test]
fn a_holder_that_is_gone_answers_the_probe_with_a_disconnect_and_the_next_claim_is_granted() {
    let mut h = harness();
    let dead = h.connect("decode-a", at(1), 1);
    dead.begin_read().unwrap();
    h.calls();
    refused_declaring(&mut h, "decode-b");
    // The probe comes back REMOTE_DISCONNECT: marked, and released once
    // its read in flight ends, never before.
    h.complete(NixlStatus::ERR_REMOTE_DISCONNECT);
    assert_eq!(dead.state(), EngineState::Unreachable);
    assert!(h.released().is_empty(), "a read is in flight");
    h.end_read(&dead);
    assert_eq!(h.released(), vec![1]);
    assert_eq!(dead.state(), EngineState::Released);
    // The restarted decode's registration, tried again, goes through.
    let t = h.handshake_declared(at(1));
    let request = h.claim(t, claim("decode-b", 2));
    assert!(h.answered_load(request));
    let (request, new) = h.register_with(Some(t), registration("decode-b", at(1), 2));
    assert!(h.registered(request));
    assert_eq!(new.state(), EngineState::Live);
    assert!(!h
        .events()
        .iter()
        .any(|e| matches!(e, Event::Replaced { .. })));
    h.assert_no_ticket_state();
}

#[test]
fn two_declaring_one_free_address_at_once_the_second_registration_is_refused() {
    let mut h = harness();
    let first = h.handshake_declared(at(1));
    let second = h.handshake_declared(at(1));
    let a = h.claim(first, claim("decode-a", 1));
    let b = h.claim(second, claim("decode-b", 2));
    assert!(
        h.answered_load(a) && h.answered_load(b),
        "nobody holds the address yet"
    );
    let (request, cell_a) = h.register_with(Some(first), registration("decode-a", at(1), 1));
    assert!(h.registered(request));
    h.calls();
    let (request, _) = h.register_with(Some(second), registration("decode-b", at(1), 2));
    assert!(address_in_use(
        &h.refused_conflict(request),
        "decode-a",
        "decode-b"
    ));
    assert_eq!(probes(&mut h), 1);
    h.complete(NixlStatus::SUCCESS);
    assert_eq!(cell_a.state(), EngineState::Live);
    assert!(h.released().is_empty());
    h.assert_no_ticket_state();
}

#[test]
fn a_declaration_where_the_engine_is_already_being_released_is_granted() {
    let mut h = harness();
    let old = h.connect("decode-a", at(1), 1);
    old.begin_read().unwrap();
    h.transfer(&old, NixlStatus::ERR_REMOTE_DISCONNECT);
    assert_eq!(old.state(), EngineState::Unreachable);
    let t = h.handshake_declared(at(1));
    let request = h.claim(t, claim("decode-b", 2));
    assert!(
        h.answered_load(request),
        "the holder is not live: nothing to protect"
    );
    h.end_read(&old);
    assert_eq!(h.released(), vec![1]);
    let (request, _) = h.register_with(Some(t), registration("decode-b", at(1), 2));
    assert!(h.registered(request));
}

#[test]
fn an_address_the_runtime_reached_still_replaces_the_engine_there() {
    let mut h = harness();
    let old = h.connect("old", at(1), 1);
    h.connect("new", at(1), 2);
    assert_eq!(old.state(), EngineState::Released);
    assert_eq!(h.released(), vec![1]);
}

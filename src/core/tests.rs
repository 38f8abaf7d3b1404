//! The core's rules, one by one, driven step by step with a chosen `now`
//! and asserted on exactly the actions that come out (foca's
//! `AccumulatingRuntime` is the model): no tokio runtime, no channels, no
//! transport.

use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::SeedableRng;
use tokio::time::Instant;

use super::cell::tests::Collect;
use super::*;
use crate::event::{Event, ReleaseReason, Source};
use crate::give_up::GiveUp;
use crate::registration::{Departure, Incarnation};
use crate::state::EngineState;
use crate::transport::{ReleaseStep, ReleaseTarget, Transfers, TransportError};
use crate::NixlStatus;

type Res = u32;

const SECOND: Duration = Duration::from_secs(1);

/// The core, a clock we move by hand, and everything it has decided.
struct Harness {
    core: Core<Res>,
    now: Instant,
    sink: Arc<Collect>,
    actions: Vec<Action<Res>>,
    /// Transport calls decided, in order, not yet looked at.
    calls: Vec<Call<Res>>,
    /// What the core counted, in order (the driver records these).
    counts: Vec<Count>,
    /// What each release completed by [`Harness::complete`] said of the
    /// engine's transfers, in order.
    release_transfers: Vec<(Res, Transfers)>,
    next: u64,
}

fn config() -> Config {
    Config::builder()
        .heartbeat_interval(Some(Duration::from_secs(5)))
        .jitter(Duration::from_millis(500))
        .rate_limit(SECOND, 2)
        .metrics_period(None)
        .shutdown_drain(Duration::from_secs(5))
        .build()
        .unwrap()
}

fn harness_with(config: Config) -> Harness {
    let now = Instant::now();
    Harness {
        core: Core::new(config, now, StdRng::seed_from_u64(7)),
        now,
        sink: Arc::new(Collect::default()),
        actions: Vec::new(),
        calls: Vec::new(),
        counts: Vec::new(),
        release_transfers: Vec::new(),
        next: 0,
    }
}

fn harness() -> Harness {
    harness_with(config())
}

fn id(s: &str) -> EngineId {
    EngineId::from(s)
}

fn at(n: u8) -> PeerAddr {
    PeerAddr::new(format!("10.0.0.{n}:5600"))
}

/// An answer in words (answers hold registrations, which are not `Debug`
/// for every resource type).
fn describe(answer: &Option<Answer<Res>>) -> String {
    match answer {
        None => "no answer".into(),
        Some(Answer::Load) => "load".into(),
        Some(Answer::Current(c)) => format!("current {}", c.id()),
        Some(Answer::ClaimRefused(e)) => format!("claim refused: {e}"),
        Some(Answer::AgentClaimed(r)) => format!("agent claimed: {r:?}"),
        Some(Answer::Registered(c)) => format!("registered {}", c.id()),
        Some(Answer::Refused(e)) => format!("refused: {e}"),
        Some(Answer::Withdrawn) => "withdrawn".into(),
    }
}

fn agents(engine: &str) -> Vec<AgentName> {
    vec![AgentName::new(format!("{engine}-rank0"))]
}

/// A registration of `engine` whose incarnation is its resources' number
/// (a new registration of an id is a new process).
fn registration(engine: &str, address: PeerAddr, resources: Res) -> Registration<Res> {
    Registration {
        engine: id(engine),
        incarnation: Some(Incarnation(u64::from(resources))),
        address,
        agents: agents(engine),
        resources,
    }
}

fn claim(engine: &str, incarnation: u64) -> Claim {
    Claim {
        engine: id(engine),
        incarnation: Some(Incarnation(incarnation)),
        agents: agents(engine),
    }
}

impl Harness {
    fn input(&mut self, input: Input<Res>) {
        self.core.handle(self.now, input);
        self.collect();
    }

    /// Takes the core's actions as the driver does: what touches the
    /// runtime's handles is carried out at once, counts are kept apart,
    /// the rest is kept for the test to look at.
    fn collect(&mut self) {
        self.calls.extend(self.core.take_calls());
        while let Some(a) = self.core.poll_action() {
            match a {
                Action::FailReads { cell } => cell.fail_reads(),
                Action::ReleaseFinished {
                    cell,
                    transfers_ended,
                } => cell.release_finished(transfers_ended),
                Action::Count(count) => self.counts.push(count),
                // The offload's concern: the harness hands every result
                // over at once anyway.
                Action::Expedite { .. } => {}
                other => self.actions.push(other),
            }
        }
    }

    /// Moves the clock by `d`, serving every timer due on the way, as the
    /// driver does.
    fn advance(&mut self, d: Duration) {
        let end = self.now + d;
        while let Some(due) = self.core.poll_timeout().filter(|&t| t <= end) {
            self.now = self.now.max(due);
            self.core.handle_timeout(self.now);
            self.collect();
        }
        self.now = end;
    }

    fn take(&mut self) -> Vec<Action<Res>> {
        std::mem::take(&mut self.actions)
    }

    fn next_id(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    fn handshake(&mut self, address: PeerAddr) -> TicketId {
        let ticket = TicketId(self.next_id());
        self.input(Input::HandshakeStarted { ticket, address });
        ticket
    }

    /// The handshake `ticket` claims `claim`; returns the question's id.
    fn claim(&mut self, ticket: TicketId, claim: Claim) -> RequestId {
        let request = RequestId(self.next_id());
        self.input(Input::Claim {
            ticket,
            request,
            claim,
        });
        request
    }

    fn finish(&mut self, ticket: TicketId) {
        self.input(Input::HandshakeFinished { ticket });
    }

    /// Takes the answer to `request`, if the core has given it.
    fn answer(&mut self, request: RequestId) -> Option<Answer<Res>> {
        let i = self
            .actions
            .iter()
            .position(|a| matches!(a, Action::Answer { request: r, .. } if *r == request))?;
        match self.actions.remove(i) {
            Action::Answer { answer, .. } => Some(answer),
            _ => unreachable!(),
        }
    }

    fn answered_load(&mut self, request: RequestId) -> bool {
        matches!(self.answer(request), Some(Answer::Load))
    }

    fn refused_conflict(&mut self, request: RequestId) -> Conflict {
        match self.answer(request) {
            Some(Answer::ClaimRefused(ClaimRefused::Conflict(c))) => c,
            Some(Answer::Refused(RegisterError::Conflict { conflict, .. })) => conflict,
            other => panic!("expected a conflict, got {}", describe(&other)),
        }
    }

    /// Registers through `ticket` (or alone); returns the question's id
    /// and the cell.
    fn register_with(
        &mut self,
        ticket: Option<TicketId>,
        registration: Registration<Res>,
    ) -> (RequestId, Arc<EngineCell>) {
        let request = RequestId(self.next_id());
        let cell = EngineCell::new(registration.engine.clone(), self.sink.clone());
        self.input(Input::Register {
            request,
            ticket,
            registration,
            cell: cell.clone(),
        });
        (request, cell)
    }

    fn registered(&mut self, request: RequestId) -> bool {
        matches!(self.answer(request), Some(Answer::Registered(_)))
    }

    /// Registers alone and expects it activated; clears the actions.
    fn live(&mut self, engine: &str, address: PeerAddr, resources: Res) -> Arc<EngineCell> {
        let (request, cell) = self.register_with(None, registration(engine, address, resources));
        assert!(self.registered(request), "{engine} activated");
        self.take();
        cell
    }

    /// The full protocol: handshake at `address`, claim, load, register.
    fn connect(&mut self, engine: &str, address: PeerAddr, resources: Res) -> Arc<EngineCell> {
        let ticket = self.handshake(address.clone());
        let request = self.claim(ticket, claim(engine, u64::from(resources)));
        assert!(self.answered_load(request), "{engine} may load");
        let (request, cell) =
            self.register_with(Some(ticket), registration(engine, address, resources));
        assert!(self.registered(request), "{engine} registered");
        cell
    }

    /// Nothing per handshake is left once every handshake has ended.
    fn assert_no_ticket_state(&self) {
        assert!(self.core.tickets.is_empty(), "tickets left");
        assert!(self.core.waiting.is_empty(), "waiting claims left");
        assert!(self.core.loads.is_empty(), "loads left");
        assert!(self.core.handshakes.is_empty(), "handshake counts left");
        assert!(
            self.core
                .agents
                .values()
                .all(|h| matches!(h, Holder::Registration(_))),
            "agent names held by loads"
        );
    }

    /// The transport calls decided since the last take, and the rest kept.
    fn calls(&mut self) -> Vec<Call<Res>> {
        std::mem::take(&mut self.calls)
    }

    /// Completes every heartbeat call decided so far with `status` per
    /// agent, and every release with success. Returns the releases made
    /// (their resources) and the number of heartbeat rounds.
    fn complete(&mut self, status: NixlStatus) -> (Vec<Res>, usize) {
        let mut released = Vec::new();
        let mut rounds = 0;
        for call in self.calls() {
            match call {
                Call::Heartbeat { key, agents, .. } => {
                    rounds += 1;
                    let mut results = RoundResults::default();
                    for agent in agents.iter() {
                        if status.is_ok() {
                            results.sent += 1;
                        } else {
                            results
                                .failed
                                .push((agent.clone(), TransportError::new("genNotif", status)));
                        }
                    }
                    self.input(Input::CallDone(CallOutcome::Heartbeat {
                        key,
                        results,
                        agents,
                    }));
                }
                Call::Release {
                    serial,
                    resources,
                    transfers,
                    ..
                } => {
                    released.push(resources);
                    self.release_transfers.push((resources, transfers));
                    self.input(Input::CallDone(CallOutcome::Release {
                        serial,
                        steps: Ok(vec![ReleaseStep {
                            target: ReleaseTarget::DlistHandle(0),
                            status: NixlStatus::SUCCESS,
                        }]),
                    }));
                }
            }
        }
        (released, rounds)
    }

    /// Resources handed to the transport for release since the last take
    /// (completed at once).
    fn released(&mut self) -> Vec<Res> {
        self.complete(NixlStatus::SUCCESS).0
    }

    fn events(&mut self) -> Vec<Event> {
        let (events, rest): (Vec<_>, Vec<_>) = self
            .take()
            .into_iter()
            .partition(|a| matches!(a, Action::Emit(_)));
        self.actions = rest;
        events
            .into_iter()
            .map(|a| match a {
                Action::Emit(e) => e,
                _ => unreachable!(),
            })
            .collect()
    }

    fn has_action(&self, pick: impl Fn(&Action<Res>) -> bool) -> bool {
        self.actions.iter().any(pick)
    }

    fn transfer(&mut self, cell: &EngineCell, status: NixlStatus) {
        self.input(Input::Read(Wake::TransferResult(cell.serial(), status)));
    }

    /// Ends a read the way the guard does: the cell, then its wake-up.
    /// (Every read of these tests begins on the test's thread: its path
    /// is this thread's.)
    fn end_read(&mut self, cell: &EngineCell) {
        cell.end_read(cell.begun_here());
        self.deliver();
    }

    /// Gives a read up the way the guard does (`begun` is what its
    /// `begin_read` returned), then delivers the wake-ups.
    fn give_up(&mut self, cell: &EngineCell, why: GiveUp, begun: u64) {
        cell.give_up(why, begun);
        self.deliver();
    }

    /// Delivers the cells' wake-ups to the core.
    fn deliver(&mut self) {
        for wake in self.sink.take() {
            self.input(Input::Read(wake));
        }
    }
}

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
    h.give_up(&given_up, GiveUp::Cancelled, begun);
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
    h.give_up(&cell, GiveUp::TimedOut, begun);
    assert_eq!(h.released(), vec![1]);
    assert_eq!(h.release_transfers, vec![(1, Transfers::MayBeRunning)]);
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
    assert_eq!(h.core.conflicts.values().sum::<u64>(), 5);
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
fn complete_one(cell: &EngineCell) {
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
    watch: &EngineCell,
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
    h.give_up(&hung, GiveUp::TimedOut, begun);
    h.advance(Duration::ZERO);
    assert_eq!(hung.state(), EngineState::Stalled, "judged at once");
    assert!(hung.reads_failed().is_set(), "its other reads are failed");
    let events = stalled_events(&mut h);
    assert_eq!(events.len(), 1);
    let (engine, stalled_for, given_up) = &events[0];
    assert_eq!((engine, *given_up), (&id("hung"), 1));
    assert!(*stalled_for <= Duration::from_secs(5), "{stalled_for:?}");
    // The other read is given up too (the service failed it): released.
    h.give_up(&hung, GiveUp::Cancelled, second);
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
    h.give_up(&hung, GiveUp::TimedOut, begun);
    h.advance(Duration::ZERO);
    let stalled = stalled_events(&mut h);
    assert_eq!(stalled.len(), 1, "judged at once");
    assert_eq!(stalled[0].2, 1, "on the evidence of the one timed-out read");
    assert_eq!(h.released(), vec![1], "no read in flight: released at once");
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
    // Cancelled by the runtime: no verdict, and no read in flight any
    // more, but no completion either.
    h.give_up(&hung, GiveUp::Cancelled, begun);
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
    // Nothing in flight: released at once.
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
    h.give_up(&only, GiveUp::TimedOut, r);
    h.advance(Duration::ZERO);
    // Marked stalled and, nothing being in flight, handed to the release.
    assert_eq!(only.state(), EngineState::Released);
    assert_eq!(stalled_events(&mut h).len(), 1);
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
        h.give_up(&only, GiveUp::TimedOut, r);
        h.advance(Duration::ZERO);
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

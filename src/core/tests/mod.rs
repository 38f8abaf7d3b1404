//! The core's rules, one by one, driven step by step with a chosen `now`
//! and asserted on exactly the actions that come out (foca's
//! `AccumulatingRuntime` is the model): no tokio runtime, no channels, no
//! transport.

use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::SeedableRng;
use std::time::Instant;

use super::*;
use crate::event::{Event, ReleaseReason, Source};
use crate::give_up::GiveUp;
use crate::registration::{Departure, Incarnation};
use crate::state::EngineState;
use crate::transport::{ReleaseStep, ReleaseTarget, Transfers, TransportError};
use nixl_status::NixlStatus;
use plain::{PlainReads, Wakes};

type Res = u32;

/// The core under test: its reads counted by [`PlainReads`].
type Core = super::Core<Res, PlainReads>;
type Action = super::Action<Res, PlainReads>;
type Answer = super::Answer<Res, PlainReads>;
type Input = super::Input<Res, PlainReads>;

const SECOND: Duration = Duration::from_secs(1);

/// The core, a clock we move by hand, and everything it has decided.
struct Harness {
    core: Core,
    now: Instant,
    sink: Rc<Wakes>,
    actions: Vec<Action>,
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
        sink: Rc::new(Wakes::default()),
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
fn describe(answer: &Option<Answer>) -> String {
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
    fn input(&mut self, input: Input) {
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

    fn take(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.actions)
    }

    fn next_id(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    fn handshake(&mut self, address: PeerAddr) -> TicketId {
        self.start_handshake(address, false)
    }

    /// A handshake at an address the peer declares ([`Input::HandshakeStarted`]'s `declared`).
    fn handshake_declared(&mut self, address: PeerAddr) -> TicketId {
        self.start_handshake(address, true)
    }

    fn start_handshake(&mut self, address: PeerAddr, declared: bool) -> TicketId {
        let ticket = TicketId(self.next_id());
        self.input(Input::HandshakeStarted {
            ticket,
            address,
            declared,
        });
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
    fn answer(&mut self, request: RequestId) -> Option<Answer> {
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
    ) -> (RequestId, Arc<PlainReads>) {
        let request = RequestId(self.next_id());
        let cell = PlainReads::new(registration.engine.clone(), self.sink.clone());
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
    fn live(&mut self, engine: &str, address: PeerAddr, resources: Res) -> Arc<PlainReads> {
        let (request, cell) = self.register_with(None, registration(engine, address, resources));
        assert!(self.registered(request), "{engine} activated");
        self.take();
        cell
    }

    /// The full protocol: handshake at `address`, claim, load, register.
    fn connect(&mut self, engine: &str, address: PeerAddr, resources: Res) -> Arc<PlainReads> {
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
        let left = self.core.directory.ticket_state_left();
        assert!(left.is_empty(), "per-handshake state left: {left:?}");
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

    fn has_action(&self, pick: impl Fn(&Action) -> bool) -> bool {
        self.actions.iter().any(pick)
    }

    fn transfer(&mut self, cell: &PlainReads, status: NixlStatus) {
        self.input(Input::Read(Wake::TransferResult(cell.serial(), status)));
    }

    /// Ends a read the way the guard does: the cell, then its wake-up.
    /// (Every read of these tests begins on the test's thread: its path
    /// is this thread's.)
    fn end_read(&mut self, cell: &PlainReads) {
        cell.end_read(cell.begun_here());
        self.deliver();
    }

    /// Gives a read up the way the guard does (`begun` is what its
    /// `begin_read` returned), then delivers the wake-ups. Returns the
    /// give-up's token: the read still counts until it is ended.
    fn give_up(&mut self, cell: &PlainReads, why: GiveUp, begun: u64) -> u64 {
        let token = cell.give_up(why, begun, 0);
        self.deliver();
        token
    }

    /// Ends a given-up read the way `GivenUpRead` does: `over` when its
    /// transfer was seen to end (with `SUCCESS`: a completion), else
    /// abandoned.
    fn end_given_up(&mut self, cell: &PlainReads, begun: u64, token: u64, over: bool) {
        cell.end_given_up(begun, token, over, over);
        self.deliver();
    }

    /// Delivers the cells' wake-ups to the core.
    fn deliver(&mut self) {
        for wake in self.sink.take() {
            self.input(Input::Read(wake));
        }
    }
}

mod declared;
mod directory;
mod heartbeat;
mod identity;
mod plain;
mod release;
mod stall;

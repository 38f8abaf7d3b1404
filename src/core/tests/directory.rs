//! The identity tables alone (`directory.rs`'s `Directory`), without
//! a core: what each table operation leaves in the others.

use crate::core::directory::{Directory, Holder, Stage};
use crate::core::{RequestId, TicketId};
use crate::names::{AgentName, EngineId, PeerAddr};
use crate::registration::{Claim, RegistrationId};

fn at(n: u8) -> PeerAddr {
    PeerAddr::new(format!("10.0.0.{n}:5600"))
}

fn names(names: &[&str]) -> Vec<AgentName> {
    names.iter().map(|&n| AgentName::from(n)).collect()
}

fn claim(engine: &str, agents: &[&str]) -> Claim {
    Claim {
        engine: EngineId::from(engine),
        incarnation: None,
        agents: names(agents),
    }
}

const ONE: RegistrationId = RegistrationId(1);
const TWO: RegistrationId = RegistrationId(2);

#[test]
fn forgetting_frees_the_id_only_while_the_serial_still_holds_it() {
    let mut d = Directory::default();
    let e = EngineId::from("p");
    d.activate(ONE, &e, &at(1), &names(&["p0"]));
    d.activate(TWO, &e, &at(2), &names(&["p1"]));
    assert!(
        !d.forget(ONE, &e, &at(1), &names(&["p0"])),
        "the successor holds it"
    );
    assert_eq!(d.serial_of(&e), Some(TWO));
    assert_eq!(d.serial_at(&at(1)), None, "its own address is free");
    assert_eq!(
        d.holder(&AgentName::from("p0")),
        None,
        "its own names are free"
    );
    assert_eq!(
        d.holder(&AgentName::from("p1")),
        Some(Holder::Registration(TWO))
    );
    assert!(d.forget(TWO, &e, &at(2), &names(&["p1"])));
    assert_eq!((d.serial_of(&e), d.serial_at(&at(2))), (None, None));
}

#[test]
fn a_second_activation_at_an_address_names_the_one_it_replaces() {
    let mut d = Directory::default();
    let (old, new) = (EngineId::from("old"), EngineId::from("new"));
    assert_eq!(d.activate(ONE, &old, &at(1), &names(&["o"])), None);
    assert_eq!(d.activate(TWO, &new, &at(1), &names(&["n"])), Some(ONE));
    assert_eq!(d.serial_at(&at(1)), Some(TWO));
    assert_eq!(
        d.activate(TWO, &new, &at(1), &names(&["n"])),
        None,
        "not itself"
    );
    assert!(
        d.forget(ONE, &old, &at(1), &names(&["o"])),
        "its id was its own"
    );
    assert_eq!(
        d.serial_at(&at(1)),
        Some(TWO),
        "the successor keeps the address"
    );
}

#[test]
fn a_granted_load_holds_its_names_until_its_handshake_ends() {
    let mut d = Directory::default();
    let (t1, t2) = (TicketId(1), TicketId(2));
    d.ticket_started(t2, at(1), false);
    d.ticket_started(t1, at(1), false);
    assert_eq!(d.open_at(&at(1)), [t1, t2], "in ticket order");
    assert_eq!(d.newest_ticket(), t2);
    d.grant(t1, claim("p", &["p0"]));
    d.claim_extra(t1, AgentName::from("extra"));
    let e = EngineId::from("p");
    assert!(d.is_loading(&e));
    assert_eq!(d.load_address(&e), Some(&at(1)));
    assert_eq!(d.loading_engine(t1), Some(&e));
    assert_eq!(d.holder(&AgentName::from("extra")), Some(Holder::Load(t1)));
    d.hold(&at(1), ONE);
    assert_eq!(d.holding(&at(1), ONE), Some(2), "two handshakes pending");
    assert_eq!(d.holding(&at(1), TWO), None, "not held");
    let ended = d.end_ticket(t1).expect("open");
    assert!(matches!(ended.stage, Stage::Loading { .. }));
    assert!(!d.is_loading(&e));
    assert_eq!(d.holder(&AgentName::from("p0")), None);
    assert_eq!(d.holder(&AgentName::from("extra")), None);
    assert_eq!(
        d.handshake_gone(&at(1)).into_iter().collect::<Vec<_>>(),
        [ONE]
    );
    assert_eq!(d.holding(&at(1), ONE), None, "judged again, not held");
    assert!(d.end_ticket(t1).is_none(), "ended once");
    d.end_ticket(t2);
    assert!(
        !d.ticket_state_left().is_empty(),
        "still counted at its address"
    );
    d.handshake_gone(&at(1));
    assert_eq!(d.ticket_state_left(), Vec::<&str>::new());
    assert!(d.open_at(&at(1)).is_empty());
}

#[test]
fn a_registered_load_gives_back_only_its_extra_names() {
    let mut d = Directory::default();
    let t = TicketId(1);
    d.ticket_started(t, at(1), false);
    d.grant(t, claim("p", &["p0"]));
    d.claim_extra(t, AgentName::from("extra"));
    d.load_registered(t, &EngineId::from("p"));
    assert!(!d.is_loading(&EngineId::from("p")));
    assert_eq!(d.holder(&AgentName::from("extra")), None);
    assert_eq!(
        d.holder(&AgentName::from("p0")),
        Some(Holder::Load(t)),
        "the claim's names pass to the registration"
    );
    assert!(matches!(
        d.ticket(t).map(|t| &t.stage),
        Some(Stage::Answered)
    ));
}

#[test]
fn claims_wait_in_arrival_order_and_one_put_back_goes_first() {
    let mut d = Directory::default();
    let e = EngineId::from("p");
    let (t1, t2) = (TicketId(1), TicketId(2));
    for t in [t1, t2] {
        d.ticket_started(t, at(1), false);
        let (claim, request) = (claim("p", &["p0"]), RequestId(t.0));
        d.set_stage(t, Stage::Waiting { claim, request });
        d.queue(&e, t);
    }
    assert!(d.has_queue(&e) && d.is_waited_for(&e));
    assert_eq!(d.next_waiting(&e), Some(t1));
    d.requeue_first(&e, t1);
    assert_eq!(d.next_waiting(&e), Some(t1));
    let (_, request) = d.take_waiting_claim(t1).expect("waiting");
    assert_eq!(request, RequestId(1));
    assert!(d.take_waiting_claim(t1).is_none(), "answered now");
    d.end_ticket(t2);
    assert!(!d.is_waited_for(&e), "its end took it out of the queue");
    d.expect_reload(&e);
    assert!(d.is_waited_for(&e) && !d.has_queue(&e));
    d.queue_served(&e);
    assert!(!d.is_waited_for(&e));
}

#[test]
fn a_shutdown_takes_every_waiting_claim_in_ticket_order() {
    let mut d = Directory::default();
    d.queue(&EngineId::from("b"), TicketId(3));
    d.queue(&EngineId::from("a"), TicketId(5));
    d.queue(&EngineId::from("a"), TicketId(1));
    assert_eq!(
        d.waiting_for_reload(),
        [EngineId::from("a"), EngineId::from("b")]
    );
    assert_eq!(d.take_waiting(), [TicketId(1), TicketId(3), TicketId(5)]);
    assert!(d.waiting_for_reload().is_empty());
}

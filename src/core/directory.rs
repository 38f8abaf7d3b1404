//! The identity tables: which registration each engine id, address and
//! agent name maps to, the handshakes in progress and what they hold (a
//! claim waiting for an engine id, the one load of an id, the releases
//! their address holds back). [`super::identity`] and
//! `flow.rs`'s handshake section decide; [`Directory`] keeps the tables consistent
//! with each other, so each rule reads as its decision, not as the
//! bookkeeping of eight maps. Its unit tests, without a core, are in
//! `tests/directory.rs`.

use std::collections::{BTreeSet, VecDeque};

use super::{Map, RequestId, TicketId};
use crate::names::{AgentName, EngineId, PeerAddr};
use crate::registration::{Claim, Registration, RegistrationId};

/// A handshake in progress.
pub(super) struct Ticket {
    pub(super) address: PeerAddr,
    /// The address is the peer's own word, not where the runtime reached
    /// it (the identity rule for declared addresses, `identity.rs`).
    pub(super) declared: bool,
    pub(super) stage: Stage,
}

/// Where a handshake is.
pub(super) enum Stage {
    /// Started; it has not said whom it found.
    Started,
    /// Its claim waits for the engine id: a load of it is in progress, or
    /// its registration is being released first.
    Waiting { claim: Claim, request: RequestId },
    /// Its claim was granted: it may load, and holds the claim's agent
    /// names (and any more it claimed while loading).
    Loading { claim: Claim, extra: Vec<AgentName> },
    /// Answered (the engine already registered, or refused): only its end
    /// is left.
    Answered,
}

/// Who holds an agent name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Holder {
    /// A registration (live, marked or being released), by serial.
    Registration(RegistrationId),
    /// A handshake whose claim was granted and that is loading.
    Load(TicketId),
}

/// The identity tables, private to this file: every change goes through a
/// method that keeps them consistent (a name is held by one holder, a
/// ticket counts once at its address, an engine id has one load).
#[derive(Default)]
pub(super) struct Directory {
    /// The registration each engine id holds now (at most one).
    by_id: Map<EngineId, RegistrationId>,
    /// The registration each address maps to now.
    by_addr: Map<PeerAddr, RegistrationId>,
    /// Who holds each agent name: a registration or a granted load.
    agents: Map<AgentName, Holder>,
    tickets: Map<TicketId, Ticket>,
    /// Handshakes in progress per address.
    handshakes: Map<PeerAddr, usize>,
    /// Marked registrations whose release waits for a handshake at their
    /// address.
    held_by_handshake: Map<PeerAddr, BTreeSet<RegistrationId>>,
    /// The one granted load of each engine id.
    loads: Map<EngineId, TicketId>,
    /// Claims waiting for an engine id, in arrival order. An empty queue
    /// is someone waiting for the id's release itself (see
    /// [`Directory::expect_reload`]).
    waiting: Map<EngineId, VecDeque<TicketId>>,
    /// The newest handshake started so far.
    newest_ticket: TicketId,
}

impl Directory {
    // ----- registrations -----

    /// The registration that holds `engine`'s id, if one does.
    pub(super) fn serial_of(&self, engine: &EngineId) -> Option<RegistrationId> {
        self.by_id.get(engine).copied()
    }

    /// The registration `address` maps to, if one does.
    pub(super) fn serial_at(&self, address: &PeerAddr) -> Option<RegistrationId> {
        self.by_addr.get(address).copied()
    }

    /// Registration `serial` of `engine` is active at `address` with
    /// `agents`: it holds the id, the address and the names. Returns the
    /// registration that mapped to the address before, if another.
    pub(super) fn activate(
        &mut self,
        serial: RegistrationId,
        engine: &EngineId,
        address: &PeerAddr,
        agents: &[AgentName],
    ) -> Option<RegistrationId> {
        self.by_id.insert(engine.clone(), serial);
        for agent in agents {
            self.agents
                .insert(agent.clone(), Holder::Registration(serial));
        }
        self.by_addr
            .insert(address.clone(), serial)
            .filter(|&old| old != serial)
    }

    /// Registration `serial` was released: the names, the address and the
    /// id it still holds are free (a successor's are kept). Returns
    /// whether the engine id was freed (claims waiting for it are judged
    /// again).
    pub(super) fn forget(
        &mut self,
        serial: RegistrationId,
        engine: &EngineId,
        address: &PeerAddr,
        agents: &[AgentName],
    ) -> bool {
        for agent in agents {
            if self.agents.get(agent) == Some(&Holder::Registration(serial)) {
                self.agents.remove(agent);
            }
        }
        if self.by_addr.get(address) == Some(&serial) {
            self.by_addr.remove(address);
        }
        let freed = self.by_id.get(engine) == Some(&serial);
        if freed {
            self.by_id.remove(engine);
        }
        // After mass departures (10,000 members that left) the tables give
        // their buckets back.
        crate::shrink::after_removal(&mut self.agents);
        crate::shrink::after_removal(&mut self.by_addr);
        crate::shrink::after_removal(&mut self.by_id);
        freed
    }

    /// Who holds `agent`, if anyone does.
    pub(super) fn holder(&self, agent: &AgentName) -> Option<Holder> {
        self.agents.get(agent).copied()
    }

    /// The newest handshake started so far: a registration activated now
    /// is newer than every reply of these.
    pub(super) fn newest_ticket(&self) -> TicketId {
        self.newest_ticket
    }

    // ----- handshakes -----

    /// The handshake `ticket` started at `address`.
    pub(super) fn ticket_started(&mut self, ticket: TicketId, address: PeerAddr, declared: bool) {
        self.newest_ticket = self.newest_ticket.max(ticket);
        *self.handshakes.entry(address.clone()).or_default() += 1;
        let stage = Stage::Started;
        let t = Ticket {
            address,
            declared,
            stage,
        };
        self.tickets.insert(ticket, t);
    }

    /// The handshake `ticket`, while it is in progress.
    pub(super) fn ticket(&self, ticket: TicketId) -> Option<&Ticket> {
        self.tickets.get(&ticket)
    }

    /// Whether the handshake `ticket` is still in progress.
    pub(super) fn is_open(&self, ticket: TicketId) -> bool {
        self.tickets.contains_key(&ticket)
    }

    /// Moves the handshake `ticket` (in progress) to `stage`: answered, or
    /// waiting (a load is granted with [`Directory::grant`], which holds
    /// its names too).
    pub(super) fn set_stage(&mut self, ticket: TicketId, stage: Stage) {
        self.tickets
            .get_mut(&ticket)
            .expect("a ticket in progress")
            .stage = stage;
    }

    /// The claim the handshake `ticket` waits with, taken (it is answered
    /// now); `None` if it is not waiting.
    pub(super) fn take_waiting_claim(&mut self, ticket: TicketId) -> Option<(Claim, RequestId)> {
        let t = self.tickets.get_mut(&ticket)?;
        if !matches!(t.stage, Stage::Waiting { .. }) {
            return None;
        }
        match std::mem::replace(&mut t.stage, Stage::Answered) {
            Stage::Waiting { claim, request } => Some((claim, request)),
            _ => unreachable!("matched above"),
        }
    }

    /// Grants the handshake `ticket` its claim: the one load of the engine
    /// id, holding the claim's agent names.
    pub(super) fn grant(&mut self, ticket: TicketId, claim: Claim) {
        self.loads.insert(claim.engine.clone(), ticket);
        for agent in &claim.agents {
            self.agents.insert(agent.clone(), Holder::Load(ticket));
        }
        let extra = Vec::new();
        self.set_stage(ticket, Stage::Loading { claim, extra });
    }

    /// Whether `registration` is what the handshake `ticket` claimed and
    /// is loading (the same claim at the same address): if so, whether
    /// that address was declared by the peer; `None` when it is not.
    pub(super) fn granted<R>(
        &self,
        ticket: TicketId,
        registration: &Registration<R>,
    ) -> Option<bool> {
        match self.tickets.get(&ticket)? {
            Ticket {
                stage: Stage::Loading { claim, .. },
                address,
                declared,
            } if *claim == registration.claim() && *address == registration.address => {
                Some(*declared)
            }
            _ => None,
        }
    }

    /// The loading handshake `ticket` holds one more agent name.
    pub(super) fn claim_extra(&mut self, ticket: TicketId, agent: AgentName) {
        if let Some(Ticket {
            stage: Stage::Loading { extra, .. },
            ..
        }) = self.tickets.get_mut(&ticket)
        {
            self.agents.insert(agent.clone(), Holder::Load(ticket));
            extra.push(agent);
        }
    }

    /// The loading handshake `ticket` registered `engine`: the load is
    /// over, the extra names it held are free (the runtime's to give back
    /// by now), and the ticket is answered.
    pub(super) fn load_registered(&mut self, ticket: TicketId, engine: &EngineId) {
        self.loads.remove(engine);
        let stage = self
            .tickets
            .get_mut(&ticket)
            .map(|t| std::mem::replace(&mut t.stage, Stage::Answered));
        if let Some(Stage::Loading { extra, .. }) = stage {
            self.free_names(ticket, &extra);
        }
    }

    /// The engine id loading under `ticket`, if it is loading.
    pub(super) fn loading_engine(&self, ticket: TicketId) -> Option<&EngineId> {
        match &self.tickets.get(&ticket)?.stage {
            Stage::Loading { claim, .. } => Some(&claim.engine),
            _ => None,
        }
    }

    /// Whether a load of `engine` is in progress.
    pub(super) fn is_loading(&self, engine: &EngineId) -> bool {
        self.loads.contains_key(engine)
    }

    /// The address of the load of `engine` in progress, if one is.
    pub(super) fn load_address(&self, engine: &EngineId) -> Option<&PeerAddr> {
        let ticket = self.loads.get(engine)?;
        Some(&self.tickets[ticket].address)
    }

    /// The handshake `ticket` ended: forgotten with what it held (its
    /// place in a queue, its load and names); returned for its answer.
    /// [`Directory::handshake_gone`] follows, once the caller has acted.
    pub(super) fn end_ticket(&mut self, ticket: TicketId) -> Option<Ticket> {
        let t = self.tickets.remove(&ticket)?;
        match &t.stage {
            Stage::Started | Stage::Answered => {}
            Stage::Waiting { claim, .. } => {
                if let Some(queue) = self.waiting.get_mut(&claim.engine) {
                    queue.retain(|&w| w != ticket);
                    if queue.is_empty() {
                        self.waiting.remove(&claim.engine);
                    }
                }
            }
            Stage::Loading { claim, extra } => {
                // Dropped after its claim was granted: whatever it loaded,
                // the runtime gives back; the names are free again.
                self.free_names(ticket, &claim.agents);
                self.free_names(ticket, extra);
                if self.loads.get(&claim.engine) == Some(&ticket) {
                    self.loads.remove(&claim.engine);
                }
            }
        }
        Some(t)
    }

    /// Frees those of `agents` that the load `ticket` holds.
    fn free_names(&mut self, ticket: TicketId, agents: &[AgentName]) {
        for agent in agents {
            if self.agents.get(agent) == Some(&Holder::Load(ticket)) {
                self.agents.remove(agent);
            }
        }
    }

    /// An ended handshake no longer counts at `address`. Returns the
    /// registrations the address held back, to be judged again (a
    /// handshake begun before their mark may have been the last that held
    /// them, whatever later ones are still open).
    pub(super) fn handshake_gone(&mut self, address: &PeerAddr) -> BTreeSet<RegistrationId> {
        let count = self
            .handshakes
            .get_mut(address)
            .expect("every ticket counts at its address");
        *count -= 1;
        if *count == 0 {
            self.handshakes.remove(address);
        }
        let held = self.held_by_handshake.remove(address).unwrap_or_default();
        // A burst of handshakes (10,000 members joining) leaves these
        // tables sized for the burst; they give their buckets back.
        crate::shrink::after_removal(&mut self.tickets);
        crate::shrink::after_removal(&mut self.handshakes);
        crate::shrink::after_removal(&mut self.held_by_handshake);
        crate::shrink::after_removal(&mut self.loads);
        crate::shrink::after_removal(&mut self.waiting);
        crate::shrink::after_removal(&mut self.agents);
        held
    }

    /// The handshakes open at `address` now, in ticket order.
    pub(super) fn open_at(&self, address: &PeerAddr) -> Vec<TicketId> {
        if !self.handshakes.contains_key(address) {
            return Vec::new();
        }
        let mut open: Vec<TicketId> = self
            .tickets
            .iter()
            .filter(|(_, t)| t.address == *address)
            .map(|(&id, _)| id)
            .collect();
        open.sort_unstable();
        open
    }

    // ----- releases held back -----

    /// The release of `serial` waits for a handshake at `address`.
    pub(super) fn hold(&mut self, address: &PeerAddr, serial: RegistrationId) {
        let held = self.held_by_handshake.entry(address.clone()).or_default();
        held.insert(serial);
    }

    /// No release waits for a handshake any more (the service stops).
    pub(super) fn clear_holds(&mut self) {
        self.held_by_handshake.clear();
    }

    /// The handshakes pending at `address`, if the release of `serial`
    /// waits for them.
    pub(super) fn holding(&self, address: &PeerAddr, serial: RegistrationId) -> Option<usize> {
        if !self.held_by_handshake.get(address)?.contains(&serial) {
            return None;
        }
        self.handshakes.get(address).copied()
    }

    // ----- claims waiting for an engine id -----

    /// Whether claims of `engine` are queued (a new one goes behind them).
    pub(super) fn has_queue(&self, engine: &EngineId) -> bool {
        self.waiting.get(engine).is_some_and(|q| !q.is_empty())
    }

    /// Whether someone waits to load `engine`: a claim, or a reload
    /// waiting for the registration's release.
    pub(super) fn is_waited_for(&self, engine: &EngineId) -> bool {
        self.waiting.contains_key(engine)
    }

    /// Someone waits for the release of `engine`'s registration to load it
    /// again: the release is not held back by a handshake.
    pub(super) fn expect_reload(&mut self, engine: &EngineId) {
        self.waiting.entry(engine.clone()).or_default();
    }

    /// Queues the claim of `ticket` behind those waiting for `engine`.
    pub(super) fn queue(&mut self, engine: &EngineId, ticket: TicketId) {
        self.waiting
            .entry(engine.clone())
            .or_default()
            .push_back(ticket);
    }

    /// Puts the claim of `ticket` back at the head of `engine`'s queue: it
    /// must wait again, before the others.
    pub(super) fn requeue_first(&mut self, engine: &EngineId, ticket: TicketId) {
        self.waiting
            .entry(engine.clone())
            .or_default()
            .push_front(ticket);
    }

    /// The first claim waiting for `engine`, out of its queue.
    pub(super) fn next_waiting(&mut self, engine: &EngineId) -> Option<TicketId> {
        self.waiting.get_mut(engine)?.pop_front()
    }

    /// `engine`'s queue was served to its end: nobody waits for it.
    pub(super) fn queue_served(&mut self, engine: &EngineId) {
        if self.waiting.get(engine).is_some_and(VecDeque::is_empty) {
            self.waiting.remove(engine);
        }
    }

    /// Every claim waiting, in ticket order, out of their queues.
    pub(super) fn take_waiting(&mut self) -> Vec<TicketId> {
        let waiting = std::mem::take(&mut self.waiting);
        let mut waiting: Vec<TicketId> = waiting.into_values().flatten().collect();
        waiting.sort_unstable();
        waiting
    }

    // ----- what the snapshot shows -----

    /// The handshakes pending, per address, in address order.
    pub(super) fn handshakes_pending(&self) -> Vec<(PeerAddr, usize)> {
        let mut pending: Vec<(PeerAddr, usize)> = self
            .handshakes
            .iter()
            .map(|(a, n)| (a.clone(), *n))
            .collect();
        pending.sort();
        pending
    }

    /// The engine ids someone waits to load, in order.
    pub(super) fn waiting_for_reload(&self) -> Vec<EngineId> {
        let mut waiting: Vec<EngineId> = self.waiting.keys().cloned().collect();
        waiting.sort();
        waiting
    }

    /// The slots each table holds (its capacity), by name: what the tables
    /// keep after departures.
    #[cfg(test)]
    pub(super) fn footprint(&self) -> Vec<(&'static str, usize)> {
        vec![
            ("by_id", self.by_id.capacity()),
            ("by_addr", self.by_addr.capacity()),
            ("agents", self.agents.capacity()),
            ("tickets", self.tickets.capacity()),
            ("handshakes", self.handshakes.capacity()),
            ("held_by_handshake", self.held_by_handshake.capacity()),
            ("loads", self.loads.capacity()),
            ("waiting", self.waiting.capacity()),
        ]
    }

    /// What per-handshake state is left, by table: none once every
    /// handshake has ended.
    #[cfg(test)]
    pub(super) fn ticket_state_left(&self) -> Vec<&'static str> {
        let loads_hold = self.agents.values().any(|h| matches!(h, Holder::Load(_)));
        [
            ("tickets", !self.tickets.is_empty()),
            ("waiting", !self.waiting.is_empty()),
            ("loads", !self.loads.is_empty()),
            ("handshakes", !self.handshakes.is_empty()),
            ("agent names held by loads", loads_hold),
        ]
        .into_iter()
        .filter_map(|(table, left)| left.then_some(table))
        .collect()
    }
}

//! Given-up transfers still running: the runtime failed their requests,
//! but their destinations are held (and their engines fenced: not
//! released) until each transfer is seen to end or is abandoned. The core
//! only keeps the books, for the snapshot and the gauges; the fence itself
//! is the read count in the engine's cell (see `GivenUpRead`).

use std::time::{Duration, Instant};

use super::{Count, Map};
use crate::registration::RegistrationId;
use crate::snapshot::GivenUpSnapshot;

/// One given-up transfer still counted in flight.
#[derive(Clone, Copy, Debug)]
struct Held {
    serial: RegistrationId,
    since: Instant,
    blocks: u64,
}

/// The given-up transfers still running, by give-up token.
#[derive(Default)]
pub(super) struct GivenUpBook {
    held: Map<u64, Held>,
    /// The blocks all of them hold.
    blocks: u64,
}

impl GivenUpBook {
    /// A read was given up with its transfer running. Returns the gauges.
    pub(super) fn given_up(
        &mut self,
        now: Instant,
        serial: RegistrationId,
        token: u64,
        blocks: u64,
    ) -> Count {
        if self
            .held
            .insert(
                token,
                Held {
                    serial,
                    since: now,
                    blocks,
                },
            )
            .is_none()
        {
            self.blocks = self.blocks.saturating_add(blocks);
        }
        self.gauges()
    }

    /// A given-up transfer ended (`over`) or was abandoned. Returns the
    /// counts to record: how long its destination was held, and the
    /// gauges. An unknown token (a give-up the core never heard of, the
    /// service having stopped) counts nothing.
    pub(super) fn ended(&mut self, now: Instant, token: u64, over: bool) -> Option<[Count; 2]> {
        let held = self.held.remove(&token)?;
        self.blocks = self.blocks.saturating_sub(held.blocks);
        Some([
            Count::GivenUpEnded {
                over,
                held_for: now.saturating_duration_since(held.since),
            },
            self.gauges(),
        ])
    }

    fn gauges(&self) -> Count {
        Count::GivenUpHeld {
            transfers: self.held.len() as u64,
            blocks: self.blocks,
        }
    }

    /// The given-up transfers of registration `serial` still running,
    /// oldest first (in the order they were given up).
    pub(super) fn of(&self, now: Instant, serial: RegistrationId) -> Vec<GivenUpSnapshot> {
        let mut of: Vec<(Instant, u64, u64)> = self
            .held
            .iter()
            .filter(|(_, h)| h.serial == serial)
            .map(|(&token, h)| (h.since, token, h.blocks))
            .collect();
        of.sort_unstable();
        of.into_iter()
            .map(|(since, _, blocks)| GivenUpSnapshot {
                held_for: now.saturating_duration_since(since),
                blocks,
            })
            .collect()
    }

    /// How long the oldest given-up transfer of `serial` has been held,
    /// if it has one.
    pub(super) fn oldest(&self, now: Instant, serial: RegistrationId) -> Option<(usize, Duration)> {
        let mut n = 0;
        let mut oldest: Option<Instant> = None;
        for h in self.held.values().filter(|h| h.serial == serial) {
            n += 1;
            oldest = Some(oldest.map_or(h.since, |o| o.min(h.since)));
        }
        oldest.map(|at| (n, now.saturating_duration_since(at)))
    }
}

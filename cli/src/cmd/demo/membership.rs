//! The demo's membership plane: the library's in-memory store (leases on
//! tokio's clock), where each simulated prefill registers under a lease
//! that it keeps alive while it runs, and the library's membership driver
//! watching it for the decoder.
//!
//! A prefill keeps its lease alive while its process runs and can reach
//! the store: a killed one stops at once, a frozen one stops until it is
//! thawed (then finds its lease expired and registers under a new one), a
//! partitioned one goes on (only the decoder's link is cut). An etcd outage
//! takes the store down: nothing expires, nothing is retired, and the
//! watch is reconciled when it is back.
//!
//! The demo's runtime retires membership removals in `fail` mode: a frozen
//! prefill's reads never end (measured: they stay in progress), so a drain
//! would wait for the readers' own timeouts.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nixl_keepalive::fake::{FakeError, FakeResources, FakeUcx};
use nixl_keepalive::membership::memory::{InMemoryStore, LeaseId};
use nixl_keepalive::membership::{self, Member, MembershipConfig, MembershipUpdate};
use nixl_keepalive::text::Escaped;
use nixl_keepalive::{EngineId, GoneMode, KeepaliveHandle, PeerAddr};
use tokio_util::sync::CancellationToken;

use super::report::Timeline;

/// The lease TTL prefills register with (Dynamo's).
pub(super) const LEASE_TTL: Duration = Duration::from_secs(10);

/// The membership plane and the prefills' registrations.
pub(super) struct DemoMembership {
    store: InMemoryStore,
    frozen: Mutex<HashSet<usize>>,
    outage: Mutex<bool>,
}

impl DemoMembership {
    /// Registers every prefill, starts their keep-alives, the lease expiry
    /// and the decoder's membership driver.
    pub(super) fn start(
        ucx: FakeUcx,
        addrs: Vec<PeerAddr>,
        ranks: u16,
        handle: KeepaliveHandle<FakeResources>,
        timeline: Arc<Timeline>,
        shutdown: CancellationToken,
    ) -> Arc<DemoMembership> {
        let store = InMemoryStore::new();
        store.spawn_lease_expiry(Duration::from_millis(100), shutdown.clone());
        let me = Arc::new(DemoMembership {
            store: store.clone(),
            frozen: Mutex::default(),
            outage: Mutex::new(false),
        });
        // Registered before the watch starts: the first list has them all.
        let mut leases: HashMap<usize, (EngineId, LeaseId)> = HashMap::new();
        me.keep_alive_round(&ucx, &addrs, ranks, &mut leases);
        let keeper = me.clone();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(LEASE_TTL / 3);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => keeper.keep_alive_round(&ucx, &addrs, ranks, &mut leases),
                }
            }
        });
        let (mut updates, _driver) = membership::spawn(
            store.watch(),
            handle,
            {
                let mut config = MembershipConfig::default();
                config.gone_mode = GoneMode::Fail;
                config.reset_grace = LEASE_TTL;
                config
            },
            shutdown.clone(),
        );
        tokio::spawn(async move {
            // Between an Outage and its Restored, in the driver's own order.
            let mut in_outage = false;
            while let Some(u) = updates.recv().await {
                on_update(&u, &timeline, &mut in_outage);
            }
        });
        me
    }
}

/// Logs an update; a removal between an outage and its end is a violation.
fn on_update(update: &MembershipUpdate, timeline: &Timeline, in_outage: &mut bool) {
    {
        let line = match update {
            MembershipUpdate::Joined(m) => {
                format!("membership: {} joined at {}", m.engine_id, m.address)
            }
            MembershipUpdate::Left { member, why } => {
                if *in_outage {
                    timeline.violation(format!(
                        "membership retired {} during an etcd outage",
                        member.engine_id
                    ));
                }
                format!(
                    "membership: {} left ({}): peer gone (fail)",
                    member.engine_id,
                    why.as_str()
                )
            }
            MembershipUpdate::Outage { error } => {
                *in_outage = true;
                format!("membership: etcd unreachable ({error}): every engine kept")
            }
            MembershipUpdate::Restored { outage } => {
                *in_outage = false;
                format!(
                    "membership: etcd back after {:.1} s: prefix listed again and reconciled",
                    outage.as_secs_f64()
                )
            }
            MembershipUpdate::Released { engine, after, .. } => format!(
                "membership: {engine} released {:.1} ms after its key went",
                after.as_secs_f64() * 1000.0
            ),
            MembershipUpdate::BadValue { key, error, .. } => {
                let key = Escaped(key);
                timeline.violation(format!("membership: bad value at {key}: {error}"));
                format!("membership: bad value at {key}")
            }
            MembershipUpdate::StoreReset { awaited, grace } => format!(
                "membership: etcd was reset: {awaited} engines kept for {:.1} s",
                grace.as_secs_f64()
            ),
            other => format!("membership: {other:?}"),
        };
        timeline.log(line);
    }
}

impl DemoMembership {
    /// Each prefill whose process runs keeps its lease alive, or registers
    /// under a new one when the old one expired (or its engine id is new).
    fn keep_alive_round(
        &self,
        ucx: &FakeUcx,
        addrs: &[PeerAddr],
        ranks: u16,
        leases: &mut HashMap<usize, (EngineId, LeaseId)>,
    ) {
        let frozen = self
            .frozen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        for (p, addr) in addrs.iter().enumerate() {
            let (engine, incarnation) = match ucx.fetch_metadata(addr) {
                Ok(m) => (m.engine.clone(), Some(m.incarnation().0)),
                // Partitioned from the decoder, not from etcd.
                Err(FakeError::Unresponsive { engine, .. }) if !frozen.contains(&p) => {
                    (engine, None)
                }
                // Killed, or frozen: no keep-alive.
                Err(_) => continue,
            };
            if let Some((e, lease)) = leases.get(&p) {
                if *e == engine && self.store.keep_alive(*lease) {
                    continue;
                }
            }
            let Some(lease) = self.store.grant_lease(LEASE_TTL) else {
                continue; // etcd down: retried next round
            };
            // The process's incarnation, as its side channel reports it.
            let mut member = Member::new(engine.as_str(), addr.as_str(), ranks);
            member.incarnation = incarnation;
            let key = format!("{}{engine}", membership::DEFAULT_PREFIX);
            if self.store.put_member(&key, &member, Some(lease)) {
                leases.insert(p, (engine, lease));
            }
        }
    }

    /// The prefill's process is frozen: it stops keeping its lease alive.
    pub(super) fn freeze(&self, prefill: usize) {
        self.frozen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(prefill);
    }

    /// Whether some prefill is frozen now.
    pub(super) fn any_frozen(&self) -> bool {
        !self
            .frozen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    /// It runs again.
    pub(super) fn thaw(&self, prefill: usize) {
        self.frozen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&prefill);
    }

    /// etcd goes down.
    pub(super) fn outage(&self) {
        *self.outage.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.store.outage("etcd unreachable (simulated)");
    }

    /// etcd is back.
    pub(super) fn restore(&self) {
        *self.outage.lock().unwrap_or_else(|e| e.into_inner()) = false;
        self.store.restore();
    }

    /// Whether etcd is down now.
    pub(super) fn in_outage(&self) -> bool {
        *self.outage.lock().unwrap_or_else(|e| e.into_inner())
    }
}

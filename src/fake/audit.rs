//! The fake UCX with every release audited against the runtime's own count
//! of reads: the safety rule ("never a release with a read in flight")
//! checked independently of the library's bookkeeping. The demo and the
//! interleaving tests both wrap the fake in it.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::{FakeResources, FakeUcx};
use crate::transport::{AgentName, EngineId, ReleaseStep, Transfers, Transport, TransportError};

/// Where a violation found by the audit goes (a test's list, the demo's
/// timeline).
type Sink = Box<dyn Fn(String) + Send + Sync>;

/// The fake UCX as a [`Transport`] whose `release` first checks the
/// runtime's own read count of the registration (keyed by its resources,
/// unique per load) and reports a violation when reads are in flight, when
/// the resources were released already, or when the runtime never
/// [tracked](AuditedUcx::track) them. Share it through an `Arc`: the
/// service gets one clone, the runtime keeps another to track loads.
pub struct AuditedUcx {
    ucx: FakeUcx,
    reads: Mutex<Vec<(FakeResources, Arc<AtomicUsize>)>>,
    releases: AtomicU64,
    violation: Sink,
}

impl AuditedUcx {
    /// Audits releases on `ucx`, sending each violation to `violation`.
    pub fn new(ucx: FakeUcx, violation: impl Fn(String) + Send + Sync + 'static) -> Self {
        AuditedUcx {
            ucx,
            reads: Mutex::new(Vec::new()),
            releases: AtomicU64::new(0),
            violation: Box::new(violation),
        }
    }

    /// The fake it wraps.
    pub fn ucx(&self) -> &FakeUcx {
        &self.ucx
    }

    /// Starts counting reads of a registration just loaded with
    /// `resources`: the runtime adds one to the returned count when a
    /// read of it begins and takes one away when the read ends. Track
    /// before registering, so that a release racing the registration is
    /// audited too.
    pub fn track(&self, resources: FakeResources) -> Arc<AtomicUsize> {
        let count = Arc::new(AtomicUsize::new(0));
        self.lock().push((resources, count.clone()));
        count
    }

    /// Releases that reached the transport, audited or not.
    pub fn releases(&self) -> u64 {
        self.releases.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(FakeResources, Arc<AtomicUsize>)>> {
        self.reads.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Transport for AuditedUcx {
    type Resources = FakeResources;

    fn notify(&self, agent: &AgentName, message: &[u8]) -> Result<(), TransportError> {
        self.ucx.notify(agent, message)
    }

    fn release_with(
        &self,
        engine: &EngineId,
        agents: &[AgentName],
        resources: FakeResources,
        transfers: Transfers,
    ) -> Vec<ReleaseStep> {
        self.releases.fetch_add(1, Ordering::Relaxed);
        let tracked = {
            let mut reads = self.lock();
            reads
                .iter()
                .position(|(r, _)| *r == resources)
                .map(|i| reads.swap_remove(i).1)
        };
        match tracked.map(|n| n.load(Ordering::SeqCst)) {
            Some(0) => {}
            Some(n) => (self.violation)(format!(
                "{engine} released while the runtime held {n} read(s) on it"
            )),
            None => (self.violation)(format!(
                "{engine} released twice, or resources the runtime never tracked"
            )),
        }
        self.ucx.release_with(engine, agents, resources, transfers)
    }

    fn watch_failures(
        &self,
        suspicions: crate::transport::Suspicions,
    ) -> Result<crate::transport::FailureWatch, String> {
        self.ucx.watch_failures(suspicions)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeConfig;
    use crate::transport::PeerAddr;

    #[test]
    fn a_release_under_a_read_twice_or_untracked_is_a_violation() {
        let found = Arc::new(Mutex::new(Vec::new()));
        let sink = found.clone();
        let ucx = FakeUcx::new(FakeConfig::default());
        let audited = AuditedUcx::new(ucx.clone(), move |v| sink.lock().unwrap().push(v));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            let addr = PeerAddr::new("10.1.0.1:7000");
            let p = ucx.spawn_prefill(addr.clone(), 1);
            let hs = ucx.handshake(&addr).unwrap();
            let reads = audited.track(hs.resources.clone());
            reads.fetch_add(1, Ordering::SeqCst);
            audited.release(&p, &hs.agents, hs.resources.clone());
            assert_eq!(found.lock().unwrap().len(), 1, "under a read");
            audited.release(&p, &hs.agents, hs.resources.clone());
            assert_eq!(found.lock().unwrap().len(), 2, "twice");
            let hs2 = ucx.handshake(&addr).unwrap();
            let idle = audited.track(hs2.resources.clone());
            assert_eq!(idle.load(Ordering::SeqCst), 0);
            audited.release(&p, &hs2.agents, hs2.resources);
            assert_eq!(found.lock().unwrap().len(), 2, "an idle one is fine");
        });
        assert_eq!(audited.releases(), 3);
        let found = found.lock().unwrap();
        assert!(found[0].contains("1 read(s)"), "{found:?}");
        assert!(found[1].contains("released twice"), "{found:?}");
    }
}

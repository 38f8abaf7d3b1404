//! What the benchmarks share: a no-op transport, a transport wrapper that
//! measures heartbeat lateness, process CPU and memory from /proc, and
//! percentiles. Each benchmark is its own harness (`harness = false`): it
//! measures its baseline in the same run and prints the ratio; it never
//! asserts on timing.
#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nixl_keepalive::{AgentName, EngineId, ReleaseStep, Transfers, Transport, TransportError};

/// `--quick` (or `BENCH_QUICK=1`): shorter measurements, for development.
pub fn quick() -> bool {
    std::env::args().any(|a| a == "--quick")
        || std::env::var_os("BENCH_QUICK").is_some_and(|v| v != "0")
}

/// A transport whose calls do nothing but count.
#[derive(Default)]
pub struct NoopTransport {
    pub notifies: AtomicU64,
    pub releases: AtomicU64,
}

impl Transport for NoopTransport {
    type Resources = ();

    fn notify(&self, _agent: &AgentName, _message: &[u8]) -> Result<(), TransportError> {
        self.notifies.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn release_with(
        &self,
        _engine: &EngineId,
        _agents: &[AgentName],
        _resources: (),
        _transfers: Transfers,
    ) -> Vec<ReleaseStep> {
        self.releases.fetch_add(1, Ordering::Relaxed);
        Vec::new()
    }
}

/// Wraps a transport and records, for the agents in `healthy`, how late
/// each heartbeat is: the gap since the previous one to the same agent,
/// minus the interval (run the service with zero jitter). Real time.
pub struct Lateness<T> {
    pub inner: T,
    interval: Duration,
    healthy: HashSet<AgentName>,
    last: Mutex<HashMap<AgentName, Instant>>,
    samples: Mutex<Vec<Duration>>,
    recording: AtomicBool,
}

impl<T> Lateness<T> {
    pub fn new(inner: T, interval: Duration, healthy: HashSet<AgentName>) -> Self {
        Lateness {
            inner,
            interval,
            healthy,
            last: Mutex::new(HashMap::new()),
            samples: Mutex::new(Vec::new()),
            recording: AtomicBool::new(false),
        }
    }

    /// Starts a new window: samples so far are dropped.
    pub fn start_window(&self) {
        self.samples.lock().unwrap().clear();
        self.recording.store(true, Ordering::SeqCst);
    }

    /// Ends the window and returns its samples.
    pub fn take_window(&self) -> Vec<Duration> {
        self.recording.store(false, Ordering::SeqCst);
        std::mem::take(&mut *self.samples.lock().unwrap())
    }

    fn seen(&self, agent: &AgentName) {
        if !self.healthy.contains(agent) {
            return;
        }
        let now = Instant::now();
        let previous = self.last.lock().unwrap().insert(agent.clone(), now);
        if let Some(previous) = previous {
            if self.recording.load(Ordering::Relaxed) {
                let late = now.duration_since(previous).saturating_sub(self.interval);
                self.samples.lock().unwrap().push(late);
            }
        }
    }
}

impl<T: Transport> Transport for Lateness<T> {
    type Resources = T::Resources;

    fn notify(&self, agent: &AgentName, message: &[u8]) -> Result<(), TransportError> {
        self.seen(agent);
        self.inner.notify(agent, message)
    }

    fn release_with(
        &self,
        engine: &EngineId,
        agents: &[AgentName],
        resources: T::Resources,
        transfers: Transfers,
    ) -> Vec<ReleaseStep> {
        self.inner
            .release_with(engine, agents, resources, transfers)
    }

    fn watch_failures(
        &self,
        suspicions: nixl_keepalive::Suspicions,
    ) -> Result<nixl_keepalive::FailureWatch, String> {
        self.inner.watch_failures(suspicions)
    }
}

/// p50, p99, max of `samples` (sorted in place); zeros when empty.
/// How long the hanging benchmarks keep calls hung, and how long they
/// measure the quiet baseline: 10 s and 5 s, or 3 s and 2 s with `--quick`.
pub fn hang_and_quiet() -> (Duration, Duration) {
    if quick() {
        (Duration::from_secs(3), Duration::from_secs(2))
    } else {
        (Duration::from_secs(10), Duration::from_secs(5))
    }
}

/// The runtime the service benchmarks run on: two workers, like the
/// machine kind's two cores.
pub fn two_worker_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

pub fn percentiles(samples: &mut [Duration]) -> (Duration, Duration, Duration) {
    if samples.is_empty() {
        return (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    }
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99), *samples.last().unwrap())
}

pub fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

/// CPU time of the whole process (all threads, live and exited), to the
/// nanosecond: `CLOCK_PROCESS_CPUTIME_ID` (the `cpu-time` crate). utime +
/// stime in /proc/self/stat count 10 ms ticks, 0.25% of a core over a 4 s
/// measurement: coarser than the targets it judges.
pub fn process_cpu() -> Duration {
    cpu_time::ProcessTime::now().as_duration()
}

/// Resident set size, from /proc/self/status.
pub fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// `ratio: X.Yx (target >= Tx) PASS/MISS`.
pub fn ratio_line(what: &str, ratio: f64, target: f64) {
    println!(
        "{what}: ratio: {ratio:.1}x (target >= {target}x) {}",
        if ratio >= target { "PASS" } else { "MISS" }
    );
}

/// The machine, for the tables.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|m| m.trim_start_matches([' ', '\t', ':']).to_string())
            })
        })
        .unwrap_or_else(|| "unknown cpu".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    format!("{cpu}, {cores} cores available")
}

/// A service over the fake UCX behind [`Lateness`], with `healthy` engines
/// whose heartbeat lateness is recorded and `others` engines that are not
/// (they will be crashed or blocked). One rank each; 1 s interval, no
/// jitter. Returns the handle, the fake, the transport, and the ids.
pub struct FakeCluster {
    pub ucx: nixl_keepalive::fake::FakeUcx,
    pub transport: std::sync::Arc<Lateness<nixl_keepalive::fake::FakeUcx>>,
    pub handle: nixl_keepalive::KeepaliveHandle<nixl_keepalive::fake::FakeResources>,
    pub task: tokio::task::JoinHandle<nixl_keepalive::Stopped<nixl_keepalive::fake::FakeResources>>,
    pub shutdown: tokio_util::sync::CancellationToken,
    pub healthy: Vec<EngineId>,
    pub others: Vec<Vec<EngineId>>,
}

pub const CLUSTER_INTERVAL: Duration = Duration::from_secs(1);

impl FakeCluster {
    pub async fn start(healthy: usize, others: &[usize]) -> FakeCluster {
        use nixl_keepalive::fake::{FakeConfig, FakeUcx};
        use nixl_keepalive::{Config, PeerAddr, Registration};
        let ucx = FakeUcx::new({
            let mut config = FakeConfig::default();
            config.record_calls = false;
            config
        });
        let mut n = 0usize;
        let mut spawn = |count: usize| -> Vec<(EngineId, PeerAddr)> {
            (0..count)
                .map(|_| {
                    n += 1;
                    let addr = PeerAddr::new(format!(
                        "10.{}.{}.{}:5600",
                        n >> 16,
                        (n >> 8) & 255,
                        n & 255
                    ));
                    (ucx.spawn_prefill(addr.clone(), 1), addr)
                })
                .collect()
        };
        let healthy_set = spawn(healthy);
        let other_sets: Vec<_> = others.iter().map(|&c| spawn(c)).collect();
        let healthy_agents: HashSet<AgentName> = healthy_set
            .iter()
            .flat_map(|(e, _)| ucx.agents_of(e))
            .collect();
        let transport =
            std::sync::Arc::new(Lateness::new(ucx.clone(), CLUSTER_INTERVAL, healthy_agents));
        let config = Config::builder()
            .heartbeat_interval(Some(CLUSTER_INTERVAL))
            .jitter(Duration::ZERO)
            .metrics_period(None)
            .event_capacity(1 << 16)
            .seed(3)
            .build()
            .unwrap();
        let shutdown = tokio_util::sync::CancellationToken::new();
        let (handle, task) = nixl_keepalive::spawn(transport.clone(), config, shutdown.clone());
        for (_, addr) in healthy_set.iter().chain(other_sets.iter().flatten()) {
            let hs = ucx.handshake(addr).unwrap();
            handle
                .register(Registration {
                    incarnation: None,
                    engine: hs.engine,
                    address: hs.addr,
                    agents: hs.agents,
                    resources: hs.resources,
                })
                .await
                .unwrap();
        }
        FakeCluster {
            ucx,
            transport,
            handle,
            task,
            shutdown,
            healthy: healthy_set.into_iter().map(|(e, _)| e).collect(),
            others: other_sets
                .into_iter()
                .map(|s| s.into_iter().map(|(e, _)| e).collect())
                .collect(),
        }
    }

    /// Lateness of heartbeats to healthy engines over `window` (real time).
    pub async fn lateness_over(&self, window: Duration) -> Vec<Duration> {
        self.transport.start_window();
        tokio::time::sleep(window).await;
        self.transport.take_window()
    }
}

pub fn lateness_line(label: &str, samples: &mut [Duration]) -> Duration {
    let (p50, p99, max) = percentiles(samples);
    println!(
        "  {label:<44} n={:<6} p50={:<11} p99={:<11} max={}",
        samples.len(),
        ms(p50),
        ms(p99),
        ms(max)
    );
    p99
}

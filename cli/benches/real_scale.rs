//! Many real NIXL peers (issue 32): one decode side (service +
//! NixlTransport, in this process) keeping 100, 300 and 1,000 real remote
//! agents alive at 1 Hz, hosted by two `nixl-keepalive prefill --engines
//! N/2` processes over loopback UCX; a release storm when one of them is
//! SIGKILLed; and the fan-in a prefill pays for 10, 50 and 100 decode
//! agents' heartbeats.
//!
//! Baselines in the same run: the same service over a no-op transport with
//! the same registrations (what NIXL and UCX add is the difference, the
//! decode agent's progress thread included); an idle prefill (no decode
//! agent notifying it) for the fan-in; the reads and heartbeats of the
//! healthy half before the storm. Prints a table per size and PASS/MISS
//! for each target; never asserts on timing. `--quick` / `BENCH_QUICK=1`:
//! 20 and 60 agents, 10 and 20 notifiers, shorter windows; `-- sizes`,
//! `-- fan-in` or `-- events`: that part alone. `events` measures the
//! service's CPU at 1,000 agents with endpoint events off and on (issue
//! 45), then soaks 1,000 healthy agents for 10 minutes with them on.
//!
//! Skips (prints SKIPPED, exits 0) without the runtime, unless
//! NIXL_KEEPALIVE_REQUIRE_REAL=1.
//!
//! `cargo bench -p nixl-keepalive-cli --bench real_scale` (`-- sizes 1000`:
//! that size alone)

#[path = "../../benches/common/mod.rs"]
mod common;
#[path = "../tests/common/procfs.rs"]
mod procfs;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{machine, percentiles, process_cpu, quick, rss_bytes};
use nixl_agent::{Agent, AgentConfig};
use nixl_keepalive::transport::nixl::{NixlTransport, RemoteDlists};
use nixl_keepalive::{
    AgentName, Config, EngineId, Event, GoneMode, PeerAddr, PeerRef, Registration, ReleaseStep,
    Transfers, Transport, TransportError,
};
use nixl_keepalive_cli::pd::decode::{Connected, DecodeOptions, Decoder, Found, ReadOutcome};
use nixl_keepalive_cli::pd::prefill::agent_name;
use procfs::Resident;
use tokio_util::sync::CancellationToken;

/// The heartbeat interval of every measurement (no jitter, so a
/// heartbeat's lateness is its gap since the previous one minus this).
const INTERVAL: Duration = Duration::from_secs(1);

/// A heartbeat counts as on time when it is at most this late.
const ON_TIME: Duration = Duration::from_millis(50);

fn verdict(pass: bool) -> &'static str {
    if pass {
        "PASS"
    } else {
        "MISS"
    }
}

fn msf(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

/// What `/proc/<pid>` says a process holds.
#[derive(Clone, Copy, Debug)]
struct Proc {
    fds: usize,
    rss: u64,
    threads: u64,
}

fn proc_of(pid: u32) -> Proc {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count());
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |k: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    Proc {
        fds,
        rss: field("VmRSS:") * 1024,
        threads: field("Threads:"),
    }
}

/// CPU time of another process: the nanoseconds on a CPU of each of its
/// threads (`/proc/<pid>/task/*/schedstat`; the ticks of `stat` are
/// 10 ms, 0.1% of a core over a 10 s window, the size of what is
/// measured).
fn cpu_of(pid: u32) -> Duration {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Duration::ZERO;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .map(Duration::from_nanos)
        .sum()
}

/// CPU time of each thread of this process, summed by thread name: the
/// nanoseconds on a CPU of `/proc/self/task/*/schedstat` (the ticks of
/// `stat` are 10 ms: too coarse for a 0.5% share over a few seconds).
/// Threads that ended meanwhile are not counted.
fn threads_cpu() -> HashMap<String, Duration> {
    let mut by_name: HashMap<String, Duration> = HashMap::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return by_name;
    };
    for task in tasks.flatten() {
        let read = |f: &str| std::fs::read_to_string(task.path().join(f)).ok();
        let (Some(name), Some(sched)) = (read("comm"), read("schedstat")) else {
            continue;
        };
        let ns: u64 = sched
            .split_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        *by_name.entry(name.trim().to_string()).or_default() += Duration::from_nanos(ns);
    }
    by_name
}

/// The thread that progresses the decode's agent
/// (`NixlTransport::spawn_progress`): the runtime's work, not the
/// service's (a decode runtime progresses its agent for its reads anyway).
const PROGRESS_THREAD: &str = "nixl-progress";

/// Share of a core each thread name took between `before` and `after`
/// over `window`.
fn shares(
    before: &HashMap<String, Duration>,
    after: &HashMap<String, Duration>,
    window: Duration,
) -> Vec<(String, f64)> {
    let mut v: Vec<(String, f64)> = after
        .iter()
        .map(|(name, t)| {
            let d = t.saturating_sub(before.get(name).copied().unwrap_or_default());
            (name.clone(), d.as_secs_f64() / window.as_secs_f64())
        })
        .filter(|(_, share)| *share > 0.0)
        .collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    v
}

/// A `prefill --engines N` process.
struct Host {
    child: Child,
    engines: Vec<(EngineId, PeerAddr)>,
}

impl Host {
    fn start(engines: usize) -> Host {
        Host::start_with(engines, &[])
    }

    fn start_with(engines: usize, flags: &[&str]) -> Host {
        let mut child = Command::new(env!("CARGO_BIN_EXE_nixl-keepalive"))
            .args(["prefill", "--listen", "127.0.0.1:0"])
            .args(["--engines", &engines.to_string()])
            .args(["--blocks", "2", "--block-size", "4096"])
            .args(flags)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn prefill --engines");
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(60 + engines as u64 / 5);
        let mut found = Vec::with_capacity(engines);
        while found.len() < engines {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = rx
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("{} of {engines} engines ready: {e}", found.len()));
            if !line.starts_with("PREFILL READY") {
                continue;
            }
            let field = |k: &str| {
                line.split_whitespace()
                    .find_map(|w| w.strip_prefix(k))
                    .expect(k)
                    .to_string()
            };
            found.push((
                EngineId::from(field("engine=")),
                PeerAddr::from(field("listen=")),
            ));
        }
        // Drained for the process's life (UCX may write to stdout).
        std::thread::spawn(move || while rx.recv().is_ok() {});
        Host {
            child,
            engines: found,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn agents(&self) -> impl Iterator<Item = AgentName> + '_ {
        self.engines
            .iter()
            .map(|(e, _)| AgentName::from(agent_name(e, 0)))
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Heartbeat lateness of two groups of agents (the healthy half and the
/// rest), around any transport.
struct Timed<T> {
    inner: Arc<T>,
    group: Mutex<HashMap<AgentName, usize>>,
    last: Mutex<HashMap<AgentName, Instant>>,
    samples: Mutex<[Vec<Duration>; 2]>,
    recording: AtomicBool,
}

impl<T> Timed<T> {
    fn new(inner: Arc<T>) -> Self {
        Timed {
            inner,
            group: Mutex::default(),
            last: Mutex::default(),
            samples: Mutex::default(),
            recording: AtomicBool::new(false),
        }
    }

    fn put(&self, agents: impl Iterator<Item = AgentName>, group: usize) {
        let mut g = self.group.lock().unwrap();
        for a in agents {
            g.insert(a, group);
        }
    }

    fn start_window(&self) {
        *self.samples.lock().unwrap() = Default::default();
        self.recording.store(true, Ordering::SeqCst);
    }

    fn take_window(&self) -> [Vec<Duration>; 2] {
        self.recording.store(false, Ordering::SeqCst);
        std::mem::take(&mut *self.samples.lock().unwrap())
    }

    fn seen(&self, agent: &AgentName) {
        let now = Instant::now();
        let previous = self.last.lock().unwrap().insert(agent.clone(), now);
        if let (Some(previous), true) = (previous, self.recording.load(Ordering::Relaxed)) {
            let group = self.group.lock().unwrap().get(agent).copied().unwrap_or(1);
            let late = now.duration_since(previous).saturating_sub(INTERVAL);
            self.samples.lock().unwrap()[group.min(1)].push(late);
        }
    }
}

impl<T: Transport> Transport for Timed<T> {
    type Resources = T::Resources;

    fn notify(&self, agent: &AgentName, message: &[u8]) -> Result<(), TransportError> {
        self.seen(agent);
        self.inner.notify(agent, message)
    }

    fn release_with(
        &self,
        e: &EngineId,
        a: &[AgentName],
        r: T::Resources,
        transfers: Transfers,
    ) -> Vec<ReleaseStep> {
        self.inner.release_with(e, a, r, transfers)
    }

    fn watch_failures(
        &self,
        suspicions: nixl_keepalive::Suspicions,
    ) -> Result<nixl_keepalive::FailureWatch, String> {
        self.inner.watch_failures(suspicions)
    }

    fn release_ends_transfers(&self) -> bool {
        self.inner.release_ends_transfers()
    }
}

fn config() -> Config {
    Config::builder()
        .heartbeat_interval(Some(INTERVAL))
        .jitter(Duration::ZERO)
        .metrics_period(None)
        .event_capacity(1 << 16)
        .seed(11)
        .build()
        .expect("config")
}

/// Share of on-time heartbeats, p99 lateness.
fn on_time(samples: &mut [Duration]) -> (f64, Duration) {
    let n = samples.len().max(1) as f64;
    let ok = samples.iter().filter(|&&l| l <= ON_TIME).count() as f64;
    let (_, p99, _) = percentiles(samples);
    (ok / n, p99)
}

/// What one steady window measured.
struct Steady {
    /// CPU of the whole process, a share of one core.
    process: f64,
    /// Of which each thread name's.
    threads: Vec<(String, f64)>,
    samples: [Vec<Duration>; 2],
}

impl Steady {
    /// The service's threads: the process but the agent's progress
    /// thread.
    fn service(&self) -> f64 {
        let progress: f64 = self
            .threads
            .iter()
            .filter(|(n, _)| n == PROGRESS_THREAD)
            .map(|(_, s)| s)
            .sum();
        (self.process - progress).max(0.0)
    }

    fn breakdown(&self) -> String {
        self.threads
            .iter()
            .take(5)
            .map(|(n, s)| format!("{n} {:.2}%", s * 100.0))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// CPU of this process over `window` (a share of one core, by thread
/// name too) and the heartbeats' lateness meanwhile.
async fn steady<T>(timed: &Timed<T>, window: Duration) -> Steady {
    let cpu = process_cpu();
    let threads = threads_cpu();
    timed.start_window();
    tokio::time::sleep(window).await;
    let samples = timed.take_window();
    let process = (process_cpu() - cpu).as_secs_f64() / window.as_secs_f64();
    Steady {
        process,
        threads: shares(&threads, &threads_cpu(), window),
        samples,
    }
}

/// The same service over a no-op transport with `n` registrations.
async fn noop_baseline(n: usize, warm: Duration, window: Duration) -> Steady {
    let timed = Arc::new(Timed::new(Arc::new(common::NoopTransport::default())));
    let shutdown = CancellationToken::new();
    let (handle, task) = nixl_keepalive::spawn(timed.clone(), config(), shutdown.clone());
    for i in 0..n {
        let engine = EngineId::from(format!("noop-{i}"));
        handle
            .register(Registration {
                incarnation: None,
                agents: vec![AgentName::from(agent_name(&engine, 0))],
                address: PeerAddr::new(format!("10.9.{}.{}:5600", i >> 8, i & 255)),
                engine,
                resources: (),
            })
            .await
            .expect("register");
    }
    tokio::time::sleep(warm).await;
    let measured = steady(&timed, window).await;
    shutdown.cancel();
    let _ = task.await;
    measured
}

/// Reads from `conns` one after another while `on`, each read's latency.
fn spawn_reader(
    decoder: Arc<Decoder>,
    conns: Arc<Vec<Connected>>,
    on: Arc<AtomicBool>,
    latencies: Arc<Mutex<Vec<Duration>>>,
) -> tokio::task::JoinHandle<usize> {
    tokio::spawn(async move {
        let mut failed = 0;
        let mut i = 0usize;
        while on.load(Ordering::Relaxed) {
            let c = &conns[i % conns.len()];
            let began = Instant::now();
            if decoder.read(c, 0, (i % 2) as u32).await == ReadOutcome::Verified {
                latencies.lock().unwrap().push(began.elapsed());
            } else {
                failed += 1;
            }
            i += 1;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        failed
    })
}

struct Decode {
    timed: Arc<Timed<NixlTransport>>,
    decoder: Arc<Decoder>,
    handle: nixl_keepalive::KeepaliveHandle<RemoteDlists>,
    events: tokio::sync::broadcast::Receiver<Event>,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<nixl_keepalive::Stopped<RemoteDlists>>,
    _progress: nixl_keepalive::transport::nixl::ProgressPoller,
}

fn start_decode(rt: &'static nixl_agent::Runtime, tag: &str) -> Decode {
    start_decode_with(rt, tag, config())
}

fn start_decode_with(rt: &'static nixl_agent::Runtime, tag: &str, config: Config) -> Decode {
    let agent = Agent::new(
        rt,
        &format!("bench-scale-{}-{tag}", std::process::id()),
        &AgentConfig::default(),
    )
    .expect("decode agent");
    let transport = Arc::new(NixlTransport::new(agent));
    let progress = transport.spawn_progress(Duration::from_millis(5));
    let timed = Arc::new(Timed::new(transport.clone()));
    let shutdown = CancellationToken::new();
    let (handle, task) = nixl_keepalive::spawn(timed.clone(), config, shutdown.clone());
    let events = handle.subscribe();
    let decoder = Decoder::new(handle.clone(), transport, DecodeOptions::default());
    Decode {
        timed,
        decoder,
        handle,
        events,
        shutdown,
        task,
        _progress: progress,
    }
}

async fn connect_all(decoder: &Decoder, host: &Host) -> Vec<Connected> {
    let mut out = Vec::with_capacity(host.engines.len());
    for (_, addr) in &host.engines {
        match decoder.connect(addr, None).await.expect("handshake") {
            Found::New(c) => out.push(c),
            Found::Unchanged => panic!("{addr}: expected a new engine"),
        }
    }
    out
}

/// Waits for a `Released` event of each of `engines`; when each came.
async fn releases_of(
    events: &mut tokio::sync::broadcast::Receiver<Event>,
    engines: &[EngineId],
    within: Duration,
) -> Vec<Instant> {
    let mut left: std::collections::HashSet<&EngineId> = engines.iter().collect();
    let mut at = Vec::with_capacity(engines.len());
    let deadline = tokio::time::Instant::now() + within;
    while !left.is_empty() {
        match tokio::time::timeout_at(deadline, events.recv()).await {
            Ok(Ok(Event::Released { engine, .. })) => {
                if left.remove(&engine) {
                    at.push(Instant::now());
                }
            }
            Ok(Ok(_)) => {}
            Ok(Err(tokio::sync::broadcast::error::RecvError::Lagged(n))) => {
                panic!("{n} events missed: raise the event capacity")
            }
            other => panic!(
                "{} engines not released within {within:?}: {other:?}",
                left.len()
            ),
        }
    }
    at
}

/// One size: `n` real remote agents (two hosts of n/2), the steady
/// window, optionally the storm, then every release.
async fn size(
    rt: &'static nixl_agent::Runtime,
    n: usize,
    storm: bool,
    windows: (Duration, Duration),
) {
    let (warm, window) = windows;
    let noop = noop_baseline(n, warm, window).await;
    let noop_share = noop.service();

    let started = Instant::now();
    let (a, b) = (Host::start(n / 2), Host::start(n - n / 2));
    let host_start = started.elapsed();
    let (pa, pb) = (proc_of(a.pid()), proc_of(b.pid()));
    let me = std::process::id();
    let mut d = start_decode(rt, &n.to_string());
    d.timed.put(b.agents(), 0);
    d.timed.put(a.agents(), 1);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let p0 = proc_of(me);
    let rss0 = rss_bytes();
    let resident0 = Resident::of(std::process::id());
    let began = Instant::now();
    let healthy = connect_all(&d.decoder, &b).await;
    let p_b = proc_of(me);
    let doomed = connect_all(&d.decoder, &a).await;
    let loads = began.elapsed();
    let p_ab = proc_of(me);
    let rss_ab = rss_bytes();
    let resident_ab = Resident::of(std::process::id());

    tokio::time::sleep(warm).await;
    let mut measured = steady(&d.timed, window).await;
    let share = measured.service();
    let mut all: Vec<Duration> = measured
        .samples
        .iter_mut()
        .flat_map(|s| s.drain(..))
        .collect();
    let expected = (n as f64 * window.as_secs_f64() / INTERVAL.as_secs_f64()).floor();
    let (share_on_time, p99) = on_time(&mut all);
    let sent_share = all.len() as f64 / expected.max(1.0);
    let fds_per = (p_ab.fds as f64 - p0.fds as f64) / n as f64;
    let rss_per = (rss_ab as f64 - rss0 as f64) / n as f64;
    let ratio = share / noop_share.max(1e-9);
    println!("real_scale: {n} real remote agents at 1 Hz (two prefill processes of {} and {} engines, started in {}; {n} loads in {})", n / 2, n - n / 2, msf(host_start), msf(loads));
    println!(
        "  decode: the service's threads' CPU {:.2}% of a core   baseline the same service over a no-op transport {:.2}%   ratio {ratio:.2}x   targets <= 3x: {}, <= 5%: {}",
        share * 100.0,
        noop_share * 100.0,
        verdict(ratio <= 3.0),
        verdict(share <= 0.05)
    );
    println!(
        "  decode: the whole process {:.2}% (the agent's progress thread, every 5 ms, included; no-op {:.2}%); by thread: {}; no-op: {}",
        measured.process * 100.0,
        noop.process * 100.0,
        measured.breakdown(),
        noop.breakdown()
    );
    println!(
        "  decode: CPU per heartbeat {:.1} us (no-op {:.1} us)",
        share * window.as_secs_f64() * 1e6 / all.len().max(1) as f64,
        noop_share * INTERVAL.as_secs_f64() * 1e6 / n as f64,
    );
    println!(
        "  heartbeats: {} of {expected:.0} due in the window ({:.1}%), {:.2}% at most {} late, p99 lateness {}   target >= 99% on time: {}",
        all.len(),
        sent_share * 100.0,
        share_on_time * 100.0,
        msf(ON_TIME),
        msf(p99),
        verdict(share_on_time >= 0.99 && sent_share >= 0.99)
    );
    println!(
        "  decode: {fds_per:.2} descriptors and {:.1} KiB resident per remote agent ({} -> {} fds, {} threads)   target <= 4 fds: {}",
        rss_per / 1024.0,
        p0.fds,
        p_ab.fds,
        p_ab.threads,
        verdict(fds_per <= 4.0)
    );
    if let Ok(settings) = nixl_keepalive::ucx::settings::UcxSettings::read() {
        use nixl_keepalive::ucx::settings::{detection_bound, detection_bound_for, secs_text};
        let gap = INTERVAL + nixl_keepalive::HEARTBEAT_SLOT / 2;
        let (one, here) = (
            detection_bound(&settings, gap),
            detection_bound_for(&settings, gap, n),
        );
        println!(
            "  bounds with {n} endpoints in the decode's worker: crashed {} (as with one); silent {} ({}) against {} for at most one keepalive round's endpoints",
            secs_text(here.crashed),
            here.silent.map_or("never".into(), secs_text),
            here.silent_terms,
            one.silent.map_or("never".into(), secs_text),
        );
    }
    for (name, p, e) in [("a", pa, a.engines.len()), ("b", pb, b.engines.len())] {
        println!(
            "  prefill {name}: {e} engines in {:.1} MiB resident ({:.2} MiB each), {} fds ({:.1} each), {} threads",
            p.rss as f64 / (1 << 20) as f64,
            p.rss as f64 / (1 << 20) as f64 / e as f64,
            p.fds,
            p.fds as f64 / e as f64,
            p.threads
        );
    }

    let doomed_ids: Vec<EngineId> = doomed.iter().map(|c| c.engine.id().clone()).collect();
    let healthy_ids: Vec<EngineId> = healthy.iter().map(|c| c.engine.id().clone()).collect();
    let healthy = Arc::new(healthy);
    if storm {
        // The healthy half's reads and heartbeats: quiet, then through
        // the storm.
        let measure_reads = || {
            let on = Arc::new(AtomicBool::new(true));
            let lat = Arc::new(Mutex::new(Vec::new()));
            let reader = spawn_reader(d.decoder.clone(), healthy.clone(), on.clone(), lat.clone());
            (on, lat, reader)
        };
        let (on, lat, reader) = measure_reads();
        d.timed.start_window();
        tokio::time::sleep(window).await;
        let mut quiet_hb = std::mem::take(&mut d.timed.take_window()[0]);
        on.store(false, Ordering::Relaxed);
        let _ = reader.await;
        let mut quiet_reads = std::mem::take(&mut *lat.lock().unwrap());

        let (on, lat, reader) = measure_reads();
        d.timed.start_window();
        let mut a = a;
        let killed = Instant::now();
        let _ = a.child.kill();
        let at = releases_of(
            &mut d.events,
            &doomed_ids,
            INTERVAL * 10 + Duration::from_secs(30),
        )
        .await;
        let (first, last) = (
            *at.iter().min().expect("some") - killed,
            *at.iter().max().expect("some") - killed,
        );
        // One more interval, so every healthy agent's gap over the storm
        // is in the window.
        tokio::time::sleep(INTERVAL).await;
        let mut storm_hb = std::mem::take(&mut d.timed.take_window()[0]);
        on.store(false, Ordering::Relaxed);
        let failed = reader.await.unwrap_or(0);
        let mut storm_reads = std::mem::take(&mut *lat.lock().unwrap());
        let (_, quiet_p99) = on_time(&mut quiet_hb);
        let (_, storm_p99) = on_time(&mut storm_hb);
        let (qr50, qr99, _) = percentiles(&mut quiet_reads);
        let (sr50, sr99, _) = percentiles(&mut storm_reads);
        let bound = INTERVAL + Duration::from_secs(1);
        println!(
            "  storm: {} agents' process SIGKILLed: first released after {}, last after {}   bound one interval + 1 s = {}   ratio {:.2}x   target: {}",
            doomed_ids.len(),
            msf(first),
            msf(last),
            msf(bound),
            last.as_secs_f64() / bound.as_secs_f64(),
            verdict(last <= bound)
        );
        println!(
            "  storm: healthy half's heartbeat lateness p99 {} ({} samples)   baseline quiet p99 {}   target <= 50 ms: {}",
            msf(storm_p99),
            storm_hb.len(),
            msf(quiet_p99),
            verdict(storm_p99 <= Duration::from_millis(50))
        );
        println!(
            "  storm: healthy half's reads p50 {} p99 {} ({} reads, {failed} not verified)   baseline quiet p50 {} p99 {} ({} reads)",
            msf(sr50),
            msf(sr99),
            storm_reads.len(),
            msf(qr50),
            msf(qr99),
            quiet_reads.len()
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut now = proc_of(me);
        while now.fds > p_b.fds && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
            now = proc_of(me);
        }
        println!(
            "  storm: decode fds {} with both processes, {} with the healthy one alone before, {} after the storm: {}",
            p_ab.fds,
            p_b.fds,
            now.fds,
            verdict(now.fds <= p_b.fds)
        );
    } else {
        for e in &doomed_ids {
            let _ = d
                .handle
                .peer_gone(PeerRef::Engine(e.clone()), GoneMode::Drain);
        }
        releases_of(&mut d.events, &doomed_ids, Duration::from_secs(60)).await;
    }
    for e in &healthy_ids {
        let _ = d
            .handle
            .peer_gone(PeerRef::Engine(e.clone()), GoneMode::Drain);
    }
    releases_of(&mut d.events, &healthy_ids, Duration::from_secs(60)).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut now = proc_of(me);
    while now.fds > p0.fds && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        now = proc_of(me);
    }
    println!(
        "  after every release: decode fds {} (before the loads {}), resident {:.1} MiB (before {:.1} MiB, with all {:.1} MiB)   target all fds back: {}",
        now.fds,
        p0.fds,
        rss_bytes() as f64 / (1 << 20) as f64,
        rss0 as f64 / (1 << 20) as f64,
        rss_ab as f64 / (1 << 20) as f64,
        verdict(now.fds <= p0.fds)
    );
    // Where the resident memory is (issue 47, item 4: it did not come back).
    println!("          resident before the loads: {resident0}");
    println!("          resident with all:         {resident_ab}");
    println!(
        "          resident after release:    {}",
        Resident::of(std::process::id())
    );
    drop(healthy);
    d.shutdown.cancel();
    let _ = d.task.await;
    drop(b);
}

/// One prefill receiving the heartbeats of `counts` decode agents (each
/// its own NIXL agent in this process, one `HB:` a second each, spread
/// over the second), against the same prefill with none; then one
/// reader's latency against it, with them heartbeating. Run for the
/// prefill as built (`--idle-poll-ms 10`: a heartbeat leaves it at its
/// idle pace) and, in the same run, for one that polls every 1 ms as it
/// did before whenever notifications kept coming (`--idle-poll-ms 1`).
async fn fan_in(rt: &'static nixl_agent::Runtime, counts: &[usize], window: Duration) {
    println!("real_scale: fan-in at one prefill (one engine, 1 rank), heartbeats at 1 Hz from each decode agent");
    for idle_poll in ["10", "1"] {
        fan_in_at(rt, counts, window, idle_poll).await;
    }
}

async fn fan_in_at(
    rt: &'static nixl_agent::Runtime,
    counts: &[usize],
    window: Duration,
    idle_poll: &str,
) {
    let host = Host::start_with(1, &["--idle-poll-ms", idle_poll]);
    let pid = host.pid();
    let (_, addr) = host.engines[0].clone();
    let reply = nixl_keepalive_cli::pd::decode::fetch(&addr, Duration::from_secs(5))
        .await
        .expect("fetch");
    let target = reply.ranks[0].agent.clone();
    let metadata = reply.ranks[0].metadata.clone();
    let d = start_decode(rt, &format!("fan-in-{idle_poll}"));
    let reader = match d.decoder.connect(&addr, None).await.expect("handshake") {
        Found::New(c) => Arc::new(vec![c]),
        Found::Unchanged => unreachable!(),
    };
    let max = counts.iter().copied().max().unwrap_or(0);
    let notifiers: Arc<Vec<Agent>> = Arc::new(
        (0..max)
            .map(|i| {
                let agent = Agent::new(
                    rt,
                    &format!("bench-fan-in-{}-{idle_poll}-{i}", std::process::id()),
                    &AgentConfig::default(),
                )
                .expect("notifier agent");
                agent.load_remote_metadata(&metadata).expect("load");
                agent
            })
            .collect(),
    );
    println!("  the prefill with --idle-poll-ms {idle_poll}:");
    let mut idle = 0.0;
    for &k in std::iter::once(&0).chain(counts) {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let thread = {
            let (notifiers, stop, sent, target) = (
                notifiers.clone(),
                stop.clone(),
                sent.clone(),
                target.clone(),
            );
            std::thread::spawn(move || {
                if k == 0 {
                    return;
                }
                let step = INTERVAL / k as u32;
                let mut next = Instant::now();
                let mut i = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    let agent = &notifiers[i % k];
                    if agent.gen_notif(&target, b"HB:").is_ok() {
                        sent.fetch_add(1, Ordering::Relaxed);
                    }
                    let _ = agent.get_notifs();
                    i += 1;
                    next += step;
                    std::thread::sleep(next.saturating_duration_since(Instant::now()));
                }
            })
        };
        tokio::time::sleep(Duration::from_secs(2)).await;
        // Heartbeats alone first (no read keeps the prefill busy), then
        // one reader beside them.
        let sent0 = sent.load(Ordering::Relaxed);
        let cpu0 = cpu_of(pid);
        tokio::time::sleep(window).await;
        let share = (cpu_of(pid) - cpu0).as_secs_f64() / window.as_secs_f64();
        let got = sent.load(Ordering::Relaxed) - sent0;
        let on = Arc::new(AtomicBool::new(true));
        let lat = Arc::new(Mutex::new(Vec::new()));
        let r = spawn_reader(d.decoder.clone(), reader.clone(), on.clone(), lat.clone());
        tokio::time::sleep(window / 2).await;
        on.store(false, Ordering::Relaxed);
        let _ = r.await;
        stop.store(true, Ordering::Relaxed);
        let _ = thread.join();
        let mut reads = std::mem::take(&mut *lat.lock().unwrap());
        let (r50, r99, _) = percentiles(&mut reads);
        if k == 0 {
            idle = share;
            println!(
                "    0 decode agents (baseline): prefill CPU {:.2}% of a core; one reader's reads p50 {} p99 {}",
                share * 100.0,
                msf(r50),
                msf(r99)
            );
            continue;
        }
        let added = share - idle;
        let per = added.max(0.0) * window.as_secs_f64() * 1e6 / got.max(1) as f64;
        let verdict_line = if k == 100 {
            format!("   target <= 1% of a core: {}", verdict(share <= 0.01))
        } else {
            String::new()
        };
        println!(
            "    {k} decode agents: prefill CPU {:.2}% of a core ({got} heartbeats in {:.0} s: {:+.2}% over the idle prefill, {per:.1} us each); one reader's reads beside them p50 {} p99 {}{verdict_line}",
            share * 100.0,
            window.as_secs_f64(),
            added * 100.0,
            msf(r50),
            msf(r99)
        );
    }
    drop(reader);
    d.shutdown.cancel();
    let _ = d.task.await;
    drop(host);
}

/// Endpoint events (issue 45) on and off: `n` real agents (two hosts of
/// n/2), one decode with the events off, then one with them on, each
/// measured over `window` after `warm`; then `soak` with the events on and
/// nothing dying: no release, no endpoint failure. Every decode retires
/// its engines (drain) before the next starts.
async fn events_part(
    rt: &'static nixl_agent::Runtime,
    n: usize,
    windows: (Duration, Duration),
    soak: Duration,
) {
    let (warm, window) = windows;
    let (a, b) = (Host::start(n / 2), Host::start(n - n / 2));
    let mut shares = Vec::new();
    for on in [false, true, true] {
        let soaking = shares.len() == 2;
        let config = config()
            .to_builder()
            .endpoint_events(on)
            .build()
            .expect("config");
        let tag = format!("events-{on}-{}", shares.len());
        let mut d = start_decode_with(rt, &tag, config);
        d.timed.put(b.agents(), 0);
        d.timed.put(a.agents(), 1);
        let mut conns = connect_all(&d.decoder, &a).await;
        conns.extend(connect_all(&d.decoder, &b).await);
        let failures_before = nixl_agent::failures::counts();
        tokio::time::sleep(warm).await;
        let measured = steady(&d.timed, if soaking { soak } else { window }).await;
        let failures = nixl_agent::failures::counts().failures - failures_before.failures;
        let mut released = 0;
        let mut unreachable = 0;
        while let Ok(e) = d.events.try_recv() {
            match e {
                Event::Released { .. } => released += 1,
                Event::Unreachable { .. } => unreachable += 1,
                _ => {}
            }
        }
        let all: usize = measured.samples.iter().map(Vec::len).sum();
        if soaking {
            println!(
                "  events on, {n} healthy agents for {:.0} s: {all} heartbeats, {failures} endpoint failures, {unreachable} marked unreachable, {released} released   target 0 released: {}",
                soak.as_secs_f64(),
                verdict(released == 0 && unreachable == 0)
            );
        } else {
            println!(
                "  events {}: the service's threads {:.2}% of a core, the whole process {:.2}% ({all} heartbeats; {failures} endpoint failures, {released} released)",
                if on { "on " } else { "off" },
                measured.service() * 100.0,
                measured.process * 100.0
            );
            shares.push(measured.service());
        }
        let ids: Vec<EngineId> = conns.iter().map(|c| c.engine.id().clone()).collect();
        for e in &ids {
            let _ = d
                .handle
                .peer_gone(PeerRef::Engine(e.clone()), GoneMode::Drain);
        }
        releases_of(&mut d.events, &ids, Duration::from_secs(120)).await;
        drop(conns);
        d.shutdown.cancel();
        let _ = d.task.await;
        if shares.len() == 2 && !soaking && on {
            let ratio = shares[1] / shares[0].max(1e-9);
            println!(
                "  endpoint events, {n} agents: on {:.2}% vs off {:.2}% of a core: ratio {ratio:.2}x   target <= 1.1x: {}",
                shares[1] * 100.0,
                shares[0] * 100.0,
                verdict(ratio <= 1.1)
            );
        }
    }
    drop((a, b));
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    // SKIPPED without it (a benchmark has no "ignored"), or a panic with
    // NIXL_KEEPALIVE_REQUIRE_REAL=1.
    let rt = match nixl_agent::Runtime::get() {
        Ok(rt) => rt,
        Err(e) => {
            nixl_agent::testing::fail_when_required_and_missing();
            eprintln!("SKIPPED: real_scale: {e}");
            return;
        }
    };
    let (sizes, notifiers, windows): (&[usize], &[usize], _) = if quick() {
        (
            &[20, 60],
            &[10, 20],
            (Duration::from_secs(2), Duration::from_secs(4)),
        )
    } else {
        (
            &[100, 300, 1000],
            &[10, 50, 100],
            (Duration::from_secs(3), Duration::from_secs(10)),
        )
    };
    println!("real_scale: {} (loopback UCX, DRAM)", machine());
    let runtime = common::two_worker_runtime();
    // `-- fan-in` or `-- sizes`: that part alone.
    let only = |part: &str| {
        let parts = ["fan-in", "sizes", "events"];
        let asked: Vec<String> = std::env::args()
            .filter(|a| parts.contains(&a.as_str()))
            .collect();
        asked.is_empty() || asked.iter().any(|a| a == part)
    };
    // Numbers among the arguments (`-- sizes 1000`): those sizes alone.
    let asked: Vec<usize> = std::env::args().filter_map(|a| a.parse().ok()).collect();
    let sizes: &[usize] = if asked.is_empty() { sizes } else { &asked };
    runtime.block_on(async {
        let largest = *sizes.last().expect("sizes");
        if only("sizes") {
            for &n in sizes {
                size(rt, n, n == largest, windows).await;
            }
        }
        if only("fan-in") {
            fan_in(rt, notifiers, windows.1).await;
        }
        if only("events") {
            let (n, soak) = if quick() {
                (60, Duration::from_secs(20))
            } else {
                (1000, Duration::from_secs(600))
            };
            println!("real_scale: endpoint events on vs off, {n} real remote agents at 1 Hz; then a soak with them on");
            events_part(rt, n, windows, soak).await;
        }
    });
}

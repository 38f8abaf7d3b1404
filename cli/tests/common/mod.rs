//! Shared by the real-runtime tests: real `nixl-keepalive prefill`
//! processes, a decode side in the test process ([`DecodeSide`]), a real
//! `decode` process ([`decode::DecodeProc`]), waiting for a state with a
//! deadline ([`wait`]), and measurement output that shows in CI logs even
//! for passing tests.
//!
//! Every wait here polls or receives what it names until a deadline and,
//! when the deadline passes, panics with what it saw: events
//! ([`DecodeSide::wait_for`]), stdout lines ([`PrefillProc::wait_line`],
//! [`decode::DecodeProc::wait_nth`]), metrics
//! ([`decode::DecodeProc::wait_metric`]), any condition
//! ([`wait::until`]). A test's deadline is the bound under test plus
//! [`wait::MARGIN`].
#![allow(dead_code)]

pub mod decode;
pub mod etcd;
pub mod procfs;
pub mod wait;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nixl_agent::{Agent, AgentConfig, Runtime};
use nixl_keepalive::transport::nixl::{NixlTransport, ProgressPoller};
use nixl_keepalive::{Config, EngineId, Event, PeerAddr};
use nixl_keepalive_cli::pd::decode::{DecodeOptions, Decoder};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

/// Every test binary that includes this module holds real tests, ignored
/// without the NIXL runtime (cfg `nixl_runtime`, from nixl-sys's build
/// script); a run that requires the runtime
/// (`NIXL_KEEPALIVE_REQUIRE_REAL=1`, CI) fails here instead of passing
/// with every one of them ignored.
#[test]
fn the_real_runtime_is_there_when_required() {
    nixl_agent::testing::fail_when_required_and_missing();
}

/// Real tests take this lock: one at a time in a test binary, so the suite
/// fits a 2-core machine and timings are not skewed by each other. Taking
/// it also pins UCX to loopback ([`pin_ucx_to_loopback`]).
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    let guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    pin_ucx_to_loopback();
    guard
}

/// The network devices UCX may use in the real tests: loopback only.
pub const UCX_DEVICES: &str = "lo";

/// Pins UCX to loopback (`UCX_NET_DEVICES=lo`) for the decode in this
/// process and every process the tests spawn (they inherit it), unless
/// `UCX_NET_DEVICES` is set already. Unpinned, UCX uses every interface it
/// finds, and a temporary address elsewhere on the machine that vanishes
/// (measured: another test's veth) hangs reads over it until their
/// timeout. Set once, under the [`serial`] lock: no other thread is inside
/// UCX then (real tests finish loading the runtime, `real_runtime`,
/// before they take the lock, and create UCX contexts only under it), and
/// UCX reads `UCX_*` when a context is created.
pub fn pin_ucx_to_loopback() {
    static PIN: std::sync::Once = std::sync::Once::new();
    PIN.call_once(|| {
        if std::env::var_os("UCX_NET_DEVICES").is_none() {
            std::env::set_var("UCX_NET_DEVICES", UCX_DEVICES);
        }
    });
}

/// Prints a measurement straight to the stderr handle (libtest captures
/// `eprintln!` of passing tests; this is seen in CI logs) and appends it
/// to `<target tmp>/real-measurements.log`.
pub fn report(line: &str) {
    let test = std::thread::current().name().unwrap_or("?").to_string();
    let text = format!("MEASURED {test}: {line}");
    eprintln!("{text}");
    let _ = writeln!(std::io::stderr().lock(), "{text}");
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("real-measurements.log");
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = writeln!(f, "{text}");
    }
}

/// A name unique in this process.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A real `nixl-keepalive prefill` process.
pub struct PrefillProc {
    child: Child,
    /// Its side-channel address.
    pub addr: PeerAddr,
    /// Its engine id.
    pub engine: String,
    /// Its incarnation (one per start), as its READY line printed it.
    pub incarnation: String,
    /// Its pid.
    pub pid: u32,
    /// Where its stderr goes.
    pub log: std::path::PathBuf,
    /// Every engine it hosts (`--engines`), in the order of their READY
    /// lines; the first is the one of `addr`, `engine` and `incarnation`.
    pub hosted: Vec<HostedEngine>,
    /// Its stdout lines after the READY line (read on, so the pipe never
    /// fills); [`PrefillProc::wait_line`] takes them in order.
    lines: std::sync::mpsc::Receiver<String>,
    /// The lines taken from `lines` so far.
    seen: Mutex<Vec<String>>,
    gone: bool,
}

/// One engine of a prefill process, from its READY line.
#[derive(Clone, Debug)]
pub struct HostedEngine {
    pub engine: String,
    pub addr: PeerAddr,
    pub incarnation: String,
}

/// How to start a prefill.
#[derive(Clone, Debug, Default)]
pub struct PrefillSpec {
    /// `--engines` (default 1): one READY line is awaited per engine.
    pub engines: Option<u16>,
    /// `--listen` (default `127.0.0.1:0`).
    pub listen: Option<String>,
    /// `--engine-id`.
    pub engine_id: Option<String>,
    /// `--blocks` (default 8).
    pub blocks: Option<u32>,
    /// `--block-size` (default 64 KiB).
    pub block_size: Option<u64>,
    /// `--ranks` (default 1).
    pub ranks: Option<u16>,
    /// Extra environment (UCX settings).
    pub env: Vec<(String, String)>,
    /// Run it inside this network namespace (`ip netns exec`, which execs
    /// the prefill: the pid is the prefill's own).
    pub netns: Option<String>,
    /// Extra flags (`--etcd-endpoint ...`, `--lease-secs 2`).
    pub args: Vec<String>,
    /// Start a push-mode decode (`decode --push`: the same block owner,
    /// its blocks written by the test's prefill side) instead of a
    /// prefill. Its READY line says `DECODE READY`.
    pub push: bool,
}

/// A loopback address for a prefill to listen on, on a free port outside
/// the kernel's ephemeral range: a prefill restarted on its port must find
/// it free, and a port in that range can be taken meanwhile as the local
/// port of any outgoing connection (seen under load: a SIGKILLed
/// prefill's port "already in use" when its successor started).
pub fn listen_outside_ephemeral() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static TURN: AtomicU32 = AtomicU32::new(0);
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    let (first, span) = (10_000, low.saturating_sub(10_000).max(1000));
    let seed = std::process::id().wrapping_mul(2_654_435_761)
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
    for _ in 0..1000 {
        let turn = TURN.fetch_add(1, Ordering::Relaxed);
        let port = first + (seed.wrapping_add(turn.wrapping_mul(7919))) % span;
        if std::net::TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
            return format!("127.0.0.1:{port}");
        }
    }
    panic!("no free loopback port between {first} and {}", first + span);
}

impl PrefillProc {
    /// Starts a prefill and waits until it answers handshakes. Without a
    /// `listen` (and outside a namespace) it listens on a port of
    /// [`listen_outside_ephemeral`], chosen again if another process took
    /// it first.
    pub fn start(spec: &PrefillSpec) -> PrefillProc {
        if spec.listen.is_some() || spec.netns.is_some() {
            return Self::start_once(spec).unwrap_or_else(|e| panic!("{e}"));
        }
        let mut spec = spec.clone();
        for _ in 0..5 {
            spec.listen = Some(listen_outside_ephemeral());
            match Self::start_once(&spec) {
                Ok(p) => return p,
                Err(e) if e.contains("Address already in use") => continue,
                Err(e) => panic!("{e}"),
            }
        }
        panic!("no free port for a prefill after 5 tries");
    }

    fn start_once(spec: &PrefillSpec) -> Result<PrefillProc, String> {
        let log = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("{}.log", unique("prefill")));
        let bin = env!("CARGO_BIN_EXE_nixl-keepalive");
        let mut cmd = match &spec.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, bin]);
                c
            }
            None => Command::new(bin),
        };
        match spec.push {
            true => cmd.args(["decode", "--push"]),
            false => cmd.arg("prefill"),
        };
        cmd.args(["--listen", spec.listen.as_deref().unwrap_or("127.0.0.1:0")])
            .args(["--engines", &spec.engines.unwrap_or(1).to_string()])
            .args(["--blocks", &spec.blocks.unwrap_or(8).to_string()])
            .args([
                "--block-size",
                &spec.block_size.unwrap_or(64 << 10).to_string(),
            ])
            .args(["--ranks", &spec.ranks.unwrap_or(1).to_string()])
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("prefill log"));
        if let Some(id) = &spec.engine_id {
            cmd.args(["--engine-id", id]);
        }
        for (k, v) in &spec.env {
            cmd.env(k, v);
        }
        cmd.args(&spec.args);
        let mut child = cmd.spawn().expect("spawn nixl-keepalive prefill");
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        // Drains stdout for the process's life: UCX logs there too (its
        // ERROR lines can come before ours), and a closed pipe would make
        // its later writes fail.
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let engines = usize::from(spec.engines.unwrap_or(1));
        let ready = if spec.push {
            "DECODE READY"
        } else {
            "PREFILL READY"
        };
        // Each engine's start (agents, memory) takes tens of ms, more on a
        // loaded machine.
        let deadline =
            Instant::now() + Duration::from_secs(30) + engines as u32 * Duration::from_millis(200);
        let mut before = Vec::new();
        let mut hosted = Vec::with_capacity(engines);
        while hosted.len() < engines {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) if line.starts_with(ready) => {
                    let field = |k: &str| {
                        line.split_whitespace()
                            .find_map(|w| w.strip_prefix(k))
                            .unwrap_or_else(|| panic!("no {k} in {line:?}"))
                            .to_string()
                    };
                    hosted.push(HostedEngine {
                        engine: field("engine="),
                        addr: PeerAddr::from(field("listen=")),
                        incarnation: field("incarnation="),
                    });
                }
                Ok(l) => before.push(l),
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!(
                        "prefill never got ready ({e}; {} of {engines} engines were); stdout: {before:#?}; log: {}",
                        hosted.len(),
                        std::fs::read_to_string(&log).unwrap_or_default()
                    ));
                }
            }
        }
        let first = hosted[0].clone();
        Ok(PrefillProc {
            addr: first.addr,
            engine: first.engine,
            incarnation: first.incarnation,
            hosted,
            pid: child.id(),
            child,
            log,
            lines: rx,
            seen: Mutex::default(),
            gone: false,
        })
    }

    /// Waits (at most `within`) for its next stdout line that starts with
    /// `prefix`, taking the lines before it; on the deadline panics with
    /// every line it printed and its log's tail.
    pub fn wait_line(&self, prefix: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.lock().unwrap().push(l.clone());
                    if l.starts_with(prefix) {
                        return l;
                    }
                }
                Err(e) => {
                    let log = self.log_text();
                    let tail: Vec<&str> = log.lines().rev().take(20).collect();
                    panic!(
                        "prefill {} printed no {prefix:?} line within {within:?} ({e}); stdout after READY: {:#?}\nlog tail (newest first): {tail:#?}",
                        self.pid,
                        self.seen.lock().unwrap()
                    )
                }
            }
        }
    }

    /// The stdout lines it printed that were not taken yet, without
    /// waiting (they are then taken).
    pub fn take_lines(&self) -> Vec<String> {
        let fresh: Vec<String> = self.lines.try_iter().collect();
        self.seen.lock().unwrap().extend(fresh.iter().cloned());
        fresh
    }

    /// The `--listen` to restart on the same port.
    pub fn listen(&self) -> String {
        self.addr.to_string()
    }

    /// SIGKILL, and reap it. Returns when the signal was sent.
    pub fn kill(&mut self) -> Instant {
        let at = Instant::now();
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.gone = true;
        at
    }

    /// Its log (stderr) so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, and waits (at most 20 s) for it to exit; returns its exit
    /// status and its whole log.
    pub fn stop(&mut self) -> (std::process::ExitStatus, String) {
        self.signal("TERM");
        let deadline = Instant::now() + Duration::from_secs(20);
        let status = loop {
            if let Some(s) = self.child.try_wait().expect("wait prefill") {
                break s;
            }
            assert!(
                Instant::now() < deadline,
                "prefill did not stop within 20 s of SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        self.gone = true;
        (status, self.log_text())
    }

    /// Sends a signal with the `kill` command (`STOP`, `CONT`).
    /// Sends `sig` (a name: `STOP`, `CONT`, ...). For `STOP`, returns
    /// once the process is stopped (its /proc state is `T`): kill returns
    /// before the stop takes effect, and a read posted in between is served
    /// by a prefill that still runs.
    pub fn signal(&self, sig: &str) {
        let st = Command::new("kill")
            .args([&format!("-{sig}"), &self.pid.to_string()])
            .status()
            .expect("run kill");
        assert!(st.success(), "kill -{sig} {} failed", self.pid);
        if sig == "STOP" {
            let stat = format!("/proc/{}/stat", self.pid);
            wait::until(
                &format!("prefill {} stopped", self.pid),
                wait::MARGIN,
                || {
                    let text = std::fs::read_to_string(&stat).unwrap_or_default();
                    let state = text
                        .rsplit_once(')')
                        .map(|(_, rest)| rest.trim_start().chars().next());
                    match state {
                        Some(Some('T' | 't')) => Ok(()),
                        _ => Err(text),
                    }
                },
            );
        }
    }
}

impl Drop for PrefillProc {
    fn drop(&mut self) {
        if !self.gone {
            let _ = Command::new("kill")
                .args(["-CONT", &self.pid.to_string()])
                .status();
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The decode side in the test process: a real agent (no NIXL progress
/// thread; our poller every 5 ms), the transport, the service, a decoder.
pub struct DecodeSide {
    pub transport: Arc<NixlTransport>,
    pub decoder: Arc<Decoder>,
    pub events: broadcast::Receiver<Event>,
    /// Every event taken from `events` so far ([`DecodeSide::wait_for`],
    /// [`DecodeSide::drain`]), in order: what a failed wait prints.
    pub seen: Vec<Event>,
    /// Events the receiver missed (it lagged): a wait that times out says
    /// so.
    pub missed: u64,
    pub shutdown: CancellationToken,
    pub task: tokio::task::JoinHandle<
        nixl_keepalive::Stopped<nixl_keepalive::transport::nixl::RemoteDlists>,
    >,
    _progress: ProgressPoller,
}

/// A service configuration with heartbeats every `interval`.
pub fn config(interval: Duration) -> Config {
    Config::builder()
        .heartbeat_interval(Some(interval))
        .jitter(interval / 10)
        .rate_limit(Duration::from_millis(100), 4)
        .metrics_period(None)
        .seed(7)
        .build()
        .expect("valid config")
}

/// For tests of what the handshake finds (a restart, a replacement):
/// heartbeats once a minute and endpoint events off, so that nothing else
/// finds the killed process first.
pub fn handshake_only_config() -> Config {
    config(Duration::from_secs(60))
        .to_builder()
        .endpoint_events(false)
        .build()
        .expect("valid config")
}

/// The decode agent and transport.
pub fn decode_transport(rt: &'static Runtime) -> (Arc<NixlTransport>, ProgressPoller) {
    let agent = Agent::new(rt, &unique("decode"), &AgentConfig::default()).expect("decode agent");
    let transport = Arc::new(NixlTransport::new(agent));
    let progress = transport.spawn_progress(Duration::from_millis(5));
    (transport, progress)
}

impl DecodeSide {
    /// Starts the service and a decoder (call inside a tokio runtime).
    pub fn start(rt: &'static Runtime, config: Config, options: DecodeOptions) -> DecodeSide {
        let (transport, progress) = decode_transport(rt);
        let shutdown = CancellationToken::new();
        let (handle, task) = nixl_keepalive::spawn(transport.clone(), config, shutdown.clone());
        let events = handle.subscribe();
        let decoder = Decoder::new(handle, transport.clone(), options);
        DecodeSide {
            transport,
            decoder,
            events,
            seen: Vec::new(),
            missed: 0,
            shutdown,
            task,
            _progress: progress,
        }
    }

    /// Waits (up to `within`) for the next event `pick` accepts; returns
    /// it with when it arrived. On the deadline panics with every event
    /// this wait saw (and how many the receiver missed, if it lagged).
    pub async fn wait_for<T>(
        &mut self,
        within: Duration,
        mut pick: impl FnMut(&Event) -> Option<T>,
    ) -> (T, Instant) {
        let deadline = tokio::time::Instant::now() + within;
        let first = self.seen.len();
        loop {
            match tokio::time::timeout_at(deadline, self.events.recv()).await {
                Ok(Ok(e)) => {
                    let picked = pick(&e);
                    self.seen.push(e);
                    if let Some(t) = picked {
                        return (t, Instant::now());
                    }
                }
                Ok(Err(broadcast::error::RecvError::Lagged(n))) => self.missed += n,
                Ok(Err(e)) => panic!(
                    "event channel closed ({e}) while waiting; events seen meanwhile: {:#?}",
                    &self.seen[first..]
                ),
                Err(_) => panic!(
                    "no matching event within {within:?}; events seen meanwhile: {:#?}; missed (lagged): {}",
                    &self.seen[first..],
                    self.missed
                ),
            }
        }
    }

    /// Every event received so far and not yet taken, without waiting:
    /// for what must *not* have happened over a window the test waited
    /// through.
    pub fn drain(&mut self) -> Vec<Event> {
        let mut v = Vec::new();
        loop {
            match self.events.try_recv() {
                Ok(e) => v.push(e),
                Err(broadcast::error::TryRecvError::Lagged(n)) => self.missed += n,
                Err(_) => break,
            }
        }
        self.seen.extend(v.iter().cloned());
        v
    }

    /// Waits `watch` and asserts that `engine` was not released meanwhile
    /// (a frozen peer fenced by its given-up transfers), saying `what`.
    pub async fn assert_fenced_for(&mut self, engine: &EngineId, watch: Duration, what: &str) {
        tokio::time::sleep(watch).await;
        let seen = self.drain();
        assert!(
            !seen
                .iter()
                .any(|e| matches!(e, Event::Released { engine: id, .. } if id == engine)),
            "{what}: released under its given-up transfers: {seen:?}"
        );
    }

    /// Stops the service; asserts it released everything.
    pub async fn stop(self) {
        self.shutdown.cancel();
        let stopped = self.task.await.expect("service task");
        assert!(stopped.unreleased.is_empty(), "engines still held at stop");
    }
}

/// Runs an async test body on a 2-worker runtime (call with the
/// [`serial`] lock held: a std lock must not be held across awaits).
pub fn block_on<F: std::future::Future>(body: F) -> F::Output {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
        .block_on(body)
}

/// Runs `cmd` (a child of this test binary, or any command) with stdout
/// and stderr captured, for at most `within`; returns its output. On the
/// deadline kills it and panics with both.
pub fn run_child(mut cmd: Command, what: &str, within: Duration) -> std::process::Output {
    use std::io::Read;
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: cannot spawn: {e}"));
    let mut out = child.stdout.take().expect("stdout");
    let mut err = child.stderr.take().expect("stderr");
    let out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let err = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let deadline = Instant::now() + within;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for the child") {
            break Some(s);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (stdout, stderr) = (out.join().unwrap(), err.join().unwrap());
    match status {
        Some(status) => std::process::Output {
            status,
            stdout,
            stderr,
        },
        None => panic!(
            "{what}: still running after {within:?}, killed; stdout:\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&stdout),
            String::from_utf8_lossy(&stderr)
        ),
    }
}

/// Milliseconds, for reports.
pub fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

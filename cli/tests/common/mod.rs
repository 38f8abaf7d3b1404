//! Shared by the real-runtime tests: real `nixl-keepalive prefill`
//! processes, a decode side in the test process, and measurement output
//! that shows in CI logs even for passing tests.
#![allow(dead_code)]

pub mod decode;
pub mod etcd;
pub mod procfs;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nixl_keepalive::nixl_transport::{NixlTransport, ProgressPoller};
use nixl_keepalive::{Config, Event, PeerAddr};
use nixl_keepalive_cli::pd::decode::{DecodeOptions, Decoder};
use nixl_sys::{Agent, AgentConfig, Runtime};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

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
/// UCX then (real tests finish loading the runtime, `runtime_or_skip`,
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
    /// Its pid.
    pub pid: u32,
    /// Where its stderr goes.
    pub log: std::path::PathBuf,
    /// Its stdout lines after the READY line (read on, so the pipe never
    /// fills).
    pub lines: std::sync::mpsc::Receiver<String>,
    gone: bool,
}

/// How to start a prefill.
#[derive(Clone, Debug, Default)]
pub struct PrefillSpec {
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
}

impl PrefillProc {
    /// Starts a prefill and waits until it answers handshakes.
    pub fn start(spec: &PrefillSpec) -> PrefillProc {
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
        cmd.arg("prefill")
            .args(["--listen", spec.listen.as_deref().unwrap_or("127.0.0.1:0")])
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
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut before = Vec::new();
        let line = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(l) if l.starts_with("PREFILL READY") => break l,
                Ok(l) => before.push(l),
                Err(e) => panic!(
                    "prefill never got ready ({e}); stdout: {before:#?}; log: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                ),
            }
        };
        let field = |k: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(k))
                .unwrap_or_else(|| panic!("no {k} in {line:?}"))
                .to_string()
        };
        assert!(line.starts_with("PREFILL READY"), "{line}");
        PrefillProc {
            addr: PeerAddr::from(field("listen=")),
            engine: field("engine="),
            pid: child.id(),
            child,
            log,
            lines: rx,
            gone: false,
        }
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
    pub fn signal(&self, sig: &str) {
        let st = Command::new("kill")
            .args([&format!("-{sig}"), &self.pid.to_string()])
            .status()
            .expect("run kill");
        assert!(st.success(), "kill -{sig} {} failed", self.pid);
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
    pub shutdown: CancellationToken,
    pub task: tokio::task::JoinHandle<
        nixl_keepalive::Stopped<nixl_keepalive::nixl_transport::RemoteDlists>,
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
            shutdown,
            task,
            _progress: progress,
        }
    }

    /// Waits (up to `within`) for the first event `pick` accepts; returns
    /// it with when it arrived.
    pub async fn wait_for<T>(
        &mut self,
        within: Duration,
        mut pick: impl FnMut(&Event) -> Option<T>,
    ) -> (T, Instant) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, self.events.recv()).await {
                Ok(Ok(e)) => {
                    if let Some(t) = pick(&e) {
                        return (t, Instant::now());
                    }
                }
                Ok(Err(broadcast::error::RecvError::Lagged(_))) => {}
                Ok(Err(e)) => panic!("event channel closed: {e}"),
                Err(_) => panic!("no matching event within {within:?}"),
            }
        }
    }

    /// Every event received so far, without waiting.
    pub fn drain(&mut self) -> Vec<Event> {
        let mut v = Vec::new();
        while let Ok(e) = self.events.try_recv() {
            v.push(e);
        }
        v
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

/// A real `nixl-keepalive decode` process: its stdout lines as they come
/// (with when), its stderr in a file, its metrics on a free port.
pub struct DecodeProc {
    child: Child,
    /// `host:port` of its `/metrics`.
    pub metrics: String,
    /// Where its stderr goes.
    pub log: std::path::PathBuf,
    lines: std::sync::mpsc::Receiver<(String, Instant)>,
    /// Every stdout line seen so far, in order.
    pub seen: Vec<String>,
}

impl DecodeProc {
    /// Starts `nixl-keepalive decode` with `args` and `env` (plus a
    /// metrics address).
    pub fn start(args: &[&str], env: &[(&str, &str)]) -> DecodeProc {
        let metrics = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .to_string();
        let log = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("{}.log", unique("decode")));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_nixl-keepalive"));
        cmd.arg("decode")
            .args(args)
            .args(["--metrics-addr", &metrics])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("decode log"));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn nixl-keepalive decode");
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send((line, Instant::now()));
            }
        });
        DecodeProc {
            child,
            metrics,
            log,
            lines: rx,
            seen: Vec::new(),
        }
    }

    /// Waits (up to `within`) for a stdout line containing `what`; returns
    /// when it came. Panics with everything seen when it does not.
    pub fn wait(&mut self, what: &str, within: Duration) -> Instant {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok((line, at)) => {
                    let hit = line.contains(what);
                    self.seen.push(line);
                    if hit {
                        return at;
                    }
                }
                Err(e) => panic!(
                    "decode never printed {what:?} within {within:?} ({e}); stdout so far:\n{}\nstderr:\n{}",
                    self.seen.join("\n"),
                    self.log_text()
                ),
            }
        }
    }

    /// Takes every line printed so far, for `for` seconds more.
    pub fn collect_for(&mut self, d: Duration) {
        let deadline = Instant::now() + d;
        while let Ok((line, _)) = self
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            self.seen.push(line);
        }
    }

    /// The lines seen so far that contain `what`.
    pub fn lines_with(&self, what: &str) -> Vec<&String> {
        self.seen.iter().filter(|l| l.contains(what)).collect()
    }

    /// Its stderr so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `GET /metrics`.
    pub fn scrape(&self) -> String {
        use std::io::Read;
        let mut s = std::net::TcpStream::connect(&self.metrics).expect("metrics endpoint");
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut body = String::new();
        let _ = s.read_to_string(&mut body);
        body
    }

    /// SIGTERM, and waits (at most 30 s) for it to exit.
    pub fn stop(mut self) -> std::process::ExitStatus {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(s) = self.child.try_wait().expect("wait decode") {
                return s;
            }
            assert!(Instant::now() < deadline, "decode did not stop within 30 s");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for DecodeProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value of a metric line that starts with `name` (labels included),
/// if present.
pub fn metric(scrape: &str, name: &str) -> Option<f64> {
    scrape
        .lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Milliseconds, for reports.
pub fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

//! Detection-to-release after a real kill, on the real NIXL runtime: 20
//! `nixl-keepalive prefill` processes SIGKILLed one after the other while
//! the decode side (service + NixlTransport, no reads: heartbeats alone)
//! watches. Prints p50/p99 of kill -> REMOTE_DISCONNECT (detection),
//! detection -> release, and kill -> release, against the heartbeat
//! interval (the baseline), and kill -> release p99 against the longest
//! gap the schedule allows between two heartbeats to one peer: interval +
//! jitter + half a slot (a round goes out at the `HEARTBEAT_SLOT` boundary
//! nearest its jittered deadline; both intervals here are long enough for
//! the full slot). An idle crashed peer is found by the first
//! heartbeat after the kill, so that gap is its bound (the one the service
//! reports at start-up adds a second of slack on top). Prints PASS/MISS;
//! never asserts on timing. `--quick` / `BENCH_QUICK=1`: 5 kills per
//! interval.
//!
//! Skips (prints SKIPPED, exits 0) without the runtime, unless
//! NIXL_KEEPALIVE_REQUIRE_REAL=1.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl_agent::{Agent, AgentConfig};
use nixl_keepalive::transport::nixl::NixlTransport;
use nixl_keepalive::{Config, EngineId, Event, PeerAddr};
use nixl_keepalive_cli::pd::decode::{DecodeOptions, Decoder, Found};
use tokio_util::sync::CancellationToken;

fn quick() -> bool {
    std::env::args().any(|a| a == "--quick")
        || std::env::var_os("BENCH_QUICK").is_some_and(|v| v != "0")
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

struct Prefill {
    child: std::process::Child,
    addr: PeerAddr,
    engine: EngineId,
}

fn start_prefill() -> Prefill {
    let mut child = Command::new(env!("CARGO_BIN_EXE_nixl-keepalive"))
        .args([
            "prefill",
            "--listen",
            "127.0.0.1:0",
            "--blocks",
            "4",
            "--block-size",
            "65536",
        ])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn prefill");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .expect("ready line");
    let field = |k: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .expect(k)
            .to_string()
    };
    Prefill {
        addr: PeerAddr::from(field("listen=")),
        engine: EngineId::from(field("engine=")),
        child,
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// What one set of kills measured, sorted.
struct Kills {
    detect: Vec<Duration>,
    release: Vec<Duration>,
    total: Vec<Duration>,
    /// Kill -> the kernel closed the prefill's sockets: EOF on a TCP
    /// connection to its side channel made just before the kill.
    floor: Vec<Duration>,
    /// Kill -> UCX ran the endpoint's error handler (events on only).
    callback: Vec<Duration>,
}

/// Waits on `stream` until the peer's socket is gone (EOF or reset) and
/// says when.
fn watch_eof(mut stream: std::net::TcpStream) -> std::thread::JoinHandle<Instant> {
    std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        loop {
            match std::io::Read::read(&mut stream, &mut buf) {
                Ok(0) | Err(_) => return Instant::now(),
                Ok(_) => {}
            }
        }
    })
}

async fn run(
    rt: &'static nixl_agent::Runtime,
    interval: Duration,
    kills: usize,
    endpoint_events: bool,
) -> Kills {
    let agent = Agent::new(
        rt,
        &format!(
            "bench-decode-{}-{}-{}",
            std::process::id(),
            interval.as_millis(),
            endpoint_events
        ),
        &AgentConfig::default(),
    )
    .expect("decode agent");
    // When UCX ran the handler, from the watch itself (events on).
    let callbacks = Arc::new(std::sync::Mutex::new(Vec::<(String, u64)>::new()));
    let _watch = endpoint_events.then(|| {
        let seen = callbacks.clone();
        agent
            .watch_endpoint_failures(move |f| {
                if let Some(remote) = f.remote_agent {
                    seen.lock().unwrap().push((remote.to_string(), f.at_ns));
                }
            })
            .expect("endpoint failures watched")
    });
    let transport = Arc::new(NixlTransport::new(agent));
    let _progress = transport.spawn_progress(Duration::from_millis(5));
    let jitter = interval / 10;
    let config = Config::builder()
        .heartbeat_interval(Some(interval))
        .jitter(jitter)
        // The per-engine rate cap (default 1 round/s) must not be what
        // limits a sub-second interval.
        .rate_limit(interval.min(Duration::from_secs(1)) / 4, 2)
        .metrics_period(None)
        .endpoint_events(endpoint_events)
        .build()
        .unwrap();
    let shutdown = CancellationToken::new();
    let (handle, task) = nixl_keepalive::spawn(transport.clone(), config, shutdown.clone());
    let mut events = handle.subscribe();
    let decoder = Decoder::new(
        handle,
        transport.clone(),
        DecodeOptions {
            ..DecodeOptions::default()
        },
    );
    let mut k = Kills {
        detect: Vec::new(),
        release: Vec::new(),
        total: Vec::new(),
        floor: Vec::new(),
        callback: Vec::new(),
    };
    for _ in 0..kills {
        let mut p = start_prefill();
        let agents = match decoder.connect(&p.addr, None).await.expect("handshake") {
            Found::New(c) => c.remote.agents.clone(),
            Found::Unchanged => unreachable!(),
        };
        // Kill at a random point of the heartbeat cycle.
        let wait = interval.mul_f64(1.0 + rand::random::<f64>());
        tokio::time::sleep(wait).await;
        let side = std::net::TcpStream::connect(p.addr.as_str()).expect("side channel");
        let eof = watch_eof(side);
        let killed = Instant::now();
        let killed_ns = nixl_agent::failures::monotonic_ns();
        p.child.kill().unwrap();
        let mut detected = None;
        loop {
            match tokio::time::timeout(Duration::from_secs(60), events.recv()).await {
                Ok(Ok(Event::Unreachable { engine, .. })) if engine == p.engine => {
                    detected = Some(Instant::now())
                }
                Ok(Ok(Event::Released { engine, .. })) if engine == p.engine => {
                    let now = Instant::now();
                    let d = detected.unwrap_or(now);
                    k.detect.push(d - killed);
                    k.release.push(now - d);
                    k.total.push(now - killed);
                    break;
                }
                Ok(Ok(_)) | Ok(Err(tokio::sync::broadcast::error::RecvError::Lagged(_))) => {}
                other => panic!("no release of {} within 60 s: {other:?}", p.engine),
            }
        }
        k.floor.push(eof.join().expect("eof watcher") - killed);
        if endpoint_events {
            let seen = callbacks.lock().unwrap();
            let first = seen
                .iter()
                .filter(|(remote, _)| agents.iter().any(|a| a.as_str() == remote))
                .map(|(_, at)| *at)
                .min();
            if let Some(at) = first {
                k.callback
                    .push(Duration::from_nanos(at.saturating_sub(killed_ns)));
            }
        }
        let _ = p.child.wait();
    }
    shutdown.cancel();
    let _ = task.await;
    for v in [
        &mut k.detect,
        &mut k.release,
        &mut k.total,
        &mut k.floor,
        &mut k.callback,
    ] {
        v.sort();
    }
    k
}

/// The heartbeat path: its rows against the longest gap between two
/// heartbeats.
fn print_heartbeat_rows(interval: Duration, kills: usize, k: &Kills) {
    let jitter = interval / 10;
    let iv = ms(interval);
    let p99 = percentile(&k.total, 0.99);
    println!(
        "heartbeat {:>6.0} ms, events off | kills {kills:>2} | kill->detect p50 {:>7.1} ms p99 {:>7.1} ms | detect->release p50 {:>5.2} ms p99 {:>5.2} ms | kill->release p50 {:>7.1} ms ({:.2}x interval) p99 {:>7.1} ms ({:.2}x interval)",
        iv,
        ms(percentile(&k.detect, 0.5)),
        ms(percentile(&k.detect, 0.99)),
        ms(percentile(&k.release, 0.5)),
        ms(percentile(&k.release, 0.99)),
        ms(percentile(&k.total, 0.5)),
        ms(percentile(&k.total, 0.5)) / iv,
        ms(p99),
        ms(p99) / iv,
    );
    // The slot is shorter only for intervals under two slots (40 ms).
    assert!(interval >= 2 * nixl_keepalive::HEARTBEAT_SLOT);
    let gap = interval + jitter + nixl_keepalive::HEARTBEAT_SLOT / 2;
    println!(
        "heartbeat {iv:>6.0} ms, events off | kill->release p99 {:.1} ms vs the longest heartbeat gap (interval + jitter + half a slot) {:.1} ms: ratio {:.2}x (target <= 1x) {}",
        ms(p99),
        ms(gap),
        ms(p99) / ms(gap),
        if p99 <= gap { "PASS" } else { "MISS" }
    );
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let rt = match nixl_agent::Runtime::get() {
        Ok(rt) => rt,
        Err(e) => {
            if std::env::var("NIXL_KEEPALIVE_REQUIRE_REAL").is_ok_and(|v| v == "1") {
                panic!("NIXL_KEEPALIVE_REQUIRE_REAL=1 but the NIXL runtime is missing: {e}");
            }
            eprintln!("SKIPPED: real_detection: {e}");
            return;
        }
    };
    let kills = if quick() { 5 } else { 20 };
    println!("real_detection: SIGKILL of an idle prefill, detected by heartbeats alone (endpoint events off; UCX defaults, loopback)");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    for interval in [Duration::from_millis(250), Duration::from_secs(1)] {
        let k = runtime.block_on(run(rt, interval, kills, false));
        print_heartbeat_rows(interval, kills, &k);
    }
    println!("baseline: the interval (ratio = kill->release / interval); target: kill->release p99 within the longest gap between two heartbeats");
    // The default interval, with and without endpoint events, and the
    // floor (the kernel closing the killed prefill's sockets) measured
    // on the same kills.
    let interval = Duration::from_secs(5);
    println!("real_detection: SIGKILL of an idle prefill at the default 5 s heartbeat: endpoint events on vs off, against the socket-gone floor");
    let off = runtime.block_on(run(rt, interval, kills, false));
    print_heartbeat_rows(interval, kills, &off);
    let on = runtime.block_on(run(rt, interval, kills, true));
    let row = |name: &str, v: &[Duration]| {
        format!(
            "{name} p50 {:.1} ms p99 {:.1} ms",
            ms(percentile(v, 0.5)),
            ms(percentile(v, 0.99))
        )
    };
    println!(
        "heartbeat 5000 ms, events on | kills {kills:>2} | {} | {} | {} | {} | {} ({} of {kills} kills seen by the handler)",
        row("kill->release", &on.total),
        row("kill->detect", &on.detect),
        row("kill->UCX error handler", &on.callback),
        row("socket-gone floor", &on.floor),
        row("floor (events-off kills)", &off.floor),
        on.callback.len(),
    );
    let (p99_on, p99_off) = (percentile(&on.total, 0.99), percentile(&off.total, 0.99));
    let floor = percentile(&on.floor, 0.99);
    println!(
        "events on: kill->release p99 {:.1} ms (target <= 100 ms: {}), {:.2}x the floor's p99 {:.1} ms (target <= 3x: {}); events off: p99 {:.1} ms ({:.1}x events on)",
        ms(p99_on),
        if p99_on <= Duration::from_millis(100) { "PASS" } else { "MISS" },
        ms(p99_on) / ms(floor),
        ms(floor),
        if ms(p99_on) <= 3.0 * ms(floor) { "PASS" } else { "MISS" },
        ms(p99_off),
        ms(p99_off) / ms(p99_on),
    );
}

//! The control server under attack, on a real decode process limited to
//! 256 file descriptors (`prlimit`), while it heartbeats and reads a real
//! prefill: an idle flood of 400 connections kept up for the whole test,
//! slow-loris connections, oversize heads. The router still gets its
//! snapshot, reads go on, heartbeats go on, and a prefill restarted at the
//! same port during the flood is registered again.
//!
//! Before the server had a connection cap and head timeouts, the idle
//! connections were all held: with a 1024-fd limit 1,100 of them took the
//! decode's last descriptor, handshakes failed with EMFILE and a restarted
//! prefill was never registered.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{ms, report, serial, PrefillProc, PrefillSpec};
use nixl_agent::testing::real_runtime;

const FD_LIMIT: usize = 256;
const IDLE: usize = 400;
const LORIS: usize = 30;
const PATIENCE: Duration = Duration::from_secs(30);

struct Decode {
    child: Child,
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
    log: std::path::PathBuf,
}

impl Decode {
    fn wait_line(&self, parts: &[&str], after: Instant, within: Duration) -> (Instant, String) {
        let deadline = Instant::now() + within;
        loop {
            if let Some(hit) = self
                .lines
                .lock()
                .unwrap()
                .iter()
                .find(|(at, l)| *at >= after && parts.iter().all(|p| l.contains(p)))
                .cloned()
            {
                return hit;
            }
            if Instant::now() > deadline {
                let seen: Vec<String> = self
                    .lines
                    .lock()
                    .unwrap()
                    .iter()
                    .map(|(_, l)| l.clone())
                    .collect();
                panic!(
                    "decode printed no line with {parts:?} within {within:?}; stdout: {seen:#?}; log tail: {}",
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    /// `verified=` of the `reads:` summaries so far.
    fn verified(&self) -> Vec<(Instant, u64)> {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, l)| l.starts_with("reads:"))
            .filter_map(|(at, l)| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix("verified="))
                    .and_then(|n| n.parse().ok())
                    .map(|n| (*at, n))
            })
            .collect()
    }
}

impl Drop for Decode {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One request on a fresh connection; the whole answer.
fn http(addr: &str, raw: &[u8]) -> std::io::Result<String> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(raw)?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

fn status_and_json(answer: &str) -> (u16, serde_json::Value) {
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or("");
    (
        status,
        serde_json::from_str(body).unwrap_or(serde_json::Value::Null),
    )
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn the_control_server_under_floods_past_the_fd_limit_keeps_the_decoder_working() {
    let _rt = real_runtime();
    let _serial = serial();
    let mut p = PrefillProc::start(&PrefillSpec::default());
    let log = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("{}.log", common::unique("decode-control")));
    let mut child = Command::new("prlimit")
        .arg(format!("--nofile={FD_LIMIT}:{FD_LIMIT}"))
        .arg("--")
        .arg(env!("CARGO_BIN_EXE_nixl-keepalive"))
        .args(["decode", "--prefill", p.addr.as_str()])
        .args(["--control-addr", "127.0.0.1:0"])
        .env("NIXL_KEEPALIVE_INTERVAL", "500ms")
        .env("NIXL_KEEPALIVE_JITTER", "50ms")
        .env("NIXL_KEEPALIVE_RATE_PERIOD", "100ms")
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).expect("decode log"))
        .spawn()
        .expect("prlimit runs nixl-keepalive decode");
    let out = child.stdout.take().unwrap();
    let lines: Arc<Mutex<Vec<(Instant, String)>>> = Arc::default();
    let sink = lines.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            sink.lock().unwrap().push((Instant::now(), line));
        }
    });
    let d = Decode { child, lines, log };
    let start = Instant::now();
    let (_, line) = d.wait_line(&["control on http://"], start, PATIENCE);
    let control = line
        .strip_prefix("control on http://")
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .to_string();
    d.wait_line(&["event: registered", &p.engine], start, PATIENCE);
    let at_rest = d.open_fds();

    // The attack, for the rest of the test.
    let stop = Arc::new(AtomicBool::new(false));
    let reconnects = Arc::new(AtomicUsize::new(0));
    let flood = {
        let (stop, addr, reconnects) = (stop.clone(), control.clone(), reconnects.clone());
        std::thread::spawn(move || {
            let mut idle: Vec<Option<TcpStream>> = (0..IDLE).map(|_| None).collect();
            while !stop.load(Ordering::Relaxed) {
                for slot in idle.iter_mut() {
                    let closed = match slot {
                        None => true,
                        Some(s) => {
                            s.set_nonblocking(true).ok();
                            let mut b = [0u8; 64];
                            // EOF, or an answer (a 408) before the close:
                            // gone either way; WouldBlock: still held.
                            s.read(&mut b).is_ok()
                        }
                    };
                    if closed {
                        *slot = TcpStream::connect(&addr).ok();
                        reconnects.fetch_add(1, Ordering::Relaxed);
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let loris: Vec<_> = (0..LORIS)
        .map(|_| {
            let (stop, addr) = (stop.clone(), control.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let Ok(mut s) = TcpStream::connect(&addr) else {
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    };
                    let _ = s.write_all(b"GET /v1/snapshot HTTP/1.1\r\n");
                    while !stop.load(Ordering::Relaxed) && s.write_all(b"X").is_ok() {
                        std::thread::sleep(Duration::from_millis(200));
                    }
                }
            })
        })
        .collect();
    let peak = Arc::new(AtomicUsize::new(0));
    let watcher = {
        let (stop, peak) = (stop.clone(), peak.clone());
        let pid = d.child.id();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let n = std::fs::read_dir(format!("/proc/{pid}/fd"))
                    .map(|d| d.count())
                    .unwrap_or(0);
                peak.fetch_max(n, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let attack = Instant::now();
    std::thread::sleep(Duration::from_secs(1));

    // An oversize head: a JSON 431.
    let big = format!(
        "GET /v1/snapshot HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "a".repeat(20_000)
    );
    let (status, json) = status_and_json(&http(&control, big.as_bytes()).unwrap_or_default());
    assert_eq!(status, 431, "{json}");
    assert!(json["error"].is_string(), "{json}");

    // The router still gets through, and heartbeats go on.
    let asked = Instant::now();
    let snapshot = loop {
        let answer = http(&control, b"GET /v1/snapshot HTTP/1.1\r\nHost: x\r\n\r\n");
        if let Ok(a) = answer {
            let (status, json) = status_and_json(&a);
            if status == 200 {
                break json;
            }
        }
        assert!(
            asked.elapsed() < PATIENCE,
            "no snapshot within {PATIENCE:?} of asking; log: {}",
            d.log_tail()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let got_snapshot = asked.elapsed();
    let engine = snapshot["engines"]
        .as_array()
        .and_then(|e| e.iter().find(|e| e["engine"] == p.engine.as_str()))
        .unwrap_or_else(|| panic!("{} not in {snapshot}", p.engine));
    let ago = engine["last_heartbeat"]["ago_ms"]
        .as_u64()
        .expect("a heartbeat came back");
    assert!(
        ago < 2_000,
        "last heartbeat {ago} ms ago under the flood: {engine}"
    );
    assert_eq!(engine["last_heartbeat"]["status"], 0, "{engine}");
    assert_eq!(engine["last_heartbeat"]["status_name"], "NIXL_SUCCESS");

    // A prefill restarted at the same port during the flood is registered.
    let listen = p.listen();
    p.kill();
    let restarted = Instant::now();
    let p2 = PrefillProc::start(&PrefillSpec {
        listen: Some(listen),
        ..PrefillSpec::default()
    });
    let (registered, _) = d.wait_line(&["event: registered", &p2.engine], restarted, PATIENCE);

    // Reads went on under the flood: of the decode's `reads:` summaries
    // (one per 5 s), two printed during the attack, the later counting
    // more verified reads.
    let deadline = Instant::now() + PATIENCE;
    let (before, during) = loop {
        let v: Vec<u64> = d
            .verified()
            .into_iter()
            .filter(|(at, _)| *at > attack)
            .map(|(_, n)| n)
            .collect();
        if let [first, .., last] = v[..] {
            assert!(last > first, "no verified read under the flood: {v:?}");
            break (first, last);
        }
        assert!(
            Instant::now() < deadline,
            "no two summaries under the flood: {v:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    stop.store(true, Ordering::Relaxed);
    flood.join().unwrap();
    for l in loris {
        l.join().unwrap();
    }
    watcher.join().unwrap();
    let peak = peak.load(Ordering::Relaxed);
    let text = std::fs::read_to_string(&d.log).unwrap_or_default();
    assert!(
        !text.contains("Too many open files"),
        "the decode ran out of descriptors: {}",
        d.log_tail()
    );
    assert!(peak < FD_LIMIT, "peak {peak} descriptors, limit {FD_LIMIT}");
    report(&format!(
        "control flood ({IDLE} idle kept up, {} reconnects; {LORIS} slow-loris; fd limit {FD_LIMIT}): descriptors at rest {at_rest}, peak {peak}; snapshot in {}; restarted prefill registered {} after its start; verified reads {before} -> {during}",
        reconnects.load(Ordering::Relaxed),
        ms(got_snapshot),
        ms(registered - restarted),
    ));
    let mut d = d;
    let _ = Command::new("kill")
        .args(["-TERM", &d.child.id().to_string()])
        .status();
    let status = d.child.wait().unwrap();
    assert!(status.success(), "decode exited with {status}");
}

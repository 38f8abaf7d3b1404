//! A real `nixl-keepalive decode` process for the real tests: its stdout
//! lines kept with the time they arrived, its control server (HTTP/1.1 by
//! hand: `/metrics`, `/v1/peer_gone`, `/v1/snapshot`).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long one HTTP exchange may take.
const HTTP_PATIENCE: Duration = Duration::from_secs(30);

/// A running `nixl-keepalive decode`.
pub struct DecodeProc {
    child: Child,
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
    /// Where its stderr (its log) goes.
    pub log: std::path::PathBuf,
    /// `host:port` of its control server (`--control-addr 127.0.0.1:0`).
    pub control: String,
}

impl DecodeProc {
    /// Starts `decode <args> --control-addr 127.0.0.1:0` with a 500 ms
    /// heartbeat and `env`, and waits for its control server.
    pub fn start(args: &[&str], env: &[(&str, &str)], within: Duration) -> DecodeProc {
        let log = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("{}.log", super::unique("decode")));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_nixl-keepalive"));
        cmd.arg("decode")
            .args(args)
            .args(["--control-addr", "127.0.0.1:0"])
            .env("RUST_LOG", "info")
            .env("NIXL_KEEPALIVE_INTERVAL", "500ms")
            .env("NIXL_KEEPALIVE_JITTER", "50ms")
            .env("NIXL_KEEPALIVE_RATE_PERIOD", "100ms")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("decode log"));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn nixl-keepalive decode");
        let out = child.stdout.take().expect("stdout");
        let lines: Arc<Mutex<Vec<(Instant, String)>>> = Arc::default();
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                sink.lock().unwrap().push((Instant::now(), line));
            }
        });
        let mut d = DecodeProc {
            child,
            lines,
            log,
            control: String::new(),
        };
        let (_, l) = d.wait_nth(1, &["control on http://"], within);
        let rest = l
            .split_once("control on http://")
            .expect("checked")
            .1
            .to_string();
        d.control = rest.split('/').next().expect("host:port").to_string();
        d
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Lines so far that contain every one of `parts`.
    pub fn matching(&self, parts: &[&str]) -> Vec<(Instant, String)> {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, l)| parts.iter().all(|p| l.contains(p)))
            .cloned()
            .collect()
    }

    /// Waits (bounded polling) for the `n`-th line containing all `parts`;
    /// on the deadline, panics with what it printed.
    pub fn wait_nth(&mut self, n: usize, parts: &[&str], within: Duration) -> (Instant, String) {
        let deadline = Instant::now() + within;
        loop {
            let m = self.matching(parts);
            if m.len() >= n {
                return m[n - 1].clone();
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "decode exited ({status}) before printing {parts:?} #{n}; last lines: {:#?}\nlog: {}",
                    self.tail(30),
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            if Instant::now() > deadline {
                panic!(
                    "no line #{n} with {parts:?} within {within:?} (saw {}); last lines: {:#?}",
                    m.len(),
                    self.tail(30)
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Its last `n` stdout lines.
    pub fn tail(&self, n: usize) -> Vec<String> {
        let lines = self.lines.lock().unwrap();
        lines
            .iter()
            .rev()
            .take(n)
            .rev()
            .map(|(_, l)| l.clone())
            .collect()
    }

    /// One request to its control server.
    pub fn http(&self, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
        http(&self.control, method, path, body)
    }

    /// The router's `peer_gone`; asserts it was accepted.
    pub fn peer_gone(&self, body: &str) {
        let (status, text) = self.http("POST", "/v1/peer_gone", Some(body));
        assert_eq!(status, 202, "peer_gone {body}: {text}");
    }

    /// A sample from its `/metrics` (`name{labels}` exactly as exported),
    /// or `None` when it is not there.
    pub fn metric(&self, series: &str) -> Option<f64> {
        let (status, text) = self.http("GET", "/metrics", None);
        assert_eq!(status, 200, "{text}");
        metric_in(&text, series)
    }

    /// SIGTERM; asserts a clean exit (everything released at shutdown).
    pub fn stop(mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let status = self.child.wait().expect("decode exits");
        assert!(
            status.success(),
            "decode exited with {status}; last lines: {:#?}",
            self.tail(30)
        );
    }
}

impl Drop for DecodeProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value of `series` (`name{labels}` as exported) in a Prometheus text.
pub fn metric_in(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| {
            l.strip_prefix(series)
                .is_some_and(|rest| rest.starts_with(' '))
        })
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
}

/// One HTTP/1.1 request (`Connection: close`); the status and the body.
pub fn http(addr: &str, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect to the control server");
    s.set_read_timeout(Some(HTTP_PATIENCE)).unwrap();
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).expect("response");
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}

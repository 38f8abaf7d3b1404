//! A real `nixl-keepalive decode` process for the real tests: its stdout
//! lines kept with the time they arrived, its stderr (its log) in a file,
//! its HTTP server (HTTP/1.1 by hand: `/metrics`, and on the control
//! server `/v1/peer_gone`, `/v1/snapshot`). The one decode process every
//! real test uses; every wait here polls the state it names until a
//! deadline and then panics with what the decode printed.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::wait::POLL;

/// How long one HTTP exchange may take.
const HTTP_PATIENCE: Duration = Duration::from_secs(30);

/// How often `decode` prints its `reads: verified=...` line
/// (`cli/src/cmd/decode.rs`).
pub const SUMMARY_PERIOD: Duration = Duration::from_secs(5);

/// A running `nixl-keepalive decode`.
pub struct DecodeProc {
    child: Child,
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
    /// Where its stderr (its log) goes.
    pub log: std::path::PathBuf,
    /// `host:port` of its HTTP server: the control server
    /// (`--control-addr`, the default here) or the metrics-only one
    /// (`--metrics-addr`).
    pub control: String,
}

impl DecodeProc {
    /// Starts `decode <args>` with a 500 ms heartbeat, `RUST_LOG=info` and
    /// then `env` (which may override them), adds `--control-addr
    /// 127.0.0.1:0` unless `args` name `--control-addr` or
    /// `--metrics-addr`, and waits (at most `within`) for its HTTP server.
    pub fn start(args: &[&str], env: &[(&str, &str)], within: Duration) -> DecodeProc {
        let log = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("{}.log", super::unique("decode")));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_nixl-keepalive"));
        cmd.arg("decode").args(args);
        let metrics_only = args.contains(&"--metrics-addr") && !args.contains(&"--control-addr");
        if !args.contains(&"--control-addr") && !metrics_only {
            cmd.args(["--control-addr", "127.0.0.1:0"]);
        }
        cmd.env("RUST_LOG", "info")
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
        let server = if metrics_only {
            "metrics on http://"
        } else {
            "control on http://"
        };
        let (_, l) = d.wait_nth(1, &[server], within);
        let rest = l.split_once(server).expect("checked").1.to_string();
        d.control = rest.split('/').next().expect("host:port").to_string();
        d
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Every stdout line so far, with when it arrived.
    pub fn lines(&self) -> Vec<(Instant, String)> {
        self.lines.lock().unwrap().clone()
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

    /// Lines that start with `kind` (`event: released`) and contain every
    /// one of `parts`: a record's text quoted inside another line (a
    /// `bad_value` line) is not that kind of line.
    pub fn lines_of(&self, kind: &str, parts: &[&str]) -> Vec<(Instant, String)> {
        self.matching(parts)
            .into_iter()
            .filter(|(_, l)| l.starts_with(kind))
            .collect()
    }

    /// Waits (at most `within`) for the `n`-th line containing all
    /// `parts`; on the deadline, or if the decode exits first, panics with
    /// what it printed.
    pub fn wait_nth(&mut self, n: usize, parts: &[&str], within: Duration) -> (Instant, String) {
        let what = format!("line #{n} with {parts:?}");
        self.wait_until(&what, within, |d| d.matching(parts).len() >= n);
        self.matching(parts)[n - 1].clone()
    }

    /// The first line containing `part`.
    pub fn wait_line(&mut self, part: &str, within: Duration) -> (Instant, String) {
        self.wait_nth(1, &[part], within)
    }

    /// The next line containing all `parts` after those printed so far.
    pub fn wait_next(&mut self, parts: &[&str], within: Duration) -> (Instant, String) {
        let n = self.matching(parts).len() + 1;
        self.wait_nth(n, parts, within)
    }

    /// Polls `done` until it holds, at most `within`; returns when it did.
    /// On the deadline, or if the decode exits first, panics with `what`,
    /// the decode's last stdout lines and its log's tail.
    pub fn wait_until(
        &mut self,
        what: &str,
        within: Duration,
        done: impl Fn(&DecodeProc) -> bool,
    ) -> Instant {
        let deadline = Instant::now() + within;
        loop {
            if done(self) {
                return Instant::now();
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "decode exited ({status}) while waiting for {what}; stdout: {:#?}\nlog tail:\n{}",
                    self.tail(60),
                    self.log_tail(30)
                );
            }
            if Instant::now() > deadline {
                panic!(
                    "{what}: not within {within:?}; stdout: {:#?}\nlog tail:\n{}",
                    self.tail(60),
                    self.log_tail(30)
                );
            }
            std::thread::sleep(POLL);
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

    /// Its log (stderr) so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `n` lines of its log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = self.log_text();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// One request to its HTTP server.
    pub fn http(&self, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
        http(&self.control, method, path, None, body)
    }

    /// One request with `Authorization: Bearer <token>` when given.
    pub fn http_with_token(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&str>,
    ) -> (u16, String) {
        http(&self.control, method, path, token, body)
    }

    /// The router's `peer_gone`; asserts it was accepted.
    pub fn peer_gone(&self, body: &str) {
        let (status, text) = self.http("POST", "/v1/peer_gone", Some(body));
        assert_eq!(status, 202, "peer_gone {body}: {text}");
    }

    /// `GET /metrics`: the whole text.
    pub fn scrape(&self) -> String {
        let (status, text) = self.http("GET", "/metrics", None);
        assert_eq!(status, 200, "{text}");
        text
    }

    /// A sample from its `/metrics` (`name{labels}` exactly as exported),
    /// or `None` when it is not there.
    pub fn metric(&self, series: &str) -> Option<f64> {
        metric_in(&self.scrape(), series)
    }

    /// Polls `/metrics` until `series` (`name{labels}`; absent counts as
    /// 0, as an unincremented counter) satisfies `holds`, at most
    /// `within`; returns its value. On the deadline panics with `what`,
    /// every sample of that metric in the last scrape, and the stdout tail.
    pub fn wait_metric(&self, series: &str, within: Duration, holds: impl Fn(f64) -> bool) -> f64 {
        let name = series.split('{').next().unwrap_or(series);
        let deadline = Instant::now() + within;
        loop {
            let text = self.scrape();
            let value = metric_in(&text, series).unwrap_or(0.0);
            if holds(value) {
                return value;
            }
            if Instant::now() > deadline {
                let samples: Vec<&str> = text.lines().filter(|l| l.starts_with(name)).collect();
                panic!(
                    "{series} = {value}: not as expected within {within:?}; its samples: {samples:#?}; stdout tail: {:#?}",
                    self.tail(30)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Reads verified so far, from `/metrics`.
    pub fn verified_reads(&self) -> u64 {
        self.metric("nixl_keepalive_pd_reads_total{outcome=\"verified\"}")
            .map_or(0, |v| v as u64)
    }

    /// Waits (at most `within`) until at least `n` reads were verified.
    pub fn wait_verified(&self, n: u64, within: Duration) -> Instant {
        self.wait_metric(
            "nixl_keepalive_pd_reads_total{outcome=\"verified\"}",
            within,
            |v| v >= n as f64,
        );
        Instant::now()
    }

    /// The engine's state in `/v1/snapshot`, if it is there.
    pub fn engine_state(&self, engine: &str) -> Option<String> {
        let (status, text) = self.http("GET", "/v1/snapshot", None);
        assert_eq!(status, 200, "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).expect("snapshot JSON");
        v["engines"]
            .as_array()
            .expect("engines")
            .iter()
            .find(|e| e["engine"] == engine)
            .map(|e| e["state"].as_str().unwrap().to_string())
    }

    /// [`DecodeProc::stop`], then every stdout line it printed, its last
    /// ones included (read until `decode stopped` arrives, or its stdout
    /// ends: the reader thread may lag the exit).
    pub fn stop_with_output(self) -> Vec<String> {
        let lines = self.lines.clone();
        self.stop();
        let deadline = Instant::now() + HTTP_PATIENCE;
        loop {
            let all: Vec<String> = lines
                .lock()
                .unwrap()
                .iter()
                .map(|(_, l)| l.clone())
                .collect();
            let done = all.iter().any(|l| l.starts_with("decode stopped"));
            if done || Instant::now() >= deadline {
                return all;
            }
            std::thread::sleep(POLL);
        }
    }

    /// SIGTERM; asserts a clean exit (everything released at shutdown).
    pub fn stop(mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(s) = self.child.try_wait().expect("wait decode") {
                break s;
            }
            assert!(
                Instant::now() < deadline,
                "decode did not stop within 60 s of SIGTERM; stdout: {:#?}\nlog tail:\n{}",
                self.tail(30),
                self.log_tail(30)
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(
            status.success(),
            "decode exited with {status}; stdout: {:#?}\nlog tail:\n{}",
            self.tail(30),
            self.log_tail(30)
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

/// One HTTP/1.1 request (`Connection: close`), with a bearer token when
/// given; the status and the body.
pub fn http(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect to the control server");
    s.set_read_timeout(Some(HTTP_PATIENCE)).unwrap();
    let body = body.unwrap_or("");
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
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

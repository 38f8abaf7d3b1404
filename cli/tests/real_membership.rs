//! Cluster membership against a real etcd, with real `prefill` and
//! `decode` processes on the real NIXL runtime: discovery, SIGKILL,
//! SIGSTOP with lease expiry, an etcd outage, and the router's control
//! endpoint. etcd runs on free loopback ports with its own data directory
//! (`common::etcd`), 2 s leases keep the suite short. Each test prints what
//! it measured (`MEASURED ...`). Without etcd or NIXL: SKIPPED; in CI
//! (NIXL_KEEPALIVE_REQUIRE_REAL=1, CI=true): a failure.
#![cfg(feature = "etcd")]

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::etcd::EtcdServer;
use common::{ms, report, serial, PrefillProc, PrefillSpec};
use nixl_sys::testing::runtime_or_skip;

/// The etcd lease of every prefill here.
const TTL_SECS: u64 = 2;
/// Generous bound for anything the tests wait for.
const PATIENCE: Duration = Duration::from_secs(30);

fn prefill_with_etcd(etcd: &EtcdServer) -> PrefillProc {
    PrefillProc::start(&PrefillSpec {
        args: vec![
            "--etcd-endpoint".into(),
            etcd.url(),
            "--etcd-ttl".into(),
            TTL_SECS.to_string(),
        ],
        ..Default::default()
    })
}

/// Waits (bounded) for a prefill stdout line that starts with `prefix`.
fn prefill_line(p: &PrefillProc, prefix: &str) -> String {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match p.lines.recv_timeout(left) {
            Ok(l) if l.starts_with(prefix) => return l,
            Ok(_) => {}
            Err(e) => panic!("prefill printed no {prefix:?} line ({e})"),
        }
    }
}

fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
}

/// A real `nixl-keepalive decode` process; its stdout lines are kept with
/// the time they arrived.
struct DecodeProc {
    child: Child,
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
    log: std::path::PathBuf,
    /// `host:port` of the control server, when `--control-addr` was given.
    control: Option<String>,
}

impl DecodeProc {
    fn start(args: &[&str], env: &[(&str, &str)]) -> DecodeProc {
        let log = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("{}.log", common::unique("decode")));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_nixl-keepalive"));
        cmd.arg("decode")
            .args(args)
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
            control: None,
        };
        if args.contains(&"--control-addr") {
            let (_, l) = d.wait_line("control on http://", PATIENCE);
            let rest = l.strip_prefix("control on http://").unwrap();
            d.control = Some(rest.split('/').next().unwrap().to_string());
        }
        d
    }

    /// Lines so far that contain every one of `parts`.
    fn matching(&self, parts: &[&str]) -> Vec<(Instant, String)> {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, l)| parts.iter().all(|p| l.contains(p)))
            .cloned()
            .collect()
    }

    /// Waits (bounded polling) for the `n`-th line containing all `parts`.
    fn wait_nth(&mut self, n: usize, parts: &[&str], within: Duration) -> (Instant, String) {
        let deadline = Instant::now() + within;
        loop {
            let m = self.matching(parts);
            if m.len() >= n {
                return m[n - 1].clone();
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "decode exited ({status}) before printing {parts:?}; stdout: {:#?}\nlog: {}",
                    self.lines.lock().unwrap(),
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            if Instant::now() > deadline {
                panic!(
                    "no line with {parts:?} within {within:?}; stdout: {:#?}",
                    self.lines.lock().unwrap()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn wait_line(&mut self, part: &str, within: Duration) -> (Instant, String) {
        self.wait_nth(1, &[part], within)
    }

    fn http(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&str>,
    ) -> (u16, String) {
        http(
            self.control.as_deref().expect("--control-addr"),
            method,
            path,
            token,
            body,
        )
    }

    /// Reads verified so far, from `/metrics`.
    fn verified_reads(&self) -> u64 {
        let (status, text) = self.http("GET", "/metrics", None, None);
        assert_eq!(status, 200, "{text}");
        text.lines()
            .find(|l| l.starts_with("nixl_keepalive_pd_reads_total{outcome=\"verified\"}"))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse::<f64>().ok())
            .map_or(0, |v| v as u64)
    }

    /// Waits (bounded polling) until at least `n` reads were verified.
    fn wait_verified(&self, n: u64) -> Instant {
        let deadline = Instant::now() + PATIENCE;
        while self.verified_reads() < n {
            assert!(Instant::now() < deadline, "fewer than {n} verified reads");
            std::thread::sleep(Duration::from_millis(20));
        }
        Instant::now()
    }

    /// The engine's state in `/v1/snapshot`, if it is there.
    fn engine_state(&self, engine: &str) -> Option<String> {
        let (status, text) = self.http("GET", "/v1/snapshot", None, None);
        assert_eq!(status, 200, "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).expect("snapshot JSON");
        v["engines"]
            .as_array()
            .expect("engines")
            .iter()
            .find(|e| e["engine"] == engine)
            .map(|e| e["state"].as_str().unwrap().to_string())
    }

    /// SIGTERM; asserts a clean exit (everything released at shutdown).
    fn stop(mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let status = self.child.wait().expect("decode exits");
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(15).collect();
        assert!(
            status.success(),
            "decode exited with {status}; stdout: {:#?}\nlog tail: {tail:#?}",
            self.lines.lock().unwrap()
        );
    }
}

impl Drop for DecodeProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 request (`Connection: close`); the status and the body.
fn http(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect to the control server");
    s.set_read_timeout(Some(PATIENCE)).unwrap();
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

#[test]
fn a_prefill_registered_in_etcd_is_discovered_and_read_without_a_prefill_flag() {
    let Some(_rt) = runtime_or_skip() else { return };
    let Some(etcd) = EtcdServer::start_or_skip() else {
        return;
    };
    let _serial = serial();
    let p = prefill_with_etcd(&etcd);
    let registered = prefill_line(&p, "ETCD registered");
    assert!(
        registered.contains(&format!("/nixl-keepalive/prefill/{}", p.engine)),
        "{registered}"
    );
    let started = Instant::now();
    let mut d = DecodeProc::start(
        &[
            "--etcd-endpoint",
            &etcd.url(),
            "--control-addr",
            "127.0.0.1:0",
        ],
        &[],
    );
    let (joined, line) = d.wait_line("membership: joined", PATIENCE);
    assert_eq!(field(&line, "engine="), p.engine);
    assert_eq!(field(&line, "address="), p.addr.as_str());
    assert_eq!(field(&line, "ranks="), "1");
    let (reg, _) = d.wait_nth(1, &["event: registered", &p.engine], PATIENCE);
    let read = d.wait_verified(1);
    assert_eq!(d.engine_state(&p.engine).as_deref(), Some("live"));
    let (_, metrics) = d.http("GET", "/metrics", None, None);
    assert!(
        metrics.contains("nixl_keepalive_membership_watch_up 1"),
        "{metrics}"
    );
    report(&format!(
        "decode start -> joined {}, -> registered {}, -> first verified read {}",
        ms(joined - started),
        ms(reg - started),
        ms(read - started)
    ));
    d.stop();
}

#[test]
fn a_killed_prefill_is_released_by_remote_disconnect_first_and_its_lease_expiry_changes_nothing() {
    let Some(_rt) = runtime_or_skip() else { return };
    let Some(etcd) = EtcdServer::start_or_skip() else {
        return;
    };
    let _serial = serial();
    let mut p = prefill_with_etcd(&etcd);
    prefill_line(&p, "ETCD registered");
    let mut d = DecodeProc::start(
        &[
            "--etcd-endpoint",
            &etcd.url(),
            "--control-addr",
            "127.0.0.1:0",
        ],
        &[],
    );
    d.wait_nth(1, &["event: registered", &p.engine], PATIENCE);
    d.wait_verified(1);
    let killed = p.kill();
    let (released, line) = d.wait_nth(1, &["event: released", &p.engine], PATIENCE);
    assert!(line.contains("reason=unreachable"), "{line}");
    let (left, line) = d.wait_nth(1, &["membership: left", &p.engine], PATIENCE);
    assert!(
        line.contains("why=deleted"),
        "lease expiry deletes the key: {line}"
    );
    // A barrier through the service: the snapshot is answered after the
    // `peer_gone` the removal sent, so any release it caused came first.
    assert_eq!(d.engine_state(&p.engine), None);
    d.wait_nth(
        d.matching(&["reads:"]).len() + 1,
        &["reads:"],
        Duration::from_secs(10),
    );
    assert_eq!(
        d.matching(&["event: released", &p.engine]).len(),
        1,
        "released once"
    );
    assert!(d.matching(&["membership: released", &p.engine]).is_empty());
    assert!(
        d.matching(&["event: retiring", &p.engine]).is_empty(),
        "nothing to retire"
    );
    report(&format!(
        "SIGKILL -> released (unreachable) {}; SIGKILL -> lease expiry seen {} (TTL {TTL_SECS} s), which released nothing more",
        ms(released - killed),
        ms(left - killed)
    ));
    d.stop();
}

#[test]
fn a_frozen_idle_prefill_is_retired_when_its_lease_expires_and_picked_up_again_under_a_new_lease() {
    let Some(_rt) = runtime_or_skip() else { return };
    let Some(etcd) = EtcdServer::start_or_skip() else {
        return;
    };
    let _serial = serial();
    let p = prefill_with_etcd(&etcd);
    let first = prefill_line(&p, "ETCD registered");
    let lease1 = field(&first, "lease=").to_string();
    // One round of reads, then idle for an hour: the prefill is idle.
    let mut d = DecodeProc::start(
        &[
            "--etcd-endpoint",
            &etcd.url(),
            "--control-addr",
            "127.0.0.1:0",
            "--read-pause-ms",
            "3600000",
        ],
        &[],
    );
    d.wait_nth(1, &["event: registered", &p.engine], PATIENCE);
    d.wait_verified(2);
    p.signal("STOP");
    let stopped = Instant::now();
    let (left, line) = d.wait_nth(1, &["membership: left", &p.engine], PATIENCE);
    assert!(line.contains("why=deleted"), "{line}");
    let (released, line) = d.wait_nth(1, &["event: released", &p.engine], PATIENCE);
    assert!(line.contains("reason=peer_gone"), "{line}");
    assert!(line.contains("reads_at_mark=0"), "idle: {line}");
    let (_, line) = d.wait_nth(1, &["membership: released", &p.engine], PATIENCE);
    let delete_to_release = field(&line, "after_ms=").to_string();
    assert!(
        d.matching(&["event: unreachable", &p.engine]).is_empty(),
        "UCX reported nothing about the frozen prefill"
    );
    p.signal("CONT");
    let resumed = Instant::now();
    let lost = prefill_line(&p, "ETCD lease_lost");
    assert_eq!(field(&lost, "lease="), lease1);
    let again = prefill_line(&p, "ETCD registered");
    let lease2 = field(&again, "lease=").to_string();
    assert_ne!(lease1, lease2, "a new lease");
    let (rejoined, _) = d.wait_nth(2, &["membership: joined", &p.engine], PATIENCE);
    let (reregistered, _) = d.wait_nth(2, &["event: registered", &p.engine], PATIENCE);
    let before = d.verified_reads();
    d.wait_verified(before + 1);
    assert_eq!(d.engine_state(&p.engine).as_deref(), Some("live"));
    report(&format!(
        "SIGSTOP -> lease expiry seen {} (TTL {TTL_SECS} s) -> released {} (deletion to release {delete_to_release} ms, drain, no reads in flight); SIGCONT -> joined again {}, registered again {}",
        ms(left - stopped),
        ms(released - stopped),
        ms(rejoined - resumed),
        ms(reregistered - resumed)
    ));
    d.stop();
}

#[test]
fn etcd_stopped_for_longer_than_the_lease_releases_nothing_and_is_reconciled_when_back() {
    let Some(_rt) = runtime_or_skip() else { return };
    let Some(mut etcd) = EtcdServer::start_or_skip() else {
        return;
    };
    let _serial = serial();
    let p = prefill_with_etcd(&etcd);
    prefill_line(&p, "ETCD registered");
    let mut d = DecodeProc::start(
        &[
            "--etcd-endpoint",
            &etcd.url(),
            "--control-addr",
            "127.0.0.1:0",
        ],
        &[],
    );
    d.wait_nth(1, &["event: registered", &p.engine], PATIENCE);
    d.wait_verified(1);
    let heartbeats = || {
        std::fs::read_to_string(&p.log)
            .unwrap_or_default()
            .matches("heartbeat: leases extended")
            .count()
    };
    let stopped = etcd.stop();
    let (outage, _) = d.wait_line("membership: outage", PATIENCE);
    let hb_at_stop = heartbeats();
    let reads_at_stop = d.verified_reads();
    // The outage itself: three lease TTLs without etcd.
    let outage_for = Duration::from_secs(3 * TTL_SECS);
    std::thread::sleep(outage_for.saturating_sub(stopped.elapsed()));
    assert!(
        d.matching(&["event: released"]).is_empty(),
        "an outage is never a removal"
    );
    assert!(d.matching(&["membership: left"]).is_empty());
    assert_eq!(d.engine_state(&p.engine).as_deref(), Some("live"));
    let hb_during = heartbeats() - hb_at_stop;
    let reads_during = d.verified_reads() - reads_at_stop;
    assert!(hb_during > 0, "heartbeats went on during the outage");
    assert!(reads_during > 0, "reads went on during the outage");
    let (_, metrics) = d.http("GET", "/metrics", None, None);
    assert!(
        metrics.contains("nixl_keepalive_membership_watch_up 0"),
        "{metrics}"
    );

    let restarted = etcd.restart();
    let (restored, line) = d.wait_line("membership: restored", PATIENCE);
    // Reconciled: the list still has the engine (etcd gives leases their
    // TTL again after a restart and the prefill's keep-alive is back).
    d.wait_nth(
        d.matching(&["reads:"]).len() + 1,
        &["reads:"],
        Duration::from_secs(10),
    );
    assert!(d.matching(&["event: released"]).is_empty());
    assert!(d.matching(&["membership: left"]).is_empty());
    assert_eq!(d.engine_state(&p.engine).as_deref(), Some("live"));
    let (_, metrics) = d.http("GET", "/metrics", None, None);
    assert!(
        metrics.contains("nixl_keepalive_membership_watch_up 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("nixl_keepalive_membership_outages_total 1"),
        "{metrics}"
    );
    let reregistered = p
        .lines
        .try_iter()
        .filter(|l| l.starts_with("ETCD registered"))
        .count();
    report(&format!(
        "etcd down {} (TTL {TTL_SECS} s): outage seen after {}, released 0, heartbeats during it {hb_during}, reads verified {reads_during}; etcd restart -> reconciled {} ({line}); prefill registered again: {}",
        ms(restarted - stopped),
        ms(outage - stopped),
        ms(restored - restarted),
        if reregistered > 0 { "yes (new lease)" } else { "no (its lease survived)" }
    ));
    d.stop();
}

#[test]
fn the_router_endpoint_retires_in_drain_and_fail_modes_and_refuses_bad_requests_with_json_errors() {
    let Some(_rt) = runtime_or_skip() else { return };
    let _serial = serial();
    let p1 = PrefillProc::start(&PrefillSpec::default());
    let p2 = PrefillProc::start(&PrefillSpec::default());
    let token_file =
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(common::unique("token"));
    std::fs::write(&token_file, "s3cret-token\n").unwrap();
    let token_arg = token_file.to_str().unwrap();
    let mut d = DecodeProc::start(
        &[
            "--prefill",
            p1.addr.as_str(),
            p2.addr.as_str(),
            "--control-addr",
            "127.0.0.1:0",
            "--control-token-file",
            token_arg,
            "--probe-ms",
            "600000",
        ],
        &[],
    );
    d.wait_nth(1, &["event: registered", &p1.engine], PATIENCE);
    d.wait_nth(1, &["event: registered", &p2.engine], PATIENCE);
    let token = Some("s3cret-token");
    let gone = |d: &DecodeProc, body: &str, token: Option<&str>| {
        d.http("POST", "/v1/peer_gone", token, Some(body))
    };
    let json = |text: &str| -> serde_json::Value {
        serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"))
    };
    let body1 = format!(r#"{{"engine": "{}"}}"#, p1.engine);

    // Loopback: reads need no token.
    let (status, text) = d.http("GET", "/v1/snapshot", None, None);
    assert_eq!(status, 200);
    assert_eq!(json(&text)["engines"].as_array().unwrap().len(), 2);
    // Every refusal: a 4xx with a JSON error that says what was wrong.
    let cases: Vec<(String, Option<&str>, u16, &str)> = vec![
        (body1.clone(), None, 401, "missing token"),
        (body1.clone(), Some("wrong"), 401, "bad token"),
        ("{not json".into(), token, 400, "malformed JSON"),
        ("".into(), token, 400, "malformed JSON"),
        (r#"{"engine": 7}"#.into(), token, 400, "malformed JSON"),
        (
            r#"{"engine": "e", "shoe": 1}"#.into(),
            token,
            400,
            "unknown field",
        ),
        (
            r#"{"engine": "no-such-engine"}"#.into(),
            token,
            404,
            "no engine \"no-such-engine\"",
        ),
        (
            r#"{"address": "127.0.0.1:1"}"#.into(),
            token,
            404,
            "no engine is registered at",
        ),
        (
            format!(r#"{{"engine": "{}", "address": "{}"}}"#, p1.engine, p1.addr),
            token,
            400,
            "exactly one",
        ),
        ("{}".into(), token, 400, "exactly one"),
        (
            format!(r#"{{"engine": "{}", "mode": "sideways"}}"#, p1.engine),
            token,
            400,
            "\"drain\", \"fail\"",
        ),
    ];
    for (body, tok, want, says) in &cases {
        let (status, text) = gone(&d, body, *tok);
        assert_eq!(status, *want, "{body:?}: {text}");
        let error = json(&text)["error"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(
            error.contains(says),
            "{body:?}: {error:?} should say {says:?}"
        );
    }
    let (status, text) = d.http("GET", "/v1/nothing", None, None);
    assert_eq!(status, 404);
    assert!(json(&text)["error"].as_str().unwrap().contains("routes"));
    let oversized = format!(r#"{{"engine": "{}"}}"#, "x".repeat(64 * 1024));
    let (status, text) = gone(&d, &oversized, token);
    assert_eq!(status, 413, "a body over the limit: {text}");
    assert!(json(&text)["error"].as_str().unwrap().contains("body over"));
    let (status, text) = d.http("GET", "/v1/peer_gone", None, None);
    assert_eq!(status, 405, "{text}");
    assert!(json(&text)["error"]
        .as_str()
        .unwrap()
        .contains("POST /v1/peer_gone"));
    assert!(
        d.matching(&["event: retiring"]).is_empty(),
        "no refused request retired anything"
    );

    // Drain, by engine id.
    let posted = Instant::now();
    let (status, text) = gone(&d, &body1, token);
    assert_eq!(status, 202, "{text}");
    assert_eq!(json(&text)["mode"], "drain");
    d.wait_nth(
        1,
        &["event: retiring", &p1.engine, "fail_reads=false"],
        PATIENCE,
    );
    let (drained, line) = d.wait_nth(1, &["event: released", &p1.engine], PATIENCE);
    assert!(line.contains("reason=peer_gone"), "{line}");

    // Fail, by address.
    let posted2 = Instant::now();
    let (status, text) = gone(
        &d,
        &format!(r#"{{"address": "{}", "mode": "fail"}}"#, p2.addr),
        token,
    );
    assert_eq!(status, 202, "{text}");
    assert_eq!(json(&text)["engine"], p2.engine.as_str());
    d.wait_nth(
        1,
        &["event: retiring", &p2.engine, "fail_reads=true"],
        PATIENCE,
    );
    let (failed, line) = d.wait_nth(1, &["event: released", &p2.engine], PATIENCE);
    assert!(line.contains("reason=peer_gone"), "{line}");
    let (_, metrics) = d.http("GET", "/metrics", None, None);
    assert!(
        metrics.contains("nixl_keepalive_control_errors_total"),
        "{metrics}"
    );
    report(&format!(
        "POST peer_gone drain -> released {}; fail -> released {}; {} bad requests refused with 4xx JSON errors",
        ms(drained - posted),
        ms(failed - posted2),
        cases.len() + 3
    ));
    d.stop();

    // A bind that is not loopback needs a token: refused before it binds.
    let out = Command::new(env!("CARGO_BIN_EXE_nixl-keepalive"))
        .args([
            "decode",
            "--prefill",
            p1.addr.as_str(),
            "--control-addr",
            "0.0.0.0:0",
        ])
        .output()
        .expect("run decode");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not a loopback address") && err.contains("--control-token-file"),
        "{err}"
    );
}

#[test]
fn a_prefill_that_would_register_an_unspecified_address_refuses_to_start() {
    let out = Command::new(env!("CARGO_BIN_EXE_nixl-keepalive"))
        .args([
            "prefill",
            "--listen",
            "0.0.0.0:0",
            "--etcd-endpoint",
            "http://127.0.0.1:1",
        ])
        .output()
        .expect("run prefill");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--listen 0.0.0.0:0") && err.contains("--etcd-endpoint"),
        "{err}"
    );
}

#[test]
fn decode_needs_a_prefill_list_or_etcd() {
    let out = Command::new(env!("CARGO_BIN_EXE_nixl-keepalive"))
        .args(["decode"])
        .output()
        .expect("run decode");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--prefill"), "{err}");
}

/// The etcd source alone against the real etcd: the first list, a
/// replacement at the same address, a bad value, a deletion, a lease
/// expiry, all in revision order, through the reconciler's rules.
#[test]
fn the_etcd_source_reports_lists_replacements_bad_values_and_lease_expiry_in_revision_order() {
    use nixl_keepalive::membership::etcd::etcd_client::{Client, PutOptions};
    use nixl_keepalive::membership::etcd::{EtcdOptions, EtcdSource};
    use nixl_keepalive::membership::{
        Action, Member, MembershipSource, Reconciler, RetireWhy, SourceEvent,
    };

    let Some(etcd) = EtcdServer::start_or_skip() else {
        return;
    };
    async fn next(source: &mut EtcdSource) -> SourceEvent {
        tokio::time::timeout(PATIENCE, source.next())
            .await
            .expect("an event in time")
            .expect("source running")
    }
    let prefix = "/t/prefill/";
    common::block_on(async move {
        let mut client = Client::connect([etcd.url()], None).await.expect("etcd");
        let m1 = Member::new("e1", "127.0.0.1:7001", 2);
        client
            .put(format!("{prefix}e1"), m1.to_json(), None)
            .await
            .unwrap();
        client
            .put(format!("{prefix}junk"), "not json", None)
            .await
            .unwrap();
        client
            .put("/elsewhere/e9", m1.to_json(), None)
            .await
            .unwrap();
        let shutdown = tokio_util::sync::CancellationToken::new();
        let mut source =
            EtcdSource::spawn(EtcdOptions::new(vec![etcd.url()], prefix), shutdown.clone());
        let mut reconciler = Reconciler::new();
        let listed = next(&mut source).await;
        let SourceEvent::Listed {
            revision, entries, ..
        } = &listed
        else {
            panic!("{listed:?}")
        };
        assert_eq!(entries.len(), 2, "only the prefix: {entries:?}");
        let list_rev = *revision;
        let actions = reconciler.apply(listed);
        assert!(
            actions.contains(&Action::Announce(m1.clone())),
            "{actions:?}"
        );
        assert!(actions
            .iter()
            .any(|a| matches!(a, Action::BadValue { key, .. } if key.ends_with("junk"))));

        // A restart under a new id at the same address.
        let m2 = Member::new("e2", "127.0.0.1:7001", 2);
        client
            .put(format!("{prefix}e2"), m2.to_json(), None)
            .await
            .unwrap();
        let put = next(&mut source).await;
        assert!(
            matches!(&put, SourceEvent::Put { revision, .. } if *revision > list_rev),
            "{put:?}"
        );
        let actions = reconciler.apply(put);
        assert_eq!(
            actions,
            vec![
                Action::Retire {
                    member: m1.clone(),
                    why: RetireWhy::Replaced { by: m2.engine() }
                },
                Action::Announce(m2.clone())
            ]
        );
        // The old key goes later: nothing more to do.
        client.delete(format!("{prefix}e1"), None).await.unwrap();
        assert!(reconciler.apply(next(&mut source).await).is_empty());

        // Under a 1 s lease that nobody keeps alive: etcd deletes it.
        let lease = client.lease_grant(1, None).await.unwrap().id();
        let m3 = Member::new("e3", "127.0.0.1:7003", 1);
        client
            .put(
                format!("{prefix}e3"),
                m3.to_json(),
                Some(PutOptions::new().with_lease(lease)),
            )
            .await
            .unwrap();
        let put_at = Instant::now();
        assert_eq!(
            reconciler.apply(next(&mut source).await),
            vec![Action::Announce(m3.clone())]
        );
        let expired = next(&mut source).await;
        let expired_after = put_at.elapsed();
        assert!(
            matches!(&expired, SourceEvent::Deleted { key, .. } if key.ends_with("e3")),
            "{expired:?}"
        );
        assert_eq!(
            reconciler.apply(expired),
            vec![Action::Retire {
                member: m3,
                why: RetireWhy::Deleted
            }]
        );
        report(&format!(
            "etcd source: list, replacement, deletion, bad value; a 1 s lease left alone was deleted {} after the put",
            ms(expired_after)
        ));
        shutdown.cancel();
    });
}

//! The operator's view: `nixl-keepalive prefill` and `nixl-keepalive
//! decode --metrics-addr` as separate processes; the prefill is SIGKILLed
//! and the decode prints its release and counts it in its metrics.

mod common;

use std::time::Duration;

use common::decode::DecodeProc;
use common::wait::MARGIN;
use common::{ms, report, serial, PrefillProc, PrefillSpec};
use nixl_agent::testing::real_runtime;

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn an_operator_kills_a_prefill_and_the_decode_command_releases_it() {
    let _rt = real_runtime();
    let _serial = serial();
    let mut p = PrefillProc::start(&PrefillSpec::default());
    // A second prefill address where nobody listens: its failed handshakes
    // must show in the metrics, by reason.
    let nobody = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let mut d = DecodeProc::start(
        &[
            "--prefill",
            p.addr.as_str(),
            &nobody,
            "--metrics-addr",
            "127.0.0.1:0",
        ],
        &[("RUST_LOG", "warn")],
        MARGIN,
    );
    d.wait_line(&format!("event: registered engine={}", p.engine), MARGIN);
    d.wait_verified(1, MARGIN);
    // Connection refused at once, counted by reason.
    d.wait_metric(
        "nixl_keepalive_pd_handshake_failures_total{reason=\"connect\"}",
        MARGIN,
        |v| v >= 1.0,
    );
    let killed = p.kill();
    // One heartbeat gap (500 ms + 50 ms jitter), or a read, finds it.
    let (released, _) = d.wait_line(
        &format!("event: released engine={}", p.engine),
        Duration::from_millis(550) + MARGIN,
    );
    // Counted before the event is published, so there at the line; and
    // counted once.
    let count = d.wait_metric(
        "nixl_keepalive_releases_total{reason=\"unreachable\"}",
        MARGIN,
        |v| v >= 1.0,
    );
    assert_eq!(count, 1.0, "released once");
    report(&format!(
        "decode command: kill -> 'event: released' on its stdout {}",
        ms(released - killed)
    ));
    d.stop();
}

/// Issue 30, item 10b: `/v1/snapshot` left out each engine's incarnation,
/// so a router could not tell a restarted process (a new incarnation, the
/// same pinned id) from the one it knew. Each engine now carries the
/// incarnation its handshake sent, as a decimal string.
#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn the_snapshot_names_each_engines_incarnation() {
    let _rt = real_runtime();
    let _serial = serial();
    let p = PrefillProc::start(&PrefillSpec::default());
    let mut d = DecodeProc::start(&["--prefill", p.addr.as_str()], &[], MARGIN);
    d.wait_nth(1, &["event: registered", &p.engine], MARGIN);
    let (status, body) = d.http("GET", "/v1/snapshot", None);
    assert_eq!(status, 200, "{body}");
    let snapshot: serde_json::Value = serde_json::from_str(&body).expect("snapshot JSON");
    let engine = snapshot["engines"]
        .as_array()
        .and_then(|e| e.iter().find(|e| e["engine"] == p.engine.as_str()))
        .unwrap_or_else(|| panic!("{} not in {snapshot}", p.engine));
    assert_eq!(
        engine["incarnation"].as_str(),
        Some(p.incarnation.as_str()),
        "the prefill's own incarnation: {engine}"
    );
    d.stop();
}

/// The decode's log, once it holds a line containing `part` (at most
/// `within`).
fn log_line(d: &DecodeProc, part: &str, within: Duration) -> String {
    let deadline = std::time::Instant::now() + within;
    loop {
        let log = std::fs::read_to_string(&d.log).unwrap_or_default();
        if let Some(l) = log.lines().find(|l| l.contains(part)) {
            return l.to_string();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no {part:?} in the decode's log within {within:?}:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Issue 56: the decode's start-up line says what its releases do with the
/// GPU mappings UCX's CUDA IPC cache keeps. On the real runtime: without a
/// CUDA driver UCX loads no CUDA transport (nothing to give back, no
/// `UCX_CUDA_IPC_CACHE` warning); with one (here the fake driver, which
/// has no device, so that UCX loads its real `libuct_cuda`) the ledger is
/// bound, and the warning is given only when the ledger is turned off.
#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn the_decodes_start_up_line_says_whether_ucxs_cuda_transport_binds_the_gpu_ledger() {
    let _rt = real_runtime();
    let _serial = serial();
    let p = PrefillProc::start(&PrefillSpec::default());
    let fake = nixl_agent::testing::FAKE_CUDA_DIR;
    let warning = "UCX_CUDA_IPC_CACHE=y";
    // (the decode's environment, its start-up line, whether it warns)
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a str, bool);
    let cases: [Case; 3] = [
        (
            &[],
            "GPU mappings: none (UCX's CUDA transport is not loaded",
            false,
        ),
        (
            &[("LD_LIBRARY_PATH", fake)],
            "GPU mappings: unmapped at each release",
            false,
        ),
        (
            &[
                ("LD_LIBRARY_PATH", fake),
                ("NIXL_KEEPALIVE_GPU_UNMAP", "off"),
            ],
            "GPU mappings: left to UCX (NIXL_KEEPALIVE_GPU_UNMAP=off)",
            true,
        ),
    ];
    for (env, line, warned) in cases {
        let mut d = DecodeProc::start(&["--prefill", p.addr.as_str()], env, MARGIN);
        d.wait_nth(1, &["event: registered", &p.engine], MARGIN);
        report(&log_line(&d, line, MARGIN));
        let log = std::fs::read_to_string(&d.log).expect("the decode's log");
        assert_eq!(
            log.lines().any(|l| l.contains(warning)),
            warned,
            "{env:?}: the {warning} warning:\n{log}"
        );
        d.stop();
    }
}

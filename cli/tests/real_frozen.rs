//! A prefill frozen with SIGSTOP: alive, silent. Records what real UCX
//! reports to the decode side under several UCX settings, and asserts the
//! measured fact: over these transports nothing reports the frozen peer
//! (`genNotif` keeps returning SUCCESS), so nothing UCX says may release
//! it: no guessing. (What does catch it is the service's own evidence,
//! reads that stop completing: the read-stall check, turned off here to
//! isolate UCX, and tested in `real_stall.rs`.)
//!
//! UCX reads its environment when the agent's UCX context is created, so
//! each setting runs the decode side in a child process (this test binary
//! again) with the setting in its environment, against a prefill started
//! with the same setting. The settings run side by side.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{config, report, serial, DecodeSide, PrefillProc, PrefillSpec};
use nixl_agent::testing::real_runtime;
use nixl_keepalive::{EngineId, EngineState, Event, PeerAddr, Transport};
use nixl_keepalive_cli::pd::decode::{DecodeOptions, Found, ReadOutcome};

const CHILD_ENV: &str = "NIXL_KEEPALIVE_FROZEN_CHILD";
const WINDOW: Duration = Duration::from_secs(10);

const SETTINGS: &[(&str, &[(&str, &str)])] = &[
    ("defaults", &[]),
    (
        "UCX_KEEPALIVE_INTERVAL=2s",
        &[("UCX_KEEPALIVE_INTERVAL", "2s")],
    ),
    ("UCX_TLS=tcp", &[("UCX_TLS", "tcp")]),
    (
        "UCX_TLS=tcp+UCX_KEEPALIVE_INTERVAL=2s",
        &[("UCX_TLS", "tcp"), ("UCX_KEEPALIVE_INTERVAL", "2s")],
    ),
];

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn a_frozen_prefill_keeps_answering_success_and_is_not_released_under_any_ucx_setting() {
    let _rt = real_runtime();
    let _serial = serial();
    let mut runs = Vec::new();
    for (name, env) in SETTINGS {
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let p = PrefillProc::start(&PrefillSpec {
            env: env.clone(),
            ..Default::default()
        });
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "frozen_decode_child",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .env("FROZEN_P_ADDR", p.addr.to_string())
        .env("FROZEN_P_PID", p.pid.to_string())
        .env("FROZEN_P_ENGINE", &p.engine);
        for (k, v) in &env {
            cmd.env(k, v);
        }
        // Side by side: each child in a thread of its own, bounded by the
        // window plus its handshake, read and stop, plus the margin.
        let what = format!("the decode child for {name}");
        let child = std::thread::spawn(move || {
            common::run_child(
                cmd,
                &what,
                WINDOW + Duration::from_secs(20) + common::wait::MARGIN,
            )
        });
        runs.push((name, p, child));
    }
    let mut failures = Vec::new();
    for (name, p, child) in runs {
        let out = child.join();
        p.signal("CONT");
        drop(p);
        let out = out.unwrap_or_else(|e| std::panic::resume_unwind(e));
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .find_map(|l| {
                l.find("FROZEN_RESULT ")
                    .map(|i| l[i + "FROZEN_RESULT ".len()..].to_string())
            })
            .unwrap_or_else(|| {
                panic!(
                    "{name}: child ({}) printed no result:\n{text}\nstderr:\n{}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                )
            });
        report(&format!("SIGSTOP P for {WINDOW:?}, {name}: {line}"));
        // The measured fact, asserted: nothing reported the frozen peer.
        for must in [
            "notify_all_success=true",
            "state=live",
            "unreachable=0",
            "released=0",
        ] {
            if !line.contains(must) {
                failures.push(format!("{name}: expected {must} in {line}"));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Not a test on its own: the decode side of one setting, run by the test
/// above in a child process with the setting's UCX environment.
#[test]
fn frozen_decode_child() {
    if std::env::var(CHILD_ENV).is_err() {
        return;
    }
    let rt = nixl_agent::Runtime::get().expect("child: runtime");
    let addr = PeerAddr::from(std::env::var("FROZEN_P_ADDR").unwrap());
    let pid = std::env::var("FROZEN_P_PID").unwrap();
    let engine = EngineId::from(std::env::var("FROZEN_P_ENGINE").unwrap());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let options = DecodeOptions { read_timeout: Duration::from_secs(3), ..DecodeOptions::default() };
        // UCX alone: the read-stall check would mark the engine once the
        // read below times out.
        let config = config(Duration::from_millis(500))
            .to_builder()
            .read_stall(None, nixl_keepalive::StallAction::Fail)
            .build()
            .expect("valid config");
        let mut d = DecodeSide::start(rt, config, options);
        let c = match d.decoder.connect(&addr, None).await.expect("handshake") {
            Found::New(c) => c,
            Found::Unchanged => unreachable!(),
        };
        assert_eq!(d.decoder.read(&c, 0, 0).await, ReadOutcome::Verified);
        tokio::time::sleep(Duration::from_secs(1)).await;
        let st = Command::new("kill").args(["-STOP", &pid]).status().unwrap();
        assert!(st.success());
        let frozen = Instant::now();
        let agent = c.remote.agents[0].clone();
        let mut changes: Vec<(u128, String)> = Vec::new();
        let mut all_ok = true;
        let mut read = None;
        while frozen.elapsed() < WINDOW {
            let t = d.transport.clone();
            let a = agent.clone();
            let r = tokio::task::spawn_blocking(move || t.notify(&a, b"HB:")).await.unwrap();
            let text = match &r {
                Ok(()) => "SUCCESS".to_string(),
                Err(e) => e.status.to_string(),
            };
            all_ok &= r.is_ok();
            if changes.last().map(|c| &c.1) != Some(&text) {
                changes.push((frozen.elapsed().as_millis(), text));
            }
            if read.is_none() && frozen.elapsed() > Duration::from_secs(2) {
                let t = Instant::now();
                let o = d.decoder.read(&c, 0, 1).await;
                read = Some(format!("{o:?} after {} ms", t.elapsed().as_millis()));
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let events = d.drain();
        let unreachable = events.iter().filter(|e| matches!(e, Event::Unreachable { engine: e_id, .. } if *e_id == engine)).count();
        let released = events.iter().filter(|e| matches!(e, Event::Released { engine: e_id, .. } if *e_id == engine)).count();
        let snapshot = d.decoder.handle().snapshot().await.unwrap();
        let last_hb = snapshot
            .engine(&engine)
            .and_then(|e| e.last_heartbeat.clone())
            .map(|h| h.status.to_string())
            .unwrap_or_else(|| "none".into());
        let state = c.engine.state();
        println!(
            "FROZEN_RESULT notify_all_success={all_ok} notify_changes(ms,status)={changes:?} read_while_frozen={} last_service_heartbeat={last_hb} state={} unreachable={unreachable} released={released}",
            read.unwrap_or_else(|| "none".into()),
            state.as_str(),
        );
        let _ = Command::new("kill").args(["-CONT", &pid]).status();
        if state == EngineState::Live {
            // Leave the NIXL state to the shutdown release.
        }
        d.stop().await;
    });
}

//! The operator's view: `nixl-keepalive prefill` and `nixl-keepalive
//! decode --metrics-addr` as separate processes; the prefill is SIGKILLed
//! and the decode prints its release and counts it in its metrics.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{ms, report, serial, PrefillProc, PrefillSpec};
use nixl_sys::testing::runtime_or_skip;

fn scrape(addr: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).expect("metrics endpoint");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body
}

#[test]
fn an_operator_kills_a_prefill_and_the_decode_command_releases_it() {
    let Some(_rt) = runtime_or_skip() else { return };
    let _serial = serial();
    let mut p = PrefillProc::start(&PrefillSpec::default());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let metrics = format!("127.0.0.1:{port}");
    // A second prefill address where nobody listens: its failed handshakes
    // must show in the metrics, by reason.
    let nobody = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let mut decode = Command::new(env!("CARGO_BIN_EXE_nixl-keepalive"))
        .args([
            "decode",
            "--prefill",
            p.addr.as_str(),
            &nobody,
            "--metrics-addr",
            &metrics,
        ])
        .env("NIXL_KEEPALIVE_INTERVAL", "500ms")
        .env("NIXL_KEEPALIVE_RATE_PERIOD", "100ms")
        .env("NIXL_KEEPALIVE_JITTER", "50ms")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn decode");
    let (tx, rx) = std::sync::mpsc::channel::<(String, Instant)>();
    let out = decode.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send((line, Instant::now()));
        }
    });
    let wait = |what: &str, within: Duration| -> Instant {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok((l, at)) if l.contains(what) => return at,
                Ok(_) => {}
                Err(e) => panic!("decode never printed {what:?}: {e}"),
            }
        }
    };
    wait(
        &format!("event: registered engine={}", p.engine),
        Duration::from_secs(20),
    );
    std::thread::sleep(Duration::from_secs(1));
    let before = scrape(&metrics);
    assert!(
        before.contains("nixl_keepalive_pd_reads_total{outcome=\"verified\"}"),
        "{before}"
    );
    assert!(
        before.contains("nixl_keepalive_pd_handshake_failures_total{reason=\"connect\"}"),
        "failed handshakes to {nobody} not counted: {before}"
    );
    let killed = p.kill();
    let released = wait(
        &format!("event: released engine={}", p.engine),
        Duration::from_secs(20),
    );
    std::thread::sleep(Duration::from_millis(1500));
    let after = scrape(&metrics);
    assert!(
        after.contains("nixl_keepalive_releases_total{reason=\"unreachable\"} 1"),
        "{after}"
    );
    report(&format!(
        "decode command: kill -> 'event: released' on its stdout {}",
        ms(released - killed)
    ));
    let _ = Command::new("kill")
        .args(["-TERM", &decode.id().to_string()])
        .status();
    let status = decode.wait().unwrap();
    assert!(status.success(), "decode exited with {status}");
}

//! The prefill's side channel under a flood of idle connections: a real
//! `nixl-keepalive prefill` process limited to 256 file descriptors, 400
//! idle loopback connections held (and re-opened when closed) by the test,
//! and a well-behaved decoder whose handshakes must all complete.

mod common;

use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{ms, report, serial, PrefillProc, PrefillSpec};
use nixl_keepalive_cli::pd::decode::fetch;
use nixl_sys::testing::runtime_or_skip;

const FLOOD: usize = 400;
const NOFILE: u32 = 256;
const CAP: usize = 64;

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Holds `FLOOD` idle connections to `addr` until `stop` (at most 60 s),
/// re-opening each one the prefill closes. Returns how many it opened.
fn flood(addr: String, stop: Arc<AtomicBool>, open_now: Arc<AtomicU64>) -> u64 {
    let connect = || {
        let s = TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(1)).ok()?;
        s.set_nonblocking(true).ok()?;
        Some(s)
    };
    let mut conns: Vec<Option<TcpStream>> = (0..FLOOD).map(|_| connect()).collect();
    let mut opened = FLOOD as u64;
    let until = Instant::now() + Duration::from_secs(60);
    while !stop.load(Ordering::Acquire) && Instant::now() < until {
        for c in conns.iter_mut() {
            let alive = c.as_ref().is_some_and(|s| {
                matches!(s.peek(&mut [0u8; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
            });
            if !alive {
                *c = connect();
                opened += 1;
            }
        }
        open_now.store(
            conns.iter().filter(|c| c.is_some()).count() as u64,
            Ordering::Relaxed,
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    opened
}

#[test]
fn handshakes_complete_while_an_attacker_holds_400_idle_connections_to_a_prefill_with_256_fds() {
    let Some(_rt) = runtime_or_skip() else { return };
    let _serial = serial();
    let p = PrefillProc::start(&PrefillSpec::default());
    let st = std::process::Command::new("prlimit")
        .args([
            "--pid",
            &p.pid.to_string(),
            &format!("--nofile={NOFILE}:{NOFILE}"),
        ])
        .status()
        .expect("run prlimit");
    assert!(st.success(), "prlimit failed");
    let baseline = open_fds(p.pid);
    assert!(
        baseline + CAP + 2 < NOFILE as usize,
        "the prefill already uses {baseline} fds: the test needs a higher limit"
    );
    let stop = Arc::new(AtomicBool::new(false));
    let open_now = Arc::new(AtomicU64::new(0));
    let attacker = {
        let (addr, stop, open_now) = (p.addr.to_string(), stop.clone(), open_now.clone());
        std::thread::spawn(move || flood(addr, stop, open_now))
    };
    // Let the flood fill every slot, and more.
    let filled = Instant::now();
    while open_now.load(Ordering::Relaxed) < (CAP * 3) as u64 {
        assert!(
            filled.elapsed() < Duration::from_secs(20),
            "flood never opened"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut max_fds = 0;
    let mut slowest = Duration::ZERO;
    let rounds = 20;
    common::block_on(async {
        for i in 0..rounds {
            let t = Instant::now();
            let reply = fetch(&p.addr, Duration::from_secs(2))
                .await
                .unwrap_or_else(|e| panic!("handshake {i} under the flood failed: {e}"));
            slowest = slowest.max(t.elapsed());
            assert_eq!(reply.engine, p.engine);
            max_fds = max_fds.max(open_fds(p.pid));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    stop.store(true, Ordering::Release);
    let opened = attacker.join().unwrap();
    assert!(
        max_fds <= baseline + CAP + 2,
        "the prefill held {max_fds} fds ({baseline} before the flood, cap {CAP})"
    );
    report(&format!(
        "{FLOOD} idle connections held (re-opened {} times) against a prefill with {NOFILE} fds, cap {CAP}: {rounds}/{rounds} handshakes completed, slowest {}; prefill fds {baseline} idle, at most {max_fds} under the flood",
        opened - FLOOD as u64,
        ms(slowest)
    ));
}

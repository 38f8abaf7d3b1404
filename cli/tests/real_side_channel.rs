//! The prefill's side channel under a flood of idle connections: a real
//! `nixl-keepalive prefill` process limited to 256 file descriptors, 400
//! idle loopback connections held (and re-opened when closed) by the test,
//! and a well-behaved decoder whose handshakes must all complete.
//! And a hostile prefill that names one agent for two ranks.

mod common;

use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::wait::{check, until, MARGIN};
use common::{ms, report, serial, PrefillProc, PrefillSpec};
use nixl_agent::testing::real_runtime;
use nixl_keepalive_cli::pd::decode::{fetch, DecodeOptions};

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
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn handshakes_complete_while_an_attacker_holds_400_idle_connections_to_a_prefill_with_256_fds() {
    let _rt = real_runtime();
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
    // Let the flood fill every slot, and more (connects on loopback: the
    // margin is the bound).
    until("the flood holds 3 x the cap open", MARGIN, || {
        let n = open_now.load(Ordering::Relaxed);
        check(n >= (CAP * 3) as u64, (n, open_fds(p.pid)))
    });
    let mut max_fds = 0;
    let mut slowest = Duration::ZERO;
    let rounds = 20;
    // The bound under test: a decoder's own handshake timeout.
    let patience = DecodeOptions::default().handshake_timeout;
    common::block_on(async {
        for i in 0..rounds {
            let t = Instant::now();
            let reply = fetch(&p.addr, patience).await.unwrap_or_else(|e| {
                panic!(
                    "handshake {i} under the flood failed: {e}; {} flood connections open, prefill fds {}",
                    open_now.load(Ordering::Relaxed),
                    open_fds(p.pid)
                )
            });
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

/// A hostile prefill on the side channel: it replays a real prefill's
/// rank-0 agent and metadata for both of its ranks (rank 1 pointed at
/// other memory). The decoder refuses the reply before loading anything;
/// `RemoteEngine::load` refuses it too when handed it directly.
#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn a_hostile_reply_naming_one_agent_for_two_ranks_is_refused_and_nothing_is_loaded() {
    use nixl_agent::NixlStatus;
    use nixl_keepalive::EngineId;
    use nixl_keepalive_cli::pd::decode::{DecodeOptions, Found, HandshakeError, RemoteEngine};
    use nixl_keepalive_cli::pd::wire;

    let rt = real_runtime();
    let _serial = serial();
    let p = PrefillProc::start(&PrefillSpec {
        ranks: Some(2),
        ..Default::default()
    });
    common::block_on(async move {
        let real = fetch(&p.addr, Duration::from_secs(5))
            .await
            .expect("real reply");
        let mut hostile = real.clone();
        hostile.ranks[1].agent = hostile.ranks[0].agent.clone();
        hostile.ranks[1].metadata = hostile.ranks[0].metadata.clone();
        let payload = wire::encode_reply(&hostile);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let fake =
            nixl_keepalive::PeerAddr::from(listener.local_addr().unwrap().to_string().as_str());
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let _ = wire::read_frame(&mut s, wire::MAX_REQUEST, Duration::from_secs(5)).await;
                let _ = wire::write_frame(&mut s, &payload).await;
            }
        });
        let d = common::DecodeSide::start(
            rt,
            common::config(Duration::from_millis(500)),
            DecodeOptions::default(),
        );
        let e = match d.decoder.connect(&fake, None).await {
            Err(e) => e,
            Ok(_) => panic!("a reply naming one agent for two ranks was accepted"),
        };
        assert_eq!(e.reason(), "bad_frame", "{e}");
        assert!(e.to_string().contains("ranks 0 and 1"), "{e}");
        let engine = EngineId::from(p.engine.as_str());
        assert!(
            d.decoder.handle().engine(&engine).is_none(),
            "registered anyway"
        );
        // Handed to the loader directly, it is refused before any load.
        let agent = d.transport.agent().clone();
        let err = RemoteEngine::load(&agent, fake.clone(), &hostile, 1).unwrap_err();
        assert!(
            matches!(
                err,
                HandshakeError::DuplicateAgent {
                    first: 0,
                    second: 1,
                    ..
                }
            ),
            "{err}"
        );
        let e = agent
            .invalidate_remote_metadata(&hostile.ranks[0].agent)
            .expect_err("nothing may be loaded");
        assert_eq!(e.status, NixlStatus::ERR_NOT_FOUND, "{e}");
        // The honest prefill still loads and registers.
        match d
            .decoder
            .connect(&p.addr, None)
            .await
            .expect("honest handshake")
        {
            Found::New(c) => assert_eq!(c.remote.agents.len(), 2),
            Found::Unchanged => panic!("expected a new engine"),
        }
        d.stop().await;
        report("hostile reply (one agent for ranks 0 and 1, real metadata): refused by the wire decoder and by RemoteEngine::load; nothing loaded; the honest prefill then registered");
    });
}

/// Issue 30, item 7: two broken peers on one host, the same fault. The
/// refusal is logged per full peer address (host and port) and reason:
/// each gets its first line. Before, the line was keyed by the host alone
/// and the second peer got none.
#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn two_broken_clients_on_one_host_with_the_same_fault_each_get_their_first_log_line() {
    use std::io::{Read, Write};
    let _rt = real_runtime();
    let _serial = serial();
    let prefill = PrefillProc::start(&PrefillSpec::default());
    let mut peers = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(prefill.addr.as_str()).expect("connect");
        let garbage = b"not the side channel";
        s.write_all(&(garbage.len() as u32).to_be_bytes()).unwrap();
        s.write_all(garbage).unwrap();
        // The prefill closes the connection once it has refused the frame.
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        peers.push(s.local_addr().unwrap().to_string());
    }
    assert_ne!(peers[0], peers[1]);
    until("a refusal line for each peer", MARGIN, || {
        let log = prefill.log_text();
        let lines: Vec<String> = log
            .lines()
            .filter(|l| l.contains("bad side-channel frame refused"))
            .map(str::to_string)
            .collect();
        check(
            peers
                .iter()
                .all(|p| lines.iter().any(|l| l.contains(p.as_str()))),
            lines,
        )
    });
    report(&format!(
        "two broken clients on one host ({peers:?}): one line each"
    ));
}

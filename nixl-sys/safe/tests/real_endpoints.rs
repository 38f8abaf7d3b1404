//! What invalidating a peer's metadata leaves behind, on the real runtime
//! (NIXL 1.5.1, UCX over shared memory and TCP on loopback, DRAM).
//!
//! Two child processes of this test binary: a *peer* (one agent, 4 KiB
//! registered, polling its notifications) and a *decode* (one agent) that
//! loads the peer's metadata, sends it a notification (which connects
//! UCX), invalidates it, and does that again and again, counting after
//! each round both processes' file descriptors, sockets, ESTABLISHED TCP
//! connections (`/proc/<pid>/fd` and `/proc/net/tcp{,6}`), UCX shared-memory
//! mappings (`/proc/<pid>/maps`), and the decode's UCP endpoints as UCX
//! itself sees them (its VFS tree). Both pin UCX to loopback
//! (`UCX_NET_DEVICES=lo`); the peer runs UCX keepalive every 500 ms, which
//! is what closes its half of the TCP connection UCX shares between the
//! two directions once the decode's endpoint is gone.
//!
//! Each prints `SKIPPED` and passes without the runtime, unless
//! NIXL_KEEPALIVE_REQUIRE_REAL=1.

use std::collections::{BTreeMap, HashSet};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nixl_agent::testing::real_runtime;
use nixl_agent::{Agent, AgentConfig, EndpointCloseMode, NixlStatus, Runtime};

/// Which child this process is.
const ROLE_ENV: &str = "NIXL_SYS_ENDPOINTS_ROLE";
/// Rounds the decode child runs.
const ROUNDS_ENV: &str = "NIXL_SYS_ENDPOINTS_ROUNDS";
/// The peer's metadata (hex) and pid, for the decode child.
const PEER_MD_ENV: &str = "NIXL_SYS_ENDPOINTS_PEER_MD";
const PEER_PID_ENV: &str = "NIXL_SYS_ENDPOINTS_PEER_PID";
/// `kill`: the decode child kills the peer and invalidates it once.
const SCENARIO_ENV: &str = "NIXL_SYS_ENDPOINTS_SCENARIO";

/// The peer's UCX keepalive: its rounds close its half of a released
/// connection.
const PEER_KEEPALIVE: Duration = Duration::from_millis(500);

/// UCX pinned to loopback in both children (their sockets are then
/// 127.0.0.1 only, whatever interfaces the machine has).
const PINNED: &[(&str, &str)] = &[("UCX_NET_DEVICES", "lo")];

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// What one process holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Held {
    fds: usize,
    sockets: usize,
    established: usize,
    ucx_shm_maps: usize,
}

fn held(pid: u32) -> Held {
    let mut fds = 0;
    let mut inodes = HashSet::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("read fds")
        .flatten()
    {
        fds += 1;
        if let Ok(link) = std::fs::read_link(entry.path()) {
            let link = link.to_string_lossy().into_owned();
            if let Some(inode) = link.strip_prefix("socket:[") {
                inodes.insert(inode.trim_end_matches(']').to_string());
            }
        }
    }
    let mut established = 0;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // st 01 = ESTABLISHED; column 9 is the inode.
            if cols.len() > 9 && cols[3] == "01" && inodes.contains(cols[9]) {
                established += 1;
            }
        }
    }
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    let ucx_shm_maps = maps
        .lines()
        .filter(|l| l.contains("ucx_shm") || l.contains("/dev/shm/") || l.contains("SYSV"))
        .count();
    Held {
        fds,
        sockets: inodes.len(),
        established,
        ucx_shm_maps,
    }
}

/// The ESTABLISHED TCP connections of `pid`: (local, remote) addresses as
/// `/proc/net/tcp{,6}` prints them.
fn connections(pid: u32) -> Vec<(String, String)> {
    let inodes: HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .filter_map(|l| {
                    l.to_string_lossy()
                        .strip_prefix("socket:[")
                        .map(|i| i.trim_end_matches(']').to_string())
                })
                .collect()
        })
        .unwrap_or_default();
    let mut out = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            if cols.len() > 9 && cols[3] == "01" && inodes.contains(cols[9]) {
                out.push((cols[1].to_string(), cols[2].to_string()));
            }
        }
    }
    out
}

/// TCP connections between processes `a` and `b` (each counted once).
fn between(a: u32, b: u32) -> usize {
    let theirs: HashSet<(String, String)> = connections(b).into_iter().collect();
    connections(a)
        .into_iter()
        .filter(|(local, remote)| theirs.contains(&(remote.clone(), local.clone())))
        .count()
}

fn spawn_child(role: &str, env: &[(&str, String)]) -> Child {
    let mut cmd = Command::new(std::env::current_exe().expect("test binary"));
    cmd.args([
        "child_process",
        "--exact",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(ROLE_ENV, role)
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    for (k, v) in PINNED {
        cmd.env(k, v);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn child")
}

/// Lines of a child's stdout, as they come.
fn lines_of(child: &mut Child) -> mpsc::Receiver<String> {
    let out = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// The text after `prefix` in the first line that has it (libtest may
/// print its own words first on the same line).
fn wait_for(rx: &mpsc::Receiver<String>, prefix: &str, within: Duration) -> String {
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) if l.contains(prefix) => {
                let at = l.find(prefix).expect("contains") + prefix.len();
                return l[at..].to_string();
            }
            Ok(_) => {}
            Err(e) => panic!("no line with {prefix:?} within {within:?}: {e}"),
        }
    }
}

/// Key=value pairs of a result line.
fn fields(line: &str) -> BTreeMap<String, String> {
    line.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// This binary's real tests are ignored without the NIXL runtime (cfg
/// `nixl_runtime`, from nixl-sys's build script); a run that requires the
/// runtime (`NIXL_KEEPALIVE_REQUIRE_REAL=1`, CI) fails here instead of
/// passing with every one of them ignored.
#[test]
fn the_real_runtime_is_there_when_required() {
    nixl_agent::testing::fail_when_required_and_missing();
}

/// Not a test on its own: the body of the child processes.
#[test]
fn child_process() {
    match std::env::var(ROLE_ENV).as_deref() {
        Ok("peer") => peer_child(),
        Ok("decode") => decode_child(),
        Ok("mode") => {
            let rt = Runtime::get().expect("runtime");
            println!("NKS_MODE before_agent={:?}", rt.endpoint_close_mode());
            let _a = Agent::new(
                rt,
                &format!("mode-{}", std::process::id()),
                &AgentConfig::default(),
            )
            .expect("agent");
            println!("NKS_MODE after_agent={:?}", rt.endpoint_close_mode());
        }
        _ => {}
    }
}

fn peer_child() {
    let rt = Runtime::get().expect("peer: runtime");
    let a = Agent::new(
        rt,
        &format!("peer-{}", std::process::id()),
        &AgentConfig::default(),
    )
    .expect("peer agent");
    let _mem = a.register_dram(4096).expect("register");
    println!("NKS_MD {}", hex(&a.local_metadata().expect("metadata")));
    let deadline = Instant::now() + Duration::from_secs(300);
    while Instant::now() < deadline {
        for n in a.get_notifs().expect("getNotifs") {
            println!("NKS_GOT {}", String::from_utf8_lossy(&n.message));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Progresses `agent` for `d`.
fn progress(agent: &Agent, d: Duration) {
    let until = Instant::now() + d;
    while Instant::now() < until {
        let _ = agent.get_notifs();
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn decode_child() {
    let rt = Runtime::get().expect("decode: runtime");
    let md = unhex(&std::env::var(PEER_MD_ENV).expect("peer metadata"));
    let peer: u32 = std::env::var(PEER_PID_ENV)
        .expect("peer pid")
        .parse()
        .expect("pid");
    let rounds: usize = std::env::var(ROUNDS_ENV)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100);
    let me = std::process::id();
    let d = Agent::new(rt, &format!("decode-{me}"), &AgentConfig::default()).expect("agent");
    let mode = rt.endpoint_close_mode();
    let eps = |d: &Agent| d.ucx_endpoints().expect("UCX VFS").endpoints.len();

    if std::env::var(SCENARIO_ENV).as_deref() == Ok("kill") {
        println!("NKS_START mode={mode:?} endpoints={}", eps(&d));
        let name = d.load_remote_metadata(&md).expect("load");
        d.gen_notif(&name, b"hello").expect("notify");
        progress(&d, Duration::from_millis(100));
        let st = Command::new("kill")
            .args(["-9", &peer.to_string()])
            .status();
        assert!(st.expect("kill").success());
        let killed = Instant::now();
        let mut last = NixlStatus::SUCCESS;
        while killed.elapsed() < Duration::from_secs(20) {
            let _ = d.get_notifs();
            last = match d.gen_notif_status(&name, b"hb") {
                Ok(s) => s,
                Err(e) => e.status,
            };
            if last.is_remote_disconnect() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(last.is_remote_disconnect(), "{last}");
        let closes = d.invalidate_remote_metadata(&name).expect("invalidate");
        progress(&d, Duration::from_millis(100));
        println!(
            "NKS_KILLED forced={} already_failed={} left_open={} observed={} endpoints={}",
            closes.forced,
            closes.already_failed,
            closes.left_open,
            closes.observed,
            eps(&d),
        );
        return;
    }

    // Round 0 connects and releases once; what both processes hold after
    // it has settled is the baseline (UCX opens some sockets of its own
    // lazily, e.g. the decode's connection to itself).
    let round = |i: usize| {
        let name = d.load_remote_metadata(&md).expect("load");
        d.gen_notif(&name, format!("ping{i}").as_bytes())
            .expect("notify");
        // Until the wireup traffic has settled: the connection is up
        // (milliseconds; waited for, and the child fails with what it saw
        // if it never is).
        let t = Instant::now();
        progress(&d, Duration::from_millis(20));
        while between(me, peer) == 0 {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "round {i}: no connection to the peer 10 s after loading it and notifying it; decode holds {:?}, peer {:?}",
                held(me),
                held(peer)
            );
            progress(&d, Duration::from_millis(5));
        }
        let connected = between(me, peer);
        let closes = d.invalidate_remote_metadata(&name).expect("invalidate");
        (connected, closes, eps(&d))
    };
    // Until no connection between the two is left, within 20 of the
    // peer's keepalive intervals (it closes its half at its next round);
    // returns how long that took.
    let settle = |d: &Agent| {
        let t = Instant::now();
        while between(me, peer) > 0 && t.elapsed() < PEER_KEEPALIVE * 20 {
            progress(d, Duration::from_millis(10));
        }
        t.elapsed()
    };
    let (connected0, _, _) = round(0);
    let settled0 = settle(&d);
    let (d0, p0, e0) = (held(me), held(peer), eps(&d));
    println!(
        "NKS_START mode={mode:?} connected_in_round0={connected0} settled0_ms={} endpoints={e0}",
        settled0.as_millis()
    );
    let mut by_round = Vec::new();
    for i in 1..=rounds {
        by_round.push(round(i));
    }
    let lingering = between(me, peer);
    let settled = settle(&d);
    let (dn, pn) = (held(me), held(peer));
    let forced = by_round.iter().filter(|(_, c, _)| c.forced == 1).count();
    let left_open: u32 = by_round.iter().map(|(_, c, _)| c.left_open).sum();
    let connected_min = by_round.iter().map(|(c, _, _)| *c).min().unwrap_or(0);
    let max_eps = by_round.iter().map(|(_, _, e)| *e).max().unwrap_or(0);
    if std::env::var("NKS_DEBUG_SS").is_ok() {
        let o = Command::new("ss").args(["-tnpa"]).output().expect("ss");
        eprintln!("SS\n{}", String::from_utf8_lossy(&o.stdout));
    }
    println!(
        "NKS_END rounds={rounds} forced={forced} left_open={left_open} \
         connected_min={connected_min} lingering_after_rounds={lingering} \
         between_end={} settled_ms={} max_endpoints={max_eps} endpoints_start={e0} \
         endpoints_end={} decode_fds={}->{} peer_fds={}->{} decode_sockets={}->{} \
         peer_sockets={}->{} decode_established={}->{} peer_established={}->{} \
         decode_shm_maps={}->{} peer_shm_maps={}->{}",
        between(me, peer),
        settled.as_millis(),
        eps(&d),
        d0.fds,
        dn.fds,
        p0.fds,
        pn.fds,
        d0.sockets,
        dn.sockets,
        p0.sockets,
        pn.sockets,
        d0.established,
        dn.established,
        p0.established,
        pn.established,
        d0.ucx_shm_maps,
        dn.ucx_shm_maps,
        p0.ucx_shm_maps,
        pn.ucx_shm_maps,
    );
}

struct Run {
    start: BTreeMap<String, String>,
    end: BTreeMap<String, String>,
    raw_end: String,
}

/// Runs a peer and a decode child; returns the decode's start and end
/// lines. `decode_env` is added to the decode child's environment.
fn run(rounds: usize, decode_env: &[(&str, String)], end_prefix: &str) -> Run {
    let mut peer = spawn_child(
        "peer",
        &[(
            "UCX_KEEPALIVE_INTERVAL",
            format!("{}ms", PEER_KEEPALIVE.as_millis()),
        )],
    );
    let peer_lines = lines_of(&mut peer);
    let md = wait_for(&peer_lines, "NKS_MD ", Duration::from_secs(30));
    let mut env = vec![
        (PEER_MD_ENV, md),
        (PEER_PID_ENV, peer.id().to_string()),
        (ROUNDS_ENV, rounds.to_string()),
    ];
    env.extend(decode_env.iter().cloned());
    let mut decode = spawn_child("decode", &env);
    let lines = lines_of(&mut decode);
    let start = wait_for(&lines, "NKS_START ", Duration::from_secs(30));
    let end = wait_for(&lines, end_prefix, Duration::from_secs(120));
    let status = decode.wait().expect("decode child");
    let _ = peer.kill();
    let _ = peer.wait();
    assert!(status.success(), "decode child failed: {status}");
    Run {
        start: fields(&start),
        end: fields(&end),
        raw_end: end,
    }
}

fn num(map: &BTreeMap<String, String>, key: &str) -> i64 {
    map.get(key)
        .unwrap_or_else(|| panic!("no {key} in {map:?}"))
        .parse()
        .unwrap_or_else(|_| panic!("{key} is not a number in {map:?}"))
}

/// `a->b` as (a, b).
fn pair(map: &BTreeMap<String, String>, key: &str) -> (i64, i64) {
    let v = map
        .get(key)
        .unwrap_or_else(|| panic!("no {key} in {map:?}"));
    let (a, b) = v.split_once("->").expect("a->b");
    (a.parse().expect("number"), b.parse().expect("number"))
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn a_hundred_invalidations_of_a_live_peer_leave_no_endpoint_socket_or_mapping_on_either_side() {
    real_runtime();
    let rounds = 100;
    let r = run(rounds, &[], "NKS_END ");
    eprintln!("MEASURED live invalidations: {}", r.raw_end);
    assert!(
        r.start["mode"] == format!("{:?}", EndpointCloseMode::Force),
        "endpoint close mode: {:?}",
        r.start["mode"]
    );
    // (The counter sees the connection while the peer is loaded: each
    // round waits for it, and the decode child fails if it never comes.)
    // Every invalidation closed the live peer's endpoint at once; UCX's own
    // view of the decode's endpoints is back where it was (a round may
    // briefly show one more: the internal endpoint UCX makes to answer the
    // peer's keepalive check with "removed").
    assert_eq!(num(&r.end, "forced"), rounds as i64, "{}", r.raw_end);
    assert_eq!(num(&r.end, "left_open"), 0, "{}", r.raw_end);
    let eps0 = num(&r.end, "endpoints_start");
    assert_eq!(num(&r.end, "endpoints_end"), eps0, "{}", r.raw_end);
    assert!(num(&r.end, "max_endpoints") <= eps0 + 1, "{}", r.raw_end);
    // No connection between the two outlives the peer's keepalive, and
    // both processes are back where they were after the first release: no
    // connection, socket, descriptor or mapping per release (NIXL's own
    // mode kept one connection, on both sides, per release).
    assert_eq!(num(&r.end, "between_end"), 0, "{}", r.raw_end);
    for key in [
        "decode_fds",
        "peer_fds",
        "decode_sockets",
        "peer_sockets",
        "decode_established",
        "peer_established",
        "decode_shm_maps",
        "peer_shm_maps",
    ] {
        let (before, after) = pair(&r.end, key);
        assert!(
            after <= before,
            "{key}: {before} after the first release, {after} after {rounds} more: {}",
            r.raw_end
        );
    }
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn nixls_own_close_mode_keeps_every_live_peers_endpoint_and_its_connection() {
    real_runtime();
    // What NIXL 1.5.1 does on its own: the measured reason for the forced
    // close. Should NIXL ever close these itself, this fails and says so.
    let rounds = 20;
    let r = run(
        rounds,
        &[(nixl_agent::endpoints::EP_CLOSE_ENV, "nixl".to_string())],
        "NKS_END ",
    );
    eprintln!("MEASURED NIXL's own close mode: {}", r.raw_end);
    assert!(r.start["mode"].starts_with("Nixl"), "{:?}", r.start["mode"]);
    assert_eq!(num(&r.end, "forced"), 0);
    let (eps0, eps1) = (num(&r.end, "endpoints_start"), num(&r.end, "endpoints_end"));
    assert_eq!(eps1 - eps0, rounds as i64, "one endpoint kept per round");
    assert!(
        num(&r.end, "between_end") >= rounds as i64,
        "one connection kept per round: {}",
        r.raw_end
    );
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn a_killed_peers_endpoint_is_closed_by_its_invalidation() {
    real_runtime();
    let r = run(1, &[(SCENARIO_ENV, "kill".to_string())], "NKS_KILLED ");
    eprintln!("MEASURED killed peer: {}", r.raw_end);
    // UCX failed the endpoint first; NIXL forces that close itself.
    assert_eq!(num(&r.end, "already_failed"), 1, "{}", r.raw_end);
    assert_eq!(num(&r.end, "left_open"), 0, "{}", r.raw_end);
    assert_eq!(
        num(&r.end, "endpoints"),
        num(&r.start, "endpoints"),
        "{}",
        r.raw_end
    );
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn a_bad_endpoint_close_setting_stops_loading_and_says_what_is_accepted() {
    real_runtime();
    let out = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "child_process",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_ENV, "peer")
        .env(nixl_agent::endpoints::EP_CLOSE_ENV, "forced")
        .output()
        .expect("run child");
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    assert!(
        text.contains("NIXL_SYS_EP_CLOSE")
            && text.contains("\"forced\"")
            && text.contains("`nixl`"),
        "{text}"
    );
}

/// The close mode a fresh process reports, before and after its first
/// agent, with `env`.
fn mode_in_child(env: &[(&str, &str)]) -> (String, String) {
    let mut cmd = Command::new(std::env::current_exe().expect("test binary"));
    cmd.args([
        "child_process",
        "--exact",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(ROLE_ENV, "mode");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run child");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let find = |key: &str| {
        text.lines()
            .find_map(|l| l.split_once(key).map(|(_, v)| v.to_string()))
            .unwrap_or_else(|| panic!("no {key} in {text}"))
    };
    (find("before_agent="), find("after_agent="))
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn the_close_mode_is_force_only_where_nixls_plugin_really_calls_the_interposer() {
    real_runtime();
    // Settled once an agent has loaded NIXL's UCX plugin, and checked
    // against the plugin's own relocation: with the 1.5.x runtime that is
    // the runtime's own layout probe, at load, before any agent of ours.
    let (before, after) = mode_in_child(&[]);
    assert_eq!(before, "Force");
    assert_eq!(after, "Force");
    // With RTLD_DEEPBIND the plugin binds UCX's own ucp_ep_close_nbx: the
    // check sees it, and nothing claims a forced close.
    let (_, deep) = mode_in_child(&[("NIXL_UCX_DEEPBIND", "1")]);
    assert!(deep.starts_with("Unavailable"), "{deep}");
    let (_, nixl) = mode_in_child(&[(nixl_agent::endpoints::EP_CLOSE_ENV, "nixl")]);
    assert_eq!(nixl, "Nixl");
}

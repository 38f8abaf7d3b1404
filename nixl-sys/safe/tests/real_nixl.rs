//! Tests against the real NIXL runtime (UCX over shared memory / loopback,
//! DRAM only, no GPU). Each prints `SKIPPED: ...` and passes when the
//! runtime is missing, unless NIXL_KEEPALIVE_REQUIRE_REAL=1.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nixl_agent::testing::real_runtime;
use nixl_agent::{Agent, AgentConfig, ApiKind, NixlStatus, Runtime, StatusSource, XferState};

const CHILD_ENV: &str = "NIXL_SYS_TEST_CHILD";

fn agent(rt: &'static Runtime, name: &str) -> Agent {
    Agent::new(rt, name, &AgentConfig::default()).expect("create agent")
}

fn unique(name: &str) -> String {
    format!("{name}-{}", std::process::id())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// Polls `who` (and progresses `also`) until a notification from `from`
/// with `message` arrives; on the deadline panics with every notification
/// that did.
fn wait_for_notif(who: &Agent, also: &Agent, from: &str, message: &[u8]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut others = Vec::new();
    loop {
        let _ = also.get_notifs();
        let got = who.get_notifs().expect("getNotifs");
        if got.iter().any(|n| n.agent == from && n.message == message) {
            return;
        }
        others.extend(
            got.iter()
                .map(|n| format!("{}: {}", n.agent, String::from_utf8_lossy(&n.message))),
        );
        assert!(
            Instant::now() < deadline,
            "no notification {message:?} from {from} within 10 s; got only {others:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// This binary's real tests are ignored without the NIXL runtime (cfg
/// `nixl_runtime`, from nixl-sys's build script); a run that requires the
/// runtime (`NIXL_KEEPALIVE_REQUIRE_REAL=1`, CI) fails here instead of
/// passing with every one of them ignored.
#[test]
fn the_real_runtime_is_there_when_required() {
    nixl_agent::testing::fail_when_required_and_missing();
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn runtime_loads_and_uses_the_cpp_shim_on_1_5() {
    let rt = real_runtime();
    eprintln!(
        "NIXL runtime: {} ({:?})",
        rt.lib_dir().display(),
        rt.api_kind()
    );
    assert!(rt.lib_dir().join("libnixl.so").is_file());
    if rt.lib_dir().to_string_lossy().contains("mesonpy") {
        assert_eq!(rt.api_kind(), ApiKind::CollapsedCapiWithShim);
    }
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn two_agents_exchange_metadata_and_a_notification() {
    let rt = real_runtime();
    let a = agent(rt, &unique("meta-a"));
    let b = agent(rt, &unique("meta-b"));
    let _ra = a.register_dram(4096).unwrap();
    let _rb = b.register_dram(4096).unwrap();

    let b_name = a
        .load_remote_metadata(&b.local_metadata().unwrap())
        .unwrap();
    assert_eq!(b_name, b.name());
    let a_name = b
        .load_remote_metadata(&a.local_metadata().unwrap())
        .unwrap();
    assert_eq!(a_name, a.name());

    // Loading the same metadata again: report what NIXL says.
    eprintln!(
        "second loadRemoteMD of identical metadata: {:?}",
        a.load_remote_metadata(&b.local_metadata().unwrap())
    );

    a.gen_notif(b.name(), b"hello from a").unwrap();
    wait_for_notif(&b, &a, a.name(), b"hello from a");
    b.gen_notif(a.name(), b"hello from b").unwrap();
    wait_for_notif(&a, &b, b.name(), b"hello from b");

    a.invalidate_remote_metadata(b.name()).unwrap();
    b.invalidate_remote_metadata(a.name()).unwrap();
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn invalidating_an_unknown_agent_returns_raw_not_found() {
    let rt = real_runtime();
    let a = agent(rt, &unique("inval"));
    let err = a.invalidate_remote_metadata("no-such-agent").unwrap_err();
    eprintln!("{err}");
    assert_eq!(err.status, NixlStatus::ERR_NOT_FOUND);
    assert_eq!(err.raw_code(), -4);
    if rt.api_kind() == ApiKind::CollapsedCapiWithShim {
        assert_eq!(err.source, StatusSource::Cpp);
    }
    assert!(err.is_not_found());
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn prepping_a_dlist_for_an_unknown_agent_fails_with_raw_not_found() {
    let rt = real_runtime();
    let a = agent(rt, &unique("prep"));
    let r = a.register_dram(64).unwrap();
    let err = a
        .prep_remote_dlist("no-such-agent", &[r.desc()])
        .err()
        .unwrap();
    eprintln!("{err}");
    assert_eq!(err.status, NixlStatus::ERR_NOT_FOUND);
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn a_read_between_two_agents_moves_the_right_bytes() {
    let rt = real_runtime();
    const LEN: usize = 64 * 1024;
    let d = agent(rt, &unique("read-d"));
    let p = agent(rt, &unique("read-p"));
    let mut src = p.register_dram(LEN).unwrap();
    for (i, b) in src.bytes_mut().iter_mut().enumerate() {
        *b = (i * 7 + 3) as u8;
    }
    let dst = d.register_dram(LEN).unwrap();
    d.load_remote_metadata(&p.local_metadata().unwrap())
        .unwrap();

    // Two blocks, read crosswise: remote block 1 -> local block 0 and back.
    let half = LEN / 2;
    let local = d
        .prep_local_dlist(&[dst.sub_desc(0, half), dst.sub_desc(half, half)])
        .unwrap();
    let remote = d
        .prep_remote_dlist(p.name(), &[src.sub_desc(0, half), src.sub_desc(half, half)])
        .unwrap();
    let mut req = d
        .create_read(&local, &[0, 1], &remote, &[1, 0], Some(b"read-done"))
        .unwrap();
    let mut state = req.post().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while state == XferState::InProgress {
        assert!(Instant::now() < deadline, "READ did not complete");
        std::thread::sleep(Duration::from_millis(1));
        // Without a progress thread the target progresses only in calls.
        let _ = p.get_notifs();
        state = req.status().unwrap();
    }
    assert_eq!(&dst.bytes()[..half], &src.bytes()[half..]);
    assert_eq!(&dst.bytes()[half..], &src.bytes()[..half]);
    wait_for_notif(&p, &d, d.name(), b"read-done");

    req.release().unwrap();
    local.release().unwrap();
    remote.release().unwrap();
    d.invalidate_remote_metadata(p.name()).unwrap();
}

/// Not a test on its own: the body of the child process spawned by
/// `gen_notif_to_a_sigkilled_child_returns_raw_remote_disconnect`.
#[test]
fn child_agent_process() {
    if std::env::var(CHILD_ENV).is_err() {
        return;
    }
    let rt = Runtime::get().expect("child: runtime");
    let a = agent(rt, &format!("child-{}", std::process::id()));
    let _mem = a.register_dram(4096).unwrap();
    println!("NKS_MD {}", hex(&a.local_metadata().unwrap()));
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        for n in a.get_notifs().unwrap() {
            println!("NKS_GOT {}", String::from_utf8_lossy(&n.message));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn gen_notif_to_a_sigkilled_child_returns_raw_remote_disconnect() {
    let rt = real_runtime();
    sigkill_child_then_heartbeat(rt, &AgentConfig::default());
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn with_a_progress_thread_gen_notif_to_a_sigkilled_child_returns_raw_remote_disconnect() {
    let rt = real_runtime();
    let cfg = AgentConfig {
        progress_thread: nixl_agent::ProgressThread::Polling {
            delay: Duration::from_millis(1),
        },
        ..AgentConfig::default()
    };
    sigkill_child_then_heartbeat(rt, &cfg);
}

fn sigkill_child_then_heartbeat(rt: &'static Runtime, cfg: &AgentConfig) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "child_agent_process",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn child");
    let (tx, rx) = mpsc::channel::<String>();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    // Waits for a line from the child, progressing `d`'s worker meanwhile
    // (without a progress thread, our sends move only inside our calls).
    let wait_line = |d: &Agent, prefix: &str| -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let _ = d.get_notifs();
            match rx.recv_timeout(Duration::from_millis(5)) {
                // libtest may print "test child_agent_process ... " first
                // on the same line.
                Ok(l) if l.contains(prefix) => {
                    let at = l.find(prefix).unwrap() + prefix.len();
                    return l[at..].to_string();
                }
                Ok(_) => {}
                Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() < deadline => {}
                Err(e) => panic!("child never printed {prefix:?}: {e}"),
            }
        }
    };

    let d = Agent::new(rt, &unique("killer"), cfg).expect("create agent");
    let md = unhex(&wait_line(&d, "NKS_MD "));
    let child_name = d.load_remote_metadata(&md).unwrap();
    d.gen_notif(&child_name, b"ping").unwrap();
    assert_eq!(wait_line(&d, "NKS_GOT "), "ping");

    child.kill().expect("SIGKILL child");
    child.wait().unwrap();
    let killed_at = Instant::now();

    // Heartbeat the dead peer the way the service does, progressing our
    // worker between beats, until UCX has noticed.
    let mut seen: Vec<(u128, NixlStatus)> = Vec::new();
    let mut last = NixlStatus::SUCCESS;
    while killed_at.elapsed() < Duration::from_secs(30) {
        let _ = d.get_notifs();
        let st = match d.gen_notif_status(&child_name, b"hb") {
            Ok(s) => s,
            Err(e) => {
                if rt.api_kind() == ApiKind::CollapsedCapiWithShim {
                    assert_eq!(e.source, StatusSource::Cpp);
                }
                e.status
            }
        };
        if seen.last().map(|s| s.1) != Some(st) {
            seen.push((killed_at.elapsed().as_millis(), st));
        }
        last = st;
        if st.is_remote_disconnect() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!(
        "{:?}: statuses after SIGKILL (ms since kill, status): {seen:?}",
        cfg.progress_thread
    );
    assert_eq!(
        last.raw(),
        -10,
        "expected raw NIXL_ERR_REMOTE_DISCONNECT within 30 s of the kill, got {last}; statuses (ms since kill, status): {seen:?}"
    );

    // It stays that way, call after call.
    for _ in 0..3 {
        let e = d.gen_notif(&child_name, b"hb").unwrap_err();
        assert_eq!(e.status, NixlStatus::ERR_REMOTE_DISCONNECT);
    }
    let inval = d.invalidate_remote_metadata(&child_name);
    eprintln!("invalidateRemoteMD after disconnect: {inval:?}");
    match inval {
        // UCX had failed the endpoint: NIXL force-closes it itself.
        Ok(closes) => assert!(
            !closes.observed || (closes.already_failed == 1 && closes.left_open == 0),
            "{closes:?}"
        ),
        Err(e) => assert!(e.is_not_found(), "{e}"),
    }
    let after = d.gen_notif(&child_name, b"hb").unwrap_err();
    eprintln!("genNotif after invalidate: {after}");
    assert_eq!(after.status, NixlStatus::ERR_NOT_FOUND);
}

/// Process CPU time (user + system) so far, from /proc/self/stat.
fn process_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    // Fields after the parenthesised command name; utime and stime are
    // fields 14 and 15 (1-based) of the whole line.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10) // USER_HZ = 100 on Linux
}

/// Measures what each progress-thread setting costs an idle agent. Run by
/// hand: `cargo test -p nixl-agent --test real_nixl -- --ignored --nocapture
/// measure_progress_thread_cpu`.
#[test]
#[ignore = "measurement, run by hand"]
fn measure_progress_thread_cpu() {
    use nixl_agent::ProgressThread;
    let rt = real_runtime();
    let settings = [
        ProgressThread::Off,
        ProgressThread::Polling {
            delay: Duration::ZERO,
        },
        ProgressThread::Polling {
            delay: Duration::from_micros(100),
        },
        ProgressThread::Polling {
            delay: Duration::from_millis(1),
        },
        ProgressThread::Polling {
            delay: Duration::from_millis(10),
        },
    ];
    for (i, pt) in settings.into_iter().enumerate() {
        let cfg = AgentConfig {
            progress_thread: pt,
            ..AgentConfig::default()
        };
        let a = Agent::new(rt, &unique(&format!("cpu-a{i}")), &cfg).unwrap();
        let b = Agent::new(rt, &unique(&format!("cpu-b{i}")), &cfg).unwrap();
        let _ma = a.register_dram(4096).unwrap();
        let _mb = b.register_dram(4096).unwrap();
        a.load_remote_metadata(&b.local_metadata().unwrap())
            .unwrap();
        b.load_remote_metadata(&a.local_metadata().unwrap())
            .unwrap();
        a.gen_notif(b.name(), b"x").unwrap();
        wait_for_notif(&b, &a, a.name(), b"x");
        std::thread::sleep(Duration::from_millis(200));
        let (c0, t0) = (process_cpu(), Instant::now());
        std::thread::sleep(Duration::from_secs(3));
        let (c1, t1) = (process_cpu(), Instant::now());
        let pct = (c1 - c0).as_secs_f64() / (t1 - t0).as_secs_f64() * 100.0;
        eprintln!("CPU {pt:?}: two idle connected agents: {pct:.1}% of one core");
    }
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn an_agent_name_with_a_nul_is_refused_before_it_reaches_nixl() {
    let rt = real_runtime();
    for name in ["victim-rank0\0zz", "\0", "a\0"] {
        let e = Agent::new(rt, name, &AgentConfig::default()).expect_err(name);
        assert!(e.is_refused_agent_name(), "{e}");
        assert_eq!(e.source, StatusSource::Crate, "{e}");
        assert_eq!(e.status, NixlStatus::ERR_INVALID_PARAM, "{e}");
    }
    // Names addressing a remote agent are refused the same way.
    let a = agent(rt, &unique("nul-caller"));
    let victim = unique("victim");
    let cut = format!("{victim}\0zz");
    for e in [
        a.gen_notif(&cut, b"HB:").unwrap_err(),
        a.invalidate_remote_metadata(&cut).unwrap_err(),
        a.prep_remote_dlist(&cut, &[]).err().expect("refused"),
    ] {
        assert!(e.is_refused_agent_name(), "{e}");
        assert!(e.to_string().contains("NUL byte at offset"), "{e}");
    }
}

/// A hostile peer hands out metadata whose agent name is a live agent's
/// name plus `\0zz`. NIXL loads it under the whole name; the name must not
/// come back cut (it would name the victim, and the caller's undo would
/// invalidate the victim's metadata). It is refused, unloaded by its exact
/// name, and the victim stays usable.
#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn metadata_whose_agent_name_has_a_nul_is_refused_and_the_victim_is_untouched() {
    let rt = real_runtime();
    if rt.api_kind() != ApiKind::CollapsedCapiWithShim {
        eprintln!(
            "SKIPPED: the {:?} C API returns agent names as C strings; a cut cannot be seen",
            rt.api_kind()
        );
        return;
    }
    let decode = agent(rt, &unique("nul-decode"));
    let victim_name = unique("victim-rank0");
    let victim = agent(rt, &victim_name);
    let rv = victim.register_dram(4096).unwrap();
    assert_eq!(
        decode
            .load_remote_metadata(&victim.local_metadata().unwrap())
            .unwrap(),
        victim_name
    );

    // The attacker: an agent whose name has the victim's as prefix and the
    // same length as `victim\0zz`; its metadata with that byte patched.
    let hostile_name = format!("{victim_name}Xzz");
    let hostile = agent(rt, &hostile_name);
    let _rh = hostile.register_dram(4096).unwrap();
    let mut md = hostile.local_metadata().unwrap();
    let at = md
        .windows(hostile_name.len())
        .position(|w| w == hostile_name.as_bytes())
        .expect("the agent name is in its metadata");
    md[at + victim_name.len()] = 0;

    let e = decode.load_remote_metadata(&md).unwrap_err();
    assert!(e.is_refused_agent_name(), "{e}");
    match &e.refusal {
        Some(nixl_agent::Refusal::AgentName { name, problem }) => {
            assert_eq!(name, format!("{victim_name}\0zz").as_bytes());
            assert_eq!(
                *problem,
                nixl_agent::AgentNameProblem::Nul {
                    at: victim_name.len()
                }
            );
        }
        other => panic!("{other:?}"),
    }
    // Unloaded by its exact name: other metadata under the same name (a
    // second agent of that name, patched alike) loads and is refused by
    // name again; were the first still loaded, NIXL would answer
    // NOT_ALLOWED (metadata is not updated in place).
    let hostile2 = agent(rt, &hostile_name);
    let _rh2 = hostile2.register_dram(4096).unwrap();
    let mut md2 = hostile2.local_metadata().unwrap();
    assert_ne!(md2, hostile.local_metadata().unwrap());
    let at = md2
        .windows(hostile_name.len())
        .position(|w| w == hostile_name.as_bytes())
        .expect("the agent name is in its metadata");
    md2[at + victim_name.len()] = 0;
    let again = decode.load_remote_metadata(&md2).unwrap_err();
    assert!(again.is_refused_agent_name(), "{again}");

    // The victim's metadata is still loaded and usable.
    decode.gen_notif(&victim_name, b"still-here").unwrap();
    wait_for_notif(&victim, &decode, decode.name(), b"still-here");
    if let Err(e) = decode.prep_remote_dlist(&victim_name, &[rv.desc()]) {
        panic!("the victim's metadata must survive: {e}");
    }
}

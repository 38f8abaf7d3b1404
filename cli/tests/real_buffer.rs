//! Where the bytes of a given-up READ go, on the real NIXL runtime.
//!
//! A prefill is frozen (SIGSTOP) with a READ in flight; the decode side
//! gives the read up as `decode` does (`releaseXferReq`), writes a sentinel
//! over the destination buffer, and resumes the prefill (SIGCONT). Does
//! the buffer get overwritten, does the prefill get the read's `RD:`
//! notification? Three ways of giving up, under three settings (UCX
//! reads its environment when the agent is created, so each setting runs
//! the decode side in a child process: this test binary again): the
//! default transports, TCP, and TCP with NIXL's own endpoint close
//! (`NIXL_SYS_EP_CLOSE=nixl`) instead of `nixl-sys`'s forced one:
//!
//! - `released_request`: the request released, the engine kept loaded;
//! - `released_engine`: the request released, then the engine released as
//!   the service does (dlist handles released, `invalidateRemoteMD`)
//!   before the prefill resumes;
//! - `kept_request`: the request not released (for comparison: what
//!   releasing changes).
//!
//! Pinned for NIXL 1.5.1 (nixl-cu12 wheel, bundled UCX 1.23, loopback,
//! DRAM), as measured on this project's machine:
//! - over TCP (`UCX_TLS=tcp`) the READ waits for the frozen prefill: the
//!   buffer is untouched at the give-up, and once the prefill resumes its
//!   bytes land in the buffer (over the sentinel) within milliseconds:
//!   `releaseXferReq` does not end the transfer. After the engine's
//!   release they land only with NIXL's own close (16-49 ms, which keeps
//!   the connection up); with the close `nixl-sys` forces (its default)
//!   nothing landed after the release (4 of 4 runs, watched 6 s: the
//!   endpoint and its connection are gone). Only a request that is not
//!   released completes (and only then is its `RD:` sent);
//! - with the default transports (shared memory, CMA) the bytes had
//!   already landed when the read was given up (the GET is one-sided;
//!   what waits for the frozen prefill is the completion of the
//!   notification), and nothing lands after;
//! - NIXL sends a READ's `RD:` only once its data moved (GETs and a flush
//!   done), from a status poll; a request released before that never
//!   sends it. Over TCP a released request's `RD:` never reached the
//!   prefill. With shared memory it did, rarely (1 run in about 7), when
//!   NIXL had handed it to UCX before the give-up (the data had moved):
//!   not asserted. The kept request's `RD:` always comes after the
//!   resume: releasing is what stops a given-up read from completing
//!   after its lease.
//!
//! Hence the rule in the API: the destination of a given-up read is reused
//! only when the transport's release is known to end transfers
//! (`Transport::release_ends_transfers`, false for NIXL 1.5.1:
//! `Destination::Retire`), and `decode` retires such slots for good. (The
//! forced close stopping TCP's late bytes is measured here on loopback
//! only; the claim stays false.)

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{decode_transport, report, serial, PrefillProc, PrefillSpec};
use nixl_agent::testing::real_runtime;
use nixl_agent::{Agent, Desc, DlistHandle, XferRequest, XferState};
use nixl_keepalive::transport::nixl::RemoteDlists;
use nixl_keepalive::{AgentName, EngineId, Transport};
use nixl_keepalive_cli::pd::pattern;

const CHILD_ENV: &str = "NIXL_KEEPALIVE_BUFFER_CHILD";
const SENTINEL: u8 = 0xA5;
/// A READ not done this long after the prefill was stopped is in flight
/// to the frozen prefill (a read takes about 1 ms here).
const HUNG: Duration = Duration::from_secs(2);
/// After the resume, once a fresh read from the prefill has completed:
/// how much longer a stale byte or notification is watched for (bytes
/// landed 4-23 ms after the resume when they did). A window for what may
/// or may not come; what must come (the kept request's end and its `RD:`)
/// is waited for, up to [`PATIENCE`].
const WATCH: Duration = Duration::from_secs(1);

/// The longest wait for what must happen: a READ to the running prefill, a
/// kept request's end and its `RD:` after the resume (milliseconds when
/// quiet).
const PATIENCE: Duration = Duration::from_secs(20);

const SETTINGS: &[(&str, &[(&str, &str)])] = &[
    ("default", &[]),
    ("tcp", &[("UCX_TLS", "tcp")]),
    (
        "tcp+nixl_close",
        &[("UCX_TLS", "tcp"), ("NIXL_SYS_EP_CLOSE", "nixl")],
    ),
];
const SCENARIOS: &[&str] = &["released_request", "released_engine", "kept_request"];

/// What one scenario saw.
#[derive(Debug, Default)]
struct Seen {
    /// `releaseXferReq` of the READ in progress (`-` when kept).
    release: String,
    /// The read's bytes were already in the buffer when it was given up.
    landed_before_give_up: bool,
    /// After the resume, bytes overwrote the sentinel: when.
    landed_after_resume: Option<Duration>,
    /// After the resume, the prefill got the read's `RD:`: when.
    rd_after_resume: Option<Duration>,
    /// The kept request's status after the resume.
    kept_status: String,
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn where_the_bytes_of_a_given_up_read_go_and_what_the_release_changes() {
    let rt = real_runtime();
    let _serial = serial();
    // The transport's claim, which `Destination` follows.
    let (transport, _progress) = decode_transport(rt);
    let claims_release_ends_transfers = transport.release_ends_transfers();
    drop(_progress);
    drop(transport);
    let mut failures = Vec::new();
    for (setting, env) in SETTINGS {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["buffer_child", "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, setting);
        for (k, v) in env.iter() {
            cmd.env(k, v);
        }
        // Three scenarios, each at most: a hung read found, the control
        // read and the kept request waited for.
        let out = common::run_child(
            cmd,
            &format!("the {setting} child"),
            (HUNG + PATIENCE * 2 + common::wait::MARGIN) * SCENARIOS.len() as u32,
        );
        let text = format!(
            "{}\nstderr:\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        for scenario in SCENARIOS {
            let key = format!("BUFFER_RESULT {scenario} ");
            let Some(line) = text
                .lines()
                .find_map(|l| l.find(&key).map(|i| l[i + key.len()..].to_string()))
            else {
                failures.push(format!("{setting}/{scenario}: no result:\n{text}"));
                continue;
            };
            report(&format!("{setting}, {scenario}: {line}"));
            let has = |s: &str| line.contains(s);
            let mut expect = |ok: bool, what: &str| {
                if !ok {
                    failures.push(format!("{setting}/{scenario}: expected {what}: {line}"));
                }
            };
            let released = *scenario != "kept_request";
            if released {
                expect(
                    has("release=NIXL_SUCCESS "),
                    "releaseXferReq to answer SUCCESS",
                );
            } else {
                expect(
                    !has("rd_after_resume=None"),
                    "the kept request's RD: after the resume",
                );
            }
            match *setting {
                "tcp" | "tcp+nixl_close" => {
                    let forced = has("close_mode=Force ");
                    expect(
                        forced == (*setting == "tcp"),
                        "the endpoint close mode the setting asks for",
                    );
                    expect(
                        has("landed_before_give_up=false"),
                        "TCP: nothing landed while frozen",
                    );
                    if *scenario == "released_engine" && forced {
                        expect(
                            has("landed_after_resume=None"),
                            "TCP, forced close: nothing lands after the engine's release",
                        );
                    } else {
                        expect(
                            !has("landed_after_resume=None"),
                            "TCP: the bytes land after the resume (NIXL 1.5.1)",
                        );
                    }
                    if released {
                        expect(
                            has("rd_after_resume=None"),
                            "TCP: no RD: for a released request",
                        );
                    }
                }
                _ => {
                    expect(
                        has("landed_before_give_up=true"),
                        "shm: the one-sided GET landed at once",
                    );
                    expect(
                        has("landed_after_resume=None"),
                        "shm: nothing lands after the give-up",
                    );
                }
            }
            if *scenario == "released_engine" && claims_release_ends_transfers {
                expect(
                    has("landed_after_resume=None"),
                    "nothing to land after a release the transport says ends transfers",
                );
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    assert!(
        !claims_release_ends_transfers,
        "the NIXL transport claims its release ends transfers: update the pinned facts above"
    );
}

/// Not a test on its own: the decode side of one setting, run by the test
/// above in a child process with the setting's UCX environment.
#[test]
fn buffer_child() {
    let Ok(setting) = std::env::var(CHILD_ENV) else {
        return;
    };
    let rt = nixl_agent::Runtime::get().expect("child: runtime");
    let env: Vec<(String, String)> = std::env::var("UCX_TLS")
        .map(|v| vec![("UCX_TLS".to_string(), v)])
        .unwrap_or_default();
    // The endpoint close mode is settled by the first agent's UCX plugin.
    drop(
        Agent::new(
            rt,
            &common::unique("probe"),
            &nixl_agent::AgentConfig::default(),
        )
        .expect("agent"),
    );
    let forced = rt.endpoint_close_mode().is_force();
    for scenario in SCENARIOS {
        // What the parent expects to land after the resume, waited for
        // here: over TCP the stale bytes, unless the engine's release
        // closed the endpoint by force.
        let must_land = setting.starts_with("tcp") && !(*scenario == "released_engine" && forced);
        let seen = run(rt, &env, scenario, must_land);
        println!(
            "BUFFER_RESULT {scenario} setting={setting} close_mode={:?} release={} landed_before_give_up={} landed_after_resume={:?} rd_after_resume={:?} kept_status={}",
            rt.endpoint_close_mode(),
            seen.release,
            seen.landed_before_give_up,
            seen.landed_after_resume,
            seen.rd_after_resume,
            seen.kept_status
        );
    }
}

/// A prefill's rank 0 loaded into the decode agent.
struct Loaded {
    name: String,
    remote: DlistHandle,
    seed: u64,
    blocks: u32,
}

fn load(agent: &Agent, p: &PrefillProc) -> Loaded {
    let reply = common::block_on(nixl_keepalive_cli::pd::decode::fetch(
        &p.addr,
        Duration::from_secs(5),
    ))
    .expect("handshake");
    let rank = &reply.ranks[0];
    let name = agent.load_remote_metadata(&rank.metadata).expect("load");
    let descs: Vec<Desc> = (0..reply.blocks)
        .map(|b| Desc {
            addr: rank.base + u64::from(b) * reply.block_size,
            len: reply.block_size as usize,
            dev_id: 0,
        })
        .collect();
    Loaded {
        remote: agent
            .prep_remote_dlist(&name, &descs)
            .expect("remote dlist"),
        name,
        seed: pattern::seed(&reply.engine),
        blocks: reply.blocks,
    }
}

/// Posts a READ of `block` of `remote` into slot `slot` and waits up to
/// `within`.
fn read(
    agent: &Agent,
    local: &DlistHandle,
    slot: i32,
    remote: &DlistHandle,
    block: u32,
    notif: &str,
    within: Duration,
) -> (XferRequest, XferState) {
    let mut req = agent
        .create_read(
            local,
            &[slot],
            remote,
            &[block as i32],
            Some(notif.as_bytes()),
        )
        .expect("create READ");
    let mut state = req.post().expect("post READ");
    let start = Instant::now();
    while state == XferState::InProgress && start.elapsed() < within {
        std::thread::sleep(Duration::from_micros(200));
        state = req.status().expect("READ status");
    }
    (req, state)
}

fn run(
    rt: &'static nixl_agent::Runtime,
    env: &[(String, String)],
    scenario: &str,
    must_land: bool,
) -> Seen {
    let p = PrefillProc::start(&PrefillSpec {
        env: env.to_vec(),
        ..Default::default()
    });
    let (transport, _progress) = decode_transport(rt);
    let agent = transport.agent().clone();
    let Loaded {
        name,
        remote,
        seed,
        blocks,
    } = load(&agent, &p);
    let bs = 64 << 10;
    let mut target = agent.register_dram(bs).expect("register");
    let control = agent.register_dram(bs).expect("register");
    let local = agent
        .prep_local_dlist(&[target.desc(), control.desc()])
        .expect("local dlist");
    let tag = format!("{scenario}-{}", std::process::id());
    let mut seen = Seen::default();

    // Reads flow; the prefill is stopped; the first READ that does not
    // complete is the one in flight to the frozen prefill.
    let started = Instant::now();
    let mut n = 0u32;
    let mut stopped: Option<Instant> = None;
    let (req, block) = loop {
        if stopped.is_none() && started.elapsed() > Duration::from_millis(500) {
            p.signal("STOP");
            stopped = Some(Instant::now());
        }
        target.bytes_mut().fill(0);
        let block = n % blocks;
        let notif = format!("RD:{tag}-{n}");
        let (mut req, mut state) = read(&agent, &local, 0, &remote, block, &notif, HUNG);
        n += 1;
        if state == XferState::InProgress && stopped.is_some() {
            break (req, block);
        }
        // Not stopped yet: a slow read on a loaded machine, not a hung one.
        let slow = Instant::now();
        while state == XferState::InProgress {
            assert!(
                slow.elapsed() < PATIENCE,
                "a READ from the running prefill took over {:?}",
                HUNG + PATIENCE
            );
            std::thread::sleep(Duration::from_micros(200));
            state = req.status().expect("READ status");
        }
        assert!(
            stopped.is_none_or(|t| t.elapsed() < Duration::from_secs(10)),
            "{n} READs completed to a stopped prefill"
        );
    };
    // The hung READ's notification names this request.
    let stale = format!("{tag}-{}", n - 1);
    seen.landed_before_give_up = pattern::first_mismatch(target.bytes(), seed, 0, block).is_none();
    let mut kept = None;
    if scenario == "kept_request" {
        seen.release = "-".into();
        kept = Some(req);
    } else {
        seen.release = match req.release() {
            Ok(()) => nixl_agent::NixlStatus::SUCCESS.name().to_string(),
            Err(e) => format!("{}({})", e.status.name(), e.status.raw()),
        };
    }
    target.bytes_mut().fill(SENTINEL);
    let engine = EngineId::from(p.engine.as_str());
    let agents = [AgentName::from(name.as_str())];
    let dlists = RemoteDlists::new(vec![remote]);
    if scenario == "released_engine" {
        let steps = transport.release(&engine, &agents, dlists.clone());
        assert!(steps.iter().all(|s| s.status.is_ok()), "{steps:?}");
    }
    std::thread::sleep(Duration::from_millis(200));
    p.signal("CONT");
    let resumed = Instant::now();

    // The control: a fresh READ from the resumed prefill (after the
    // release, through its metadata loaded again) completes, so the
    // prefill has run; stale bytes and notifications get MARGIN more.
    let reloaded = (scenario == "released_engine").then(|| load(&agent, &p));
    let control_read = |remote: &DlistHandle| {
        let (req, state) = read(
            &agent,
            &local,
            1,
            remote,
            0,
            "RD:control",
            Duration::from_secs(20),
        );
        drop(req);
        state
    };
    let state = match &reloaded {
        Some(again) => control_read(&again.remote),
        None => dlists.with_handle(0, control_read).expect("still loaded"),
    };
    assert_eq!(state, XferState::Done, "the control READ after the resume");
    let control_done = Instant::now();
    loop {
        let watched = control_done.elapsed();
        // The kept request must end and send its `RD:`, and bytes that must
        // land must land: waited for.
        let kept_pending =
            scenario == "kept_request" && (kept.is_some() || seen.rd_after_resume.is_none());
        let landing_pending = must_land && seen.landed_after_resume.is_none();
        if (watched >= WATCH && !kept_pending && !landing_pending) || watched >= PATIENCE {
            break;
        }
        if seen.landed_after_resume.is_none() && target.bytes().iter().any(|&b| b != SENTINEL) {
            seen.landed_after_resume = Some(resumed.elapsed());
        }
        if seen.rd_after_resume.is_none() && p.log_text().contains(&format!("request=\"{stale}\""))
        {
            seen.rd_after_resume = Some(resumed.elapsed());
        }
        if let Some(r) = kept.as_mut() {
            match r.status() {
                Ok(XferState::InProgress) => {}
                other => {
                    seen.kept_status = format!("{other:?} after {:?}", resumed.elapsed());
                    kept = None;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    drop(kept);
    if seen.landed_after_resume.is_some() {
        assert_eq!(
            pattern::first_mismatch(target.bytes(), seed, 0, block),
            None,
            "what landed is the block that was read"
        );
    }
    // Give everything back.
    let _ = transport.release(&engine, &agents, dlists);
    if let Some(again) = reloaded {
        let _ = transport.release(&engine, &agents, RemoteDlists::new(vec![again.remote]));
    }
    drop(local);
    seen
}

//! A real network partition, in network namespaces of its own: a
//! `nixl-keepalive decode` in one namespace, each `nixl-keepalive prefill`
//! in another, joined by a veth pair on a private /30 that this test
//! creates *inside* the namespaces and removes with them (also on
//! failure). The namespace everything else on the machine uses is never
//! touched: its links and addresses are compared before, during and after,
//! and none of this test's may ever show there. UCX runs over TCP only
//! (`UCX_TLS=tcp`), each side pinned to its end of the veth with
//! `UCX_NET_DEVICES`. The link is cut with `ip link set down` (sch_netem is
//! not available everywhere; a downed link drops every packet just the
//! same), or the decode's address on it is removed, and the decode's
//! stdout events are timed against that. Its metrics are scraped from a
//! thread that enters its namespace (`setns`).
//!
//! What it pins, measured:
//! - with `UCX_TCP_USER_TIMEOUT=3s`: partition -> `event: unreachable ...
//!   REMOTE_DISCONNECT` -> `event: released`, within the silent-peer bound
//!   the decode reports (`nixl_keepalive_detection_bound_silent_seconds`),
//!   both with reads in flight (a transfer reports it) and with none (a
//!   heartbeat does);
//! - a 1 s partition, healed well before that bound, releases nothing and
//!   reads go on being verified;
//! - with UCX's default user timeout (`auto`), the kernel retransmits for
//!   about 15 minutes: the decode reports that bound (~927 s), and a 15 s
//!   partition is not reported (TCP keepalive, tuned to 1s/1s/3, sends no
//!   probe while the heartbeats are unacknowledged) and reads resume after
//!   it heals;
//! - two prefills on two links, and the decode's address on one of them
//!   removed: that prefill is released within the bound, the decode holds
//!   no socket over the removed address once the release is done, and
//!   reads from the other prefill never hang meanwhile (none times out).
//!
//! Needs root and `ip` (iproute2; `scripts/install-netns-tools.sh`). Where
//! namespaces cannot be made it prints SKIPPED with the reason; in CI
//! (`CI=true`) that is a failure.

mod common;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use common::procfs::tcp_sockets;
use common::{ms, report, serial, PrefillProc, PrefillSpec};
use nixl_agent::testing::real_runtime;
use nixl_keepalive::PeerAddr;

/// The decode's heartbeat interval (its jitter derives: 50 ms).
const INTERVAL: &str = "500ms";
/// The short partition, healed well before the bound.
const SHORT_CUT: Duration = Duration::from_secs(1);
/// The partition under UCX's default user timeout: longer than what TCP
/// keepalive (1s idle + 3 x 1s) would take, far below the kernel's limit.
const DEFAULT_CUT: Duration = Duration::from_secs(15);
/// Where the decode's metrics listen, inside its own namespace (nothing
/// else lives there).
const METRICS_ADDR: &str = "127.0.0.1:19464";
/// The decode's read timeout (`DecodeOptions::default`): a read that
/// hangs shows as `timed_out` after it.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// `ip ARGS`, its stderr on failure.
fn ip(args: &[&str]) -> Result<String, String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip` (iproute2): {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The links and addresses of the namespace this test runs in (the one
/// everything else on the machine uses), one line each, without counters.
fn host_network() -> BTreeSet<String> {
    let mut lines = BTreeSet::new();
    for args in [["-o", "link", "show"], ["-o", "addr", "show"]] {
        let text = ip(&args).expect("list the host's links and addresses");
        for line in text.lines() {
            // `ip -o link` prints the link's state, which others' links
            // may change; keep what identifies a link or an address.
            let words: Vec<&str> = line.split_whitespace().collect();
            let keep: Vec<&str> = words
                .iter()
                .take_while(|w| **w != "mtu" && **w != "valid_lft")
                .copied()
                .collect();
            lines.insert(keep.join(" "));
        }
    }
    lines
}

/// A veth pair from the decode's namespace to one prefill's namespace.
struct Link {
    /// The prefill's namespace.
    p_ns: String,
    d_if: String,
    p_if: String,
    d_ip: String,
    p_ip: String,
}

/// The decode's namespace and one link per prefill, all removed on drop
/// (also when the test fails). Nothing is created in the namespace the
/// test runs in.
struct Netns {
    d_ns: String,
    links: Vec<Link>,
    /// Every name and address this test uses, to look for on the host.
    ours: Vec<String>,
}

impl Netns {
    /// Names and /30s in 10.201.0.0/16 from the pid, so runs side by side
    /// (other checkouts on the same machine) do not collide.
    fn create(prefills: usize) -> Result<Netns, String> {
        let pid = std::process::id();
        let d_ns = format!("nk-d-{pid}");
        let mut links = Vec::new();
        for k in 0..prefills {
            let idx = (pid % 8192) * 2 + k as u32;
            let (c, d) = (idx / 64, (idx % 64) * 4);
            links.push(Link {
                p_ns: format!("nk-p{k}-{pid}"),
                d_if: format!("nkd{k}-{pid}"),
                p_if: format!("nkp{k}-{pid}"),
                d_ip: format!("10.201.{c}.{}", d + 1),
                p_ip: format!("10.201.{c}.{}", d + 2),
            });
        }
        let mut ours = vec![d_ns.clone()];
        for l in &links {
            ours.extend([
                l.p_ns.clone(),
                l.d_if.clone(),
                l.p_if.clone(),
                format!("{}/", l.d_ip),
                format!("{}/", l.p_ip),
            ]);
        }
        let ns = Netns { d_ns, links, ours };
        // Leftovers of an earlier run that was killed with this pid.
        ns.remove();
        ip(&["netns", "add", &ns.d_ns])?;
        ns.inside(&ns.d_ns, &["link", "set", "lo", "up"])?;
        for l in &ns.links {
            ip(&["netns", "add", &l.p_ns])?;
            // Both ends made inside the namespaces: the host never has them.
            ns.inside(
                &ns.d_ns,
                &[
                    "link", "add", &l.d_if, "type", "veth", "peer", "name", &l.p_if, "netns",
                    &l.p_ns,
                ],
            )?;
            ns.inside(
                &ns.d_ns,
                &["addr", "add", &format!("{}/30", l.d_ip), "dev", &l.d_if],
            )?;
            ns.inside(&ns.d_ns, &["link", "set", &l.d_if, "up"])?;
            ns.inside(
                &l.p_ns,
                &["addr", "add", &format!("{}/30", l.p_ip), "dev", &l.p_if],
            )?;
            ns.inside(&l.p_ns, &["link", "set", &l.p_if, "up"])?;
            ns.inside(&l.p_ns, &["link", "set", "lo", "up"])?;
        }
        // UCX only takes a device that is running (carrier on both ends);
        // a veth gets there shortly after both ends are up.
        for l in &ns.links {
            ns.wait_running(&ns.d_ns, &l.d_if)?;
            ns.wait_running(&l.p_ns, &l.p_if)?;
        }
        Ok(ns)
    }

    /// Waits (at most 10 s) until `dev` in `ns` has its carrier.
    fn wait_running(&self, ns: &str, dev: &str) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let state = self.inside(ns, &["-br", "link", "show", "dev", dev])?;
            if state.contains("LOWER_UP") && !state.contains("NO-CARRIER") {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("{dev} in {ns} never got its carrier: {state}"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn inside(&self, ns: &str, args: &[&str]) -> Result<String, String> {
        let mut a = vec!["-n", ns];
        a.extend_from_slice(args);
        ip(&a)
    }

    fn cut(&self, k: usize) {
        let l = &self.links[k];
        self.inside(&self.d_ns, &["link", "set", &l.d_if, "down"])
            .expect("cut the link");
    }

    fn heal(&self, k: usize) {
        let l = &self.links[k];
        self.inside(&self.d_ns, &["link", "set", &l.d_if, "up"])
            .expect("heal the link");
    }

    /// Removes the decode's address on link `k`.
    fn remove_decode_address(&self, k: usize) {
        let l = &self.links[k];
        self.inside(
            &self.d_ns,
            &["addr", "del", &format!("{}/30", l.d_ip), "dev", &l.d_if],
        )
        .expect("remove the decode's address");
    }

    /// Asserts that none of this test's links or addresses is in the
    /// host's network (`host`: from [`host_network`]).
    fn assert_not_on_host(&self, host: &BTreeSet<String>, when: &str) {
        let leaked: Vec<&String> = host
            .iter()
            .filter(|line| self.ours.iter().any(|o| line.contains(o.as_str())))
            .collect();
        assert!(
            leaked.is_empty(),
            "{when}: the host namespace has this test's links or addresses: {leaked:#?}"
        );
    }

    fn remove(&self) {
        for l in &self.links {
            let _ = ip(&["netns", "del", &l.p_ns]);
        }
        // Deleting a namespace deletes the veth ends in it (and so their
        // peers).
        let _ = ip(&["netns", "del", &self.d_ns]);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        self.remove();
    }
}

/// The namespaces, or `None` after printing why not (a failure in CI).
fn netns_or_skip(prefills: usize) -> Option<Netns> {
    match Netns::create(prefills) {
        Ok(ns) => Some(ns),
        Err(reason) => {
            let reason = format!("cannot create network namespaces: {reason} (needs root and iproute2: scripts/install-netns-tools.sh)");
            if matches!(std::env::var("CI").as_deref(), Ok("true" | "1")) {
                panic!("CI=true: the partition test must run, but {reason}");
            }
            eprintln!("\n*** SKIPPED: {reason} ***\n");
            None
        }
    }
}

/// Runs `f` on a thread that has entered network namespace `ns` (only that
/// thread's namespace changes).
fn in_netns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    use std::os::fd::AsRawFd;
    extern "C" {
        fn setns(fd: std::ffi::c_int, nstype: std::ffi::c_int) -> std::ffi::c_int;
    }
    const CLONE_NEWNET: std::ffi::c_int = 0x4000_0000;
    let path = format!("/var/run/netns/{ns}");
    std::thread::spawn(move || {
        let handle = std::fs::File::open(&path).expect("the namespace's handle");
        // Safety: a valid descriptor of a network namespace; setns changes
        // the network namespace of this thread only, which exits after `f`.
        let rc = unsafe { setns(handle.as_raw_fd(), CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns({path}): {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .expect("the namespace thread")
}

/// UCX over TCP only, on `devices`, with the timers tuned to seconds.
fn ucx_env(devices: &str, user_timeout: Option<&str>) -> Vec<(String, String)> {
    let mut env = vec![
        ("UCX_TLS", "tcp"),
        ("UCX_NET_DEVICES", devices),
        ("UCX_KEEPALIVE_INTERVAL", "1s"),
        ("UCX_TCP_KEEPIDLE", "1s"),
        ("UCX_TCP_KEEPINTVL", "1s"),
        ("UCX_TCP_KEEPCNT", "3"),
    ];
    if let Some(t) = user_timeout {
        env.push(("UCX_TCP_USER_TIMEOUT", t));
    }
    env.into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A `nixl-keepalive decode` child in the decode's namespace: its stdout
/// lines with when they came, and its metrics endpoint there.
struct DecodeProc {
    child: Child,
    ns: String,
    /// Its stderr (its log, and UCX's).
    log: std::path::PathBuf,
    lines: Receiver<(String, Instant)>,
    seen: Vec<(String, Instant)>,
}

impl DecodeProc {
    fn start(
        ns: &Netns,
        prefills: &[&PeerAddr],
        env: &[(String, String)],
        args: &[&str],
    ) -> DecodeProc {
        let mut cmd = Command::new("ip");
        // `ip netns exec` execs the decode: the pid is the decode's own.
        cmd.args([
            "netns",
            "exec",
            &ns.d_ns,
            env!("CARGO_BIN_EXE_nixl-keepalive"),
        ])
        .arg("decode")
        .args(["--metrics-addr", METRICS_ADDR]);
        for p in prefills {
            cmd.args(["--prefill", p.as_str()]);
        }
        let log = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("{}.log", common::unique("partition-decode")));
        cmd.args(args)
            .env("NIXL_KEEPALIVE_INTERVAL", INTERVAL)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("decode log"));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn nixl-keepalive decode");
        let out = child.stdout.take().unwrap();
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send((line, Instant::now()));
            }
        });
        DecodeProc {
            child,
            ns: ns.d_ns.clone(),
            log,
            lines,
            seen: Vec::new(),
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The last lines of its log, for failure messages.
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// The first line containing `what` that arrives within `within`.
    fn wait_line(&mut self, what: &str, within: Duration) -> Option<(String, Instant)> {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok((l, at)) => {
                    self.seen.push((l.clone(), at));
                    if l.contains(what) {
                        return Some((l, at));
                    }
                }
                Err(_) => return None,
            }
        }
    }

    /// Every line that arrived since the last call (and reads them all).
    fn take_lines(&mut self) -> Vec<(String, Instant)> {
        while let Ok(l) = self.lines.try_recv() {
            self.seen.push(l);
        }
        std::mem::take(&mut self.seen)
    }

    /// The metrics page; empty while the endpoint does not answer yet.
    fn scrape(&self) -> String {
        in_netns(&self.ns, || {
            let Ok(mut s) = std::net::TcpStream::connect(METRICS_ADDR) else {
                return String::new();
            };
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
            let mut body = String::new();
            let _ = s.read_to_string(&mut body);
            body
        })
    }

    /// A metric's value (the first sample whose line starts with `name`).
    fn metric(&self, name: &str) -> Option<f64> {
        self.scrape()
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    fn verified_reads(&self) -> f64 {
        self.metric("nixl_keepalive_pd_reads_total{outcome=\"verified\"}")
            .unwrap_or(0.0)
    }

    fn timed_out_reads(&self) -> f64 {
        self.metric("nixl_keepalive_pd_reads_total{outcome=\"timed_out\"}")
            .unwrap_or(0.0)
    }

    /// Waits (bounded) until the metrics endpoint answers with the bound.
    fn silent_bound(&self) -> Duration {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(b) = self.metric("nixl_keepalive_detection_bound_silent_seconds") {
                return Duration::from_secs_f64(b);
            }
            assert!(Instant::now() < deadline, "decode never reported its bound");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Its TCP sockets from `local_ip` to `remote_ip`, other than
    /// listening ones.
    fn sockets_between(&self, local_ip: &str, remote_ip: &str) -> Vec<common::procfs::TcpSocket> {
        tcp_sockets(self.pid())
            .into_iter()
            .filter(|s| {
                !s.is_listening()
                    && s.local_ipv4().as_deref() == Some(local_ip)
                    && s.remote_ipv4().as_deref() == Some(remote_ip)
            })
            .collect()
    }
}

impl Drop for DecodeProc {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A prefill on link `k`, in its namespace.
fn prefill_on(ns: &Netns, k: usize, user_timeout: Option<&str>) -> PrefillProc {
    let l = &ns.links[k];
    PrefillProc::start(&PrefillSpec {
        listen: Some(format!("{}:0", l.p_ip)),
        netns: Some(l.p_ns.clone()),
        env: ucx_env(&l.p_if, user_timeout),
        ..Default::default()
    })
}

/// Waits (bounded) until `min_reads` reads are verified.
fn wait_reads(d: &DecodeProc, min_reads: f64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while d.verified_reads() < min_reads {
        assert!(
            Instant::now() < deadline,
            "no verified reads across the veth"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A prefill on link 0 and a decode (with `args`) reading from it, both
/// with `user_timeout` (None: UCX's `auto`); returns once the engine is
/// registered and `min_reads` reads are verified.
fn pair(
    ns: &Netns,
    user_timeout: Option<&str>,
    args: &[&str],
    min_reads: f64,
) -> (PrefillProc, DecodeProc) {
    let p = prefill_on(ns, 0, user_timeout);
    let mut d = DecodeProc::start(
        ns,
        &[&p.addr],
        &ucx_env(&ns.links[0].d_if, user_timeout),
        args,
    );
    d.wait_line(
        &format!("event: registered engine={}", p.engine),
        Duration::from_secs(30),
    )
    .unwrap_or_else(|| {
        panic!(
            "the decode did not register the prefill across the veth; stdout: {:?}; log:\n{}",
            d.take_lines(),
            d.log_tail()
        )
    });
    wait_reads(&d, min_reads);
    (p, d)
}

/// Events (not read summaries) among `lines`.
fn events(lines: &[(String, Instant)]) -> Vec<&str> {
    lines
        .iter()
        .map(|(l, _)| l.as_str())
        .filter(|l| l.starts_with("event: "))
        .collect()
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn a_partitioned_prefill_is_released_within_the_reported_bound_and_a_short_one_is_kept() {
    let _rt = real_runtime();
    let _serial = serial();
    let host_before = host_network();
    let Some(ns) = netns_or_skip(1) else { return };
    ns.assert_not_on_host(&host_network(), "after setup");

    // --- UCX_TCP_USER_TIMEOUT=3s: a short partition, then a long one.
    let (p, mut d) = pair(&ns, Some("3s"), &[], 10.0);
    let bound = d.silent_bound();
    assert!(
        bound < Duration::from_secs(30),
        "the bound for these settings should be seconds: {bound:?}"
    );
    d.take_lines();

    let before = d.verified_reads();
    ns.cut(0);
    std::thread::sleep(SHORT_CUT);
    ns.heal(0);
    // Watch past the bound: nothing may be reported or released.
    let watch = bound + Duration::from_secs(3);
    let released = d.wait_line("event: released", watch);
    let after = d.verified_reads();
    let seen = d.take_lines();
    report(&format!(
        "partition {} healed, UCX_TCP_USER_TIMEOUT=3s, reported silent bound {}: \
         events in the {} after: {:?}; verified reads {before} -> {after}",
        ms(SHORT_CUT),
        ms(bound),
        ms(watch),
        events(&seen)
    ));
    assert!(
        released.is_none(),
        "a short partition released the engine: {seen:?}"
    );
    assert!(
        !events(&seen).iter().any(|e| e.contains("unreachable")),
        "a short partition was reported: {seen:?}"
    );
    assert!(
        after > before,
        "reads did not resume after the heal: {before} -> {after}"
    );

    // The long partition: cut and keep it cut.
    let cut = Instant::now();
    ns.cut(0);
    ns.assert_not_on_host(&host_network(), "during a partition");
    let unreachable = d.wait_line(
        &format!("event: unreachable engine={}", p.engine),
        bound * 2 + Duration::from_secs(5),
    );
    let released = unreachable.as_ref().and_then(|_| {
        d.wait_line(
            &format!("event: released engine={}", p.engine),
            Duration::from_secs(10),
        )
    });
    ns.heal(0);
    let (Some((u_line, u_at)), Some((r_line, r_at))) = (unreachable, released) else {
        panic!(
            "a partition was not released within twice the reported bound {bound:?}: {:?}",
            d.take_lines()
        );
    };
    report(&format!(
        "partition, UCX_TCP_USER_TIMEOUT=3s: cut -> unreachable {}, -> released {} \
         (reported silent bound {}, {:.0}% of it); {u_line}",
        ms(u_at - cut),
        ms(r_at - cut),
        ms(bound),
        (r_at - cut).as_secs_f64() / bound.as_secs_f64() * 100.0
    ));
    assert!(u_line.contains("REMOTE_DISCONNECT"), "{u_line}");
    assert!(r_line.contains("reason=unreachable"), "{r_line}");
    drop(d);
    drop(p);

    // --- The same, with no read in flight when the link goes: one round of
    // reads, then an hour's pause. Only the heartbeats can notice.
    let (p, mut d) = pair(&ns, Some("3s"), &["--read-pause-ms", "3600000"], 1.0);
    let bound = d.silent_bound();
    std::thread::sleep(Duration::from_secs(1));
    d.take_lines();
    let cut = Instant::now();
    ns.cut(0);
    let unreachable = d.wait_line(
        &format!("event: unreachable engine={}", p.engine),
        bound * 2 + Duration::from_secs(5),
    );
    let released = unreachable.as_ref().and_then(|_| {
        d.wait_line(
            &format!("event: released engine={}", p.engine),
            Duration::from_secs(10),
        )
    });
    ns.heal(0);
    let (Some((u_line, u_at)), Some((_, r_at))) = (unreachable, released) else {
        panic!(
            "an idle partitioned engine was not released within twice the bound {bound:?}: {:?}",
            d.take_lines()
        );
    };
    report(&format!(
        "partition with no read in flight, UCX_TCP_USER_TIMEOUT=3s: cut -> unreachable {}, \
         -> released {} (reported silent bound {}, {:.0}% of it); {u_line}",
        ms(u_at - cut),
        ms(r_at - cut),
        ms(bound),
        (r_at - cut).as_secs_f64() / bound.as_secs_f64() * 100.0
    ));
    assert!(u_line.contains("REMOTE_DISCONNECT"), "{u_line}");
    assert!(u_line.contains("source=heartbeat"), "{u_line}");
    drop(d);
    drop(p);

    // --- UCX's default user timeout: the kernel's retransmission limit.
    let (p, mut d) = pair(&ns, None, &[], 10.0);
    let bound = d.silent_bound();
    assert!(
        bound > Duration::from_secs(900),
        "with UCX_TCP_USER_TIMEOUT=auto the bound is the kernel's ~15 min: {bound:?}"
    );
    d.take_lines();
    let before = d.verified_reads();
    ns.cut(0);
    // Stops early only if a release shows up (then asserted against).
    let _ = d.wait_line("event: released", DEFAULT_CUT);
    ns.heal(0);
    let seen = d.take_lines();
    // Reads resume once TCP's next retransmission gets through (bounded
    // wait: its backoff is a few seconds at this point).
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut after = d.verified_reads();
    while after <= before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        after = d.verified_reads();
    }
    let resumed = after > before;
    let seen_after = d.take_lines();
    report(&format!(
        "partition {} with UCX_TCP_USER_TIMEOUT=auto (TCP keepalive 1s/1s/3), reported \
         silent bound {}: events during it: {:?}; after the heal: {:?}; verified reads \
         {before} -> {after}",
        ms(DEFAULT_CUT),
        ms(bound),
        events(&seen),
        events(&seen_after)
    ));
    // UCX's verdict: none, TCP is still retransmitting. The decode's own
    // read timeout (5 s) may pass meanwhile: a read given up unanswered is
    // the runtime's verdict that the engine is hung, and the service marks
    // it stalled by design (docs/design/hung-peers.md): its requests fail
    // then, but its given-up READs may still run, so it is released only
    // once they end: after the heal (docs/design/given-up-transfers.md),
    // and registered again. Nothing else may happen to it.
    let during = events(&seen);
    assert!(
        during
            .iter()
            .all(|e| !e.starts_with("event: unreachable")
                && !e.starts_with("event: transient_error")),
        "UCX reported a partition that TCP should still be retransmitting over: {seen:?}"
    );
    assert!(
        during
            .iter()
            .all(|e| !e.starts_with("event: released") || e.contains("reason=stalled")),
        "released during the partition for another reason than the read timeout's stall: {seen:?}"
    );
    assert!(
        resumed,
        "reads did not resume after a {DEFAULT_CUT:?} partition healed"
    );
    let stalled_during = during.iter().any(|e| e.starts_with("event: stalled"));
    assert!(
        events(&seen_after)
            .iter()
            .all(|e| !e.contains("released") || (stalled_during && e.contains("reason=stalled"))),
        "released after the heal for another reason than a stall during it: {seen:?} {seen_after:?}"
    );
    assert!(
        during.iter().all(|e| !e.starts_with("event: released")),
        "released during the partition, under its given-up READs: {seen:?}"
    );
    drop(d);
    drop(p);
    let ours = ns.ours.clone();
    drop(ns);
    assert_host_untouched(&host_before, &ours);
}

/// Compares the host's links and addresses with `before`: none of this
/// test's (`ours`: its names and addresses) may be there, and whatever
/// else changed (another process on the machine) is reported.
fn assert_host_untouched(before: &BTreeSet<String>, ours: &[String]) {
    let after = host_network();
    let changed: Vec<&String> = before.symmetric_difference(&after).collect();
    let mine: Vec<&&String> = changed
        .iter()
        .filter(|l| ours.iter().any(|o| l.contains(o.as_str())))
        .collect();
    report(&format!(
        "host namespace: {} links and addresses before, {} after; changed meanwhile by others \
         on the machine: {}",
        before.len(),
        after.len(),
        changed.len() - mine.len()
    ));
    assert!(
        mine.is_empty(),
        "the host namespace was changed by this test: {mine:#?}"
    );
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn a_prefill_behind_a_removed_address_is_released_with_its_sockets_and_reads_to_another_go_on() {
    let _rt = real_runtime();
    let _serial = serial();
    let host_before = host_network();
    let Some(ns) = netns_or_skip(2) else { return };
    ns.assert_not_on_host(&host_network(), "after setup");
    let t = Some("3s");
    let gone = prefill_on(&ns, 0, t);
    let other = prefill_on(&ns, 1, t);
    let devices = format!("{},{}", ns.links[0].d_if, ns.links[1].d_if);
    let mut d = DecodeProc::start(&ns, &[&gone.addr, &other.addr], &ucx_env(&devices, t), &[]);
    // Both registrations, in whatever order they come.
    let mut waiting = vec![gone.engine.clone(), other.engine.clone()];
    let deadline = Instant::now() + Duration::from_secs(30);
    while !waiting.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        let Some((line, _)) = d.wait_line("event: registered", left) else {
            panic!(
                "the decode did not register {waiting:?}; stdout: {:?}; log:\n{}",
                d.take_lines(),
                d.log_tail()
            );
        };
        waiting.retain(|e| !line.contains(&format!("engine={e} ")));
    }
    wait_reads(&d, 20.0);
    let bound = d.silent_bound();
    // The released peer's sockets: from the removed address to the
    // prefill's (UCX's own connection from the decode to itself over that
    // address is the decode's, not the peer's, and is not counted).
    let (over, peer_ip) = (ns.links[0].d_ip.clone(), ns.links[0].p_ip.clone());
    let before_removal = d.sockets_between(&over, &peer_ip);
    assert!(
        !before_removal.is_empty(),
        "the decode has no connection from {over} to {peer_ip} to count"
    );
    d.take_lines();
    let timed_out_before = d.timed_out_reads();

    // The decode's address on the first link vanishes.
    let removed = Instant::now();
    ns.remove_decode_address(0);
    ns.assert_not_on_host(&host_network(), "after the address removal");
    // Meanwhile, reads go on: the longest time without a verified read,
    // sampled until the release (bounded by twice the reported bound).
    let mut last_count = d.verified_reads();
    let mut last_progress = Instant::now();
    let mut longest_gap = Duration::ZERO;
    let deadline = removed + bound * 2 + Duration::from_secs(5);
    let mut released = None;
    while released.is_none() && Instant::now() < deadline {
        released = d.wait_line(
            &format!("event: released engine={}", gone.engine),
            Duration::from_millis(250),
        );
        let n = d.verified_reads();
        if n > last_count {
            last_count = n;
            last_progress = Instant::now();
        }
        longest_gap = longest_gap.max(last_progress.elapsed());
    }
    let Some((r_line, r_at)) = released else {
        panic!(
            "the prefill behind the removed address was not released within twice the bound \
             {bound:?}: {:?}",
            d.take_lines()
        );
    };
    // Its sockets went with its release: poll briefly for the kernel's
    // table to show the close (the release closed them).
    let grace = Duration::from_millis(500);
    let mut left = d.sockets_between(&over, &peer_ip);
    while !left.is_empty() && r_at.elapsed() < grace {
        std::thread::sleep(Duration::from_millis(20));
        left = d.sockets_between(&over, &peer_ip);
    }
    // Reads from the other prefill carried on after it.
    let after_release = d.verified_reads();
    std::thread::sleep(Duration::from_secs(1));
    let later = d.verified_reads();
    let timed_out = d.timed_out_reads() - timed_out_before;
    let seen = d.take_lines();
    report(&format!(
        "decode address removed under a prefill (UCX_TCP_USER_TIMEOUT=3s): -> released {} \
         (reported silent bound {}); sockets from the removed address to that prefill: {} \
         before, {} once released; the other prefill's reads: longest gap without a verified read {}, \
         {timed_out} timed out, verified {after_release} -> {later} in the second after; \
         events: {:?}",
        ms(r_at - removed),
        ms(bound),
        before_removal.len(),
        left.len(),
        ms(longest_gap),
        events(&seen)
    ));
    assert!(r_line.contains("reason=unreachable"), "{r_line}");
    assert!(
        left.is_empty(),
        "sockets over the removed address outlived the release: {left:?}"
    );
    assert_eq!(
        timed_out, 0.0,
        "reads hung until their {READ_TIMEOUT:?} timeout while an address vanished"
    );
    assert!(
        longest_gap < READ_TIMEOUT,
        "no read verified for {longest_gap:?} while an address vanished"
    );
    assert!(
        later > after_release,
        "reads from the other prefill stopped"
    );
    assert!(
        !events(&seen)
            .iter()
            .any(|e| e.contains(&other.engine) && !e.contains("registered")),
        "the other prefill was touched: {seen:?}"
    );
    drop(d);
    drop(gone);
    drop(other);
    let ours = ns.ours.clone();
    drop(ns);
    assert_host_untouched(&host_before, &ours);
}

//! A real network partition: a `nixl-keepalive prefill` in its own network
//! namespace, joined to the host by a veth pair on a private /30 that this
//! test creates and removes, and a `nixl-keepalive decode` on the host
//! reading from it with UCX over TCP (`UCX_TLS=tcp`, each side bound to its
//! end of the veth with `UCX_NET_DEVICES`). The link is cut with
//! `ip link set down` (sch_netem is not available everywhere; a downed link
//! drops every packet just the same) and the decode's stdout events are
//! timed against the cut.
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
//!   it heals.
//!
//! Needs root and `ip` (iproute2; `scripts/install-netns-tools.sh`). Where
//! namespaces cannot be made it prints SKIPPED with the reason; in CI
//! (`CI=true`) that is a failure.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use common::{ms, report, serial, PrefillProc, PrefillSpec};
use nixl_keepalive::PeerAddr;
use nixl_sys::testing::runtime_or_skip;

/// The decode's heartbeat interval (its jitter derives: 50 ms).
const INTERVAL: &str = "500ms";
/// The short partition, healed well before the bound.
const SHORT_CUT: Duration = Duration::from_secs(1);
/// The partition under UCX's default user timeout: longer than what TCP
/// keepalive (1s idle + 3 x 1s) would take, far below the kernel's limit.
const DEFAULT_CUT: Duration = Duration::from_secs(15);

/// `ip ARGS`, its stderr on failure.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip` (iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A network namespace with one veth pair to the host, removed on drop
/// (also when the test fails).
struct Netns {
    name: String,
    host_if: String,
    ns_if: String,
    host_ip: String,
    ns_ip: String,
}

impl Netns {
    /// Names and a /30 in 10.201.0.0/16 from the pid, so runs side by side
    /// (other checkouts on the same machine) do not collide.
    fn create() -> Result<Netns, String> {
        let pid = std::process::id();
        let n = pid % 16384;
        let (c, d) = (n / 64, (n % 64) * 4);
        let ns = Netns {
            name: format!("nk-part-{pid}"),
            host_if: format!("nkh{pid}"),
            ns_if: format!("nkp{pid}"),
            host_ip: format!("10.201.{c}.{}", d + 1),
            ns_ip: format!("10.201.{c}.{}", d + 2),
        };
        // Leftovers of an earlier run that was killed with this pid.
        ns.remove();
        ip(&["netns", "add", &ns.name])?;
        let setup = || -> Result<(), String> {
            ip(&[
                "link",
                "add",
                &ns.host_if,
                "type",
                "veth",
                "peer",
                "name",
                &ns.ns_if,
            ])?;
            ip(&["link", "set", &ns.ns_if, "netns", &ns.name])?;
            ip(&[
                "addr",
                "add",
                &format!("{}/30", ns.host_ip),
                "dev",
                &ns.host_if,
            ])?;
            ip(&["link", "set", &ns.host_if, "up"])?;
            let inside = |args: &[&str]| {
                let mut a = vec!["-n", ns.name.as_str()];
                a.extend_from_slice(args);
                ip(&a)
            };
            inside(&["addr", "add", &format!("{}/30", ns.ns_ip), "dev", &ns.ns_if])?;
            inside(&["link", "set", &ns.ns_if, "up"])?;
            inside(&["link", "set", "lo", "up"])
        };
        setup().map(|()| ns)
    }

    fn cut(&self) {
        ip(&["link", "set", &self.host_if, "down"]).expect("cut the link");
    }

    fn heal(&self) {
        ip(&["link", "set", &self.host_if, "up"]).expect("heal the link");
    }

    fn remove(&self) {
        let _ = ip(&["link", "del", &self.host_if]);
        let _ = ip(&["netns", "del", &self.name]);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        self.remove();
    }
}

/// The namespace, or `None` after printing why not (a failure in CI).
fn netns_or_skip() -> Option<Netns> {
    match Netns::create() {
        Ok(ns) => Some(ns),
        Err(reason) => {
            let reason = format!("cannot create a network namespace: {reason} (needs root and iproute2: scripts/install-netns-tools.sh)");
            if matches!(std::env::var("CI").as_deref(), Ok("true" | "1")) {
                panic!("CI=true: the partition test must run, but {reason}");
            }
            eprintln!("\n*** SKIPPED: {reason} ***\n");
            None
        }
    }
}

/// UCX over TCP only, on one interface, with the timers tuned to seconds.
fn ucx_env(device: &str, user_timeout: Option<&str>) -> Vec<(String, String)> {
    let mut env = vec![
        ("UCX_TLS", "tcp"),
        ("UCX_NET_DEVICES", device),
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

/// A `nixl-keepalive decode` child: its stdout lines with when they came,
/// and its metrics endpoint.
struct DecodeProc {
    child: Child,
    lines: Receiver<(String, Instant)>,
    seen: Vec<(String, Instant)>,
    metrics: String,
}

impl DecodeProc {
    fn start(prefill: &PeerAddr, env: &[(String, String)], args: &[&str]) -> DecodeProc {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let metrics = format!("127.0.0.1:{port}");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_nixl-keepalive"));
        cmd.args([
            "decode",
            "--prefill",
            &prefill.to_string(),
            "--metrics-addr",
            &metrics,
        ])
        .args(args)
        .env("NIXL_KEEPALIVE_INTERVAL", INTERVAL)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
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
            lines,
            seen: Vec::new(),
            metrics,
        }
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
        let Ok(mut s) = std::net::TcpStream::connect(&self.metrics) else {
            return String::new();
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        let mut body = String::new();
        let _ = s.read_to_string(&mut body);
        body
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

/// A prefill in `ns` and a decode (with `args`) reading from it, both with
/// `user_timeout` (None: UCX's `auto`); returns once the engine is
/// registered and `min_reads` reads are verified.
fn pair(
    ns: &Netns,
    user_timeout: Option<&str>,
    args: &[&str],
    min_reads: f64,
) -> (PrefillProc, DecodeProc) {
    let p = PrefillProc::start(&PrefillSpec {
        listen: Some(format!("{}:0", ns.ns_ip)),
        netns: Some(ns.name.clone()),
        env: ucx_env(&ns.ns_if, user_timeout),
        ..Default::default()
    });
    let mut d = DecodeProc::start(&p.addr, &ucx_env(&ns.host_if, user_timeout), args);
    d.wait_line(
        &format!("event: registered engine={}", p.engine),
        Duration::from_secs(30),
    )
    .expect("the decode registers the prefill across the veth");
    let deadline = Instant::now() + Duration::from_secs(20);
    while d.verified_reads() < min_reads {
        assert!(
            Instant::now() < deadline,
            "no verified reads across the veth"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
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
fn a_partitioned_prefill_is_released_within_the_reported_bound_and_a_short_one_is_kept() {
    let Some(_rt) = runtime_or_skip() else { return };
    let _serial = serial();
    let Some(ns) = netns_or_skip() else { return };

    // --- UCX_TCP_USER_TIMEOUT=3s: a short partition, then a long one.
    let (p, mut d) = pair(&ns, Some("3s"), &[], 10.0);
    let bound = d.silent_bound();
    assert!(
        bound < Duration::from_secs(30),
        "the bound for these settings should be seconds: {bound:?}"
    );
    d.take_lines();

    let before = d.verified_reads();
    ns.cut();
    std::thread::sleep(SHORT_CUT);
    ns.heal();
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
    ns.cut();
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
    ns.heal();
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
    ns.cut();
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
    ns.heal();
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
    ns.cut();
    // Stops early only if a release shows up (then asserted against).
    let _ = d.wait_line("event: released", DEFAULT_CUT);
    ns.heal();
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
    assert!(
        events(&seen).is_empty(),
        "UCX reported a partition that TCP should still be retransmitting over: {seen:?}"
    );
    assert!(
        resumed,
        "reads did not resume after a {DEFAULT_CUT:?} partition healed"
    );
    assert!(
        !events(&seen_after).iter().any(|e| e.contains("released")),
        "{seen_after:?}"
    );
    drop(d);
    drop(p);
}

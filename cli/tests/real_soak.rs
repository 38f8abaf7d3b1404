//! The soak: a real `decode` process over thousands of real cycles, each a
//! prefill SIGKILLed and restarted at its port (a new id, or its pinned id
//! in turn) plus a router release of a second, live prefill that is then
//! loaded again. Every `SOAK_SAMPLE` cycles it prints one `MEASURED` line
//! with the decode's resident memory (and its anonymous part), descriptors,
//! sockets, ESTABLISHED connections, threads, memory mappings and UCX's own
//! count of its endpoints, and writes them to
//! `<target tmp>/soak-<pid>.csv`. At the end it asserts that descriptors,
//! sockets, connections and threads did not grow, and prints how resident
//! memory moved (KiB per cycle over each half).
//!
//! Ignored by default (about an hour for 3,000 cycles on 2 cores):
//!
//! ```sh
//! cargo test -p nixl-keepalive-cli --test real_soak -- --ignored --nocapture
//! SOAK_CYCLES=3000 SOAK_SAMPLE=100 MALLOC_ARENA_MAX=1 cargo test ... # the decode inherits it
//! ```
//!
//! `SOAK_DECODE_ENV="K=V;K=V"` adds environment to the decode only, e.g. a
//! heap profiler's preload (heaptrack: `LD_PRELOAD=<libheaptrack_preload.so>;
//! DUMP_HEAPTRACK_OUTPUT=<fifo read by heaptrack_interpret>`), so that the
//! decode's own pid is still the one measured.

mod common;

use std::io::Write;
use std::time::{Duration, Instant};

use common::decode::DecodeProc;
use common::procfs::{held, Held, Resident};
use common::{report, serial, PrefillProc, PrefillSpec};
use nixl_agent::testing::real_runtime;

const PATIENCE: Duration = Duration::from_secs(60);

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// `/proc/<pid>/smaps_rollup`'s anonymous memory and the number of
/// mappings in `/proc/<pid>/maps`.
fn memory_detail(pid: u32) -> (u64, usize) {
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    let anon = rollup
        .lines()
        .find_map(|l| l.strip_prefix("Anonymous:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map(|m| m.lines().count())
        .unwrap_or(0);
    (anon, maps)
}

struct Sample {
    cycle: usize,
    at: Duration,
    held: Held,
    anon_kib: u64,
    maps: usize,
    ucx_endpoints: f64,
}

/// Least-squares slope of RSS (KiB) per cycle over `samples`.
fn slope(samples: &[Sample]) -> f64 {
    let n = samples.len() as f64;
    if n < 2.0 {
        return 0.0;
    }
    let mx = samples.iter().map(|s| s.cycle as f64).sum::<f64>() / n;
    let my = samples.iter().map(|s| s.held.rss_kib as f64).sum::<f64>() / n;
    let sxy: f64 = samples
        .iter()
        .map(|s| (s.cycle as f64 - mx) * (s.held.rss_kib as f64 - my))
        .sum();
    let sxx: f64 = samples.iter().map(|s| (s.cycle as f64 - mx).powi(2)).sum();
    if sxx == 0.0 {
        0.0
    } else {
        sxy / sxx
    }
}

#[test]
#[ignore = "an hour-long soak: run with --ignored"]
fn soak_kills_restarts_and_live_releases() {
    let _rt = real_runtime();
    let _serial = serial();
    let cycles = env_or("SOAK_CYCLES", 3000);
    let every = env_or("SOAK_SAMPLE", 100).max(1);
    let spec = |listen: Option<String>, id: Option<String>| PrefillSpec {
        listen,
        engine_id: id,
        ranks: Some(2),
        env: vec![("UCX_KEEPALIVE_INTERVAL".into(), "500ms".into())],
        ..Default::default()
    };
    let live = PrefillProc::start(&spec(None, None));
    let mut victim = PrefillProc::start(&spec(None, None));
    let listen = victim.listen();
    let pinned = common::unique("soak-pinned");
    let decode_env: Vec<(String, String)> = std::env::var("SOAK_DECODE_ENV")
        .unwrap_or_default()
        .split(';')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let decode_env: Vec<(&str, &str)> = decode_env
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let mut d = DecodeProc::start(
        &["--prefill", live.addr.as_str(), victim.addr.as_str()],
        &decode_env,
        PATIENCE,
    );
    d.wait_nth(1, &["event: registered", &live.engine], PATIENCE);
    d.wait_nth(1, &["event: registered", &victim.engine], PATIENCE);
    let csv_path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("soak-{}.csv", std::process::id()));
    let mut csv = std::fs::File::create(&csv_path).expect("csv");
    writeln!(
        csv,
        "cycle,seconds,rss_kib,anon_kib,fds,sockets,established,established_out,threads,maps,ucx_endpoints"
    )
    .unwrap();
    report(&format!(
        "soak: {cycles} cycles, a sample every {every}, decode pid {}, MALLOC_ARENA_MAX={}, csv {}",
        d.pid(),
        std::env::var("MALLOC_ARENA_MAX").unwrap_or_else(|_| "unset".into()),
        csv_path.display()
    ));

    let started = Instant::now();
    let mut samples: Vec<Sample> = Vec::new();
    let mut live_releases = 0usize;
    let mut kills = 0usize;
    let bodies = [
        format!(r#"{{"engine": "{}", "mode": "drain"}}"#, live.engine),
        format!(r#"{{"address": "{}", "mode": "fail"}}"#, live.addr),
    ];
    for cycle in 0..=cycles {
        if cycle % every == 0 {
            // A quiet moment: both prefills registered.
            std::thread::sleep(Duration::from_millis(300));
            let h = held(d.pid());
            let (anon_kib, maps) = memory_detail(d.pid());
            let ucx_endpoints = d.metric("nixl_keepalive_ucx_endpoints").unwrap_or(-1.0);
            let s = Sample {
                cycle,
                at: started.elapsed(),
                held: h,
                anon_kib,
                maps,
                ucx_endpoints,
            };
            writeln!(
                csv,
                "{},{:.1},{},{},{},{},{},{},{},{},{}",
                s.cycle,
                s.at.as_secs_f64(),
                h.rss_kib,
                anon_kib,
                h.fds,
                h.sockets,
                h.established,
                h.established_out,
                h.threads,
                maps,
                ucx_endpoints
            )
            .unwrap();
            report(&format!(
                "soak cycle {cycle} ({:.0} s): rss {} KiB (anon {anon_kib}), fds {}, sockets {}, \
                 established {}, threads {}, maps {maps}, ucx endpoints {ucx_endpoints}; {}",
                s.at.as_secs_f64(),
                h.rss_kib,
                h.fds,
                h.sockets,
                h.established,
                h.threads,
                Resident::of(d.pid()),
            ));
            samples.push(s);
        }
        if cycle == cycles {
            break;
        }
        // The victim: SIGKILL, released, restarted at its port.
        victim.kill();
        kills += 1;
        d.wait_nth(kills, &["event: released", "reason=unreachable"], PATIENCE);
        let id = (cycle % 2 == 1).then(|| pinned.clone());
        victim = PrefillProc::start(&spec(Some(listen.clone()), id));
        // The live one: released by the router, loaded again.
        live_releases += 1;
        d.peer_gone(&bodies[cycle % 2]);
        d.wait_nth(live_releases, &["event: released", &live.engine], PATIENCE);
        d.wait_nth(
            live_releases + 1,
            &["event: registered", &live.engine],
            PATIENCE,
        );
        // Both registered again before the next cycle.
        d.wait_nth(kills + live_releases + 2, &["event: registered"], PATIENCE);
    }
    // The baseline is the second sample: by then the decode has made the
    // threads and connections it keeps (tokio's blocking workers, UCX's
    // own), which the first sample, before any release, has not.
    let first = &samples[1.min(samples.len() - 1)];
    let last = samples.last().expect("samples");
    let half = samples.len() / 2;
    report(&format!(
        "soak done: {kills} kills and {live_releases} live releases in {:.0} s; rss {} -> {} KiB \
         ({:+.2} KiB/cycle over the first half of the samples, {:+.2} over the second); \
         anonymous {} -> {} KiB; fds {} -> {}, established {} -> {}, threads {} -> {}, \
         maps {} -> {}, UCX endpoints {} -> {}",
        started.elapsed().as_secs_f64(),
        first.held.rss_kib,
        last.held.rss_kib,
        slope(&samples[..=half]),
        slope(&samples[half..]),
        first.anon_kib,
        last.anon_kib,
        first.held.fds,
        last.held.fds,
        first.held.established,
        last.held.established,
        first.held.threads,
        last.held.threads,
        first.maps,
        last.maps,
        first.ucx_endpoints,
        last.ucx_endpoints,
    ));
    // UCX connects each worker to itself lazily (two descriptors each):
    // a few descriptors come and go; a leak is one per release and rank.
    // Spare call threads of a burst exit 10 s (tokio's keep-alive) after
    // their last call: what is compared is what the decode holds once
    // they could have (waited for, at most that plus the margin).
    let base = first.held;
    let flat = |h: &Held| {
        h.fds <= base.fds + 6
            && h.sockets <= base.sockets + 6
            && h.established_out <= base.established_out + 2
            && h.threads <= base.threads + 2
    };
    common::wait::until(
        "descriptors, sockets, connections to others and threads back to the baseline",
        Duration::from_secs(10) + common::wait::MARGIN,
        || {
            let h = held(d.pid());
            common::wait::check(flat(&h), (base, h))
        },
    );
    d.stop();
}

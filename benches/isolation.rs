//! Isolation: 1, 2 and 8 engines whose notification calls block for 10 s
//! (`block_notify_for`), all started in one burst; lateness of heartbeats
//! to 1,000 healthy engines,
//! against a quiet window of the same run (no blocked engine) and against a
//! naive sender that calls the transport inline, one engine after the
//! other, on one thread.
//!
//! Target: <= 5 ms p99 lateness while the engines are blocked, in every
//! case.

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{lateness_line, machine, ms, FakeCluster, Lateness, CLUSTER_INTERVAL};
use nixl_keepalive::fake::{FakeConfig, FakeUcx};
use nixl_keepalive::{AgentName, PeerAddr, Transport};

const HEALTHY: usize = 1_000;

/// How many engines hang at once, case by case.
const HUNG: [usize; 3] = [1, 2, 8];

fn main() {
    let (block, quiet) = common::hang_and_quiet();
    println!(
        "isolation: {HEALTHY} healthy engines at 1 Hz; 1, 2 and 8 engines whose notifies block {} s, started in one burst; {}",
        block.as_secs(),
        machine()
    );
    let runtime = common::two_worker_runtime();
    let (quiet_p99, cases) = runtime.block_on(async move {
        let max = *HUNG.iter().max().unwrap();
        let cluster = FakeCluster::start(HEALTHY, &[max]).await;
        tokio::time::sleep(CLUSTER_INTERVAL * 2).await;
        println!();
        println!("heartbeat lateness to healthy engines (gap between two heartbeats minus the 1 s interval):");
        let mut q = cluster.lateness_over(quiet).await;
        let quiet_p99 = lateness_line("service, quiet (baseline)", &mut q);
        let mut cases = Vec::new();
        for hung in HUNG {
            let blocked = &cluster.others[0][..hung];
            for e in blocked {
                cluster.ucx.block_notify_for(e, block);
            }
            // All of them hang at once: one burst of renewals.
            for e in blocked {
                cluster.handle.renew_leases(e)
.expect("the service is running");
            }
            // Two blocked calls back to back, at least.
            let mut b = cluster.lateness_over(block * 2 + CLUSTER_INTERVAL).await;
            let p99 = lateness_line(&format!("service, {hung} engine(s) hung at once"), &mut b);
            for e in blocked {
                cluster.ucx.unblock_notify(e);
            }
            // The blocked calls still hold their threads; let them finish.
            tokio::time::sleep(block).await;
            cases.push((hung, p99));
        }
        cluster.shutdown.cancel();
        let _ = cluster.task.await;
        (quiet_p99, cases)
    });
    let naive_p99 = naive(block);
    println!();
    for (hung, p99) in &cases {
        println!(
            "service with {hung} engine(s) hung at once: p99 {} (target <= 5 ms) {}",
            ms(*p99),
            if *p99 <= Duration::from_millis(5) {
                "PASS"
            } else {
                "MISS"
            }
        );
    }
    let (_, one_p99) = cases[0];
    println!(
        "naive inline sender vs service (one hung): ratio: {:.0}x (p99 {} vs {}; target >= 1x, i.e. no worse)",
        naive_p99.as_secs_f64() / one_p99.as_secs_f64().max(1e-6),
        ms(naive_p99),
        ms(one_p99)
    );
    println!("service quiet: p99 {}", ms(quiet_p99));
}

/// The baseline: one thread sends every engine's heartbeat in turn, inline,
/// once per interval; one engine's notify blocks.
fn naive(block: Duration) -> Duration {
    let ucx = FakeUcx::new({
        let mut config = FakeConfig::default();
        config.record_calls = false;
        config
    });
    let mut agents = Vec::new();
    let mut healthy = HashSet::new();
    let mut blocked = None;
    for i in 0..=HEALTHY {
        let addr = PeerAddr::new(format!("10.8.{}.{}:5600", i >> 8, i & 255));
        let e = ucx.spawn_prefill(addr.clone(), 1);
        let hs = ucx.handshake(&addr).unwrap();
        if i == HEALTHY / 2 {
            blocked = Some(e);
        } else {
            healthy.insert(hs.agents[0].clone());
        }
        agents.push(hs.agents[0].clone());
        std::mem::forget(hs.resources);
    }
    let transport = Arc::new(Lateness::new(ucx.clone(), CLUSTER_INTERVAL, healthy));
    let stop = Arc::new(AtomicBool::new(false));
    let sender = {
        let transport = transport.clone();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let start = Instant::now();
            let mut round = 0u32;
            while !stop.load(Ordering::Relaxed) {
                for (i, agent) in agents.iter().enumerate() {
                    // Each engine's slot in the round, as a scheduler would.
                    let due = start
                        + CLUSTER_INTERVAL * round
                        + CLUSTER_INTERVAL.mul_f64(i as f64 / agents.len() as f64);
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                    let _ = transport.notify(agent as &AgentName, b"HB:");
                }
                round += 1;
            }
        })
    };
    std::thread::sleep(CLUSTER_INTERVAL * 2);
    transport.start_window();
    ucx.block_notify_for(blocked.as_ref().unwrap(), block);
    std::thread::sleep(block * 2 + CLUSTER_INTERVAL);
    ucx.unblock_notify(blocked.as_ref().unwrap());
    let mut samples = transport.take_window();
    stop.store(true, Ordering::Relaxed);
    sender.join().unwrap();
    println!();
    lateness_line("naive inline sender, one engine blocked", &mut samples)
}

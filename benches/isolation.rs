//! Isolation: one engine whose notification call blocks for 10 s
//! (`block_notify_for`); lateness of heartbeats to 1,000 healthy engines,
//! against a quiet window of the same run (no blocked engine) and against a
//! naive sender that calls the transport inline, one engine after the
//! other, on one thread.
//!
//! Target: <= 5 ms p99 lateness while the engine is blocked.

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{lateness_line, machine, ms, quick, FakeCluster, Lateness, CLUSTER_INTERVAL};
use nixl_keepalive::fake::{FakeConfig, FakeUcx};
use nixl_keepalive::{AgentName, PeerAddr, Transport};

const HEALTHY: usize = 1_000;

fn main() {
    let block = if quick() {
        Duration::from_secs(3)
    } else {
        Duration::from_secs(10)
    };
    let quiet = if quick() {
        Duration::from_secs(2)
    } else {
        Duration::from_secs(5)
    };
    println!(
        "isolation: {HEALTHY} healthy engines at 1 Hz, 1 engine whose notify blocks {} s; {}",
        block.as_secs(),
        machine()
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (quiet_p99, blocked_p99) = runtime.block_on(async move {
        let cluster = FakeCluster::start(HEALTHY, &[1]).await;
        tokio::time::sleep(CLUSTER_INTERVAL * 2).await;
        println!();
        println!("heartbeat lateness to healthy engines (gap between two heartbeats minus the 1 s interval):");
        let mut q = cluster.lateness_over(quiet).await;
        let quiet_p99 = lateness_line("service, quiet (baseline)", &mut q);
        let blocked = &cluster.others[0][0];
        cluster.ucx.block_notify_for(blocked, block);
        // Two blocked calls back to back, at least.
        let mut b = cluster.lateness_over(block * 2 + CLUSTER_INTERVAL).await;
        let blocked_p99 = lateness_line("service, one engine blocked", &mut b);
        cluster.ucx.unblock_notify(blocked);
        cluster.shutdown.cancel();
        // The blocked call still holds one blocking thread; let it finish.
        tokio::time::sleep(block).await;
        let _ = cluster.task.await;
        (quiet_p99, blocked_p99)
    });
    let naive_p99 = naive(block);
    println!();
    println!(
        "service with one engine blocked: p99 {} (target <= 5 ms) {}",
        ms(blocked_p99),
        if blocked_p99 <= Duration::from_millis(5) {
            "PASS"
        } else {
            "MISS"
        }
    );
    println!(
        "naive inline sender vs service: ratio: {:.0}x (p99 {} vs {}; target >= 1x, i.e. no worse)",
        naive_p99.as_secs_f64() / blocked_p99.as_secs_f64().max(1e-6),
        ms(naive_p99),
        ms(blocked_p99)
    );
    println!(
        "service blocked vs quiet: p99 {} vs {} ({:.1}x)",
        ms(blocked_p99),
        ms(quiet_p99),
        blocked_p99.as_secs_f64() / quiet_p99.as_secs_f64().max(1e-6)
    );
}

/// The baseline: one thread sends every engine's heartbeat in turn, inline,
/// once per interval; one engine's notify blocks.
fn naive(block: Duration) -> Duration {
    let ucx = FakeUcx::new(FakeConfig {
        record_calls: false,
        ..FakeConfig::default()
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

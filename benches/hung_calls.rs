//! Hung transport calls: 1, 8, 64 and 1,000 engines whose notifies block
//! (for 10 s of real time), all hung in one burst (one batch of renewals),
//! with a release queued right behind them; meanwhile 1,000 healthy
//! engines are heartbeated at 1 Hz.
//!
//! Per case: the lateness of healthy heartbeats (gap between two heartbeats
//! minus the 1 s interval) against a quiet window of the same run (no hung
//! call; the baseline), the share of healthy heartbeats that went out at
//! all, the time from `peer_gone` of an idle engine to its release (queued
//! behind the hung calls), and the process's threads at their peak.
//!
//! Target, every case: healthy lateness p99 <= 5 ms, >= 99% of healthy
//! heartbeats out, the queued release within 5 ms, threads within the
//! pool's documented cap (`nixl_keepalive::TRANSPORT_THREADS_CAP`) plus
//! the runtime's own.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{lateness_line, machine, ms, FakeCluster, CLUSTER_INTERVAL};
use nixl_keepalive::{Event, GoneMode, PeerRef};

const HEALTHY: usize = 1_000;

/// How many engines hang at once, case by case.
const HUNG: [usize; 4] = [1, 8, 64, 1_000];

const TARGET: Duration = Duration::from_millis(5);

/// The lateness window ends this long before the hung calls return.
const RETURN_MARGIN: Duration = Duration::from_millis(500);

/// The process's threads now, from /proc/self/status.
fn threads() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0)
}

/// Samples the thread count every 20 ms until stopped; returns the peak.
fn watch_threads() -> (Arc<AtomicBool>, std::thread::JoinHandle<usize>) {
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicUsize::new(0));
    let s = stop.clone();
    let handle = std::thread::spawn(move || {
        while !s.load(Ordering::Relaxed) {
            peak.fetch_max(threads(), Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(20));
        }
        peak.load(Ordering::Relaxed)
    });
    (stop, handle)
}

struct Case {
    hung: usize,
    p99: Duration,
    delivered: f64,
    release: Option<Duration>,
    peak_threads: usize,
}

fn main() {
    let (block, quiet) = common::hang_and_quiet();
    println!(
        "hung_calls: {HEALTHY} healthy engines at 1 Hz; 1, 8, 64 and 1,000 engines whose notifies block {} s, hung in one burst, a release queued behind them; {}",
        block.as_secs(),
        machine()
    );
    let runtime = common::two_worker_runtime();
    let (quiet_p99, quiet_threads, cases) = runtime.block_on(async move {
        let max = *HUNG.iter().max().unwrap();
        // The hung engines, and one idle engine per case to release.
        let cluster = FakeCluster::start(HEALTHY, &[max, HUNG.len()]).await;
        tokio::time::sleep(CLUSTER_INTERVAL * 2).await;
        println!();
        println!("heartbeat lateness to healthy engines (gap between two heartbeats minus the 1 s interval):");
        let (stop, peak) = watch_threads();
        let mut q = cluster.lateness_over(quiet).await;
        stop.store(true, Ordering::Relaxed);
        let quiet_threads = peak.join().unwrap();
        let quiet_p99 = lateness_line("quiet (baseline)", &mut q);
        let pool = cluster.handle.snapshot().await.unwrap().transport;
        println!(
            "  {:<44} pool: {} threads ({} idle), cap {}",
            "", pool.threads, pool.idle, pool.cap
        );
        let expected_per_window = |window: Duration| HEALTHY as f64 * window.as_secs_f64();
        let mut cases = Vec::new();
        for (i, hung) in HUNG.into_iter().enumerate() {
            let blocked = &cluster.others[0][..hung];
            let victim = cluster.others[1][i].clone();
            for e in blocked {
                cluster.ucx.block_notify_for(e, block);
            }
            let mut events = cluster.handle.subscribe();
            let (stop, peak) = watch_threads();
            cluster.transport.start_window();
            // All of them hang at once: one burst of renewals, one batch.
            for e in blocked {
                cluster.handle.renew_leases(e)
.expect("the service is running");
            }
            // A release queued right behind them.
            let t0 = Instant::now();
            cluster
                .handle
                .peer_gone(PeerRef::Engine(victim.clone()), GoneMode::Drain)
.expect("the service is running");
            let release = tokio::time::timeout(block, async {
                loop {
                    match events.recv().await {
                        Ok(Event::Released { engine, .. }) if engine == victim => {
                            return t0.elapsed()
                        }
                        Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                        Err(e) => panic!("events closed: {e}"),
                    }
                }
            })
            .await
            .ok();
            // Past the hung threshold: every hung call is in the snapshot.
            tokio::time::sleep(nixl_keepalive::HUNG_AFTER * 2).await;
            let pool = cluster.handle.snapshot().await.unwrap().transport;
            let hung_now = pool.hung().count();
            // The window ends just before the hung calls come back: what
            // is measured is the time they hang (their return, a burst of
            // results, is measured on its own below, without a target).
            let hung_for = block - RETURN_MARGIN;
            let rest = hung_for.saturating_sub(t0.elapsed());
            tokio::time::sleep(rest).await;
            let mut b = cluster.transport.take_window();
            let delivered = b.len() as f64 / expected_per_window(hung_for);
            let p99 = lateness_line(&format!("{hung} engine(s) hung at once"), &mut b);
            println!(
                "  {:<44} healthy heartbeats out: {:.1}%, queued release: {}; snapshot after {:?}: {hung_now} calls hung, pool {} threads",
                "",
                delivered * 100.0,
                release.map_or("not within the block".to_string(), ms),
                nixl_keepalive::HUNG_AFTER * 2,
                pool.threads,
            );
            for e in blocked {
                cluster.ucx.unblock_notify(e);
            }
            // Their return: every hung call comes back at once.
            cluster.transport.start_window();
            tokio::time::sleep(RETURN_MARGIN * 3).await;
            let mut back = cluster.transport.take_window();
            stop.store(true, Ordering::Relaxed);
            let peak_threads = peak.join().unwrap();
            let (_, back_p99, back_max) = common::percentiles(&mut back);
            println!(
                "  {:<44} peak threads {peak_threads}; as the {hung} hung call(s) came back: p99 {} max {} (no target)",
                "",
                ms(back_p99),
                ms(back_max)
            );
            // The threads they held idle out; let the pool settle.
            tokio::time::sleep(CLUSTER_INTERVAL * 2).await;
            cases.push(Case {
                hung,
                p99,
                delivered,
                release,
                peak_threads,
            });
        }
        cluster.shutdown.cancel();
        let _ = cluster.task.await;
        (quiet_p99, quiet_threads, cases)
    });
    println!();
    println!(
        "quiet: p99 {}, threads {quiet_threads} (the baseline)",
        ms(quiet_p99)
    );
    for c in &cases {
        let ok = c.p99 <= TARGET && c.delivered >= 0.99 && c.release.is_some_and(|r| r <= TARGET);
        println!(
            "{:>5} hung at once: lateness p99 {} (ratio to quiet {:.1}x), {:.1}% out, queued release {}, peak threads {} (quiet {quiet_threads}) (target: p99 <= 5 ms, >= 99% out, release <= 5 ms) {}",
            c.hung,
            ms(c.p99),
            c.p99.as_secs_f64() / quiet_p99.as_secs_f64().max(1e-6),
            c.delivered * 100.0,
            c.release.map_or("never".to_string(), ms),
            c.peak_threads,
            if ok { "PASS" } else { "MISS" }
        );
    }
}

//! Heartbeat scheduling for 1k, 10k and 100k engines at 1 Hz with a no-op
//! transport: process CPU per second of schedule and memory per engine,
//! against a loop that scans every engine each 1 ms tick (the timer
//! resolution of the service's DelayQueue) and calls the transport inline.
//! A third line isolates the cost of one `spawn_blocking` per heartbeat
//! (what the service does), with no scheduling at all. A last line is the
//! floor of any slot-based schedule on the machine: a task on the same
//! runtime that wakes at every slot boundary and does nothing else, at the
//! service's slot and at half of it (on a VM a wake-up after milliseconds
//! asleep can cost a hundred microseconds of CPU).
//!
//! Each measurement runs in its own child process (this executable with
//! `--child`), so that memory and CPU are its own.
//!
//! Targets: 10k engines at <= 2% of a core and no more CPU than the scan
//! (ratio >= 1x); 100k engines keep up (>= 99% of heartbeats out) at <= 20%
//! of a core; <= 1 KiB per engine at 1k and 10k.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::{machine, process_cpu, quick, rss_bytes, NoopTransport};
use nixl_keepalive::{AgentName, Config, EngineId, PeerAddr, Registration, Transport};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

const INTERVAL: Duration = Duration::from_secs(1);

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--child") {
        let kind = args[i + 1].clone();
        let engines: usize = args[i + 2].parse().unwrap();
        let seconds: u64 = args[i + 3].parse().unwrap();
        child(&kind, engines, Duration::from_secs(seconds));
        return;
    }
    let seconds = if quick() { 2 } else { 5 };
    println!(
        "heartbeat_schedule: 1 Hz per engine, no-op transport, {seconds} s measured per point after warm-up; {}",
        machine()
    );
    println!("CPU = process CPU time (CLOCK_PROCESS_CPUTIME_ID, every thread) / wall time; 100% = one core");
    println!();
    println!(
        "{:>8}  {:>22}  {:>14}  {:>14}  {:>22}  {:>22}",
        "engines",
        "service CPU (% core)",
        "heartbeats/s",
        "bytes/engine",
        "scan loop CPU (% core)",
        "spawn_blocking only"
    );
    let exe = std::env::current_exe().unwrap();
    let run = |kind: &str, n: usize| -> (f64, f64, f64) {
        let out = std::process::Command::new(&exe)
            .args(["--child", kind, &n.to_string(), &seconds.to_string()])
            .output()
            .expect("child runs");
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .find(|l| l.starts_with("RESULT"))
            .unwrap_or_else(|| {
                panic!(
                    "child {kind} {n} failed: {text} {}",
                    String::from_utf8_lossy(&out.stderr)
                )
            });
        let v: Vec<f64> = line
            .split_whitespace()
            .skip(1)
            .map(|x| x.parse().unwrap())
            .collect();
        (v[0], v[1], v[2])
    };
    let mut ratios = Vec::new();
    let floor = |slot: Duration| run("timer", slot.as_micros() as usize).0;
    for n in [1_000usize, 10_000, 100_000] {
        let (cpu, rate, bytes) = run("service", n);
        let (scan_cpu, scan_rate, _) = run("scan", n);
        let (blocking_cpu, _, _) = run("blocking", n);
        println!(
            "{n:>8}  {:>21.2}%  {rate:>14.0}  {bytes:>14.0}  {:>21.2}%  {:>21.2}%",
            cpu * 100.0,
            scan_cpu * 100.0,
            blocking_cpu * 100.0
        );
        let _ = scan_rate;
        ratios.push((n, cpu, scan_cpu, bytes, rate));
    }
    println!(
        "floor: a task that only wakes at each slot boundary: {:.2}% of a core every {:?} (the service's slot), {:.2}% every {:?}",
        floor(nixl_keepalive::HEARTBEAT_SLOT) * 100.0,
        nixl_keepalive::HEARTBEAT_SLOT,
        floor(nixl_keepalive::HEARTBEAT_SLOT / 2) * 100.0,
        nixl_keepalive::HEARTBEAT_SLOT / 2,
    );
    println!();
    for (n, cpu, scan, bytes, rate) in ratios {
        let ratio = if cpu > 0.0 { scan / cpu } else { f64::INFINITY };
        let verdict = |ok: bool| if ok { "PASS" } else { "MISS" };
        common::ratio_line(&format!("{n} engines, scan vs service"), ratio, 1.0);
        match n {
            10_000 => println!(
                "10000 engines: {:.2}% of a core (target <= 2%) {}",
                cpu * 100.0,
                verdict(cpu <= 0.02)
            ),
            100_000 => {
                let on_time = rate / n as f64;
                println!(
                    "100000 engines: {:.1}% of the heartbeats due went out (target >= 99%) {}; {:.2}% of a core (target <= 20%) {}",
                    on_time * 100.0,
                    verdict(on_time >= 0.99),
                    cpu * 100.0,
                    verdict(cpu <= 0.20)
                )
            }
            _ => {}
        }
        if n <= 10_000 {
            println!(
                "{n} engines: {bytes:.0} bytes per engine (target <= 1024) {}",
                verdict(bytes <= 1024.0)
            );
        }
    }
}

fn child(kind: &str, engines: usize, measure: Duration) {
    let runtime = common::two_worker_runtime();
    let (cpu, rate, bytes) = runtime.block_on(async move {
        match kind {
            "service" => service(engines, measure).await,
            "scan" => scan(engines, measure).await,
            "blocking" => blocking(engines, measure).await,
            // `engines` is the period in microseconds here.
            "timer" => timer(Duration::from_micros(engines as u64), measure).await,
            other => panic!("unknown child {other}"),
        }
    });
    println!("RESULT {cpu} {rate} {bytes}");
}

/// CPU share and rate over `measure`, counting with `count`.
async fn measure_cpu(measure: Duration, count: impl Fn() -> u64) -> (f64, f64) {
    let c0 = process_cpu();
    let n0 = count();
    let t0 = std::time::Instant::now();
    tokio::time::sleep(measure).await;
    let wall = t0.elapsed();
    let cpu = (process_cpu() - c0).as_secs_f64() / wall.as_secs_f64();
    (cpu, (count() - n0) as f64 / wall.as_secs_f64())
}

async fn service(engines: usize, measure: Duration) -> (f64, f64, f64) {
    let transport = Arc::new(NoopTransport::default());
    let config = Config::builder()
        .heartbeat_interval(Some(INTERVAL))
        .jitter(Duration::from_millis(100))
        .metrics_period(None)
        .event_capacity(16)
        .seed(1)
        .build()
        .unwrap();
    let shutdown = CancellationToken::new();
    // Names made before the baseline RSS: they are the runtime's, not the
    // service's (the decoder holds them anyway).
    let regs: Vec<_> = (0..engines)
        .map(|i| Registration {
            incarnation: None,
            engine: EngineId::new(format!("prefill-{i}")),
            address: PeerAddr::new(format!(
                "10.{}.{}.{}:5600",
                i >> 16,
                (i >> 8) & 255,
                i & 255
            )),
            agents: vec![AgentName::new(format!("prefill-{i}-rank0"))],
            resources: (),
        })
        .collect();
    let (handle, _task) = nixl_keepalive::spawn(transport.clone(), config, shutdown.clone());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let rss0 = rss_bytes();
    let mut refs = Vec::with_capacity(engines);
    for r in regs {
        refs.push(handle.register(r).await.unwrap());
    }
    // Warm-up: every engine has had a heartbeat (first ones are spread
    // over one interval), the timers and limiter keys are all there.
    tokio::time::sleep(INTERVAL * 2).await;
    let bytes = (rss_bytes().saturating_sub(rss0)) as f64 / engines as f64;
    let (cpu, rate) = measure_cpu(measure, || transport.notifies.load(Ordering::Relaxed)).await;
    shutdown.cancel();
    (cpu, rate, bytes)
}

async fn scan(engines: usize, measure: Duration) -> (f64, f64, f64) {
    let transport = Arc::new(NoopTransport::default());
    let stop = CancellationToken::new();
    let task = {
        let transport = transport.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let start = Instant::now();
            let mut table: Vec<(Instant, AgentName)> = (0..engines)
                .map(|i| {
                    (
                        start + INTERVAL.mul_f64(i as f64 / engines as f64),
                        AgentName::new(format!("prefill-{i}-rank0")),
                    )
                })
                .collect();
            let mut tick = tokio::time::interval(Duration::from_millis(1));
            tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stop.cancelled() => break,
                }
                let now = Instant::now();
                for (due, agent) in table.iter_mut() {
                    if *due <= now {
                        let _ = transport.notify(agent, b"HB:");
                        *due = now + INTERVAL;
                    }
                }
            }
        })
    };
    tokio::time::sleep(INTERVAL * 2).await;
    let (cpu, rate) = measure_cpu(measure, || transport.notifies.load(Ordering::Relaxed)).await;
    stop.cancel();
    let _ = task.await;
    (cpu, rate, 0.0)
}

/// What one `spawn_blocking` per heartbeat costs alone: `engines` no-op
/// blocking jobs per second, spread over 1 ms ticks.
async fn blocking(engines: usize, measure: Duration) -> (f64, f64, f64) {
    let transport = Arc::new(NoopTransport::default());
    let stop = CancellationToken::new();
    let task = {
        let transport = transport.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let agent = AgentName::new("prefill-0-rank0");
            let mut tick = tokio::time::interval(Duration::from_millis(1));
            tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
            let mut sent = 0u64;
            let start = Instant::now();
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stop.cancelled() => break,
                }
                let due = (start.elapsed().as_secs_f64() * engines as f64) as u64;
                while sent < due {
                    let transport = transport.clone();
                    let agent = agent.clone();
                    tokio::task::spawn_blocking(move || transport.notify(&agent, b"HB:"));
                    sent += 1;
                }
            }
        })
    };
    tokio::time::sleep(INTERVAL * 2).await;
    let (cpu, rate) = measure_cpu(measure, || transport.notifies.load(Ordering::Relaxed)).await;
    stop.cancel();
    let _ = task.await;
    (cpu, rate, 0.0)
}

/// The floor: a task that sleeps to each boundary of `slot` and does
/// nothing else, on the same runtime as the service.
async fn timer(slot: Duration, measure: Duration) -> (f64, f64, f64) {
    let stop = CancellationToken::new();
    let wakes = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let task = {
        let stop = stop.clone();
        let wakes = wakes.clone();
        tokio::spawn(async move {
            let mut next = Instant::now();
            loop {
                next += slot;
                tokio::select! {
                    _ = tokio::time::sleep_until(next) => {}
                    _ = stop.cancelled() => break,
                }
                wakes.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    tokio::time::sleep(INTERVAL).await;
    let (cpu, rate) = measure_cpu(measure, || wakes.load(Ordering::Relaxed)).await;
    stop.cancel();
    let _ = task.await;
    (cpu, rate, 0.0)
}

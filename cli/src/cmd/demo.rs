//! `nixl-keepalive demo`: a simulated P/D cluster on the fake UCX.
//!
//! One decoder (the keepalive service plus a simulated decoder runtime:
//! handshakes, read traffic, reconnects) and `--prefills` prefill engines.
//! A scenario (built in, or drawn from `--seed`) kills, freezes, restarts
//! and partitions prefills while reads run; the demo checks what it can
//! check independently of the library (see
//! [`nixl_keepalive::fake::AuditedUcx`]) and ends
//! with a summary whose last line is
//! `summary: released=N leaked=L violations=V`.
//!
//! By default the whole cluster runs on tokio's paused clock (a
//! current-thread runtime with `start_paused`): time jumps to the next
//! timer whenever every task is idle, so a ten-minute scenario takes
//! seconds. `--real-time` runs it on the wall clock.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use nixl_keepalive::fake::{AuditedUcx, FakeConfig, FakeUcx};
use nixl_keepalive::ucx::time::{parse_time, TimeField, UcxTime};
use nixl_keepalive::{Config, PeerAddr};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

mod decoder;
mod membership;
mod report;
mod scenario;
mod view;

use decoder::{Decoder, TrafficShape};
use report::{Outcome, Timeline};
use scenario::{Bounds, Scenario};

/// `demo`'s flags.
#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    /// Prefill engines in the simulated cluster.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=1000))]
    prefills: u16,

    /// NIXL agents (ranks) per prefill engine.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=i64::from(nixl_keepalive::text::MAX_RANKS)))]
    ranks: u16,

    /// Concurrent reader loops in the decoder (each pulls KV blocks from a
    /// random prefill, one read at a time).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=256))]
    readers: u16,

    /// Random incidents drawn from this seed instead of the built-in
    /// script. The same seed gives the same scenario.
    #[arg(long)]
    seed: Option<u64>,

    /// Scenario length, in UCX time syntax (`10m`, `90s`, a bare number of
    /// seconds).
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    duration: Duration,

    /// The simulated UCX_KEEPALIVE_INTERVAL: how long a frozen or
    /// partitioned prefill stays silent before UCX fails its endpoints
    /// (`inf`: never).
    #[arg(long, default_value = "5s", value_parser = parse_keepalive)]
    ucx_keepalive: Keepalive,

    /// Run on the wall clock instead of tokio's paused (virtual) clock.
    #[arg(long)]
    real_time: bool,

    /// Print the summary as one line of JSON (before the summary line)
    /// instead of the tables; no live view.
    #[arg(long)]
    json: bool,

    /// Push mode (SGLang's NIXL path): the service runs in a prefill that
    /// WRITEs into the simulated peers, which are decodes. The same
    /// incidents, bounds and checks (no release with a write in flight);
    /// the lines below name each peer as the simulated cluster does
    /// (`prefill N`): in push mode, read decode N.
    #[arg(long)]
    push: bool,
}

/// `--ucx-keepalive`: a duration or `inf`.
#[derive(Clone, Copy, Debug)]
struct Keepalive(Option<Duration>);

fn parse_duration(value: &str) -> Result<Duration, String> {
    match parse_time(value, TimeField::Time).map_err(|e| e.to_string())? {
        UcxTime::Finite(d) if !d.is_zero() => Ok(d),
        _ => Err("must be a time above zero".into()),
    }
}

fn parse_keepalive(value: &str) -> Result<Keepalive, String> {
    match parse_time(value, TimeField::TimeUnits).map_err(|e| e.to_string())? {
        UcxTime::Finite(d) if !d.is_zero() => Ok(Keepalive(Some(d))),
        UcxTime::Finite(_) => Err("must be above zero (`inf` disables)".into()),
        UcxTime::Infinite => Ok(Keepalive(None)),
        UcxTime::Auto => Err("`auto` has no meaning here".into()),
    }
}

/// Runs the demo: the exit code is 0 only if nothing leaked and no safety
/// violation was seen; 2 for a configuration error.
pub(crate) fn run(args: DemoArgs) -> ExitCode {
    // The environment is read before anything starts: a bad value stops
    // here, naming the variable and the accepted syntax.
    let config = match Config::from_env().and_then(|config| {
        config
            .to_builder()
            // The jitter's seed: fixed, so that runs repeat.
            .seed(args.seed.unwrap_or(0))
            // No metrics recorder is installed: skip the census.
            .metrics_period(None)
            .build()
    }) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };

    let runtime = if args.real_time {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
    };
    let runtime = match runtime {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let wall = std::time::Instant::now();
    let outcome = runtime.block_on(simulate(&args, config));
    let wall = wall.elapsed();
    report::print(
        &outcome,
        &args_summary(&args),
        args.json,
        args.real_time,
        wall,
    );
    if outcome.leaked() > 0 || !outcome.violations.is_empty() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn args_summary(args: &DemoArgs) -> report::RunInfo {
    report::RunInfo {
        prefills: args.prefills as usize,
        ranks: args.ranks as usize,
        readers: args.readers as usize,
        seed: args.seed,
        duration: args.duration,
        ucx_keepalive: args.ucx_keepalive.0,
        push: args.push,
    }
}

async fn simulate(args: &DemoArgs, config: Config) -> Outcome {
    let out_is_tty = std::io::stdout().is_terminal();
    let live = !args.json;
    let ucx = FakeUcx::new({
        let mut fake = FakeConfig::with_keepalive(args.ucx_keepalive.0);
        fake.record_calls = false;
        // As measured on shared memory and TCP: UCX never reports a frozen
        // peer; its lease expiry in the membership plane does.
        fake.frozen_peers_detected = false;
        fake
    });
    let addrs: Vec<PeerAddr> = (0..args.prefills)
        .map(|i| PeerAddr::new(format!("10.0.{}.{}:5600", i / 250, i % 250 + 1)))
        .collect();
    for addr in &addrs {
        ucx.spawn_prefill(addr.clone(), args.ranks as usize);
    }

    let origin = Instant::now();
    let timeline = Arc::new(Timeline::new(origin));
    let audit = {
        let timeline = timeline.clone();
        Arc::new(AuditedUcx::new(ucx.clone(), move |v| timeline.violation(v)))
    };
    let shutdown = CancellationToken::new();
    let (handle, service) = nixl_keepalive::spawn(audit.clone(), config.clone(), shutdown.clone());

    let shape = TrafficShape::default().with_push(args.push);
    let bounds = Bounds::new(&config, args.ucx_keepalive.0, shape.max_read());
    let decoder = Decoder::new(
        ucx.clone(),
        handle.clone(),
        addrs.clone(),
        audit.clone(),
        timeline.clone(),
        shape,
        args.seed.unwrap_or(0),
    );
    let watcher = decoder.clone().watch_events(handle.subscribe());
    let membership = membership::DemoMembership::start(
        ucx.clone(),
        addrs.clone(),
        args.ranks,
        handle.clone(),
        timeline.clone(),
        shutdown.clone(),
    );

    if live {
        let clock = if args.real_time {
            "real time (wall clock)".to_string()
        } else {
            format!(
                "virtual time (tokio's paused clock): a {} scenario runs in seconds; --real-time to watch it on the wall clock",
                report::human(args.duration)
            )
        };
        if args.push {
            println!(
                "nixl-keepalive demo, push mode: 1 prefill embedding the service, with {} writers, WRITEs into {} decodes x {} ranks (each named `prefill N` below, as the simulated cluster calls its peers: read decode N); {}",
                args.readers, args.prefills, args.ranks, clock
            );
        } else {
            println!(
                "nixl-keepalive demo: {} prefills x {} ranks, 1 decoder with {} readers; {}",
                args.prefills, args.ranks, args.readers, clock
            );
        }
        println!(
            "service: {config}; simulated UCX_KEEPALIVE_INTERVAL={}; scenario: {}",
            args.ucx_keepalive
                .0
                .map(report::human)
                .unwrap_or_else(|| "inf".into()),
            match args.seed {
                Some(seed) => format!("random from seed {seed}"),
                None => "built-in script".into(),
            }
        );
    }

    decoder.connect_all().await;
    decoder.clone().start_readers(args.readers as usize);
    let view = live.then(|| {
        view::start(
            handle.clone(),
            decoder.clone(),
            timeline.clone(),
            args.duration,
            out_is_tty,
        )
    });

    let scenario = match args.seed {
        Some(seed) => Scenario::random(seed, args.prefills as usize, args.duration, bounds),
        None => Scenario::script(args.prefills as usize, args.duration, bounds),
    };
    let interrupted = scenario.run(&decoder, &membership, &timeline, origin).await;

    // Stop the traffic and the reconnects, so that every guard is dropped;
    // then stop the service and take back what it could not release.
    decoder.stop().await;
    // Let the last drained reads reach the service before it stops.
    tokio::time::sleep(Duration::from_millis(100)).await;
    if let Some(view) = view {
        view.stop().await;
    }
    shutdown.cancel();
    let unreleased = match service.await {
        Ok(stopped) => stopped.unreleased,
        Err(e) => {
            timeline.violation(format!("the keepalive service task failed: {e}"));
            Vec::new()
        }
    };
    let returned_at_stop = unreleased.len();
    for registration in unreleased {
        // What the service handed back: the runtime releases it itself.
        use nixl_keepalive::Transport;
        ucx.release(
            &registration.engine,
            &registration.agents,
            registration.resources,
        );
    }
    let events = watcher.finish().await;
    let held = ucx.held();
    Outcome::build(
        &timeline,
        decoder.reads(),
        audit.releases(),
        events,
        held,
        returned_at_stop,
        interrupted,
        Instant::now().saturating_duration_since(origin),
        config,
    )
}

//! `nixl-keepalive decode`: a real decode engine on the NIXL runtime.
//!
//! Runs the keepalive service over a [`NixlTransport`] and one reader per
//! `--prefill` address (handshake, random READs with every byte checked,
//! re-handshake after a release), prints the service's events one per
//! line, a read summary every 5 s, and with `--metrics-addr` serves
//! Prometheus metrics at `http://ADDR/metrics`. An operator can kill a
//! prefill and watch the decoder release it. Service settings come from
//! the `NIXL_KEEPALIVE_*` environment variables; UCX's from `UCX_*`.
//!
//! SIGINT or SIGTERM stops it gracefully (see `stop_gracefully`): no new
//! reads, the reads in flight end (bounded), then the service releases
//! every engine; exit 0 when none is left held.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use nixl_keepalive::nixl_transport::NixlTransport;
use nixl_keepalive::ucx_settings::UcxSettings;
use nixl_keepalive::{Config, Event, Keepalive, PeerAddr};
use nixl_keepalive_cli::pd::decode::{DecodeOptions, Decoder};
use nixl_sys::{Agent, AgentConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// `decode`'s flags.
#[derive(Debug, Args)]
pub(crate) struct DecodeArgs {
    /// Prefill side-channel addresses (`host:port`), one or more.
    #[arg(long, required = true, num_args = 1..)]
    prefill: Vec<String>,

    /// Serve Prometheus metrics on this address (`/metrics`).
    #[arg(long)]
    metrics_addr: Option<SocketAddr>,

    /// Reads in flight per prefill.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=64))]
    reads: u16,

    /// Pause between rounds of reads, in milliseconds.
    #[arg(long, default_value_t = 20)]
    read_pause_ms: u64,

    /// How often a connected prefill's side channel is asked again who is
    /// there, in milliseconds.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..))]
    probe_ms: u64,

    /// How often the decode agent's UCX worker is progressed, in ms.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=1000))]
    progress_ms: u64,
}

pub(crate) fn run(args: DecodeArgs) -> ExitCode {
    // A bad environment value stops here, before anything starts.
    let config = match Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    super::init_tracing();
    let rt = match nixl_sys::Runtime::get() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    // After NIXL is loaded, so UCX's settings are read from NIXL's own UCX.
    // A bad UCX_* value stops here too.
    let ucx_settings = match UcxSettings::read() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let metrics = match args.metrics_addr {
        Some(_) => match PrometheusBuilder::new().install_recorder() {
            Ok(h) => Some(h),
            Err(e) => {
                eprintln!("error: cannot install the metrics recorder: {e}");
                return ExitCode::FAILURE;
            }
        },
        None => None,
    };
    let name = format!("decode-{}-{}", std::process::id(), rand::random::<u32>());
    let agent = match Agent::new(rt, &name, &AgentConfig::default()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: cannot create the decode agent: {e}");
            return ExitCode::FAILURE;
        }
    };
    let transport = Arc::new(NixlTransport::new(agent));
    let _progress = transport.spawn_progress(Duration::from_millis(args.progress_ms));
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let shutdown = CancellationToken::new();
        if let (Some(addr), Some(handle)) = (args.metrics_addr, metrics) {
            match tokio::net::TcpListener::bind(addr).await {
                Ok(l) => {
                    println!("metrics on http://{}/metrics", l.local_addr().map_or(addr, |a| a));
                    tokio::spawn(serve_metrics(l, handle, shutdown.clone()));
                }
                Err(e) => {
                    eprintln!("error: cannot listen on {addr}: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
        println!("decode agent {name}; service: {config}");
        let (service, keepalive) = Keepalive::new(transport.clone(), config);
        // Its start-up line (stderr) gives the detection bound.
        let task = tokio::spawn(
            service
                .with_ucx_settings(&ucx_settings)
                .run(shutdown.clone()),
        );
        let mut events = keepalive.subscribe();
        let options = DecodeOptions {
            reads_in_flight: args.reads as usize,
            read_pause: Duration::from_millis(args.read_pause_ms),
            probe_interval: Duration::from_millis(args.probe_ms),
            ..DecodeOptions::default()
        };
        // Readers stop on their own token, before the service's: see
        // `stop_gracefully`.
        let reading = CancellationToken::new();
        let reader_drain = options.read_timeout + options.handshake_timeout * 2;
        let decoder = Decoder::new(keepalive.clone(), transport.clone(), options);
        let readers: Vec<_> = args
            .prefill
            .iter()
            .map(|a| decoder.spawn(PeerAddr::from(a.as_str()), reading.clone()))
            .collect();
        let mut summary = tokio::time::interval(Duration::from_secs(5));
        summary.tick().await;
        let signal = super::wait_for_signal();
        tokio::pin!(signal);
        loop {
            tokio::select! {
                _ = &mut signal => break,
                event = events.recv() => match event {
                    Ok(e) => print_event(&e),
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => println!("event: ({n} events missed)"),
                    Err(_) => break,
                },
                _ = summary.tick() => {
                    let s = decoder.stats();
                    println!(
                        "reads: verified={} corrupt={} failed={} abandoned={} refused={} handshakes={}",
                        s.verified.load(Ordering::Relaxed),
                        s.corrupt.load(Ordering::Relaxed),
                        s.failed.load(Ordering::Relaxed),
                        s.abandoned.load(Ordering::Relaxed),
                        s.refused.load(Ordering::Relaxed),
                        s.handshakes.load(Ordering::Relaxed),
                    );
                }
            }
        }
        println!("decode stopping");
        let code = stop_gracefully(reading, readers, reader_drain, shutdown, task).await;
        // The releases of the stop itself, sent before the task returned.
        loop {
            match events.try_recv() {
                Ok(e) => print_event(&e),
                Err(tokio::sync::broadcast::error::TryRecvError::Lagged(n)) => {
                    println!("event: ({n} events missed)")
                }
                Err(_) => break,
            }
        }
        if code == ExitCode::SUCCESS {
            println!("decode stopped: every engine released");
        }
        code
    })
}

/// A graceful stop, in this order:
/// 1. the readers' token is cancelled: no new read or handshake starts;
/// 2. the readers are awaited, at most `reader_drain` (a read in flight
///    ends within its read timeout, a handshake within two handshake
///    timeouts) or until a second SIGINT/SIGTERM: reads end by themselves
///    and their guards are dropped;
/// 3. only then is the service cancelled and awaited: it releases every
///    engine (no read in flight is left to wait for).
///
/// Cancelling the service first would find reads in flight, and a service
/// that returns such engines unreleased left "stopped with N engines still
/// held" and exit 1. Exit 0 when every engine was released.
async fn stop_gracefully(
    reading: CancellationToken,
    readers: Vec<tokio::task::JoinHandle<()>>,
    reader_drain: Duration,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<
        nixl_keepalive::Stopped<nixl_keepalive::nixl_transport::RemoteDlists>,
    >,
) -> ExitCode {
    reading.cancel();
    let all = futures_join_all(readers);
    tokio::select! {
        _ = all => tracing::info!("readers stopped; no read in flight"),
        _ = tokio::time::sleep(reader_drain) => {
            tracing::warn!(?reader_drain, "readers still busy after the drain bound; stopping the service anyway");
        }
        _ = super::wait_for_signal() => {
            tracing::warn!("second signal: not waiting for reads in flight");
        }
    }
    shutdown.cancel();
    match task.await {
        Ok(s) if s.unreleased.is_empty() => ExitCode::SUCCESS,
        Ok(s) => {
            eprintln!("stopped with {} engines still held", s.unreleased.len());
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: the service task failed: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Awaits every reader task (their results carry nothing).
async fn futures_join_all(readers: Vec<tokio::task::JoinHandle<()>>) {
    for r in readers {
        let _ = r.await;
    }
}

/// One line per event, greppable: `event: <kind> key=value ...`.
fn print_event(event: &Event) {
    match event {
        Event::Registered { engine, address } => println!("event: registered engine={engine} address={address}"),
        Event::Unreachable { engine, status, source } => {
            println!("event: unreachable engine={engine} status={status} source={source}")
        }
        Event::Replaced { old, new, address } => println!("event: replaced old={old} new={new} address={address}"),
        Event::Retiring { engine, fail_reads } => println!("event: retiring engine={engine} fail_reads={fail_reads}"),
        Event::ReadsFailed { engine, count } => println!("event: reads_failed engine={engine} count={count}"),
        Event::TransientError { engine, status, source } => {
            println!("event: transient_error engine={engine} status={status} source={source}")
        }
        Event::Released {
            engine,
            reason,
            waited_for,
            failed_steps,
        } => println!(
            "event: released engine={engine} reason={} waited_ms={} reads_at_mark={} handshake={} failed_steps={failed_steps}",
            reason.as_str(),
            waited_for.duration.as_millis(),
            waited_for.reads_in_flight_at_mark,
            waited_for.handshake
        ),
    }
}

/// A minimal HTTP/1.1 endpoint: every request gets the rendered metrics.
async fn serve_metrics(
    listener: tokio::net::TcpListener,
    handle: PrometheusHandle,
    shutdown: CancellationToken,
) {
    let upkeep = handle.clone();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        let mut t = tokio::time::interval(Duration::from_secs(5));
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = t.tick() => upkeep.run_upkeep(),
            }
        }
    });
    loop {
        let (mut stream, _) = tokio::select! {
            _ = shutdown.cancelled() => return,
            a = listener.accept() => match a { Ok(a) => a, Err(_) => continue },
        };
        let handle = handle.clone();
        tokio::spawn(async move {
            // Read the request head (bounded), ignore its contents.
            let mut buf = vec![0u8; 4096];
            let mut n = 0;
            let read = tokio::time::timeout(Duration::from_secs(5), async {
                while n < buf.len() {
                    match stream.read(&mut buf[n..]).await {
                        Ok(0) | Err(_) => break,
                        Ok(k) => n += k,
                    }
                    if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
            });
            let _ = read.await;
            let body = handle.render();
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = stream.write_all(head.as_bytes()).await;
            let _ = stream.write_all(body.as_bytes()).await;
            let _ = stream.shutdown().await;
        });
    }
}

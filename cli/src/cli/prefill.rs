//! `nixl-keepalive prefill`: a real prefill engine on the NIXL runtime.
//!
//! One NIXL agent per rank with a DRAM "KV cache" filled with the known
//! pattern, a side channel on `--listen` (at most `--max-connections` at
//! once), request leases kept with vLLM's rules (`--lease-secs`; expiries
//! and reads after expiry logged, a `lease summary` line at stop). Prints
//! one line
//! `PREFILL READY engine=<id> listen=<addr> pid=<pid> incarnation=<n>` on
//! stdout once it answers handshakes; runs until SIGINT or SIGTERM.
//!
//! With `--etcd-endpoint`, it registers itself under
//! `<--etcd-prefix><engine id>` with a lease of `--etcd-ttl` seconds, kept
//! alive every TTL/3, and written again under a new lease when it finds
//! the old one expired (after a freeze, or an etcd outage longer than the
//! TTL); one stdout line per change (`ETCD registered key=.. lease=..`,
//! `ETCD lease_lost lease=..`, `ETCD unreachable error=..`). A graceful
//! stop deletes the key before the side channel closes.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use nixl_keepalive::EngineId;
use nixl_keepalive_cli::pd::prefill::{fresh_engine_id, Prefill, PrefillConfig};
use nixl_keepalive_cli::pd::wire::{MAX_BLOCK_SIZE, MAX_RANKS};
use tokio_util::sync::CancellationToken;

/// `prefill`'s flags.
#[derive(Debug, Args)]
pub(crate) struct PrefillArgs {
    /// Side-channel address to answer handshakes on (`host:port`).
    #[arg(long)]
    listen: SocketAddr,

    /// Pin the engine id (default: a fresh UUID per start).
    #[arg(long)]
    engine_id: Option<String>,

    /// KV blocks per rank.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    blocks: u32,

    /// Bytes per block.
    #[arg(long, default_value_t = 65536, value_parser = clap::value_parser!(u64).range(1..=MAX_BLOCK_SIZE))]
    block_size: u64,

    /// Ranks (one NIXL agent each).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=i64::from(MAX_RANKS)))]
    ranks: u16,

    /// Poll interval of the agents while notifications arrive, in ms.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1000))]
    poll_ms: u64,

    /// Longest poll interval while idle, in ms (a READ to an idle prefill
    /// may wait this long; lower costs more CPU while idle).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=1000))]
    idle_poll_ms: u64,

    /// Give each agent NIXL's progress thread, sleeping this many µs between
    /// polls (0: busy loop, a core per agent). Default: none; our poller
    /// progresses the agents. Large READs are progress-bound without it.
    #[arg(long)]
    progress_thread_us: Option<u64>,

    /// etcd client URL (`http://host:port`, repeatable): register this
    /// engine there under a lease.
    #[arg(long)]
    etcd_endpoint: Vec<String>,

    /// The etcd key prefix to register under.
    #[arg(long, default_value = nixl_keepalive::membership::DEFAULT_PREFIX)]
    etcd_prefix: String,

    /// The etcd lease's TTL in seconds: a decoder retires this engine when
    /// the lease is not kept alive for this long.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    etcd_ttl: u64,

    /// Lease of a request's KV blocks without renewal, in seconds (vLLM:
    /// 30). An `HB:` extends a request to now + 2/3 of it.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    lease_secs: u64,

    /// Side-channel connections handled at once; when all are taken, the
    /// one waiting longest for its request is closed to make room.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=4096))]
    max_connections: u64,

    /// How long one side-channel connection may take, in ms.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    connection_timeout_ms: u64,
}

pub(crate) fn run(mut args: PrefillArgs) -> ExitCode {
    if !args.etcd_endpoint.is_empty() && args.listen.ip().is_unspecified() {
        // The address goes into etcd for decoders to connect to.
        eprintln!(
            "error: --listen {} is not an address a decoder can connect to; with --etcd-endpoint give the host's own address",
            args.listen
        );
        return ExitCode::from(2);
    }
    super::init_tracing();
    let rt = match nixl_sys::Runtime::get() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let engine = match args.engine_id.take() {
        Some(id) if !id.is_empty() && id.len() <= 200 => EngineId::from(id),
        Some(_) => {
            eprintln!("error: --engine-id must be 1 to 200 bytes");
            return ExitCode::from(2);
        }
        None => fresh_engine_id(),
    };
    let mut config = PrefillConfig::new(engine.clone());
    config.blocks = args.blocks;
    config.block_size = args.block_size as usize;
    config.ranks = args.ranks;
    config.lease = Duration::from_secs(args.lease_secs);
    config.max_connections = args.max_connections as usize;
    config.connection_timeout = Duration::from_millis(args.connection_timeout_ms);
    config.poll_interval = Duration::from_millis(args.poll_ms);
    if let Some(us) = args.progress_thread_us {
        config.agent.progress_thread = nixl_sys::ProgressThread::Polling {
            delay: Duration::from_micros(us),
        };
    }
    config.idle_poll_interval = Duration::from_millis(args.idle_poll_ms.max(args.poll_ms));
    let prefill = match Prefill::start(rt, config) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: cannot start the prefill agents: {e}");
            return ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
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
        let listener = match tokio::net::TcpListener::bind(args.listen).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("error: cannot listen on {}: {e}", args.listen);
                return ExitCode::FAILURE;
            }
        };
        let local = listener.local_addr().map_or(args.listen, |a| a);
        let stop = Arc::new(AtomicBool::new(false));
        let poller = prefill.spawn_poller(stop.clone());
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(prefill.clone().serve(listener, shutdown.clone()));
        println!(
            "PREFILL READY engine={engine} listen={local} pid={} incarnation={}",
            std::process::id(),
            prefill.incarnation()
        );
        tracing::info!(%engine, listen = %local, ranks = args.ranks, blocks = args.blocks, "prefill ready");
        let registration = register(&args, &engine, prefill.incarnation(), local);
        super::wait_for_signal().await;
        tracing::info!("prefill stopping");
        // The key goes first, so decoders retire this engine before its
        // side channel closes.
        if let Some(r) = registration {
            r.stop().await;
            println!("ETCD deleted");
        }
        shutdown.cancel();
        let _ = server.await;
        stop.store(true, std::sync::atomic::Ordering::Release);
        let _ = tokio::task::spawn_blocking(move || poller.join()).await;
        prefill.log_lease_counts();
        ExitCode::SUCCESS
    })
}

#[cfg(feature = "etcd")]
type Registration = nixl_keepalive::membership::etcd::EtcdRegistration;
#[cfg(not(feature = "etcd"))]
type Registration = NoRegistration;

/// Without the `etcd` feature there is nothing to stop.
#[cfg(not(feature = "etcd"))]
pub(crate) struct NoRegistration;

#[cfg(not(feature = "etcd"))]
impl NoRegistration {
    async fn stop(self) {}
}

/// Registers in etcd with `--etcd-endpoint`, printing each change.
fn register(
    args: &PrefillArgs,
    engine: &EngineId,
    incarnation: u64,
    local: SocketAddr,
) -> Option<Registration> {
    if args.etcd_endpoint.is_empty() {
        return None;
    }
    #[cfg(feature = "etcd")]
    {
        use nixl_keepalive::membership::etcd::{EtcdOptions, EtcdRegistration, RegistrationEvent};
        use nixl_keepalive::membership::Member;
        let options = EtcdOptions::new(args.etcd_endpoint.clone(), args.etcd_prefix.clone());
        // The incarnation the side channel reports: decoders tell this
        // process's record from a predecessor's with it.
        let member = Member::new(engine.as_str(), local.to_string(), args.ranks)
            .with_incarnation(incarnation);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(e) = rx.recv().await {
                match e {
                    RegistrationEvent::Registered { key, lease } => {
                        println!("ETCD registered key={key} lease={lease}")
                    }
                    RegistrationEvent::LeaseLost { lease } => {
                        println!("ETCD lease_lost lease={lease}")
                    }
                    RegistrationEvent::Unreachable { error } => {
                        println!("ETCD unreachable error={error}")
                    }
                }
            }
        });
        Some(EtcdRegistration::start(
            options,
            member,
            Duration::from_secs(args.etcd_ttl),
            tx,
        ))
    }
    #[cfg(not(feature = "etcd"))]
    {
        let _ = (engine, incarnation, local);
        eprintln!(
            "error: --etcd-endpoint needs the `etcd` feature (built without it); not registering"
        );
        None
    }
}

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
//! `--engines N` hosts N such engines in the process (one READY line
//! each, each with its own agents, id, incarnation and side channel; one
//! polling thread for all): many real prefills on one machine, and one
//! SIGKILL that takes all of them at once.
//!
//! With `--etcd-endpoint`, it registers itself under
//! `<--etcd-prefix><engine id>` with a lease of `--etcd-ttl` seconds, kept
//! alive every TTL/3, and written again under a new lease when it finds
//! the old one expired (after a freeze, or an etcd outage longer than the
//! TTL); one stdout line per change (`ETCD registered key=.. lease=..`,
//! `ETCD lease_lost lease=..`, `ETCD unreachable error=..`, and `ETCD
//! contested key=.. owner=..` when another process holds the key: it is
//! claimed when free). A graceful
//! stop deletes the key before the side channel closes.
//!
//! `--memory vram` puts the KV cache in GPU memory (CUDA device
//! `--cuda-device`, through the driver API loaded at run time, registered
//! as NIXL `VRAM_SEG`); without a GPU and its driver it stops at once with
//! an error naming `libcuda.so.1`. `--size` allocates and registers more
//! than the blocks per rank (the rest set to a constant byte), e.g. most of
//! a GPU; then one line `PREFILL MEMORY kind=.. device=.. region_bytes=..`
//! comes before the READY line (with `free_bytes=.. total_bytes=..` for
//! VRAM, from `cuMemGetInfo` once allocated).

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use nixl_keepalive::EngineId;
use nixl_keepalive_cli::pd::prefill::{
    fresh_engine_id, spawn_shared_poller, Memory, Prefill, PrefillConfig, Role, WriteCounts,
};
use nixl_keepalive_cli::pd::wire::{MAX_BLOCK_SIZE, MAX_RANKS};
use tokio_util::sync::CancellationToken;

/// Where the KV cache (or a decode's landing slots) live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum MemoryArg {
    /// Host memory (NIXL `DRAM_SEG`).
    Dram,
    /// GPU memory of `--cuda-device` (NIXL `VRAM_SEG`; needs an NVIDIA GPU
    /// and its driver, `libcuda.so.1`).
    Vram,
}

impl MemoryArg {
    /// The memory, checked: for VRAM, the driver must load and the device
    /// exist (else the error to print, naming `libcuda.so.1`).
    pub(crate) fn resolve(self, device: i32) -> Result<Memory, String> {
        match self {
            MemoryArg::Dram => Ok(Memory::Dram),
            MemoryArg::Vram => {
                let cuda =
                    nixl_agent::cuda::Cuda::get().map_err(|e| format!("--memory vram: {e}"))?;
                if device >= cuda.device_count() {
                    return Err(format!(
                        "--memory vram: --cuda-device {device} does not exist ({} CUDA device(s) seen)",
                        cuda.device_count()
                    ));
                }
                Ok(Memory::Vram { device })
            }
        }
    }
}

/// A byte count: digits with an optional binary suffix `K`, `M`, `G`, `T`
/// (`KiB`.. too), e.g. `120G`, `65536`.
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(digits);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a byte count (digits, then K, M, G or T)"))?;
    let shift = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        _ => return Err(format!("{text:?}: unknown unit (K, M, G or T, binary)")),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// `prefill`'s flags: the block owner's, and its etcd registration.
#[derive(Debug, Args)]
pub(crate) struct PrefillArgs {
    #[command(flatten)]
    owner: OwnerArgs,

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
}

/// The flags of a process that owns KV blocks and answers handshakes for
/// them: pull mode's prefill, and push mode's decode (`decode --push`).
#[derive(Debug, Args)]
pub(crate) struct OwnerArgs {
    /// Side-channel address to answer handshakes on (`host:port`).
    #[arg(long)]
    listen: SocketAddr,

    /// Pin the engine id (default: a fresh UUID per start). With
    /// `--engines N` above 1, the engines are `<id>-0` .. `<id>-<N-1>`.
    #[arg(long)]
    engine_id: Option<String>,

    /// Engines hosted by this process, each with its own agents, engine
    /// id, incarnation, KV cache and side channel (one READY line each),
    /// polled by one shared thread: a cheap way to run many real prefill
    /// engines on one machine. With `--listen` port 0 each side channel
    /// takes a port of its own; with port P, engine k listens on P + k.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=MAX_ENGINES))]
    engines: u16,

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

    /// Where the KV cache lives: host memory, or GPU memory of
    /// `--cuda-device` (fails at once without a GPU and its driver).
    #[arg(long, value_enum, default_value = "dram")]
    memory: MemoryArg,

    /// The CUDA device of `--memory vram`.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i32).range(0..=1023))]
    cuda_device: i32,

    /// Bytes to allocate and register per rank (`120G`, `256M`, ...); at
    /// least `--blocks` × `--block-size`, which sit at its start; the rest
    /// is set to a constant byte. Default: exactly the blocks.
    #[arg(long, value_parser = parse_size)]
    size: Option<u64>,
}

/// A push-mode decode's line about the writes into it, all its engines
/// together: `writes: verified=N corrupt=N malformed=N overwritten=N
/// late=N unknown=N`
/// and `suffix` (every 5 s, and once more at stop).
fn print_writes(engines: &[Arc<Prefill>], suffix: &str) {
    let (mut sum, mut late, mut unknown) = (WriteCounts::default(), 0, 0);
    for e in engines {
        let c = e.write_counts();
        let leases = e.lease_counts();
        sum.verified += c.verified;
        sum.corrupt += c.corrupt;
        sum.malformed += c.malformed;
        sum.overwritten += c.overwritten;
        sum.bytes_after_notification += c.bytes_after_notification;
        sum.bytes_after_notification_max_us = sum
            .bytes_after_notification_max_us
            .max(c.bytes_after_notification_max_us);
        late += leases.late_reads;
        unknown += leases.unknown_reads;
    }
    println!(
        "writes: verified={} corrupt={} malformed={} overwritten={} late={late} unknown={unknown} bytes_after_notification={} max_lag_us={}{suffix}",
        sum.verified,
        sum.corrupt,
        sum.malformed,
        sum.overwritten,
        sum.bytes_after_notification,
        sum.bytes_after_notification_max_us
    );
}

/// The most engines one `prefill` process hosts (`--engines`).
const MAX_ENGINES: i64 = 1024;

/// Engine `k`'s side-channel address: `--listen` itself for one engine or
/// port 0, else its port + `k` (`None` past port 65535).
fn engine_listen(listen: SocketAddr, k: u16) -> Option<SocketAddr> {
    if listen.port() == 0 {
        return Some(listen);
    }
    let port = listen.port().checked_add(k)?;
    Some(SocketAddr::new(listen.ip(), port))
}

/// Engine `k`'s id, from `--engine-id` (or fresh).
fn engine_id(pinned: Option<&str>, engines: u16, k: u16) -> EngineId {
    match pinned {
        Some(id) if engines == 1 => EngineId::from(id),
        Some(id) => EngineId::from(format!("{id}-{k}")),
        None => fresh_engine_id(),
    }
}

pub(crate) fn run(args: PrefillArgs) -> ExitCode {
    serve_blocks(args, Role::Source)
}

/// `decode --push`: the block owner of push mode. Its blocks start zeroed,
/// prefills write them (`prefill --push`), and each write's `WR:` is
/// checked against the request's bytes; no etcd registration (a push
/// prefill takes `--decode` addresses).
pub(crate) fn run_push_decode(owner: OwnerArgs) -> ExitCode {
    let args = PrefillArgs {
        owner,
        etcd_endpoint: Vec::new(),
        etcd_prefix: nixl_keepalive::membership::DEFAULT_PREFIX.to_string(),
        etcd_ttl: 10,
    };
    serve_blocks(args, Role::Sink)
}

/// Serves blocks as `role`: until SIGINT or SIGTERM.
fn serve_blocks(mut args: PrefillArgs, role: Role) -> ExitCode {
    if !args.etcd_endpoint.is_empty() && args.owner.listen.ip().is_unspecified() {
        // The address goes into etcd for decoders to connect to.
        eprintln!(
            "error: --listen {} is not an address a decoder can connect to; with --etcd-endpoint give the host's own address",
            args.owner.listen
        );
        return ExitCode::from(2);
    }
    if engine_listen(args.owner.listen, args.owner.engines - 1).is_none() {
        eprintln!(
            "error: --engines {} from --listen {} runs past port 65535 (engine k listens on the port + k; give a lower port, or port 0)",
            args.owner.engines, args.owner.listen
        );
        return ExitCode::from(2);
    }
    // Before NIXL loads: `--memory vram` without a GPU stops here, at once.
    let memory = match args.owner.memory.resolve(args.owner.cuda_device) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let region = match args.owner.size.map(usize::try_from) {
        None => 0,
        Some(Ok(n)) => n,
        Some(Err(_)) => {
            eprintln!("error: --size does not fit this machine's address space");
            return ExitCode::from(2);
        }
    };
    super::init_tracing();
    let rt = match nixl_agent::Runtime::get() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let pinned = match args.owner.engine_id.take() {
        Some(id) if !id.is_empty() && id.len() <= 200 => Some(id),
        Some(_) => {
            eprintln!("error: --engine-id must be 1 to 200 bytes");
            return ExitCode::from(2);
        }
        None => None,
    };
    let mut prefills = Vec::with_capacity(args.owner.engines.into());
    for k in 0..args.owner.engines {
        let engine = engine_id(pinned.as_deref(), args.owner.engines, k);
        let mut config = PrefillConfig::new(engine);
        config.blocks = args.owner.blocks;
        config.block_size = args.owner.block_size as usize;
        config.ranks = args.owner.ranks;
        config.lease = Duration::from_secs(args.owner.lease_secs);
        config.max_connections = args.owner.max_connections as usize;
        config.connection_timeout = Duration::from_millis(args.owner.connection_timeout_ms);
        config.poll_interval = Duration::from_millis(args.owner.poll_ms);
        if let Some(us) = args.owner.progress_thread_us {
            config.agent.progress_thread = nixl_agent::ProgressThread::Polling {
                delay: Duration::from_micros(us),
            };
        }
        config.idle_poll_interval =
            Duration::from_millis(args.owner.idle_poll_ms.max(args.owner.poll_ms));
        config.memory = memory;
        config.region = region;
        config.role = role;
        match Prefill::start(rt, config) {
            Ok(p) => prefills.push(p),
            Err(e) => {
                eprintln!(
                    "error: cannot start the prefill agents of engine {k} of {}: {e}",
                    args.owner.engines
                );
                return ExitCode::FAILURE;
            }
        }
    }
    let kv = args.owner.blocks as usize * args.owner.block_size as usize;
    if args.owner.size.is_some() || memory != Memory::Dram {
        let mut line = format!(
            "PREFILL MEMORY kind={} region_bytes={} blocks_bytes={kv}",
            memory.kind(),
            region.max(kv)
        );
        if let Memory::Vram { device } = memory {
            line.push_str(&format!(" device={device}"));
            if let Ok(info) = nixl_agent::cuda::Cuda::get().and_then(|c| c.mem_info(device)) {
                line.push_str(&format!(
                    " free_bytes={} total_bytes={}",
                    info.free, info.total
                ));
            }
        }
        println!("{line}");
    }
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
        let mut listeners = Vec::with_capacity(prefills.len());
        for k in 0..args.owner.engines {
            let at = engine_listen(args.owner.listen, k).expect("checked above");
            match tokio::net::TcpListener::bind(at).await {
                Ok(l) => listeners.push(l),
                Err(e) => {
                    eprintln!("error: cannot listen on {at}: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let poller = spawn_shared_poller(prefills.clone(), stop.clone());
        let shutdown = CancellationToken::new();
        let mut servers = Vec::with_capacity(prefills.len());
        let mut registrations = Vec::new();
        for (prefill, listener) in prefills.iter().zip(listeners) {
            let local = listener.local_addr().map_or(args.owner.listen, |a| a);
            servers.push(tokio::spawn(prefill.clone().serve(listener, shutdown.clone())));
            let engine = prefill.engine();
            println!(
                "{} READY engine={engine} listen={local} pid={} incarnation={}",
                role.ready_word(),
                std::process::id(),
                prefill.incarnation()
            );
            tracing::info!(%engine, listen = %local, ranks = args.owner.ranks, blocks = args.owner.blocks, ?role, "ready");
            registrations.extend(register(&args, engine, prefill.incarnation(), local));
        }
        let signal = super::wait_for_signal();
        tokio::pin!(signal);
        let mut summary = tokio::time::interval(Duration::from_secs(5));
        summary.tick().await;
        loop {
            tokio::select! {
                _ = &mut signal => break,
                _ = summary.tick(), if role == Role::Sink => print_writes(&prefills, ""),
            }
        }
        tracing::info!(engines = prefills.len(), ?role, "stopping");
        // The keys go first, so decoders retire the engines before their
        // side channels close.
        if !registrations.is_empty() {
            for r in registrations {
                r.stop().await;
            }
            println!("ETCD deleted");
        }
        shutdown.cancel();
        for server in servers {
            let _ = server.await;
        }
        stop.store(true, std::sync::atomic::Ordering::Release);
        let _ = tokio::task::spawn_blocking(move || poller.join()).await;
        for prefill in &prefills {
            prefill.log_lease_counts();
        }
        if role == Role::Sink {
            print_writes(&prefills, " at=stop");
        }
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
        let member = Member::new(engine.as_str(), local.to_string(), args.owner.ranks)
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
                    RegistrationEvent::Contested { key, owner } => {
                        println!("ETCD contested key={key} owner={owner}")
                    }
                    other => println!("ETCD {other:?}"),
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

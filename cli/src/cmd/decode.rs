//! `nixl-keepalive decode`: a real decode engine on the NIXL runtime.
//!
//! Runs the keepalive service over a [`NixlTransport`] and one reader per
//! prefill (handshake, random READs with every byte checked, re-handshake
//! after a release), prints the service's events one per line, a read
//! summary every 5 s. The prefills come from `--prefill` addresses, from
//! etcd (`--etcd-endpoint`: every engine registered under the prefix;
//! removals retire the engine), or both. One HTTP server (axum) serves the
//! router's control endpoint with `--control-addr` (`POST /v1/peer_gone`,
//! `POST /fault_tolerance/event`, `GET /v1/snapshot`, `GET /metrics`: the
//! library's `nixl_keepalive::control`; see `control.rs`), and
//! `--metrics-addr` serves `/metrics` alone. Service settings come from
//! the `NIXL_KEEPALIVE_*` environment variables; UCX's from `UCX_*`.
//!
//! SIGINT or SIGTERM stops it gracefully (see `stop_gracefully`): no new
//! reads, the reads in flight end (bounded), then the service releases
//! every engine; exit 0 when none is left held.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use nixl_agent::{Agent, AgentConfig};
use nixl_keepalive::control::ControlServer;
use nixl_keepalive::log_limit::LogLimiter;
use nixl_keepalive::membership::{self, MembershipUpdate};
use nixl_keepalive::text::Escaped;
use nixl_keepalive::transport::nixl::NixlTransport;
use nixl_keepalive::ucx::settings::UcxSettings;
use nixl_keepalive::{Config, Event, Keepalive, PeerAddr};
use nixl_keepalive_cli::pd::decode::{DecodeOptions, Decoder, Direction};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::control;

/// What a membership removal does to reads in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum GoneModeArg {
    /// Let reads in flight finish, then release.
    Drain,
    /// Fail reads in flight at once, release when their guards drop.
    Fail,
}

/// `decode`'s flags: where the prefills are, and the initiator's.
#[derive(Debug, Args)]
pub(crate) struct DecodeArgs {
    /// Prefill side-channel addresses (`host:port`). Needed unless
    /// `--etcd-endpoint` is given; both may be.
    #[arg(long, num_args = 1.., required_unless_present = "etcd_endpoint")]
    prefill: Vec<String>,

    /// etcd client URL (`http://host:port`, repeatable): learn the prefills
    /// registered under `--etcd-prefix`, and retire those whose key goes.
    #[arg(long)]
    etcd_endpoint: Vec<String>,

    /// The etcd key prefix prefills register under.
    #[arg(long, default_value = membership::DEFAULT_PREFIX)]
    etcd_prefix: String,

    /// What an etcd removal does to reads in flight.
    #[arg(long, value_enum, default_value = "drain")]
    gone_mode: GoneModeArg,

    /// After etcd was reset (restarted empty, or restored: its revision
    /// went back or its cluster id changed), how long the prefills it lacks
    /// may take to register again before they are retired, in seconds. Set
    /// it to the prefills' `--etcd-ttl`.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    etcd_reset_grace: u64,

    #[command(flatten)]
    run: InitiatorArgs,

    /// Pull mode's reads, or push mode's writes (`prefill --push`, which
    /// runs this same initiator with `--decode` peers).
    #[arg(skip)]
    direction: Direction,
}

/// The flags of the process that embeds the keepalive and transfers with
/// its peers' blocks: pull mode's decode, and push mode's prefill
/// (`prefill --push`).
#[derive(Debug, Args)]
pub(crate) struct InitiatorArgs {
    /// Serve the control endpoint (`POST /v1/peer_gone`, `GET
    /// /v1/snapshot`) and `/metrics` here. Loopback unless
    /// `--control-token-file` is given.
    #[arg(long)]
    control_addr: Option<SocketAddr>,

    /// A file holding the bearer token every POST (and, on a non-loopback
    /// bind, every request, `/metrics` included) to the control endpoint
    /// must carry; also what `/metrics` on a non-loopback `--metrics-addr`
    /// asks for.
    #[arg(long)]
    control_token_file: Option<PathBuf>,

    /// Serve Prometheus metrics on this address (`/metrics`). Not
    /// loopback: every scrape needs the token of `--control-token-file`,
    /// unless `--metrics-public`.
    #[arg(long)]
    metrics_addr: Option<SocketAddr>,

    /// Serve `--metrics-addr` to anyone who can reach it, without a token
    /// (it says so at start-up). Metrics only: never the control routes.
    #[arg(long, requires = "metrics_addr")]
    metrics_public: bool,

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

    /// Where the landing slots live: host memory, or GPU memory of
    /// `--cuda-device` (fails at once without a GPU and its driver). With
    /// `vram` the prefills' KV caches are taken to be VRAM of that same
    /// device (`prefill --memory vram`): the handshake does not say.
    #[arg(long, value_enum, default_value = "dram")]
    memory: super::prefill::MemoryArg,

    /// The CUDA device of `--memory vram`.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i32).range(0..=1023))]
    cuda_device: i32,

    /// Leave each read's bytes unchecked (counted as
    /// `nixl_keepalive_pd_reads_total{outcome="unchecked"}`): for timing
    /// the reads alone (the GPU check's cost table), since checking a VRAM
    /// slot copies it back to the host.
    #[arg(long)]
    no_check: bool,
}

/// `prefill --push`'s flags: the decodes to write into, and the
/// initiator's.
#[derive(Debug, Args)]
pub(crate) struct PushPrefillArgs {
    /// Push-mode decode side-channel addresses (`host:port`), each a
    /// `decode --push`: this prefill loads their metadata, keeps them
    /// alive and writes their blocks.
    #[arg(long, num_args = 1.., required = true)]
    decode: Vec<String>,

    #[command(flatten)]
    run: InitiatorArgs,
}

/// One reader per prefill address.
struct Reader {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    /// From `--prefill`: kept whatever etcd says.
    pinned: bool,
}

pub(crate) fn run(args: DecodeArgs) -> ExitCode {
    start_or_refuse(args)
}

/// `prefill --push`: the same initiator, writing into `--decode` peers
/// (push mode: the keepalive embedded in the prefill for every decode it
/// writes to).
pub(crate) fn run_push_prefill(args: PushPrefillArgs) -> ExitCode {
    start_or_refuse(DecodeArgs {
        prefill: args.decode,
        etcd_endpoint: Vec::new(),
        etcd_prefix: membership::DEFAULT_PREFIX.to_string(),
        gone_mode: GoneModeArg::Drain,
        etcd_reset_grace: 10,
        run: args.run,
        direction: Direction::Write,
    })
}

fn start_or_refuse(args: DecodeArgs) -> ExitCode {
    match start_and_run(args) {
        Ok(code) => code,
        Err(refused) => {
            eprintln!("error: {}", refused.message);
            refused.code
        }
    }
}

/// Why `decode` stopped before it ran: printed as `error: ...` with its
/// exit code (2: a bad flag or value, nothing started; 1: a start-up step
/// failed).
struct Refused {
    code: ExitCode,
    message: String,
}

impl Refused {
    fn usage(message: impl std::fmt::Display) -> Self {
        Refused {
            code: ExitCode::from(2),
            message: message.to_string(),
        }
    }

    fn failed(message: impl std::fmt::Display) -> Self {
        Refused {
            code: ExitCode::FAILURE,
            message: message.to_string(),
        }
    }
}

/// The steps, in order: check what was asked, load NIXL, then serve
/// until a signal and stop.
fn start_and_run(args: DecodeArgs) -> Result<ExitCode, Refused> {
    let checked = check(&args)?;
    // The progress thread outlives the runtime (dropped after it).
    let (nixl, _progress) = load_nixl(&args)?;
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.worker_threads(2).enable_all();
    if let nixl_keepalive_cli::pd::prefill::Memory::Vram { device } = checked.memory {
        // Every thread that may call NIXL (workers, the blocking pool) with
        // the device's context current, as a framework's threads have it:
        // UCX's CUDA transports ask for it (`Cuda::make_current`).
        builder.on_thread_start(move || {
            if let Ok(cuda) = nixl_agent::cuda::Cuda::get() {
                if let Err(e) = cuda.make_current(device) {
                    tracing::warn!(device, error = %e, "cannot make the CUDA context current on a runtime thread");
                }
            }
        });
    }
    let runtime = builder
        .build()
        .map_err(|e| Refused::failed(format!("cannot start the tokio runtime: {e}")))?;
    runtime.block_on(serve(args, checked, nixl))
}

/// What the flags and the environment say, checked before anything
/// starts or loads: a bad value stops here.
struct Checked {
    config: Config,
    servers: Vec<control::Server>,
    memory: nixl_keepalive_cli::pd::prefill::Memory,
}

fn check(args: &DecodeArgs) -> Result<Checked, Refused> {
    let config = Config::from_env().map_err(Refused::usage)?;
    if args.run.control_token_file.is_some()
        && args.run.control_addr.is_none()
        && args.run.metrics_addr.is_none()
    {
        return Err(Refused::usage(
            "--control-token-file needs --control-addr or --metrics-addr",
        ));
    }
    let servers = control::servers(
        args.run.control_addr,
        args.run.control_token_file.as_deref(),
        args.run.metrics_addr,
        args.run.metrics_public,
    )
    .map_err(Refused::usage)?;
    // Before NIXL loads: `--memory vram` without a GPU stops here, at once.
    let memory = args
        .run
        .memory
        .resolve(args.run.cuda_device)
        .map_err(Refused::usage)?;
    Ok(Checked {
        config,
        servers,
        memory,
    })
}

/// NIXL loaded, UCX's settings read from it, the metrics recorder and the
/// decode agent with its transport (its progress thread beside it).
struct Nixl {
    ucx_settings: UcxSettings,
    metrics: Option<PrometheusHandle>,
    name: String,
    transport: Arc<NixlTransport>,
}

fn load_nixl(
    args: &DecodeArgs,
) -> Result<(Nixl, nixl_keepalive::transport::nixl::ProgressPoller), Refused> {
    super::init_tracing();
    let rt = nixl_agent::Runtime::get().map_err(Refused::usage)?;
    // After NIXL is loaded, so UCX's settings are read from NIXL's own UCX.
    // A bad UCX_* value stops here too.
    let ucx_settings = UcxSettings::read().map_err(Refused::usage)?;
    let metrics =
        if args.run.metrics_addr.is_some() || args.run.control_addr.is_some() {
            Some(PrometheusBuilder::new().install_recorder().map_err(|e| {
                Refused::failed(format!("cannot install the metrics recorder: {e}"))
            })?)
        } else {
            None
        };
    let name = format!(
        "{}-{}-{}",
        role_word(args.direction),
        std::process::id(),
        rand::random::<u32>()
    );
    let agent = Agent::new(rt, &name, &AgentConfig::default())
        .map_err(|e| Refused::failed(format!("cannot create the decode agent: {e}")))?;
    let transport = Arc::new(NixlTransport::new(agent));
    let progress = transport.spawn_progress(Duration::from_millis(args.run.progress_ms));
    Ok((
        Nixl {
            ucx_settings,
            metrics,
            name,
            transport,
        },
        progress,
    ))
}

/// The service, its HTTP servers, the readers and the membership, until a
/// signal; then the graceful stop. Its exit code.
async fn serve(args: DecodeArgs, checked: Checked, nixl: Nixl) -> Result<ExitCode, Refused> {
    let Checked {
        config,
        servers,
        memory,
    } = checked;
    let shutdown = CancellationToken::new();
    println!(
        "{} agent {}; service: {config}",
        role_word(args.direction),
        nixl.name
    );
    let (service, keepalive) = Keepalive::new(nixl.transport.clone(), config);
    if let Some(handle) = &nixl.metrics {
        spawn_upkeep(handle.clone(), shutdown.clone());
    }
    for server in servers {
        serve_http(&args, server, &keepalive, &nixl, &shutdown).await?;
    }
    // Its start-up line (stderr) gives the detection bound.
    let task = tokio::spawn(
        service
            .with_ucx_settings(&nixl.ucx_settings)
            .run(shutdown.clone()),
    );
    let mut events = keepalive.subscribe();
    let mut quiet = TransientLog::standard();
    let options = DecodeOptions {
        reads_in_flight: args.run.reads as usize,
        read_pause: Duration::from_millis(args.run.read_pause_ms),
        probe_interval: Duration::from_millis(args.run.probe_ms),
        memory,
        direction: args.direction,
        check: !args.run.no_check,
        ..DecodeOptions::default()
    };
    // Readers stop on their own token, before the service's: see
    // `stop_gracefully`.
    let reading = CancellationToken::new();
    let reader_drain = options.read_timeout + options.handshake_timeout * 2;
    let decoder = Decoder::new(keepalive.clone(), nixl.transport.clone(), options);
    let mut readers: HashMap<PeerAddr, Reader> = HashMap::new();
    let prefills = resolve_prefills(&args.prefill, peers_flag(args.direction))
        .await
        .map_err(Refused::usage)?;
    for address in prefills {
        let stop = reading.child_token();
        let task = decoder.spawn(address.clone(), stop.clone());
        readers.insert(
            address,
            Reader {
                stop,
                task,
                pinned: true,
            },
        );
    }
    let mut members = Members::default();
    let mut updates = start_membership(&args, &keepalive, &shutdown);
    let mut summary = tokio::time::interval(Duration::from_secs(5));
    summary.tick().await;
    let signal = super::wait_for_signal();
    tokio::pin!(signal);
    loop {
        tokio::select! {
            _ = &mut signal => break,
            event = events.recv() => match event {
                Ok(e) => print_event(&e, &mut quiet),
                Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => println!("event: ({n} events missed)"),
                Err(_) => break,
            },
            Some(update) = next_update(&mut updates) => {
                print_update(&update);
                follow_membership(&update, &decoder, &mut readers, &mut members, &reading).await;
            }
            _ = summary.tick() => {
                print_untold(&mut quiet);
                print_reads(&decoder, "");
            }
        }
    }
    println!("{} stopping", role_word(args.direction));
    let readers = readers.into_values().map(|r| r.task).collect();
    let code = stop_gracefully(reading, readers, reader_drain, shutdown, task).await;
    // The readers have stopped (or were given up on): reads since the
    // last 5 s line are counted here, or never told.
    print_untold(&mut quiet);
    print_reads(&decoder, " at=stop");
    // The releases of the stop itself, sent before the task returned.
    loop {
        match events.try_recv() {
            Ok(e) => print_event(&e, &mut quiet),
            Err(tokio::sync::broadcast::error::TryRecvError::Lagged(n)) => {
                println!("event: ({n} events missed)")
            }
            Err(_) => break,
        }
    }
    if code == ExitCode::SUCCESS {
        println!(
            "{} stopped: every engine released",
            role_word(args.direction)
        );
    }
    Ok(code)
}

/// One HTTP server (the library's): the control endpoint (with
/// `/metrics`) when `control`, else `/metrics` alone, until `shutdown`.
async fn serve_http(
    args: &DecodeArgs,
    (control, config): control::Server,
    keepalive: &nixl_keepalive::KeepaliveHandle<nixl_keepalive::transport::nixl::RemoteDlists>,
    nixl: &Nixl,
    shutdown: &CancellationToken,
) -> Result<(), Refused> {
    let config = match nixl.metrics.clone() {
        Some(handle) => config.metrics(Arc::new(move || handle.render())),
        None => config,
    };
    let server = ControlServer::bind(config).await.map_err(Refused::failed)?;
    let local = server.local_addr();
    let what = if control {
        println!("control on http://{local}/v1/ (and /metrics)");
        "control"
    } else {
        if args.run.metrics_public && !local.ip().is_loopback() {
            println!(
                "metrics on http://{local}/metrics (public: no token asked, --metrics-public)"
            );
        } else {
            println!("metrics on http://{local}/metrics");
        }
        "metrics"
    };
    tracing::info!(%local, what, "HTTP server listening");
    tokio::spawn(server.run(keepalive.clone(), shutdown.clone()));
    Ok(())
}

/// The read summary line, `reads: verified=N corrupt=N failed=N
/// abandoned=N refused=N handshakes=N` and `suffix`: every 5 s, and once
/// more at stop (` at=stop`), so that the reads after the last periodic
/// line are reported too.
fn print_reads(decoder: &Decoder, suffix: &str) {
    let s = decoder.stats();
    if decoder.direction() == Direction::Write {
        // Push mode: the decode checks the bytes (its own `writes:` line).
        println!(
            "writes: written={} failed={} abandoned={} refused={} handshakes={}{suffix}",
            s.written.load(Ordering::Relaxed),
            s.failed.load(Ordering::Relaxed),
            s.abandoned.load(Ordering::Relaxed),
            s.refused.load(Ordering::Relaxed),
            s.handshakes.load(Ordering::Relaxed),
        );
        return;
    }
    println!(
        "reads: verified={} corrupt={} failed={} abandoned={} refused={} handshakes={}{suffix}",
        s.verified.load(Ordering::Relaxed),
        s.corrupt.load(Ordering::Relaxed),
        s.failed.load(Ordering::Relaxed),
        s.abandoned.load(Ordering::Relaxed),
        s.refused.load(Ordering::Relaxed),
        s.handshakes.load(Ordering::Relaxed),
    );
}

/// Starts the etcd watch and the membership driver, with `--etcd-endpoint`.
fn start_membership(
    args: &DecodeArgs,
    keepalive: &nixl_keepalive::KeepaliveHandle<nixl_keepalive::transport::nixl::RemoteDlists>,
    shutdown: &CancellationToken,
) -> Option<mpsc::UnboundedReceiver<MembershipUpdate>> {
    if args.etcd_endpoint.is_empty() {
        return None;
    }
    #[cfg(feature = "etcd")]
    {
        use nixl_keepalive::membership::etcd::{EtcdOptions, EtcdSource};
        use nixl_keepalive::membership::MembershipConfig;
        use nixl_keepalive::GoneMode;
        let options = EtcdOptions::new(args.etcd_endpoint.clone(), args.etcd_prefix.clone());
        let source = EtcdSource::spawn(options, shutdown.clone());
        let gone_mode = match args.gone_mode {
            GoneModeArg::Drain => GoneMode::Drain,
            GoneModeArg::Fail => GoneMode::Fail,
        };
        println!(
            "membership: watching etcd {:?} prefix {} (removal: {:?})",
            args.etcd_endpoint, args.etcd_prefix, gone_mode
        );
        let (updates, _task) = membership::spawn(
            source,
            keepalive.clone(),
            {
                let mut config = MembershipConfig::default();
                config.gone_mode = gone_mode;
                config.reset_grace = Duration::from_secs(args.etcd_reset_grace);
                config
            },
            shutdown.clone(),
        );
        Some(updates)
    }
    #[cfg(not(feature = "etcd"))]
    {
        let _ = (keepalive, shutdown);
        eprintln!(
            "error: --etcd-endpoint needs the `etcd` feature (built without it); ignoring it"
        );
        None
    }
}

async fn next_update(
    updates: &mut Option<mpsc::UnboundedReceiver<MembershipUpdate>>,
) -> Option<MembershipUpdate> {
    match updates {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// The flag that names the peers: `--prefill`, or `--decode` for `prefill
/// --push`.
fn peers_flag(direction: Direction) -> &'static str {
    match direction {
        Direction::Read => "--prefill",
        Direction::Write => "--decode",
    }
}

/// This process's role in its lines: `decode`, or `prefill` for `prefill
/// --push`.
fn role_word(direction: Direction) -> &'static str {
    match direction {
        Direction::Read => "decode",
        Direction::Write => "prefill",
    }
}

/// Resolves the `--prefill` addresses to the one address each names
/// ([`PeerAddr::resolve`]), so that aliases of one prefill
/// (`localhost:p`, `127.0.0.1:p`) and duplicates get one reader, with one
/// warning per duplicate. A name that does not resolve, or resolves to
/// several addresses, stops start-up with an error that says so.
async fn resolve_prefills(args: &[String], flag: &str) -> Result<Vec<PeerAddr>, String> {
    let mut seen: Vec<(PeerAddr, &str)> = Vec::new();
    for a in args {
        let address = PeerAddr::resolve(a)
            .await
            .map_err(|e| format!("{flag} {e}"))?;
        match seen.iter().find(|(s, _)| *s == address) {
            Some((_, first)) => {
                tracing::warn!(first = %Escaped(first), again = %Escaped(a), %address, "{flag} names one peer twice: one reader");
                println!(
                    "warning: {flag} {} and {} are one peer ({address}): one reader",
                    Escaped(first),
                    Escaped(a)
                );
            }
            None => seen.push((address, a)),
        }
    }
    Ok(seen.into_iter().map(|(a, _)| a).collect())
}

/// Membership records per resolved address: a reader that membership
/// started stops only when no record names its address any more (a dead
/// predecessor's record expiring after its successor registered at the
/// same address must not stop the successor's reader).
#[derive(Default)]
struct Members {
    /// Record -> the address it named, resolved when it joined.
    by_key: HashMap<(String, Option<u64>, String), PeerAddr>,
}

impl Members {
    fn count_at(&self, address: &PeerAddr) -> usize {
        self.by_key.values().filter(|a| *a == address).count()
    }
}

/// A joined engine gets a reader (unless its address has one); a left
/// engine's reader stops when no record names its address any more
/// (unless `--prefill` named it). Its NIXL state is released by the
/// service (after its own arbitration), not here.
async fn follow_membership(
    update: &MembershipUpdate,
    decoder: &Arc<Decoder>,
    readers: &mut HashMap<PeerAddr, Reader>,
    members: &mut Members,
    reading: &CancellationToken,
) {
    match update {
        MembershipUpdate::Joined(member) => {
            let address = match PeerAddr::resolve(&member.address).await {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(engine = %Escaped(&member.engine_id), error = %e, "membership: joined engine's address not usable: no reader");
                    return;
                }
            };
            members.by_key.insert(member_key(member), address.clone());
            if let Some(r) = readers.get(&address) {
                if !r.task.is_finished() {
                    return;
                }
            }
            let stop = reading.child_token();
            let task = decoder.spawn(address.clone(), stop.clone());
            readers.insert(
                address,
                Reader {
                    stop,
                    task,
                    pinned: false,
                },
            );
        }
        MembershipUpdate::Left { member, .. } => {
            let Some(address) = members.by_key.remove(&member_key(member)) else {
                return;
            };
            if members.count_at(&address) > 0 {
                return;
            }
            if readers.get(&address).is_some_and(|r| !r.pinned) {
                let r = readers.remove(&address).expect("checked");
                r.stop.cancel();
            }
        }
        _ => {}
    }
}

/// A record as the reader bookkeeping tracks it: what it says (engine id,
/// incarnation, address). Two keys saying exactly the same are one record
/// (membership retires neither while the other stays).
fn member_key(member: &membership::Member) -> (String, Option<u64>, String) {
    (
        member.engine_id.clone(),
        member.incarnation,
        member.address.clone(),
    )
}

/// One line per membership update: `membership: <kind> key=value ...`.
fn print_update(update: &MembershipUpdate) {
    match update {
        MembershipUpdate::Joined(m) => println!(
            "membership: joined engine={} address={} ranks={}",
            Escaped(&m.engine_id),
            Escaped(&m.address),
            m.ranks
        ),
        MembershipUpdate::Left { member, why } => println!(
            "membership: left engine={} address={} why={}",
            Escaped(&member.engine_id),
            Escaped(&member.address),
            why.as_str()
        ),
        MembershipUpdate::BadValue {
            key,
            error,
            unreported,
        } => println!(
            "membership: bad_value key={} reason={} unreported={unreported} error={error}",
            Escaped(key),
            error.reason()
        ),
        MembershipUpdate::StoreReset { awaited, grace } => println!(
            "membership: store_reset awaited={awaited} grace_ms={}",
            grace.as_millis()
        ),
        MembershipUpdate::Outage { error } => println!("membership: outage error={error}"),
        MembershipUpdate::Restored { outage } => {
            println!("membership: restored outage_ms={}", outage.as_millis())
        }
        MembershipUpdate::Released {
            engine,
            after,
            reason,
        } => println!(
            "membership: released engine={engine} after_ms={} reason={}",
            after.as_millis(),
            reason.as_str()
        ),
        // An update this build does not know yet: still one line.
        other => println!("membership: {other:?}"),
    }
}

/// The Prometheus recorder's periodic upkeep (histogram buckets).
fn spawn_upkeep(handle: PrometheusHandle, shutdown: CancellationToken) {
    tokio::spawn(async move {
        let mut t = tokio::time::interval(Duration::from_secs(5));
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = t.tick() => handle.run_upkeep(),
            }
        }
    });
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
        nixl_keepalive::Stopped<nixl_keepalive::transport::nixl::RemoteDlists>,
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

/// Repeated `transient_error` events, by engine, raw status and source.
type TransientLog = LogLimiter<(nixl_keepalive::EngineId, i32, nixl_keepalive::Source)>;

/// What a burst of `transient_error` events left untold, once its period
/// is over: `event: transient_error ... suppressed=N` (`N` more like it).
fn print_untold(quiet: &mut TransientLog) {
    for ((engine, raw, source), n) in quiet.flush(tokio::time::Instant::now()) {
        let status = nixl_keepalive::NixlStatus::from_raw(raw);
        println!(
            "event: transient_error engine={engine} status={status} source={source} suppressed={n}"
        );
    }
}

/// One line per event, greppable: `event: ` and the event's own text
/// (`<kind> key=value ...`, its `Display`); repeated `transient_error`s
/// are summarised (`quiet`).
fn print_event(event: &Event, quiet: &mut TransientLog) {
    if let Event::TransientError {
        engine,
        status,
        source,
        ..
    } = event
    {
        // One line per engine, status and source per period, with the
        // count it stands for (a broken prefill once printed 1,235 of
        // these in 16 s); the rest at the next summary.
        let key = (engine.clone(), status.raw(), *source);
        if let Some(suppressed) = quiet.admit(key, tokio::time::Instant::now()) {
            println!("event: {event} suppressed={suppressed}");
        }
        return;
    }
    println!("event: {event}");
}

//! A prefill engine on the real runtime: one NIXL agent per rank, each
//! with a DRAM "KV cache" filled with the known pattern, a side channel
//! that answers handshakes, and a loop that serves peers' READs and keeps
//! request leases with vLLM's rules ([`super::lease`]): `RQ:` schedules a
//! request, `HB:` extends, `RD:` completes, and a lease that runs out
//! frees the request's blocks (logged; a read completed after that is
//! logged as an error and counted).
//!
//! # The other way round: a push-mode decode
//!
//! The same server is the decode of push mode ([`Role::Sink`], `decode
//! --push`): it owns the blocks (zeroed, not filled), answers the same
//! handshake, and a prefill WRITEs into them. The lease rules are the same
//! table with the roles swapped: `RQ:<request>` from the writing prefill
//! (`RQ:<request>:<rank>:<block>`: the block the write goes to) reserves
//! the decode's block for the request, the prefill's keepalive `HB:`
//! (naming its requests whose writes are pending) renews the lease, and
//! `WR:<request>:<rank>:<block>`, sent by NIXL to the decode once the
//! write's bytes are in its memory, completes the request: the decode
//! checks the block against [`pattern::write_seed`] and frees the lease.
//! A block reserved again by a newer request before the older one's `WR:`
//! is handled is not checked (the newer write may be landing in it) and
//! is counted as `overwritten`: the test prefill picks blocks itself, so
//! it can reuse one sooner than a real decode, which frees a block only
//! once its request completed.
//! A `WR:` after the lease ran out is a write into blocks the decode had
//! given back (a late write: logged as an error and counted).
//!
//! # Progress
//!
//! The agents run without NIXL's progress thread. One thread of ours polls
//! every rank's notifications: that both progresses UCX (a peer's READ
//! completes only while the target's worker progresses) and delivers the
//! `HB:` notifications the prefill must see anyway. It polls every
//! [`PrefillConfig::poll_interval`] (1 ms) while notifications arrive (each
//! completed READ sends one), and backs off to
//! [`PrefillConfig::idle_poll_interval`] (10 ms) when idle. One thread for
//! all ranks, asleep between polls, suits a small (2-core CI) box better
//! than a NIXL progress thread per agent (measured on 1.5.1: 3.7% of a core
//! for two agents at 1 ms; our poller at a fixed 1 ms: 3.5% for two ranks,
//! idle). A READ posted to an idle prefill may wait one idle interval.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nixl_agent::cuda::{CudaError, DeviceMemory, VramRegistration};
use nixl_agent::{Agent, AgentConfig, DramRegistration, NixlError, Runtime};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::lease::{LeaseCounts, Leases, ReadDone};
use super::pattern;
use super::wire::{self, HandshakeReply, RankInfo};
use nixl_keepalive::log_limit::LogLimiter;
use nixl_keepalive::EngineId;

/// Rounds of `getNotifs` before a lease sweep while notifications keep
/// arriving: what arrived before the sweep is handled first, and a steady
/// stream cannot hold sweeps off for long.
const SWEEP_DRAIN_ROUNDS: usize = 16;

/// Where a prefill's KV cache (and a decoder's landing slots) live.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Memory {
    /// Host memory, registered as NIXL `DRAM_SEG`.
    #[default]
    Dram,
    /// GPU memory of CUDA device `device` (`cuMemAlloc`, through
    /// [`nixl_agent::cuda`]), registered as `VRAM_SEG` under that device id.
    Vram {
        /// The CUDA device ordinal.
        device: i32,
    },
}

impl Memory {
    /// `dram` or `vram`.
    pub fn kind(self) -> &'static str {
        match self {
            Memory::Dram => "dram",
            Memory::Vram { .. } => "vram",
        }
    }
}

/// The byte the part of a rank's region past its blocks is set to (see
/// [`PrefillConfig::region`]).
pub const REGION_FILLER: u8 = 0x5a;

/// Which way a block owner's bytes go.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Role {
    /// Pull mode's prefill: blocks filled with the pattern, read by
    /// decodes (`RD:` completes a request).
    #[default]
    Source,
    /// Push mode's decode: blocks zeroed, written by prefills (`WR:`
    /// completes a request, its bytes checked).
    Sink,
}

impl Role {
    /// The word of the ready line: `PREFILL` or `DECODE`.
    pub fn ready_word(self) -> &'static str {
        match self {
            Role::Source => "PREFILL",
            Role::Sink => "DECODE",
        }
    }
}

/// Why a prefill did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// NIXL refused an agent, a registration or the metadata.
    #[error(transparent)]
    Nixl(#[from] NixlError),
    /// GPU memory could not be had (no driver or GPU, out of memory).
    #[error("GPU memory for rank {rank}: {source}")]
    Cuda {
        /// The rank.
        rank: u16,
        /// The driver's error.
        source: CudaError,
    },
}

/// How to start a prefill engine.
#[derive(Clone, Debug)]
pub struct PrefillConfig {
    /// The engine id (a fresh one per start unless pinned).
    pub engine: EngineId,
    /// Blocks per rank.
    pub blocks: u32,
    /// Bytes per block.
    pub block_size: usize,
    /// Ranks (one agent each).
    pub ranks: u16,
    /// How long a request's KV blocks are kept without a renewal (vLLM: 30 s).
    pub lease: Duration,
    /// How often the agents are polled while notifications arrive.
    pub poll_interval: Duration,
    /// The longest pause between polls while idle.
    pub idle_poll_interval: Duration,
    /// The agents' configuration.
    pub agent: AgentConfig,
    /// Side-channel connections handled at once (see [`Prefill::serve`]).
    pub max_connections: usize,
    /// How long one side-channel connection may take, from accept to the
    /// reply written.
    pub connection_timeout: Duration,
    /// Where the KV cache lives.
    pub memory: Memory,
    /// Bytes allocated and registered per rank; at least `blocks ×
    /// block_size` (0: exactly that). The blocks are at its start, filled
    /// with the pattern; the rest is set to [`REGION_FILLER`] (so it is
    /// really there: resident, for DRAM).
    pub region: usize,
    /// Pull mode's prefill or push mode's decode.
    pub role: Role,
}

impl PrefillConfig {
    /// Defaults for `engine`: 16 blocks of 64 KiB, one rank, 30 s leases,
    /// polling every 1 ms when busy and 10 ms when idle, no NIXL progress
    /// thread, at most 64 side-channel connections of at most 2 s each.
    pub fn new(engine: EngineId) -> Self {
        PrefillConfig {
            engine,
            blocks: 16,
            block_size: 64 << 10,
            ranks: 1,
            lease: Duration::from_secs(30),
            poll_interval: Duration::from_millis(1),
            idle_poll_interval: Duration::from_millis(10),
            agent: AgentConfig::default(),
            max_connections: 64,
            connection_timeout: Duration::from_secs(2),
            memory: Memory::Dram,
            region: 0,
            role: Role::Source,
        }
    }
}

/// A fresh engine id, UUID-shaped (random v4 layout).
pub fn fresh_engine_id() -> EngineId {
    let a: u128 = rand::random();
    let a = (a & !(0xf << 76) | (0x4 << 76)) & !(0x3 << 62) | (0x2 << 62);
    let h = format!("{a:032x}");
    EngineId::new(format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    ))
}

/// The NIXL agent name of `rank` of `engine`: unique per engine and rank,
/// and the same again when a pinned id restarts.
pub fn agent_name(engine: &EngineId, rank: u16) -> String {
    format!("{engine}-rank{rank}")
}

struct Rank {
    agent: Agent,
    memory: RankMemory,
}

/// A rank's registered KV cache (deregistered, then freed, on drop).
enum RankMemory {
    Dram(DramRegistration),
    Vram(VramRegistration),
}

impl RankMemory {
    /// The first byte of block `block` (of `size` bytes) that differs from
    /// the pattern of `seed` for `rank` (GPU memory is copied back first; a
    /// failed copy is a mismatch at 0, logged).
    fn block_mismatch(&self, block: u32, size: usize, seed: u64, rank: u16) -> Option<usize> {
        let at = block as usize * size;
        match self {
            RankMemory::Dram(m) => {
                pattern::first_mismatch(&m.bytes()[at..at + size], seed, rank, block)
            }
            RankMemory::Vram(m) => {
                let mut host = vec![0u8; size];
                if let Err(e) = m.memory().read(at, &mut host) {
                    tracing::error!(error = %e, "cannot copy a written GPU block back to check it");
                    return Some(0);
                }
                pattern::first_mismatch(&host, seed, rank, block)
            }
        }
    }
}

/// Counters of what the prefill saw.
#[derive(Debug, Default)]
pub struct PrefillStats {
    /// `HB:` notifications received.
    pub heartbeats: AtomicU64,
    /// `RD:` (read done) notifications received.
    pub reads_done: AtomicU64,
    /// Other notifications.
    pub other: AtomicU64,
    /// `WR:` notifications whose block held the request's bytes (push).
    pub writes_verified: AtomicU64,
    /// `WR:` notifications whose block did not (push): the write landed
    /// elsewhere, not at all, or another request's write overwrote it.
    pub writes_corrupt: AtomicU64,
    /// `RQ:` and `WR:` notifications that named no block of this engine.
    pub writes_malformed: AtomicU64,
    /// `WR:` notifications whose block a newer request had reserved by
    /// the time they were handled: not checked (the newer write may be
    /// landing).
    pub writes_overwritten: AtomicU64,
    /// Writes verified only after their `WR:` was handled.
    pub bytes_after_notification: AtomicU64,
    /// The longest lag of those, in microseconds.
    pub bytes_after_notification_max_us: AtomicU64,
    /// Handshakes answered.
    pub handshakes: AtomicU64,
    /// Bad side-channel requests refused.
    pub bad_requests: AtomicU64,
    /// Side-channel connections closed unanswered (busy, evicted, I/O
    /// error, early EOF, timeout).
    pub dropped: AtomicU64,
}

/// How long a written block's bytes may come after its `WR:` before the
/// write counts as corrupt (see [`Prefill::recheck`]). With NIXL 1.5.1
/// over loopback none came after it in our runs (the count stays 0): a
/// `WR:` found its bytes, or a newer write's.
pub const BYTES_AFTER_NOTIFICATION: Duration = Duration::from_secs(1);

/// `<request>:<rank>:<block>` of a push-mode notification from a peer:
/// the request and the block, when the rank is `rank`, the block one of
/// the engine's `blocks` and the request not empty; anything else is
/// `None` (the caller counts it as malformed).
fn named_block(text: &str, rank: u16, blocks: u32) -> Option<(&str, u32)> {
    match text.rsplitn(3, ':').collect::<Vec<_>>().as_slice() {
        [block, r, id] if !id.is_empty() => match (r.parse::<u16>(), block.parse::<u32>()) {
            (Ok(r), Ok(b)) if r == rank && b < blocks => Some((*id, b)),
            _ => None,
        },
        _ => None,
    }
}

/// A written block checked again (see [`Prefill::recheck`]).
struct PendingCheck {
    rank: u16,
    block: u32,
    request: String,
    seed: u64,
    /// When its `WR:` was handled.
    since: Instant,
    /// Checked at least once already (its bytes were not there yet).
    again: bool,
}

/// What the writes into a push-mode decode came to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteCounts {
    /// Checked: the block held the request's bytes.
    pub verified: u64,
    /// Checked: it did not.
    pub corrupt: u64,
    /// `RQ:` or `WR:` naming no block of this engine.
    pub malformed: u64,
    /// Not checked: the block was reserved again first.
    pub overwritten: u64,
    /// Verified, but only after their `WR:` was handled (the bytes came
    /// after the notification).
    pub bytes_after_notification: u64,
    /// The longest such lag, in microseconds.
    pub bytes_after_notification_max_us: u64,
}

/// A running prefill engine. See the module docs.
pub struct Prefill {
    config: PrefillConfig,
    ranks: Vec<Rank>,
    reply: Vec<u8>,
    incarnation: u64,
    leases: Mutex<Leases>,
    stats: PrefillStats,
    /// Lines about connections closed unanswered: one per client address
    /// (host and port: two clients on one host are two peers) and reason
    /// per period, within the process's log budget.
    drop_log: Mutex<LogLimiter<(SocketAddr, &'static str)>>,
    /// Push mode: written blocks whose bytes were not all there at their
    /// `WR:`, checked again at each poll ([`Prefill::recheck`]).
    pending_checks: Mutex<Vec<PendingCheck>>,
    /// Push mode: the request each written block was last reserved for
    /// (`RQ:<request>:<rank>:<block>`), so that a `WR:` is checked only
    /// while its block is still its own.
    reserved: Mutex<HashMap<(u16, u32), String>>,
}

impl Prefill {
    /// Creates the agents, allocates, fills and registers their memory
    /// ([`PrefillConfig::memory`], [`PrefillConfig::region`]).
    pub fn start(rt: &'static Runtime, config: PrefillConfig) -> Result<Arc<Prefill>, StartError> {
        let seed = pattern::seed(config.engine.as_str());
        let bs = config.block_size;
        let kv = config.blocks as usize * bs;
        let region = config.region.max(kv);
        let mut ranks = Vec::with_capacity(config.ranks as usize);
        let mut infos = Vec::with_capacity(config.ranks as usize);
        for r in 0..config.ranks {
            let agent = Agent::new(rt, &agent_name(&config.engine, r), &config.agent)?;
            let (memory, base) = match config.memory {
                Memory::Dram => {
                    let mut memory = agent.register_dram(region)?;
                    let bytes = memory.bytes_mut();
                    for (b, chunk) in bytes[..kv].chunks_mut(bs).enumerate() {
                        match config.role {
                            Role::Source => pattern::fill(chunk, seed, r, b as u32),
                            Role::Sink => chunk.fill(0),
                        }
                    }
                    bytes[kv..].fill(REGION_FILLER);
                    let base = memory.desc().addr;
                    (RankMemory::Dram(memory), base)
                }
                Memory::Vram { device } => {
                    let cuda = |source| StartError::Cuda { rank: r, source };
                    let memory = DeviceMemory::alloc(device, region).map_err(cuda)?;
                    let mut block = vec![0u8; bs];
                    for b in 0..config.blocks {
                        if config.role == Role::Source {
                            pattern::fill(&mut block, seed, r, b);
                        }
                        memory.write(b as usize * bs, &block).map_err(cuda)?;
                    }
                    if region > kv {
                        memory.fill(kv, region - kv, REGION_FILLER).map_err(cuda)?;
                    }
                    let memory = agent.register_vram(memory)?;
                    let base = memory.desc().addr;
                    (RankMemory::Vram(memory), base)
                }
            };
            infos.push(RankInfo {
                agent: agent.name().to_string(),
                base,
                metadata: agent.local_metadata()?,
            });
            ranks.push(Rank { agent, memory });
        }
        let incarnation = rand::random();
        let reply = wire::encode_reply(&HandshakeReply {
            engine: config.engine.to_string(),
            incarnation,
            block_size: config.block_size as u64,
            blocks: config.blocks,
            ranks: infos,
        });
        let leases = Leases::new(config.lease);
        Ok(Arc::new(Prefill {
            config,
            ranks,
            reply,
            incarnation,
            leases: Mutex::new(leases),
            stats: PrefillStats::default(),
            drop_log: Mutex::new(LogLimiter::standard()),
            reserved: Mutex::default(),
            pending_checks: Mutex::default(),
        }))
    }

    /// The engine id.
    pub fn engine(&self) -> &EngineId {
        &self.config.engine
    }

    /// This process's incarnation (see the side-channel protocol).
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The agents, in rank order.
    pub fn agents(&self) -> impl Iterator<Item = &Agent> {
        self.ranks.iter().map(|r| &r.agent)
    }

    /// What the prefill has seen so far.
    pub fn stats(&self) -> &PrefillStats {
        &self.stats
    }

    /// Requests whose lease has not expired.
    pub fn live_leases(&self) -> usize {
        self.lock_leases().live(Instant::now())
    }

    /// What the leases saw so far (late reads among them).
    pub fn lease_counts(&self) -> LeaseCounts {
        self.lock_leases().counts()
    }

    fn lock_leases(&self) -> std::sync::MutexGuard<'_, Leases> {
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts the polling thread (see the module docs). It stops when
    /// `stop` is set.
    pub fn spawn_poller(self: &Arc<Self>, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
        spawn_shared_poller(vec![self.clone()], stop)
    }

    /// One round of `getNotifs` over every rank, each notification handled.
    /// Whether any arrived that says a read is coming or went (anything
    /// but a heartbeat): a heartbeat alone leaves the poller at its idle
    /// pace. Counting heartbeats kept a prefill that 100 decodes heartbeat
    /// (one every 10 ms) at its 1 ms busy pace for good (issue 32's
    /// fan-in).
    fn poll_once(&self) -> bool {
        let mut busy = self.recheck();
        for (r, rank) in self.ranks.iter().enumerate() {
            match rank.agent.get_notifs() {
                Ok(notifs) => {
                    busy |= notifs.iter().any(|n| !n.message.starts_with(b"HB:"));
                    for n in notifs {
                        self.on_notification(r as u16, &n.agent, &n.message);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "getNotifs failed"),
            }
        }
        busy
    }

    /// Checks again the written blocks whose bytes were not all there when
    /// their `WR:` was handled ([`Prefill::judge_write`]). Whether any is
    /// still waiting (the poller keeps its busy pace meanwhile). Reads the
    /// clock only when one is.
    fn recheck(&self) -> bool {
        let mut pending = self
            .pending_checks
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if pending.is_empty() {
            return false;
        }
        let now = Instant::now();
        let reserved = self.reserved.lock().unwrap_or_else(|e| e.into_inner());
        pending.retain_mut(|c| self.judge_write(c, &reserved, now));
        !pending.is_empty()
    }

    /// Judges one written block: not checked (`overwritten`) once a newer
    /// request reserved it, verified once it holds the request's bytes
    /// (counted as bytes after the notification when an earlier check
    /// found them missing), corrupt once [`BYTES_AFTER_NOTIFICATION`]
    /// passed without them. Whether to check it again at the next poll.
    fn judge_write(
        &self,
        c: &mut PendingCheck,
        reserved: &HashMap<(u16, u32), String>,
        now: Instant,
    ) -> bool {
        let reserved_for = reserved.get(&(c.rank, c.block));
        if reserved_for != Some(&c.request) {
            // A newer request reserved the block first: its write may be
            // landing there now, so this one's bytes can no longer be told
            // from it. Not checked, counted.
            self.stats
                .writes_overwritten
                .fetch_add(1, Ordering::Relaxed);
            tracing::debug!(request = %c.request, block = c.block, newer = ?reserved_for, "written block reserved again before its check: not checked");
            return false;
        }
        let memory = &self.ranks[usize::from(c.rank)].memory;
        let waited = now.saturating_duration_since(c.since);
        match memory.block_mismatch(c.block, self.config.block_size, c.seed, c.rank) {
            None => {
                self.stats.writes_verified.fetch_add(1, Ordering::Relaxed);
                if c.again {
                    self.stats
                        .bytes_after_notification
                        .fetch_add(1, Ordering::Relaxed);
                    self.stats
                        .bytes_after_notification_max_us
                        .fetch_max(waited.as_micros() as u64, Ordering::Relaxed);
                }
                false
            }
            Some(offset) if waited >= BYTES_AFTER_NOTIFICATION => {
                self.stats.writes_corrupt.fetch_add(1, Ordering::Relaxed);
                tracing::error!(request = %c.request, rank = c.rank, block = c.block, offset, ?waited, "written block does not hold the request's bytes");
                false
            }
            // Not yet told apart: a newer write into the block may have
            // landed before this poll handled the newer one's `RQ:` (the
            // test prefill reuses blocks at once; measured), or the bytes
            // may still be on their way. Checked again at the next poll.
            Some(_) => {
                c.again = true;
                true
            }
        }
    }

    /// How often leases are swept: a tenth of a lease, at most 1 s, so an
    /// expiry is logged within 10% of the lease after it happens.
    fn sweep_interval(&self) -> Duration {
        (self.config.lease / 10).min(Duration::from_secs(1))
    }

    fn on_notification(&self, rank: u16, from: &str, message: &[u8]) {
        let rank_agent = self.ranks[usize::from(rank)].agent.name();
        let text = String::from_utf8_lossy(message);
        let now = Instant::now();
        if let Some(scheduled) = text.strip_prefix("RQ:") {
            let id = match self.config.role {
                Role::Source => scheduled,
                Role::Sink => match self.reserve(rank, scheduled) {
                    Some(id) => id,
                    None => return,
                },
            };
            if self.lock_leases().schedule(id, now) {
                tracing::debug!(
                    to = rank_agent,
                    from,
                    request = id,
                    "request scheduled: blocks leased"
                );
            } else {
                tracing::warn!(
                    to = rank_agent,
                    from,
                    request = id,
                    max = super::lease::MAX_REQUESTS,
                    "request refused: too many requests held"
                );
            }
        } else if let Some(ids) = text.strip_prefix("HB:") {
            self.stats.heartbeats.fetch_add(1, Ordering::Relaxed);
            let named: Vec<&str> = ids.split(',').filter(|s| !s.is_empty()).collect();
            let extended = self.lock_leases().heartbeat(named.iter().copied(), now);
            tracing::info!(to = rank_agent, from, named = named.len(), extended = ?extended, "heartbeat: leases extended");
        } else if let (Role::Sink, Some(written)) = (self.config.role, text.strip_prefix("WR:")) {
            self.on_written(rank, from, written, now);
        } else if let (Role::Source, Some(id)) = (self.config.role, text.strip_prefix("RD:")) {
            self.stats.reads_done.fetch_add(1, Ordering::Relaxed);
            match self.lock_leases().read_done(id, now) {
                ReadDone::InTime => {
                    tracing::debug!(
                        to = rank_agent,
                        from,
                        request = id,
                        "read done: blocks freed"
                    )
                }
                ReadDone::AfterExpiry { expired_for } => tracing::error!(
                    to = rank_agent,
                    from,
                    request = id,
                    ?expired_for,
                    "read completed after its lease expired: a read of freed KV blocks"
                ),
                ReadDone::Unknown => tracing::warn!(
                    to = rank_agent,
                    from,
                    request = id,
                    "read completed for a request not scheduled here (or already completed)"
                ),
            }
        } else {
            self.stats.other.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(to = rank_agent, from, %text, "notification ignored");
        }
    }

    /// `RQ:<request>:<rank>:<block>` at rank `rank` (push mode): the block
    /// is reserved for the request, whose id (leased) it returns. A
    /// request naming another rank or no block of this engine is
    /// malformed: counted, logged, nothing leased.
    fn reserve<'a>(&self, rank: u16, scheduled: &'a str) -> Option<&'a str> {
        let Some((id, block)) = named_block(scheduled, rank, self.config.blocks) else {
            self.stats.writes_malformed.fetch_add(1, Ordering::Relaxed);
            let scheduled = nixl_keepalive::text::Escaped(scheduled);
            tracing::warn!(rank, %scheduled, blocks = self.config.blocks, "write request refused: not RQ:<request>:<this rank>:<block below blocks>");
            return None;
        };
        self.reserved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((rank, block), id.to_string());
        Some(id)
    }

    /// `WR:<request>:<rank>:<block>` at rank `rank` (push mode): the
    /// write's bytes are in the block; they are checked, and the request's
    /// lease ends. A `WR:` naming another rank than the one it reached, or
    /// a block past the engine's, is malformed: counted, logged, nothing
    /// freed.
    fn on_written(&self, rank: u16, from: &str, written: &str, now: Instant) {
        let rank_agent = self.ranks[usize::from(rank)].agent.name();
        let Some((id, block)) = named_block(written, rank, self.config.blocks) else {
            self.stats.writes_malformed.fetch_add(1, Ordering::Relaxed);
            let written = nixl_keepalive::text::Escaped(written);
            tracing::warn!(to = rank_agent, from, %written, blocks = self.config.blocks, "write notification refused: not WR:<request>:<this rank>:<block below blocks>");
            return;
        };
        let mut check = PendingCheck {
            rank,
            block,
            request: id.to_string(),
            seed: pattern::write_seed(self.config.engine.as_str(), id),
            since: now,
            again: false,
        };
        let reserved = self.reserved.lock().unwrap_or_else(|e| e.into_inner());
        if self.judge_write(&mut check, &reserved, now) {
            drop(reserved);
            self.pending_checks
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(check);
        }
        match self.lock_leases().read_done(id, now) {
            ReadDone::InTime => {
                tracing::debug!(to = rank_agent, from, request = id, block, "write done: lease ended")
            }
            ReadDone::AfterExpiry { expired_for } => tracing::error!(
                to = rank_agent,
                from,
                request = id,
                block,
                ?expired_for,
                "write completed after its lease expired: a write into KV blocks this decode had given back"
            ),
            ReadDone::Unknown => tracing::warn!(
                to = rank_agent,
                from,
                request = id,
                "write completed for a request not scheduled here (or already completed)"
            ),
        }
    }

    /// What the push-mode writes into this engine came to (`decode
    /// --push`).
    pub fn write_counts(&self) -> WriteCounts {
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        WriteCounts {
            verified: n(&self.stats.writes_verified),
            corrupt: n(&self.stats.writes_corrupt),
            malformed: n(&self.stats.writes_malformed),
            overwritten: n(&self.stats.writes_overwritten),
            bytes_after_notification: n(&self.stats.bytes_after_notification),
            bytes_after_notification_max_us: n(&self.stats.bytes_after_notification_max_us),
        }
    }

    /// Pull mode's prefill or push mode's decode.
    pub fn role(&self) -> Role {
        self.config.role
    }

    fn expire_leases(&self) {
        let gone = self.lock_leases().expire(Instant::now());
        for (id, ago) in gone {
            tracing::info!(request = %id, ?ago, "lease expired: the request's KV blocks are freed");
        }
    }

    /// Logs the lease counts (at stop).
    pub fn log_lease_counts(&self) {
        let c = self.lease_counts();
        // Push mode's decode: the same table, its completions writes.
        let push = (self.config.role == Role::Sink).then(|| self.write_counts());
        let role = if push.is_some() {
            "push: writes into this decode"
        } else {
            "pull: reads from this prefill"
        };
        tracing::info!(
            role,
            scheduled = c.scheduled,
            extended = c.extended,
            ignored = c.ignored,
            completed = c.completed,
            expired = c.expired,
            // (Push mode: late and unknown writes; one name for both
            // roles, which operators and tests grep for.)
            late_reads = c.late_reads,
            unknown_reads = c.unknown_reads,
            refused = c.refused,
            writes = ?push,
            "lease summary"
        );
    }

    /// Answers handshakes on `listener` until `shutdown`.
    ///
    /// At most [`PrefillConfig::max_connections`] connections are handled
    /// at once, each for at most [`PrefillConfig::connection_timeout`], so
    /// idle connections cannot exhaust the process's file descriptors. When
    /// every slot is taken, the connection that has waited longest for its
    /// request is closed to make room (`evicted`): a decoder sends its
    /// request as soon as it connects, so under a flood of idle connections
    /// the flood is evicted and decoders are answered. When every slot is
    /// answering a request, the newcomer is closed (`busy`); the decoder
    /// retries. Each drop is counted in
    /// `nixl_keepalive_pd_side_channel_drops_total{reason}`.
    ///
    /// Cancel safety: cancel with the token; connections in progress are
    /// dropped.
    pub async fn serve(self: Arc<Self>, listener: TcpListener, shutdown: CancellationToken) {
        let max = self.config.max_connections.max(1);
        let slots = Arc::new(tokio::sync::Semaphore::new(max));
        // Connections still waiting for their request, oldest first.
        let waiting: Arc<Mutex<VecDeque<(u64, CancellationToken)>>> = Arc::default();
        let mut next_id = 0u64;
        loop {
            let (stream, peer) = tokio::select! {
                _ = shutdown.cancelled() => return,
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let permit = match slots.clone().try_acquire_owned() {
                Ok(p) => p,
                Err(_) => {
                    let oldest = waiting
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .pop_front();
                    let Some((_, evict)) = oldest else {
                        self.dropped(&peer, "busy");
                        continue;
                    };
                    evict.cancel();
                    // The evicted task gives its slot back when it next
                    // runs; wait for that, briefly.
                    match tokio::time::timeout(
                        Duration::from_millis(100),
                        slots.clone().acquire_owned(),
                    )
                    .await
                    {
                        Ok(Ok(p)) => p,
                        _ => {
                            self.dropped(&peer, "busy");
                            continue;
                        }
                    }
                }
            };
            let id = next_id;
            next_id += 1;
            let evict = shutdown.child_token();
            waiting
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push_back((id, evict.clone()));
            let me = self.clone();
            let waiting = waiting.clone();
            tokio::spawn(async move {
                me.answer(stream, peer, id, evict, &waiting).await;
                drop(permit);
            });
        }
    }

    fn dropped(&self, peer: &SocketAddr, reason: &'static str) {
        self.stats.dropped.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("nixl_keepalive_pd_side_channel_drops_total", "reason" => reason)
            .increment(1);
        let now = tokio::time::Instant::now();
        let told = self
            .drop_log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .admit((*peer, reason), now);
        if let Some(suppressed) = told {
            tracing::info!(%peer, reason, suppressed, "side-channel connection closed unanswered");
        }
    }

    async fn answer(
        &self,
        mut stream: tokio::net::TcpStream,
        peer: SocketAddr,
        id: u64,
        evict: CancellationToken,
        waiting: &Mutex<VecDeque<(u64, CancellationToken)>>,
    ) {
        let deadline = tokio::time::Instant::now() + self.config.connection_timeout;
        let request = tokio::select! {
            _ = evict.cancelled() => {
                self.dropped(&peer, "evicted");
                return;
            }
            r = wire::read_frame(&mut stream, wire::MAX_REQUEST, self.config.connection_timeout) => r,
        };
        waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(i, _)| *i != id);
        let request = request.and_then(|p| wire::decode_request(&p));
        match request {
            Ok(()) => {}
            Err(wire::WireError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return self.dropped(&peer, "eof")
            }
            Err(wire::WireError::Io(_)) => return self.dropped(&peer, "io"),
            Err(wire::WireError::Timeout(_)) => return self.dropped(&peer, "timeout"),
            Err(e) => {
                self.stats.bad_requests.fetch_add(1, Ordering::Relaxed);
                super::bad_frame("prefill", &peer.to_string(), &e);
                return;
            }
        }
        match tokio::time::timeout_at(deadline, wire::write_frame(&mut stream, &self.reply)).await {
            Ok(Ok(())) => {
                self.stats.handshakes.fetch_add(1, Ordering::Relaxed);
                tracing::info!(%peer, engine = %self.config.engine, "handshake answered");
            }
            Ok(Err(e)) => {
                tracing::warn!(%peer, error = %e, "handshake reply not sent");
                self.dropped(&peer, "io");
            }
            Err(_) => {
                tracing::warn!(%peer, "handshake reply not taken within the connection timeout");
                self.dropped(&peer, "timeout");
            }
        }
    }
}

/// One polling thread for every engine of `prefills` (a host of many
/// engines in one process, `prefill --engines N`): each round polls every
/// engine's ranks and sweeps each engine's leases on its own period. The
/// pause between rounds is the shortest poll interval while any engine
/// had notifications, doubling up to the idle interval otherwise, as for
/// one engine. One thread for all, not one each: 1,000 engines would
/// otherwise be 1,000 threads waking every 10 ms.
pub fn spawn_shared_poller(
    prefills: Vec<Arc<Prefill>>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    std::thread::Builder::new()
        .name("prefill-poll".into())
        .spawn(move || {
            let Some(first) = prefills.first() else {
                return;
            };
            let busy_pause = prefills
                .iter()
                .map(|p| p.config.poll_interval)
                .min()
                .unwrap_or(first.config.poll_interval);
            let idle_pause = prefills
                .iter()
                .map(|p| p.config.idle_poll_interval.max(p.config.poll_interval))
                .min()
                .unwrap_or(busy_pause);
            let mut last_sweep = vec![Instant::now(); prefills.len()];
            let mut pause = busy_pause;
            while !stop.load(Ordering::Acquire) {
                let mut busy = false;
                for (me, swept) in prefills.iter().zip(last_sweep.iter_mut()) {
                    busy |= me.poll_once();
                    if swept.elapsed() >= me.sweep_interval() {
                        // As vLLM's prefill: what has arrived is handled
                        // before expired requests are freed (after a
                        // freeze, a completion that arrived in time is in
                        // time). Drained, bounded.
                        for _ in 0..SWEEP_DRAIN_ROUNDS {
                            if !me.poll_once() {
                                break;
                            }
                        }
                        *swept = Instant::now();
                        me.expire_leases();
                    }
                }
                pause = if busy {
                    busy_pause
                } else {
                    (pause * 2).min(idle_pause)
                };
                std::thread::sleep(pause);
            }
            // What arrived before the stop is handled before the stop's
            // summary counts it (a write's `WR:` that came in with the
            // signal), bounded as the sweeps are.
            for me in &prefills {
                for _ in 0..SWEEP_DRAIN_ROUNDS {
                    if !me.poll_once() {
                        break;
                    }
                }
            }
        })
        .expect("spawn prefill poller")
}

#[cfg(test)]
mod tests {
    use super::named_block;

    #[test]
    fn a_peers_block_names_outside_the_engine_or_its_rank_are_refused() {
        assert_eq!(named_block("p-rank0-7:1:3", 1, 8), Some(("p-rank0-7", 3)));
        // A request id may hold colons of its own: the last two fields are
        // the rank and the block.
        assert_eq!(named_block("a:b:c:0:7", 0, 8), Some(("a:b:c", 7)));
        for hostile in [
            "p-1:1:8",          // the block one past the last
            "p-1:1:4294967296", // past u32
            "p-1:0:3",          // another rank than the one it reached
            "p-1:65536:3",      // past u16
            "p-1:1:-1",
            "p-1:1:",
            ":1:3", // no request
            "1:3",
            "p-1",
            "",
        ] {
            assert_eq!(named_block(hostile, 1, 8), None, "{hostile:?}");
        }
    }
}

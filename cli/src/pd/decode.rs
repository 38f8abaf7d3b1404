//! The decode side: handshakes with prefills over the side channel, loads
//! their metadata into the decode agent, registers them with the keepalive
//! service, and reads random blocks, checking every byte.
//!
//! Layers, lowest first (tests use each):
//! - [`fetch`]: one side-channel handshake, no NIXL;
//! - [`RemoteEngine::load`]: `loadRemoteMD` per rank, remote dlists
//!   prepped (one descriptor per block), local landing slots registered;
//!   [`RemoteEngine::read_block`]: one READ, polled to its end, bytes
//!   checked;
//! - landing slots: a READ given up in progress keeps its slot (see
//!   [`ReadOutcome::lent_slot`]): NIXL 1.5.1 may still write it (measured,
//!   `cli/tests/real_buffer.rs`). The [`Decoder`] keeps the READ's request
//!   and watches it to its end (it completes when a frozen prefill resumes,
//!   fails when it dies), tells the service ([`GivenUpRead::ended`]: the
//!   engine is not released before) and hands the slot back;
//! - [`Decoder`]: the above with the service, through the library's
//!   handshake protocol (`handshake`, `ready_to_load`, `register`),
//!   read guards reporting each transfer's status; [`Decoder::spawn`] runs
//!   the whole loop for one prefill address, re-handshaking after a
//!   release once something listens again.
//!
//! # Push mode
//!
//! The same initiator writes instead of reading ([`Direction::Write`]:
//! `prefill --push`, the keepalive embedded in the prefill for every
//! decode it writes to). The peer is then a push-mode decode
//! (`decode --push`, [`super::prefill::Role::Sink`]): the handshake, the
//! loads, the registration, the leases and the guards are the same; a
//! write fills its local slot with the request's bytes
//! ([`pattern::write_seed`] of the decode's engine id and the request),
//! WRITEs it into the decode's block with the completion notification
//! `WR:<request>:<rank>:<block>`, and the decode checks the bytes. The
//! guard ([`EngineRef::begin_write_owned`]) holds the release off while
//! the write is in flight, as a read's does.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nixl_agent::cuda::{CudaError, DeviceMemory, VramRegistration};
use nixl_agent::{
    Agent, Desc, DlistHandle, DramRegistration, MemType, NixlError, NixlStatus, XferState,
};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use super::pattern;
use super::prefill::Memory;
use super::wire::{self, HandshakeReply, WireError};
use nixl_keepalive::log_limit::LogLimiter;
use nixl_keepalive::text::Escaped;
use nixl_keepalive::transport::nixl::{NixlTransport, RemoteDlists};
use nixl_keepalive::{
    AgentName, Claim, ClaimRefused, Destination, EngineId, EngineRef, EngineState, GiveUp,
    GivenUpRead, Incarnation, PeerAddr, Ready, ServiceStopped,
};
use nixl_keepalive::{KeepaliveHandle, LeaseError};

/// A handshake that did not complete. Nothing stays loaded.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// Nobody answered at the address (refused, reset, timed out).
    #[error("cannot reach {address}: {source}")]
    Connect {
        /// The address.
        address: PeerAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The prefill's reply broke the protocol (counted and logged).
    #[error("bad reply from {address}: {source}")]
    Wire {
        /// The address.
        address: PeerAddr,
        /// What was wrong.
        source: WireError,
    },
    /// NIXL refused the metadata or a dlist (raw status kept); whatever
    /// had been loaded was invalidated again.
    #[error("loading {engine}: {source}")]
    Load {
        /// The engine.
        engine: EngineId,
        /// NIXL's error.
        source: NixlError,
    },
    /// The metadata named another agent than the reply did. What was
    /// loaded under the reply's own (claimed) names was invalidated; the
    /// name NIXL loaded instead was unloaded only if the service granted
    /// it to this handshake (it may be another engine's: NIXL keeps one
    /// entry for identical metadata, and unloading it would cut that
    /// engine off).
    #[error(
        "metadata for rank {rank} names agent {}, the reply said {}",
        Escaped(got),
        Escaped(expected)
    )]
    AgentMismatch {
        /// The rank.
        rank: usize,
        /// The agent the reply listed.
        expected: String,
        /// The agent the metadata named.
        got: String,
    },
    /// Who the prefill says it is conflicts with an engine already
    /// registered or being loaded (the service logged it once and counted
    /// it); nothing was loaded.
    #[error(transparent)]
    Conflict(nixl_keepalive::Conflict),
    /// The reply's identity is malformed (the service refused the claim).
    #[error("{0}")]
    Invalid(String),
    /// Two ranks of the reply name one agent (see the protocol). Caught by
    /// the wire decoder; checked again for replies built in code.
    #[error("{engine}: ranks {first} and {second} both name agent {:?}; each rank must have its own agent", Escaped(agent))]
    DuplicateAgent {
        /// The engine.
        engine: EngineId,
        /// The first rank naming it.
        first: usize,
        /// The second.
        second: usize,
        /// The agent.
        agent: String,
    },
    /// The keepalive service has stopped.
    #[error(transparent)]
    Stopped(#[from] ServiceStopped),
    /// The keepalive service refused the registration (what was loaded
    /// was given back).
    #[error("{0}")]
    Refused(String),
    /// GPU landing slots could not be had (`--memory vram`); whatever had
    /// been loaded was invalidated again.
    #[error("loading {engine}: GPU landing slots: {source}")]
    Memory {
        /// The engine.
        engine: EngineId,
        /// The driver's error.
        source: CudaError,
    },
}

impl HandshakeError {
    /// The `reason` label of `nixl_keepalive_pd_handshake_failures_total`
    /// (see [the list](super#what-is-counted)).
    pub fn reason(&self) -> &'static str {
        match self {
            HandshakeError::Connect { .. } => "connect",
            HandshakeError::Wire { source, .. } => match source {
                WireError::Io(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => "eof",
                WireError::Io(_) => "io",
                WireError::Timeout(_) => "timeout",
                _ => "bad_frame",
            },
            HandshakeError::Load { .. } => "load",
            HandshakeError::AgentMismatch { .. } => "agent_mismatch",
            HandshakeError::DuplicateAgent { .. } => "duplicate_agent",
            HandshakeError::Stopped(_) => "stopped",
            HandshakeError::Refused(_) => "refused",
            HandshakeError::Conflict(_) => "conflict",
            HandshakeError::Invalid(_) => "invalid",
            HandshakeError::Memory { .. } => "memory",
        }
    }
}

/// Asks the prefill at `address` for its engine id, metadata and layout.
pub async fn fetch(
    address: &PeerAddr,
    timeout: Duration,
) -> Result<HandshakeReply, HandshakeError> {
    let connect = tokio::time::timeout(timeout, TcpStream::connect(address.as_str()))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"))
        .and_then(|r| r)
        .map_err(|source| HandshakeError::Connect {
            address: address.clone(),
            source,
        })?;
    let mut stream = connect;
    let wire_err = |source| HandshakeError::Wire {
        address: address.clone(),
        source,
    };
    wire::write_frame(&mut stream, &wire::encode_request())
        .await
        .map_err(wire_err)?;
    let reply = wire::read_frame(&mut stream, wire::MAX_FRAME, timeout)
        .await
        .and_then(|p| wire::decode_reply(&p));
    match reply {
        Ok(r) => Ok(r),
        Err(e) => {
            if !matches!(e, WireError::Io(_) | WireError::Timeout(_)) {
                super::bad_frame("decode", address.as_str(), &e);
            }
            Err(wire_err(e))
        }
    }
}

/// Which way a transfer's bytes go.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Direction {
    /// Pull mode: READ the peer's block into a local slot, check it here.
    #[default]
    Read,
    /// Push mode: WRITE a local slot into the peer's block; the peer
    /// checks it.
    Write,
}

impl Direction {
    /// `read` or `write`.
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Read => "read",
            Direction::Write => "write",
        }
    }
}

/// How one transfer (a read, or a push-mode write) ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadOutcome {
    /// Done, and every byte matched the pattern.
    Verified,
    /// A write is done: NIXL said DONE, and its `WR:` went to the peer,
    /// which checks the bytes (push mode).
    Written,
    /// Done, but the bytes are wrong from this offset on.
    Corrupt {
        /// First differing byte.
        offset: usize,
    },
    /// NIXL refused or failed the transfer with this raw status.
    Failed(NixlStatus),
    /// Still in progress at the deadline: given up, its request kept (not
    /// released: `releaseXferReq` does not end a READ in progress, it only
    /// stops its `RD:`, measured in `cli/tests/real_buffer.rs`) to be
    /// watched to its end ([`RemoteEngine::take_running`]). Its landing
    /// slot stays lent to the transfer until then.
    TimedOut {
        /// The landing slot the transfer may still write.
        slot: usize,
    },
    /// The service failed the engine's reads (unreachable, stalled, gone in
    /// fail mode): given up as [`ReadOutcome::TimedOut`] is.
    Abandoned {
        /// The landing slot the transfer may still write.
        slot: usize,
    },
    /// Completed; its bytes were not checked ([`RemoteEngine::unchecked`]).
    Unchecked,
    /// The engine's dlists were already released: nothing was posted.
    Released,
    /// Every landing slot was busy: nothing was posted.
    NoSlot,
}

impl ReadOutcome {
    /// The status to report to the service, when there is one.
    pub fn status(self) -> Option<NixlStatus> {
        match self {
            ReadOutcome::Verified
            | ReadOutcome::Written
            | ReadOutcome::Unchecked
            | ReadOutcome::Corrupt { .. } => Some(NixlStatus::SUCCESS),
            ReadOutcome::Failed(s) => Some(s),
            _ => None,
        }
    }

    /// The landing slot a read given up in progress left lent to its
    /// transfer: not free again until [`RemoteEngine::return_slot`].
    pub fn lent_slot(self) -> Option<usize> {
        match self {
            ReadOutcome::TimedOut { slot, .. } | ReadOutcome::Abandoned { slot, .. } => Some(slot),
            _ => None,
        }
    }

    /// A short name, used as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            ReadOutcome::Verified => "verified",
            ReadOutcome::Written => "written",
            ReadOutcome::Unchecked => "unchecked",
            ReadOutcome::Corrupt { .. } => "corrupt",
            ReadOutcome::Failed(_) => "failed",
            ReadOutcome::TimedOut { .. } => "timed_out",
            ReadOutcome::Abandoned { .. } => "abandoned",
            ReadOutcome::Released => "released",
            ReadOutcome::NoSlot => "no_slot",
        }
    }
}

/// One landing slot: registered DRAM, or registered GPU memory.
enum Slot {
    Dram(DramRegistration),
    Vram(VramRegistration),
}

impl Slot {
    fn desc(&self) -> Desc {
        match self {
            Slot::Dram(r) => r.desc(),
            Slot::Vram(r) => r.desc(),
        }
    }

    /// Fills the slot with block `block` of rank `rank` of `seed`: what a
    /// push-mode write sends.
    fn fill(&mut self, seed: u64, rank: u16, block: u32) -> Result<(), CudaError> {
        match self {
            Slot::Dram(r) => {
                pattern::fill(r.bytes_mut(), seed, rank, block);
                Ok(())
            }
            Slot::Vram(r) => {
                let mut host = vec![0u8; r.memory().len()];
                pattern::fill(&mut host, seed, rank, block);
                r.memory().write(0, &host)
            }
        }
    }

    /// The first byte that differs from block `block` of rank `rank`
    /// (GPU memory is copied back to the host first; a failed copy is
    /// reported as a mismatch at 0, and logged).
    fn first_mismatch(&self, seed: u64, rank: u16, block: u32) -> Option<usize> {
        match self {
            Slot::Dram(r) => pattern::first_mismatch(r.bytes(), seed, rank, block),
            Slot::Vram(r) => {
                let mut host = vec![0u8; r.memory().len()];
                if let Err(e) = r.memory().read(0, &mut host) {
                    tracing::error!(error = %e, "cannot copy a GPU landing slot back to check it");
                    return Some(0);
                }
                pattern::first_mismatch(&host, seed, rank, block)
            }
        }
    }
}

/// The decode side's landing slots for one engine: registered memory
/// (DRAM, or VRAM with `--memory vram`), one block each, and the local
/// dlist over them.
struct LocalSlots {
    /// `None` only while dropping: it goes before the memory it describes.
    dlist: Option<DlistHandle>,
    /// Each behind a lock only its one transfer takes (a slot is popped
    /// from `free` first): filling a slot for a write needs `&mut`.
    regions: Vec<Mutex<Slot>>,
    /// Free slots, oldest first: a slot is taken again as late as it can
    /// be.
    free: Mutex<std::collections::VecDeque<usize>>,
    /// Slots lent to transfers given up in progress, not proven over.
    lent: Mutex<BTreeSet<usize>>,
    /// The transfers given up in progress, by slot, not released: kept to
    /// be watched to their end ([`RemoteEngine::take_running`]).
    running: Mutex<std::collections::BTreeMap<usize, nixl_agent::XferRequest>>,
}

impl LocalSlots {
    fn dlist(&self) -> &DlistHandle {
        self.dlist.as_ref().expect("only taken when dropped")
    }
}

impl Drop for LocalSlots {
    /// A lent slot's memory is never freed: a given-up READ may still
    /// write it (NIXL 1.5.1 over TCP: measured), for as long as the decode
    /// agent lives. Its registration is leaked on purpose (the memory and
    /// a reference to the agent); the others are given back.
    fn drop(&mut self) {
        drop(self.dlist.take());
        let lent = std::mem::take(&mut *self.lent.lock().unwrap_or_else(|e| e.into_inner()));
        for (slot, region) in std::mem::take(&mut self.regions).into_iter().enumerate() {
            if lent.contains(&slot) {
                std::mem::forget(region);
            }
        }
    }
}

/// One loaded prefill engine: its metadata loaded into the decode agent,
/// its remote dlists prepped, local landing slots registered.
pub struct RemoteEngine {
    /// The engine id.
    pub engine: EngineId,
    /// Its side-channel address.
    pub address: PeerAddr,
    /// The prefill process's incarnation.
    pub incarnation: u64,
    /// Its agents, in rank order.
    pub agents: Vec<AgentName>,
    /// Bytes per block.
    pub block_size: usize,
    /// Blocks per rank.
    pub blocks: u32,
    /// The prepped remote dlists (shared with the service, which releases
    /// them).
    pub dlists: RemoteDlists,
    seed: u64,
    /// Whether a read's bytes are checked against the pattern
    /// ([`RemoteEngine::unchecked`] turns it off).
    check: bool,
    local: LocalSlots,
}

impl std::fmt::Debug for RemoteEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteEngine")
            .field("engine", &self.engine)
            .field("address", &self.address)
            .field("agents", &self.agents)
            .finish_non_exhaustive()
    }
}

impl RemoteEngine {
    /// Loads `reply` into `agent` (blocking): `loadRemoteMD` per rank,
    /// then a remote dlist per rank and `slots` local landing slots. All or
    /// nothing: on failure, metadata loaded so far is invalidated again.
    pub fn load(
        agent: &Agent,
        address: PeerAddr,
        reply: &HandshakeReply,
        slots: usize,
    ) -> Result<RemoteEngine, HandshakeError> {
        Self::load_in(agent, address, reply, slots, Memory::Dram)
    }

    /// [`RemoteEngine::load`] with the prefill's KV cache and the local
    /// landing slots in `memory`. The handshake does not say where a
    /// prefill's memory is: with [`Memory::Vram`], the prefill's is taken
    /// to be VRAM of the same device ordinal (one GPU: the check in
    /// `scripts/gpu-check.sh`).
    pub fn load_in(
        agent: &Agent,
        address: PeerAddr,
        reply: &HandshakeReply,
        slots: usize,
        memory: Memory,
    ) -> Result<RemoteEngine, HandshakeError> {
        let (mem_type, dev_id) = match memory {
            Memory::Dram => (MemType::Dram, 0),
            Memory::Vram { device } => (MemType::Vram, device as u64),
        };
        let engine = EngineId::new(reply.engine.as_str());
        if let Some((first, second)) = wire::find_duplicate_agent(reply) {
            return Err(HandshakeError::DuplicateAgent {
                engine,
                first,
                second,
                agent: reply.ranks[first].agent.clone(),
            });
        }
        let mut loaded: Vec<String> = Vec::new();
        // Only names the reply claimed (and the service granted to this
        // handshake) are ours to unload: NIXL keeps one entry for identical
        // metadata, so a name loaded "again" may be another engine's.
        let claimed: Vec<&str> = reply.ranks.iter().map(|r| r.agent.as_str()).collect();
        let undo = |loaded: &[String]| {
            for name in loaded.iter().filter(|n| claimed.contains(&n.as_str())) {
                let _ = agent.invalidate_remote_metadata(name);
            }
        };
        let load_err = |source| HandshakeError::Load {
            engine: engine.clone(),
            source,
        };
        for (rank, info) in reply.ranks.iter().enumerate() {
            match agent.load_remote_metadata(&info.metadata) {
                Ok(name) if name == info.agent => loaded.push(name),
                Ok(name) => {
                    loaded.push(name.clone());
                    undo(&loaded);
                    return Err(HandshakeError::AgentMismatch {
                        rank,
                        expected: info.agent.clone(),
                        got: name,
                    });
                }
                Err(e) => {
                    undo(&loaded);
                    return Err(load_err(e));
                }
            }
        }
        let bs = reply.block_size as usize;
        let mut handles = Vec::with_capacity(reply.ranks.len());
        for info in &reply.ranks {
            let descs: Vec<Desc> = (0..reply.blocks)
                .map(|b| Desc {
                    addr: info.base + u64::from(b) * reply.block_size,
                    len: bs,
                    dev_id,
                })
                .collect();
            match agent.prep_remote_dlist_in(&info.agent, mem_type, &descs) {
                Ok(h) => handles.push(h),
                Err(e) => {
                    drop(handles);
                    undo(&loaded);
                    return Err(load_err(e));
                }
            }
        }
        let local = (|| {
            let regions = (0..slots.max(1))
                .map(|_| match memory {
                    Memory::Dram => Ok(Slot::Dram(agent.register_dram(bs).map_err(load_err)?)),
                    Memory::Vram { device } => {
                        let m = DeviceMemory::alloc(device, bs).map_err(|source| {
                            HandshakeError::Memory {
                                engine: engine.clone(),
                                source,
                            }
                        })?;
                        Ok(Slot::Vram(agent.register_vram(m).map_err(load_err)?))
                    }
                })
                .collect::<Result<Vec<_>, HandshakeError>>()?;
            let descs: Vec<Desc> = regions.iter().map(|r| r.desc()).collect();
            let regions: Vec<Mutex<Slot>> = regions.into_iter().map(Mutex::new).collect();
            let dlist = agent
                .prep_local_dlist_in(mem_type, &descs)
                .map_err(load_err)?;
            Ok(LocalSlots {
                dlist: Some(dlist),
                free: Mutex::new((0..regions.len()).collect()),
                lent: Mutex::default(),
                running: Mutex::default(),
                regions,
            })
        })();
        let local = match local {
            Ok(l) => l,
            Err(e) => {
                drop(handles);
                undo(&loaded);
                return Err(e);
            }
        };
        Ok(RemoteEngine {
            seed: pattern::seed(&reply.engine),
            check: true,
            engine,
            address,
            incarnation: reply.incarnation,
            agents: loaded.into_iter().map(AgentName::from).collect(),
            block_size: bs,
            blocks: reply.blocks,
            dlists: RemoteDlists::new(handles),
            local,
        })
    }

    /// Ranks.
    /// This engine with its reads left unchecked: they end as
    /// [`ReadOutcome::Unchecked`]. For timing the reads themselves (the
    /// GPU check's cost table): checking a VRAM slot copies it back to the
    /// host, which would be most of a read's time.
    pub fn unchecked(mut self) -> Self {
        self.check = false;
        self
    }

    pub fn ranks(&self) -> u16 {
        self.agents.len() as u16
    }

    /// Reads block `block` of rank `rank` for `request` (blocking):
    /// schedules the request at the rank's agent (`RQ:<request>`), creates
    /// and posts a READ whose completion notification is `RD:<request>`,
    /// polls it until done, failed, `timeout`, or `abandon()` says to give
    /// up, then checks the bytes. Never hangs past `timeout`.
    ///
    /// A read given up in progress ([`ReadOutcome::lent_slot`]) keeps its
    /// landing slot: the transfer may still write it. Hand it back with
    /// [`RemoteEngine::return_slot`] once the transfer is proven over, or
    /// never (it stays out of use, and its memory outlives this engine).
    pub fn read_block(
        &self,
        agent: &Agent,
        request: &str,
        rank: u16,
        block: u32,
        timeout: Duration,
        abandon: &dyn Fn() -> bool,
    ) -> ReadOutcome {
        let at = Target { rank, block };
        self.transfer_block(agent, Direction::Read, request, at, timeout, abandon)
    }

    /// [`RemoteEngine::read_block`] either way: a push-mode write fills a
    /// local slot with the request's bytes and WRITEs it into the block,
    /// with `WR:<request>:<rank>:<block>` as its completion notification
    /// (see the module docs). A write given up in progress keeps its slot
    /// lent too: UCX may still be reading it.
    pub fn transfer_block(
        &self,
        agent: &Agent,
        direction: Direction,
        request: &str,
        at: Target,
        timeout: Duration,
        abandon: &dyn Fn() -> bool,
    ) -> ReadOutcome {
        let Some(slot) = self
            .local
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front()
        else {
            return ReadOutcome::NoSlot;
        };
        let outcome = self.transfer_into(agent, direction, request, slot, at, timeout, abandon);
        if outcome.lent_slot().is_some() {
            self.local
                .lent
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(slot);
        } else {
            self.local
                .free
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push_back(slot);
        }
        outcome
    }

    /// The request of the transfer given up in progress into `slot`, kept
    /// to be watched to its end (see [`ReadOutcome::TimedOut`]); `None`
    /// when there is none.
    pub fn take_running(&self, slot: usize) -> Option<nixl_agent::XferRequest> {
        self.local
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&slot)
    }

    /// Hands back a slot a given-up read left lent, once its transfer is
    /// over ([`Destination::Reusable`]). A slot not lent is left alone.
    pub fn return_slot(&self, slot: usize) {
        let was_lent = self
            .local
            .lent
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&slot);
        if was_lent {
            self.local
                .free
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push_back(slot);
        }
    }

    /// Landing slots lent to given-up transfers, not handed back.
    pub fn lent_slots(&self) -> usize {
        self.local
            .lent
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    #[allow(clippy::too_many_arguments)]
    fn transfer_into(
        &self,
        agent: &Agent,
        direction: Direction,
        request: &str,
        slot: usize,
        at: Target,
        timeout: Duration,
        abandon: &dyn Fn() -> bool,
    ) -> ReadOutcome {
        let Target { rank, block } = at;
        let notif = match direction {
            Direction::Read => format!("RD:{request}"),
            Direction::Write => {
                let seed = pattern::write_seed(self.engine.as_str(), request);
                let filled = self.local.regions[slot]
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .fill(seed, rank, block);
                if let Err(e) = filled {
                    tracing::error!(error = %e, "cannot fill a GPU slot to write it");
                    return ReadOutcome::NoSlot;
                }
                format!("WR:{request}:{rank}:{block}")
            }
        };
        let local = self.local.dlist();
        let (slots, blocks) = ([slot as i32], [block as i32]);
        let created = self
            .dlists
            .with_handle(rank as usize, |remote| match direction {
                Direction::Read => {
                    agent.create_read(local, &slots, remote, &blocks, Some(notif.as_bytes()))
                }
                Direction::Write => {
                    agent.create_write(local, &slots, remote, &blocks, Some(notif.as_bytes()))
                }
            });
        let mut req = match created {
            None => return ReadOutcome::Released,
            Some(Err(e)) => return ReadOutcome::Failed(e.status),
            Some(Ok(r)) => r,
        };
        // The request reaches P before its READ does (the same pair of
        // agents, in order): P leases its blocks from now.
        if let Some(to) = self.agents.get(rank as usize) {
            // Push mode names the block the request writes: the decode
            // reserves it for this request (see `pd::prefill`).
            let scheduled = match direction {
                Direction::Read => format!("RQ:{request}"),
                Direction::Write => format!("RQ:{request}:{rank}:{block}"),
            };
            if let Err(e) = agent.gen_notif(to.as_str(), scheduled.as_bytes()) {
                return ReadOutcome::Failed(e.status);
            }
        }
        let start = Instant::now();
        let mut state = match req.post() {
            Ok(s) => s,
            Err(e) => return ReadOutcome::Failed(e.status),
        };
        let mut pause = Duration::from_micros(50);
        // Giving up on a READ in progress: the request is kept, not
        // released (that does not end the transfer: over TCP its bytes
        // still land when the prefill resumes, measured with NIXL 1.5.1),
        // to be watched to its end; the slot stays lent until then.
        let keep = |req: nixl_agent::XferRequest| {
            self.local
                .running
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(slot, req);
        };
        while state == XferState::InProgress {
            if abandon() {
                keep(req);
                return ReadOutcome::Abandoned { slot };
            }
            if start.elapsed() >= timeout {
                keep(req);
                return ReadOutcome::TimedOut { slot };
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_micros(100));
            state = match req.status() {
                Ok(s) => s,
                Err(e) => return ReadOutcome::Failed(e.status),
            };
        }
        drop(req);
        if direction == Direction::Write {
            return ReadOutcome::Written;
        }
        if !self.check {
            return ReadOutcome::Unchecked;
        }
        let region = self.local.regions[slot]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match region.first_mismatch(self.seed, rank, block) {
            None => ReadOutcome::Verified,
            Some(offset) => ReadOutcome::Corrupt { offset },
        }
    }
}

/// Where one transfer goes: block `block` of rank `rank` of the peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    /// The peer's rank.
    pub rank: u16,
    /// The block of that rank.
    pub block: u32,
}

/// The blocks one round transfers with, one per transfer in flight: random
/// for reads; for writes, consecutive from a random start, never one
/// block twice in a round (two writes of different requests into one
/// block at once would each make the other's bytes look corrupt), so a
/// round writes at most every block once.
fn round_targets(remote: &RemoteEngine, in_flight: usize, direction: Direction) -> Vec<Target> {
    let (ranks, blocks) = (remote.ranks().max(1), remote.blocks.max(1));
    let total = u64::from(ranks) * u64::from(blocks);
    let n = in_flight.max(1);
    match direction {
        Direction::Read => (0..n)
            .map(|_| Target {
                rank: rand::random_range(0..ranks),
                block: rand::random_range(0..blocks),
            })
            .collect(),
        Direction::Write => {
            let start = rand::random_range(0..total);
            (0..(n as u64).min(total))
                .map(|i| {
                    let index = (start + i) % total;
                    Target {
                        rank: (index / u64::from(blocks)) as u16,
                        block: (index % u64::from(blocks)) as u32,
                    }
                })
                .collect()
        }
    }
}

/// The pause before asking an address again whose prefill conflicts with
/// an engine already registered (the same engine id elsewhere, another
/// engine's agent names).
const CONFLICT_PAUSE: Duration = Duration::from_secs(10);

/// How many given-up request ids [`ReadStats`] keeps.
pub const GIVEN_UP_KEPT: usize = 10_000;

/// How many verified requests [`ReadStats`] remembers.
pub const COMPLETIONS_KEPT: usize = 4096;

/// Counts one read's outcome (stats, metrics, logs).
fn count(
    stats: &ReadStats,
    engine: &EngineId,
    request: &str,
    rank: u16,
    block: u32,
    outcome: ReadOutcome,
) {
    let counter = match outcome {
        ReadOutcome::Verified => {
            let mut done = stats.completions.lock().unwrap_or_else(|e| e.into_inner());
            if done.len() == COMPLETIONS_KEPT {
                done.pop_front();
            }
            done.push_back((request.to_string(), Instant::now()));
            &stats.verified
        }
        ReadOutcome::Written => &stats.written,
        ReadOutcome::Unchecked => &stats.unchecked,
        ReadOutcome::Corrupt { offset } => {
            tracing::error!(%engine, rank, block, offset, "read returned wrong bytes");
            &stats.corrupt
        }
        ReadOutcome::Failed(status) => {
            tracing::debug!(%engine, %status, "read failed");
            &stats.failed
        }
        ReadOutcome::TimedOut { .. } | ReadOutcome::Abandoned { .. } => {
            tracing::info!(%engine, request, outcome = outcome.as_str(), "read given up: its request failed now, its transfer watched to its end");
            let mut ids = stats
                .given_up_requests
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if ids.len() < GIVEN_UP_KEPT {
                ids.push(request.to_string());
            }
            &stats.abandoned
        }
        ReadOutcome::Released | ReadOutcome::NoSlot => &stats.refused,
    };
    counter.fetch_add(1, Ordering::Relaxed);
    metrics::counter!("nixl_keepalive_pd_reads_total", "outcome" => outcome.as_str()).increment(1);
}

/// How a [`Decoder`] reads.
#[derive(Clone, Debug)]
pub struct DecodeOptions {
    /// Reads in flight per prefill (also the landing slots per engine).
    pub reads_in_flight: usize,
    /// A read still in progress after this is abandoned.
    pub read_timeout: Duration,
    /// Side-channel connect and reply timeout.
    pub handshake_timeout: Duration,
    /// First pause after a failed handshake; it doubles with each failure
    /// in a row, up to `retry_max` ([`super::retry`]).
    pub retry: Duration,
    /// The longest pause between handshake attempts.
    pub retry_max: Duration,
    /// At most one WARN per this long about a prefill that keeps failing
    /// for one reason (each reason has its own; each line says how many
    /// failures it stands for).
    pub warn_every: Duration,
    /// How often a connected address is asked again who is there (a new
    /// engine id or incarnation there is a replacement).
    pub probe_interval: Duration,
    /// Pause between rounds of reads (`reads_in_flight` reads each).
    pub read_pause: Duration,
    /// Where the landing slots are, and where the prefills' KV caches are
    /// taken to be (see [`RemoteEngine::load_in`]).
    pub memory: Memory,
    /// Which way [`Decoder::spawn`]'s transfers go: pull mode's reads, or
    /// push mode's writes (`prefill --push`).
    pub direction: Direction,
    /// Whether each read's bytes are checked (see
    /// [`RemoteEngine::unchecked`]).
    pub check: bool,
}

impl Default for DecodeOptions {
    fn default() -> Self {
        DecodeOptions {
            reads_in_flight: 2,
            read_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(2),
            retry: Duration::from_millis(250),
            retry_max: Duration::from_secs(4),
            warn_every: Duration::from_secs(30),
            probe_interval: Duration::from_secs(2),
            read_pause: Duration::from_millis(20),
            memory: Memory::Dram,
            direction: Direction::Read,
            check: true,
        }
    }
}

/// Counts of read outcomes, all prefills together.
#[derive(Debug, Default)]
pub struct ReadStats {
    /// Reads whose bytes all matched.
    pub verified: AtomicU64,
    /// Push-mode writes done (the peer checks their bytes).
    pub written: AtomicU64,
    /// Reads that completed with wrong bytes.
    pub corrupt: AtomicU64,
    /// Reads NIXL failed.
    pub failed: AtomicU64,
    /// Reads abandoned (timed out, or failed by the service).
    pub abandoned: AtomicU64,
    /// What the given-up reads' transfers ended with, once watched to
    /// their end (`SUCCESS`: the prefill resumed; an error: it died): raw
    /// status -> count.
    pub given_up_ended: Mutex<std::collections::BTreeMap<i32, u64>>,
    /// The ids of the requests whose reads were given up (the first
    /// [`GIVEN_UP_KEPT`]), so that a prefill's late completions can be
    /// matched to them.
    pub given_up_requests: Mutex<Vec<String>>,
    /// The last [`COMPLETIONS_KEPT`] requests whose reads were verified,
    /// with when `decode` saw them done (their `RD:` had been handed to
    /// the prefill by then), to match a prefill's late completions.
    pub completions: Mutex<std::collections::VecDeque<(String, Instant)>>,
    /// Landing slots of given-up reads handed back (their transfer was
    /// seen to end).
    pub slots_returned: AtomicU64,
    /// Landing slots of given-up reads retired for good (their transfer
    /// was abandoned unwatched and may still write them).
    pub slots_retired: AtomicU64,
    /// Landing slots lent to given-up transfers now (still running).
    pub slots_lent: AtomicU64,
    /// Reads refused before posting (engine not live, released, no slot).
    pub refused: AtomicU64,
    /// Reads completed and not checked ([`DecodeOptions::check`] off).
    pub unchecked: AtomicU64,
    /// Handshakes that registered an engine.
    pub handshakes: AtomicU64,
}

/// The claim a handshake reply makes: who the prefill says it is, before
/// anything of it is loaded.
pub fn claim_of(reply: &HandshakeReply) -> Claim {
    Claim {
        engine: EngineId::new(reply.engine.as_str()),
        incarnation: Some(Incarnation(reply.incarnation)),
        agents: reply
            .ranks
            .iter()
            .map(|r| AgentName::new(r.agent.as_str()))
            .collect(),
    }
}

/// What a handshake found.
pub enum Found {
    /// A new engine (or a new incarnation of one) was loaded and registered.
    New(Connected),
    /// The engine and incarnation already connected are still there.
    Unchanged,
}

/// A registered engine and what reads from it need.
#[derive(Clone)]
pub struct Connected {
    /// The service's reference (reads are guarded through it).
    pub engine: EngineRef,
    /// The loaded engine.
    pub remote: Arc<RemoteEngine>,
}

/// The decode side: the service's handle, the transport, and readers.
pub struct Decoder {
    handle: KeepaliveHandle<RemoteDlists>,
    transport: Arc<NixlTransport>,
    options: DecodeOptions,
    stats: Arc<ReadStats>,
    /// Request ids are `<decode agent>-<n>`: unique per request, and per
    /// decoder across decoders (agent names are unique).
    next_request: AtomicU64,
    /// Registrations this decoder loaded, until released.
    loaded: Mutex<Vec<Connected>>,
    /// Handshake-failure WARNs, one per prefill address and reason per
    /// `warn_every`, shared by every reader: a reader started again for
    /// the same address (a record flapped in etcd) does not start a fresh
    /// budget, and one reader's flood does not hide another's first line.
    handshake_log: Mutex<LogLimiter<(PeerAddr, &'static str)>>,
}

impl Decoder {
    /// A decoder over a running service and its transport.
    pub fn new(
        handle: KeepaliveHandle<RemoteDlists>,
        transport: Arc<NixlTransport>,
        options: DecodeOptions,
    ) -> Arc<Decoder> {
        Arc::new(Decoder {
            handle,
            transport,
            stats: Arc::default(),
            next_request: AtomicU64::new(0),
            handshake_log: Mutex::new(LogLimiter::new(
                options.warn_every,
                nixl_keepalive::log_limit::LOG_KEYS * 16,
            )),
            loaded: Mutex::default(),
            options,
        })
    }

    /// Which way [`Decoder::spawn`]'s transfers go.
    pub fn direction(&self) -> Direction {
        self.options.direction
    }

    /// A fresh request id, never used before by this decoder.
    pub fn next_request_id(&self) -> String {
        let n = self.next_request.fetch_add(1, Ordering::Relaxed);
        format!("{}-{n}", self.transport.agent().name())
    }

    /// The service's handle.
    pub fn handle(&self) -> &KeepaliveHandle<RemoteDlists> {
        &self.handle
    }

    /// Read outcomes so far.
    pub fn stats(&self) -> &ReadStats {
        &self.stats
    }

    /// One handshake with `address`, through the library's protocol.
    /// `current` is what this caller has connected there: the same engine
    /// id and incarnation, still live, is [`Found::Unchanged`]. Any
    /// other registration of the engine id found is released first
    /// (`ready_to_load`), whatever its state: NIXL must not load metadata
    /// over loaded metadata.
    ///
    /// A handshake that fails is counted in
    /// `nixl_keepalive_pd_handshake_failures_total{reason}`.
    ///
    /// Cancel safety: a cancelled handshake may leave metadata loaded and
    /// unregistered; run it to the end.
    pub async fn connect(
        &self,
        address: &PeerAddr,
        current: Option<&Connected>,
    ) -> Result<Found, HandshakeError> {
        self.connect_by(address, current).await.0
    }

    /// [`Decoder::connect`], and who answered: the engine id and
    /// incarnation of the reply, `None` when no reply was read. A failure
    /// is earned by that claimant ([`super::retry::Retry::failed_by`]).
    pub async fn connect_by(
        &self,
        address: &PeerAddr,
        current: Option<&Connected>,
    ) -> (Result<Found, HandshakeError>, super::retry::Claimant) {
        let mut claimant = None;
        let result = self.handshake(address, current, &mut claimant).await;
        if let Err(e) = &result {
            metrics::counter!("nixl_keepalive_pd_handshake_failures_total", "reason" => e.reason())
                .increment(1);
        }
        (result, claimant)
    }

    /// The handshake and registration calls themselves (see `connect`):
    /// the library's protocol, step by step.
    async fn handshake(
        &self,
        address: &PeerAddr,
        current: Option<&Connected>,
        claimant: &mut super::retry::Claimant,
    ) -> Result<Found, HandshakeError> {
        let handshake = self.handle.handshake(address.clone());
        let reply = fetch(address, self.options.handshake_timeout).await?;
        *claimant = Some((reply.engine.clone(), reply.incarnation));
        let ready = match handshake.ready_to_load(claim_of(&reply)).await {
            Ok(Ready::Load(ready)) => ready,
            Ok(Ready::Current(engine)) => {
                // This process is registered already: nothing to load.
                if let Some(c) = current.filter(|c| c.engine.same_registration(&engine)) {
                    let _ = c;
                    return Ok(Found::Unchanged);
                }
                return match self.loaded(&engine) {
                    Some(connected) => Ok(Found::New(connected)),
                    None => Err(HandshakeError::Invalid(format!(
                        "engine {} is registered by another runtime of this agent",
                        engine.id()
                    ))),
                };
            }
            Err(ClaimRefused::Conflict(conflict)) => {
                return Err(HandshakeError::Conflict(conflict))
            }
            Err(ClaimRefused::Invalid { reason, .. }) => {
                return Err(HandshakeError::Invalid(reason))
            }
            Err(ClaimRefused::Stopped(stopped)) => return Err(HandshakeError::Stopped(stopped)),
            // A refusal this build does not know: nothing may be loaded.
            Err(other) => return Err(HandshakeError::Invalid(other.to_string())),
        };
        let agent = self.transport.agent().clone();
        let addr = address.clone();
        let slots = self.options.reads_in_flight.max(1);
        let memory = self.options.memory;
        let check = self.options.check;
        let loaded = tokio::task::spawn_blocking(move || {
            RemoteEngine::load_in(&agent, addr, &reply, slots, memory).map(|r| {
                if check {
                    r
                } else {
                    r.unchecked()
                }
            })
        })
        .await
        .expect("load does not panic");
        let remote = match loaded {
            Ok(remote) => remote,
            Err(HandshakeError::AgentMismatch {
                rank,
                expected,
                got,
            }) => {
                // NIXL loaded a name the reply did not claim. Unload it only
                // if it is nobody else's (granted to this handshake now).
                let stray = AgentName::new(got.as_str());
                match ready.claim_agent(stray.clone()).await {
                    Ok(()) => {
                        let agent = self.transport.agent().clone();
                        let _ = tokio::task::spawn_blocking(move || {
                            agent.invalidate_remote_metadata(stray.as_str())
                        })
                        .await;
                    }
                    Err(e) => {
                        tracing::warn!(%address, agent = %stray, error = %e, "the reply's metadata named another engine's agent: left loaded for its owner");
                    }
                }
                return Err(HandshakeError::AgentMismatch {
                    rank,
                    expected,
                    got,
                });
            }
            Err(e) => return Err(e),
        };
        let engine = match ready.register(remote.dlists.clone()).await {
            Ok(engine) => engine,
            Err(refused) => {
                let text = refused.to_string();
                // Loaded but not registered: give it back here.
                let transport = self.transport.clone();
                let _ = tokio::task::spawn_blocking(move || refused.give_back(&*transport)).await;
                return Err(HandshakeError::Refused(text));
            }
        };
        self.stats.handshakes.fetch_add(1, Ordering::Relaxed);
        tracing::info!(engine = %remote.engine, %address, ranks = remote.agents.len(), "engine loaded and registered");
        let connected = Connected {
            engine,
            remote: Arc::new(remote),
        };
        self.remember(&connected);
        Ok(Found::New(connected))
    }

    /// Keeps what reads from a registration need, for any reader that
    /// finds the engine registered already (two readers of one prefill).
    fn remember(&self, connected: &Connected) {
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        loaded.retain(|c| c.engine.state() != EngineState::Released);
        loaded.push(connected.clone());
    }

    /// What this decoder loaded for `engine`'s registration, if anything.
    fn loaded(&self, engine: &EngineRef) -> Option<Connected> {
        self.loaded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|c| c.engine.same_registration(engine))
            .cloned()
    }

    /// One request: a read of `block` of `rank`, as vLLM's decode does it.
    /// Under a read guard (refused at once when the engine is not live),
    /// the request gets a fresh id, which is leased (the service's
    /// heartbeats name it) from now until its read has ended; the read is
    /// posted and polled on a blocking thread (`RQ:` before it, `RD:` on
    /// completion, see the [protocol](super)), its outcome counted, its
    /// status reported to the service, and then the lease is removed. No
    /// lease outlives its read, so heartbeats name exactly the requests
    /// still pending.
    ///
    /// A read given up in progress (timed out, or failed by the service)
    /// ends its guard with [`nixl_keepalive::TransferGuard::give_up`]: not a
    /// completion, and for a time-out the service's evidence of a hung
    /// prefill. Its landing slot stays lent until the service says the
    /// transfer is over ([`Destination::Reusable`]), else for good.
    ///
    /// Every count is made before the guard ends: whoever sees the engine
    /// released (the last guard's end releases it) sees the read counted.
    pub async fn read(&self, connected: &Connected, rank: u16, block: u32) -> ReadOutcome {
        let at = Target { rank, block };
        self.transfer(connected, Direction::Read, at).await
    }

    /// Writes block `block` of rank `rank` of a push-mode decode (see the
    /// module docs): as [`Decoder::read`], with a write guard
    /// ([`EngineRef::begin_write_owned`]), the request leased at the
    /// decode and renewed by this process's keepalive until the write
    /// ends. [`ReadOutcome::Written`] when NIXL said DONE; the decode
    /// checks the bytes.
    pub async fn write(&self, connected: &Connected, rank: u16, block: u32) -> ReadOutcome {
        let at = Target { rank, block };
        self.transfer(connected, Direction::Write, at).await
    }

    async fn transfer(
        &self,
        connected: &Connected,
        direction: Direction,
        at: Target,
    ) -> ReadOutcome {
        let begun = match direction {
            Direction::Read => connected.engine.begin_read_owned(),
            Direction::Write => connected.engine.begin_write_owned(),
        };
        let guard = match begun {
            Ok(g) => g,
            Err(_) => {
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                return ReadOutcome::Released;
            }
        };
        let request = self.next_request_id();
        let engine = connected.remote.engine.clone();
        match self
            .handle
            .add_leases(&engine, vec![request.clone()], false)
        {
            Ok(()) => {}
            // Stopping: nothing renews leases any more, and the read's
            // engine is released or handed back.
            Err(LeaseError::Stopped(_)) => {
                tracing::debug!("lease not added: the service has stopped")
            }
            // Our own ids (`<decode agent>-<n>`) are always valid.
            Err(e) => tracing::error!(error = %e, "lease not added"),
        }
        let remote = connected.remote.clone();
        let agent = self.transport.agent().clone();
        let timeout = self.options.read_timeout;
        let stats = self.stats.clone();
        let id = request.clone();
        let who = engine.clone();
        let (outcome, given_up) = tokio::task::spawn_blocking(move || {
            let outcome =
                remote.transfer_block(&agent, direction, &id, at, timeout, &|| guard.is_failed());
            count(&stats, &who, &id, at.rank, at.block, outcome);
            let given_up = match outcome {
                ReadOutcome::TimedOut { .. } => Some(guard.give_up_holding(GiveUp::TimedOut, 1)),
                ReadOutcome::Abandoned { .. } => Some(guard.give_up_holding(GiveUp::Cancelled, 1)),
                _ => {
                    match outcome.status() {
                        Some(status) => guard.finish(status),
                        None => drop(guard),
                    }
                    None
                }
            };
            (outcome, given_up)
        })
        .await
        .expect("reads do not panic");
        // A stopped service renews nothing: there is nothing to remove.
        let _ = self.handle.remove_leases(&engine, vec![request]);
        if let (Some(given_up), Some(slot)) = (given_up, outcome.lent_slot()) {
            self.reclaim_when_over(connected.remote.clone(), slot, given_up);
        }
        outcome
    }

    /// Watches a given-up read's transfer to its end (in a task: its
    /// request polled every few milliseconds, as `getXferStatus` must be
    /// for UCX to progress it): it completes when a frozen prefill resumes
    /// and fails when it dies. Then the service hears of its end (the
    /// engine is no longer fenced by it), its request is released and its
    /// landing slot handed back. A slot whose request is missing (never
    /// kept) is abandoned and retired unless the release proves it over.
    fn reclaim_when_over(&self, remote: Arc<RemoteEngine>, slot: usize, given_up: GivenUpRead) {
        let stats = self.stats.clone();
        stats.slots_lent.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(async move {
            let destination = match remote.take_running(slot) {
                Some(mut req) => {
                    let mut pause = Duration::from_millis(1);
                    let status = loop {
                        match req.status() {
                            Ok(XferState::InProgress) => {}
                            Ok(_) => break NixlStatus::SUCCESS,
                            Err(e) => break e.status,
                        }
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_millis(20));
                    };
                    *stats
                        .given_up_ended
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .entry(status.raw())
                        .or_default() += 1;
                    metrics::counter!("nixl_keepalive_pd_given_up_ended_total", "status" => status.name())
                        .increment(1);
                    tracing::info!(engine = %remote.engine, slot, %status, "a given-up READ ended: its landing slot is free again");
                    let destination = given_up.ended(status);
                    drop(req);
                    destination
                }
                None => {
                    given_up.abandon();
                    given_up.destination().await
                }
            };
            stats.slots_lent.fetch_sub(1, Ordering::Relaxed);
            match destination {
                Destination::Reusable => {
                    remote.return_slot(slot);
                    stats.slots_returned.fetch_add(1, Ordering::Relaxed);
                }
                // `Retire`, and any verdict this build does not know: the
                // safe answer is never to reuse the slot.
                _ => {
                    stats.slots_retired.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(engine = %remote.engine, slot, "landing slot retired: the given-up READ was abandoned and may still write it; never reused");
                }
            }
        });
    }

    /// Runs the reader for one prefill address until `shutdown`: handshake
    /// (retrying while nobody answers), rounds of random reads, a probe
    /// handshake every `probe_interval`, and after the engine is marked,
    /// waits for its release before handshaking again.
    pub fn spawn(
        self: &Arc<Self>,
        address: PeerAddr,
        shutdown: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move { me.reader_loop(address, shutdown).await })
    }

    /// Waits out a conflicting claimant's back-off at `address`, at most
    /// `pause`, asking the address (the side-channel reply only, nothing
    /// loaded) every retry step: it ends as soon as another claimant (a
    /// new engine id or incarnation) or nobody answers there, so an
    /// honest prefill that starts where a conflicting one was is
    /// handshaken at once, not after the other's back-off.
    async fn until_another_claimant(
        &self,
        address: &PeerAddr,
        claimant: &super::retry::Claimant,
        pause: Duration,
    ) {
        let deadline = tokio::time::Instant::now() + pause;
        loop {
            let step = self
                .options
                .retry
                .mul_f64(0.5 + rand::random::<f64>() / 2.0)
                .max(Duration::from_millis(1));
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return;
            }
            tokio::time::sleep_until((now + step).min(deadline)).await;
            if tokio::time::Instant::now() >= deadline {
                return;
            }
            match fetch(address, self.options.handshake_timeout).await {
                Ok(reply) if Some((reply.engine.clone(), reply.incarnation)) == *claimant => {}
                _ => return,
            }
        }
    }

    async fn reader_loop(self: Arc<Self>, address: PeerAddr, shutdown: CancellationToken) {
        let mut current: Option<Connected> = None;
        let mut last_probe: Option<Instant> = None;
        let o = &self.options;
        let mut retry = super::retry::Retry::new(o.retry, o.retry_max);
        while !shutdown.is_cancelled() {
            if let Some(c) = &current {
                if c.engine.state() != EngineState::Live {
                    // Waits for this very registration's release (a
                    // pinned id's successor is another registration), at
                    // most a minute: a release the transport never
                    // returns must not stop the reader for good.
                    let c = current.take().expect("checked");
                    tokio::select! {
                        _ = c.engine.released() => {}
                        _ = tokio::time::sleep(Duration::from_secs(60)) => {}
                        _ = shutdown.cancelled() => {}
                    }
                    last_probe = None;
                }
            }
            let probe_due = last_probe.is_none_or(|t| t.elapsed() >= self.options.probe_interval);
            if current.is_none() || probe_due {
                last_probe = Some(Instant::now());
                match self.connect_by(&address, current.as_ref()).await {
                    (Ok(h), _) => {
                        let failures = retry.succeeded();
                        // The next failure is told at once.
                        self.handshake_log
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .forget(|(a, _)| *a == address);
                        if failures > 0 {
                            tracing::info!(%address, failures, "handshake succeeded after failures");
                        }
                        if let Found::New(c) = h {
                            current = Some(c);
                        }
                    }
                    (Err(e), claimant) => {
                        let now = tokio::time::Instant::now();
                        // Earned by whoever answered: a new engine id or
                        // incarnation here starts fresh.
                        let mut after = retry.failed_by(claimant.clone());
                        let conflicted = matches!(e, HandshakeError::Conflict(_));
                        if let HandshakeError::Conflict(conflict) = &e {
                            // The service logged the conflict once, with
                            // both sides; the same claimant conflicting
                            // again does not heal in milliseconds: back off
                            // further (woken early if another claimant
                            // answers here).
                            if after.in_a_row > 1 {
                                after.pause = after.pause.max(CONFLICT_PAUSE);
                            }
                            tracing::debug!(%address, %conflict, next_try_in = ?after.pause, "handshake refused: identity conflict");
                        } else if let Some(suppressed) = self
                            .handshake_log
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .admit((address.clone(), e.reason()), now)
                        {
                            tracing::warn!(
                                %address,
                                error = %e,
                                reason = e.reason(),
                                in_a_row = after.in_a_row,
                                suppressed,
                                next_try_in = ?after.pause,
                                "handshake failed; retrying with back-off"
                            );
                        }
                        if current.is_none() {
                            let wait = async {
                                if conflicted {
                                    self.until_another_claimant(&address, &claimant, after.pause)
                                        .await
                                } else {
                                    tokio::time::sleep(after.pause).await
                                }
                            };
                            tokio::select! {
                                _ = shutdown.cancelled() => break,
                                _ = wait => {}
                            }
                            continue;
                        }
                    }
                }
            }
            let Some(c) = current.clone() else { continue };
            let mut reads = tokio::task::JoinSet::new();
            let direction = self.options.direction;
            for at in round_targets(&c.remote, self.options.reads_in_flight, direction) {
                let me = self.clone();
                let c = c.clone();
                reads.spawn(async move { me.transfer(&c, direction, at).await });
            }
            while reads.join_next().await.is_some() {}
            // The pause ends early when this registration is released (by
            // membership, the router or the service): the reader then
            // handshakes for whoever is at the address. Without that, a
            // reader kept running by another record naming the address
            // slept out its whole pause (issue 47, item 1).
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(self.options.read_pause) => {}
                _ = c.engine.released() => {}
            }
        }
    }
}

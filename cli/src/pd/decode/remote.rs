//! One loaded prefill engine ([`RemoteEngine`]): its metadata in the
//! decode agent, its remote dlists, the local landing slots, and one
//! transfer posted and polled to its end with its bytes checked. Blocking
//! NIXL calls only: the [`super::Decoder`] runs them on blocking threads.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nixl_agent::cuda::{CudaError, DeviceMemory, VramRegistration};
use nixl_agent::{Agent, Desc, DlistHandle, DramRegistration, MemType, XferState};
use nixl_keepalive::transport::nixl::RemoteDlists;
use nixl_keepalive::{AgentName, EngineId, PeerAddr};

use super::handshake::HandshakeError;
use super::transfer::{Direction, ReadOutcome, Target};
use crate::pd::pattern;
use crate::pd::prefill::Memory;
use crate::pd::wire::{self, HandshakeReply};

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
    /// over ([`Destination::Reusable`](nixl_keepalive::Destination::Reusable)). A slot not lent is left alone.
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

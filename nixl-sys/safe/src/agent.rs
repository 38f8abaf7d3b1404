//! The safe layer: owned handles with `Drop`.
//!
//! # Thread safety
//!
//! A NIXL agent's default thread-sync mode is NONE: two threads calling the
//! same agent at once race inside NIXL. This crate only creates agents in a
//! locking mode ([`ThreadSync::Rw`], the default, or
//! [`ThreadSync::Strict`]); that is what makes [`Agent`] `Send + Sync`.
//! Rule for users: share one `Agent` freely between threads; each
//! [`XferRequest`] is driven by one thread at a time (its methods take
//! `&mut self`). NIXL's own progress thread, when enabled, takes the
//! backend's locks itself.
//!
//! # Progress thread
//!
//! With a progress thread, NIXL polls the UCX worker in a loop, by default
//! without sleeping, which keeps one core busy per agent. The default here
//! is [`ProgressThread::Off`]: UCX then progresses inside NIXL calls
//! (notifications, transfer status), which is enough for a caller that
//! polls regularly, and costs no CPU while idle. See [`ProgressThread`].

use std::collections::HashSet;
use std::ffi::{c_int, c_void, CStr, CString};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use nixl_sys::{CapiAgentConfig, NixlStatus, Runtime};

use crate::binding::{op, CapiGuard};
use crate::endpoints::{EndpointCloses, UcxEndpoints};
use crate::error::{check_agent_name, NixlError, WithDetail};
use crate::sockets::{self, Connections, Look, Recorded};

type CapiHandle = *mut c_void;

/// NIXL's locking mode for an agent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ThreadSync {
    /// Readers-writer lock: const operations (notifications, posting and
    /// checking transfers) run concurrently, metadata changes exclusively.
    #[default]
    Rw,
    /// One lock around every agent call.
    Strict,
}

impl ThreadSync {
    fn capi(self) -> c_int {
        // nixl_capi_thread_sync_t: NONE=0, STRICT=1, RW=2.
        match self {
            ThreadSync::Strict => 1,
            ThreadSync::Rw => 2,
        }
    }
}

/// NIXL's progress thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgressThread {
    /// No progress thread: UCX progresses only inside NIXL calls. Costs no
    /// CPU while idle. A dead peer is noticed on the next call that
    /// progresses the worker (a notification poll, a transfer check).
    Off,
    /// A progress thread that sleeps `delay` between polls of the UCX
    /// worker (NIXL's `pthrDelay`, in microseconds). `Duration::ZERO` is
    /// NIXL's default: a busy loop that keeps one core at 100%.
    Polling {
        /// Sleep between polls.
        delay: Duration,
    },
}

/// How to create an [`Agent`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentConfig {
    /// Locking mode (always a locking one; see the module docs).
    pub thread_sync: ThreadSync,
    /// NIXL's progress thread.
    pub progress_thread: ProgressThread,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            thread_sync: ThreadSync::Rw,
            progress_thread: ProgressThread::Off,
        }
    }
}

/// A memory descriptor: an address range on a device (0 for DRAM).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Desc {
    /// Start address (in the owner's address space).
    pub addr: u64,
    /// Length in bytes.
    pub len: usize,
    /// Device id (0 for DRAM).
    pub dev_id: u64,
}

/// The kind of memory a registration or a descriptor list is of (NIXL's
/// segment types; `nixl_capi_mem_type_t`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MemType {
    /// Host memory (`DRAM_SEG`).
    #[default]
    Dram,
    /// GPU memory (`VRAM_SEG`), the descriptor's device id its ordinal.
    Vram,
}

impl MemType {
    fn capi(self) -> c_int {
        match self {
            MemType::Dram => 0,
            MemType::Vram => 1,
        }
    }
}

/// A notification received from a remote agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// The sending agent's name.
    pub agent: String,
    /// The message bytes.
    pub message: Vec<u8>,
}

/// Where a transfer stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XferState {
    /// Complete (`NIXL_SUCCESS`).
    Done,
    /// Still running (`NIXL_IN_PROG`).
    InProgress,
}

impl XferState {
    fn from_ok(s: NixlStatus) -> XferState {
        if s == NixlStatus::IN_PROG {
            XferState::InProgress
        } else {
            XferState::Done
        }
    }
}

pub(crate) struct AgentInner {
    rt: &'static Runtime,
    capi: CapiHandle,
    name: String,
    /// The TCP sockets UCX opened while each remote agent's metadata was
    /// loaded, shut down at its invalidation (see `sockets.rs`).
    sockets: Mutex<Recorded>,
    /// Notifications taken while an invalidation progressed the worker to
    /// let UCX close the sockets it shut down: handed out first by the
    /// next [`Agent::get_notifs`], so none is lost.
    stashed: Mutex<Vec<Notification>>,
    /// The ports this agent's UCX workers listen on (those that appeared
    /// while its backend was created): where peers connect to it.
    ucx_ports: std::sync::OnceLock<HashSet<u16>>,
    /// Held across a load and its recording, and across a release's
    /// shutting down: a release on one thread never judges the host of an
    /// agent another thread is loading (not recorded yet) as free of
    /// loaded agents, and never looks while a load's sockets appear.
    socket_work: Mutex<()>,
}

/// How long an invalidation progresses the worker at most for UCX to close
/// the descriptors of the connections it shut down (UCX reads their end at
/// its next progress; this bounds a worker that does not get to it).
const SHUT_SOCKETS_PATIENCE: Duration = Duration::from_millis(200);

/// How long an invalidation that shut connections down watches for the
/// peer connecting back (it does at its next progress of its worker: 1-10
/// ms for this project's `prefill`).
const RECONNECT_WATCH: Duration = Duration::from_millis(30);

// SAFETY: the only non-thread-safe field is `capi`, a pointer to NIXL's
// heap-allocated agent handle, which is tied to no thread. The agent was
// created with a locking thread-sync mode (RW or STRICT; `ThreadSync` has no
// NONE), so NIXL serialises calls made from any thread itself; the rest of
// the state is behind `Mutex`es and a `OnceLock`.
unsafe impl Send for AgentInner {}
// SAFETY: as for `Send`: concurrent `&self` calls into the agent are
// serialised by NIXL's own lock (RW or STRICT mode).
unsafe impl Sync for AgentInner {}

impl Drop for AgentInner {
    fn drop(&mut self) {
        // Progress the agent's UCX workers until they are idle (NIXL's
        // `getNotifs` does; the notifications are dropped with the agent).
        // Why, before the agent is destroyed: a release's endpoint closes
        // finish in UCX's next progress, and a READ cancelled in flight can
        // leave its copy queued on UCX's cross-memory-attach transport
        // until progressed. UCX 1.23 destroys such an endpoint at worker
        // destruction without running its queue, and its destructor asserts
        // the queue is empty (`arbiter.c:36 Assertion
        // 'ucs_arbiter_group_is_empty(group)'`, seen once in a Python
        // decoder's teardown). A failure here has nobody left to tell: the
        // agent is destroyed next either way.
        let _ = self.take_notifs();
        crate::failures::forget_agent(&self.name);
        crate::gpu::forget_agent(&self.name);
        // SAFETY: `self.capi` is the live handle `Agent::new` created;
        // every registration, dlist handle and request made by this agent
        // holds an `Arc` to it, so none is left and this is the last use
        // of the handle, destroyed once.
        unsafe { (self.rt.capi().destroy_agent)(self.capi) };
    }
}

impl AgentInner {
    /// NIXL's `getNotifs`: progresses the agent's UCX workers until they
    /// are idle and takes the notifications received since the last call,
    /// into a map that the returned guard owns.
    fn take_notifs(&self) -> Result<CapiGuard, NixlError> {
        let rt = self.rt;
        let c = rt.capi();
        let mut map: CapiHandle = std::ptr::null_mut();
        // SAFETY: `map` is a valid out-pointer; the new map is owned by
        // `guard` below, which destroys it once.
        let st = unsafe { (c.create_notif_map)(&mut map) };
        op("createNotifMap", rt.capi_status(st))?;
        // SAFETY: `map` is the live map just created (the status was
        // checked), destroyed by `destroy_notif_map` and owned by nothing
        // else.
        let guard = unsafe { CapiGuard::adopt(map, c.destroy_notif_map) };
        // SAFETY: `self.capi` is live (this is a method of the agent, or
        // its drop before the destroy), `guard.ptr()` a live notification map,
        // and a null opt-args handle is allowed (no options).
        let st = unsafe { (c.get_notifs)(self.capi, guard.ptr(), std::ptr::null_mut()) };
        op("getNotifs", rt.capi_status(st))?;
        Ok(guard)
    }

    /// NIXL's `getNotifs` (progressing the workers), read into a list.
    fn collect_notifs(&self) -> Result<Vec<Notification>, NixlError> {
        let rt = self.rt;
        let c = rt.capi();
        let guard = self.take_notifs()?;
        let mut out = Vec::new();
        // SAFETY: `guard.ptr()` is a live map for the whole block (the guard
        // drops after it), and only valid out-pointers are passed. On
        // success `agent` is a non-null pointer to a key string of the map
        // (NUL-terminated), and `data` points to `len` bytes of a message
        // in it; both stay valid while the map is neither changed nor
        // destroyed, which nothing does before they are copied out. `data`
        // is read only when `len > 0`.
        unsafe {
            let mut n = 0usize;
            op(
                "getNotifs",
                rt.capi_status((c.notif_map_size)(guard.ptr(), &mut n)),
            )?;
            for i in 0..n {
                let mut agent: *const std::ffi::c_char = std::ptr::null();
                op(
                    "getNotifs",
                    rt.capi_status((c.notif_map_get_agent_at)(guard.ptr(), i, &mut agent)),
                )?;
                let name = CStr::from_ptr(agent).to_string_lossy().into_owned();
                let mut m = 0usize;
                op(
                    "getNotifs",
                    rt.capi_status((c.notif_map_get_notifs_size)(guard.ptr(), agent, &mut m)),
                )?;
                for j in 0..m {
                    let mut data: *const c_void = std::ptr::null();
                    let mut len = 0usize;
                    op(
                        "getNotifs",
                        rt.capi_status((c.notif_map_get_notif)(
                            guard.ptr(),
                            agent,
                            j,
                            &mut data,
                            &mut len,
                        )),
                    )?;
                    let message = if len == 0 {
                        Vec::new()
                    } else {
                        std::slice::from_raw_parts(data as *const u8, len).to_vec()
                    };
                    out.push(Notification {
                        agent: name.clone(),
                        message,
                    });
                }
            }
        }
        Ok(out)
    }

    fn recorded(&self) -> std::sync::MutexGuard<'_, Recorded> {
        self.sockets.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn socket_work(&self) -> std::sync::MutexGuard<'_, ()> {
        self.socket_work
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn stash(&self) -> std::sync::MutexGuard<'_, Vec<Notification>> {
        self.stashed.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// After `remote`'s invalidation: shuts down the still-open sockets
    /// recorded at its loads, then progresses the worker (notifications go
    /// to the stash) until UCX has closed their descriptors. Returns how
    /// many sockets were shut down, and how many of those UCX had not
    /// closed when it stopped waiting ([`SHUT_SOCKETS_PATIENCE`]).
    ///
    /// Connections the peer opened *to* this agent. UCX's TCP transport
    /// gives the peer's endpoint for this agent the decode's socket when
    /// the two sides' connection sequence numbers agree; when they do not
    /// (seen after fast release-reload rounds, when the peer had not yet
    /// made an endpoint for a released one), the peer connects to this
    /// agent's UCX listening port instead, and that connection, received
    /// here with no endpoint of ours, stays until the peer's keepalive
    /// fails it. A peer also connects again when its endpoint's socket ends
    /// before UCX acknowledged it. Those connections carry no name, only
    /// the peer's host. So when the released agent was the last loaded one
    /// on its hosts (no other agent recorded here has UCX there), every
    /// connection accepted on this agent's UCX ports from those hosts is
    /// shut down too, watched for [`RECONNECT_WATCH`], each once the worker
    /// has been progressed after it was first seen (then UCX has
    /// acknowledged it, and the peer fails its endpoint instead of
    /// connecting again). UCX's connection from this worker to itself is
    /// never touched. While another loaded agent shares the host nothing
    /// accepted is touched (its own may be among them); what is left then
    /// goes at the release of the last one there, or at the peer's
    /// keepalive. This assumes the peers do not load this agent's metadata
    /// themselves (pull mode): one that did would reach it the same way,
    /// and its connection would be cut when the last agent on its host is
    /// released here.
    fn shut_recorded(&self, remote: &[u8], connections: Connections) -> (u32, u32) {
        let _work = self.socket_work();
        let ports = self.ucx_ports.get().cloned().unwrap_or_default();
        let (agent, last_on_host, spared) = {
            let mut recorded = self.recorded();
            let agent = recorded.take(remote);
            if connections == Connections::Keep {
                // Its peer may still send over a connection it opened to
                // us: every such connection open now is spared from later
                // releases (from any host, when the load saw no host).
                let look = Look::now();
                let accepted = if agent.peers.is_empty() {
                    look.accepted_on(&ports)
                } else {
                    look.accepted_from(&ports, &agent.peers)
                };
                recorded.spare(&look, accepted);
                return (0, 0);
            }
            let shared = recorded.shares_a_host(&agent.peers);
            (agent, !shared, recorded.spared().clone())
        };
        if agent.inodes.is_empty() {
            return (0, 0);
        }
        let started = Instant::now();
        let accepted = |look: &Look| -> Vec<u64> {
            if last_on_host {
                let mut found = look.accepted_from(&ports, &agent.peers);
                found.retain(|inode| !spared.contains(inode));
                found
            } else {
                Vec::new()
            }
        };
        let mut targets: HashSet<u64> = agent.inodes.clone();
        let look = Look::now();
        let mut shut = sockets::shut_down(&look, &targets);
        let mut seen: HashSet<u64> = accepted(&look).into_iter().collect();
        if shut == 0 && seen.is_empty() {
            // All closed already: the forced close destroyed them (a
            // connection not shared with the peer's direction), or UCX had
            // (a dead peer).
            return (0, 0);
        }
        // A failed progress (the agent is being torn down) ends the wait.
        while let Ok(notifs) = self.collect_notifs() {
            self.stash().extend(notifs);
            let look = Look::now();
            for inode in accepted(&look) {
                if !seen.insert(inode) && targets.insert(inode) {
                    shut += sockets::shut_down(&look, &HashSet::from([inode]));
                }
            }
            let open = sockets::open_count(&look, &targets);
            let settled = open == 0 && seen.iter().all(|i| targets.contains(i));
            let waited = started.elapsed();
            let watched = !last_on_host || waited >= RECONNECT_WATCH;
            if (settled && watched) || waited >= SHUT_SOCKETS_PATIENCE {
                return (shut, open);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        (shut, sockets::open_count(&Look::now(), &targets))
    }
}

/// Refuses a remote agent name NIXL would cut at a NUL byte (the V1 C API
/// takes C strings; with the shim the whole name would arrive, but no such
/// name is ever loaded, see [`Agent::load_remote_metadata`]).
fn remote_name(operation: &'static str, remote: &str) -> Result<(), NixlError> {
    check_agent_name(remote.as_bytes())
        .map(|_| ())
        .map_err(|p| NixlError::agent_name(operation, remote.as_bytes(), p))
}

/// A NIXL agent with the UCX backend. Cheap to clone (shared handle);
/// destroyed when the last clone and the last handle made from it drop.
#[derive(Clone)]
pub struct Agent {
    inner: Arc<AgentInner>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("name", &self.inner.name)
            .finish()
    }
}

impl Agent {
    /// Creates an agent named `name` with the UCX backend.
    pub fn new(rt: &'static Runtime, name: &str, config: &AgentConfig) -> Result<Agent, NixlError> {
        check_agent_name(name.as_bytes())
            .map_err(|p| NixlError::agent_name("createAgent", name.as_bytes(), p))?;
        let cname = CString::new(name).expect("checked: no NUL byte");
        let (prog, delay) = match config.progress_thread {
            ProgressThread::Off => (false, 0),
            ProgressThread::Polling { delay } => {
                (true, delay.as_micros().min(u64::MAX as u128) as u64)
            }
        };
        let cfg = CapiAgentConfig {
            enable_prog_thread: prog,
            enable_listen_thread: false,
            listen_port: 0,
            thread_sync: config.thread_sync.capi(),
            num_workers: 1,
            pthr_delay_us: delay,
            lthr_delay_us: 100_000,
            capture_telemetry: false,
        };
        let c = rt.capi();
        let mut agent: CapiHandle = std::ptr::null_mut();
        // SAFETY: `cname` is NUL-terminated and `cfg` a `#[repr(C)]`
        // `nixl_capi_agent_config_t`, both outliving the call (NIXL copies
        // them); `agent` is a valid out-pointer for the new handle.
        let st = unsafe { (c.create_configured_agent)(cname.as_ptr(), &cfg, &mut agent) };
        op("createAgent", rt.capi_status(st)).detail(|| format!("agent {name}"))?;
        // From here `inner`'s Drop destroys the agent on any error.
        let inner = Arc::new(AgentInner {
            rt,
            capi: agent,
            name: name.to_string(),
            sockets: Mutex::default(),
            stashed: Mutex::default(),
            ucx_ports: std::sync::OnceLock::new(),
            socket_work: Mutex::default(),
        });

        let ucx = c"UCX";
        let mut mems: CapiHandle = std::ptr::null_mut();
        let mut params: CapiHandle = std::ptr::null_mut();
        // SAFETY: `agent` is the handle just created (owned by `inner`,
        // destroyed only when it drops); `ucx` is NUL-terminated; `mems`
        // and `params` are valid out-pointers.
        let st = unsafe { (c.get_plugin_params)(agent, ucx.as_ptr(), &mut mems, &mut params) };
        op("getPluginParams", rt.capi_status(st)).detail(|| "UCX plugin".into())?;
        let mut backend: CapiHandle = std::ptr::null_mut();
        let listening_before = Look::now();
        // SAFETY: `agent` is live and `params`/`mems` are the live lists
        // `get_plugin_params` returned (it succeeded); `backend` is a valid
        // out-pointer. The lists are ours, destroyed once each after
        // `create_backend` has read them. The backend handle is only a
        // `new`'d wrapper around the agent-owned `nixlBackendH*`, so
        // destroying it (once, when non-null) leaves the backend in place.
        let st = unsafe {
            let st = (c.create_backend)(agent, ucx.as_ptr(), params, &mut backend);
            (c.destroy_params)(params);
            (c.destroy_mem_list)(mems);
            if !backend.is_null() {
                (c.destroy_backend)(backend);
            }
            st
        };
        op("createBackend", rt.capi_status(st)).detail(|| "UCX".into())?;
        let _ = inner
            .ucx_ports
            .set(Look::now().listening_since(&listening_before));
        // The UCX plugin is loaded now: settle the endpoint close mode.
        let _ = rt.endpoint_close_mode();
        Ok(Agent { inner })
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The runtime this agent lives in.
    pub fn runtime(&self) -> &'static Runtime {
        self.inner.rt
    }

    /// Allocates `len` bytes of zeroed DRAM and registers them with NIXL.
    pub fn register_dram(&self, len: usize) -> Result<DramRegistration, NixlError> {
        DramRegistration::new(self.inner.clone(), len)
    }

    /// Registers `len` bytes at `addr` (memory the caller owns and keeps
    /// alive for the [`Registered`]'s life) as `mem` of device `dev_id`.
    pub(crate) fn register_region(
        &self,
        mem: MemType,
        addr: usize,
        len: usize,
        dev_id: u64,
    ) -> Result<Registered, NixlError> {
        let rt = self.inner.rt;
        let c = rt.capi();
        let mut reg = Registered {
            agent: self.inner.clone(),
            reg_dlist: std::ptr::null_mut(),
            registered: false,
        };
        // SAFETY: `reg.reg_dlist` is a valid out-pointer and `mem.capi()` a
        // valid `nixl_capi_mem_type_t` (DRAM 0 or VRAM 1); the new list is
        // destroyed once, by `Registered`'s drop.
        let st = unsafe { (c.create_reg_dlist)(mem.capi(), &mut reg.reg_dlist) };
        op("registerMem", rt.capi_status(st))?;
        // SAFETY: `reg.reg_dlist` is the live list created above; a null
        // metadata pointer with length 0 is allowed. NIXL only records the
        // range here; the memory itself is reached by later transfers,
        // which is why the caller (`register_vram`) keeps it alive longer
        // than the returned `Registered`.
        let st = unsafe {
            (c.reg_dlist_add_desc)(reg.reg_dlist, addr, len, dev_id, std::ptr::null(), 0)
        };
        op("registerMem", rt.capi_status(st))?;
        // SAFETY: `reg.agent.capi` is this live agent's handle and
        // `reg.reg_dlist` the live list above; a null opt-args handle is
        // allowed (no options).
        let st = unsafe { (c.register_mem)(reg.agent.capi, reg.reg_dlist, std::ptr::null_mut()) };
        op("registerMem", rt.capi_status(st))
            .detail(|| format!("{mem:?}, {len} bytes, device {dev_id}"))?;
        reg.registered = true;
        Ok(reg)
    }

    /// This agent's metadata, to hand to peers out of band.
    pub fn local_metadata(&self) -> Result<Vec<u8>, NixlError> {
        let rt = self.inner.rt;
        let mut data: CapiHandle = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: `self.inner.capi` is this live agent's handle; `data` and
        // `len` are valid out-pointers. On success the C API has set `data`
        // to a non-null malloc'd copy of the metadata, `len` bytes long (it
        // fails rather than return null); it is copied out, then freed once
        // with `rt.free`, and not used after.
        unsafe {
            let st = (rt.capi().get_local_md)(self.inner.capi, &mut data, &mut len);
            op("getLocalMD", rt.capi_status(st))?;
            let v = std::slice::from_raw_parts(data as *const u8, len).to_vec();
            rt.free(data);
            Ok(v)
        }
    }

    /// Loads a peer's metadata; returns the peer's agent name, exactly as
    /// NIXL holds it. `NOT_ALLOWED` when that agent's metadata is already
    /// loaded (invalidate it first).
    ///
    /// Metadata whose agent name NIXL's C interfaces would cut (a NUL
    /// byte inside) or that is not UTF-8 is refused
    /// ([`NixlError::is_refused_agent_name`]) and unloaded again by its
    /// exact bytes, so that no caller ever holds a name that addresses
    /// another agent: `victim-rank0\0zz` must never come back as the live
    /// `victim-rank0`, whose metadata the caller's undo would invalidate.
    /// (With the V1 C API, which returns names as C strings, the cut
    /// happens inside NIXL and cannot be seen; the 1.5.x runtime goes
    /// through the shim, which returns the length.)
    pub fn load_remote_metadata(&self, metadata: &[u8]) -> Result<String, NixlError> {
        let rt = self.inner.rt;
        // The sockets UCX opens for the new endpoint appear during the load
        // (its TCP transport connects when the endpoint is created): looked
        // for only where invalidations force the close, whose leftovers
        // they are.
        let recording = rt.endpoint_close_mode().is_force() && sockets::shutdown_on();
        let work = recording.then(|| self.inner.socket_work());
        let before = recording.then(Look::now);
        // The endpoints NIXL creates for the agent are made inside the
        // load, on this thread: listed, so that their failures are named.
        let ((raw, name), eps) = crate::failures::around_load(|| {
            // SAFETY: `self.inner.capi` is this agent's handle, live while
            // `self.inner` is, and created by `rt`.
            unsafe { rt.load_remote_md(self.inner.capi, metadata) }
        });
        op("loadRemoteMD", raw)?;
        let name = name.unwrap_or_default();
        if let Some(before) = before {
            let opened = Look::now().opened_since(&before);
            self.inner.recorded().record(&name, opened);
        }
        drop(work);
        match check_agent_name(&name) {
            Ok(n) => {
                eps.belong_to(&self.inner.name, n);
                Ok(n.to_owned())
            }
            Err(problem) => {
                if rt.names_have_length() {
                    // The shim passes the name with its length, so this
                    // reaches exactly the agent just loaded.
                    let _ = rt.ep_close().forcing(
                        // SAFETY: `self.inner.capi` is this agent's live
                        // handle, created by `rt`; the closure runs at once.
                        || unsafe { rt.invalidate_remote_md(self.inner.capi, &name) },
                    );
                    // Just loaded, never used: nothing can be in flight.
                    self.inner.shut_recorded(&name, Connections::Shut);
                }
                Err(NixlError::agent_name("loadRemoteMD", &name, problem))
            }
        }
    }

    /// Forgets a peer's metadata and disconnects from it, closing its UCX
    /// endpoints at once when the process's
    /// [`EndpointCloseMode`](crate::EndpointCloseMode) is `Force` (see
    /// [`crate::endpoints`]): its sockets and mappings go with them, live
    /// peer or dead. Returns what the closes did. `NOT_FOUND` for an agent
    /// this one does not know (already invalidated, or dropped by NIXL):
    /// for a release, treat that as done.
    ///
    /// The TCP connections UCX keeps for the agent are left to UCX
    /// ([`Connections::Keep`]): this call cannot know whether a transfer
    /// with the agent may still be running at the peer. A caller that
    /// knows every transfer ended uses
    /// [`Agent::invalidate_remote_metadata_with`] and [`Connections::Shut`].
    pub fn invalidate_remote_metadata(&self, remote: &str) -> Result<EndpointCloses, NixlError> {
        self.invalidate_remote_metadata_with(remote, Connections::Keep)
    }

    /// [`Agent::invalidate_remote_metadata`], then what `connections` says
    /// to the agent's TCP connections.
    ///
    /// The forced close does not take down a TCP connection UCX shares
    /// between both directions: UCX keeps it to receive until the peer
    /// closes it, at the peer's next UCX keepalive round (20 s by default,
    /// never with keepalive off), so a flapping router could run the
    /// process out of descriptors. So the sockets UCX opened while this
    /// agent's metadata was loaded and that are still open are shut down
    /// here ([`EndpointCloses::connections_shut`]), with the connections
    /// the peer opened to this agent when it was the last one loaded on its
    /// host, and the worker is progressed (at least 30 ms when something
    /// was shut down, at most 200 ms; notifications taken meanwhile come
    /// from the next [`Agent::get_notifs`]) until UCX has closed their
    /// descriptors. The peer reads end-of-file and closes its end at once,
    /// whatever its keepalive period. Nothing is shut down when the
    /// invalidation failed (other than `NOT_FOUND`): the agent may still be
    /// loaded. With [`Connections::Keep`] nothing is shut down, and the
    /// connections the peer opened to this process are spared by later
    /// releases. Off for the whole process with `NIXL_SYS_SHUT_SOCKETS=0`.
    /// See `docs/design/releases-and-sockets.md`.
    pub fn invalidate_remote_metadata_with(
        &self,
        remote: &str,
        connections: Connections,
    ) -> Result<EndpointCloses, NixlError> {
        remote_name("invalidateRemoteMD", remote)?;
        let rt = self.inner.rt;
        let (raw, counts) = rt.ep_close().forcing(
            // SAFETY: `self.inner.capi` is this agent's live handle, created
            // by `rt`; the closure runs at once, while `self` is borrowed.
            || unsafe { rt.invalidate_remote_md(self.inner.capi, remote.as_bytes()) },
        );
        let mut closes = EndpointCloses::from_counts(counts);
        let result = op("invalidateRemoteMD", raw).detail(|| format!("agent {remote}"));
        // Invalidated, or unknown to NIXL (dropped by it already): the
        // agent is not loaded, its connections have no owner left.
        let gone = match &result {
            Ok(_) => true,
            Err(e) => e.status == NixlStatus::ERR_NOT_FOUND,
        };
        if gone {
            crate::failures::forget(&self.inner.name, remote);
            let (shut, pending) = self.inner.shut_recorded(remote.as_bytes(), connections);
            closes.connections_shut = shut;
            closes.connections_pending = pending;
            // The agent's rkeys went with the invalidation: UCX's
            // references left are transfers of other agents.
            closes.gpu = crate::gpu::released(&self.inner.name, remote);
        }
        result?;
        Ok(closes)
    }

    /// Calls `on_failure` each time UCX fails one of this agent's
    /// endpoints, from the moment it happens (see [`crate::failures`]):
    /// with the remote agent's name for endpoints its loads created,
    /// without it for any other. Until the returned watch drops. `Err`
    /// with the reason when this process cannot watch (NIXL's own close
    /// mode, `NIXL_UCX_DEEPBIND`, the plugin loaded before this crate).
    pub fn watch_endpoint_failures(
        &self,
        on_failure: impl Fn(crate::failures::EndpointFailure) + Send + Sync + 'static,
    ) -> Result<crate::failures::EndpointFailureWatch, String> {
        crate::failures::watch(&self.inner.name, on_failure)
    }

    /// The UCP endpoints this agent's UCX workers hold now, with UCX's
    /// endpoint counters, read from UCX's own introspection (its VFS tree).
    /// `None` when UCX's VFS is off (`UCX_VFS_ENABLE=n`) or not found.
    pub fn ucx_endpoints(&self) -> Option<UcxEndpoints> {
        crate::endpoints::ucx_endpoints(&self.inner.name)
    }

    /// Sends a notification. `SUCCESS` means handed to UCX, not delivered;
    /// `REMOTE_DISCONNECT` once UCX knows the peer's endpoint failed.
    pub fn gen_notif(&self, remote: &str, message: &[u8]) -> Result<(), NixlError> {
        self.gen_notif_status(remote, message).map(|_| ())
    }

    /// As [`Agent::gen_notif`], returning the raw success status too.
    pub fn gen_notif_status(&self, remote: &str, message: &[u8]) -> Result<NixlStatus, NixlError> {
        remote_name("genNotif", remote)?;
        // SAFETY: `self.inner.capi` is this agent's live handle, created by
        // `self.inner.rt`.
        let raw = unsafe {
            self.inner
                .rt
                .gen_notif(self.inner.capi, remote.as_bytes(), message)
        };
        op("genNotif", raw).detail(|| format!("to agent {remote}"))
    }

    /// Takes the notifications received since the last call. Also
    /// progresses the UCX worker.
    pub fn get_notifs(&self) -> Result<Vec<Notification>, NixlError> {
        let mut out = std::mem::take(&mut *self.inner.stash());
        match self.inner.collect_notifs() {
            Ok(more) => {
                out.extend(more);
                Ok(out)
            }
            Err(e) => {
                // Kept for the next call rather than lost with the error.
                self.inner.stash().splice(0..0, out);
                Err(e)
            }
        }
    }

    /// Prepares a handle over this agent's own (registered) memory.
    pub fn prep_local_dlist(&self, descs: &[Desc]) -> Result<DlistHandle, NixlError> {
        self.prep(None, MemType::Dram, descs)
    }

    /// [`Agent::prep_local_dlist`] over memory of type `mem` (VRAM
    /// registered with [`Agent::register_vram`]).
    pub fn prep_local_dlist_in(
        &self,
        mem: MemType,
        descs: &[Desc],
    ) -> Result<DlistHandle, NixlError> {
        self.prep(None, mem, descs)
    }

    /// [`Agent::prep_remote_dlist`] over `remote`'s memory of type `mem`.
    pub fn prep_remote_dlist_in(
        &self,
        remote: &str,
        mem: MemType,
        descs: &[Desc],
    ) -> Result<DlistHandle, NixlError> {
        self.prep(Some(remote), mem, descs)
    }

    /// Prepares a handle over `remote`'s memory (its metadata must be
    /// loaded; `NOT_FOUND` otherwise).
    pub fn prep_remote_dlist(
        &self,
        remote: &str,
        descs: &[Desc],
    ) -> Result<DlistHandle, NixlError> {
        self.prep(Some(remote), MemType::Dram, descs)
    }

    fn prep(
        &self,
        remote: Option<&str>,
        mem: MemType,
        descs: &[Desc],
    ) -> Result<DlistHandle, NixlError> {
        if let Some(r) = remote {
            remote_name("prepXferDlist", r)?;
        }
        let rt = self.inner.rt;
        let c = rt.capi();
        let mut dl: CapiHandle = std::ptr::null_mut();
        // SAFETY: `dl` is a valid out-pointer and `mem.capi()` a valid
        // `nixl_capi_mem_type_t`; the new list is owned by `guard` below.
        let st = unsafe { (c.create_xfer_dlist)(mem.capi(), &mut dl) };
        op("prepXferDlist", rt.capi_status(st))?;
        // SAFETY: `dl` is the live xfer dlist just created (the status was
        // checked), destroyed by `destroy_xfer_dlist` and owned by nothing
        // else.
        let guard = unsafe { CapiGuard::adopt(dl, c.destroy_xfer_dlist) };
        for d in descs {
            // SAFETY: `guard.ptr()` is the live xfer dlist created above; the
            // descriptor is passed by value (NIXL only records the range).
            let st =
                unsafe { (c.xfer_dlist_add_desc)(guard.ptr(), d.addr as usize, d.len, d.dev_id) };
            op("prepXferDlist", rt.capi_status(st))?;
        }
        // SAFETY: `self.inner.capi` is this agent's live handle, created by
        // `rt`, and `guard.ptr()` a live xfer dlist of `rt` for the whole call.
        // NIXL copies the descriptors, so the dlist may go when this
        // returns.
        let (raw, handle) =
            unsafe { rt.prep_dlist(self.inner.capi, remote.map(str::as_bytes), guard.ptr()) };
        op("prepXferDlist", raw).detail(|| match remote {
            Some(r) => format!("remote agent {r}"),
            None => "local".into(),
        })?;
        Ok(DlistHandle {
            inner: Arc::new(DlistInner {
                agent: self.inner.clone(),
                raw: handle,
                remote: remote.map(str::to_string),
                released: std::sync::atomic::AtomicBool::new(false),
            }),
        })
    }

    /// Creates a READ: remote descriptors `remote_idx` of `remote` into
    /// local descriptors `local_idx` of `local`. With `notif`, the remote
    /// agent gets that message when the transfer completes.
    pub fn create_read(
        &self,
        local: &DlistHandle,
        local_idx: &[i32],
        remote: &DlistHandle,
        remote_idx: &[i32],
        notif: Option<&[u8]>,
    ) -> Result<XferRequest, NixlError> {
        self.create_xfer(XferOp::Read, local, local_idx, remote, remote_idx, notif)
    }

    /// Creates a WRITE: local descriptors `local_idx` of `local` into
    /// remote descriptors `remote_idx` of `remote` (push mode: a prefill
    /// writing its KV cache into a decode's blocks). With `notif`, the
    /// remote agent gets that message once the written bytes are in its
    /// memory. Until the request is DONE or failed, UCX may still read the
    /// local descriptors: they are not the caller's to reuse before.
    pub fn create_write(
        &self,
        local: &DlistHandle,
        local_idx: &[i32],
        remote: &DlistHandle,
        remote_idx: &[i32],
        notif: Option<&[u8]>,
    ) -> Result<XferRequest, NixlError> {
        self.create_xfer(XferOp::Write, local, local_idx, remote, remote_idx, notif)
    }

    /// `makeXferReq` for either direction: one path for the notification's
    /// options and the request's ownership of both dlists.
    fn create_xfer(
        &self,
        direction: XferOp,
        local: &DlistHandle,
        local_idx: &[i32],
        remote: &DlistHandle,
        remote_idx: &[i32],
        notif: Option<&[u8]>,
    ) -> Result<XferRequest, NixlError> {
        let rt = self.inner.rt;
        let c = rt.capi();
        let mut opt: Option<CapiGuard> = None;
        if let Some(msg) = notif {
            let mut p: CapiHandle = std::ptr::null_mut();
            // SAFETY: `p` is a valid out-pointer; once created (the status
            // checked), the opt-args handle is adopted by `g`, its only
            // owner, with its `destroy_opt_args` (destroyed once, on drop),
            // and is live for the two setters. `msg` is valid for `msg.len()` bytes during
            // the call; NIXL copies it into its `std::string`.
            unsafe {
                op("makeXferReq", rt.capi_status((c.create_opt_args)(&mut p)))?;
                let g = CapiGuard::adopt(p, c.destroy_opt_args);
                op(
                    "makeXferReq",
                    rt.capi_status((c.opt_args_set_notif_msg)(
                        g.ptr(),
                        msg.as_ptr().cast(),
                        msg.len(),
                    )),
                )?;
                op(
                    "makeXferReq",
                    rt.capi_status((c.opt_args_set_has_notif)(g.ptr(), true)),
                )?;
                opt = Some(g);
            }
        }
        let opt_ptr = opt.as_ref().map_or(std::ptr::null_mut(), |g| g.ptr());
        // SAFETY: `self.inner.capi` is this agent's live handle. Both dlist
        // handles are live and unreleased for the request's whole life: it
        // keeps their `Arc`s, and a `DlistInner` releases its handle only
        // when the last one drops. `opt_ptr` is null or the live opt-args
        // handle kept in the request (`_opt`), so it outlives it. The index
        // slices are valid for the call. Not checked here: that both dlists
        // were prepared by this agent rather than by another agent of the
        // process (NIXL then uses the backend they share, or refuses
        // them).
        let (raw, req) = unsafe {
            rt.make_xfer_req(
                self.inner.capi,
                direction.raw(),
                local.inner.raw,
                local_idx,
                remote.inner.raw,
                remote_idx,
                opt_ptr,
            )
        };
        op("makeXferReq", raw).detail(|| {
            let peer = remote.inner.remote.as_deref().unwrap_or("?");
            match direction {
                XferOp::Read => format!("READ from {peer}"),
                XferOp::Write => format!("WRITE to {peer}"),
            }
        })?;
        Ok(XferRequest {
            agent: self.inner.clone(),
            raw: req,
            _local: local.inner.clone(),
            _remote: remote.inner.clone(),
            _opt: opt,
            released: false,
        })
    }
}

/// A transfer's direction, as NIXL numbers it (`nixl_xfer_op_t`: READ 0,
/// WRITE 1, in both the C++ API and the C API).
#[derive(Clone, Copy)]
enum XferOp {
    Read,
    Write,
}

impl XferOp {
    fn raw(self) -> c_int {
        match self {
            XferOp::Read => 0,
            XferOp::Write => 1,
        }
    }
}

/// DRAM owned by this crate and registered with an agent. Deregistered,
/// then freed, on drop.
pub struct DramRegistration {
    agent: Arc<AgentInner>,
    reg_dlist: CapiHandle,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the registration owns its heap allocation (`ptr`, `len`) alone and
// the reg dlist is plain C API data; its NIXL calls go through a locking
// agent, so none is tied to the creating thread.
unsafe impl Send for DramRegistration {}
// SAFETY: `&self` methods only read: the fields, and the bytes (`bytes`);
// writing the bytes takes `&mut self` (`bytes_mut`).
unsafe impl Sync for DramRegistration {}

impl DramRegistration {
    fn new(agent: Arc<AgentInner>, len: usize) -> Result<Self, NixlError> {
        let len = len.max(1);
        let buf = vec![0u8; len].into_boxed_slice();
        let ptr = Box::into_raw(buf) as *mut u8;
        let rt = agent.rt;
        let c = rt.capi();
        let mut reg = DramRegistration {
            agent,
            reg_dlist: std::ptr::null_mut(),
            ptr,
            len,
        };
        // SAFETY: `reg.reg_dlist` is a valid out-pointer and 0 is
        // `NIXL_CAPI_DRAM_SEG`; the list is destroyed once (here on a
        // failed registration, else in `drop`).
        let st = unsafe { (c.create_reg_dlist)(0, &mut reg.reg_dlist) };
        op("registerMem", rt.capi_status(st))?;
        // SAFETY: `reg.reg_dlist` is the live list created above; the range
        // is our own allocation of `len` bytes, freed only after it is
        // deregistered (`drop`); null metadata with length 0 is allowed.
        let st = unsafe {
            (c.reg_dlist_add_desc)(reg.reg_dlist, ptr as usize, len, 0, std::ptr::null(), 0)
        };
        op("registerMem", rt.capi_status(st))?;
        // SAFETY: `reg.agent.capi` is the live agent's handle and
        // `reg.reg_dlist` the live list above; null opt args are allowed.
        let st = unsafe { (c.register_mem)(reg.agent.capi, reg.reg_dlist, std::ptr::null_mut()) };
        if let Err(e) = op("registerMem", rt.capi_status(st)) {
            // SAFETY: the registration failed, so only the live list needs
            // destroying; it is nulled below so `drop` does not touch it
            // again.
            unsafe { (c.destroy_reg_dlist)(reg.reg_dlist) };
            reg.reg_dlist = std::ptr::null_mut();
            return Err(e);
        }
        Ok(reg)
    }

    /// The descriptor of the whole region.
    pub fn desc(&self) -> Desc {
        Desc {
            addr: self.ptr as u64,
            len: self.len,
            dev_id: 0,
        }
    }

    /// The descriptor of `len` bytes at `offset` (panics if out of range).
    pub fn sub_desc(&self, offset: usize, len: usize) -> Desc {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "range out of bounds"
        );
        Desc {
            addr: self.ptr as u64 + offset as u64,
            len,
            dev_id: 0,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (a registration has at least one byte).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The bytes. A transfer that writes this memory (a READ into it)
    /// changes them underneath: read only after such a transfer completed.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` is our boxed slice of `len` initialised (zeroed)
        // bytes, freed only in `drop`; no `&mut` to it coexists (`bytes_mut`
        // takes `&mut self`). NIXL writes it only during a READ into it,
        // which the caller must let complete first (see above): not
        // enforced by the types.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, to fill before peers read them.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`; `&mut self` excludes every other Rust
        // reference to the bytes for the borrow's life.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for DramRegistration {
    fn drop(&mut self) {
        let c = self.agent.rt.capi();
        if !self.reg_dlist.is_null() {
            // SAFETY: a non-null `reg_dlist` was registered with this agent,
            // which is live (held by `self.agent`); it is deregistered and
            // destroyed once, here. After deregistration NIXL no longer
            // touches the memory freed below.
            unsafe {
                (c.deregister_mem)(self.agent.capi, self.reg_dlist, std::ptr::null_mut());
                (c.destroy_reg_dlist)(self.reg_dlist);
            }
        }
        // SAFETY: `ptr`/`len` are the boxed slice leaked in `new`, turned
        // back into its `Box` once, here, after NIXL stopped using it.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

/// A region registered by [`Agent::register_region`]: deregistered on drop
/// (before its owner frees the memory).
pub(crate) struct Registered {
    agent: Arc<AgentInner>,
    reg_dlist: CapiHandle,
    registered: bool,
}

// SAFETY: the reg dlist is plain C API data, tied to no thread, and only
// touched on drop, through the locking agent.
unsafe impl Send for Registered {}
// SAFETY: no `&self` method touches the reg dlist (`agent_name` reads the
// agent's name only).
unsafe impl Sync for Registered {}

impl Registered {
    /// The agent's name.
    pub(crate) fn agent_name(&self) -> &str {
        &self.agent.name
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        if self.reg_dlist.is_null() {
            return;
        }
        let c = self.agent.rt.capi();
        // SAFETY: `reg_dlist` is the live list `register_region` made with
        // this agent, which is live (held by `self.agent`); it is
        // deregistered only if it was registered, and destroyed once, here.
        // After deregistration NIXL no longer touches the memory.
        unsafe {
            if self.registered {
                (c.deregister_mem)(self.agent.capi, self.reg_dlist, std::ptr::null_mut());
            }
            (c.destroy_reg_dlist)(self.reg_dlist);
        }
    }
}

struct DlistInner {
    agent: Arc<AgentInner>,
    raw: CapiHandle,
    remote: Option<String>,
    released: std::sync::atomic::AtomicBool,
}

// SAFETY: `raw` is a NIXL dlist handle tied to no thread, used only in calls
// to its (locking) agent.
unsafe impl Send for DlistInner {}
// SAFETY: the only `&self` use of `raw` is `release`, which the `released`
// flag (an atomic swap) lets run once, whichever thread gets there first.
unsafe impl Sync for DlistInner {}

impl DlistInner {
    fn release(&self) -> Result<(), NixlError> {
        if self
            .released
            .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            return Ok(());
        }
        // SAFETY: `self.raw` was prepared by `self.agent` (live: held by the
        // `Arc`) and is released once: the swap above lets only the first
        // caller through.
        let raw = unsafe { self.agent.rt.release_dlist(self.agent.capi, self.raw) };
        op("releasedDlistH", raw).map(|_| ())
    }
}

impl Drop for DlistInner {
    fn drop(&mut self) {
        let _ = self.release();
    }
}

/// A prepared descriptor-list handle (`nixlDlistH`), local or remote.
/// Released on drop, once no transfer request made from it remains.
pub struct DlistHandle {
    inner: Arc<DlistInner>,
}

impl DlistHandle {
    /// The remote agent, or `None` for a local handle.
    pub fn remote_agent(&self) -> Option<&str> {
        self.inner.remote.as_deref()
    }

    /// Releases now and reports NIXL's status. If transfer requests made
    /// from this handle still exist, the release waits for the last of
    /// them to drop and this returns `Ok(())`.
    pub fn release(self) -> Result<(), NixlError> {
        match Arc::try_unwrap(self.inner) {
            Ok(inner) => inner.release(),
            Err(_) => Ok(()),
        }
    }
}

/// A transfer request (`nixlXferReqH`). Released on drop.
pub struct XferRequest {
    agent: Arc<AgentInner>,
    raw: CapiHandle,
    _local: Arc<DlistInner>,
    _remote: Arc<DlistInner>,
    _opt: Option<CapiGuard>,
    released: bool,
}

// SAFETY: `raw` is a NIXL request handle tied to no thread, used only in
// calls to its (locking) agent; the `&mut self` methods keep one thread per
// request at a time.
unsafe impl Send for XferRequest {}
// SAFETY: no `&self` method touches NIXL: posting, checking and releasing
// all take `&mut self` or `self`.
unsafe impl Sync for XferRequest {}

impl XferRequest {
    /// Posts the transfer. `Done` if it completed at once.
    pub fn post(&mut self) -> Result<XferState, NixlError> {
        // SAFETY: `self.raw` is the live request `create_read` made with
        // `self.agent` (live: held by the `Arc`), not released: the release
        // sets `released` and only runs in `release(self)` or on drop.
        let raw = unsafe { self.agent.rt.post_xfer_req(self.agent.capi, self.raw) };
        op("postXferReq", raw).map(XferState::from_ok)
    }

    /// Checks the transfer (also progresses the UCX worker).
    pub fn status(&mut self) -> Result<XferState, NixlError> {
        // SAFETY: as in `post`.
        let raw = unsafe { self.agent.rt.get_xfer_status(self.agent.capi, self.raw) };
        op("getXferStatus", raw).map(XferState::from_ok)
    }

    /// Releases now and reports NIXL's status (a transfer still in flight
    /// is aborted by NIXL where the backend can).
    pub fn release(mut self) -> Result<(), NixlError> {
        self.release_inner()
    }

    fn release_inner(&mut self) -> Result<(), NixlError> {
        if self.released {
            return Ok(());
        }
        self.released = true;
        // SAFETY: `self.raw` is the live request `create_read` made with
        // `self.agent` (held by the `Arc`); the flag above makes this the
        // one release, and nothing uses `raw` after it.
        let raw = unsafe { self.agent.rt.release_xfer_req(self.agent.capi, self.raw) };
        op("releaseXferReq", raw).map(|_| ())
    }
}

impl Drop for XferRequest {
    fn drop(&mut self) {
        let _ = self.release_inner();
    }
}

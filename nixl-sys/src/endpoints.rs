//! The endpoint-close interposer's raw hooks (`shim/ep_close.c`) and UCX's
//! VFS reads (`shim/nixl_shim.cpp`).
//!
//! NIXL 1.5.1's UCX plugin closes a live remote agent's endpoints in UCX's
//! flush mode, which keeps them (and their TCP sockets) until the agent is
//! destroyed. The interposer, loaded here with `RTLD_GLOBAL` before libnixl
//! (by [`crate::Runtime::get`] or [`EpClose::process`], whichever comes
//! first), turns a flush-mode close into a forced one inside a scope
//! ([`EpClose::forcing`]) on the calling thread, and counts what it closed.
//! `NIXL_SYS_EP_CLOSE=nixl` leaves NIXL's own mode (the interposer is not
//! loaded); `force` (or unset) is the default.
//!
//! This module only loads the interposer and reports its raw counts; the
//! `nixl-agent` crate's `endpoints` module says what the closes mean, wraps
//! them for code that invalidates through another binding
//! (`EndpointCloser`), and reads an agent's endpoints from [`vfs_list`] and
//! [`vfs_read`].

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;

use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};

use crate::gpu::GpuHooks;

/// The environment variable that chooses the endpoint close mode.
pub const EP_CLOSE_ENV: &str = "NIXL_SYS_EP_CLOSE";

/// The file name of NIXL's UCX plugin, whose binding is checked.
const UCX_PLUGIN_FILE: &str = "libplugin_UCX.so";

/// The interposer, built by build.rs.
static EP_CLOSE_SO: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libnixl_sys_ep_close.so"));

/// How this process closes the UCX endpoints of an invalidated agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EndpointCloseMode {
    /// Forced: a live peer's endpoints (socket, mappings) are destroyed by
    /// the invalidation itself. Verified: NIXL's UCX plugin calls the
    /// interposer.
    Force,
    /// NIXL's own mode, chosen with `NIXL_SYS_EP_CLOSE=nixl`: a live peer's
    /// endpoints stay until the agent is destroyed.
    Nixl,
    /// Forcing was wanted but cannot be done in this process; the reason
    /// says why (NIXL's plugin loaded before this crate, or with
    /// `NIXL_UCX_DEEPBIND`, or the interposer could not be loaded). NIXL's
    /// own mode applies.
    Unavailable(String),
    /// Not known yet: no agent (hence no UCX plugin) exists yet. (With
    /// the 1.5.x runtime the layout probe at load creates one, so this is
    /// only seen with a V1 C API runtime before its first agent.)
    Pending,
}

impl EndpointCloseMode {
    /// Whether invalidations close live peers' endpoints.
    pub fn is_force(&self) -> bool {
        matches!(self, EndpointCloseMode::Force)
    }
}

impl std::fmt::Display for EndpointCloseMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EndpointCloseMode::Force => write!(f, "force"),
            EndpointCloseMode::Nixl => write!(f, "nixl ({EP_CLOSE_ENV}=nixl)"),
            EndpointCloseMode::Unavailable(why) => write!(f, "unavailable: {why}"),
            EndpointCloseMode::Pending => write!(f, "pending (no agent yet)"),
        }
    }
}

/// What the interposer counted in one scope: `struct nks_ep_closes` of
/// shim/ep_close.c.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EpCloseCounts {
    /// Flush-mode closes of live endpoints turned into forced ones.
    pub forced: u32,
    /// Closes that NIXL forced itself (UCX had failed the endpoint).
    pub already_forced: u32,
    /// Closes left in flush mode (the endpoint stays).
    pub left_open: u32,
    /// Closes whose mode the interposer could not tell.
    pub unresolved: u32,
}

/// One endpoint failure the watch recorded: `struct nks_ep_failure` of
/// shim/ep_watch.c.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EpFailure {
    /// The failed `ucp_ep_h`, as an integer (compare it with the endpoints
    /// [`EpClose::watching`] listed; never dereference it).
    pub ep: u64,
    /// The `ucs_status_t` UCX handed the error handler.
    pub status: i64,
    /// `CLOCK_MONOTONIC` (ns) when the handler ran.
    pub at_ns: u64,
}

/// What the watch counted since it was loaded: `struct
/// nks_ep_watch_counts` of shim/ep_watch.c.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EpWatchCounts {
    /// Endpoint creates whose error handler is watched.
    pub watched: u64,
    /// Creates with an error handler the watch left alone (another
    /// handler than NIXL's, or parameters it does not know).
    pub unwatched: u64,
    /// Watched error handlers UCX ran.
    pub failures: u64,
    /// Failures dropped because nobody drained the queue (1,024 held).
    pub lost: u64,
}

/// Whether NIXL's endpoint failures are watched in this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EndpointWatchMode {
    /// NIXL's UCX plugin creates its endpoints through the watch.
    Watching,
    /// Not watched; the reason says why (the interposer is not loaded, or
    /// the plugin binds another `ucp_ep_create`).
    Unavailable(String),
    /// Not known yet: NIXL's UCX plugin is not loaded.
    Pending,
}

/// The loaded interposer.
struct Interposer {
    begin: unsafe extern "C" fn(),
    end: unsafe extern "C" fn(*mut EpCloseCounts),
    bound: unsafe extern "C" fn(*const c_char) -> c_int,
    create_bound: unsafe extern "C" fn(*const c_char) -> c_int,
    watch_set_fd: unsafe extern "C" fn(c_int),
    watch_drain: unsafe extern "C" fn(*mut EpFailure, usize) -> usize,
    watch_counts: unsafe extern "C" fn(*mut EpWatchCounts),
    watch_begin: unsafe extern "C" fn(),
    watch_end: unsafe extern "C" fn(*mut u64, usize) -> usize,
    mode: OnceLock<EndpointCloseMode>,
    watch_mode: OnceLock<EndpointWatchMode>,
    gpu: GpuHooks,
    _lib: Library,
}

/// The most endpoints one watched scope lists (one per NIXL worker: 64 is
/// far above vLLM's 4 + 1).
const SCOPE_EPS: usize = 64;

/// The interposer's state in this process, decided before libnixl loads
/// (obtain it with [`EpClose::process`]).
pub struct EpClose(State);

enum State {
    /// Loaded; whether the UCX plugin binds it is checked after the first
    /// agent exists.
    Loaded(Interposer),
    /// Not loaded, with the mode that applies.
    Off(EndpointCloseMode),
}

/// What `NIXL_SYS_EP_CLOSE` takes, for error messages.
pub const EP_CLOSE_ACCEPTED: &str = "`force` (default: a released peer's UCX endpoints are \
     closed at once) or `nixl` (NIXL's own close mode, which keeps a live peer's endpoints)";

/// A bad `NIXL_SYS_EP_CLOSE` value: nothing was installed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadEpCloseSetting(pub String);

impl std::fmt::Display for BadEpCloseSetting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{EP_CLOSE_ENV}={:?} is not a value it takes; accepted: {EP_CLOSE_ACCEPTED}",
            self.0.escape_debug().to_string()
        )
    }
}

impl std::error::Error for BadEpCloseSetting {}

/// The process's one interposer state, decided by the first caller.
static PROCESS: OnceLock<Result<EpClose, BadEpCloseSetting>> = OnceLock::new();

/// Whether the install came after NIXL's UCX plugin was loaded.
static INSTALLED_LATE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl EpClose {
    /// The process's interposer state, installed by the first call: it
    /// reads `NIXL_SYS_EP_CLOSE` and, for `force`, loads the interposer
    /// into the global symbol scope, which must come before NIXL's UCX
    /// plugin is loaded. One per process: a second interposer would not be
    /// the one NIXL's plugin binds, and its scopes would see no close. A
    /// bad `NIXL_SYS_EP_CLOSE` installs nothing.
    pub fn process() -> Result<&'static EpClose, BadEpCloseSetting> {
        PROCESS
            .get_or_init(|| EpClose::install().map(EpClose))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Reads `NIXL_SYS_EP_CLOSE` and, for `force`, loads the interposer
    /// into the global symbol scope. Must run before NIXL's UCX plugin is
    /// loaded.
    fn install() -> Result<State, BadEpCloseSetting> {
        match std::env::var(EP_CLOSE_ENV) {
            Ok(v) if v == "nixl" => return Ok(State::Off(EndpointCloseMode::Nixl)),
            Ok(v) if v.is_empty() || v == "force" => {}
            Ok(v) => return Err(BadEpCloseSetting(v)),
            Err(std::env::VarError::NotPresent) => {}
            Err(std::env::VarError::NotUnicode(v)) => {
                return Err(BadEpCloseSetting(v.to_string_lossy().into_owned()))
            }
        }
        if plugin_already_loaded() {
            INSTALLED_LATE.store(true, std::sync::atomic::Ordering::Relaxed);
            return Ok(State::Off(EndpointCloseMode::Unavailable(format!(
                "NIXL's {UCX_PLUGIN_FILE} was loaded before nixl-sys's interposer (a UCX \
                 backend was created first): it is bound to UCX already"
            ))));
        }
        match load_interposer() {
            Ok(i) => Ok(State::Loaded(i)),
            Err(why) => Ok(State::Off(EndpointCloseMode::Unavailable(why))),
        }
    }

    /// The mode in force. Checks the binding once the UCX plugin is loaded.
    pub fn mode(&self) -> EndpointCloseMode {
        match &self.0 {
            State::Off(mode) => mode.clone(),
            State::Loaded(i) => {
                if let Some(m) = i.mode.get() {
                    return m.clone();
                }
                let file = CString::new(UCX_PLUGIN_FILE).expect("no NUL");
                // SAFETY: `i.bound` is the interposer's `nks_ep_close_bound`
                // (`int (const char *)`), kept loaded by `i._lib` in the
                // process's static state; `file` is NUL-terminated and
                // outlives the call, which only reads the loader's list
                // (dl_iterate_phdr) and the plugin's relocations.
                let bound = unsafe { (i.bound)(file.as_ptr()) };
                let mode = match bound {
                    1 => EndpointCloseMode::Force,
                    0 => EndpointCloseMode::Unavailable(format!(
                        "{UCX_PLUGIN_FILE} calls another ucp_ep_close_nbx (loaded with \
                         RTLD_DEEPBIND: is NIXL_UCX_DEEPBIND set?)"
                    )),
                    -1 => EndpointCloseMode::Unavailable(format!(
                        "{UCX_PLUGIN_FILE} does not import ucp_ep_close_nbx"
                    )),
                    _ => return EndpointCloseMode::Pending,
                };
                i.mode.get_or_init(|| mode).clone()
            }
        }
    }

    /// Whether the install came too late: NIXL's UCX plugin was in the
    /// process already, so the mode is [`EndpointCloseMode::Unavailable`].
    pub fn installed_too_late(&self) -> bool {
        INSTALLED_LATE.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Runs `f` (an `invalidateRemoteMD`) with flush-mode closes on this
    /// thread forced, and returns what the interposer counted, or `None`
    /// when the closes were not observed (the mode is not
    /// [`EndpointCloseMode::Force`]: `f` only runs).
    pub fn forcing<T>(&self, f: impl FnOnce() -> T) -> (T, Option<EpCloseCounts>) {
        let State::Loaded(i) = &self.0 else {
            return (f(), None);
        };
        if !self.mode().is_force() {
            return (f(), None);
        }
        /// Closes the thread's scope even if `f` unwinds.
        struct Scope<'a> {
            interposer: &'a Interposer,
            open: bool,
        }
        impl Scope<'_> {
            fn end(&mut self) -> EpCloseCounts {
                let mut raw = EpCloseCounts::default();
                if std::mem::take(&mut self.open) {
                    // SAFETY: `end` is `nks_ep_close_scope_end`, kept loaded
                    // with the interposer; `raw` is a valid `#[repr(C)]`
                    // mirror of `struct nks_ep_closes` (four `uint32_t`) for
                    // it to write. `open` was set, so this closes the scope
                    // this guard opened, on this thread (the guard never
                    // leaves `forcing`).
                    unsafe { (self.interposer.end)(&mut raw) };
                }
                raw
            }
        }
        impl Drop for Scope<'_> {
            fn drop(&mut self) {
                self.end();
            }
        }
        // SAFETY: `begin` is `nks_ep_close_scope_begin` (`void (void)`),
        // kept loaded with the interposer; it only bumps a thread-local
        // depth, and the `Scope` below closes it, also on unwind.
        unsafe { (i.begin)() };
        let mut scope = Scope {
            interposer: i,
            open: true,
        };
        let out = f();
        (out, Some(scope.end()))
    }
}

impl EpClose {
    /// Whether NIXL's endpoint failures are watched: the interposer is
    /// loaded (the default close mode) and NIXL's UCX plugin binds its
    /// `ucp_ep_create` (checked once the plugin is loaded).
    pub fn watch_mode(&self) -> EndpointWatchMode {
        let i = match &self.0 {
            State::Loaded(i) => i,
            State::Off(_) => {
                return EndpointWatchMode::Unavailable(
                    self.not_loaded().expect("the interposer is not loaded"),
                )
            }
        };
        if let Some(m) = i.watch_mode.get() {
            return m.clone();
        }
        let file = CString::new(UCX_PLUGIN_FILE).expect("no NUL");
        // SAFETY: as in `mode`: `create_bound` is `nks_ep_create_bound`
        // (`int (const char *)`), kept loaded; `file` outlives the call.
        let bound = unsafe { (i.create_bound)(file.as_ptr()) };
        let mode = match bound {
            1 => EndpointWatchMode::Watching,
            0 => EndpointWatchMode::Unavailable(format!(
                "{UCX_PLUGIN_FILE} calls another ucp_ep_create (loaded before the interposer, or \
                 with RTLD_DEEPBIND: is NIXL_UCX_DEEPBIND set?)"
            )),
            -1 => EndpointWatchMode::Unavailable(format!(
                "{UCX_PLUGIN_FILE} does not import ucp_ep_create"
            )),
            _ => return EndpointWatchMode::Pending,
        };
        i.watch_mode.get_or_init(|| mode).clone()
    }

    fn watch(&self) -> Option<&Interposer> {
        match &self.0 {
            State::Loaded(i) => Some(i),
            State::Off(_) => None,
        }
    }

    /// Runs `f` (a `loadRemoteMD`) and lists the UCP endpoints created on
    /// this thread meanwhile (NIXL creates one per worker, synchronously,
    /// inside the load), as integers to compare with [`EpFailure::ep`];
    /// `None` when the interposer is not loaded. The list holds at most 64;
    /// `created` says how many there were.
    pub fn watching<T>(&self, f: impl FnOnce() -> T) -> (T, Option<WatchedEps>) {
        let Some(i) = self.watch() else {
            return (f(), None);
        };
        /// Closes the thread's scope even if `f` unwinds.
        struct Scope<'a>(&'a Interposer, bool);
        impl Scope<'_> {
            fn end(&mut self) -> WatchedEps {
                let mut eps = vec![0u64; SCOPE_EPS];
                let mut created = 0;
                if std::mem::take(&mut self.1) {
                    // SAFETY: `watch_end` is `nks_ep_watch_scope_end`, kept
                    // loaded; `eps` has room for the `SCOPE_EPS` it may
                    // write. It closes the scope this guard opened, on this
                    // thread.
                    created = unsafe { (self.0.watch_end)(eps.as_mut_ptr(), SCOPE_EPS) };
                }
                eps.truncate(created.min(SCOPE_EPS));
                WatchedEps { eps, created }
            }
        }
        impl Drop for Scope<'_> {
            fn drop(&mut self) {
                self.end();
            }
        }
        // SAFETY: `watch_begin` is `nks_ep_watch_scope_begin` (`void
        // (void)`), kept loaded; it bumps a thread-local depth, closed by
        // the `Scope` below, also on unwind.
        unsafe { (i.watch_begin)() };
        let mut scope = Scope(i, true);
        let out = f();
        (out, Some(scope.end()))
    }

    /// Gives the watch the eventfd it writes to after each failure
    /// (`None`: no more wake-ups). The descriptor must stay open until it
    /// is replaced. `false` when the interposer is not loaded.
    pub fn watch_wake_fd(&self, fd: Option<std::os::fd::BorrowedFd<'static>>) -> bool {
        let Some(i) = self.watch() else {
            return false;
        };
        let raw = fd.map_or(-1, |fd| std::os::fd::AsRawFd::as_raw_fd(&fd));
        // SAFETY: `watch_set_fd` is `nks_ep_watch_set_fd` (`void (int)`),
        // kept loaded; it only stores the number under its lock. The
        // descriptor is borrowed for `'static`: it outlives every write.
        unsafe { (i.watch_set_fd)(raw) };
        true
    }

    /// Moves every queued failure into `out`, oldest first.
    pub fn watch_drain(&self, out: &mut Vec<EpFailure>) {
        let Some(i) = self.watch() else {
            return;
        };
        loop {
            let mut buf = [EpFailure::default(); 64];
            // SAFETY: `watch_drain` is `nks_ep_watch_drain`, kept loaded;
            // `buf` has room for the `buf.len()` entries it may write.
            let n = unsafe { (i.watch_drain)(buf.as_mut_ptr(), buf.len()) };
            out.extend_from_slice(&buf[..n.min(buf.len())]);
            if n < buf.len() {
                return;
            }
        }
    }

    /// The watch's counts since it was loaded (zero when it is not).
    pub fn watch_counts(&self) -> EpWatchCounts {
        let mut c = EpWatchCounts::default();
        if let Some(i) = self.watch() {
            // SAFETY: `watch_counts` is `nks_ep_watch_counts`, kept
            // loaded; `c` is a valid `#[repr(C)]` mirror for it to write.
            unsafe { (i.watch_counts)(&mut c) };
        }
        c
    }
}

/// The endpoints one [`EpClose::watching`] scope saw created.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WatchedEps {
    /// Their `ucp_ep_h` values (at most 64).
    pub eps: Vec<u64>,
    /// How many were created (more than `eps.len()`: some are not listed).
    pub created: usize,
}

/// The service's knob for the GPU-mapping ledger, read here too because
/// the ledger must be on (or off) before UCX maps anything: `0`, `n`,
/// `no`, `off` or `false` turn it off for the process. The service
/// validates the value itself and refuses a bad one at start-up.
pub const GPU_UNMAP_ENV: &str = "NIXL_KEEPALIVE_GPU_UNMAP";

fn gpu_unmap_off_in_env() -> bool {
    std::env::var(GPU_UNMAP_ENV).is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "0" | "n" | "no" | "off" | "false"
        )
    })
}

impl EpClose {
    /// The GPU-mapping ledger's hooks ([`crate::gpu`]), when the
    /// interposer is loaded.
    pub fn gpu(&self) -> Option<&GpuHooks> {
        match &self.0 {
            State::Loaded(i) => Some(&i.gpu),
            State::Off(_) => None,
        }
    }

    /// Why the interposer is not loaded (the endpoint watch and the
    /// GPU-mapping ledger live in it), or `None` when it is.
    pub fn not_loaded(&self) -> Option<String> {
        match &self.0 {
            State::Loaded(_) => None,
            State::Off(EndpointCloseMode::Nixl) => Some(format!(
                "the interposer is not loaded ({EP_CLOSE_ENV}=nixl)"
            )),
            State::Off(mode) => Some(format!("the interposer is not loaded: {mode}")),
        }
    }
}

/// Whether NIXL's UCX plugin is in the process already (then it is bound).
fn plugin_already_loaded() -> bool {
    let name = CString::new(UCX_PLUGIN_FILE).expect("no NUL");
    // SAFETY: `name` is NUL-terminated and outlives the calls. With
    // RTLD_NOLOAD dlopen loads nothing (no initialiser runs): it returns a
    // handle only to an object already loaded, whose reference count it
    // took, and the one dlclose gives that back without unloading it.
    unsafe {
        let h = libc::dlopen(name.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY);
        if h.is_null() {
            false
        } else {
            libc::dlclose(h);
            true
        }
    }
}

fn load_interposer() -> Result<Interposer, String> {
    let name = c"nixl-sys-ep-close";
    // SAFETY: `name` is NUL-terminated; memfd_create touches no other memory.
    // The new descriptor (checked below) is owned by this function alone.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(format!(
            "memfd_create failed: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: `fd` is the open descriptor just created, owned by nothing
    // else; the `File` takes it over and closes it once, on drop.
    let mut file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    std::io::Write::write_all(&mut file, EP_CLOSE_SO)
        .map_err(|e| format!("writing the interposer to a memfd failed: {e}"))?;
    let path = format!("/proc/self/fd/{fd}");
    // SAFETY: our own object, built from shim/ep_close.c by build.rs; it has
    // no constructors, only static data (a mutex initialiser). RTLD_GLOBAL
    // puts its ucp_ep_close_nbx ahead of UCX's for objects loaded later
    // (NIXL's plugin). The `Library` is kept in the `Interposer`, which
    // lives in a static: the object is never unloaded.
    let lib = unsafe { Library::open(Some(&path), RTLD_NOW | RTLD_GLOBAL) }
        .map_err(|e| format!("loading the interposer failed: {e}"))?;
    drop(file);
    // SAFETY: the symbols' types are those shim/ep_close.c and
    // shim/ep_watch.c define (`void (void)`, `void (struct nks_ep_closes *)`,
    // `int (const char *)`, `void (int)`, `size_t (struct nks_ep_failure *,
    // size_t)`, `void (struct nks_ep_watch_counts *)`, `size_t (uint64_t *,
    // size_t)`), mirrored by the `#[repr(C)]` types above.
    // The function pointers copied out stay valid because `lib` moves into
    // the same `Interposer`, which is never dropped (static state).
    unsafe {
        let begin = *lib
            .get::<unsafe extern "C" fn()>(b"nks_ep_close_scope_begin\0")
            .map_err(|e| e.to_string())?;
        let end = *lib
            .get::<unsafe extern "C" fn(*mut EpCloseCounts)>(b"nks_ep_close_scope_end\0")
            .map_err(|e| e.to_string())?;
        let bound = *lib
            .get::<unsafe extern "C" fn(*const c_char) -> c_int>(b"nks_ep_close_bound\0")
            .map_err(|e| e.to_string())?;
        let create_bound = *lib
            .get::<unsafe extern "C" fn(*const c_char) -> c_int>(b"nks_ep_create_bound\0")
            .map_err(|e| e.to_string())?;
        let watch_set_fd = *lib
            .get::<unsafe extern "C" fn(c_int)>(b"nks_ep_watch_set_fd\0")
            .map_err(|e| e.to_string())?;
        let watch_drain = *lib
            .get::<unsafe extern "C" fn(*mut EpFailure, usize) -> usize>(b"nks_ep_watch_drain\0")
            .map_err(|e| e.to_string())?;
        let watch_counts = *lib
            .get::<unsafe extern "C" fn(*mut EpWatchCounts)>(b"nks_ep_watch_counts\0")
            .map_err(|e| e.to_string())?;
        let watch_begin = *lib
            .get::<unsafe extern "C" fn()>(b"nks_ep_watch_scope_begin\0")
            .map_err(|e| e.to_string())?;
        let watch_end = *lib
            .get::<unsafe extern "C" fn(*mut u64, usize) -> usize>(b"nks_ep_watch_scope_end\0")
            .map_err(|e| e.to_string())?;
        // SAFETY: `lib` is the interposer, and moves into the same
        // `Interposer` as the hooks: never unloaded.
        let gpu = GpuHooks::load(&lib)?;
        // On from the start, before any UCX map call, unless turned off
        // for the process (the service's knob can turn it off later).
        gpu.set_enabled(!gpu_unmap_off_in_env());
        Ok(Interposer {
            begin,
            end,
            bound,
            create_bound,
            watch_set_fd,
            watch_drain,
            watch_counts,
            watch_begin,
            watch_end,
            mode: OnceLock::new(),
            watch_mode: OnceLock::new(),
            gpu,
            _lib: lib,
        })
    }
}

// ---------------------------------------------------------------------------
// UCX's own view: the UCS VFS tree of the process.
// ---------------------------------------------------------------------------

extern "C" {
    fn nks_ucx_vfs_list(
        path: *const c_char,
        cb: extern "C" fn(*const c_char, *mut c_void),
        arg: *mut c_void,
    ) -> c_int;
    fn nks_ucx_vfs_read(
        path: *const c_char,
        cb: extern "C" fn(*const c_char, *mut c_void),
        arg: *mut c_void,
    ) -> c_int;
}

extern "C" fn push_name(name: *const c_char, arg: *mut c_void) {
    // SAFETY: `arg` is the `&mut Vec<String>` that `vfs_list` or `vfs_read`
    // passed; the shim calls this callback only synchronously, during that
    // call, when no other reference to the vector is in use.
    let v = unsafe { &mut *(arg as *mut Vec<String>) };
    v.push(
        // SAFETY: UCX (through the shim) passes a NUL-terminated name, or
        // the text of a VFS file, valid for the callback's duration; it is
        // copied out at once.
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned(),
    );
}

/// The names under `path` in UCX's VFS tree (`ucs_vfs_path_list_dir`, through
/// the shim), in whichever libucs the process has loaded; `None` when the
/// path or UCX's VFS is not there.
pub fn vfs_list(path: &str) -> Option<Vec<String>> {
    let p = CString::new(path).ok()?;
    let mut out: Vec<String> = Vec::new();
    // SAFETY: `p` is NUL-terminated and outlives the call; `push_name` has
    // the `void (*)(const char *, void *)` type the shim takes, and `arg`
    // is `out`, exclusively borrowed for the call, the only thing the
    // callback touches (it is called only during the call).
    let st =
        unsafe { nks_ucx_vfs_list(p.as_ptr(), push_name, (&mut out as *mut Vec<String>).cast()) };
    (st == 0).then_some(out)
}

/// The text of the VFS file at `path` (trailing whitespace trimmed), or
/// `None` when it is not there.
pub fn vfs_read(path: &str) -> Option<String> {
    let p = CString::new(path).ok()?;
    let mut out: Vec<String> = Vec::new();
    // SAFETY: as in `vfs_list`: `p` is NUL-terminated, `push_name` has the
    // callback type the shim takes, and `arg` is `out`, exclusively
    // borrowed for the call.
    let st =
        unsafe { nks_ucx_vfs_read(p.as_ptr(), push_name, (&mut out as *mut Vec<String>).cast()) };
    (st == 0).then(|| out.concat().trim_end().to_string())
}

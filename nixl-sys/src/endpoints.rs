//! What happens to a remote agent's UCX endpoints when its metadata is
//! invalidated, and UCX's own view of the endpoints an agent holds.
//!
//! # Closing a released peer's endpoints
//!
//! NIXL 1.5.1's UCX plugin disconnects a remote agent with
//! `ucp_ep_close_nbx` in UCX's *flush* mode unless UCX has already failed
//! the endpoint (then it forces the close). In flush mode UCX keeps an
//! endpoint whose peer is connected until the UCX worker is destroyed
//! (`ucp_ep_disconnected`: "to enable remote endpoints keep sending"), so
//! every invalidation of a *live* peer left its endpoint, its TCP socket and
//! its shared-memory mappings in the process, for good (measured: one
//! ESTABLISHED connection on each side per release). A peer that died is
//! failed by UCX first and was closed for real.
//!
//! This crate loads a small interposer (`shim/ep_close.c`) with
//! `RTLD_GLOBAL` before libnixl, so that NIXL's UCX plugin binds its
//! `ucp_ep_close_nbx` there. Inside [`crate::Agent::invalidate_remote_metadata`]
//! only, on the calling thread, a flush-mode close becomes a forced one
//! (`UCP_EP_CLOSE_FLAG_FORCE`: the endpoint and its transports are destroyed
//! at once); everywhere else it forwards untouched. Upstream NIXL later
//! added the same as the opt-in backend parameter `ucx_ep_close_force`.
//!
//! What stays, measured with the 1.5.1 wheel (loopback): the TCP
//! connection UCX shares between the two directions is half-closed by the
//! decode and fully closed by the *prefill*, when its UCX keepalive
//! (`UCX_KEEPALIVE_INTERVAL` in the prefill's environment, 20 s by default)
//! next checks the endpoint it made for the decode and learns that it was
//! removed. A prefill with UCX keepalive off keeps that socket, and the
//! decode its half, until one of them exits. So [`crate::Agent`] also
//! records the TCP sockets UCX opens while it loads a remote agent's
//! metadata and shuts down those the forced close left open when it
//! invalidates that agent: the descriptors go at once, and the peer closes
//! its end on reading end-of-file, whatever its keepalive period (see
//! `sockets.rs` for what UCX's TCP transport keeps and why).
//!
//! `NIXL_SYS_EP_CLOSE=nixl` leaves NIXL's own close mode (the interposer is
//! not loaded); `force` (or unset) is the default.
//!
//! # Invalidations made through another binding
//!
//! The interposer is installed once per process, by whichever comes first:
//! [`crate::Runtime::get`] (before it loads libnixl) or
//! [`EndpointCloser::install`]. The latter is for processes whose agent is
//! not this crate's, such as a Python decoder whose `nixl_agent` (NIXL's
//! Python API) loads its own libnixl: install it before that agent creates
//! its UCX backend (NIXL loads the UCX plugin then), and call
//! `invalidateRemoteMD` through the other binding inside
//! [`EndpointCloser::around_invalidation`], on the calling thread.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;

use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};

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

/// What the UCX endpoint closes inside one `invalidateRemoteMD` did.
///
/// NIXL closes one endpoint per UCX worker (one here) when it invalidates
/// an agent whose connection nothing else holds. No close at all means the
/// agent was unknown (`NOT_FOUND`), or a handle still holds its connection
/// (a transfer request or dlist not yet released), or the closes could not
/// be seen ([`EndpointCloses::observed`] is false).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndpointCloses {
    /// Live endpoints closed at once in UCX's force mode.
    pub forced: u32,
    /// Endpoints UCX had already failed (a dead peer): NIXL forces those
    /// itself; closed too.
    pub already_failed: u32,
    /// Endpoints closed in UCX's flush mode: UCX keeps each (its socket,
    /// its mappings) until the agent is destroyed.
    pub left_open: u32,
    /// Whether the closes were observed: the mode is
    /// [`EndpointCloseMode::Force`]. When false, the counts are all 0 and
    /// say nothing.
    pub observed: bool,
    /// TCP connections to the agent that the forced close left open and the
    /// invalidation then shut down itself (see [`crate::Agent::invalidate_remote_metadata`]):
    /// without that, UCX keeps each until the *peer* closes it, at the
    /// peer's next UCX keepalive round. 0 when nothing was recorded for the
    /// agent or everything had closed already (a dead peer), and always 0
    /// from [`EndpointCloser::around_invalidation`], which does not see the
    /// loads.
    pub connections_shut: u32,
    /// Of [`EndpointCloses::connections_shut`], those whose descriptor UCX
    /// had not closed yet when the invalidation returned (it closes them at
    /// its next progress of the worker).
    pub connections_pending: u32,
}

impl EndpointCloses {
    /// Endpoints closed for real (forced by us, or already failed).
    pub fn closed(&self) -> u32 {
        self.forced + self.already_failed
    }
}

/// `struct nks_ep_closes` of shim/ep_close.c.
#[repr(C)]
#[derive(Default)]
struct RawCloses {
    forced: u32,
    already_forced: u32,
    left_open: u32,
    unresolved: u32,
}

/// The loaded interposer.
pub(crate) struct Interposer {
    begin: unsafe extern "C" fn(),
    end: unsafe extern "C" fn(*mut RawCloses),
    bound: unsafe extern "C" fn(*const c_char) -> c_int,
    mode: OnceLock<EndpointCloseMode>,
    _lib: Library,
}

/// The interposer's state in this process, decided before libnixl loads.
pub(crate) enum EpClose {
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
    /// The process's interposer state, installed by the first call (see
    /// [`EpClose::install`]). One per process: a second interposer would
    /// not be the one NIXL's plugin binds, and its scopes would see no
    /// close.
    pub(crate) fn process() -> Result<&'static EpClose, BadEpCloseSetting> {
        PROCESS
            .get_or_init(EpClose::install)
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Reads `NIXL_SYS_EP_CLOSE` and, for `force`, loads the interposer
    /// into the global symbol scope. Must run before NIXL's UCX plugin is
    /// loaded.
    fn install() -> Result<EpClose, BadEpCloseSetting> {
        match std::env::var(EP_CLOSE_ENV) {
            Ok(v) if v == "nixl" => return Ok(EpClose::Off(EndpointCloseMode::Nixl)),
            Ok(v) if v.is_empty() || v == "force" => {}
            Ok(v) => return Err(BadEpCloseSetting(v)),
            Err(std::env::VarError::NotPresent) => {}
            Err(std::env::VarError::NotUnicode(v)) => {
                return Err(BadEpCloseSetting(v.to_string_lossy().into_owned()))
            }
        }
        if plugin_already_loaded() {
            INSTALLED_LATE.store(true, std::sync::atomic::Ordering::Relaxed);
            return Ok(EpClose::Off(EndpointCloseMode::Unavailable(format!(
                "NIXL's {UCX_PLUGIN_FILE} was loaded before nixl-sys's interposer (a UCX \
                 backend was created first): it is bound to UCX already"
            ))));
        }
        match load_interposer() {
            Ok(i) => Ok(EpClose::Loaded(i)),
            Err(why) => Ok(EpClose::Off(EndpointCloseMode::Unavailable(why))),
        }
    }

    /// The mode in force. Checks the binding once the UCX plugin is loaded.
    pub(crate) fn mode(&self) -> EndpointCloseMode {
        match self {
            EpClose::Off(mode) => mode.clone(),
            EpClose::Loaded(i) => {
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

    /// Runs `f` (an `invalidateRemoteMD`) with flush-mode closes on this
    /// thread forced, and reports what the closes did.
    pub(crate) fn forcing<T>(&self, f: impl FnOnce() -> T) -> (T, EndpointCloses) {
        let EpClose::Loaded(i) = self else {
            return (f(), EndpointCloses::default());
        };
        if !self.mode().is_force() {
            return (f(), EndpointCloses::default());
        }
        /// Closes the thread's scope even if `f` unwinds.
        struct Scope<'a> {
            interposer: &'a Interposer,
            open: bool,
        }
        impl Scope<'_> {
            fn end(&mut self) -> RawCloses {
                let mut raw = RawCloses::default();
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
        let raw = scope.end();
        (
            out,
            EndpointCloses {
                forced: raw.forced,
                already_failed: raw.already_forced,
                left_open: raw.left_open + raw.unresolved,
                observed: true,
                connections_shut: 0,
                connections_pending: 0,
            },
        )
    }
}

/// The process's endpoint-close interposer, for code that invalidates
/// remote agents through another NIXL binding (NIXL's Python API): a
/// [`crate::Agent`] of this crate uses it by itself.
///
/// ```no_run
/// // Before anything in the process creates a NIXL agent's UCX backend:
/// let closer = nixl_sys::EndpointCloser::install().expect("a valid NIXL_SYS_EP_CLOSE");
/// // ...later, around the other binding's invalidateRemoteMD:
/// let (status, closes) = closer.around_invalidation(|| 0 /* agent.remove_remote_agent(name) */);
/// assert!(closes.observed == closer.mode().is_force());
/// ```
#[derive(Clone, Copy)]
pub struct EndpointCloser {
    inner: &'static EpClose,
}

impl std::fmt::Debug for EndpointCloser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EndpointCloser")
            .field("mode", &self.mode())
            .finish()
    }
}

impl EndpointCloser {
    /// Installs the interposer in this process (once: later calls, and
    /// [`crate::Runtime::get`], share it), as `NIXL_SYS_EP_CLOSE` says.
    ///
    /// It takes effect for NIXL UCX plugins loaded *after* this call: NIXL
    /// loads its plugin when an agent first creates a UCX backend (a
    /// `nixl_agent` does in its constructor; importing NIXL's Python
    /// module does not). Called later, the mode is
    /// [`EndpointCloseMode::Unavailable`] with the reason, and NIXL's own
    /// close mode applies. A bad `NIXL_SYS_EP_CLOSE` installs nothing.
    pub fn install() -> Result<EndpointCloser, BadEpCloseSetting> {
        EpClose::process().map(|inner| EndpointCloser { inner })
    }

    /// The mode in force: [`EndpointCloseMode::Pending`] until NIXL's UCX
    /// plugin is loaded, then whether the plugin really calls the
    /// interposer (checked in its relocations).
    pub fn mode(&self) -> EndpointCloseMode {
        self.inner.mode()
    }

    /// Whether the mode is [`EndpointCloseMode::Unavailable`] because the
    /// install came too late: NIXL's UCX plugin was in the process already
    /// (an agent had created a UCX backend). The other reasons are NIXL
    /// loading its plugin with `RTLD_DEEPBIND` and an interposer that could
    /// not be loaded.
    pub fn installed_too_late(&self) -> bool {
        INSTALLED_LATE.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Runs `invalidate`, a call that makes NIXL invalidate a remote agent
    /// (`invalidateRemoteMD`, or NIXL's Python `remove_remote_agent`), with
    /// the flush-mode endpoint closes it makes *on this thread* forced, and
    /// says what they did. Outside [`EndpointCloseMode::Force`] it only
    /// runs `invalidate` (the closes are not observed). A forced close ends
    /// whatever the endpoint still had in flight, so run nothing else that
    /// closes endpoints you mean to keep inside it.
    pub fn around_invalidation<T>(&self, invalidate: impl FnOnce() -> T) -> (T, EndpointCloses) {
        self.inner.forcing(invalidate)
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
    // SAFETY: the three symbols' types are those shim/ep_close.c defines
    // (`void (void)`, `void (struct nks_ep_closes *)`, `int (const char *)`).
    // The function pointers copied out stay valid because `lib` moves into
    // the same `Interposer`, which is never dropped (static state).
    unsafe {
        let begin = *lib
            .get::<unsafe extern "C" fn()>(b"nks_ep_close_scope_begin\0")
            .map_err(|e| e.to_string())?;
        let end = *lib
            .get::<unsafe extern "C" fn(*mut RawCloses)>(b"nks_ep_close_scope_end\0")
            .map_err(|e| e.to_string())?;
        let bound = *lib
            .get::<unsafe extern "C" fn(*const c_char) -> c_int>(b"nks_ep_close_bound\0")
            .map_err(|e| e.to_string())?;
        Ok(Interposer {
            begin,
            end,
            bound,
            mode: OnceLock::new(),
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

fn vfs_list(path: &str) -> Option<Vec<String>> {
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

fn vfs_read(path: &str) -> Option<String> {
    let p = CString::new(path).ok()?;
    let mut out: Vec<String> = Vec::new();
    // SAFETY: as in `vfs_list`: `p` is NUL-terminated, `push_name` has the
    // callback type the shim takes, and `arg` is `out`, exclusively
    // borrowed for the call.
    let st =
        unsafe { nks_ucx_vfs_read(p.as_ptr(), push_name, (&mut out as *mut Vec<String>).cast()) };
    (st == 0).then(|| out.concat().trim_end().to_string())
}

/// The most bytes of a name UCX keeps for a context or a worker (its
/// `UCP_ENTITY_NAME_MAX`, 32, less the terminating NUL).
pub const UCX_NAME_MAX: usize = 31;

/// `name` as UCX lists it: its first [`UCX_NAME_MAX`] bytes, or fewer to
/// end on a character boundary.
fn ucx_entity_name(name: &str) -> &str {
    if name.len() <= UCX_NAME_MAX {
        return name;
    }
    let mut end = UCX_NAME_MAX;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    &name[..end]
}

/// One UCP endpoint as UCX's VFS shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UcxEndpoint {
    /// Its VFS name (the endpoint's address in this process).
    pub id: String,
    /// The peer worker's name (`host:pid`), or UCX's `<no debug data>`
    /// unless the *peer* runs with `UCX_ADDRESS_DEBUG_INFO=y`.
    pub peer_name: String,
    /// Its error-handling mode (`peer` under NIXL).
    pub error_mode: String,
}

/// The UCP endpoints and endpoint counters of one agent's UCX workers, read
/// from UCX's own VFS tree (`/ucp/context/<agent name>/worker/*`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UcxEndpoints {
    /// Every endpoint the workers hold now, NIXL's own loopback endpoint
    /// included (one per worker).
    pub endpoints: Vec<UcxEndpoint>,
    /// Endpoints ever created (`counters/ep_creations`).
    pub created: u64,
    /// Endpoint closes requested (`counters/ep_closures`).
    pub closed: u64,
    /// Endpoints UCX failed (`counters/ep_failures`).
    pub failed: u64,
}

/// Reads the endpoints of the UCX context named `context` (NIXL names the
/// UCX context of an agent after the agent, so this is the agent's name),
/// in whichever libucs the process has loaded: that of an agent made
/// through NIXL's Python API too. UCX keeps only the first
/// [`UCX_NAME_MAX`] bytes of a context's name (measured with UCX 1.23: an
/// agent named `decode-` and a UUID is listed under its first 31 bytes),
/// so a longer name is looked up by that prefix. `None` when UCX's VFS is
/// not there (`UCX_VFS_ENABLE=n`, no libucs loaded) or no such context
/// exists (a name cut inside a multi-byte character is not found).
pub fn ucx_endpoints(context: &str) -> Option<UcxEndpoints> {
    let context = ucx_entity_name(context);
    let base = format!("/ucp/context/{context}/worker");
    let workers = vfs_list(&base)?;
    let mut out = UcxEndpoints::default();
    for w in workers {
        let wpath = format!("{base}/{w}");
        // Listing the worker's own node runs its refresh, which adds the
        // endpoints created since the last look to the tree.
        let _ = vfs_list(&wpath);
        let counter = |name: &str| {
            vfs_read(&format!("{wpath}/counters/{name}"))
                .and_then(|s| s.parse::<u64>().ok())
                .unwrap_or(0)
        };
        out.created += counter("ep_creations");
        out.closed += counter("ep_closures");
        out.failed += counter("ep_failures");
        for ep in vfs_list(&format!("{wpath}/ep")).unwrap_or_default() {
            let epath = format!("{wpath}/ep/{ep}");
            out.endpoints.push(UcxEndpoint {
                peer_name: vfs_read(&format!("{epath}/peer_name")).unwrap_or_default(),
                error_mode: vfs_read(&format!("{epath}/error_mode")).unwrap_or_default(),
                id: ep,
            });
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_agent_name_is_looked_up_by_the_prefix_ucx_keeps() {
        assert_eq!(ucx_entity_name("decode-0"), "decode-0");
        let long = "decode-0123456789abcdef-0123456789abcdef-0123";
        assert_eq!(ucx_entity_name(long), "decode-0123456789abcdef-0123456");
        assert_eq!(ucx_entity_name(&long[..31]), &long[..31]);
        // Never cut inside a character: "é" is two bytes at 30..32.
        let accented = format!("{}é-tail", "a".repeat(30));
        assert_eq!(ucx_entity_name(&accented), "a".repeat(30));
    }
}

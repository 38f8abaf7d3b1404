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
//! `nixl-sys` loads a small interposer (`shim/ep_close.c`) with
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
//! [`EndpointCloser::around_invalidation`], on the calling thread; to have
//! the leftover connections shut down as well, make the loads inside
//! [`EndpointCloser::around_load`] and the invalidations through
//! [`EndpointCloser::invalidate`].

use crate::foreign::LoadedConnections;
use crate::sockets::Connections;
use nixl_sys::endpoints::{vfs_list, vfs_read, EpClose, EpCloseCounts};
pub use nixl_sys::endpoints::{
    BadEpCloseSetting, EndpointCloseMode, EP_CLOSE_ACCEPTED, EP_CLOSE_ENV,
};

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
    /// loads ([`EndpointCloser::invalidate`] does, for loads made inside
    /// [`EndpointCloser::around_load`]).
    pub connections_shut: u32,
    /// Of [`EndpointCloses::connections_shut`], those whose descriptor UCX
    /// had not closed yet when the invalidation returned (it closes them at
    /// its next progress of the worker).
    pub connections_pending: u32,
    /// What the invalidation gave back of the GPU mappings UCX's CUDA IPC
    /// cache held for the agent ([`crate::gpu`]); `None` when the ledger
    /// does not run in this process or the agent's loads were not seen.
    pub gpu: Option<crate::gpu::GpuReleaseCounts>,
}

impl EndpointCloses {
    /// What the interposer counted in one invalidation, or `None` when the
    /// closes were not observed; the connections are counted later.
    pub(crate) fn from_counts(counts: Option<EpCloseCounts>) -> EndpointCloses {
        match counts {
            None => EndpointCloses::default(),
            Some(raw) => EndpointCloses {
                forced: raw.forced,
                already_failed: raw.already_forced,
                left_open: raw.left_open + raw.unresolved,
                observed: true,
                connections_shut: 0,
                connections_pending: 0,
                gpu: None,
            },
        }
    }

    /// Endpoints closed for real (forced by us, or already failed).
    pub fn closed(&self) -> u32 {
        self.forced + self.already_failed
    }
}

/// The process's endpoint-close interposer, for code that invalidates
/// remote agents through another NIXL binding (NIXL's Python API): a
/// [`crate::Agent`] of this crate uses it by itself.
///
/// ```no_run
/// // Before anything in the process creates a NIXL agent's UCX backend:
/// let closer = nixl_agent::EndpointCloser::install().expect("a valid NIXL_SYS_EP_CLOSE");
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
        self.inner.installed_too_late()
    }

    /// Runs `invalidate`, a call that makes NIXL invalidate a remote agent
    /// (`invalidateRemoteMD`, or NIXL's Python `remove_remote_agent`), with
    /// the flush-mode endpoint closes it makes *on this thread* forced, and
    /// says what they did. Outside [`EndpointCloseMode::Force`] it only
    /// runs `invalidate` (the closes are not observed). A forced close ends
    /// whatever the endpoint still had in flight, so run nothing else that
    /// closes endpoints you mean to keep inside it.
    pub fn around_invalidation<T>(&self, invalidate: impl FnOnce() -> T) -> (T, EndpointCloses) {
        let (out, counts) = self.inner.forcing(invalidate);
        (out, EndpointCloses::from_counts(counts))
    }

    /// Runs `load`, a call that makes the other binding load one remote
    /// agent's metadata (NIXL's Python `add_remote_agent`), and records
    /// the TCP connections UCX opened for it meanwhile, for
    /// [`EndpointCloser::invalidate`] to shut down at its release: name
    /// them with [`LoadedConnections::belong_to`] once the load said which
    /// agent it was. Loads made through this take one process-wide lock
    /// (never two at once: one engine's connections never land in
    /// another's record), and only sockets set up as UCX sets up its own
    /// are recorded (not those other threads of the process open
    /// meanwhile); see `docs/design/releases-and-sockets.md`. Records
    /// nothing outside [`EndpointCloseMode::Force`] or with
    /// `NIXL_SYS_SHUT_SOCKETS=0`. A load nested inside another runs
    /// unrecorded.
    pub fn around_load<T>(&self, load: impl FnOnce() -> T) -> (T, LoadedConnections) {
        crate::foreign::around_load(self.mode().is_force(), load)
    }

    /// [`EndpointCloser::around_invalidation`] of `local`'s metadata of
    /// `remote`, then, when `unloaded` says the call left the agent
    /// unloaded (it succeeded, or NIXL did not know the agent), what
    /// `connections` says to the TCP connections recorded at its loads
    /// ([`EndpointCloser::around_load`]): with [`Connections::Shut`] those
    /// still open are shut down (`shutdown(SHUT_RDWR)`: UCX closes the
    /// descriptor at its next progress, the peer at once, whatever its
    /// keepalive period; [`EndpointCloses::connections_shut`]); with
    /// [`Connections::Keep`] they are left to UCX. Either way the record is
    /// forgotten, and so are the agent's endpoints for
    /// [`crate::failures`]. Shut only when no transfer with the agent
    /// may still be running at the peer (see [`Connections`]).
    pub fn invalidate<T>(
        &self,
        local: &str,
        remote: &str,
        connections: Connections,
        invalidate: impl FnOnce() -> T,
        unloaded: impl FnOnce(&T) -> bool,
    ) -> (T, EndpointCloses) {
        let (out, mut closes) = self.around_invalidation(invalidate);
        if unloaded(&out) {
            crate::failures::forget(local, remote);
            let shut = connections == Connections::Shut && closes.observed;
            let (n, pending) = crate::foreign::released(local, remote, shut);
            closes.connections_shut = n;
            closes.connections_pending = pending;
            // Every rkey of the agent went with the invalidation: UCX's
            // references left are transfers of other agents.
            closes.gpu = crate::gpu::released(local, remote);
        }
        (out, closes)
    }
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

//! UCX endpoint failures as they happen, named by the remote agent.
//!
//! NIXL 1.5.1 gives every UCP endpoint an error handler that only marks it
//! failed: the next `genNotif` to that agent then returns
//! `REMOTE_DISCONNECT` at once, but nobody is told when it happens. UCX
//! runs the handler inside worker progress as soon as a TCP lane reads the
//! peer's FIN or RST, milliseconds after a peer process dies, long before a
//! periodic heartbeat would ask. `nixl-sys`'s interposer
//! (`shim/ep_watch.c`, loaded with the endpoint-close one) wraps that
//! handler; this module turns what it records into [`EndpointFailure`]s
//! for whoever watches an agent ([`crate::Agent::watch_endpoint_failures`],
//! or [`watch`] for an agent made through another binding).
//!
//! The remote agent is known for endpoints created inside a load that went
//! through this crate ([`crate::Agent::load_remote_metadata`], or
//! [`around_load`] + [`LoadedEndpoints::belong_to`] for another binding's
//! load): NIXL creates them there, one per worker, on the calling thread.
//! A failure of any other endpoint (created elsewhere, or failing before
//! its load returned) reaches every watcher with no remote name: check
//! every peer.
//!
//! What this cannot see: a lane UCX checks only at its keepalive round
//! (shared memory, cross-memory attach; a host gone silently, with no FIN),
//! and an agent whose worker nobody progresses (UCX runs handlers only
//! inside progress). A failure is a suspicion, never a verdict: confirm it
//! with a notification.
//!
//! One thread per process (`nixl-ep-watch`, blocked on an eventfd while
//! nothing fails) hands failures to the watchers' callbacks; keep them
//! short (send on a channel).

use std::collections::HashMap;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, OnceLock};

use nixl_sys::endpoints::{EpClose, EpFailure, WatchedEps};

pub use nixl_sys::endpoints::{EndpointWatchMode, EpWatchCounts};

/// One endpoint UCX failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointFailure {
    /// The local agent whose endpoint failed, when known; `None` for an
    /// endpoint no load named (every watcher is told).
    pub local_agent: Option<Arc<str>>,
    /// The remote agent it connected to, when known.
    pub remote_agent: Option<Arc<str>>,
    /// The `ucs_status_t` UCX handed the handler (UCX's numbering, e.g.
    /// -25 `UCS_ERR_CONNECTION_RESET`), kept raw.
    pub ucs_status: i64,
    /// `CLOCK_MONOTONIC` in nanoseconds when UCX ran the handler (compare
    /// with [`monotonic_ns`]).
    pub at_ns: u64,
}

/// `CLOCK_MONOTONIC` now, in nanoseconds: the clock of
/// [`EndpointFailure::at_ns`].
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for clock_gettime to write.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

type Callback = Arc<dyn Fn(EndpointFailure) + Send + Sync>;

/// (local agent, remote agent): who an endpoint connects.
type Pair = (Arc<str>, Arc<str>);

/// Who owns which endpoint, and who watches which agent.
#[derive(Default)]
struct Registry {
    /// Endpoint -> (local agent, remote agent).
    owners: HashMap<u64, Pair>,
    /// (local agent, remote agent) -> its endpoints, to forget them.
    by_pair: HashMap<Pair, Vec<u64>>,
    /// Watchers: id, local agent, callback.
    watchers: Vec<(u64, Arc<str>, Callback)>,
    next_id: u64,
}

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    REGISTRY
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

fn ep_close() -> Option<&'static EpClose> {
    EpClose::process().ok()
}

/// Whether endpoint failures are watched in this process (see
/// [`EndpointWatchMode`]).
pub fn mode() -> EndpointWatchMode {
    match ep_close() {
        Some(e) => e.watch_mode(),
        None => EndpointWatchMode::Unavailable("NIXL_SYS_EP_CLOSE has a bad value".into()),
    }
}

/// What the interposer counted in this process since it was loaded.
pub fn counts() -> EpWatchCounts {
    ep_close().map(EpClose::watch_counts).unwrap_or_default()
}

/// The endpoints one load created: name them with
/// [`LoadedEndpoints::belong_to`] once the load said which agent it was.
#[must_use = "name the endpoints with belong_to, or their failures reach every watcher unnamed"]
#[derive(Debug, Default)]
pub struct LoadedEndpoints(Option<WatchedEps>, crate::gpu::LoadedMappings);

impl LoadedEndpoints {
    /// How many endpoints the load created (0 when not watched).
    pub fn created(&self) -> usize {
        self.0.as_ref().map_or(0, |w| w.created)
    }

    /// Records that these endpoints connect `local` to `remote` (replacing
    /// what an earlier load of the pair recorded).
    /// The rkeys the load unpacked are named too, for the release of the
    /// pair's GPU mappings (see [`crate::gpu`]).
    pub fn belong_to(self, local: &str, remote: &str) {
        self.1.belong_to(local, remote);
        let Some(w) = self.0 else {
            return;
        };
        let pair: Pair = (local.into(), remote.into());
        let mut r = registry();
        for ep in &w.eps {
            // An endpoint's address may be reused after a close: the
            // newest load owns it.
            if let Some(old) = r.owners.insert(*ep, pair.clone()) {
                if old != pair {
                    if let Some(v) = r.by_pair.get_mut(&old) {
                        v.retain(|e| e != ep);
                    }
                }
            }
        }
        r.by_pair.entry(pair).or_default().extend(w.eps);
    }
}

/// Runs `load`, another binding's `loadRemoteMD` (NIXL's Python
/// `add_remote_agent`), and lists the endpoints it created on this thread.
///
/// The rkeys NIXL unpacks in it are listed too (see [`crate::gpu`]).
pub fn around_load<T>(load: impl FnOnce() -> T) -> (T, LoadedEndpoints) {
    let ((out, eps), mappings) = crate::gpu::around_load(|| match ep_close() {
        Some(e) => e.watching(load),
        None => (load(), None),
    });
    (out, LoadedEndpoints(eps, mappings))
}

/// Forgets the endpoints `local` holds to `remote` (its metadata was
/// invalidated: they are closed).
pub fn forget(local: &str, remote: &str) {
    let mut r = registry();
    let key: Pair = (local.into(), remote.into());
    if let Some(eps) = r.by_pair.remove(&key) {
        for ep in eps {
            if r.owners.get(&ep) == Some(&key) {
                r.owners.remove(&ep);
            }
        }
    }
}

/// Forgets every endpoint of `local` (the agent is destroyed).
pub(crate) fn forget_agent(local: &str) {
    let mut r = registry();
    let pairs: Vec<_> = r
        .by_pair
        .keys()
        .filter(|(l, _)| &**l == local)
        .cloned()
        .collect();
    for key in pairs {
        if let Some(eps) = r.by_pair.remove(&key) {
            for ep in eps {
                if r.owners.get(&ep) == Some(&key) {
                    r.owners.remove(&ep);
                }
            }
        }
    }
}

/// Stops the watch it came from when dropped.
#[must_use = "the watch stops when this is dropped"]
#[derive(Debug)]
pub struct EndpointFailureWatch {
    id: u64,
}

impl Drop for EndpointFailureWatch {
    fn drop(&mut self) {
        registry().watchers.retain(|(id, _, _)| *id != self.id);
    }
}

/// Calls `on_failure` for each endpoint UCX fails that `local` holds (with
/// the remote agent's name) and for each failure no load named (without
/// it), from the process's `nixl-ep-watch` thread, until the returned
/// watch drops. `Err` with the reason when failures are not watched in
/// this process ([`mode`]).
pub fn watch(
    local: &str,
    on_failure: impl Fn(EndpointFailure) + Send + Sync + 'static,
) -> Result<EndpointFailureWatch, String> {
    match mode() {
        EndpointWatchMode::Watching => {}
        EndpointWatchMode::Unavailable(why) => return Err(why),
        EndpointWatchMode::Pending => {
            return Err("NIXL's UCX plugin is not loaded yet (no agent exists)".into())
        }
    }
    dispatcher()?;
    let mut r = registry();
    r.next_id += 1;
    let id = r.next_id;
    r.watchers.push((id, local.into(), Arc::new(on_failure)));
    Ok(EndpointFailureWatch { id })
}

/// Starts the process's dispatcher once: an eventfd the interposer writes
/// to, and the thread that reads it.
fn dispatcher() -> Result<(), String> {
    static STARTED: OnceLock<Result<(), String>> = OnceLock::new();
    STARTED.get_or_init(start_dispatcher).clone()
}

fn start_dispatcher() -> Result<(), String> {
    let e = ep_close().ok_or("no interposer")?;
    // SAFETY: eventfd takes no pointers; the result is checked below.
    let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if raw < 0 {
        return Err(format!("eventfd: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: `raw` is the descriptor just created, owned by nothing else.
    // It is leaked into a static below: the interposer may write to it for
    // the life of the process.
    let fd: &'static OwnedFd = Box::leak(Box::new(unsafe { OwnedFd::from_raw_fd(raw) }));
    let reader = fd.try_clone().map_err(|e| format!("dup: {e}"))?;
    std::thread::Builder::new()
        .name("nixl-ep-watch".into())
        .spawn(move || dispatch(e, reader))
        .map_err(|e| format!("spawn: {e}"))?;
    e.watch_wake_fd(Some(fd.as_fd()));
    Ok(())
}

fn dispatch(e: &'static EpClose, fd: OwnedFd) {
    let mut file = std::fs::File::from(fd);
    let mut failures: Vec<EpFailure> = Vec::new();
    let mut lost_seen = 0;
    loop {
        let mut buf = [0u8; 8];
        if let Err(err) = std::io::Read::read_exact(&mut file, &mut buf) {
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        e.watch_drain(&mut failures);
        let lost = e.watch_counts().lost;
        if lost > lost_seen {
            lost_seen = lost;
            // Dropped, unnamed: every watcher checks every peer.
            failures.push(EpFailure {
                ep: 0,
                status: 0,
                at_ns: monotonic_ns(),
            });
        }
        for f in failures.drain(..) {
            deliver(f);
        }
    }
}

fn deliver(f: EpFailure) {
    let (owner, targets): (Option<Pair>, Vec<Callback>) = {
        let r = registry();
        let owner = r.owners.get(&f.ep).cloned();
        let targets = r
            .watchers
            .iter()
            .filter(|(_, local, _)| owner.as_ref().is_none_or(|(l, _)| l == local))
            .map(|(_, _, cb)| cb.clone())
            .collect();
        (owner, targets)
    };
    let (local_agent, remote_agent) = match owner {
        Some((l, r)) => (Some(l), Some(r)),
        None => (None, None),
    };
    for cb in targets {
        cb(EndpointFailure {
            local_agent: local_agent.clone(),
            remote_agent: remote_agent.clone(),
            ucs_status: f.status,
            at_ns: f.at_ns,
        });
    }
}

//! A released peer's GPU memory, given back while UCX's CUDA IPC cache is
//! on (`UCX_CUDA_IPC_CACHE=y`, UCX's default).
//!
//! UCX maps a peer's GPU allocation at the first zero-copy transfer and
//! keeps the mapping in a process-wide cache until the process exits: the
//! mapping alone keeps the peer's memory allocated, so a restarted prefill
//! cannot get its memory back (measured on an H200, docs/gpu-check.md).
//! `nixl-sys`'s ledger (`shim/gpu_map.c`, see [`nixl_sys::gpu`]) follows
//! UCX's cache; this module names who uses what and gives it back:
//! - a load made through this crate ([`crate::Agent::load_remote_metadata`],
//!   or [`crate::failures::around_load`] + `belong_to` for another
//!   binding's load) names the rkeys NIXL unpacks in it, and so every
//!   region a transfer with those keys maps, by its (local agent, remote
//!   agent) pair;
//! - the invalidation of that pair ([`crate::Agent::invalidate_remote_metadata`],
//!   [`crate::EndpointCloser::invalidate`]), made once no transfer with it
//!   is in flight, gives back each region no other pair uses: UCX removes
//!   it from its cache and closes it itself, unless a transfer of anyone
//!   holds it (then at that transfer's end). A peer that comes back with
//!   the same process maps afresh: its lookup misses.
//!
//! A region also used by an rkey no load named (a load made without this
//! crate) is never given back. [`mode`] says whether this runs here.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use nixl_sys::endpoints::EpClose;
use nixl_sys::gpu::GpuHooks;

pub use nixl_sys::gpu::{GpuCounts, GpuImport, GpuMapping, GpuReleaseCounts, GpuUnmapMode};

/// (local agent, remote agent) -> the ledger's number for the pair.
#[derive(Default)]
struct Pairs {
    by_pair: HashMap<(String, String), u64>,
    next: u64,
}

fn pairs() -> MutexGuard<'static, Pairs> {
    static PAIRS: OnceLock<Mutex<Pairs>> = OnceLock::new();
    PAIRS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

fn hooks() -> Option<&'static GpuHooks> {
    EpClose::process().ok().and_then(EpClose::gpu)
}

/// Whether releases give UCX's cached GPU mappings back in this process:
/// [`GpuUnmapMode::Pending`] until a UCX backend exists, then whether
/// UCX's CUDA transport and libucp call the ledger (checked in their
/// relocations).
pub fn mode() -> GpuUnmapMode {
    let Ok(process) = EpClose::process() else {
        return GpuUnmapMode::Unavailable("NIXL_SYS_EP_CLOSE has a bad value".into());
    };
    if let Some(why) = process.not_loaded() {
        return GpuUnmapMode::Unavailable(why);
    }
    match process.gpu() {
        Some(h) => h.check(),
        None => GpuUnmapMode::Unavailable("the interposer is not loaded".into()),
    }
}

/// Turns the ledger on or off for the process (the service's knob,
/// `NIXL_KEEPALIVE_GPU_UNMAP`). Off gives back every reference it holds:
/// UCX keeps those regions cached, as it would without it. Call it before
/// transfers start; turned on later, it sees only regions mapped from then
/// on.
pub fn set_enabled(on: bool) {
    if let Some(h) = hooks() {
        h.set_enabled(on);
    }
}

/// The ledger's process-wide counts (zero when it cannot run here).
pub fn counts() -> GpuCounts {
    hooks().map(GpuHooks::counts).unwrap_or_default()
}

/// Every mapping UCX's cache holds that the ledger saw opened.
pub fn ledger() -> Vec<GpuMapping> {
    hooks().map(GpuHooks::ledger).unwrap_or_default()
}

/// The rkeys one load unpacked (and the regions it mapped): name them with
/// [`LoadedMappings::belong_to`]; dropped unnamed, their regions are never
/// given back.
#[derive(Debug, Default)]
pub struct LoadedMappings(u64);

impl LoadedMappings {
    /// Names them as used by `local`'s metadata of `remote`.
    pub fn belong_to(mut self, local: &str, remote: &str) {
        let batch = std::mem::take(&mut self.0);
        if batch == 0 {
            return;
        }
        if let Some(h) = hooks() {
            let pair = {
                let mut p = pairs();
                let key = (local.to_owned(), remote.to_owned());
                if let Some(&pair) = p.by_pair.get(&key) {
                    pair
                } else {
                    p.next += 1;
                    let pair = p.next;
                    p.by_pair.insert(key, pair);
                    pair
                }
            };
            h.assign(batch, pair);
        }
    }
}

impl Drop for LoadedMappings {
    fn drop(&mut self) {
        if self.0 != 0 {
            if let Some(h) = hooks() {
                h.assign(self.0, 0);
            }
        }
    }
}

/// Runs `load` with a load scope open on this thread (closed on unwind
/// too): the rkeys it unpacks become a batch to name.
pub(crate) fn around_load<T>(load: impl FnOnce() -> T) -> (T, LoadedMappings) {
    let Some(h) = hooks() else {
        return (load(), LoadedMappings(0));
    };
    /// Closes the scope even if `load` unwinds.
    struct Scope<'a>(&'a GpuHooks, bool);
    impl Drop for Scope<'_> {
        fn drop(&mut self) {
            if std::mem::take(&mut self.1) {
                let batch = self.0.scope_end();
                self.0.assign(batch, 0);
            }
        }
    }
    h.scope_begin();
    let mut scope = Scope(h, true);
    let out = load();
    scope.1 = false;
    (out, LoadedMappings(h.scope_end()))
}

/// What one release did to the pair's GPU mappings; `None` when the ledger
/// does not run here or knew nothing of the pair.
pub(crate) fn released(local: &str, remote: &str) -> Option<GpuReleaseCounts> {
    let h = hooks()?;
    let pair = pairs()
        .by_pair
        .remove(&(local.to_owned(), remote.to_owned()))?;
    Some(h.release(pair))
}

/// Gives back what every pair of `local` used (the agent is destroyed:
/// its rkeys went with it).
pub(crate) fn forget_agent(local: &str) {
    let Some(h) = hooks() else {
        return;
    };
    let gone: Vec<u64> = {
        let mut p = pairs();
        let keys: Vec<_> = p
            .by_pair
            .keys()
            .filter(|(l, _)| l == local)
            .cloned()
            .collect();
        keys.into_iter()
            .filter_map(|k| p.by_pair.remove(&k))
            .collect()
    };
    for pair in gone {
        h.release(pair);
    }
}

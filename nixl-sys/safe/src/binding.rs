//! Where nixl-sys's raw values become this crate's: the one place a raw
//! call's status becomes a `Result` ([`op`]), and the owner every C API
//! object a raw call creates goes into before anything else uses it
//! ([`CapiGuard::adopt`]). The longer-lived handles (agent, registrations,
//! dlist handles, requests) are owned by their types in `agent.rs`, each
//! made in one constructor and released once, in its `Drop`.

use std::ffi::{c_int, c_void};

use nixl_sys::{NixlStatus, RawStatus};

use crate::error::{check, NixlError};

type CapiHandle = *mut c_void;

/// A raw call's status as a `Result`: `SUCCESS` and `IN_PROG` pass, every
/// other status is a [`NixlError`] of `operation` that keeps the code and
/// where it came from.
pub(crate) fn op(operation: &'static str, raw: RawStatus) -> Result<NixlStatus, NixlError> {
    check(operation, raw.0, raw.1)
}

/// A C API object (notification map, xfer dlist, opt args) owned alone,
/// destroyed once, on drop.
pub(crate) struct CapiGuard {
    p: CapiHandle,
    destroy: unsafe extern "C" fn(CapiHandle) -> c_int,
}

impl CapiGuard {
    /// Takes ownership of `p`.
    ///
    /// # Safety
    ///
    /// `p` must be a live C API object that a successful `create_*` call
    /// just returned, `destroy` the matching `destroy_*` entry point of the
    /// same runtime, and nothing else may own or destroy `p`.
    pub(crate) unsafe fn adopt(
        p: CapiHandle,
        destroy: unsafe extern "C" fn(CapiHandle) -> c_int,
    ) -> CapiGuard {
        CapiGuard { p, destroy }
    }

    /// The object, for raw calls while the guard lives.
    pub(crate) fn ptr(&self) -> CapiHandle {
        self.p
    }
}

impl Drop for CapiGuard {
    fn drop(&mut self) {
        // SAFETY: by `adopt`'s contract `p` is a live object of the kind
        // `destroy` expects, owned by this guard alone; this drop is its
        // last use.
        unsafe { (self.destroy)(self.p) };
    }
}

// SAFETY: the guarded objects (opt args, xfer dlists, notification maps) are
// plain heap data of the C API, tied to no thread, and owned by the guard
// alone; destroying one from another thread is fine.
unsafe impl Send for CapiGuard {}
// SAFETY: a `&CapiGuard` gives only the pointer's value: no `&self` method
// calls into NIXL (the object is read by NIXL only in calls made by its
// owner, and destroyed through `&mut self` in `drop`).
unsafe impl Sync for CapiGuard {}

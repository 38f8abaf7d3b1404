//! The interface a status came through. The status itself, `nixl_status_t`
//! kept raw, is [`NixlStatus`](crate::NixlStatus) of the `nixl-status` crate (re-exported
//! here): the keepalive's core names it without building this crate's C++
//! shim.

/// Which interface a status came through, so a reader knows how much it
/// can trust the code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StatusSource {
    /// The C++ member itself, through this crate's shim: the raw
    /// `nixl_status_t`.
    Cpp,
    /// The newer C API that maps statuses 1:1 (exports
    /// `nixl_capi_get_version`).
    CapiV1,
    /// The released 1.5.x C API, which collapses most failures into
    /// `ERR_BACKEND`: a `BACKEND` from here may hide any other failure.
    CapiCollapsed,
    /// The bindings (`nixl-sys`, `nixl-agent`) refused the call before
    /// reaching NIXL (for example an argument NIXL cannot represent).
    Crate,
}

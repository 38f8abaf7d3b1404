//! Finding and loading the NIXL runtime, and the raw calls into it.
//!
//! Nothing links against NIXL: `libnixl.so` and `libnixl_capi.so` are
//! opened with `dlopen` the first time [`Runtime::get`] is called, and stay
//! loaded for the life of the process (NIXL and UCX start threads and
//! register handlers that must never be unloaded).
//!
//! Two runtime flavours are supported, told apart by the presence of
//! `nixl_capi_get_version`:
//! - the released 1.5.x runtime, whose C API collapses statuses: the calls
//!   whose status matters go to the C++ members through the shim
//!   (`shim/nixl_shim.cpp`), everything else to the C API;
//! - a runtime with the newer 1:1 C API: everything goes to the C API.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};

use crate::endpoints::{EndpointCloseMode, EpClose, EP_CLOSE_ACCEPTED, EP_CLOSE_ENV};
use crate::error::LoadError;
use crate::locate::find_lib_dir;
use crate::status::StatusSource;
use crate::NixlStatus;

/// Where `scripts/install-nixl.sh` installs the runtime for this build (or
/// `NIXL_PREFIX` as it was at build time).
pub const DEFAULT_RUNTIME_DIR: &str = env!("NIXL_SYS_DEFAULT_RUNTIME");

/// The environment variable that points at another NIXL install.
pub const PREFIX_ENV: &str = "NIXL_PREFIX";

/// Which interface carries the statuses that matter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApiKind {
    /// NIXL 1.5.x: collapsed C API, raw statuses through the C++ shim.
    CollapsedCapiWithShim,
    /// A runtime exporting `nixl_capi_get_version`: 1:1 C API.
    CapiV1,
}

/// A raw C API or shim status (`nixl_capi_status_t`, or the C++
/// `nixl_status_t` from the shim), before translation.
pub type CapiStatus = c_int;
/// An opaque C API handle (agent, dlist, request, map, ...).
pub type CapiHandle = *mut c_void;

/// `nixl_capi_agent_config_t`, declared from its documented fields (field
/// order and types matter: 40 bytes, checked against the 1.5.1 library's
/// reads at offsets 0, 1, 4, 8, 16, 24, 32).
#[repr(C)]
pub struct CapiAgentConfig {
    pub enable_prog_thread: bool,
    pub enable_listen_thread: bool,
    pub listen_port: c_int,
    pub thread_sync: c_int,
    pub num_workers: u32,
    pub pthr_delay_us: u64,
    pub lthr_delay_us: u64,
    pub capture_telemetry: bool,
}

/// C API entry points (the subset the bindings use), each with the
/// signature `nixl_capi.h` declares for it. Calling one is `unsafe`: the
/// caller upholds the C API's own contract for that function (live
/// handles of this runtime, valid out-pointers, buffers valid for their
/// lengths).
pub struct Capi {
    pub create_configured_agent:
        unsafe extern "C" fn(*const c_char, *const CapiAgentConfig, *mut CapiHandle) -> CapiStatus,
    pub destroy_agent: unsafe extern "C" fn(CapiHandle) -> CapiStatus,
    pub get_plugin_params: unsafe extern "C" fn(
        CapiHandle,
        *const c_char,
        *mut CapiHandle,
        *mut CapiHandle,
    ) -> CapiStatus,
    pub destroy_mem_list: unsafe extern "C" fn(CapiHandle) -> CapiStatus,
    pub destroy_params: unsafe extern "C" fn(CapiHandle) -> CapiStatus,
    pub create_backend:
        unsafe extern "C" fn(CapiHandle, *const c_char, CapiHandle, *mut CapiHandle) -> CapiStatus,
    pub destroy_backend: unsafe extern "C" fn(CapiHandle) -> CapiStatus,
    pub get_local_md: unsafe extern "C" fn(CapiHandle, *mut CapiHandle, *mut usize) -> CapiStatus,
    pub load_remote_md:
        unsafe extern "C" fn(CapiHandle, *const c_void, usize, *mut *mut c_char) -> CapiStatus,
    pub invalidate_remote_md: unsafe extern "C" fn(CapiHandle, *const c_char) -> CapiStatus,
    pub create_reg_dlist: unsafe extern "C" fn(c_int, *mut CapiHandle) -> CapiStatus,
    pub destroy_reg_dlist: unsafe extern "C" fn(CapiHandle) -> CapiStatus,
    pub reg_dlist_add_desc:
        unsafe extern "C" fn(CapiHandle, usize, usize, u64, *const c_void, usize) -> CapiStatus,
    pub register_mem: unsafe extern "C" fn(CapiHandle, CapiHandle, CapiHandle) -> CapiStatus,
    pub deregister_mem: unsafe extern "C" fn(CapiHandle, CapiHandle, CapiHandle) -> CapiStatus,
    pub create_xfer_dlist: unsafe extern "C" fn(c_int, *mut CapiHandle) -> CapiStatus,
    pub destroy_xfer_dlist: unsafe extern "C" fn(CapiHandle) -> CapiStatus,
    pub xfer_dlist_add_desc: unsafe extern "C" fn(CapiHandle, usize, usize, u64) -> CapiStatus,
    pub prep_xfer_dlist: unsafe extern "C" fn(
        CapiHandle,
        *const c_char,
        CapiHandle,
        *mut CapiHandle,
        CapiHandle,
    ) -> CapiStatus,
    pub release_xfer_dlist_handle: unsafe extern "C" fn(CapiHandle, CapiHandle) -> CapiStatus,
    #[allow(clippy::type_complexity)]
    pub make_xfer_req: unsafe extern "C" fn(
        CapiHandle,
        c_int,
        CapiHandle,
        *const c_int,
        usize,
        CapiHandle,
        *const c_int,
        usize,
        *mut CapiHandle,
        CapiHandle,
    ) -> CapiStatus,
    pub post_xfer_req: unsafe extern "C" fn(CapiHandle, CapiHandle, CapiHandle) -> CapiStatus,
    pub get_xfer_status: unsafe extern "C" fn(CapiHandle, CapiHandle) -> CapiStatus,
    pub release_xfer_req: unsafe extern "C" fn(CapiHandle, CapiHandle) -> CapiStatus,
    pub destroy_xfer_req: unsafe extern "C" fn(CapiHandle) -> CapiStatus,
    pub create_opt_args: unsafe extern "C" fn(*mut CapiHandle) -> CapiStatus,
    pub destroy_opt_args: unsafe extern "C" fn(CapiHandle) -> CapiStatus,
    pub opt_args_set_notif_msg:
        unsafe extern "C" fn(CapiHandle, *const c_void, usize) -> CapiStatus,
    pub opt_args_set_has_notif: unsafe extern "C" fn(CapiHandle, bool) -> CapiStatus,
    pub gen_notif: unsafe extern "C" fn(
        CapiHandle,
        *const c_char,
        *const c_void,
        usize,
        CapiHandle,
    ) -> CapiStatus,
    pub create_notif_map: unsafe extern "C" fn(*mut CapiHandle) -> CapiStatus,
    pub destroy_notif_map: unsafe extern "C" fn(CapiHandle) -> CapiStatus,
    pub get_notifs: unsafe extern "C" fn(CapiHandle, CapiHandle, CapiHandle) -> CapiStatus,
    pub notif_map_size: unsafe extern "C" fn(CapiHandle, *mut usize) -> CapiStatus,
    pub notif_map_get_agent_at:
        unsafe extern "C" fn(CapiHandle, usize, *mut *const c_char) -> CapiStatus,
    pub notif_map_get_notifs_size:
        unsafe extern "C" fn(CapiHandle, *const c_char, *mut usize) -> CapiStatus,
    pub notif_map_get_notif: unsafe extern "C" fn(
        CapiHandle,
        *const c_char,
        usize,
        *mut *const c_void,
        *mut usize,
    ) -> CapiStatus,
}

/// An address inside libnixl.so (a C++ member function). Plain code
/// addresses, valid for the life of the process because the library is
/// never unloaded.
#[derive(Clone, Copy)]
struct Member(*const c_void);
// SAFETY: a `Member` is only a code address in libnixl, which stays loaded
// for the life of the process; it is never read or written through, only
// handed to the shim to call, so moving it to another thread moves no data.
unsafe impl Send for Member {}
// SAFETY: as for `Send`: a shared `&Member` only gives out the same
// immutable address.
unsafe impl Sync for Member {}

/// The C++ members reached through the shim on a collapsed-C-API runtime.
/// The mangled names are those exported by libnixl.so 1.5.1 (`nm -D`).
struct CppMembers {
    pub gen_notif: Member,
    pub post_xfer_req: Member,
    pub get_xfer_status: Member,
    pub release_xfer_req: Member,
    pub invalidate_remote_md: Member,
    pub released_dlist_h: Member,
    pub load_remote_md: Member,
    pub prep_local_dlist: Member,
    pub prep_remote_dlist: Member,
    pub make_xfer_req: Member,
    pub get_local_md: Member,
}

const CPP_GEN_NOTIF: &str = "_ZNK9nixlAgent8genNotifERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEES7_PK21nixlAgentOptionalArgs";
const CPP_POST_XFER_REQ: &str =
    "_ZNK9nixlAgent11postXferReqEP12nixlXferReqHPK21nixlAgentOptionalArgs";
const CPP_GET_XFER_STATUS: &str = "_ZNK9nixlAgent13getXferStatusEP12nixlXferReqH";
const CPP_RELEASE_XFER_REQ: &str = "_ZNK9nixlAgent14releaseXferReqEP12nixlXferReqH";
const CPP_INVALIDATE_REMOTE_MD: &str =
    "_ZN9nixlAgent18invalidateRemoteMDERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE";
const CPP_RELEASED_DLIST_H: &str = "_ZNK9nixlAgent14releasedDlistHEP10nixlDlistH";
const CPP_LOAD_REMOTE_MD: &str =
    "_ZN9nixlAgent12loadRemoteMDERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEERS5_";
const CPP_PREP_LOCAL_DLIST: &str = "_ZNK9nixlAgent13prepXferDlistERK12nixlDescListI13nixlBasicDescERP10nixlDlistHPK21nixlAgentOptionalArgs";
const CPP_PREP_REMOTE_DLIST: &str = "_ZNK9nixlAgent13prepXferDlistERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEERK12nixlDescListI13nixlBasicDescERP10nixlDlistHPK21nixlAgentOptionalArgs";
const CPP_GET_LOCAL_MD: &str =
    "_ZNK9nixlAgent10getLocalMDERNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE";
const CPP_MAKE_XFER_REQ: &str = "_ZNK9nixlAgent11makeXferReqERK14nixl_xfer_op_tPK10nixlDlistHRKSt6vectorIiSaIiEES5_SA_RP12nixlXferReqHPK21nixlAgentOptionalArgs";

// The shim (shim/nixl_shim.cpp, compiled by build.rs). Each takes the
// member's address first and returns the raw nixl_status_t.
extern "C" {
    fn nks_gen_notif(
        f: *const c_void,
        agent: *const c_void,
        remote: *const c_char,
        remote_len: usize,
        msg: *const c_char,
        msg_len: usize,
        opt: *const c_void,
    ) -> CapiStatus;
    fn nks_post_xfer_req(
        f: *const c_void,
        agent: *const c_void,
        req: CapiHandle,
        opt: *const c_void,
    ) -> CapiStatus;
    fn nks_get_xfer_status(f: *const c_void, agent: *const c_void, req: CapiHandle) -> CapiStatus;
    fn nks_release_xfer_req(f: *const c_void, agent: *const c_void, req: CapiHandle) -> CapiStatus;
    fn nks_invalidate_remote_md(
        f: *const c_void,
        agent: CapiHandle,
        remote: *const c_char,
        remote_len: usize,
    ) -> CapiStatus;
    fn nks_release_dlist_handle(
        f: *const c_void,
        agent: *const c_void,
        dlist: CapiHandle,
    ) -> CapiStatus;
    fn nks_load_remote_md(
        f: *const c_void,
        agent: CapiHandle,
        md: *const c_void,
        md_len: usize,
        name_out: *mut *mut c_char,
        name_len: *mut usize,
    ) -> CapiStatus;
    fn nks_prep_local_dlist(
        f: *const c_void,
        agent: *const c_void,
        descs: *const c_void,
        out: *mut CapiHandle,
        opt: *const c_void,
    ) -> CapiStatus;
    fn nks_prep_remote_dlist(
        f: *const c_void,
        agent: *const c_void,
        remote: *const c_char,
        remote_len: usize,
        descs: *const c_void,
        out: *mut CapiHandle,
        opt: *const c_void,
    ) -> CapiStatus;
    #[allow(clippy::too_many_arguments)]
    fn nks_make_xfer_req(
        f: *const c_void,
        agent: *const c_void,
        op: c_int,
        local: *const c_void,
        local_idx: *const c_int,
        local_count: usize,
        remote: *const c_void,
        remote_idx: *const c_int,
        remote_count: usize,
        out: *mut CapiHandle,
        opt: *const c_void,
    ) -> CapiStatus;
    fn nks_get_local_md(
        f: *const c_void,
        agent: *const c_void,
        out: *mut *mut c_char,
        len: *mut usize,
    ) -> CapiStatus;
    fn nks_free(p: *mut c_void);
}

enum Flavor {
    Collapsed(CppMembers),
    V1,
}

/// A loaded NIXL runtime. Obtain it with [`Runtime::get`].
pub struct Runtime {
    lib_dir: PathBuf,
    capi: Capi,
    flavor: Flavor,
    ep_close: &'static EpClose,
    // Kept so the libraries are never closed (the Runtime lives in a static).
    _libnixl: Library,
    _libcapi: Library,
}

static RUNTIME: OnceLock<Result<Runtime, LoadError>> = OnceLock::new();

impl Runtime {
    /// Loads the runtime once per process (later calls return the same
    /// result). Location: `$NIXL_PREFIX` if set, else
    /// [`DEFAULT_RUNTIME_DIR`].
    pub fn get() -> Result<&'static Runtime, LoadError> {
        RUNTIME
            .get_or_init(Self::load)
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The directory the libraries were loaded from.
    pub fn lib_dir(&self) -> &Path {
        &self.lib_dir
    }

    /// How the UCX endpoints of an invalidated agent are closed in this
    /// process (see [`crate::endpoints`]): [`EndpointCloseMode::Pending`]
    /// until an agent has loaded NIXL's UCX plugin (with the 1.5.x runtime,
    /// the layout probe at load does).
    pub fn endpoint_close_mode(&self) -> EndpointCloseMode {
        self.ep_close.mode()
    }

    /// The process's endpoint-close interposer, installed before libnixl
    /// was loaded.
    pub fn ep_close(&self) -> &'static EpClose {
        self.ep_close
    }

    /// Which interface carries the statuses.
    pub fn api_kind(&self) -> ApiKind {
        match self.flavor {
            Flavor::Collapsed(_) => ApiKind::CollapsedCapiWithShim,
            Flavor::V1 => ApiKind::CapiV1,
        }
    }

    fn load() -> Result<Runtime, LoadError> {
        let (location, origin) = match std::env::var_os(PREFIX_ENV) {
            Some(p) if !p.is_empty() => (PathBuf::from(p), "from NIXL_PREFIX"),
            _ => (PathBuf::from(DEFAULT_RUNTIME_DIR), "build-time default"),
        };
        let lib_dir = find_lib_dir(&location).map_err(|tried| LoadError::NotFound {
            location: location.clone(),
            origin,
            tried,
        })?;
        // Before libnixl: NIXL's UCX plugin, loaded later, must find the
        // endpoint-close interposer in the global scope (installed already
        // when `EndpointCloser::install` came first: one per process).
        let ep_close = EpClose::process().map_err(|bad| LoadError::BadSetting {
            variable: EP_CLOSE_ENV,
            value: bad.0,
            accepted: EP_CLOSE_ACCEPTED,
        })?;
        let nixl_path = lib_dir.join("libnixl.so");
        let capi_path = lib_dir.join("libnixl_capi.so");
        let open = |path: &Path| {
            // SAFETY: loading NIXL runs its (and UCX's) initialisers; those are
            // the libraries this crate exists to use, loaded by absolute path
            // from the runtime folder found above, and never unloaded (the
            // `Library`s live in the static `Runtime`).
            unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL) }.map_err(|e| {
                LoadError::Open {
                    path: path.to_path_buf(),
                    message: e.to_string(),
                }
            })
        };
        let libnixl = open(&nixl_path)?;
        let libcapi = open(&capi_path)?;

        macro_rules! sym {
            ($lib:expr, $path:expr, $name:expr) => {{
                // SAFETY: the symbol's type is the `Capi` field it is stored
                // in, declared from the C API's signature (nixl_capi.h). The
                // function pointer copied out of the `Symbol` outlives the
                // borrow of `$lib`: sound because the library is moved into
                // the `Runtime`, which lives in a static and never unloads
                // it (on an error return nothing keeps the pointers).
                match unsafe { $lib.get(concat!($name, "\0").as_bytes()) } {
                    Ok(s) => *s,
                    Err(_) => {
                        return Err(LoadError::MissingSymbol {
                            path: $path.clone(),
                            symbol: $name.to_string(),
                        })
                    }
                }
            }};
        }
        let capi = Capi {
            create_configured_agent: sym!(libcapi, capi_path, "nixl_capi_create_configured_agent"),
            destroy_agent: sym!(libcapi, capi_path, "nixl_capi_destroy_agent"),
            get_plugin_params: sym!(libcapi, capi_path, "nixl_capi_get_plugin_params"),
            destroy_mem_list: sym!(libcapi, capi_path, "nixl_capi_destroy_mem_list"),
            destroy_params: sym!(libcapi, capi_path, "nixl_capi_destroy_params"),
            create_backend: sym!(libcapi, capi_path, "nixl_capi_create_backend"),
            destroy_backend: sym!(libcapi, capi_path, "nixl_capi_destroy_backend"),
            get_local_md: sym!(libcapi, capi_path, "nixl_capi_get_local_md"),
            load_remote_md: sym!(libcapi, capi_path, "nixl_capi_load_remote_md"),
            invalidate_remote_md: sym!(libcapi, capi_path, "nixl_capi_invalidate_remote_md"),
            create_reg_dlist: sym!(libcapi, capi_path, "nixl_capi_create_reg_dlist"),
            destroy_reg_dlist: sym!(libcapi, capi_path, "nixl_capi_destroy_reg_dlist"),
            reg_dlist_add_desc: sym!(libcapi, capi_path, "nixl_capi_reg_dlist_add_desc"),
            register_mem: sym!(libcapi, capi_path, "nixl_capi_register_mem"),
            deregister_mem: sym!(libcapi, capi_path, "nixl_capi_deregister_mem"),
            create_xfer_dlist: sym!(libcapi, capi_path, "nixl_capi_create_xfer_dlist"),
            destroy_xfer_dlist: sym!(libcapi, capi_path, "nixl_capi_destroy_xfer_dlist"),
            xfer_dlist_add_desc: sym!(libcapi, capi_path, "nixl_capi_xfer_dlist_add_desc"),
            prep_xfer_dlist: sym!(libcapi, capi_path, "nixl_capi_prep_xfer_dlist"),
            release_xfer_dlist_handle: sym!(
                libcapi,
                capi_path,
                "nixl_capi_release_xfer_dlist_handle"
            ),
            make_xfer_req: sym!(libcapi, capi_path, "nixl_capi_make_xfer_req"),
            post_xfer_req: sym!(libcapi, capi_path, "nixl_capi_post_xfer_req"),
            get_xfer_status: sym!(libcapi, capi_path, "nixl_capi_get_xfer_status"),
            release_xfer_req: sym!(libcapi, capi_path, "nixl_capi_release_xfer_req"),
            destroy_xfer_req: sym!(libcapi, capi_path, "nixl_capi_destroy_xfer_req"),
            create_opt_args: sym!(libcapi, capi_path, "nixl_capi_create_opt_args"),
            destroy_opt_args: sym!(libcapi, capi_path, "nixl_capi_destroy_opt_args"),
            opt_args_set_notif_msg: sym!(libcapi, capi_path, "nixl_capi_opt_args_set_notif_msg"),
            opt_args_set_has_notif: sym!(libcapi, capi_path, "nixl_capi_opt_args_set_has_notif"),
            gen_notif: sym!(libcapi, capi_path, "nixl_capi_gen_notif"),
            create_notif_map: sym!(libcapi, capi_path, "nixl_capi_create_notif_map"),
            destroy_notif_map: sym!(libcapi, capi_path, "nixl_capi_destroy_notif_map"),
            get_notifs: sym!(libcapi, capi_path, "nixl_capi_get_notifs"),
            notif_map_size: sym!(libcapi, capi_path, "nixl_capi_notif_map_size"),
            notif_map_get_agent_at: sym!(libcapi, capi_path, "nixl_capi_notif_map_get_agent_at"),
            notif_map_get_notifs_size: sym!(
                libcapi,
                capi_path,
                "nixl_capi_notif_map_get_notifs_size"
            ),
            notif_map_get_notif: sym!(libcapi, capi_path, "nixl_capi_notif_map_get_notif"),
        };

        // SAFETY: only probes whether the symbol exists; the address is typed
        // as a plain data pointer and neither called nor dereferenced.
        let has_v1 = unsafe { libcapi.get::<*const c_void>(b"nixl_capi_get_version\0") }.is_ok();
        let flavor = if has_v1 {
            Flavor::V1
        } else {
            let member = |name: &str| -> Result<Member, LoadError> {
                let cname = format!("{name}\0");
                // SAFETY: only the address is taken (as a data pointer, never
                // dereferenced here); it is called later through the shim,
                // with the C++ signature the shim declares for each mangled
                // name, while `libnixl` stays loaded in the `Runtime`.
                match unsafe { libnixl.get::<*const c_void>(cname.as_bytes()) } {
                    Ok(s) => Ok(Member(s.into_raw() as *const c_void)),
                    Err(_) => Err(LoadError::MissingSymbol {
                        path: nixl_path.clone(),
                        symbol: name.to_string(),
                    }),
                }
            };
            Flavor::Collapsed(CppMembers {
                gen_notif: member(CPP_GEN_NOTIF)?,
                post_xfer_req: member(CPP_POST_XFER_REQ)?,
                get_xfer_status: member(CPP_GET_XFER_STATUS)?,
                release_xfer_req: member(CPP_RELEASE_XFER_REQ)?,
                invalidate_remote_md: member(CPP_INVALIDATE_REMOTE_MD)?,
                released_dlist_h: member(CPP_RELEASED_DLIST_H)?,
                load_remote_md: member(CPP_LOAD_REMOTE_MD)?,
                prep_local_dlist: member(CPP_PREP_LOCAL_DLIST)?,
                prep_remote_dlist: member(CPP_PREP_REMOTE_DLIST)?,
                make_xfer_req: member(CPP_MAKE_XFER_REQ)?,
                get_local_md: member(CPP_GET_LOCAL_MD)?,
            })
        };
        let runtime = Runtime {
            lib_dir,
            capi,
            flavor,
            ep_close,
            _libnixl: libnixl,
            _libcapi: libcapi,
        };
        runtime.verify_layout(LayoutProbe::Own)?;
        Ok(runtime)
    }

    /// The shim takes a C API handle's first member for the C++ object
    /// (`nixl_capi_agent_s { nixlAgent* inner; }` in 1.5.x): a layout
    /// private to libnixl_capi that a later release may change. Checked
    /// once, before anything uses it: a throwaway agent's metadata read
    /// through the C API and through the C++ member on that pointer must
    /// be the same bytes. On any difference (or a pointer that is not into
    /// writable memory) the runtime is refused, never used half-right.
    ///
    /// `object` says whose handle the C++ member is read from:
    /// [`LayoutProbe::Own`], the probe agent's own (the layout the shim
    /// relies on). [`LayoutProbe::Another`] exists only to prove, in a
    /// test, that a wrong object is refused: it reads the member of a
    /// second, equally live probe agent, whose metadata names another
    /// agent. (An earlier form of the test read the handle's second word,
    /// past its 8-byte allocation.)
    fn verify_layout(&self, object: LayoutProbe) -> Result<(), LoadError> {
        let Flavor::Collapsed(members) = &self.flavor else {
            return Ok(());
        };
        let mismatch = |why: String| LoadError::LayoutMismatch {
            path: self.lib_dir.join("libnixl_capi.so"),
            why,
        };
        let agent = self.probe_agent("", &mismatch)?;
        let other = match object {
            LayoutProbe::Own => None,
            LayoutProbe::Another => match self.probe_agent("-other", &mismatch) {
                Ok(other) => Some(other),
                Err(e) => {
                    // SAFETY: `agent` is the probe agent just created; nothing
                    // else holds it, and it is destroyed once, here.
                    unsafe { (self.capi.destroy_agent)(agent) };
                    return Err(e);
                }
            },
        };
        let result = (|| {
            let mut data: CapiHandle = std::ptr::null_mut();
            let mut len = 0usize;
            // SAFETY: `agent` is the live probe agent; `data` and `len` are
            // valid out-pointers. On success the C API has set `data` to a
            // non-null malloc'd copy of the metadata, `len` bytes long (it
            // fails rather than return null), which is copied out, then
            // freed once with `nks_free` (the same libc `free`).
            let via_capi = unsafe {
                let st = (self.capi.get_local_md)(agent, &mut data, &mut len);
                if st != 0 {
                    return Err(mismatch(format!(
                        "getLocalMD through the C API failed ({st})"
                    )));
                }
                let v = std::slice::from_raw_parts(data as *const u8, len).to_vec();
                nks_free(data);
                v
            };
            let handle = other.unwrap_or(agent);
            // SAFETY: `handle` is a live probe agent (destroyed only after
            // this closure) allocated by the C API with `new`, so it is
            // aligned for a pointer, and its first word (in bounds: the
            // 1.5.1 handle is one pointer, `operator new(8)`) is the member
            // this check is about.
            let inner = unsafe { *(handle as *const CapiHandle) };
            if !points_into_writable_memory(inner) {
                return Err(mismatch(format!(
                    "the agent handle's first member ({inner:p}) does not point into writable memory"
                )));
            }
            let mut out: *mut c_char = std::ptr::null_mut();
            let mut out_len = 0usize;
            // SAFETY: `members.get_local_md` is `nixlAgent::getLocalMD` in
            // the loaded libnixl, the signature the shim casts it to; `out`
            // and `out_len` are valid out-pointers. `inner` points into
            // writable memory (checked above) and, with the layout the shim
            // expects (as in 1.5.1), is a live probe agent's `nixlAgent`.
            // This call is the check of that layout: with another one the
            // member would run on whatever `inner` points at, which the
            // writable-memory check narrows but cannot rule out.
            let st =
                unsafe { nks_get_local_md(members.get_local_md.0, inner, &mut out, &mut out_len) };
            if st != 0 {
                return Err(mismatch(format!(
                    "nixlAgent::getLocalMD through the handle's first member answered {st}"
                )));
            }
            // SAFETY: the call succeeded (`st == 0`), so the shim set `out`
            // to a non-null malloc'd block of `out_len + 1` bytes (it throws,
            // hence fails, rather than return null); it is copied out, then
            // freed once with `nks_free`, its own `free`.
            let via_cpp = unsafe {
                let v = std::slice::from_raw_parts(out as *const u8, out_len).to_vec();
                nks_free(out.cast());
                v
            };
            if via_capi.is_empty() || via_capi != via_cpp {
                return Err(mismatch(format!(
                    "the agent's metadata differs between the C API ({} bytes) and the C++ member on the handle's first member ({} bytes)",
                    via_capi.len(),
                    via_cpp.len()
                )));
            }
            Ok(())
        })();
        for probe in std::iter::once(agent).chain(other) {
            // SAFETY: each is a probe agent created above (non-null, status
            // 0); nothing else holds it, and it is destroyed once, here,
            // after the closure's last use of it and of `inner`.
            unsafe { (self.capi.destroy_agent)(probe) };
        }
        result
    }

    /// A throwaway agent with a UCX backend (NIXL describes an agent only
    /// once it has one), named for this process and `suffix`; the caller
    /// destroys it once with `destroy_agent`.
    fn probe_agent(
        &self,
        suffix: &str,
        mismatch: &dyn Fn(String) -> LoadError,
    ) -> Result<CapiHandle, LoadError> {
        let name = std::ffi::CString::new(format!(
            "nixl-sys-layout-probe-{}{suffix}",
            std::process::id()
        ))
        .expect("no NUL");
        let cfg = CapiAgentConfig {
            enable_prog_thread: false,
            enable_listen_thread: false,
            listen_port: 0,
            thread_sync: 0,
            num_workers: 1,
            pthr_delay_us: 0,
            lthr_delay_us: 0,
            capture_telemetry: false,
        };
        let mut agent: CapiHandle = std::ptr::null_mut();
        // SAFETY: `name` is a NUL-terminated string and `cfg` a `#[repr(C)]`
        // `nixl_capi_agent_config_t`, both outliving the call (NIXL copies
        // them); `agent` is a valid out-pointer for the new handle.
        let st = unsafe { (self.capi.create_configured_agent)(name.as_ptr(), &cfg, &mut agent) };
        if st != 0 || agent.is_null() {
            return Err(mismatch(format!(
                "the probe agent could not be created (C API status {st})"
            )));
        }
        let backend_made = (|| {
            let ucx = c"UCX";
            let mut mems: CapiHandle = std::ptr::null_mut();
            let mut params: CapiHandle = std::ptr::null_mut();
            let mut backend: CapiHandle = std::ptr::null_mut();
            // SAFETY: `agent` is the live probe agent (destroyed only below,
            // or by the caller); `ucx` is NUL-terminated; `mems`, `params` and
            // `backend` are valid out-pointers. `params` and `mems` are the
            // C API's own allocations, destroyed once each after
            // `create_backend` has read them; the backend handle is only a
            // `new`'d wrapper around the agent-owned `nixlBackendH*`, so
            // destroying it (once, when non-null) leaves the backend to the
            // agent.
            unsafe {
                let st = (self.capi.get_plugin_params)(agent, ucx.as_ptr(), &mut mems, &mut params);
                if st != 0 {
                    return Err(mismatch(format!("the probe's UCX plugin parameters: {st}")));
                }
                let st = (self.capi.create_backend)(agent, ucx.as_ptr(), params, &mut backend);
                (self.capi.destroy_params)(params);
                (self.capi.destroy_mem_list)(mems);
                if !backend.is_null() {
                    (self.capi.destroy_backend)(backend);
                }
                if st != 0 {
                    return Err(mismatch(format!("the probe's UCX backend: {st}")));
                }
            }
            Ok(())
        })();
        if let Err(e) = backend_made {
            // SAFETY: `agent` was created above (non-null, status 0);
            // nothing else holds it, and it is destroyed once, here.
            unsafe { (self.capi.destroy_agent)(agent) };
            return Err(e);
        }
        Ok(agent)
    }
}

/// Whose handle [`Runtime::verify_layout`] reads the C++ member from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LayoutProbe {
    /// The probe agent's own: the check at load.
    Own,
    /// A second probe agent's: a wrong object, for the test.
    #[cfg_attr(not(test), allow(dead_code))]
    Another,
}

/// Whether `p` lies in a mapping of this process that is readable and
/// writable (a heap object), from `/proc/self/maps`.
fn points_into_writable_memory(p: CapiHandle) -> bool {
    let addr = p as usize;
    if addr == 0 {
        return false;
    }
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return false;
    };
    maps.lines().any(|line| {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            return false;
        };
        let Some((lo, hi)) = range.split_once('-') else {
            return false;
        };
        let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
        else {
            return false;
        };
        perms.starts_with("rw") && (lo..hi).contains(&addr)
    })
}

// ---------------------------------------------------------------------------
// Raw calls. Each returns the status in C++ numbering and where it came
// from. Callers guarantee the handles are live and belong to `agent`.
// ---------------------------------------------------------------------------

/// Reads the first member of a C API handle: the C++ object pointer
/// (`nixl_capi_agent_s { nixlAgent* inner; }` and its siblings).
///
/// # Safety
///
/// `h` must be a live (not yet destroyed) C API handle whose first member
/// is a pointer: an agent or xfer dlist handle of a 1.5.x runtime, the
/// layout [`Runtime::verify_layout`] checked when the runtime loaded.
unsafe fn first_member(h: CapiHandle) -> CapiHandle {
    // SAFETY: per the contract, `h` is a live handle that the C API made
    // with `new` (so it is aligned for a pointer) and that starts with a
    // pointer member: reading one pointer-sized word at `h` is in bounds.
    unsafe { *(h as *const CapiHandle) }
}

/// A status from a raw call: C++ numbering, and the interface it came
/// through.
pub type RawStatus = (NixlStatus, StatusSource);

fn collapsed(st: CapiStatus) -> RawStatus {
    (
        NixlStatus::from_capi_collapsed(st),
        StatusSource::CapiCollapsed,
    )
}
fn cpp(st: CapiStatus) -> RawStatus {
    (NixlStatus::from_raw(st), StatusSource::Cpp)
}

impl Runtime {
    /// Status of a C API call, translated according to the runtime.
    pub fn capi_status(&self, st: CapiStatus) -> RawStatus {
        match self.flavor {
            Flavor::Collapsed(_) => collapsed(st),
            Flavor::V1 => (NixlStatus::from_capi_v1(st), StatusSource::CapiV1),
        }
    }

    /// The C API entry points.
    pub fn capi(&self) -> &Capi {
        &self.capi
    }

    /// Frees memory the C API or the shim allocated with malloc.
    ///
    /// # Safety
    ///
    /// `p` must be null or a pointer that NIXL's C API or the shim returned
    /// from `malloc` (metadata blobs, copied names), not freed yet; nothing
    /// may use it after this call.
    pub unsafe fn free(&self, p: *mut c_void) {
        // SAFETY: `nks_free` is `std::free`; the caller guarantees `p` is
        // null or a live malloc'd block freed only here. NIXL and the shim
        // share the process's one C allocator (both link the system libc).
        unsafe { nks_free(p) }
    }

    /// NIXL's `genNotif`: sends `msg` to the remote agent `remote`.
    ///
    /// # Safety
    ///
    /// `agent` must be a live C API agent handle of this runtime (created
    /// by `create_configured_agent`, not destroyed yet).
    pub unsafe fn gen_notif(&self, agent: CapiHandle, remote: &[u8], msg: &[u8]) -> RawStatus {
        match &self.flavor {
            // SAFETY: `agent` is live (caller), so its first member is its
            // `nixlAgent*` (layout checked at load). `m.gen_notif` is the
            // address of `nixlAgent::genNotif` in libnixl, which `self`
            // keeps loaded, and the shim calls it with that member's
            // signature. `remote` and `msg` are valid for their lengths for
            // the call; the shim copies them into `std::string`s first. A
            // null opt-args pointer is NIXL's default (no options). The
            // shim catches every C++ exception.
            Flavor::Collapsed(m) => cpp(unsafe {
                nks_gen_notif(
                    m.gen_notif.0,
                    first_member(agent),
                    remote.as_ptr().cast(),
                    remote.len(),
                    msg.as_ptr().cast(),
                    msg.len(),
                    std::ptr::null(),
                )
            }),
            Flavor::V1 => {
                let Ok(r) = std::ffi::CString::new(remote) else {
                    return (NixlStatus::ERR_INVALID_PARAM, StatusSource::Crate);
                };
                // SAFETY: `agent` is a live C API agent handle (caller); `r`
                // is NUL-terminated and outlives the call; `msg` is valid
                // for `msg.len()` bytes, which NIXL copies; a null opt-args
                // handle is allowed by the C API (no options).
                self.capi_status(unsafe {
                    (self.capi.gen_notif)(
                        agent,
                        r.as_ptr(),
                        msg.as_ptr().cast(),
                        msg.len(),
                        std::ptr::null_mut(),
                    )
                })
            }
        }
    }

    /// NIXL's `invalidateRemoteMD`: forgets `remote`'s metadata and
    /// disconnects from it (run it inside [`EpClose::forcing`] for the
    /// forced close).
    ///
    /// # Safety
    ///
    /// `agent` must be a live C API agent handle of this runtime.
    pub unsafe fn invalidate_remote_md(&self, agent: CapiHandle, remote: &[u8]) -> RawStatus {
        match &self.flavor {
            // SAFETY: `agent` is live (caller), its first member is its
            // `nixlAgent*` (layout checked at load); `m.invalidate_remote_md`
            // is `nixlAgent::invalidateRemoteMD` in the loaded libnixl, the
            // signature the shim casts it to. `remote` is valid for its
            // length; the shim copies it into a `std::string`.
            Flavor::Collapsed(m) => cpp(unsafe {
                nks_invalidate_remote_md(
                    m.invalidate_remote_md.0,
                    first_member(agent),
                    remote.as_ptr().cast(),
                    remote.len(),
                )
            }),
            Flavor::V1 => {
                let Ok(r) = std::ffi::CString::new(remote) else {
                    return (NixlStatus::ERR_INVALID_PARAM, StatusSource::Crate);
                };
                // SAFETY: `agent` is a live C API agent handle (caller); `r`
                // is a NUL-terminated string that outlives the call.
                self.capi_status(unsafe { (self.capi.invalidate_remote_md)(agent, r.as_ptr()) })
            }
        }
    }

    /// On success returns the remote agent's name, every byte of it: with
    /// the shim, the length NIXL's `std::string` has (a NUL inside is
    /// kept, so the caller can refuse it); with the V1 C API, which hands
    /// back only a C string, up to its first NUL.
    ///
    /// # Safety
    ///
    /// `agent` must be a live C API agent handle of this runtime.
    pub unsafe fn load_remote_md(
        &self,
        agent: CapiHandle,
        md: &[u8],
    ) -> (RawStatus, Option<Vec<u8>>) {
        let mut name: *mut c_char = std::ptr::null_mut();
        let mut len = None;
        let raw = match &self.flavor {
            Flavor::Collapsed(m) => {
                let mut n = 0usize;
                // SAFETY: `agent` is live (caller), its first member is its
                // `nixlAgent*` (layout checked at load); `m.load_remote_md`
                // is `nixlAgent::loadRemoteMD` in the loaded libnixl. `md`
                // is valid for its length (copied into a `std::string` by
                // the shim); `name` and `n` are valid out-pointers, which
                // the shim sets to null/0 first and, on success, to a
                // malloc'd copy of the name and its length.
                let raw = cpp(unsafe {
                    nks_load_remote_md(
                        m.load_remote_md.0,
                        first_member(agent),
                        md.as_ptr().cast(),
                        md.len(),
                        &mut name,
                        &mut n,
                    )
                });
                len = Some(n);
                raw
            }
            // SAFETY: `agent` is a live C API agent handle (caller); `md` is
            // valid for `md.len()` bytes, which NIXL copies; `name` is a
            // valid out-pointer that the C API sets to a malloc'd
            // (`strdup`) C string on success and leaves null otherwise.
            Flavor::V1 => self.capi_status(unsafe {
                (self.capi.load_remote_md)(agent, md.as_ptr().cast(), md.len(), &mut name)
            }),
        };
        let out = if name.is_null() {
            None
        } else {
            let bytes = match len {
                // The shim's copy holds `n` bytes plus a terminator.
                // SAFETY: non-null, so the shim's load succeeded and `name`
                // is its malloc'd block of `n + 1` bytes, not freed until
                // below; the bytes are copied out before that.
                Some(n) => unsafe { std::slice::from_raw_parts(name.cast::<u8>(), n) }.to_vec(),
                // SAFETY: non-null, so the C API's load succeeded and `name`
                // is the NUL-terminated string it `strdup`ed, alive until
                // freed below; the bytes are copied out before that.
                None => unsafe { CStr::from_ptr(name) }.to_bytes().to_vec(),
            };
            // SAFETY: `name` is the malloc'd block the shim or the C API
            // handed us (above); nothing refers to it after this.
            unsafe { self.free(name.cast()) };
            Some(bytes)
        };
        (raw, out)
    }

    /// Whether names come back from NIXL with their length (the shim), so
    /// that a NUL inside one can be seen.
    pub fn names_have_length(&self) -> bool {
        matches!(self.flavor, Flavor::Collapsed(_))
    }

    /// Prepares a dlist handle over `xfer_dlist` (a C API xfer dlist).
    /// `remote` is `None` for the local side.
    ///
    /// # Safety
    ///
    /// `agent` must be a live C API agent handle and `xfer_dlist` a live C
    /// API xfer dlist handle, both of this runtime.
    pub unsafe fn prep_dlist(
        &self,
        agent: CapiHandle,
        remote: Option<&[u8]>,
        xfer_dlist: CapiHandle,
    ) -> (RawStatus, CapiHandle) {
        let mut out: CapiHandle = std::ptr::null_mut();
        let raw = match (&self.flavor, remote) {
            // SAFETY: `agent` and `xfer_dlist` are live handles (caller);
            // their first members are the `nixlAgent*` and the
            // `nixl_xfer_dlist_t*` the shim expects (agent layout checked at
            // load; `nixl_capi_xfer_dlist_s { nixl_xfer_dlist_t* dlist; }`).
            // `m.prep_local_dlist` is the matching `nixlAgent::prepXferDlist`
            // overload in the loaded libnixl; `out` is a valid out-pointer;
            // null opt-args is NIXL's default.
            (Flavor::Collapsed(m), None) => cpp(unsafe {
                nks_prep_local_dlist(
                    m.prep_local_dlist.0,
                    first_member(agent),
                    first_member(xfer_dlist),
                    &mut out,
                    std::ptr::null(),
                )
            }),
            // SAFETY: as for the local side; `r` is valid for its length and
            // copied into a `std::string` by the shim; `m.prep_remote_dlist`
            // is the remote-agent overload of `prepXferDlist`.
            (Flavor::Collapsed(m), Some(r)) => cpp(unsafe {
                nks_prep_remote_dlist(
                    m.prep_remote_dlist.0,
                    first_member(agent),
                    r.as_ptr().cast(),
                    r.len(),
                    first_member(xfer_dlist),
                    &mut out,
                    std::ptr::null(),
                )
            }),
            (Flavor::V1, r) => {
                // The local side is named by NIXL's NIXL_INIT_AGENT (""),
                // as in the C API's own bindings.
                let Ok(name) = std::ffi::CString::new(r.unwrap_or(b"")) else {
                    return ((NixlStatus::ERR_INVALID_PARAM, StatusSource::Crate), out);
                };
                // SAFETY: `agent` and `xfer_dlist` are live C API handles
                // (caller); `name` is NUL-terminated and outlives the call;
                // `out` is a valid out-pointer; a null opt-args handle is
                // allowed (no options).
                self.capi_status(unsafe {
                    (self.capi.prep_xfer_dlist)(
                        agent,
                        name.as_ptr(),
                        xfer_dlist,
                        &mut out,
                        std::ptr::null_mut(),
                    )
                })
            }
        };
        (raw, out)
    }

    /// NIXL's `releasedDlistH`: releases a prepared dlist handle.
    ///
    /// # Safety
    ///
    /// `agent` must be a live C API agent handle, and `dlist` a handle that
    /// [`Self::prep_dlist`] returned for it and that was not released yet;
    /// `dlist` must not be used after this call.
    pub unsafe fn release_dlist(&self, agent: CapiHandle, dlist: CapiHandle) -> RawStatus {
        match &self.flavor {
            // SAFETY: `agent` is live (caller), its first member is its
            // `nixlAgent*` (layout checked at load); `dlist` is the
            // `nixlDlistH*` the shim's `prepXferDlist` returned for this
            // agent, not yet released (caller); `m.released_dlist_h` is
            // `nixlAgent::releasedDlistH` in the loaded libnixl.
            Flavor::Collapsed(m) => cpp(unsafe {
                nks_release_dlist_handle(m.released_dlist_h.0, first_member(agent), dlist)
            }),
            Flavor::V1 => {
                // SAFETY: `agent` is a live C API agent handle and `dlist` the
                // C API dlist handle `prep_xfer_dlist` returned for it, not yet
                // released (caller).
                self.capi_status(unsafe { (self.capi.release_xfer_dlist_handle)(agent, dlist) })
            }
        }
    }

    /// NIXL's `makeXferReq`: a transfer request (`op` 0 is `NIXL_READ`)
    /// between descriptors of two prepared dlist handles.
    ///
    /// # Safety
    ///
    /// `agent` must be a live C API agent handle; `local` and `remote`
    /// handles that [`Self::prep_dlist`] returned for it and that stay
    /// unreleased while the request exists; `opt_args` null or a live C API
    /// opt-args handle that outlives the request.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn make_xfer_req(
        &self,
        agent: CapiHandle,
        op: c_int,
        local: CapiHandle,
        local_idx: &[c_int],
        remote: CapiHandle,
        remote_idx: &[c_int],
        opt_args: CapiHandle,
    ) -> (RawStatus, CapiHandle) {
        let mut out: CapiHandle = std::ptr::null_mut();
        let raw = match &self.flavor {
            // nixl_capi_opt_args_s holds the nixlAgentOptionalArgs by value
            // as its first member, so the handle address is the object's.
            // SAFETY: `agent` is live (caller), its first member is its
            // `nixlAgent*` (layout checked at load); `local` and `remote`
            // are live `nixlDlistH*`s the shim prepared for this agent, and
            // `opt_args` null or a live opt-args handle, i.e. a
            // `nixlAgentOptionalArgs*` (caller). The index slices are valid
            // for their lengths (the shim copies them into vectors); `out`
            // is a valid out-pointer; `m.make_xfer_req` is
            // `nixlAgent::makeXferReq` in the loaded libnixl.
            Flavor::Collapsed(m) => cpp(unsafe {
                nks_make_xfer_req(
                    m.make_xfer_req.0,
                    first_member(agent),
                    op,
                    local,
                    local_idx.as_ptr(),
                    local_idx.len(),
                    remote,
                    remote_idx.as_ptr(),
                    remote_idx.len(),
                    &mut out,
                    opt_args,
                )
            }),
            // SAFETY: `agent`, `local`, `remote` and (when not null)
            // `opt_args` are live C API handles of this agent (caller); the
            // index slices are valid for their lengths during the call;
            // `out` is a valid out-pointer.
            Flavor::V1 => self.capi_status(unsafe {
                (self.capi.make_xfer_req)(
                    agent,
                    op,
                    local,
                    local_idx.as_ptr(),
                    local_idx.len(),
                    remote,
                    remote_idx.as_ptr(),
                    remote_idx.len(),
                    &mut out,
                    opt_args,
                )
            }),
        };
        (raw, out)
    }

    /// NIXL's `postXferReq`: posts a transfer request.
    ///
    /// # Safety
    ///
    /// `agent` must be a live C API agent handle, and `req` a request that
    /// [`Self::make_xfer_req`] returned for it and that was not released.
    pub unsafe fn post_xfer_req(&self, agent: CapiHandle, req: CapiHandle) -> RawStatus {
        match &self.flavor {
            // SAFETY: `agent` is live (caller), its first member is its
            // `nixlAgent*` (layout checked at load); `req` is a live
            // `nixlXferReqH*` of this agent (caller); null opt-args is
            // NIXL's default; `m.post_xfer_req` is `nixlAgent::postXferReq`
            // in the loaded libnixl.
            Flavor::Collapsed(m) => cpp(unsafe {
                nks_post_xfer_req(
                    m.post_xfer_req.0,
                    first_member(agent),
                    req,
                    std::ptr::null(),
                )
            }),
            // SAFETY: `agent` and `req` are live C API handles, `req` made by
            // `agent` (caller); a null opt-args handle is allowed.
            Flavor::V1 => self.capi_status(unsafe {
                (self.capi.post_xfer_req)(agent, req, std::ptr::null_mut())
            }),
        }
    }

    /// NIXL's `getXferStatus`: checks a transfer (and progresses the
    /// worker).
    ///
    /// # Safety
    ///
    /// As [`Self::post_xfer_req`].
    pub unsafe fn get_xfer_status(&self, agent: CapiHandle, req: CapiHandle) -> RawStatus {
        match &self.flavor {
            Flavor::Collapsed(m) => {
                // SAFETY: `agent` is live (caller), its first member is its
                // `nixlAgent*` (layout checked at load); `req` is a live
                // `nixlXferReqH*` of this agent (caller); `m.get_xfer_status`
                // is `nixlAgent::getXferStatus` in the loaded libnixl.
                cpp(unsafe { nks_get_xfer_status(m.get_xfer_status.0, first_member(agent), req) })
            }
            // SAFETY: `agent` and `req` are live C API handles, `req` made by
            // `agent` (caller).
            Flavor::V1 => self.capi_status(unsafe { (self.capi.get_xfer_status)(agent, req) }),
        }
    }

    /// NIXL's `releaseXferReq`: releases a request (aborting it in
    /// flight where the backend can).
    ///
    /// # Safety
    ///
    /// As [`Self::post_xfer_req`]; `req` must not be used after this call
    /// (released once: NIXL frees it on success).
    pub unsafe fn release_xfer_req(&self, agent: CapiHandle, req: CapiHandle) -> RawStatus {
        match &self.flavor {
            Flavor::Collapsed(m) => {
                // SAFETY: `agent` is live (caller), its first member is its
                // `nixlAgent*` (layout checked at load); `req` is a live,
                // unreleased `nixlXferReqH*` of this agent, not used again
                // (caller); `m.release_xfer_req` is `nixlAgent::releaseXferReq`
                // in the loaded libnixl.
                cpp(unsafe { nks_release_xfer_req(m.release_xfer_req.0, first_member(agent), req) })
            }
            Flavor::V1 => {
                // SAFETY: `agent` and `req` are live C API handles, `req`
                // made by `agent` and not released yet (caller).
                let raw = self.capi_status(unsafe { (self.capi.release_xfer_req)(agent, req) });
                if raw.0 == NixlStatus::SUCCESS {
                    // SAFETY: the request was released, leaving only the C
                    // API's wrapper handle `req`, destroyed once here; the
                    // caller does not use `req` again.
                    unsafe { (self.capi.destroy_xfer_req)(req) };
                }
                raw
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layout check can fail: reading the handle's second word instead
    /// of its first is refused, with the reason; the real layout passes.
    #[test]
    #[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
    fn the_layout_check_refuses_the_member_of_another_agent() {
        let rt = crate::testing::real_runtime();
        if rt.api_kind() != ApiKind::CollapsedCapiWithShim {
            return;
        }
        assert!(rt.verify_layout(LayoutProbe::Own).is_ok());
        match rt.verify_layout(LayoutProbe::Another) {
            Err(LoadError::LayoutMismatch { why, .. }) => {
                assert!(!why.is_empty());
            }
            other => panic!("a wrong layout must be refused: {other:?}"),
        }
    }
}

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
use crate::error::{LoadError, StatusSource};
use crate::status::NixlStatus;

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

type St = c_int;
type P = *mut c_void;

/// `nixl_capi_agent_config_t`, declared from its documented fields (field
/// order and types matter: 40 bytes, checked against the 1.5.1 library's
/// reads at offsets 0, 1, 4, 8, 16, 24, 32).
#[repr(C)]
pub(crate) struct CapiAgentConfig {
    pub enable_prog_thread: bool,
    pub enable_listen_thread: bool,
    pub listen_port: c_int,
    pub thread_sync: c_int,
    pub num_workers: u32,
    pub pthr_delay_us: u64,
    pub lthr_delay_us: u64,
    pub capture_telemetry: bool,
}

/// C API entry points (the subset this crate uses).
pub(crate) struct Capi {
    pub create_configured_agent:
        unsafe extern "C" fn(*const c_char, *const CapiAgentConfig, *mut P) -> St,
    pub destroy_agent: unsafe extern "C" fn(P) -> St,
    pub get_plugin_params: unsafe extern "C" fn(P, *const c_char, *mut P, *mut P) -> St,
    pub destroy_mem_list: unsafe extern "C" fn(P) -> St,
    pub destroy_params: unsafe extern "C" fn(P) -> St,
    pub create_backend: unsafe extern "C" fn(P, *const c_char, P, *mut P) -> St,
    pub destroy_backend: unsafe extern "C" fn(P) -> St,
    pub get_local_md: unsafe extern "C" fn(P, *mut P, *mut usize) -> St,
    pub load_remote_md: unsafe extern "C" fn(P, *const c_void, usize, *mut *mut c_char) -> St,
    pub invalidate_remote_md: unsafe extern "C" fn(P, *const c_char) -> St,
    pub create_reg_dlist: unsafe extern "C" fn(c_int, *mut P) -> St,
    pub destroy_reg_dlist: unsafe extern "C" fn(P) -> St,
    pub reg_dlist_add_desc: unsafe extern "C" fn(P, usize, usize, u64, *const c_void, usize) -> St,
    pub register_mem: unsafe extern "C" fn(P, P, P) -> St,
    pub deregister_mem: unsafe extern "C" fn(P, P, P) -> St,
    pub create_xfer_dlist: unsafe extern "C" fn(c_int, *mut P) -> St,
    pub destroy_xfer_dlist: unsafe extern "C" fn(P) -> St,
    pub xfer_dlist_add_desc: unsafe extern "C" fn(P, usize, usize, u64) -> St,
    pub prep_xfer_dlist: unsafe extern "C" fn(P, *const c_char, P, *mut P, P) -> St,
    pub release_xfer_dlist_handle: unsafe extern "C" fn(P, P) -> St,
    #[allow(clippy::type_complexity)]
    pub make_xfer_req: unsafe extern "C" fn(
        P,
        c_int,
        P,
        *const c_int,
        usize,
        P,
        *const c_int,
        usize,
        *mut P,
        P,
    ) -> St,
    pub post_xfer_req: unsafe extern "C" fn(P, P, P) -> St,
    pub get_xfer_status: unsafe extern "C" fn(P, P) -> St,
    pub release_xfer_req: unsafe extern "C" fn(P, P) -> St,
    pub destroy_xfer_req: unsafe extern "C" fn(P) -> St,
    pub create_opt_args: unsafe extern "C" fn(*mut P) -> St,
    pub destroy_opt_args: unsafe extern "C" fn(P) -> St,
    pub opt_args_set_notif_msg: unsafe extern "C" fn(P, *const c_void, usize) -> St,
    pub opt_args_set_has_notif: unsafe extern "C" fn(P, bool) -> St,
    pub gen_notif: unsafe extern "C" fn(P, *const c_char, *const c_void, usize, P) -> St,
    pub create_notif_map: unsafe extern "C" fn(*mut P) -> St,
    pub destroy_notif_map: unsafe extern "C" fn(P) -> St,
    pub get_notifs: unsafe extern "C" fn(P, P, P) -> St,
    pub notif_map_size: unsafe extern "C" fn(P, *mut usize) -> St,
    pub notif_map_get_agent_at: unsafe extern "C" fn(P, usize, *mut *const c_char) -> St,
    pub notif_map_get_notifs_size: unsafe extern "C" fn(P, *const c_char, *mut usize) -> St,
    pub notif_map_get_notif:
        unsafe extern "C" fn(P, *const c_char, usize, *mut *const c_void, *mut usize) -> St,
}

/// An address inside libnixl.so (a C++ member function). Plain code
/// addresses, valid for the life of the process because the library is
/// never unloaded.
#[derive(Clone, Copy)]
pub(crate) struct Member(*const c_void);
// Safety: a code address; sharing it between threads shares nothing mutable.
unsafe impl Send for Member {}
// Safety: as above.
unsafe impl Sync for Member {}

/// The C++ members reached through the shim on a collapsed-C-API runtime.
/// The mangled names are those exported by libnixl.so 1.5.1 (`nm -D`).
pub(crate) struct CppMembers {
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
    ) -> St;
    fn nks_post_xfer_req(f: *const c_void, agent: *const c_void, req: P, opt: *const c_void) -> St;
    fn nks_get_xfer_status(f: *const c_void, agent: *const c_void, req: P) -> St;
    fn nks_release_xfer_req(f: *const c_void, agent: *const c_void, req: P) -> St;
    fn nks_invalidate_remote_md(
        f: *const c_void,
        agent: P,
        remote: *const c_char,
        remote_len: usize,
    ) -> St;
    fn nks_release_dlist_handle(f: *const c_void, agent: *const c_void, dlist: P) -> St;
    fn nks_load_remote_md(
        f: *const c_void,
        agent: P,
        md: *const c_void,
        md_len: usize,
        name_out: *mut *mut c_char,
        name_len: *mut usize,
    ) -> St;
    fn nks_prep_local_dlist(
        f: *const c_void,
        agent: *const c_void,
        descs: *const c_void,
        out: *mut P,
        opt: *const c_void,
    ) -> St;
    fn nks_prep_remote_dlist(
        f: *const c_void,
        agent: *const c_void,
        remote: *const c_char,
        remote_len: usize,
        descs: *const c_void,
        out: *mut P,
        opt: *const c_void,
    ) -> St;
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
        out: *mut P,
        opt: *const c_void,
    ) -> St;
    fn nks_get_local_md(
        f: *const c_void,
        agent: *const c_void,
        out: *mut *mut c_char,
        len: *mut usize,
    ) -> St;
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

    pub(crate) fn ep_close(&self) -> &EpClose {
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
            // Safety: loading NIXL runs its (and UCX's) initialisers; those are
            // the libraries this crate exists to use, loaded by absolute path.
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
                // Safety: the symbol's type is declared in `Capi` from the C
                // API's documented signature.
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

        // Safety: only probing for presence; the symbol is never called here.
        let has_v1 = unsafe { libcapi.get::<*const c_void>(b"nixl_capi_get_version\0") }.is_ok();
        let flavor = if has_v1 {
            Flavor::V1
        } else {
            let member = |name: &str| -> Result<Member, LoadError> {
                let cname = format!("{name}\0");
                // Safety: only the address is taken; it is called through the
                // shim with the signature documented next to each name.
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
        runtime.verify_layout_at(0)?;
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
    /// `word` is which pointer-sized word of the handle is taken for the
    /// object: 0, the layout the shim relies on (another value exists only
    /// to prove, in a test, that a wrong layout is refused).
    fn verify_layout_at(&self, word: usize) -> Result<(), LoadError> {
        let Flavor::Collapsed(members) = &self.flavor else {
            return Ok(());
        };
        let mismatch = |why: String| LoadError::LayoutMismatch {
            path: self.lib_dir.join("libnixl_capi.so"),
            why,
        };
        let name = std::ffi::CString::new(format!("nixl-sys-layout-probe-{}", std::process::id()))
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
        let mut agent: P = std::ptr::null_mut();
        // Safety: valid NUL-terminated name, config and out-pointer.
        let st = unsafe { (self.capi.create_configured_agent)(name.as_ptr(), &cfg, &mut agent) };
        if st != 0 || agent.is_null() {
            return Err(mismatch(format!(
                "the probe agent could not be created (C API status {st})"
            )));
        }
        let result = (|| {
            // NIXL describes an agent only once it has a backend: the UCX
            // one, as every agent of this crate has.
            let ucx = c"UCX";
            let mut mems: P = std::ptr::null_mut();
            let mut params: P = std::ptr::null_mut();
            let mut backend: P = std::ptr::null_mut();
            // Safety: live agent; out-pointers valid; params and mem list
            // destroyed once the backend exists; the C API backend handle
            // is a wrapper, destroying it leaves the backend to the agent.
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
            let mut data: P = std::ptr::null_mut();
            let mut len = 0usize;
            // Safety: live agent; NIXL mallocs `len` bytes at `data`.
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
            // Safety: reading a pointer-sized word of the handle; the handle
            // is a live allocation of at least two words (the 1.5.x agent
            // handle holds its nixlAgent pointer and more).
            let inner = unsafe { *(agent as *const P).add(word) };
            if !points_into_writable_memory(inner) {
                return Err(mismatch(format!(
                    "the agent handle's first member ({inner:p}) does not point into writable memory"
                )));
            }
            let mut out: *mut c_char = std::ptr::null_mut();
            let mut out_len = 0usize;
            // Safety: `inner` points into the heap; if the layout is the
            // one the shim expects it is the agent's nixlAgent.
            let st =
                unsafe { nks_get_local_md(members.get_local_md.0, inner, &mut out, &mut out_len) };
            if st != 0 {
                return Err(mismatch(format!(
                    "nixlAgent::getLocalMD through the handle's first member answered {st}"
                )));
            }
            // Safety: the shim malloc'd `out_len` bytes at `out`.
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
        // Safety: the probe agent is ours; nothing else holds it.
        unsafe { (self.capi.destroy_agent)(agent) };
        result
    }
}

/// Whether `p` lies in a mapping of this process that is readable and
/// writable (a heap object), from `/proc/self/maps`.
fn points_into_writable_memory(p: P) -> bool {
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

/// Candidate library folders under a runtime location, in search order.
fn lib_dir_candidates(location: &Path) -> Vec<PathBuf> {
    vec![
        location.join(".nixl_cu12.mesonpy.libs"),
        location.join("lib"),
        location.join("lib64"),
        location.join("lib/x86_64-linux-gnu"),
        location.to_path_buf(),
    ]
}

fn find_lib_dir(location: &Path) -> Result<PathBuf, Vec<PathBuf>> {
    let mut tried = Vec::new();
    for dir in lib_dir_candidates(location) {
        let nixl = dir.join("libnixl.so");
        let capi = dir.join("libnixl_capi.so");
        if nixl.is_file() && capi.is_file() {
            return Ok(dir);
        }
        tried.push(nixl);
    }
    Err(tried)
}

// ---------------------------------------------------------------------------
// Raw calls. Each returns the status in C++ numbering and where it came
// from. Callers guarantee the handles are live and belong to `agent`.
// ---------------------------------------------------------------------------

/// Reads the first member of a C API handle: the C++ object pointer
/// (`nixl_capi_agent_s { nixlAgent* inner; }` and its siblings).
///
/// Safety: `h` must be a live C API handle whose first member is a pointer.
unsafe fn first_member(h: P) -> P {
    *(h as *const P)
}

pub(crate) type Raw = (NixlStatus, StatusSource);

fn collapsed(st: St) -> Raw {
    (
        NixlStatus::from_capi_collapsed(st),
        StatusSource::CapiCollapsed,
    )
}
fn cpp(st: St) -> Raw {
    (NixlStatus::from_raw(st), StatusSource::Cpp)
}

impl Runtime {
    /// Status of a C API call, translated according to the runtime.
    pub(crate) fn capi_status(&self, st: St) -> Raw {
        match self.flavor {
            Flavor::Collapsed(_) => collapsed(st),
            Flavor::V1 => (NixlStatus::from_capi_v1(st), StatusSource::CapiV1),
        }
    }

    pub(crate) fn capi(&self) -> &Capi {
        &self.capi
    }

    /// Frees memory the C API or the shim allocated with malloc.
    ///
    /// Safety: `p` is null or came from malloc in NIXL or the shim.
    pub(crate) unsafe fn free(&self, p: *mut c_void) {
        nks_free(p)
    }

    /// Safety: `agent` is a live C API agent handle.
    pub(crate) unsafe fn gen_notif(&self, agent: P, remote: &[u8], msg: &[u8]) -> Raw {
        match &self.flavor {
            Flavor::Collapsed(m) => cpp(nks_gen_notif(
                m.gen_notif.0,
                first_member(agent),
                remote.as_ptr().cast(),
                remote.len(),
                msg.as_ptr().cast(),
                msg.len(),
                std::ptr::null(),
            )),
            Flavor::V1 => {
                let Ok(r) = std::ffi::CString::new(remote) else {
                    return (NixlStatus::ERR_INVALID_PARAM, StatusSource::Crate);
                };
                self.capi_status((self.capi.gen_notif)(
                    agent,
                    r.as_ptr(),
                    msg.as_ptr().cast(),
                    msg.len(),
                    std::ptr::null_mut(),
                ))
            }
        }
    }

    /// Safety: `agent` is a live C API agent handle.
    pub(crate) unsafe fn invalidate_remote_md(&self, agent: P, remote: &[u8]) -> Raw {
        match &self.flavor {
            Flavor::Collapsed(m) => cpp(nks_invalidate_remote_md(
                m.invalidate_remote_md.0,
                first_member(agent),
                remote.as_ptr().cast(),
                remote.len(),
            )),
            Flavor::V1 => {
                let Ok(r) = std::ffi::CString::new(remote) else {
                    return (NixlStatus::ERR_INVALID_PARAM, StatusSource::Crate);
                };
                self.capi_status((self.capi.invalidate_remote_md)(agent, r.as_ptr()))
            }
        }
    }

    /// On success returns the remote agent's name, every byte of it: with
    /// the shim, the length NIXL's `std::string` has (a NUL inside is
    /// kept, so the caller can refuse it); with the V1 C API, which hands
    /// back only a C string, up to its first NUL.
    ///
    /// Safety: `agent` is a live C API agent handle.
    pub(crate) unsafe fn load_remote_md(&self, agent: P, md: &[u8]) -> (Raw, Option<Vec<u8>>) {
        let mut name: *mut c_char = std::ptr::null_mut();
        let mut len = None;
        let raw = match &self.flavor {
            Flavor::Collapsed(m) => {
                let mut n = 0usize;
                let raw = cpp(nks_load_remote_md(
                    m.load_remote_md.0,
                    first_member(agent),
                    md.as_ptr().cast(),
                    md.len(),
                    &mut name,
                    &mut n,
                ));
                len = Some(n);
                raw
            }
            Flavor::V1 => self.capi_status((self.capi.load_remote_md)(
                agent,
                md.as_ptr().cast(),
                md.len(),
                &mut name,
            )),
        };
        let out = if name.is_null() {
            None
        } else {
            let bytes = match len {
                // The shim's copy holds `n` bytes plus a terminator.
                Some(n) => std::slice::from_raw_parts(name.cast::<u8>(), n).to_vec(),
                None => CStr::from_ptr(name).to_bytes().to_vec(),
            };
            self.free(name.cast());
            Some(bytes)
        };
        (raw, out)
    }

    /// Whether names come back from NIXL with their length (the shim), so
    /// that a NUL inside one can be seen.
    pub(crate) fn names_have_length(&self) -> bool {
        matches!(self.flavor, Flavor::Collapsed(_))
    }

    /// Prepares a dlist handle over `xfer_dlist` (a C API xfer dlist).
    /// `remote` is `None` for the local side.
    ///
    /// Safety: `agent` and `xfer_dlist` are live C API handles.
    pub(crate) unsafe fn prep_dlist(
        &self,
        agent: P,
        remote: Option<&[u8]>,
        xfer_dlist: P,
    ) -> (Raw, P) {
        let mut out: P = std::ptr::null_mut();
        let raw = match (&self.flavor, remote) {
            (Flavor::Collapsed(m), None) => cpp(nks_prep_local_dlist(
                m.prep_local_dlist.0,
                first_member(agent),
                first_member(xfer_dlist),
                &mut out,
                std::ptr::null(),
            )),
            (Flavor::Collapsed(m), Some(r)) => cpp(nks_prep_remote_dlist(
                m.prep_remote_dlist.0,
                first_member(agent),
                r.as_ptr().cast(),
                r.len(),
                first_member(xfer_dlist),
                &mut out,
                std::ptr::null(),
            )),
            (Flavor::V1, r) => {
                // The local side is named by NIXL's NIXL_INIT_AGENT (""),
                // as in the C API's own bindings.
                let Ok(name) = std::ffi::CString::new(r.unwrap_or(b"")) else {
                    return ((NixlStatus::ERR_INVALID_PARAM, StatusSource::Crate), out);
                };
                self.capi_status((self.capi.prep_xfer_dlist)(
                    agent,
                    name.as_ptr(),
                    xfer_dlist,
                    &mut out,
                    std::ptr::null_mut(),
                ))
            }
        };
        (raw, out)
    }

    /// Safety: `agent` is live and `dlist` came from [`Self::prep_dlist`]
    /// on it and was not released.
    pub(crate) unsafe fn release_dlist(&self, agent: P, dlist: P) -> Raw {
        match &self.flavor {
            Flavor::Collapsed(m) => cpp(nks_release_dlist_handle(
                m.released_dlist_h.0,
                first_member(agent),
                dlist,
            )),
            Flavor::V1 => self.capi_status((self.capi.release_xfer_dlist_handle)(agent, dlist)),
        }
    }

    /// Safety: `agent` live; `local`/`remote` from [`Self::prep_dlist`];
    /// `opt_args` null or a live C API opt-args handle.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn make_xfer_req(
        &self,
        agent: P,
        op: c_int,
        local: P,
        local_idx: &[c_int],
        remote: P,
        remote_idx: &[c_int],
        opt_args: P,
    ) -> (Raw, P) {
        let mut out: P = std::ptr::null_mut();
        let raw = match &self.flavor {
            // nixl_capi_opt_args_s holds the nixlAgentOptionalArgs by value
            // as its first member, so the handle address is the object's.
            Flavor::Collapsed(m) => cpp(nks_make_xfer_req(
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
            )),
            Flavor::V1 => self.capi_status((self.capi.make_xfer_req)(
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
            )),
        };
        (raw, out)
    }

    /// Safety: `agent` live; `req` from [`Self::make_xfer_req`], not released.
    pub(crate) unsafe fn post_xfer_req(&self, agent: P, req: P) -> Raw {
        match &self.flavor {
            Flavor::Collapsed(m) => cpp(nks_post_xfer_req(
                m.post_xfer_req.0,
                first_member(agent),
                req,
                std::ptr::null(),
            )),
            Flavor::V1 => {
                self.capi_status((self.capi.post_xfer_req)(agent, req, std::ptr::null_mut()))
            }
        }
    }

    /// Safety: as [`Self::post_xfer_req`].
    pub(crate) unsafe fn get_xfer_status(&self, agent: P, req: P) -> Raw {
        match &self.flavor {
            Flavor::Collapsed(m) => cpp(nks_get_xfer_status(
                m.get_xfer_status.0,
                first_member(agent),
                req,
            )),
            Flavor::V1 => self.capi_status((self.capi.get_xfer_status)(agent, req)),
        }
    }

    /// Safety: as [`Self::post_xfer_req`]; `req` must not be used after a
    /// successful release.
    pub(crate) unsafe fn release_xfer_req(&self, agent: P, req: P) -> Raw {
        match &self.flavor {
            Flavor::Collapsed(m) => cpp(nks_release_xfer_req(
                m.release_xfer_req.0,
                first_member(agent),
                req,
            )),
            Flavor::V1 => {
                let raw = self.capi_status((self.capi.release_xfer_req)(agent, req));
                if raw.0 == NixlStatus::SUCCESS {
                    (self.capi.destroy_xfer_req)(req);
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
    fn the_layout_check_refuses_a_handle_read_at_the_wrong_word() {
        let Some(rt) = crate::testing::runtime_or_skip() else {
            return;
        };
        if rt.api_kind() != ApiKind::CollapsedCapiWithShim {
            return;
        }
        assert!(rt.verify_layout_at(0).is_ok());
        match rt.verify_layout_at(1) {
            Err(LoadError::LayoutMismatch { why, .. }) => {
                assert!(!why.is_empty());
            }
            other => panic!("a wrong layout must be refused: {other:?}"),
        }
    }
}

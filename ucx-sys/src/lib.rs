//! Bindings to UCX: the status table, and (when a UCX library can be
//! loaded at run time) its version, status strings and configuration.
//!
//! # Which UCX
//!
//! UCX is loaded at run time with `dlopen`, never linked, so this crate
//! builds without UCX and a process never holds two UCX versions. The
//! first of these that exists wins ([`Ucx::get`]):
//!
//! 1. `$NIXL_KEEPALIVE_UCX_LIB`: an explicit path to a `libucp` file.
//! 2. A `libucp` already mapped into this process (the NIXL runtime, once
//!    loaded, brings its own UCX: we use that one).
//! 3. The UCX bundled with the NIXL runtime: `libucp-<hash>.so.0.0.0` in
//!    `$NIXL_PREFIX/nixl_cu12.libs`, then in `.nixl-runtime/nixl_cu12.libs`
//!    at the root of this workspace (`scripts/install-nixl.sh`).
//! 4. The system's UCX (`libucp.so.0`; Debian: `scripts/install-ucx.sh`).
//!
//! Otherwise [`Ucx::get`] returns a [`LoadError`] whose `Display` says that
//! only the constants ([`UcsStatus`]) are available, and what to install.
//!
//! # What is bound
//!
//! Only functions of UCX's public API, declared here by hand from their
//! documented signatures: `ucs_status_string`, `ucp_get_version_string`,
//! `ucp_config_read` / `_modify` / `_print` / `_release`, and for UCT
//! `uct_query_components`, `uct_component_query`,
//! `uct_release_component_list`, `uct_md_config_read`, `uct_config_modify`,
//! `uct_config_get`, `uct_config_release`. One exception, optional and
//! gated by version: [`Ucx::time_field_parser`] (see there).

#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};

/// The status table lives in `nixl-status` (no dependency, no build), so
/// the keepalive's sans-IO core names it without this binding.
pub use nixl_status::UcsStatus;

/// `ucs_config_print_flags_t`: print the values.
pub const UCS_CONFIG_PRINT_CONFIG: c_int = 1;
/// `ucs_config_print_flags_t`: print a header.
pub const UCS_CONFIG_PRINT_HEADER: c_int = 1 << 1;
/// `ucs_config_print_flags_t`: print each field's documentation.
pub const UCS_CONFIG_PRINT_DOC: c_int = 1 << 2;
/// `ucs_config_print_flags_t`: include hidden fields.
pub const UCS_CONFIG_PRINT_HIDDEN: c_int = 1 << 3;

/// Where the loaded UCX came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UcxSource {
    /// `$NIXL_KEEPALIVE_UCX_LIB`.
    Explicit,
    /// Already mapped into this process when we looked.
    InProcess,
    /// Bundled with the NIXL runtime (`nixl_cu12.libs`).
    NixlRuntime,
    /// The system's shared library search path.
    System,
}

impl fmt::Display for UcxSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            UcxSource::Explicit => "NIXL_KEEPALIVE_UCX_LIB",
            UcxSource::InProcess => "already loaded in this process",
            UcxSource::NixlRuntime => "bundled with the NIXL runtime",
            UcxSource::System => "system",
        })
    }
}

/// No UCX could be loaded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "no UCX library could be loaded; UCX status constants only (tried: {}). \
     Install the NIXL runtime (scripts/install-nixl.sh) or the system UCX \
     (scripts/install-ucx.sh: libucx0 libucx-dev ucx-utils), or set \
     NIXL_KEEPALIVE_UCX_LIB to a libucp file",
    tried.join("; ")
)]
pub struct LoadError {
    /// Every candidate tried, with why it failed.
    pub tried: Vec<String>,
}

type StatusStringFn = unsafe extern "C" fn(i8) -> *const c_char;
type VersionStringFn = unsafe extern "C" fn() -> *const c_char;
type UcpConfigReadFn = unsafe extern "C" fn(*const c_char, *const c_char, *mut *mut c_void) -> i8;
type UcpConfigModifyFn = unsafe extern "C" fn(*mut c_void, *const c_char, *const c_char) -> i8;
type UcpConfigPrintFn = unsafe extern "C" fn(*const c_void, *mut libc::FILE, *const c_char, c_int);
type ConfigReleaseFn = unsafe extern "C" fn(*mut c_void);
type UctQueryComponentsFn = unsafe extern "C" fn(*mut *mut *mut c_void, *mut c_uint) -> i8;
type UctComponentQueryFn = unsafe extern "C" fn(*mut c_void, *mut UctComponentAttr) -> i8;
type UctReleaseComponentListFn = unsafe extern "C" fn(*mut *mut c_void);
type UctMdConfigReadFn =
    unsafe extern "C" fn(*mut c_void, *const c_char, *const c_char, *mut *mut c_void) -> i8;
type UctConfigGetFn = unsafe extern "C" fn(*mut c_void, *const c_char, *mut c_char, usize) -> i8;
type SscanfTimeFn = unsafe extern "C" fn(*const c_char, *mut c_void, *const c_void) -> c_int;
type SprintfTimeFn =
    unsafe extern "C" fn(*mut c_char, usize, *const c_void, *const c_void) -> c_int;

/// `UCT_COMPONENT_NAME_MAX`.
const UCT_COMPONENT_NAME_MAX: usize = 16;
/// `UCT_COMPONENT_ATTR_FIELD_NAME`.
const UCT_COMPONENT_ATTR_FIELD_NAME: u64 = 1;

/// `uct_component_attr_t` (field mask, name, resource count, resources,
/// flags), with room to spare for fields a newer UCX may append.
#[repr(C)]
struct UctComponentAttr {
    field_mask: u64,
    name: [c_char; UCT_COMPONENT_NAME_MAX],
    md_resource_count: c_uint,
    md_resources: *mut c_void,
    flags: u64,
    spare: [u64; 16],
}

struct Uct {
    query_components: UctQueryComponentsFn,
    component_query: UctComponentQueryFn,
    release_component_list: UctReleaseComponentListFn,
    md_config_read: UctMdConfigReadFn,
    config_modify: UcpConfigModifyFn,
    config_get: UctConfigGetFn,
    config_release: ConfigReleaseFn,
}

/// A loaded UCX.
pub struct Ucx {
    _lib: Library,
    source: UcxSource,
    path: PathBuf,
    version: String,
    status_string: StatusStringFn,
    config_read: UcpConfigReadFn,
    config_modify: UcpConfigModifyFn,
    config_print: UcpConfigPrintFn,
    config_release: ConfigReleaseFn,
    uct: Option<Uct>,
    time_parser: Option<(SscanfTimeFn, SprintfTimeFn)>,
}

impl fmt::Debug for Ucx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ucx")
            .field("version", &self.version)
            .field("source", &self.source)
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

static UCX: OnceLock<Result<Ucx, LoadError>> = OnceLock::new();

impl Ucx {
    /// The process's UCX, loaded on first use (see the crate docs for the
    /// order). Later calls return the same result.
    pub fn get() -> Result<&'static Ucx, &'static LoadError> {
        UCX.get_or_init(load).as_ref()
    }

    /// One line for a start-up log: `UCX 1.23.0 (bundled with the NIXL
    /// runtime, /path/libucp-….so.0.0.0)` or the [`LoadError`].
    pub fn describe() -> String {
        match Ucx::get() {
            Ok(u) => format!("UCX {} ({}, {})", u.version, u.source, u.path.display()),
            Err(e) => e.to_string(),
        }
    }

    /// `ucp_get_version_string()`, e.g. `1.23.0`.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// `(major, minor)` from [`version`](Self::version).
    pub fn version_numbers(&self) -> Option<(u32, u32)> {
        let mut it = self.version.split('.');
        Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
    }

    /// Where this UCX came from.
    pub fn source(&self) -> &UcxSource {
        &self.source
    }

    /// The `libucp` file loaded.
    pub fn library_path(&self) -> &Path {
        &self.path
    }

    /// `ucs_status_string(status)`: UCX's own text.
    pub fn status_string(&self, status: UcsStatus) -> String {
        // SAFETY: `self.status_string` is `ucs_status_string` of the loaded
        // UCX (kept loaded by the static `Ucx`); it takes any value of the
        // 8-bit enum and returns a NUL-terminated string that UCX owns
        // (static, or a static buffer for unknown codes), which
        // `cstr_to_string` copies at once.
        unsafe { cstr_to_string((self.status_string)(status.raw())) }
    }

    /// `ucp_config_read(NULL, NULL, …)`: UCP's configuration as the
    /// environment (`UCX_*`) sets it now.
    pub fn ucp_config_read(&self) -> Result<UcpConfig<'_>, UcsStatus> {
        let mut cfg = std::ptr::null_mut();
        // SAFETY: NULL env prefix and file are allowed (defaults: "UCX_", no
        // file); `cfg` is a valid out-pointer. The config it returns is
        // owned by the `UcpConfig` below and released once, on drop.
        let st = UcsStatus::from_raw(unsafe {
            (self.config_read)(std::ptr::null(), std::ptr::null(), &mut cfg)
        });
        if st != UcsStatus::OK || cfg.is_null() {
            return Err(if st == UcsStatus::OK {
                UcsStatus::ERR_NO_MEMORY
            } else {
                st
            });
        }
        Ok(UcpConfig {
            ucx: self,
            ptr: cfg,
        })
    }

    /// The names of UCT's components (`self`, `tcp`, `sysv`, `posix`,
    /// `cma`, `ib`, …), or an empty list where UCT is not bound.
    pub fn uct_components(&self) -> Vec<String> {
        self.with_components(|list| list.iter().map(|(n, _)| n.clone()).collect())
            .unwrap_or_default()
    }

    /// `uct_md_config_read` for the named component, from the environment.
    /// Needs no hardware. `Err(ERR_NO_ELEM)` when there is no such
    /// component, `Err(ERR_UNSUPPORTED)` where UCT is not bound.
    pub fn uct_md_config_read(&self, component: &str) -> Result<UctConfig<'_>, UcsStatus> {
        let uct = self.uct.as_ref().ok_or(UcsStatus::ERR_UNSUPPORTED)?;
        self.with_components(|list| {
            let (_, handle) = list
                .iter()
                .find(|(n, _)| n == component)
                .ok_or(UcsStatus::ERR_NO_ELEM)?;
            let mut cfg = std::ptr::null_mut();
            // SAFETY: `handle` comes from `uct_query_components`, and the
            // list is released only after this closure returns; NULL env
            // prefix and file are allowed; `cfg` is a valid out-pointer.
            // The config is owned by the `UctConfig` and released on drop.
            let st = UcsStatus::from_raw(unsafe {
                (uct.md_config_read)(*handle, std::ptr::null(), std::ptr::null(), &mut cfg)
            });
            if st != UcsStatus::OK || cfg.is_null() {
                return Err(if st == UcsStatus::OK {
                    UcsStatus::ERR_NO_MEMORY
                } else {
                    st
                });
            }
            Ok(UctConfig { uct, ptr: cfg })
        })
        .unwrap_or(Err(UcsStatus::ERR_UNSUPPORTED))
    }

    fn with_components<R>(&self, f: impl FnOnce(&[(String, *mut c_void)]) -> R) -> Option<R> {
        let uct = self.uct.as_ref()?;
        let mut comps: *mut *mut c_void = std::ptr::null_mut();
        let mut n: c_uint = 0;
        // SAFETY: `comps` and `n` are valid out-pointers; on success UCX
        // sets them to an array of `n` component handles, released once
        // below.
        let st = unsafe { (uct.query_components)(&mut comps, &mut n) };
        if st != 0 || comps.is_null() {
            return None;
        }
        let mut list = Vec::with_capacity(n as usize);
        for i in 0..n as usize {
            // SAFETY: `i < n` and the array UCX returned holds `n` handles,
            // alive until it is released below.
            let handle = unsafe { *comps.add(i) };
            // SAFETY: every field of `UctComponentAttr` is an integer, an
            // integer array or a raw pointer, for which all-zero bytes are
            // a valid value (the pointer is null).
            let mut attr: UctComponentAttr = unsafe { std::mem::zeroed() };
            attr.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME;
            // SAFETY: `handle` is live (the list is not released yet);
            // `attr` is a writable `uct_component_attr_t` with room to spare,
            // and its field mask asks for the name only, which UCX writes
            // into `name`.
            if unsafe { (uct.component_query)(handle, &mut attr) } == 0 {
                attr.name[UCT_COMPONENT_NAME_MAX - 1] = 0;
                // SAFETY: `attr.name` is NUL-terminated within its bounds
                // (its last byte was set to 0 just above).
                let name = unsafe { CStr::from_ptr(attr.name.as_ptr()) };
                list.push((name.to_string_lossy().into_owned(), handle));
            }
        }
        let r = f(&list);
        // SAFETY: `comps` came from `uct_query_components` (non-null, status
        // OK) and is released once, here, after `f`, the last use of the
        // handles (this crate's closures keep none of them).
        unsafe { (uct.release_component_list)(comps) };
        Some(r)
    }

    /// UCX's parser for plain TIME fields (`UD_TIMEOUT`, `RC_TIMEOUT`): the
    /// function `ucs_config_parser_set_value` calls for every such field.
    ///
    /// It is exported by `libucs` but not part of UCX's public headers, so
    /// it is bound only for UCX versions whose signature
    /// (`int (const char *buf, void *dest, const void *arg)`, `dest` a
    /// `double` of seconds) was checked: 1.9 to 1.23. `None` otherwise.
    /// Use it where no public configuration exposes a plain TIME field:
    /// `ucp_config_modify` only caches transport fields such as
    /// `UD_TIMEOUT` without parsing them.
    pub fn time_field_parser(&self) -> Option<TimeFieldParser<'_>> {
        self.time_parser.map(|(scan, print)| TimeFieldParser {
            _ucx: self,
            scan,
            print,
        })
    }
}

/// See [`Ucx::time_field_parser`].
pub struct TimeFieldParser<'a> {
    _ucx: &'a Ucx,
    scan: SscanfTimeFn,
    print: SprintfTimeFn,
}

impl TimeFieldParser<'_> {
    /// `Some((seconds, UCX's own rendering, e.g. "5000000.00us"))` when UCX
    /// accepts `value` for a plain TIME field, `None` when it rejects it
    /// (or `value` holds a NUL byte).
    pub fn parse(&self, value: &str) -> Option<(f64, String)> {
        let c = CString::new(value).ok()?;
        let mut secs: f64 = 0.0;
        // SAFETY: `self.scan` is `ucs_config_sscanf_time`, bound only for
        // the UCX versions whose signature was checked (see
        // `Ucx::time_field_parser`); `c` is NUL-terminated; `dest` points to
        // a writable `f64`, the `double` the TIME parser writes; `arg` is
        // unused by it, so null is fine.
        let ok =
            unsafe { (self.scan)(c.as_ptr(), (&mut secs as *mut f64).cast(), std::ptr::null()) };
        if ok == 0 {
            return None;
        }
        let mut buf = [0 as c_char; 128];
        // SAFETY: `self.print` is `ucs_config_sprintf_time` (same checked
        // versions); `buf` is writable for `buf.len()` bytes, the size
        // passed; `src` points to the `f64` parsed above; `arg` is unused.
        unsafe {
            (self.print)(
                buf.as_mut_ptr(),
                buf.len(),
                (&secs as *const f64).cast(),
                std::ptr::null(),
            )
        };
        buf[buf.len() - 1] = 0;
        // SAFETY: `buf` is NUL-terminated within its bounds (its last byte
        // was set to 0 just above).
        let text = unsafe { CStr::from_ptr(buf.as_ptr()) };
        Some((secs, text.to_string_lossy().into_owned()))
    }
}

/// A `ucp_config_t`, released on drop.
pub struct UcpConfig<'a> {
    ucx: &'a Ucx,
    ptr: *mut c_void,
}

impl UcpConfig<'_> {
    /// `ucp_config_modify(config, name, value)`; `name` without the `UCX_`
    /// prefix. Note: names UCP does not know (transport fields such as
    /// `UD_TIMEOUT`) are cached for the transports and not parsed here,
    /// so `Ok` does not mean such a value is valid. UCX logs an error line
    /// of its own for a rejected value.
    pub fn modify(&mut self, name: &str, value: &str) -> Result<(), UcsStatus> {
        let n = CString::new(name).map_err(|_| UcsStatus::ERR_INVALID_PARAM)?;
        let v = CString::new(value).map_err(|_| UcsStatus::ERR_INVALID_PARAM)?;
        // SAFETY: `self.ptr` is the live config from `ucp_config_read`
        // (released only on drop); `n` and `v` are NUL-terminated and
        // outlive the call.
        let st = UcsStatus::from_raw(unsafe {
            (self.ucx.config_modify)(self.ptr, n.as_ptr(), v.as_ptr())
        });
        if st == UcsStatus::OK {
            Ok(())
        } else {
            Err(st)
        }
    }

    /// `ucp_config_print` into memory, with the given
    /// `UCS_CONFIG_PRINT_*` flags.
    pub fn print(&self, flags: c_int) -> String {
        let title = c"nixl-keepalive";
        let mut buf: *mut c_char = std::ptr::null_mut();
        let mut len: libc::size_t = 0;
        // SAFETY: open_memstream gets valid out-pointers and a non-null
        // stream is checked before use. `ucp_config_print` gets the live
        // config (`self.ptr`), that stream and a NUL-terminated title.
        // After `fclose`, `buf` holds the malloc'd buffer and `len` its
        // length (open_memstream's contract); it is copied out, then freed
        // once with `free`.
        unsafe {
            let f = libc::open_memstream(&mut buf, &mut len);
            if f.is_null() {
                return String::new();
            }
            (self.ucx.config_print)(self.ptr, f, title.as_ptr(), flags);
            libc::fclose(f);
            if buf.is_null() {
                return String::new();
            }
            let bytes = std::slice::from_raw_parts(buf.cast::<u8>(), len);
            let s = String::from_utf8_lossy(bytes).into_owned();
            libc::free(buf.cast());
            s
        }
    }

    /// Every `UCX_NAME=value` line of [`print`](Self::print)`(CONFIG)`, as
    /// `(NAME without UCX_, value)`.
    pub fn values(&self) -> Vec<(String, String)> {
        parse_config_lines(&self.print(UCS_CONFIG_PRINT_CONFIG))
    }

    /// The printed value of one field (`KEEPALIVE_INTERVAL` →
    /// `20000000.00us`), as UCX renders it.
    pub fn get(&self, name: &str) -> Option<String> {
        self.values()
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
    }
}

impl Drop for UcpConfig<'_> {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `ucp_config_read` (non-null, status OK),
        // is owned by this `UcpConfig` alone and is released once, here.
        unsafe { (self.ucx.config_release)(self.ptr) }
    }
}

/// A UCT configuration (`uct_md_config_t` and friends), released on drop.
pub struct UctConfig<'a> {
    uct: &'a Uct,
    ptr: *mut c_void,
}

impl UctConfig<'_> {
    /// `uct_config_modify(config, name, value)`. `Err(ERR_NO_ELEM)` when
    /// this configuration has no such field.
    pub fn modify(&mut self, name: &str, value: &str) -> Result<(), UcsStatus> {
        let n = CString::new(name).map_err(|_| UcsStatus::ERR_INVALID_PARAM)?;
        let v = CString::new(value).map_err(|_| UcsStatus::ERR_INVALID_PARAM)?;
        // SAFETY: `self.ptr` is the live config from `uct_md_config_read`
        // (released only on drop); `n` and `v` are NUL-terminated and
        // outlive the call.
        let st = UcsStatus::from_raw(unsafe {
            (self.uct.config_modify)(self.ptr, n.as_ptr(), v.as_ptr())
        });
        if st == UcsStatus::OK {
            Ok(())
        } else {
            Err(st)
        }
    }

    /// `uct_config_get(config, name, …)`: the value as UCX renders it.
    pub fn get(&self, name: &str) -> Result<String, UcsStatus> {
        let n = CString::new(name).map_err(|_| UcsStatus::ERR_INVALID_PARAM)?;
        let mut buf = [0 as c_char; 256];
        // SAFETY: `self.ptr` is the live config; `n` is NUL-terminated;
        // `buf` is writable for `buf.len()` bytes, the size passed.
        let st = UcsStatus::from_raw(unsafe {
            (self.uct.config_get)(self.ptr, n.as_ptr(), buf.as_mut_ptr(), buf.len())
        });
        if st != UcsStatus::OK {
            return Err(st);
        }
        buf[buf.len() - 1] = 0;
        // SAFETY: `buf` is NUL-terminated within its bounds (its last byte
        // was set to 0 just above).
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }
}

impl Drop for UctConfig<'_> {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `uct_md_config_read` (non-null, status OK),
        // is owned by this `UctConfig` alone and is released once, here.
        unsafe { (self.uct.config_release)(self.ptr) }
    }
}

/// `UCX_NAME=value` lines of a printed configuration.
pub fn parse_config_lines(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| l.strip_prefix("UCX_"))
        .filter_map(|l| l.split_once('='))
        .map(|(n, v)| (n.to_owned(), v.to_owned()))
        .collect()
}

/// # Safety
///
/// `p` must be null or point to a NUL-terminated string that stays valid
/// and unchanged for the duration of the call.
unsafe fn cstr_to_string(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: `p` is non-null here, so by the caller's contract it is a
        // NUL-terminated string valid for the call; it is copied out.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

fn is_libucp(file_name: &str) -> bool {
    (file_name.starts_with("libucp-") || file_name.starts_with("libucp."))
        && file_name.contains(".so")
}

/// A `libucp` already mapped into this process, from `/proc/self/maps`.
fn in_process_libucp() -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .map(PathBuf::from)
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(is_libucp)
        })
}

/// The bundled `libucp-<hash>.so…` in a `nixl_cu12.libs` folder.
fn bundled_libucp(dir: &Path) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(is_libucp)
        })
        .collect();
    found.sort();
    found.into_iter().next()
}

fn candidates() -> Vec<(UcxSource, PathBuf)> {
    let mut c = Vec::new();
    if let Some(p) = std::env::var_os("NIXL_KEEPALIVE_UCX_LIB") {
        c.push((UcxSource::Explicit, PathBuf::from(p)));
    }
    if let Some(p) = in_process_libucp() {
        c.push((UcxSource::InProcess, p));
    }
    let mut dirs = Vec::new();
    if let Some(prefix) = std::env::var_os("NIXL_PREFIX") {
        dirs.push(PathBuf::from(prefix).join("nixl_cu12.libs"));
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    dirs.push(workspace.join(".nixl-runtime").join("nixl_cu12.libs"));
    for d in dirs {
        if let Some(p) = bundled_libucp(&d) {
            c.push((UcxSource::NixlRuntime, p));
        }
    }
    c.push((UcxSource::System, PathBuf::from("libucp.so.0")));
    c
}

fn load() -> Result<Ucx, LoadError> {
    let mut tried = Vec::new();
    for (source, path) in candidates() {
        match open(source.clone(), &path) {
            Ok(u) => return Ok(u),
            Err(e) => tried.push(format!("{} ({source}): {e}", path.display())),
        }
    }
    Err(LoadError { tried })
}

/// Symbol reads: each symbol is declared with the signature UCX documents
/// for it; the library stays loaded for the life of the process (the
/// [`Ucx`] lives in a static), so the copied function pointers stay valid.
fn open(source: UcxSource, path: &Path) -> Result<Ucx, String> {
    // SAFETY: loading UCX runs its constructors (library init), which is
    // what any UCX user does; RTLD_GLOBAL as UCX's own modules expect. The
    // `Library` ends up in the static `Ucx` and is never unloaded.
    let lib =
        unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }.map_err(|e| e.to_string())?;
    macro_rules! sym {
        ($t:ty, $name:literal) => {
            // SAFETY: `$t` is the signature UCX documents for `$name` (or,
            // for the two TIME functions, the one checked for the versions
            // `checked_time_abi` admits). The function pointer copied out
            // outlives the `Symbol` borrow: sound because `lib` moves into
            // the returned `Ucx`, kept in a static and never unloaded (on
            // an error return nothing keeps the pointers).
            unsafe { lib.get::<$t>(concat!($name, "\0").as_bytes()) }
                .map(|s| *s)
                .map_err(|e| e.to_string())
        };
    }
    let version_string = sym!(VersionStringFn, "ucp_get_version_string")?;
    // SAFETY: `ucp_get_version_string` takes no arguments and returns a
    // static NUL-terminated string, copied out by `cstr_to_string`.
    let version = unsafe { cstr_to_string(version_string()) };
    let uct = (|| {
        Ok::<_, String>(Uct {
            query_components: sym!(UctQueryComponentsFn, "uct_query_components")?,
            component_query: sym!(UctComponentQueryFn, "uct_component_query")?,
            release_component_list: sym!(UctReleaseComponentListFn, "uct_release_component_list")?,
            md_config_read: sym!(UctMdConfigReadFn, "uct_md_config_read")?,
            config_modify: sym!(UcpConfigModifyFn, "uct_config_modify")?,
            config_get: sym!(UctConfigGetFn, "uct_config_get")?,
            config_release: sym!(ConfigReleaseFn, "uct_config_release")?,
        })
    })()
    .ok();
    let checked_time_abi =
        matches!(version_of(&version), Some((1, minor)) if (9..=23).contains(&minor));
    let time_parser = if checked_time_abi {
        match (
            sym!(SscanfTimeFn, "ucs_config_sscanf_time"),
            sym!(SprintfTimeFn, "ucs_config_sprintf_time"),
        ) {
            (Ok(a), Ok(b)) => Some((a, b)),
            _ => None,
        }
    } else {
        None
    };
    Ok(Ucx {
        status_string: sym!(StatusStringFn, "ucs_status_string")?,
        config_read: sym!(UcpConfigReadFn, "ucp_config_read")?,
        config_modify: sym!(UcpConfigModifyFn, "ucp_config_modify")?,
        config_print: sym!(UcpConfigPrintFn, "ucp_config_print")?,
        config_release: sym!(ConfigReleaseFn, "ucp_config_release")?,
        uct,
        time_parser,
        version,
        path: path.to_path_buf(),
        source,
        _lib: lib,
    })
}

fn version_of(v: &str) -> Option<(u32, u32)> {
    let mut it = v.split('.');
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ucx_or_skip() -> Option<&'static Ucx> {
        // The NIXL wheel's UCX has an `efa` module linked against the
        // system's libefa; where the system's rdma-core is installed too
        // (Debian's libucx0 pulls it in), two libnl copies meet and the
        // process crashes at exit. Keep that module out of test processes.
        if std::env::var_os("UCX_MODULES").is_none() {
            std::env::set_var("UCX_MODULES", "^efa");
        }
        match Ucx::get() {
            Ok(u) => {
                eprintln!("using {}", Ucx::describe());
                Some(u)
            }
            Err(e) => {
                assert!(
                    std::env::var("NIXL_KEEPALIVE_REQUIRE_REAL").as_deref() != Ok("1"),
                    "NIXL_KEEPALIVE_REQUIRE_REAL=1 but {e}"
                );
                eprintln!("SKIPPED: {e}");
                None
            }
        }
    }

    #[test]
    fn every_status_message_matches_ucs_status_string() {
        let Some(ucx) = ucx_or_skip() else { return };
        for raw in i8::MIN..=i8::MAX {
            let s = UcsStatus::from_raw(raw);
            // Outside UCX's range the text is still "Unknown error <n>".
            assert_eq!(ucx.status_string(s), s.message(), "status {raw}");
        }
        for s in UcsStatus::ALL {
            assert_eq!(ucx.status_string(*s), s.message(), "{s:?}");
        }
    }

    #[test]
    fn version_and_config_print_work() {
        let Some(ucx) = ucx_or_skip() else { return };
        assert!(ucx.version_numbers().is_some(), "{}", ucx.version());
        let mut cfg = ucx.ucp_config_read().unwrap();
        assert!(cfg.get("KEEPALIVE_INTERVAL").is_some());
        cfg.modify("KEEPALIVE_INTERVAL", "2s").unwrap();
        assert_eq!(
            cfg.get("KEEPALIVE_INTERVAL").as_deref(),
            Some("2000000.00us")
        );
        assert_eq!(
            cfg.modify("KEEPALIVE_INTERVAL", "2h"),
            Err(UcsStatus::ERR_INVALID_PARAM)
        );
        assert!(ucx.uct_components().iter().any(|c| c == "self"));
    }

    #[test]
    fn config_lines_parse() {
        let v = parse_config_lines("# c\nUCX_A=1\nUCX_B=x=y\nfoo\n");
        assert_eq!(
            v,
            vec![("A".into(), "1".into()), ("B".into(), "x=y".into())]
        );
    }

    #[test]
    fn status_messages_are_ucx_text() {
        assert_eq!(
            UcsStatus::ERR_CONNECTION_RESET.message(),
            "Connection reset by remote peer"
        );
        assert_eq!(
            UcsStatus::ERR_ENDPOINT_TIMEOUT.message(),
            "Endpoint timeout"
        );
        assert_eq!(
            UcsStatus::ERR_FIRST_LINK_FAILURE.message(),
            "Unknown error -40"
        );
        assert_eq!(UcsStatus::ERR_LAST.known_message(), None);
    }
}

//! The GPU-mapping ledger's raw hooks (`shim/gpu_map.c`): what gives a
//! released peer's GPU memory back while UCX's CUDA IPC cache is on.
//!
//! UCX's cuda_ipc transport maps a peer's GPU allocation at the first
//! zero-copy transfer and keeps it in a process-wide cache until the
//! process exits; nothing a release does reaches it, and the mapping keeps
//! the peer's memory allocated (docs/design/gpu-mappings.md). The ledger,
//! part of the interposer [`crate::endpoints`] loads before libnixl, sees
//! UCX's cache entry points, the driver calls inside them and libucp's rkey
//! unpacks; it keeps one reference of each idle region and gives it back,
//! with UCX's own unmap and the cache off, at the release of the last agent
//! that used the region: UCX then removes and closes the region itself,
//! unless a transfer holds it.
//!
//! This module only loads the hooks and reports their raw counts; the
//! `nixl-agent` crate's `gpu` module names the agents (pairs) and says
//! what a release did.

use std::ffi::{c_char, c_int, CString};

use libloading::os::unix::Library;

/// How a mapping was imported: `NKS_GPU_KIND_*` of shim/gpu_map.c.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuImport {
    /// Legacy CUDA IPC (`cuIpcOpenMemHandle`): `cudaMalloc` memory.
    Legacy,
    /// VMM over a fabric handle (multi-node NVLink).
    VmmFabric,
    /// VMM over a POSIX file descriptor (one node, UCX 1.22 and later).
    VmmPosixFd,
    /// VMM over another handle type.
    VmmOther,
    /// A kind this crate does not know.
    Unknown(u32),
}

impl GpuImport {
    fn from_raw(kind: u32) -> GpuImport {
        match kind {
            1 => GpuImport::Legacy,
            2 => GpuImport::VmmFabric,
            3 => GpuImport::VmmPosixFd,
            4 => GpuImport::VmmOther,
            other => GpuImport::Unknown(other),
        }
    }
}

impl std::fmt::Display for GpuImport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuImport::Legacy => write!(f, "legacy-ipc"),
            GpuImport::VmmFabric => write!(f, "vmm-fabric"),
            GpuImport::VmmPosixFd => write!(f, "vmm-posix-fd"),
            GpuImport::VmmOther => write!(f, "vmm"),
            GpuImport::Unknown(k) => write!(f, "kind-{k}"),
        }
    }
}

/// `struct nks_gpu_mapping` of shim/gpu_map.c.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RawGpuMapping {
    pub addr: u64,
    pub size: u64,
    pub d_bptr: u64,
    pub refs: i64,
    pub holder: u64,
    pub kind: u32,
    pub opens: u32,
    pub holders: u32,
    pub pid: i32,
    pub held: u8,
    pub unknown: u8,
    pub doomed: u8,
    pub pad: u8,
    pub pad2: u32,
}

/// One mapping UCX's cache holds, as the ledger sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuMapping {
    /// The mapped address in this process.
    pub addr: u64,
    /// Bytes mapped (the whole exporter allocation); 0 when the driver
    /// could not say.
    pub size: u64,
    /// How it was imported.
    pub import: GpuImport,
    /// Driver opens of it not closed yet (legacy IPC counts opens).
    pub opens: u32,
    /// UCX's references to it (transfers in flight, unpacked rkeys), the
    /// ledger's own not counted.
    pub refs: i64,
    /// Agent pairs (see `nixl-agent`'s `gpu` module) that used it and are
    /// not released; [`GpuMapping::holder`] is the first of them.
    pub holders: u32,
    /// The first agent pair that used it (0: none).
    pub holder: u64,
    /// The exporter's pid and base address, once UCX unmapped it once.
    pub exporter: Option<(i32, u64)>,
    /// Whether the ledger holds one reference of it (idle, cache on).
    pub held: bool,
    /// Used by an rkey no load scope named: never unmapped by a release.
    pub unknown: bool,
    /// Released while in use: unmapped when its last transfer ends.
    pub doomed: bool,
}

impl From<RawGpuMapping> for GpuMapping {
    fn from(r: RawGpuMapping) -> Self {
        GpuMapping {
            addr: r.addr,
            size: r.size,
            import: GpuImport::from_raw(r.kind),
            opens: r.opens,
            refs: r.refs,
            holders: r.holders,
            holder: r.holder,
            exporter: (r.pid != 0 || r.d_bptr != 0).then_some((r.pid, r.d_bptr)),
            held: r.held != 0,
            unknown: r.unknown != 0,
            doomed: r.doomed != 0,
        }
    }
}

/// What one release did: `struct nks_gpu_release` of shim/gpu_map.c.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuReleaseCounts {
    /// Regions UCX removed from its cache and closed.
    pub unmapped: u32,
    /// Regions kept: another agent pair still uses them.
    pub kept_shared: u32,
    /// Regions kept: an rkey no load named used them too.
    pub kept_unknown: u32,
    /// Regions in use by a transfer now: closed when UCX's count reaches 0.
    pub deferred: u32,
    /// Regions a transfer mapped again between the decision and the call:
    /// kept (that transfer holds them).
    pub raced: u32,
    /// Closes the driver refused (UCX forgets the region all the same).
    pub failures: u32,
    /// Bytes of the regions unmapped.
    pub bytes: u64,
}

/// Process-wide counts: `struct nks_gpu_counts` of shim/gpu_map.c.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuCounts {
    /// UCX map calls seen while the ledger was on.
    pub maps: u64,
    /// Of which found their region cached.
    pub hits: u64,
    /// Driver opens inside UCX's map calls.
    pub opens: u64,
    /// Driver opens that failed.
    pub open_failures: u64,
    /// Driver closes of ledger regions.
    pub closes: u64,
    /// Of which failed.
    pub close_failures: u64,
    /// Regions closed by releases (at once or at their last transfer).
    pub unmapped: u64,
    /// Their bytes.
    pub unmapped_bytes: u64,
    /// Regions in the ledger now.
    pub regions: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Regions holding the ledger's reference now.
    pub held: u64,
    /// Map calls by rkeys no load named.
    pub unknown_keys: u64,
}

/// The symbols UCX's cuda_ipc module (libuct_cuda) must call here for the
/// ledger to work: the cache's entry points and the driver calls that map
/// and close legacy IPC and VMM imports.
pub const UCT_CUDA_SYMBOLS: [&str; 6] = [
    "uct_cuda_ipc_map_memhandle",
    "uct_cuda_ipc_unmap_memhandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuMemMap",
    "cuMemUnmap",
];

/// The symbols libucp must call here: the rkey unpacks that name the keys
/// a load made, and their release.
pub const UCP_SYMBOLS: [&str; 2] = ["uct_rkey_unpack_v2", "uct_rkey_release"];

/// The base-name prefix of UCX's CUDA transport module.
pub const UCT_CUDA_FILE: &str = "libuct_cuda";
/// The base-name prefix of libucp (hashed in wheels: `libucp-<hash>.so`).
pub const UCP_FILE: &str = "libucp";

/// How one object binds one of the ledger's symbols (`nks_gpu_bound`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binding {
    /// Its relocation points here (or, bound lazily, will).
    Here,
    /// It calls another definition (loaded before the interposer, or with
    /// `RTLD_DEEPBIND`).
    Elsewhere,
    /// It does not import the symbol.
    NotImported,
    /// No such object is loaded.
    NotLoaded,
}

/// The ledger's functions in the loaded interposer.
pub struct GpuHooks {
    pub(crate) enable: unsafe extern "C" fn(c_int),
    pub(crate) enabled: unsafe extern "C" fn() -> c_int,
    pub(crate) scope_begin: unsafe extern "C" fn(),
    pub(crate) scope_end: unsafe extern "C" fn() -> u64,
    pub(crate) assign: unsafe extern "C" fn(u64, u64),
    pub(crate) release: unsafe extern "C" fn(u64, *mut GpuReleaseCounts),
    pub(crate) counts: unsafe extern "C" fn(*mut GpuCounts),
    pub(crate) ledger: unsafe extern "C" fn(*mut RawGpuMapping, usize) -> usize,
    pub(crate) bound: unsafe extern "C" fn(*const c_char, c_int, *const c_char) -> c_int,
}

impl GpuHooks {
    /// Looks the ledger's functions up in the interposer.
    ///
    /// # Safety
    ///
    /// `lib` must be the interposer built from shim/*.c by build.rs, and
    /// must outlive the returned hooks (it is never unloaded).
    pub(crate) unsafe fn load(lib: &Library) -> Result<GpuHooks, String> {
        macro_rules! sym {
            ($name:expr) => {
                // SAFETY: each field's type is the C signature shim/gpu_map.c
                // gives that symbol, mirrored by the `#[repr(C)]` types of
                // this module; `lib` outlives the copied pointer (caller).
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| e.to_string())?
            };
        }
        Ok(GpuHooks {
            enable: sym!("nks_gpu_enable"),
            enabled: sym!("nks_gpu_enabled"),
            scope_begin: sym!("nks_gpu_scope_begin"),
            scope_end: sym!("nks_gpu_scope_end"),
            assign: sym!("nks_gpu_assign"),
            release: sym!("nks_gpu_release"),
            counts: sym!("nks_gpu_counts"),
            ledger: sym!("nks_gpu_ledger"),
            bound: sym!("nks_gpu_bound"),
        })
    }

    /// Whether the ledger is on.
    pub fn is_enabled(&self) -> bool {
        // SAFETY: `nks_gpu_enabled` (`int (void)`) reads one atomic flag.
        unsafe { (self.enabled)() != 0 }
    }

    /// Turns the ledger on or off for the process (already so: nothing
    /// happens). Off gives back every reference it holds (UCX keeps those
    /// regions cached, as without the ledger) and forgets it.
    pub fn set_enabled(&self, on: bool) {
        // SAFETY: `nks_gpu_enable` (`void (int)`), kept loaded with the
        // interposer; it takes its own lock and calls UCX's unmap, which
        // takes UCX's, never both at once.
        unsafe { (self.enable)(c_int::from(on)) }
    }

    /// Opens a load scope on this thread: the rkeys unpacked and the
    /// regions mapped on this thread until [`GpuHooks::scope_end`] belong
    /// to the load's remote agent.
    pub fn scope_begin(&self) {
        // SAFETY: `nks_gpu_scope_begin` (`void (void)`) only touches this
        // thread's scope state.
        unsafe { (self.scope_begin)() }
    }

    /// Closes this thread's load scope; returns the batch of what it saw
    /// (0: nothing), to name with [`GpuHooks::assign`].
    pub fn scope_end(&self) -> u64 {
        // SAFETY: `nks_gpu_scope_end` (`uint64_t (void)`) closes this
        // thread's scope (a no-op when none is open).
        unsafe { (self.scope_end)() }
    }

    /// Names `batch` (from [`GpuHooks::scope_end`]) as `pair`; `pair` 0
    /// drops the batch (the load failed), and its regions are never
    /// unmapped by a release.
    pub fn assign(&self, batch: u64, pair: u64) {
        if batch != 0 {
            // SAFETY: `nks_gpu_assign` (`void (uint64_t, uint64_t)`) renames
            // under the ledger's lock; unknown batches are ignored.
            unsafe { (self.assign)(batch, pair) }
        }
    }

    /// The release of `pair`: call it once its rkeys are released (NIXL's
    /// invalidation) and none of its transfers is in flight.
    pub fn release(&self, pair: u64) -> GpuReleaseCounts {
        let mut out = GpuReleaseCounts::default();
        // SAFETY: `nks_gpu_release` writes one `struct nks_gpu_release`,
        // mirrored by `GpuReleaseCounts`, into `out`; it calls UCX's unmap
        // without holding its own lock.
        unsafe { (self.release)(pair, &mut out) };
        out
    }

    /// The process-wide counts.
    pub fn counts(&self) -> GpuCounts {
        let mut out = GpuCounts::default();
        // SAFETY: `nks_gpu_counts` writes one `struct nks_gpu_counts`,
        // mirrored by `GpuCounts`, into `out`.
        unsafe { (self.counts)(&mut out) };
        out
    }

    /// Every mapping in the ledger now.
    pub fn ledger(&self) -> Vec<GpuMapping> {
        let mut raw: Vec<RawGpuMapping> = Vec::new();
        loop {
            let cap = raw.capacity();
            // SAFETY: `nks_gpu_ledger` writes at most `cap` entries (each a
            // `struct nks_gpu_mapping`, mirrored by `RawGpuMapping`) into
            // the vector's spare capacity and returns how many exist.
            let n = unsafe { (self.ledger)(raw.as_mut_ptr(), cap) };
            if n <= cap {
                // SAFETY: the first `n` entries were written just above.
                unsafe { raw.set_len(n) };
                return raw.into_iter().map(GpuMapping::from).collect();
            }
            raw.reserve(n + 16);
        }
    }

    /// How the loaded object whose base name is (or, with `prefix`, starts
    /// with) `file` binds `symbol`; `None` for a symbol that is not the
    /// ledger's.
    pub fn binding(&self, file: &str, prefix: bool, symbol: &str) -> Option<Binding> {
        let (Ok(f), Ok(s)) = (CString::new(file), CString::new(symbol)) else {
            return None;
        };
        // SAFETY: `nks_gpu_bound` (`int (const char *, int, const char *)`)
        // reads the two NUL-terminated strings, which outlive the call, and
        // the loader's list of objects.
        match unsafe { (self.bound)(f.as_ptr(), c_int::from(prefix), s.as_ptr()) } {
            1 | 2 => Some(Binding::Here),
            0 => Some(Binding::Elsewhere),
            -1 => Some(Binding::NotImported),
            -2 => Some(Binding::NotLoaded),
            _ => None,
        }
    }

    /// Whether UCX's CUDA transport and libucp in this process call the
    /// ledger: [`GpuUnmapMode::Unmapping`], or why not.
    pub fn check(&self) -> GpuUnmapMode {
        if !self.is_enabled() {
            return GpuUnmapMode::Off;
        }
        let mut elsewhere = Vec::new();
        for (file, symbols) in [
            (UCT_CUDA_FILE, &UCT_CUDA_SYMBOLS[..]),
            (UCP_FILE, &UCP_SYMBOLS[..]),
        ] {
            for symbol in symbols {
                match self.binding(file, true, symbol) {
                    Some(Binding::Here) => {}
                    Some(Binding::NotLoaded) if file == UCT_CUDA_FILE => {
                        return GpuUnmapMode::NoCudaTransport
                    }
                    Some(Binding::NotLoaded) => return GpuUnmapMode::Pending,
                    Some(Binding::NotImported) => {
                        elsewhere.push(format!("{file} does not import {symbol}"))
                    }
                    _ => elsewhere.push(format!("{file} calls another {symbol}")),
                }
            }
        }
        if elsewhere.is_empty() {
            GpuUnmapMode::Unmapping
        } else {
            GpuUnmapMode::Unavailable(format!(
                "{} (loaded before nixl-sys's interposer, or with RTLD_DEEPBIND)",
                elsewhere.join(", ")
            ))
        }
    }
}

/// Whether releases give UCX's cached GPU mappings back in this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuUnmapMode {
    /// Yes: UCX's CUDA transport and libucp call the ledger.
    Unmapping,
    /// Turned off (the service's knob, `NIXL_KEEPALIVE_GPU_UNMAP=0`).
    Off,
    /// UCX's CUDA transport (libuct_cuda) is not loaded in this process: no
    /// CUDA IPC mapping is made here (no CUDA driver, or UCX_TLS without
    /// cuda_ipc).
    NoCudaTransport,
    /// Not known yet: libucp is not loaded (no UCX backend exists yet).
    Pending,
    /// Wanted but not possible here; the reason says why.
    Unavailable(String),
}

impl GpuUnmapMode {
    /// Whether releases unmap.
    pub fn is_unmapping(&self) -> bool {
        matches!(self, GpuUnmapMode::Unmapping)
    }
}

impl std::fmt::Display for GpuUnmapMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuUnmapMode::Unmapping => write!(
                f,
                "unmapping (UCX's cuda_ipc cache and the driver calls are bound to the ledger)"
            ),
            GpuUnmapMode::Off => write!(f, "off (NIXL_KEEPALIVE_GPU_UNMAP=0)"),
            GpuUnmapMode::NoCudaTransport => write!(
                f,
                "no CUDA transport (UCX's libuct_cuda is not loaded: no CUDA IPC mappings here)"
            ),
            GpuUnmapMode::Pending => write!(f, "pending (no UCX backend yet)"),
            GpuUnmapMode::Unavailable(why) => write!(f, "unavailable: {why}"),
        }
    }
}

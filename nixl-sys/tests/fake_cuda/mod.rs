//! The fakes of the GPU-mapping tests, loaded behind the interposer: a
//! fake CUDA driver and a library that behaves as UCX's cuda_ipc cache
//! (the C files beside this one, built by build.rs into
//! OUT_DIR/fake-cuda). Shared by the test files that use them.

#![allow(dead_code, clippy::undocumented_unsafe_blocks)]

use std::ffi::c_int;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
use nixl_sys::endpoints::EpClose;
use nixl_sys::gpu::GpuHooks;

pub const GIB: u64 = 1 << 30;
pub const CUDA_ERROR_ILLEGAL_ADDRESS: c_int = 700;

/// `struct fake_key` of fake_uct_cuda.c: what an rkey carries.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct FakeKey {
    pub vmm: i32,
    pub pid: i32,
    pub pid_ns: u32,
    pub pad: u32,
    pub d_bptr: u64,
    pub b_len: u64,
    pub buffer_id: u64,
    pub handle: [u8; 64],
}

/// `uct_rkey_bundle_t`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Bundle {
    pub rkey: u64,
    pub handle: u64,
    pub kind: u64,
}

/// `struct fake_cuda_stats` of fake_driver.c.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct DriverStats {
    pub opens: u64,
    pub closes: u64,
    pub bad_closes: u64,
    pub live_maps: u64,
    pub allocated: u64,
    pub context_lost: u64,
}

pub struct Fakes {
    pub export: unsafe extern "C" fn(u64, *mut u8),
    pub exporter_exit: unsafe extern "C" fn(*const u8),
    pub stats: unsafe extern "C" fn(*mut DriverStats),
    pub fail_next: unsafe extern "C" fn(c_int, c_int, c_int),
    pub driver_close: unsafe extern "C" fn(u64) -> c_int,
    pub reset_context: unsafe extern "C" fn(),
    pub unpack: unsafe extern "C" fn(*const FakeKey, *mut Bundle) -> u64,
    pub destroy: unsafe extern "C" fn(*const Bundle),
    pub get_begin: unsafe extern "C" fn(u64, u64, *mut c_int) -> u64,
    pub get_end: unsafe extern "C" fn(u64, u64),
    pub set_cache: unsafe extern "C" fn(c_int),
    pub cached: unsafe extern "C" fn() -> c_int,
    pub exit: unsafe extern "C" fn(),
    _driver: Library,
    _cache: Library,
}

pub fn fake_dir() -> PathBuf {
    PathBuf::from(env!("OUT_DIR")).join("fake-cuda")
}

/// The interposer (loaded first, so the fakes bind to it), then the
/// fakes; one lock for the whole test.
pub fn setup() -> (MutexGuard<'static, ()>, &'static GpuHooks, &'static Fakes) {
    static LOCK: Mutex<()> = Mutex::new(());
    static FAKES: OnceLock<(&'static GpuHooks, Fakes)> = OnceLock::new();
    let guard = LOCK.lock().unwrap_or_else(PoisonError::into_inner);
    let (hooks, fakes) = FAKES.get_or_init(|| {
        let process = EpClose::process().expect("the interposer loads");
        let hooks = process.gpu().expect("the interposer has the ledger");
        unsafe {
            // The driver by its path first: the cache library's
            // DT_NEEDED libcuda.so.1 then finds it by its soname.
            let driver =
                Library::open(Some(fake_dir().join("libcuda.so.1")), RTLD_NOW | RTLD_LOCAL)
                    .expect("fake driver");
            let cache = Library::open(
                Some(fake_dir().join("libfake_uct_cuda.so")),
                RTLD_NOW | RTLD_LOCAL,
            )
            .expect("fake cache");
            let fakes = Fakes {
                export: *driver.get(b"fake_cuda_export\0").unwrap(),
                exporter_exit: *driver.get(b"fake_cuda_exporter_exit\0").unwrap(),
                stats: *driver.get(b"fake_cuda_stats\0").unwrap(),
                fail_next: *driver.get(b"fake_cuda_fail_next\0").unwrap(),
                driver_close: *driver.get(b"cuIpcCloseMemHandle\0").unwrap(),
                reset_context: *driver.get(b"fake_cuda_reset_context\0").unwrap(),
                unpack: *cache.get(b"fake_ucp_rkey_unpack\0").unwrap(),
                destroy: *cache.get(b"fake_ucp_rkey_destroy\0").unwrap(),
                get_begin: *cache.get(b"fake_ucx_get_begin\0").unwrap(),
                get_end: *cache.get(b"fake_ucx_get_end\0").unwrap(),
                set_cache: *cache.get(b"fake_ucx_set_cache\0").unwrap(),
                cached: *cache.get(b"fake_ucx_cached\0").unwrap(),
                exit: *cache.get(b"fake_ucx_exit\0").unwrap(),
                _driver: driver,
                _cache: cache,
            };
            (hooks, fakes)
        }
    });
    hooks.set_enabled(true);
    unsafe { (fakes.set_cache)(1) };
    (guard, hooks, fakes)
}

/// One exporter process's allocation.
#[derive(Clone, Copy)]
pub struct Export {
    pub key: FakeKey,
}

impl Fakes {
    pub fn export(&self, pid: i32, d_bptr: u64, size: u64, buffer_id: u64) -> Export {
        let mut handle = [0u8; 64];
        unsafe { (self.export)(size, handle.as_mut_ptr()) };
        Export {
            key: FakeKey {
                vmm: 0,
                pid,
                pid_ns: 4026531836,
                pad: 0,
                d_bptr,
                b_len: size,
                buffer_id,
                handle,
            },
        }
    }

    pub fn exporter_exits(&self, e: &Export) {
        unsafe { (self.exporter_exit)(e.key.handle.as_ptr()) }
    }

    pub fn stats(&self) -> DriverStats {
        let mut s = DriverStats::default();
        unsafe { (self.stats)(&mut s) };
        s
    }

    /// An rkey unpack (as NIXL's load does through libucp).
    pub fn unpack(&self, e: &Export) -> Bundle {
        let mut b = Bundle::default();
        let key = unsafe { (self.unpack)(&e.key, &mut b) };
        assert_ne!(key, 0, "the fake unpack failed");
        b
    }

    pub fn destroy(&self, b: &Bundle) {
        unsafe { (self.destroy)(b) }
    }

    /// One whole read: map, read through the mapping, unmap.
    pub fn read(&self, b: &Bundle) -> c_int {
        let (mapped, st) = self.begin(b);
        if mapped != 0 {
            self.end(b, mapped);
        }
        st
    }

    pub fn begin(&self, b: &Bundle) -> (u64, c_int) {
        let mut st = 0;
        let mapped = unsafe { (self.get_begin)(b.rkey, 4096, &mut st) };
        (mapped, st)
    }

    pub fn end(&self, b: &Bundle, mapped: u64) {
        unsafe { (self.get_end)(b.rkey, mapped) }
    }

    pub fn cached(&self) -> i32 {
        unsafe { (self.cached)() }
    }
}

/// Distinct pair numbers per test (the ledger is process-wide).
pub fn pair() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Distinct exporter pids per test.
pub fn pid() -> i32 {
    static NEXT: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(10_000);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// A load of `exports` as `pair` names: the keys unpacked in one scope.
pub fn load(hooks: &GpuHooks, fakes: &Fakes, pair: u64, exports: &[Export]) -> Vec<Bundle> {
    hooks.scope_begin();
    let keys = exports.iter().map(|e| fakes.unpack(e)).collect();
    let batch = hooks.scope_end();
    assert_ne!(batch, 0, "the scope saw the unpacks");
    hooks.assign(batch, pair);
    keys
}

/// One peer of [`crowd`]: its pair, its exports, its unpacked keys.
pub type Peer = (u64, Vec<Export>, Vec<Bundle>);

/// `peers` peers of 10 regions of 64 MiB each, loaded and read once.
pub fn crowd(hooks: &GpuHooks, fakes: &Fakes, peers: usize) -> Vec<Peer> {
    (0..peers)
        .map(|_| {
            let pid = pid();
            let exports: Vec<_> = (0..10u64)
                .map(|i| fakes.export(pid, 0x10_0000_0000 + i * GIB, 64 << 20, i + 1))
                .collect();
            let p = pair();
            let keys = load(hooks, fakes, p, &exports);
            for k in &keys {
                assert_eq!(fakes.read(k), 0);
            }
            (p, exports, keys)
        })
        .collect()
}

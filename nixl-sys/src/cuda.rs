//! The CUDA driver's raw function table, loaded at run time.
//!
//! Nothing links against CUDA: `libcuda.so.1` (the driver's library, not
//! the toolkit's runtime) is opened with `dlopen` the first time
//! [`Driver::get`] is called, and stays loaded for the life of the process.
//! No call is made here (not even `cuInit`): the `nixl-agent` crate's
//! `cuda` module initialises the driver and owns device memory.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};

/// The driver library opened by [`Driver::get`].
pub const LIBCUDA: &str = "libcuda.so.1";

/// `CUresult`.
pub type CuResult = c_int;
/// `CUdevice`: a device ordinal's handle.
pub type CuDevice = c_int;
/// `CUcontext`.
pub type CuContext = *mut c_void;
/// `CUdeviceptr`: a device address.
pub type CuDevicePtr = u64;

/// `CUDA_SUCCESS`.
pub const CUDA_SUCCESS: CuResult = 0;

/// The driver entry points the bindings use, each with the driver API's
/// signature for it (cuda.h; the `_v2` entry points where the API has
/// them). Calling one is `unsafe`: the caller upholds the driver's contract
/// for that function (an initialised driver, a current context where the
/// call needs one, valid pointers). Obtain it with [`Driver::get`].
pub struct Driver {
    pub init: unsafe extern "C" fn(c_uint) -> CuResult,
    pub device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    pub device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    pub primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    pub ctx_set_current: unsafe extern "C" fn(CuContext) -> CuResult,
    pub ctx_synchronize: unsafe extern "C" fn() -> CuResult,
    pub mem_alloc: unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult,
    pub mem_free: unsafe extern "C" fn(CuDevicePtr) -> CuResult,
    pub memset_d8: unsafe extern "C" fn(CuDevicePtr, u8, usize) -> CuResult,
    pub memcpy_htod: unsafe extern "C" fn(CuDevicePtr, *const c_void, usize) -> CuResult,
    pub memcpy_dtoh: unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize) -> CuResult,
    pub mem_get_info: unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult,
    pub get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    _lib: Library,
}

static DRIVER: OnceLock<Result<Driver, String>> = OnceLock::new();

impl Driver {
    /// Loads the driver library once per process (later calls return the
    /// same result); the error is `dlerror()`'s text or the missing
    /// symbol.
    pub fn get() -> Result<&'static Driver, String> {
        DRIVER
            .get_or_init(Self::load)
            .as_ref()
            .map_err(Clone::clone)
    }

    fn load() -> Result<Driver, String> {
        // SAFETY: loading the driver runs its initialisers; it is the
        // library this module exists to use, and it is never unloaded (the
        // `Library` lives in the static `Driver`).
        let lib = unsafe { Library::open(Some(LIBCUDA), RTLD_NOW | RTLD_LOCAL) }
            .map_err(|e| e.to_string())?;
        macro_rules! sym {
            ($name:expr) => {{
                // SAFETY: each `Driver` field's type is the driver API's
                // documented signature for that symbol (cuda.h, the `_v2`
                // entry points where the API has them). The function
                // pointer copied out outlives the `Symbol` borrow: sound
                // because `lib` moves into the `Driver`, which lives in a
                // static and never unloads it (on an error return nothing
                // keeps the pointers).
                match unsafe { lib.get(concat!($name, "\0").as_bytes()) } {
                    Ok(s) => *s,
                    Err(_) => return Err(format!("{LIBCUDA} has no symbol {}", $name)),
                }
            }};
        }
        Ok(Driver {
            init: sym!("cuInit"),
            device_get_count: sym!("cuDeviceGetCount"),
            device_get: sym!("cuDeviceGet"),
            primary_ctx_retain: sym!("cuDevicePrimaryCtxRetain"),
            ctx_set_current: sym!("cuCtxSetCurrent"),
            ctx_synchronize: sym!("cuCtxSynchronize"),
            mem_alloc: sym!("cuMemAlloc_v2"),
            mem_free: sym!("cuMemFree_v2"),
            memset_d8: sym!("cuMemsetD8_v2"),
            memcpy_htod: sym!("cuMemcpyHtoD_v2"),
            memcpy_dtoh: sym!("cuMemcpyDtoH_v2"),
            mem_get_info: sym!("cuMemGetInfo_v2"),
            get_error_name: sym!("cuGetErrorName"),
            _lib: lib,
        })
    }
}

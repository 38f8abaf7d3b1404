//! GPU memory through the CUDA driver API, loaded at run time.
//!
//! Nothing links against CUDA: `libcuda.so.1` (the driver's library, not
//! the toolkit's runtime) is opened with `dlopen` (by `nixl_sys::cuda`)
//! the first time [`Cuda::get`] is called, and stays loaded for the life of the process.
//! Without it (no NVIDIA driver, no GPU) every call answers a
//! [`CudaError::Load`] that names the library, so a program can refuse
//! `--memory vram` at once with a clear message.
//!
//! What is here is what a KV cache in device memory needs and no more:
//! [`DeviceMemory`] (`cuMemAlloc`, freed on drop), filled with a byte
//! (`cuMemsetD8`) or from host bytes (`cuMemcpyHtoD`), read back
//! (`cuMemcpyDtoH`), the device's free and total memory
//! ([`Cuda::mem_info`], `cuMemGetInfo`), and [`Agent::register_vram`],
//! which registers such memory with NIXL as `VRAM_SEG` under its device
//! id. Every call runs in the device's *primary* context (retained once
//! per device, made current on the calling thread before each call), the
//! context UCX's `cuda_ipc` transport also finds from the pointer.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, CStr};
use std::sync::{Mutex, OnceLock, PoisonError};

/// The driver library opened by [`Cuda::get`].
pub use nixl_sys::cuda::LIBCUDA;
use nixl_sys::cuda::{CuContext, CuDevice, CuDevicePtr, CuResult, Driver, CUDA_SUCCESS};

use crate::agent::{Agent, MemType, Registered};
use crate::error::NixlError;

/// A failed CUDA call, or a driver that could not be loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CudaError {
    /// `libcuda.so.1` could not be opened, or lacks a symbol: no NVIDIA
    /// driver here (or not one this crate can use).
    Load {
        /// `dlerror()`'s text, or the missing symbol.
        message: String,
    },
    /// A driver call returned an error.
    Call {
        /// The driver function (`cuMemAlloc_v2`, ...).
        call: &'static str,
        /// Its `CUresult`.
        code: i32,
        /// The driver's name for it (`CUDA_ERROR_OUT_OF_MEMORY`), when it
        /// gave one.
        name: Option<String>,
        /// What was asked (`device 0, 137438953472 bytes`).
        detail: String,
    },
    /// An argument this module refuses before calling the driver (a range
    /// outside the allocation, a device that does not exist).
    Invalid(String),
}

impl CudaError {
    /// Whether this is the driver's `CUDA_ERROR_OUT_OF_MEMORY` (2): the
    /// device has not that much free memory.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, CudaError::Call { code: 2, .. })
    }
}

impl std::fmt::Display for CudaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CudaError::Load { message } => write!(
                f,
                "cannot use the CUDA driver ({LIBCUDA}): {message}; GPU memory needs an NVIDIA GPU and its driver"
            ),
            CudaError::Call {
                call,
                code,
                name,
                detail,
            } => {
                let name = name.as_deref().unwrap_or("unknown CUresult");
                write!(f, "{call} failed: {name} ({code})")?;
                if !detail.is_empty() {
                    write!(f, " [{detail}]")?;
                }
                Ok(())
            }
            CudaError::Invalid(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for CudaError {}

/// The loaded CUDA driver. Obtain it with [`Cuda::get`].
pub struct Cuda {
    /// nixl-sys's table of the driver's entry points (loaded once, never
    /// unloaded).
    fns: &'static Driver,
    devices: c_int,
    /// Retained primary contexts, by device ordinal (never released: the
    /// process keeps using them until it exits).
    contexts: Mutex<HashMap<c_int, usize>>,
}

static CUDA: OnceLock<Result<Cuda, CudaError>> = OnceLock::new();

/// The free and total memory of one device, as `cuMemGetInfo` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemInfo {
    /// Bytes free.
    pub free: u64,
    /// Bytes in all.
    pub total: u64,
}

impl Cuda {
    /// Loads the driver and initialises it once per process (later calls
    /// return the same result).
    pub fn get() -> Result<&'static Cuda, CudaError> {
        CUDA.get_or_init(Self::load).as_ref().map_err(Clone::clone)
    }

    fn load() -> Result<Cuda, CudaError> {
        let fns = Driver::get().map_err(|message| CudaError::Load { message })?;
        let mut cuda = Cuda {
            fns,
            devices: 0,
            contexts: Mutex::default(),
        };
        // SAFETY: `cuInit` takes only its flags argument, which must be 0.
        cuda.check("cuInit", String::new(), unsafe { (cuda.fns.init)(0) })?;
        let mut n: c_int = 0;
        // SAFETY: the driver is initialised (above); `n` is a valid
        // out-pointer for the count.
        cuda.check("cuDeviceGetCount", String::new(), unsafe {
            (cuda.fns.device_get_count)(&mut n)
        })?;
        cuda.devices = n;
        Ok(cuda)
    }

    /// How many CUDA devices the driver sees.
    pub fn device_count(&self) -> i32 {
        self.devices
    }

    fn check(&self, call: &'static str, detail: String, code: CuResult) -> Result<(), CudaError> {
        if code == CUDA_SUCCESS {
            return Ok(());
        }
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: `p` is a valid out-pointer; on success the driver sets it
        // to a static NUL-terminated string (checked non-null before it is
        // read), copied out at once.
        let name = unsafe {
            if (self.fns.get_error_name)(code, &mut p) == CUDA_SUCCESS && !p.is_null() {
                Some(CStr::from_ptr(p).to_string_lossy().into_owned())
            } else {
                None
            }
        };
        Err(CudaError::Call {
            call,
            code,
            name,
            detail,
        })
    }

    /// Makes `device`'s primary context current on this thread (retaining
    /// it the first time).
    fn enter(&self, device: i32) -> Result<(), CudaError> {
        if device < 0 || device >= self.devices {
            return Err(CudaError::Invalid(format!(
                "CUDA device {device} does not exist ({} device(s) seen)",
                self.devices
            )));
        }
        let ctx = {
            let mut contexts = self.contexts.lock().unwrap_or_else(PoisonError::into_inner);
            match contexts.get(&device) {
                Some(c) => *c as CuContext,
                None => {
                    let mut dev: CuDevice = 0;
                    let detail = || format!("device {device}");
                    // SAFETY: `dev` is a valid out-pointer; `device` is in
                    // `0..self.devices` (checked above), the ordinals the
                    // initialised driver counted.
                    self.check("cuDeviceGet", detail(), unsafe {
                        (self.fns.device_get)(&mut dev, device)
                    })?;
                    let mut ctx: CuContext = std::ptr::null_mut();
                    // SAFETY: `ctx` is a valid out-pointer and `dev` the
                    // device `cuDeviceGet` just returned.
                    self.check("cuDevicePrimaryCtxRetain", detail(), unsafe {
                        (self.fns.primary_ctx_retain)(&mut ctx, dev)
                    })?;
                    contexts.insert(device, ctx as usize);
                    ctx
                }
            }
        };
        // SAFETY: `ctx` is a primary context retained above (or earlier, in
        // `contexts`) and never released, so it is still valid.
        self.check("cuCtxSetCurrent", format!("device {device}"), unsafe {
            (self.fns.ctx_set_current)(ctx)
        })
    }

    /// Makes `device`'s primary context current on the calling thread.
    ///
    /// For threads that call NIXL on device memory without touching CUDA
    /// themselves: UCX's CUDA transports ask the driver for the current
    /// context on the calling thread (its debug log on an H200 showed
    /// `cuCtxGetDevice ... invalid device context` on such threads), as a
    /// framework's threads would have one through its CUDA runtime.
    pub fn make_current(&self, device: i32) -> Result<(), CudaError> {
        self.enter(device)
    }

    /// `device`'s free and total memory (`cuMemGetInfo`, in its primary
    /// context: the first call on a device creates that context, which
    /// itself takes some device memory).
    pub fn mem_info(&self, device: i32) -> Result<MemInfo, CudaError> {
        self.enter(device)?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: `free` and `total` are valid out-pointers; `enter` made
        // the device's primary context current on this thread.
        self.check("cuMemGetInfo_v2", format!("device {device}"), unsafe {
            (self.fns.mem_get_info)(&mut free, &mut total)
        })?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }
}

/// Device memory allocated with `cuMemAlloc` on one device, freed on drop.
pub struct DeviceMemory {
    cuda: &'static Cuda,
    device: i32,
    ptr: CuDevicePtr,
    len: usize,
}

impl std::fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMemory")
            .field("device", &self.device)
            .field("addr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl DeviceMemory {
    /// Allocates `len` bytes (at least 1) on `device`. Its contents are
    /// undefined until written.
    pub fn alloc(device: i32, len: usize) -> Result<DeviceMemory, CudaError> {
        let cuda = Cuda::get()?;
        cuda.enter(device)?;
        let len = len.max(1);
        let mut ptr: CuDevicePtr = 0;
        cuda.check(
            "cuMemAlloc_v2",
            format!("device {device}, {len} bytes"),
            // SAFETY: `ptr` is a valid out-pointer and `len` is at least 1;
            // `enter` made the device's primary context current on this
            // thread. The allocation is freed once, by `drop`.
            unsafe { (cuda.fns.mem_alloc)(&mut ptr, len) },
        )?;
        Ok(DeviceMemory {
            cuda,
            device,
            ptr,
            len,
        })
    }

    /// The device ordinal.
    pub fn device(&self) -> i32 {
        self.device
    }

    /// The device address of the first byte.
    pub fn addr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (an allocation has at least one byte).
    pub fn is_empty(&self) -> bool {
        false
    }

    fn range(&self, offset: usize, len: usize) -> Result<CuDevicePtr, CudaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.ptr + offset as u64),
            _ => Err(CudaError::Invalid(format!(
                "range {offset}+{len} is outside the {}-byte allocation",
                self.len
            ))),
        }
    }

    /// Sets `len` bytes at `offset` to `byte`, and waits for it.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<(), CudaError> {
        let at = self.range(offset, len)?;
        self.cuda.enter(self.device)?;
        let detail = || format!("device {}, {len} bytes at +{offset}", self.device);
        // SAFETY: `at..at + len` is inside our live allocation (`range`);
        // `enter` made its device's primary context current.
        self.cuda.check("cuMemsetD8_v2", detail(), unsafe {
            (self.cuda.fns.memset_d8)(at, byte, len)
        })?;
        // SAFETY: `enter` made the device's primary context current; the
        // call takes no pointers.
        self.cuda.check("cuCtxSynchronize", detail(), unsafe {
            (self.cuda.fns.ctx_synchronize)()
        })
    }

    /// Copies `src` to `offset` (synchronous).
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), CudaError> {
        let at = self.range(offset, src.len())?;
        self.cuda.enter(self.device)?;
        self.cuda.check(
            "cuMemcpyHtoD_v2",
            format!("device {}, {} bytes at +{offset}", self.device, src.len()),
            // SAFETY: `at..at + src.len()` is inside our live allocation
            // (`range`); `src` is valid for reads of its length during the
            // (synchronous) copy; `enter` made the context current.
            unsafe { (self.cuda.fns.memcpy_htod)(at, src.as_ptr().cast(), src.len()) },
        )
    }

    /// Copies `dst.len()` bytes from `offset` into `dst` (synchronous: it
    /// waits for work on the device that writes them, e.g. a transfer that
    /// completed).
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), CudaError> {
        let at = self.range(offset, dst.len())?;
        self.cuda.enter(self.device)?;
        self.cuda.check(
            "cuMemcpyDtoH_v2",
            format!("device {}, {} bytes at +{offset}", self.device, dst.len()),
            // SAFETY: `at..at + dst.len()` is inside our live allocation
            // (`range`); `dst` is an exclusive borrow, valid for writes of
            // its length during the (synchronous) copy; `enter` made the
            // context current.
            unsafe { (self.cuda.fns.memcpy_dtoh)(dst.as_mut_ptr().cast(), at, dst.len()) },
        )
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if self.cuda.enter(self.device).is_ok() {
            // SAFETY: `self.ptr` was allocated by `alloc` in this device's
            // primary context (current again, via `enter`) and is freed
            // once, here. A `VramRegistration` drops its NIXL registration
            // before this memory (field order).
            unsafe { (self.cuda.fns.mem_free)(self.ptr) };
        }
    }
}

/// Device memory registered with an agent as NIXL `VRAM_SEG` memory.
/// Deregistered, then freed, on drop.
pub struct VramRegistration {
    // Field order: the registration goes before the memory it describes.
    reg: Registered,
    memory: DeviceMemory,
}

impl std::fmt::Debug for VramRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VramRegistration")
            .field("memory", &self.memory)
            .finish_non_exhaustive()
    }
}

impl VramRegistration {
    /// The descriptor of the whole region (its device id is the device
    /// ordinal).
    pub fn desc(&self) -> crate::Desc {
        self.sub_desc(0, self.memory.len)
    }

    /// The descriptor of `len` bytes at `offset` (panics if out of range).
    pub fn sub_desc(&self, offset: usize, len: usize) -> crate::Desc {
        assert!(
            offset
                .checked_add(len)
                .is_some_and(|end| end <= self.memory.len),
            "range out of bounds"
        );
        crate::Desc {
            addr: self.memory.ptr + offset as u64,
            len,
            dev_id: self.memory.device as u64,
        }
    }

    /// The memory.
    pub fn memory(&self) -> &DeviceMemory {
        &self.memory
    }

    /// The agent it is registered with.
    pub fn agent_name(&self) -> &str {
        self.reg.agent_name()
    }
}

impl Agent {
    /// Registers `memory` with this agent as `VRAM_SEG` memory of its
    /// device. Transfers over it use [`MemType::Vram`] dlists
    /// ([`Agent::prep_local_dlist_in`], [`Agent::prep_remote_dlist_in`]).
    pub fn register_vram(&self, memory: DeviceMemory) -> Result<VramRegistration, NixlError> {
        let reg = self.register_region(
            MemType::Vram,
            memory.ptr as usize,
            memory.len,
            memory.device as u64,
        )?;
        Ok(VramRegistration { reg, memory })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_library_and_the_call() {
        let e = CudaError::Load {
            message: "libcuda.so.1: cannot open shared object file".into(),
        };
        let text = e.to_string();
        assert!(text.contains(LIBCUDA), "{text}");
        assert!(text.contains("NVIDIA GPU"), "{text}");
        let oom = CudaError::Call {
            call: "cuMemAlloc_v2",
            code: 2,
            name: Some("CUDA_ERROR_OUT_OF_MEMORY".into()),
            detail: "device 0, 1 bytes".into(),
        };
        assert!(oom.is_out_of_memory());
        assert_eq!(
            oom.to_string(),
            "cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY (2) [device 0, 1 bytes]"
        );
    }

    #[test]
    fn without_a_driver_the_error_says_so() {
        // Where a driver and a GPU exist this allocates a byte; elsewhere
        // it must fail with the load error (never panic).
        match DeviceMemory::alloc(0, 1) {
            Ok(m) => assert_eq!(m.len(), 1),
            Err(CudaError::Load { .. }) | Err(CudaError::Call { .. }) => {}
            Err(CudaError::Invalid(m)) => assert!(m.contains("does not exist"), "{m}"),
        }
    }
}

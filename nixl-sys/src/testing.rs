//! Test support shared by every test that needs the real NIXL runtime.

use std::io::Write;

use crate::runtime::Runtime;

/// The environment variable that turns a missing runtime into a failure.
pub const REQUIRE_REAL_ENV: &str = "NIXL_KEEPALIVE_REQUIRE_REAL";

/// The loaded runtime, or `None` after printing a loud `SKIPPED: <reason>`
/// to stderr. With `NIXL_KEEPALIVE_REQUIRE_REAL=1` a missing runtime panics
/// instead, so CI cannot pass by skipping.
///
/// ```no_run
/// let Some(rt) = nixl_sys::testing::runtime_or_skip() else { return };
/// ```
pub fn runtime_or_skip() -> Option<&'static Runtime> {
    match Runtime::get() {
        Ok(rt) => Some(rt),
        Err(e) => {
            let test = std::thread::current()
                .name()
                .unwrap_or("<unnamed>")
                .to_string();
            if std::env::var(REQUIRE_REAL_ENV).is_ok_and(|v| v == "1") {
                panic!("{REQUIRE_REAL_ENV}=1 but the NIXL runtime is missing ({test}): {e}");
            }
            // Straight to the stderr handle, not eprintln!: libtest captures
            // the print macros of passing tests, and a skip must be seen.
            let _ = writeln!(std::io::stderr(), "SKIPPED: {test}: {e}");
            None
        }
    }
}

/// Where build.rs put the GPU-mapping tests' fakes (`tests/fake_cuda/`): a
/// fake CUDA driver named `libcuda.so.1` and a fake `libnvidia-ml.so.1`,
/// with every symbol UCX's `libuct_cuda` imports. With this folder on a
/// process's `LD_LIBRARY_PATH`, the real UCX loads its CUDA transport
/// (which finds no device): enough to check what binds to what, no GPU.
pub const FAKE_CUDA_DIR: &str = concat!(env!("OUT_DIR"), "/fake-cuda");

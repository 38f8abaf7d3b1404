//! Test support shared by every test that needs the real NIXL runtime.
//!
//! Whether a real test runs is decided when it is compiled: build.rs
//! searches for the runtime where [`Runtime::get`](crate::Runtime::get) will (`src/locate.rs`)
//! and sets cfg `nixl_runtime` when it is there (nixl-agent's and the
//! CLI's build scripts forward it). Every real test carries
//!
//! ```text
//! #[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
//! ```
//!
//! so that without the runtime cargo prints it `ignored`, never `ok`. What
//! cargo cannot ignore on its own, a run that must not pass without the
//! runtime (CI), each real test binary checks in one test that calls
//! [`fail_when_required_and_missing`](crate::testing::fail_when_required_and_missing).

use crate::runtime::Runtime;

/// The environment variable that turns a missing runtime into a failure.
pub const REQUIRE_REAL_ENV: &str = "NIXL_KEEPALIVE_REQUIRE_REAL";

/// Whether this build found the runtime (cfg `nixl_runtime`): when it did
/// not, the real tests were compiled ignored.
pub const BUILT_WITH_RUNTIME: bool = cfg!(nixl_runtime);

/// The loaded runtime, for a real test that runs. A test runs only when
/// the build found the runtime, or when it was asked for by name with
/// `--ignored`/`--include-ignored`: a runtime that does not load then is a
/// failure, with the loader's reason, never a test that passes without
/// running.
///
/// ```no_run
/// let rt = nixl_sys::testing::real_runtime();
/// ```
pub fn real_runtime() -> &'static Runtime {
    match Runtime::get() {
        Ok(rt) => rt,
        Err(e) if BUILT_WITH_RUNTIME => {
            panic!("the build found the NIXL runtime, but it does not load: {e}")
        }
        Err(e) => panic!(
            "this real test runs without the NIXL runtime (the build did not find it, so \
             it is ignored unless run with --ignored): {e}"
        ),
    }
}

/// Fails when [`REQUIRE_REAL_ENV`] is `1` and this binary's real tests
/// were compiled ignored (the build did not find the runtime) or the
/// runtime does not load: an ignored test passes a run, and a run that
/// requires the real runtime (CI) must not pass without it. Each real test
/// binary calls it from one test of its own, which is never ignored.
pub fn fail_when_required_and_missing() {
    if std::env::var(REQUIRE_REAL_ENV).as_deref() != Ok("1") {
        return;
    }
    if !BUILT_WITH_RUNTIME {
        let why = Runtime::get()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_else(|| {
                "it loads now: it was installed after the build (touch nixl-sys/build.rs)".into()
            });
        panic!(
            "{REQUIRE_REAL_ENV}=1, but the NIXL runtime was missing when these tests were \
             built, so every real test in this binary is ignored: {why}"
        );
    }
    if let Err(e) = Runtime::get() {
        panic!("{REQUIRE_REAL_ENV}=1, but the NIXL runtime does not load: {e}");
    }
}

/// Where build.rs put the GPU-mapping tests' fakes (`tests/fake_cuda/`): a
/// fake CUDA driver named `libcuda.so.1` and a fake `libnvidia-ml.so.1`,
/// with every symbol UCX's `libuct_cuda` imports. With this folder on a
/// process's `LD_LIBRARY_PATH`, the real UCX loads its CUDA transport
/// (which finds no device): enough to check what binds to what, no GPU.
pub const FAKE_CUDA_DIR: &str = concat!(env!("OUT_DIR"), "/fake-cuda");

#[cfg(test)]
mod tests {
    /// This crate's real tests (the layout check in `runtime.rs`) are
    /// ignored without the runtime: a run that requires it fails here.
    #[test]
    fn the_real_runtime_is_there_when_required() {
        super::fail_when_required_and_missing();
    }
}

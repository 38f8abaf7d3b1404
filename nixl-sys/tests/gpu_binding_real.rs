//! The GPU-mapping ledger's binding, checked against the NIXL wheel's own
//! UCX: its `libuct_cuda` (loaded against the fake CUDA driver and NVML of
//! tests/fake_cuda/, no GPU needed) and its `libucp` must call the ledger
//! for every symbol it interposes, through their relocations, when the
//! interposer is loaded first, as nixl-sys loads it.

#![allow(clippy::undocumented_unsafe_blocks)]

use std::io::Write;
use std::path::PathBuf;

use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
use nixl_sys::endpoints::EpClose;
use nixl_sys::gpu::{
    Binding, GpuUnmapMode, UCP_FILE, UCP_SYMBOLS, UCT_CUDA_FILE, UCT_CUDA_SYMBOLS,
};

/// The wheel's UCX folder, or `None` after a loud SKIPPED (a failure under
/// NIXL_KEEPALIVE_REQUIRE_REAL=1).
fn wheel_ucx() -> Option<PathBuf> {
    let root = std::env::var_os(nixl_sys::PREFIX_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(nixl_sys::DEFAULT_RUNTIME_DIR));
    let dir = root.join("nixl_cu12.libs");
    if dir.join("ucx").is_dir() {
        return Some(dir);
    }
    let why = format!("no NIXL runtime with UCX at {}", dir.display());
    if std::env::var(nixl_sys::testing::REQUIRE_REAL_ENV).is_ok_and(|v| v == "1") {
        panic!("{}=1 but {why}", nixl_sys::testing::REQUIRE_REAL_ENV);
    }
    let _ = writeln!(std::io::stderr(), "SKIPPED: gpu_binding_real: {why}");
    None
}

fn one(dir: &std::path::Path, prefix: &str) -> PathBuf {
    std::fs::read_dir(dir)
        .expect("readable")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with(prefix) && name.contains(".so")
        })
        .unwrap_or_else(|| panic!("no {prefix}*.so in {}", dir.display()))
}

#[test]
fn the_wheels_libuct_cuda_and_libucp_call_the_ledger() {
    let Some(libs) = wheel_ucx() else { return };
    let process = EpClose::process().expect("the interposer loads");
    let hooks = process.gpu().expect("the ledger is in the interposer");
    let fakes = PathBuf::from(env!("OUT_DIR")).join("fake-cuda");
    let _driver = unsafe { Library::open(Some(fakes.join("libcuda.so.1")), RTLD_NOW | RTLD_LOCAL) }
        .expect("fake driver");
    let _nvml =
        unsafe { Library::open(Some(fakes.join("libnvidia-ml.so.1")), RTLD_NOW | RTLD_LOCAL) }
            .expect("fake NVML");
    assert_eq!(
        hooks.binding(UCT_CUDA_FILE, true, UCT_CUDA_SYMBOLS[0]),
        Some(Binding::NotLoaded)
    );
    // As UCX loads its modules: local scope, after the interposer.
    let uct_cuda = one(&libs.join("ucx"), "libuct_cuda.so");
    let _cuda = unsafe { Library::open(Some(&uct_cuda), RTLD_NOW | RTLD_LOCAL) }
        .unwrap_or_else(|e| panic!("loading {}: {e}", uct_cuda.display()));
    let ucp = one(&libs, "libucp-");
    let _ucp = unsafe { Library::open(Some(&ucp), RTLD_NOW | RTLD_LOCAL) }
        .unwrap_or_else(|e| panic!("loading {}: {e}", ucp.display()));
    for symbol in UCT_CUDA_SYMBOLS
        .iter()
        .chain(&["cuMemImportFromShareableHandle"])
    {
        assert_eq!(
            hooks.binding(UCT_CUDA_FILE, true, symbol),
            Some(Binding::Here),
            "{} binds {symbol} elsewhere",
            uct_cuda.display()
        );
    }
    for symbol in UCP_SYMBOLS.iter().chain(&["uct_rkey_unpack"]) {
        assert_eq!(
            hooks.binding(UCP_FILE, true, symbol),
            Some(Binding::Here),
            "{} binds {symbol} elsewhere",
            ucp.display()
        );
    }
    assert_eq!(hooks.check(), GpuUnmapMode::Unmapping);
}

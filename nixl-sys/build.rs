//! Compiles the C++ shim and the endpoint-close interposer, records where
//! the NIXL runtime is expected, and whether it is there (for the real
//! tests: `record_runtime`).
//!
//! Nothing here needs NIXL or UCX: the shim declares its own opaque types
//! and receives member-function addresses at run time, and the interposer
//! declares the two UCX constants it uses, so the crate builds on a machine
//! without either.

use std::env;
use std::path::{Path, PathBuf};

#[path = "src/locate.rs"]
mod locate;

fn main() {
    println!("cargo:rerun-if-changed=shim/nixl_shim.cpp");
    println!("cargo:rerun-if-changed=shim/ep_close.c");
    println!("cargo:rerun-if-changed=shim/ep_watch.c");
    println!("cargo:rerun-if-changed=shim/gpu_map.c");
    println!("cargo:rerun-if-changed=tests/fake_cuda");
    println!("cargo:rerun-if-changed=shim/interpose.h");
    println!("cargo:rerun-if-env-changed=NIXL_PREFIX");

    cc::Build::new()
        .cpp(true)
        .file("shim/nixl_shim.cpp")
        .std("c++20")
        // libnixl.so uses the cxx11 std::string ABI; the shim must match.
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .flag_if_supported("-fno-strict-aliasing")
        .warnings(true)
        .extra_warnings(true)
        .compile("nixl_keepalive_shim");

    build_ep_close_interposer();
    build_fake_cuda();

    // Default runtime location baked into the binary: NIXL_PREFIX at build
    // time if set, else `<workspace root>/.nixl-runtime`, where
    // scripts/install-nixl.sh puts the wheel's libraries. NIXL_PREFIX at run
    // time still wins.
    let default = match env::var_os("NIXL_PREFIX") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => {
            let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
            let root = manifest.parent().map(PathBuf::from).unwrap_or(manifest);
            root.join(".nixl-runtime")
        }
    };
    println!(
        "cargo:rustc-env=NIXL_SYS_DEFAULT_RUNTIME={}",
        default.display()
    );
    record_runtime(&default);
}

/// Whether the runtime is where `Runtime::get` will look when the tests run
/// (this location, NIXL_PREFIX being the same variable then, and the same
/// search, `src/locate.rs`): cfg `nixl_runtime` here, and metadata
/// `runtime` = `found` or `missing` (`DEP_NIXL_KEEPALIVE_SHIM_RUNTIME`) for
/// the crates that depend on this one directly (nixl-agent, the CLI),
/// whose build scripts turn it into the same cfg. The workspace's real
/// tests are `#[cfg_attr(not(nixl_runtime), ignore = ...)]`: without the
/// runtime cargo reports them ignored, not "ok". Nothing is downloaded.
fn record_runtime(location: &Path) {
    println!("cargo:rustc-check-cfg=cfg(nixl_runtime)");
    match locate::find_lib_dir(location) {
        Ok(dir) => {
            // Removing the libraries runs this again, and the tests are
            // ignored again.
            for lib in ["libnixl.so", "libnixl_capi.so"] {
                println!("cargo:rerun-if-changed={}", dir.join(lib).display());
            }
            println!("cargo:rustc-cfg=nixl_runtime");
            println!("cargo:runtime=found");
        }
        // Nothing to watch for an install that does not exist yet: a path
        // that is missing makes cargo run this script, and rebuild every
        // crate above it, on every build. scripts/install-nixl.sh touches
        // this file instead once it has installed a runtime.
        Err(_) => println!("cargo:runtime=missing"),
    }
}

/// Builds `shim/ep_close.c` and `shim/ep_watch.c` as one shared object in
/// OUT_DIR; `endpoints.rs` embeds it and loads it (RTLD_GLOBAL, from a
/// memfd) before libnixl, so that NIXL's UCX plugin binds its
/// `ucp_ep_close_nbx` and `ucp_ep_create` there.
fn build_ep_close_interposer() {
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets it"));
    let so = out.join("libnixl_sys_ep_close.so");
    let compiler = cc::Build::new().cargo_metadata(false).get_compiler();
    let status = compiler
        .to_command()
        .args([
            "-shared",
            "-fPIC",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-fvisibility=hidden",
            "-o",
        ])
        .arg(&so)
        .arg("shim/ep_close.c")
        .arg("shim/ep_watch.c")
        .arg("shim/gpu_map.c")
        .args(["-ldl", "-lpthread"])
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler ({:?}): {e}", compiler.path()));
    assert!(
        status.success(),
        "building shim/ep_close.c and shim/ep_watch.c as a shared object failed ({status})"
    );
}

/// Builds the GPU-mapping tests' fakes (tests/fake_cuda/) into
/// OUT_DIR/fake-cuda: a fake CUDA driver named `libcuda.so.1`, a fake
/// NVML, a fake libuct and a library that behaves as UCX's cuda_ipc cache
/// and calls the others through its relocations, as libuct_cuda does.
/// Small C files, built in well under a second; no test needs a GPU.
fn build_fake_cuda() {
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets it")).join("fake-cuda");
    std::fs::create_dir_all(&out).expect("create OUT_DIR/fake-cuda");
    let compiler = cc::Build::new().cargo_metadata(false).get_compiler();
    let build = |name: &str, source: &str, extra: &[&str]| {
        let status = compiler
            .to_command()
            .args(["-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror"])
            .args(["-fvisibility=hidden", &format!("-Wl,-soname,{name}"), "-o"])
            .arg(out.join(name))
            .arg(format!("tests/fake_cuda/{source}"))
            .args(extra)
            .status()
            .unwrap_or_else(|e| panic!("cannot run the C compiler ({:?}): {e}", compiler.path()));
        assert!(
            status.success(),
            "building tests/fake_cuda/{source} failed ({status})"
        );
    };
    let dir = format!("-L{}", out.display());
    build("libcuda.so.1", "fake_driver.c", &["-lpthread"]);
    build("libnvidia-ml.so.1", "fake_nvml.c", &[]);
    build("libfake_uct.so", "fake_uct.c", &[]);
    build(
        "libfake_uct_cuda.so",
        "fake_uct_cuda.c",
        &[
            &dir,
            "-l:libcuda.so.1",
            "-l:libfake_uct.so",
            "-Wl,-rpath,$ORIGIN",
            "-lpthread",
        ],
    );
}

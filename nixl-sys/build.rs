//! Compiles the C++ shim and records where the NIXL runtime is expected.
//!
//! Nothing here needs NIXL: the shim declares its own opaque types and
//! receives member-function addresses at run time, so the crate builds on
//! a machine without NIXL.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=shim/nixl_shim.cpp");
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
}

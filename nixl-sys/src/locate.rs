//! Where a NIXL runtime's libraries are under a runtime location: the one
//! search that both the loader ([`crate::Runtime::get`]) and the build
//! script use. The build script includes this file (`#[path]`) to tell the
//! workspace's real tests whether they can run (cfg `nixl_runtime`), so
//! "found" means the same thing when a test is compiled as when it loads
//! the runtime. Only `std` here: build.rs compiles it without the crate.

use std::path::{Path, PathBuf};

/// Candidate library folders under a runtime location, in search order:
/// an unpacked `nixl_cu12` wheel (what `scripts/install-nixl.sh` installs),
/// then the usual prefixes, then the folder itself.
fn lib_dir_candidates(location: &Path) -> Vec<PathBuf> {
    vec![
        location.join(".nixl_cu12.mesonpy.libs"),
        location.join("lib"),
        location.join("lib64"),
        location.join("lib/x86_64-linux-gnu"),
        location.to_path_buf(),
    ]
}

/// The first candidate folder holding both `libnixl.so` and
/// `libnixl_capi.so`, or every `libnixl.so` path tried.
pub(crate) fn find_lib_dir(location: &Path) -> Result<PathBuf, Vec<PathBuf>> {
    let mut tried = Vec::new();
    for dir in lib_dir_candidates(location) {
        let nixl = dir.join("libnixl.so");
        let capi = dir.join("libnixl_capi.so");
        if nixl.is_file() && capi.is_file() {
            return Ok(dir);
        }
        tried.push(nixl);
    }
    Err(tried)
}

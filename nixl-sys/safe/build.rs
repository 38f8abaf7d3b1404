//! Turns nixl-sys's answer to "is the NIXL runtime there?" (its build
//! script's `runtime` metadata, the one search the loader uses) into cfg
//! `nixl_runtime`, so that this crate's real tests are ignored without the
//! runtime, in cargo's own words, instead of passing without running.
fn main() {
    println!("cargo:rustc-check-cfg=cfg(nixl_runtime)");
    if std::env::var("DEP_NIXL_KEEPALIVE_SHIM_RUNTIME").as_deref() == Ok("found") {
        println!("cargo:rustc-cfg=nixl_runtime");
    }
}

//! A decoder runtime that depends on `nixl-keepalive` with its default
//! features gets the service, the transport trait and `NixlTransport`:
//! not tokio's `test-util` (it would let a paused clock into production),
//! not the CLI's dependencies, not the fake. Checked on the dependency
//! graph cargo resolves for the library alone. And the production
//! `nixl-keepalive` binary (`nixl-keepalive-cli` without its default
//! `demo` feature) links neither test-util nor the fake.

use std::process::Command;

fn tree(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO"))
        .args(["tree", "--offline", "--locked", "-p", "nixl-keepalive"])
        .args(["-e", "normal,features", "--prefix", "none"])
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_default_features_pull_neither_tokio_test_util_nor_the_cli_nor_the_fake() {
    let all = tree(&[]);
    for absent in [
        "tokio feature \"test-util\"",
        "clap",
        "axum",
        "hyper",
        "serde_json",
        "tracing-subscriber",
        "metrics-exporter-prometheus",
    ] {
        assert!(
            !all.contains(absent),
            "{absent} is in the default graph:\n{all}"
        );
    }
    let own = tree(&["-i", "nixl-keepalive"]);
    assert!(own.contains("nixl-keepalive feature \"default\""), "{own}");
    assert!(!own.contains("nixl-keepalive feature \"fake\""), "{own}");
    // The check itself sees what it looks for: the graph is there.
    for present in [
        "tokio feature \"time\"",
        "governor",
        "nixl-agent",
        "nixl-sys",
        "ucx-sys",
    ] {
        assert!(all.contains(present), "{present} missing from:\n{all}");
    }
}

/// Which features of `krate` the `nixl-keepalive-cli` build with `flags`
/// turns on, and what turns each on (normal edges: what the binary links,
/// not what its tests do).
fn cli_features(flags: &[&str], krate: &str) -> String {
    let out = Command::new(env!("CARGO"))
        .args(["tree", "--offline", "--locked", "-p", "nixl-keepalive-cli"])
        .args(flags)
        .args(["-e", "normal,features", "--prefix", "none", "-i", krate])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_production_binary_links_neither_tokio_test_util_nor_the_fake() {
    // The production build: no default features (the demo), membership
    // over etcd or not.
    for flags in [
        &["--no-default-features"][..],
        &["--no-default-features", "--features", "etcd"][..],
    ] {
        let tokio = cli_features(flags, "tokio");
        assert!(
            !tokio.contains("tokio feature \"test-util\""),
            "{flags:?}: test-util is linked:\n{tokio}"
        );
        assert!(
            tokio.contains("tokio feature \"rt-multi-thread\""),
            "{tokio}"
        );
        let lib = cli_features(flags, "nixl-keepalive");
        assert!(
            !lib.contains("nixl-keepalive feature \"fake\""),
            "{flags:?}: the fake is linked:\n{lib}"
        );
        assert!(
            lib.contains("nixl-keepalive feature \"membership\""),
            "{lib}"
        );
    }
    // The check sees what it looks for: the default build (the demo, so
    // that `cargo run --release -- demo` works on a fresh machine) has
    // both, through the `demo` feature alone.
    let tokio = cli_features(&[], "tokio");
    assert!(tokio.contains("tokio feature \"test-util\""), "{tokio}");
    assert!(
        tokio.contains("nixl-keepalive-cli feature \"demo\""),
        "{tokio}"
    );
    let lib = cli_features(&[], "nixl-keepalive");
    assert!(lib.contains("nixl-keepalive feature \"fake\""), "{lib}");
}

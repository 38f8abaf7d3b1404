//! A decoder runtime that depends on `nixl-keepalive` with its default
//! features gets the service, the transport trait and `NixlTransport`:
//! not tokio's `test-util` (it would let a paused clock into production),
//! not the CLI's dependencies, not the fake. Checked on the dependency
//! graph cargo resolves for the library alone.

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
    for present in ["tokio feature \"time\"", "governor", "nixl-sys", "ucx-sys"] {
        assert!(all.contains(present), "{present} missing from:\n{all}");
    }
}

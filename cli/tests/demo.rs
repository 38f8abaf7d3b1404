//! The demo (the README's first command) on the fake UCX, pull and push:
//! its own checks (every incident released within its bound or kept as
//! it must be, nothing leaked, no release under a transfer) pass, and the
//! push scenario really writes.

use std::process::Command;

fn demo(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_nixl-keepalive"))
        .arg("demo")
        .args(args)
        .output()
        .expect("run the demo");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "demo {args:?} failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn summary(stdout: &str) -> &str {
    stdout
        .lines()
        .find(|l| l.starts_with("summary: "))
        .unwrap_or_else(|| panic!("no summary line in {stdout}"))
}

#[test]
fn the_push_scenario_writes_into_decodes_and_passes_the_same_checks() {
    let stdout = demo(&["--push", "--duration", "3m"]);
    assert!(stdout.contains("push mode"), "{stdout}");
    let writes = stdout
        .lines()
        .find(|l| l.starts_with("writes (push mode): "))
        .unwrap_or_else(|| panic!("no writes line in {stdout}"));
    let ok: u64 = writes
        .trim_start_matches("writes (push mode): ")
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count in {writes:?}"));
    assert!(ok > 100, "{writes}");
    let summary = summary(&stdout);
    assert!(summary.contains("leaked=0 violations=0"), "{summary}");
    assert!(!summary.contains("released=0"), "{summary}");
}

#[test]
fn the_pull_scenario_still_reads() {
    let stdout = demo(&["--duration", "3m"]);
    assert!(stdout.lines().any(|l| l.starts_with("reads: ")), "{stdout}");
    assert!(summary(&stdout).contains("leaked=0 violations=0"));
}

//! An operator's bad environment: the commands stop before anything
//! starts, exit 2, and list every refused value at once (the variable, the
//! value, why, and what is accepted), not one per start.

use std::process::Command;

fn run(sub: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nixl-keepalive"));
    cmd.args(sub);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run nixl-keepalive");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const BAD: &[(&str, &str)] = &[
    ("NIXL_KEEPALIVE_INTERVAL", "100000000s"),
    ("NIXL_KEEPALIVE_EVENT_CAPACITY", "4294967295"),
    ("NIXL_KEEPALIVE_METRICS_PERIOD", "1ns"),
];

#[test]
fn every_bad_value_is_listed_in_one_error_and_nothing_starts() {
    for sub in [&["demo"][..], &["decode", "--prefill", "127.0.0.1:9"][..]] {
        let (code, stderr) = run(sub, BAD);
        assert_eq!(code, Some(2), "{sub:?}: {stderr}");
        assert!(
            stderr.contains("3 configuration values are not accepted"),
            "{sub:?}: {stderr}"
        );
        for (var, value) in BAD {
            let line = stderr
                .lines()
                .find(|l| l.contains(var))
                .unwrap_or_else(|| panic!("{sub:?}: {var} not listed: {stderr}"));
            assert!(line.contains(value), "{line}");
            assert!(line.contains("expected"), "{line}");
        }
        // The bounds are in the message.
        assert!(stderr.contains("86400s"), "{stderr}");
        assert!(stderr.contains("1048576"), "{stderr}");
        assert!(stderr.contains("10ms"), "{stderr}");
    }
}

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

#[test]
fn a_prefill_host_whose_engines_would_pass_port_65535_or_number_none_stops_with_the_rule() {
    // Engine k listens on the port + k: 65530 + 9 is past the last port.
    let (code, stderr) = run(
        &["prefill", "--listen", "127.0.0.1:65530", "--engines", "10"],
        &[],
    );
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("past port 65535"), "{stderr}");
    assert!(stderr.contains("port 0"), "what is accepted: {stderr}");
    for engines in ["0", "1025"] {
        let (code, stderr) = run(
            &["prefill", "--listen", "127.0.0.1:0", "--engines", engines],
            &[],
        );
        assert_eq!(code, Some(2), "--engines {engines}: {stderr}");
        assert!(stderr.contains("1..=1024"), "--engines {engines}: {stderr}");
    }
}

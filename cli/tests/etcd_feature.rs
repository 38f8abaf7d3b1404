//! The real etcd membership tests (`real_membership.rs`) exist only with
//! the CLI's `etcd` feature (its build needs `protoc`). Built without it,
//! this says so loudly, and fails where the real tests must run (CI).

#[cfg(not(feature = "etcd"))]
#[test]
fn the_real_etcd_membership_tests_need_the_etcd_feature() {
    let text = "SKIPPED: the real etcd membership tests: built without the CLI's `etcd` feature \
                (bash scripts/test.sh turns it on)";
    eprintln!("{text}");
    let required = std::env::var("NIXL_KEEPALIVE_REQUIRE_REAL").as_deref() == Ok("1")
        || std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false");
    assert!(!required, "{text}, and this run requires them");
}

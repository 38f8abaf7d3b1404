//! The UCX time parser's invariants on one input, through its public API
//! only: shared by the fuzz target (`fuzz_targets/ucx_time.rs`) and the
//! test that replays the corpus (`tests/fuzz_corpus.rs`), each of which
//! includes this file as a module of its own.

use nixl_keepalive::ucx::time::{parse_time, ucx_accepts, TimeField, UcxTime, MAX_TIME};

/// Checks the parser's invariants on one input, panicking on a breach: no
/// panic; an accepted value is one UCX accepts too, lies within
/// `MAX_TIME`, and formats to text that parses back to the same value; a
/// rejected value's `ucx_accepts` agrees with `ucx_accepts`. Shared by
/// the fuzz target and the test that replays its corpus.
pub fn check_invariants(s: &str) {
    for field in [TimeField::Time, TimeField::TimeUnits] {
        match parse_time(s, field) {
            Ok(t) => {
                assert!(ucx_accepts(s, field), "{s:?} accepted but not by UCX");
                if let UcxTime::Finite(d) = t {
                    assert!(d <= MAX_TIME);
                } else {
                    assert_eq!(field, TimeField::TimeUnits);
                }
                let again = parse_time(&t.to_string(), field);
                assert_eq!(again, Ok(t), "{s:?} -> {t}");
            }
            Err(e) => {
                assert_eq!(e.ucx_accepts, ucx_accepts(s, field), "{s:?}");
                assert_eq!(e.value, s);
                let _ = e.to_string();
            }
        }
    }
}

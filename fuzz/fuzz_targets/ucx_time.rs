//! Fuzzes the UCX time parser: arbitrary strings, both field kinds.
//!
//! Invariants: no panic; an accepted value is one UCX accepts too, lies
//! within `MAX_TIME`, and formats to a string that parses back to the same
//! value; a rejected value's `ucx_accepts` agrees with `ucx_accepts()`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nixl_keepalive::ucx_time::{parse_time, ucx_accepts, TimeField, UcxTime, MAX_TIME};

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
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
});

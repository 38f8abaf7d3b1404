//! Fuzzes the UCX time parser: arbitrary strings, both field kinds, checked
//! against `ucx_time::check_invariants` (the corpus is replayed by
//! `tests/fuzz_corpus.rs` in the normal test suite).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data) {
        nixl_keepalive::ucx_time::check_invariants(s);
    }
});

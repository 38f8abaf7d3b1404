//! Fuzzes the UCX time parser: arbitrary strings, both field kinds, checked
//! against `check_invariants` (`fuzz/invariants.rs`) (the corpus is replayed by
//! `tests/fuzz_corpus.rs` in the normal test suite).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../invariants.rs"]
mod invariants;

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data) {
        invariants::check_invariants(s);
    }
});

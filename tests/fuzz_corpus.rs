//! Replays the cargo-fuzz corpus of the UCX time parser (`fuzz/corpus/`),
//! so every input the fuzzer ever kept is checked on every test run.

#[path = "../fuzz/invariants.rs"]
mod invariants;

#[test]
fn every_fuzz_corpus_input_keeps_the_parser_invariants() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus/ucx_time");
    let mut checked = 0;
    for entry in std::fs::read_dir(dir).expect("the corpus is in the repo") {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        if let Ok(s) = std::str::from_utf8(&bytes) {
            invariants::check_invariants(s);
            checked += 1;
        }
    }
    assert!(checked > 100, "only {checked} corpus inputs");
}

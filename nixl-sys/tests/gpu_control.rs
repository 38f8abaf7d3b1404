//! The hazard the GPU-mapping ledger is built around, shown on its fakes
//! (tests/fake_cuda/): a mapping closed behind UCX's cache is found by the
//! cache's next hit, with no driver call, and the read faults. A process
//! of its own: it closes a mapping behind the ledger's back too.

#![allow(clippy::undocumented_unsafe_blocks)]

mod fake_cuda;

use fake_cuda::{load, pair, pid, setup, CUDA_ERROR_ILLEGAL_ADDRESS, GIB};

/// On a GPU the context is lost: the decode with it.
#[test]
fn control_a_mapping_closed_behind_the_cache_faults_at_its_next_hit() {
    let (_g, hooks, fakes) = setup();
    let e = fakes.export(pid(), 0x4000_0000, GIB, 3);
    let p = pair();
    let keys = load(hooks, fakes, p, &[e]);
    let (mapped, st) = fakes.begin(&keys[0]);
    assert_eq!(st, 0);
    fakes.end(&keys[0], mapped);
    // Closed the way a naive release would: the driver only.
    assert_eq!(unsafe { (fakes.driver_close)(mapped) }, 0);
    let opens = fakes.stats().opens;
    let (_, st) = fakes.begin(&keys[0]);
    assert_eq!(fakes.stats().opens, opens, "a hit: no driver call saw it");
    assert_eq!(st, CUDA_ERROR_ILLEGAL_ADDRESS);
    assert_eq!(fakes.stats().context_lost, 1);
}

//! The GPU-mapping ledger (shim/gpu_map.c) against a fake CUDA driver and a
//! library that behaves as UCX's cuda_ipc cache does (tests/fake_cuda/,
//! built by build.rs): both call through their relocations, as
//! libuct_cuda calls the driver and its own cache entry points, so the
//! interposer binds them exactly as it binds UCX's. No GPU is needed.
//!
//! Every test here shares one process-wide interposer, fake driver and
//! fake cache: they take one lock and each uses its own exporters.

#![allow(clippy::undocumented_unsafe_blocks)]

mod fake_cuda;

use fake_cuda::{crowd, load, pair, pid, setup, GIB};
use nixl_sys::gpu::{Binding, GpuImport, GpuReleaseCounts};

#[test]
fn a_release_gives_a_dead_peers_memory_back_and_ucx_closes_nothing_twice() {
    let (_g, hooks, fakes) = setup();
    let before = fakes.stats();
    let p = pair();
    let e = fakes.export(pid(), 0x1000_0000, GIB, 1);
    let keys = load(hooks, fakes, p, &[e]);
    assert_eq!(fakes.read(&keys[0]), 0);
    let opens = fakes.stats().opens;
    assert_eq!(fakes.read(&keys[0]), 0, "a hit");
    assert_eq!(
        fakes.stats().opens,
        opens,
        "a cache hit makes no driver call"
    );

    // The prefill dies: its memory stays, held by this process's mapping.
    fakes.exporter_exits(&e);
    assert_eq!(fakes.stats().allocated - before.allocated, GIB);
    let mapped: Vec<_> = hooks
        .ledger()
        .into_iter()
        .filter(|m| m.holder == p)
        .collect();
    assert_eq!(mapped.len(), 1);
    assert_eq!(mapped[0].size, GIB);
    assert_eq!(mapped[0].import, GpuImport::Legacy);
    assert_eq!(mapped[0].refs, 1, "the unpacked rkey's reference");
    assert!(!mapped[0].held);

    // The release: the rkeys go (NIXL's invalidation), then the pair.
    fakes.destroy(&keys[0]);
    let idle: Vec<_> = hooks
        .ledger()
        .into_iter()
        .filter(|m| m.holder == p)
        .collect();
    assert_eq!(idle[0].refs, 0);
    assert!(
        idle[0].held,
        "idle at UCX's count 0: the ledger keeps one reference"
    );
    let r = hooks.release(p);
    assert_eq!(
        r,
        GpuReleaseCounts {
            unmapped: 1,
            bytes: GIB,
            ..Default::default()
        }
    );
    assert_eq!(
        fakes.stats().allocated,
        before.allocated,
        "the memory is back"
    );
    assert!(hooks.ledger().iter().all(|m| m.holder != p));

    // UCX's clean-up at exit closes what it still caches: never ours again.
    unsafe { (fakes.exit)() };
    assert_eq!(fakes.stats().bad_closes, before.bad_closes);
    assert_eq!(fakes.cached(), 0);
}

/// The service never releases an engine with a read in flight; this is a
/// caller that does (or a transfer of another agent's on the same
/// region): nothing is unmapped under the read, and the region goes when
/// UCX's last reference does.
#[test]
fn a_release_with_a_read_in_flight_unmaps_only_when_its_last_use_ends() {
    let (_g, hooks, fakes) = setup();
    let before = fakes.stats();
    let (p, q) = (pair(), pair());
    let e = fakes.export(pid(), 0x2000_0000, GIB, 1);
    let mine = load(hooks, fakes, p, &[e]);
    let theirs = load(hooks, fakes, q, &[e]);
    let (mapped, st) = fakes.begin(&theirs[0]);
    assert_eq!(st, 0);
    fakes.exporter_exits(&e);
    fakes.destroy(&mine[0]);
    assert_eq!(
        hooks.release(p),
        GpuReleaseCounts {
            kept_shared: 1,
            ..Default::default()
        }
    );
    let r = hooks.release(q);
    assert_eq!(r.deferred, 1, "in use: nothing unmapped under the read");
    assert_eq!(r.unmapped, 0);
    assert_eq!(fakes.stats().live_maps, before.live_maps + 1);
    let unmapped = hooks.counts().unmapped;
    fakes.end(&theirs[0], mapped);
    assert_eq!(hooks.counts().unmapped, unmapped, "its rkey still holds it");
    // The rkey goes: the last use.
    fakes.destroy(&theirs[0]);
    assert_eq!(hooks.counts().unmapped, unmapped + 1);
    assert_eq!(fakes.stats().allocated, before.allocated);
    assert_eq!(fakes.stats().bad_closes, before.bad_closes);
}

#[test]
fn a_live_peer_released_and_read_again_from_the_same_process_maps_afresh() {
    let (_g, hooks, fakes) = setup();
    let before = fakes.stats();
    let e = fakes.export(pid(), 0x3000_0000, GIB, 7);
    let p = pair();
    let keys = load(hooks, fakes, p, &[e]);
    assert_eq!(fakes.read(&keys[0]), 0);
    // A router retire: the prefill lives on, same process, same allocation.
    fakes.destroy(&keys[0]);
    assert_eq!(hooks.release(p).unmapped, 1);
    // It re-registers: the same pid, base and buffer id come back.
    let again = pair();
    let opens = fakes.stats().opens;
    let keys = load(hooks, fakes, again, &[e]);
    assert_eq!(
        fakes.stats().opens,
        opens + 1,
        "the lookup missed: mapped afresh"
    );
    assert_eq!(fakes.read(&keys[0]), 0, "no CUDA error");
    assert_eq!(fakes.stats().context_lost, 0);
    fakes.destroy(&keys[0]);
    assert_eq!(hooks.release(again).unmapped, 1);
    fakes.exporter_exits(&e);
    assert_eq!(fakes.stats().allocated, before.allocated);
    assert_eq!(fakes.stats().bad_closes, before.bad_closes);
}

#[test]
fn a_same_pid_restart_maps_afresh_and_the_stale_close_is_ucxs_own() {
    let (_g, hooks, fakes) = setup();
    let before = fakes.stats();
    let pid = pid();
    let old = fakes.export(pid, 0x5000_0000, GIB, 1);
    let p = pair();
    let keys = load(hooks, fakes, p, &[old]);
    assert_eq!(fakes.read(&keys[0]), 0);
    fakes.exporter_exits(&old);
    fakes.destroy(&keys[0]);
    // Not released yet (say the release waits on something): the restarted
    // prefill got the same pid, base address, another allocation.
    let new = fakes.export(pid, 0x5000_0000, GIB, 2);
    let q = pair();
    let keys = load(hooks, fakes, q, &[new]);
    // UCX found the stale region at that base and closed it itself.
    assert_eq!(fakes.read(&keys[0]), 0);
    assert_eq!(fakes.stats().context_lost, 0);
    assert_eq!(
        fakes.stats().allocated - before.allocated,
        GIB,
        "the old GiB is back"
    );
    // The late release of the old pair finds nothing left to close.
    assert_eq!(hooks.release(p), GpuReleaseCounts::default());
    fakes.destroy(&keys[0]);
    assert_eq!(hooks.release(q).unmapped, 1);
    fakes.exporter_exits(&new);
    assert_eq!(fakes.stats().allocated, before.allocated);
    assert_eq!(fakes.stats().bad_closes, before.bad_closes);
}

#[test]
fn a_region_an_unnamed_key_used_is_never_unmapped() {
    let (_g, hooks, fakes) = setup();
    let e = fakes.export(pid(), 0x6000_0000, GIB, 1);
    let p = pair();
    let named = load(hooks, fakes, p, &[e]);
    // A load this crate did not see: its key names nobody.
    let unnamed = fakes.unpack(&e);
    assert_eq!(fakes.read(&unnamed), 0);
    fakes.destroy(&named[0]);
    assert_eq!(
        hooks.release(p),
        GpuReleaseCounts {
            kept_unknown: 1,
            ..Default::default()
        }
    );
    assert_eq!(fakes.read(&unnamed), 0);
    fakes.destroy(&unnamed);
    fakes.exporter_exits(&e);
}

#[test]
fn one_exporter_mapped_by_two_agents_is_kept_until_both_are_released() {
    let (_g, hooks, fakes) = setup();
    let before = fakes.stats();
    let e = fakes.export(pid(), 0x7000_0000, GIB, 1);
    let (a, b) = (pair(), pair());
    let ka = load(hooks, fakes, a, &[e]);
    let kb = load(hooks, fakes, b, &[e]);
    assert_eq!(fakes.read(&ka[0]), 0);
    assert_eq!(fakes.read(&kb[0]), 0);
    fakes.destroy(&ka[0]);
    assert_eq!(hooks.release(a).kept_shared, 1);
    assert_eq!(fakes.read(&kb[0]), 0, "the other agent reads on");
    fakes.destroy(&kb[0]);
    assert_eq!(hooks.release(b).unmapped, 1);
    fakes.exporter_exits(&e);
    assert_eq!(fakes.stats().allocated, before.allocated);
}

#[test]
fn driver_failures_are_counted_and_nothing_crashes() {
    let (_g, hooks, fakes) = setup();
    let counts = hooks.counts();
    let e = fakes.export(pid(), 0x8000_0000, GIB, 1);
    let p = pair();
    // The unpack's reachability check fails to open (out of memory, 2).
    unsafe { (fakes.fail_next)(0, 2, 1) };
    let keys = load(hooks, fakes, p, &[e]);
    assert_eq!(hooks.counts().open_failures, counts.open_failures + 1);
    assert_eq!(fakes.read(&keys[0]), 0, "the read's own open works");
    fakes.destroy(&keys[0]);
    unsafe { (fakes.fail_next)(1, 999, 1) };
    let r = hooks.release(p);
    assert_eq!((r.unmapped, r.failures), (0, 1));
    assert_eq!(hooks.counts().close_failures, counts.close_failures + 1);
    assert!(
        hooks.ledger().iter().all(|m| m.holder != p),
        "UCX forgot it"
    );
    fakes.exporter_exits(&e);
}

#[test]
fn vmm_fabric_imports_are_given_back_too() {
    let (_g, hooks, fakes) = setup();
    let before = fakes.stats();
    let mut e = fakes.export(pid(), 0x9000_0000, GIB, 1);
    e.key.vmm = 1;
    let p = pair();
    let keys = load(hooks, fakes, p, &[e]);
    assert_eq!(fakes.read(&keys[0]), 0);
    let m: Vec<_> = hooks
        .ledger()
        .into_iter()
        .filter(|m| m.holder == p)
        .collect();
    assert_eq!(m[0].import, GpuImport::VmmFabric);
    fakes.exporter_exits(&e);
    fakes.destroy(&keys[0]);
    assert_eq!(hooks.release(p).bytes, GIB);
    assert_eq!(fakes.stats().allocated, before.allocated);
    assert_eq!(fakes.stats().bad_closes, before.bad_closes);
}

#[test]
fn with_the_cache_off_ucx_closes_each_region_itself() {
    let (_g, hooks, fakes) = setup();
    let before = fakes.stats();
    unsafe { (fakes.set_cache)(0) };
    let e = fakes.export(pid(), 0xa000_0000, GIB, 1);
    let p = pair();
    let keys = load(hooks, fakes, p, &[e]);
    assert_eq!(fakes.read(&keys[0]), 0);
    fakes.exporter_exits(&e);
    fakes.destroy(&keys[0]);
    assert_eq!(fakes.stats().allocated, before.allocated, "UCX's own close");
    assert_eq!(hooks.release(p), GpuReleaseCounts::default());
    assert_eq!(fakes.stats().bad_closes, before.bad_closes);
}

#[test]
fn turned_off_the_ledger_gives_its_references_back_to_ucx() {
    let (_g, hooks, fakes) = setup();
    let e = fakes.export(pid(), 0xb000_0000, GIB, 1);
    let p = pair();
    let keys = load(hooks, fakes, p, &[e]);
    assert_eq!(fakes.read(&keys[0]), 0);
    fakes.destroy(&keys[0]);
    assert!(hooks.counts().held >= 1);
    hooks.set_enabled(false);
    assert_eq!(hooks.counts().held, 0);
    assert!(hooks.ledger().is_empty());
    // UCX keeps the region cached at count 0, as without the ledger.
    assert_eq!(hooks.release(p), GpuReleaseCounts::default());
    assert!(fakes.cached() >= 1);
    hooks.set_enabled(true);
    fakes.exporter_exits(&e);
}

#[test]
fn a_thousand_mappings_over_a_hundred_peers_all_come_back() {
    let (_g, hooks, fakes) = setup();
    let before = fakes.stats();
    let peers = crowd(hooks, fakes, 100);
    assert_eq!(fakes.stats().live_maps, before.live_maps + 1000);
    let mut unmapped = 0;
    for (p, exports, keys) in &peers {
        for e in exports {
            fakes.exporter_exits(e);
        }
        for k in keys {
            fakes.destroy(k);
        }
        let r = hooks.release(*p);
        assert_eq!(r.bytes, 10 * (64 << 20));
        unmapped += r.unmapped;
    }
    assert_eq!(unmapped, 1000);
    assert_eq!(fakes.stats().live_maps, before.live_maps);
    assert_eq!(fakes.stats().allocated, before.allocated);
    assert_eq!(fakes.stats().bad_closes, before.bad_closes);
}

#[test]
fn the_fake_cache_calls_the_ledger_through_its_relocations() {
    let (_g, hooks, _fakes) = setup();
    for symbol in nixl_sys::gpu::UCT_CUDA_SYMBOLS
        .iter()
        .chain(&nixl_sys::gpu::UCP_SYMBOLS)
        .chain(&["cuMemImportFromShareableHandle"])
    {
        assert_eq!(
            hooks.binding("libfake_uct_cuda.so", false, symbol),
            Some(Binding::Here),
            "{symbol}"
        );
    }
    assert_eq!(
        hooks.binding("libfake_uct_cuda.so", false, "cuMemPoolImportPointer"),
        None,
        "not one of the ledger's"
    );
}

//! What the GPU-mapping ledger costs a transfer: one zero-copy read's map
//! and unmap through UCX's cache entry points (the fake cache of
//! tests/fake_cuda/, a hit each time, as a cached region is), with the
//! ledger on, against the same with it off (the interposer then only
//! forwards): the baseline, measured in the same run. Then the same with
//! 1,000 regions over 100 peers in the ledger, and one release of a peer's
//! 10 regions. Prints `gpu_ledger <case>: <ns> ns per call, <ratio>x the
//! baseline`.
//!
//!   cargo bench -p nixl-sys --bench gpu_ledger [-- --quick]

#[path = "../tests/fake_cuda/mod.rs"]
mod fake_cuda;

use std::time::Instant;

use fake_cuda::{crowd, load, pair, pid, setup, Bundle, Fakes, GIB};

/// Nanoseconds per read (map, read through the mapping, unmap), best of 5
/// rounds of `n`.
fn per_read(fakes: &Fakes, key: &Bundle, n: u32) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let start = Instant::now();
        for _ in 0..n {
            assert_eq!(fakes.read(key), 0);
        }
        best = best.min(start.elapsed().as_nanos() as f64 / f64::from(n));
    }
    best
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let n = if quick { 20_000 } else { 200_000 };
    let (_g, hooks, fakes) = setup();
    let e = fakes.export(pid(), 0x1000_0000, GIB, 1);
    let keys = load(hooks, fakes, pair(), &[e]);

    hooks.set_enabled(false);
    let off = per_read(fakes, &keys[0], n);
    hooks.set_enabled(true);
    // Named again under the ledger: turning it off forgot the batch.
    let keys = load(hooks, fakes, pair(), &[e]);
    let on = per_read(fakes, &keys[0], n);
    println!("gpu_ledger off (baseline): {off:.0} ns per read");
    println!(
        "gpu_ledger on: {on:.0} ns per read, {:.2}x the baseline",
        on / off
    );

    let crowd = crowd(hooks, fakes, 100);
    let crowded = per_read(fakes, &keys[0], n);
    println!(
        "gpu_ledger on, 1,000 regions over 100 peers: {crowded:.0} ns per read, {:.2}x the baseline",
        crowded / off
    );
    let start = Instant::now();
    let mut unmapped = 0;
    for (p, _, keys) in &crowd {
        for k in keys {
            fakes.destroy(k);
        }
        unmapped += hooks.release(*p).unmapped;
    }
    let per_release = start.elapsed().as_nanos() as f64 / crowd.len() as f64;
    assert_eq!(unmapped, 1000);
    println!(
        "gpu_ledger release of a peer's 10 regions (its rkeys destroyed first): {:.1} us",
        per_release / 1000.0
    );
}

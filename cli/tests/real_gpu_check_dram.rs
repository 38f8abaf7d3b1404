//! The GPU check's harness and bundle, exercised every time on DRAM
//! (docs/gpu-check.md): `scripts/gpu-bundle.sh` makes a bundle of this
//! build's binary and the runtime subset that loads (the
//! check runs from it, `NIXL_PREFIX` at its runtime), and
//! `scripts/gpu-check.sh --memory dram` goes through every phase of every
//! run: reads verified, the prefill killed, released with the cuda_ipc
//! cache on and off, never in the control, the replacement started. Only
//! the VRAM figures need a GPU. Without the runtime: SKIPPED (a failure
//! with `NIXL_KEEPALIVE_REQUIRE_REAL=1`).
//!
//! `GPU_CHECK_BUNDLE=<dir>` checks that bundle (e.g. the release one CI
//! builds, which must be under the 64 MiB that may travel) instead of
//! making one from this test's debug binary (which never travels).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

const LIMIT: u64 = 64 * 1024 * 1024;

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts")
        .join(name)
}

fn dir_size(dir: &Path) -> u64 {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).expect("read bundle dir") {
        let entry = entry.expect("entry");
        let meta = entry.metadata().expect("metadata");
        if meta.is_dir() {
            total += dir_size(&entry.path());
        } else {
            total += meta.len();
        }
    }
    total
}

fn report(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "MEASURED real_gpu_check_dram: {line}");
}

/// (run, phase, figure) -> value, from figures.tsv.
fn figures(out: &Path) -> HashMap<(String, String, String), String> {
    let text = std::fs::read_to_string(out.join("figures.tsv")).expect("figures.tsv");
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let mut f = l.splitn(4, '\t');
            Some((
                (
                    f.next()?.to_string(),
                    f.next()?.to_string(),
                    f.next()?.to_string(),
                ),
                f.next()?.to_string(),
            ))
        })
        .collect()
}

/// This binary's real tests are ignored without the NIXL runtime (cfg
/// `nixl_runtime`, from nixl-sys's build script); a run that requires the
/// runtime (`NIXL_KEEPALIVE_REQUIRE_REAL=1`, CI) fails here instead of
/// passing with every one of them ignored.
#[test]
fn the_real_runtime_is_there_when_required() {
    nixl_agent::testing::fail_when_required_and_missing();
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn the_dram_check_runs_every_phase_from_a_bundle() {
    let rt = nixl_agent::testing::real_runtime();
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR")).join("gpu-check-dram");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).expect("tmp dir");
    let runtime_dir = rt
        .lib_dir()
        .parent()
        .expect("the runtime's lib dir has a parent")
        .to_path_buf();

    let started = Instant::now();
    let given = std::env::var_os("GPU_CHECK_BUNDLE");
    let bundle = match &given {
        Some(b) => PathBuf::from(b),
        None => {
            let bundle = tmp.join("bundle");
            let made = Command::new("bash")
                .arg(script("gpu-bundle.sh"))
                // This test's debug binary (about 20 MB stripped) never
                // travels: the 64 MiB is the release bundle's, checked by
                // CI's GPU bundle step.
                .arg("--no-travel-limit")
                .arg("--bin")
                .arg(env!("CARGO_BIN_EXE_nixl-keepalive"))
                .arg(&bundle)
                .env("NIXL_RUNTIME_DIR", &runtime_dir)
                .output()
                .expect("run gpu-bundle.sh");
            let stdout = String::from_utf8_lossy(&made.stdout);
            assert!(
                made.status.success(),
                "gpu-bundle.sh failed: {stdout}\n{}",
                String::from_utf8_lossy(&made.stderr)
            );
            let line = stdout
                .lines()
                .find(|l| l.starts_with("GPU BUNDLE "))
                .unwrap_or("(no GPU BUNDLE line)");
            report(line);
            bundle
        }
    };
    let bundle_secs = started.elapsed().as_secs_f64();
    let size = dir_size(&bundle);
    if given.is_some() {
        assert!(size < LIMIT, "the bundle is {size} bytes, not under 64 MiB");
    }
    let manifest = std::fs::read_to_string(bundle.join("MANIFEST.txt")).expect("MANIFEST.txt");
    for needed in [
        "runtime/.nixl_cu12.mesonpy.libs/libnixl.so",
        "runtime/.nixl_cu12.mesonpy.libs/libnixl_capi.so",
        "runtime/.nixl_cu12.mesonpy.libs/plugins/libplugin_UCX.so",
        "runtime/nixl_cu12.libs/ucx/libuct_cuda.so.0.0.0",
        "runtime/nixl_cu12.libs/ucx/libuct_cma.so.0.0.0",
        "bin/nixl-keepalive",
    ] {
        assert!(manifest.contains(needed), "{needed} not in the bundle");
    }
    for dropped in [
        "libplugin_OBJ",
        "libplugin_GDS",
        "libuct_ib.so",
        "libaws-",
        "libazure",
    ] {
        assert!(
            !manifest
                .lines()
                .any(|l| l.starts_with(|c: char| c.is_ascii_digit()) && l.contains(dropped)),
            "{dropped} should not be in the bundle"
        );
    }

    let out = tmp.join("out");
    let check_started = Instant::now();
    let ran = Command::new("bash")
        .arg(script("gpu-check.sh"))
        .args(["--memory", "dram", "--size", "32M", "--bundle"])
        .arg(&bundle)
        .arg("--out")
        .arg(&out)
        .env_remove("OUT")
        .output()
        .expect("run gpu-check.sh");
    let stdout = String::from_utf8_lossy(&ran.stdout);
    let stderr = String::from_utf8_lossy(&ran.stderr);
    assert!(
        ran.status.success(),
        "gpu-check.sh --memory dram failed:\n{stdout}\n{stderr}"
    );
    let table = std::fs::read_to_string(out.join("table.txt")).expect("table.txt");
    for line in table.lines() {
        report(line);
    }
    report(&format!(
        "bundle {size} bytes ({bundle_secs:.1} s), check {:.1} s",
        check_started.elapsed().as_secs_f64()
    ));

    let f = figures(&out);
    let get = |run: &str, phase: &str, figure: &str| -> String {
        f.get(&(run.into(), phase.into(), figure.into()))
            .cloned()
            .unwrap_or_else(|| panic!("no {figure} for {run}/{phase} in figures.tsv:\n{table}"))
    };
    for run in ["y", "ykeep", "n", "control"] {
        let verified: u64 = get(run, "reading", "verified_reads")
            .parse()
            .expect("number");
        assert!(verified >= 1, "{run}: no verified read");
        assert_eq!(get(run, "reading", "corrupt_reads"), "0", "{run}");
        assert_eq!(get(run, "replacement", "fits"), "yes", "{run}");
        for phase in ["prefill_up", "reading", "replacement"] {
            let rss: u64 = get(run, phase, "prefill_rss_kib").parse().expect("RSS");
            // The 32 MiB region is resident (filled) in the prefill.
            assert!(rss >= 32 * 1024, "{run}/{phase}: prefill RSS {rss} KiB");
        }
        for phase in ["reading", "after_kill", "after_release", "replacement"] {
            get(run, phase, "decode_rss_kib")
                .parse::<u64>()
                .expect("the decode is alive in every phase");
        }
        // Nothing of the dead prefill stays mapped into the decode.
        assert_eq!(
            get(run, "after_release", "decode_maps_of_prefill_shm"),
            "0",
            "{run}"
        );
        assert_eq!(
            get(run, "after_release", "decode_fds_of_prefill_shm"),
            "0",
            "{run}"
        );
    }
    for run in ["y", "ykeep", "n"] {
        let released = get(run, "after_release", "released");
        assert!(released.starts_with("yes"), "{run}: {released}");
    }
    assert!(get("control", "after_release", "released").starts_with("no"));
    // No CUDA transport on DRAM: the decode says so, and has nothing to
    // give back.
    assert!(
        get("y", "reading", "gpu_mappings").starts_with("GPU mappings: none"),
        "{}",
        get("y", "reading", "gpu_mappings")
    );
    // The live prefill retired by the router, registered again and read
    // again (the VRAM run's round trip, here on DRAM).
    assert_eq!(get("live", "retire", "released"), "yes");
    let again: u64 = get("live", "read_again", "verified_after_retire")
        .parse()
        .expect("number");
    assert!(again >= 4, "read again after the retire: {again}");
    assert_eq!(get("live", "read_again", "corrupt_reads"), "0");
    assert_eq!(get("live", "read_again", "cuda_error_lines"), "0");
    assert_eq!(get("live", "read_again", "decode_alive"), "yes");
}

#[test]
fn vram_without_a_gpu_fails_at_once_naming_the_driver() {
    if nixl_agent::cuda::Cuda::get().is_ok() {
        eprintln!("SKIPPED: a CUDA driver is here; --memory vram may start");
        return;
    }
    for command in [
        &["prefill", "--listen", "127.0.0.1:0", "--memory", "vram"][..],
        &["decode", "--prefill", "127.0.0.1:1", "--memory", "vram"][..],
    ] {
        let started = Instant::now();
        let out = Command::new(env!("CARGO_BIN_EXE_nixl-keepalive"))
            .args(command)
            .output()
            .expect("run nixl-keepalive");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{command:?}: {stderr}");
        assert!(
            stderr.contains("libcuda.so.1") && stderr.contains("--memory vram"),
            "{command:?}: {stderr}"
        );
        assert!(
            started.elapsed().as_secs() < 5,
            "{command:?} took {:?}",
            started.elapsed()
        );
    }
}

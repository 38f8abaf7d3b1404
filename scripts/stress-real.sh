#!/usr/bin/env bash
# The real-process tests, N times in a row, with a CPU load running beside
# them: the check that they wait for what they assert instead of racing
# the processes they watch (docs/testing.md).
#
#   bash scripts/stress-real.sh [N]          # N runs, 5 by default
#
# What one run is: every `cli/tests/real_*.rs` (the partition test only
# with STRESS_PARTITION=1) and `cli/tests/conformance.rs` with the CLI's
# `etcd` feature, every `nixl-sys/safe/tests/real_*.rs`, and
# `python/tests/test_real.py` (when `.venv/` exists: see
# scripts/install-python.sh), all with NIXL_KEEPALIVE_REQUIRE_REAL=1, so a
# missing runtime or etcd is a failure, never a pass. `cargo test` runs
# with `--no-fail-fast` and a failed run never stops the next one: at the
# end it prints runs, failed runs, and every failed test with how often it
# failed, and how long each run and each test binary took. It exits
# non-zero when any run failed.
#
# Environment:
#   STRESS_LOAD       busy (default): STRESS_BUSY shell busy loops (2 by
#                     default: one per core of this project's machine kind)
#                     at normal priority for the whole stress run;
#                     build: a copy of the workspace (`git archive HEAD`)
#                     built again and again with `cargo build --workspace
#                     -j 2` in a target directory of its own;
#                     none: no load (a baseline)
#   STRESS_BUSY       how many busy loops (busy load)
#   STRESS_PYTHON     0 leaves the Python real tests out
#   STRESS_PARTITION  1 adds cli/tests/real_partition.rs (needs root; makes
#                     network namespaces of its own)
#   STRESS_LOG        where each run's output goes (default target/stress)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

runs="${1:-5}"
if ! [[ "${runs}" =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: bash scripts/stress-real.sh [N]  (N: a positive number of runs, 5 by default)" >&2
    exit 2
fi
load="${STRESS_LOAD:-busy}"
busy="${STRESS_BUSY:-2}"
case "${load}" in
    busy | build | none) ;;
    *)
        echo "stress-real.sh: STRESS_LOAD=${load}: use busy, build or none" >&2
        exit 2
        ;;
esac
logs="${STRESS_LOG:-target/stress}"
mkdir -p "${logs}"
export NIXL_KEEPALIVE_REQUIRE_REAL=1
export CARGO_TERM_COLOR=never

set -e
bash scripts/install-nixl.sh >/dev/null
bash scripts/install-etcd.sh >/dev/null

# The test binaries, by name: every real test file there is.
cli_tests=(conformance)
for f in cli/tests/real_*.rs; do
    name="$(basename "${f}" .rs)"
    if [[ "${name}" == real_partition && "${STRESS_PARTITION:-0}" != 1 ]]; then
        continue
    fi
    cli_tests+=("${name}")
done
sys_tests=()
for f in nixl-sys/safe/tests/real_*.rs; do
    sys_tests+=("$(basename "${f}" .rs)")
done
cargo_args=(--locked --no-fail-fast)
cli_args=(-p nixl-keepalive-cli --features nixl-keepalive-cli/etcd)
for t in "${cli_tests[@]}"; do cli_args+=(--test "${t}"); done
sys_args=(-p nixl-agent)
for t in "${sys_tests[@]}"; do sys_args+=(--test "${t}"); done

python=0
if [[ "${STRESS_PYTHON:-1}" != 0 && -x .venv/bin/python ]]; then
    python=1
fi

# Built before the load starts: the runs time the tests, not the build.
echo "== building the test binaries (and the Python wheel: ${python})"
cargo test "${cargo_args[@]}" "${cli_args[@]}" "${sys_args[@]}" --no-run 2>&1 | tail -n 3
if [[ "${python}" == 1 ]]; then
    wheels="target/python-wheel"
    rm -rf "${wheels}"
    .venv/bin/maturin build --locked --manifest-path python/Cargo.toml --out "${wheels}" 2>&1 | tail -n 1
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "${wheels}"/nixl_keepalive-*.whl
fi
set +e

# The load, stopped (by the ids started here) when this script ends.
load_pids=()
stop_load() {
    for pid in "${load_pids[@]}"; do
        kill -- "-${pid}" 2>/dev/null || kill "${pid}" 2>/dev/null
    done
    wait 2>/dev/null
}
trap stop_load EXIT
trap 'exit 130' INT TERM
load_text="none"
case "${load}" in
    busy)
        for _ in $(seq "${busy}"); do
            setsid bash -c 'while :; do :; done' &
            load_pids+=("$!")
        done
        load_text="${busy} busy loops (bash 'while :; do :; done', normal priority)"
        ;;
    build)
        copy="${logs}/load-src"
        rm -rf "${copy}"
        mkdir -p "${copy}"
        git archive HEAD | tar -x -C "${copy}"
        setsid bash -c "cd '${copy}' && while :; do cargo clean --target-dir target-load -p nixl-keepalive -p nixl-keepalive-cli >/dev/null 2>&1; cargo build --workspace --offline --target-dir target-load -j 2 >/dev/null 2>&1; done" &
        load_pids+=("$!")
        load_text="a copy of the workspace rebuilt again and again (cargo build --workspace -j 2)"
        ;;
esac
echo "== ${runs} run(s) of the real-process tests; load: ${load_text}"
echo "   cargo: ${cli_tests[*]} (nixl-keepalive-cli, etcd feature); ${sys_tests[*]} (nixl-agent)$([[ ${python} == 1 ]] && echo '; pytest python/tests/test_real.py')"

failed_runs=0
all_failures=()
durations=()
started=$(date +%s)
for run in $(seq "${runs}"); do
    log="${logs}/run-${run}.log"
    t0=$(date +%s)
    cargo test "${cargo_args[@]}" "${cli_args[@]}" "${sys_args[@]}" >"${log}" 2>&1
    cargo_rc=$?
    py_rc=0
    if [[ "${python}" == 1 ]]; then
        .venv/bin/python -m pytest -q -rfE python/tests/test_real.py >>"${log}" 2>&1
        py_rc=$?
    fi
    took=$(($(date +%s) - t0))
    durations+=("${took}")
    # libtest: "test NAME ... FAILED", named with the binary that ran it
    # ("Running tests/real_x.rs"); a binary that died without its own
    # verdict: cargo's "error: test failed, to rerun pass `--test X`";
    # pytest: "FAILED python/tests/test_real.py::NAME".
    mapfile -t failures < <(awk '
        /^ *Running / { bin = $2; sub(/^tests\//, "", bin); sub(/\.rs$/, "", bin) }
        /^test .* \.\.\. FAILED$/ { print bin "::" $2; named[bin] = 1 }
        /error: test failed, to rerun pass/ {
            b = $0; sub(/.*--test /, "", b); sub(/`.*/, "", b)
            if (!(b in named)) print b "::(the binary failed: see the log)"
        }
        /^FAILED python\// { print $2 }
    ' "${log}")
    if [[ ${cargo_rc} -ne 0 && ${#failures[@]} -eq 0 ]]; then
        failures=("cargo test exited ${cargo_rc} (see ${log})")
    fi
    if [[ ${py_rc} -ne 0 && ${py_rc} -ne 5 ]] && ! grep -q '^FAILED python/' "${log}"; then
        failures+=("pytest exited ${py_rc} (see ${log})")
    fi
    if [[ ${cargo_rc} -ne 0 || (${py_rc} -ne 0 && ${py_rc} -ne 5) || ${#failures[@]} -ne 0 ]]; then
        failed_runs=$((failed_runs + 1))
        all_failures+=("${failures[@]}")
        echo "run ${run}/${runs}: FAILED in ${took} s: ${failures[*]} (log ${log})"
    else
        echo "run ${run}/${runs}: ok in ${took} s (log ${log})"
    fi
done
total=$(($(date +%s) - started))

echo
echo "== per test binary, seconds over the runs (libtest's own 'finished in')"
cat "${logs}"/run-*.log | awk '
    /^ *Running / { bin = $2; sub(/^tests\//, "", bin); sub(/\.rs$/, "", bin) }
    /^test result: / && bin != "" {
        s = $0; sub(/.*finished in /, "", s); sub(/s$/, "", s); s += 0
        if (!(bin in min) || s < min[bin]) min[bin] = s
        if (s > max[bin]) max[bin] = s
        sum[bin] += s; n[bin]++; bin = ""
    }
    /^(=+ )?[0-9]+ (passed|failed).* in [0-9.]+s/ {
        s = $0; sub(/.* in /, "", s); sub(/s.*/, "", s); s += 0
        b = "test_real.py"
        if (!(b in min) || s < min[b]) min[b] = s
        if (s > max[b]) max[b] = s
        sum[b] += s; n[b]++
    }
    END { for (b in n) printf "  %-24s %7.1f - %7.1f (mean %.1f, %d runs)\n", b, min[b], max[b], sum[b] / n[b], n[b] }
' | sort
echo
echo "== stress: runs=${runs} failed_runs=${failed_runs} load: ${load_text}"
echo "   each run took: ${durations[*]} s; all of it ${total} s"
if [[ ${#all_failures[@]} -gt 0 ]]; then
    echo "   failed tests (times failed):"
    printf '%s\n' "${all_failures[@]}" | sort | uniq -c | sed 's/^/    /'
    exit 1
fi
echo "   failures: 0"

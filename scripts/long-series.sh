#!/usr/bin/env bash
# The long series, run on demand: the tests CI (.ci/run) runs at shorter
# counts, here at their full ones, and the soak. What they measured goes
# into docs/benchmarks.md ("The long series"), with the machine and date.
#
#   bash scripts/long-series.sh                 # rust, python and vllm parts
#   bash scripts/long-series.sh rust python     # some of them
#   LONG_SOAK=1 bash scripts/long-series.sh rust   # and the Rust soak (an hour and more)
#
# Parts (each prints its own time; every part runs whatever the one before
# said, and the script exits non-zero when any failed):
#   rust    cli/tests/real_given_up.rs, issue 43's freeze cycles
#           (NIXL_KEEPALIVE_FREEZE_CYCLES, 20, as in CI), and
#           cli/tests/real_release_sockets.rs's kill/restart cycles
#           (REAL_RELEASE_CYCLES, CI 20, here 100); with LONG_SOAK=1 also
#           cli/tests/real_soak.rs (ignored in CI; SOAK_CYCLES, default 3000)
#   python  python/tests/test_real.py and test_real_releases.py: the freeze
#           cycles (20, as in CI), the kill/restart cycles
#           (NIXL_KEEPALIVE_PY_CYCLES, CI 20, here 100) and the releases
#           (NIXL_KEEPALIVE_PY_RELEASES, CI 20, here 60); needs what
#           scripts/test.sh made (.venv with the wheel, target/debug/nixl-keepalive)
#   vllm    the vLLM tier's freeze series (test_sigstopped_with_reads_in_flight_...,
#           CI 5 cycles, here 20) on VLLM_VERSION (default 0.34.0), through
#           scripts/test-vllm.sh (installs .venv-vllm when missing)
# Each count can be set as usual (the variables above); unset, the full one
# is used. The real runtime is required (NIXL_KEEPALIVE_REQUIRE_REAL=1).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

export NIXL_KEEPALIVE_REQUIRE_REAL=1
# NIXL_KEEPALIVE_FREEZE_CYCLES is left unset (the tests' default is 20):
# set, the service warns of it as an unknown knob, which fails the Python suite.
export REAL_RELEASE_CYCLES="${REAL_RELEASE_CYCLES:-100}"
export NIXL_KEEPALIVE_PY_CYCLES="${NIXL_KEEPALIVE_PY_CYCLES:-100}"
export NIXL_KEEPALIVE_PY_RELEASES="${NIXL_KEEPALIVE_PY_RELEASES:-60}"

parts=("$@")
if ((${#parts[@]} == 0)); then parts=(rust python vllm); fi
for part in "${parts[@]}"; do
    case "${part}" in
        rust | python | vllm) ;;
        *) echo "long-series.sh: unknown part '${part}' (rust, python, vllm)" >&2; exit 2 ;;
    esac
done

echo "long-series.sh: freeze cycles ${NIXL_KEEPALIVE_FREEZE_CYCLES:-20}, release cycles ${REAL_RELEASE_CYCLES}," \
    "Python kill/restart cycles ${NIXL_KEEPALIVE_PY_CYCLES}, Python releases ${NIXL_KEEPALIVE_PY_RELEASES}"
failed=()
run_part() {
    local part="$1" start status=0
    start=$(date +%s)
    echo "== long series: ${part}"
    case "${part}" in
        rust)
            bash scripts/install-nixl.sh
            cargo test --locked -p nixl-keepalive-cli --test real_given_up --test real_release_sockets \
                -- --nocapture || status=$?
            if [[ "${LONG_SOAK:-0}" == "1" ]]; then
                cargo test --locked -p nixl-keepalive-cli --test real_soak -- --ignored --nocapture || status=$?
            fi
            ;;
        python)
            if [[ ! -x .venv/bin/python || ! -x target/debug/nixl-keepalive ]]; then
                echo "long-series.sh: the python part needs .venv and target/debug/nixl-keepalive (bash scripts/test.sh makes both)" >&2
                status=1
            else
                .venv/bin/python -m pytest -p no:cacheprovider -rs python/tests/test_real.py \
                    python/tests/test_real_releases.py || status=$?
            fi
            ;;
        vllm)
            VLLM_UNIT=0 bash scripts/test-vllm.sh -k test_sigstopped_with_reads_in_flight || status=$?
            ;;
    esac
    echo "-- long series ${part}: $(( $(date +%s) - start )) s, exit ${status}"
    if ((status != 0)); then failed+=("${part}"); fi
}
for part in "${parts[@]}"; do
    run_part "${part}"
done
if ((${#failed[@]} > 0)); then
    echo "scripts/long-series.sh: FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "scripts/long-series.sh: passed"

#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs the NIXL runtime (and
# with it the UCX the real tests load) and etcd, then runs every test of the
# workspace (cargo-nextest: every test in a process of its own, two at a
# time, .config/nextest.toml; then the doctests with `cargo test --doc`),
# and, beside the Rust tests, builds the Python package and runs its pytest
# suite. Extra arguments go to `cargo nextest run`.
#
# Real-runtime tests print SKIPPED when the runtime cannot be loaded; with
# NIXL_KEEPALIVE_REQUIRE_REAL=1 (set by CI) a missing runtime fails instead.
#
# A failure never hides the rest: nextest and the doctests run with
# --no-fail-fast (every test runs, whichever fails), the Python part runs
# whatever cargo said, and the script exits non-zero when either failed.
# `scripts/stress-real.sh N` runs the real-process tests N times under a
# CPU load.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/install-nixl.sh
# etcd (the membership tests start their own on a free loopback port) and
# protoc (the etcd-client crate's build script needs it).
bash scripts/install-etcd.sh

# cargo-nextest (on CI's machines; scripts/install-nextest.sh installs it
# where it is missing, from crates.io, once).
bash scripts/install-nextest.sh

# The real tests spawn the `nixl-keepalive prefill` binary and check the
# fuzz corpus. The CLI's `etcd` feature is on here: its real membership
# tests run. The build first, alone, so that the Python part can start
# beside the Rust tests with the CLI binary it spawns already built.
cargo_args=(--workspace --locked --features nixl-keepalive-cli/etcd)
cargo_status=0
cargo nextest run "${cargo_args[@]}" --no-run || cargo_status=$?

# The Python package (python/, `nixl_keepalive`): a venv under the checkout
# with NIXL's Python API (the same pinned wheel), the wheel users install
# (scripts/build-wheel.sh: release, manylinux_2_28, checked) installed
# there, then its pytest suite: the API's rules over a recording agent, and
# the vLLM-shaped example decode against real prefill processes (the
# binary cargo test just built). Real tests print SKIPPED without the
# runtime, and fail under NIXL_KEEPALIVE_REQUIRE_REAL=1 or CI=true.
python_status=0
python_part() {
    set -e
    bash scripts/install-python.sh
    local wheels="target/wheelhouse"
    bash scripts/build-wheel.sh "${wheels}"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "${wheels}"/nixl_keepalive-*.whl
    .venv/bin/python -m pytest python/tests
}
# In a subshell run as a plain command: `set -e` holds inside it (under a
# `||` bash would ignore it there), and its status is kept for the end. It
# runs beside the Rust tests (both mostly wait on real processes: on 2
# cores the two together take about as long as the Rust tests alone), its
# output kept in a file and printed after theirs, so neither is interleaved.
python_log="target/test-python.log"
mkdir -p target
set +e
(python_part) >"${python_log}" 2>&1 &
python_pid=$!
set -e

if [[ ${cargo_status} -eq 0 ]]; then
    cargo nextest run "${cargo_args[@]}" --no-fail-fast "$@" || cargo_status=$?
    # nextest runs no doctests: cargo's own harness does.
    cargo test "${cargo_args[@]}" --doc --no-fail-fast || cargo_status=$?
fi

set +e
wait "${python_pid}"
python_status=$?
set -e
echo "== the Python part (python/tests), exit ${python_status}: ${python_log}"
cat "${python_log}"

if [[ ${cargo_status} -ne 0 || ${python_status} -ne 0 ]]; then
    echo "scripts/test.sh: FAILED (cargo nextest/test exit ${cargo_status}, Python part exit ${python_status})" >&2
    exit 1
fi

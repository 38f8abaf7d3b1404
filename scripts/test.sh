#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs the NIXL runtime (and
# with it the UCX the real tests load) and etcd, then runs every test of the
# workspace, then builds the Python package and runs its pytest suite.
# Extra arguments go to `cargo test`.
#
# Real-runtime tests print SKIPPED when the runtime cannot be loaded; with
# NIXL_KEEPALIVE_REQUIRE_REAL=1 (set by CI) a missing runtime fails instead.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/install-nixl.sh
# etcd (the membership tests start their own on a free loopback port) and
# protoc (the etcd-client crate's build script needs it).
bash scripts/install-etcd.sh

# The real tests spawn the `nixl-keepalive prefill` binary and check the
# fuzz corpus; everything runs in one cargo invocation.
# The CLI's `etcd` feature is on here: its real membership tests run.
cargo test --workspace --locked --features nixl-keepalive-cli/etcd "$@"

# The Python package (python/, `nixl_keepalive`): a venv under the checkout
# with NIXL's Python API (the same pinned wheel), the package built as a
# wheel with maturin and installed there, then its pytest suite: the API's
# rules over a recording agent, and the vLLM-shaped example decode against
# real prefill processes (the binary cargo test just built). Real tests
# print SKIPPED without the runtime, and fail under
# NIXL_KEEPALIVE_REQUIRE_REAL=1 or CI=true.
bash scripts/install-python.sh
wheels="target/python-wheel"
rm -rf "${wheels}"
.venv/bin/maturin build --locked --manifest-path python/Cargo.toml --out "${wheels}"
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "${wheels}"/nixl_keepalive-*.whl
.venv/bin/python -m pytest python/tests

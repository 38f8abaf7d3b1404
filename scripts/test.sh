#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs the NIXL runtime (and
# with it the UCX the real tests load) and etcd, then runs every test of the
# workspace. Extra arguments go to `cargo test`.
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

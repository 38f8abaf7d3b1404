#!/usr/bin/env bash
# cargo-nextest, the test runner scripts/test.sh uses (.config/nextest.toml
# says why). CI's machines come with it; where it is missing this installs
# it from crates.io with cargo (a few minutes on 2 cores, once). Idempotent:
# exits at once when `cargo nextest` answers.
set -euo pipefail

if version="$(cargo nextest --version 2>/dev/null | head -n 1)" && [[ -n "${version}" ]]; then
    echo "${version} already installed"
    exit 0
fi
echo "cargo-nextest not found: installing it from crates.io (cargo install --locked cargo-nextest)"
cargo install --locked cargo-nextest
cargo nextest --version | head -n 1

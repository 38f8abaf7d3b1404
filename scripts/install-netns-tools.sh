#!/usr/bin/env bash
# Installs iproute2 (`ip`), which the real network-partition test
# (cli/tests/real_partition.rs) uses to make a network namespace and a veth
# pair. Idempotent: does nothing when `ip` is already there. The test
# itself also needs root; without it (or without `ip`) it prints SKIPPED,
# and fails under CI=true.
set -euo pipefail

if command -v ip >/dev/null 2>&1; then
    echo "install-netns-tools: already installed: $(ip -V)"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
        echo "install-netns-tools: not root and no sudo: install iproute2 yourself" >&2
        exit 1
    fi
    SUDO="sudo"
fi
echo "install-netns-tools: installing iproute2"
$SUDO apt-get update
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends iproute2
ip -V

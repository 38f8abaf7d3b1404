#!/usr/bin/env bash
# Installs the system UCX (Debian: libucx0, libucx-dev, ucx-utils) that
# ucx-sys falls back to when no NIXL runtime with a bundled UCX is present.
# Idempotent: does nothing when the libraries are already installed.
set -euo pipefail

packages=(libucx0 libucx-dev ucx-utils)

missing=()
for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done

if [ "${#missing[@]}" -eq 0 ]; then
    echo "install-ucx: already installed: ${packages[*]}"
else
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
        SUDO="sudo"
    fi
    echo "install-ucx: installing ${missing[*]}"
    $SUDO apt-get update
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends "${missing[@]}"
fi

if command -v ucx_info >/dev/null 2>&1; then
    ucx_info -v | head -n 2
fi

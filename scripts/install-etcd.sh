#!/usr/bin/env bash
# Installs what the membership tests and the `etcd` feature need, from
# Debian's packages: `etcd` and `etcdctl` (etcd-server, etcd-client) for the
# real tests, and `protoc` (protobuf-compiler), which the build script of the
# `etcd-client` crate runs to compile etcd's protocol files (it never
# downloads anything), with protobuf's own .proto files (libprotobuf-dev;
# without them protoc fails on google/protobuf/descriptor.proto). Idempotent: exits at once when all three commands are
# there, and runs `apt-get update` only when a package is not installable
# from the lists already on the machine.
#
# Environment:
#   PROTOC  an explicit protoc (then protobuf-compiler is not installed)
set -euo pipefail

need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || need+=(etcd-client)
if [[ -z "${PROTOC:-}" ]]; then
    command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
    [[ -f /usr/include/google/protobuf/descriptor.proto ]] || need+=(libprotobuf-dev)
fi

if [[ ${#need[@]} -eq 0 ]]; then
    echo "etcd $(etcd --version 2>/dev/null | sed -n 's/^etcd Version: //p') and protoc already installed"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "error: missing ${need[*]} and no apt-get here; install etcd 3.4+ (etcd, etcdctl) and protoc by hand" >&2
    exit 1
fi
sudo=()
if [[ "$(id -u)" -ne 0 ]]; then
    command -v sudo >/dev/null 2>&1 || { echo "error: installing ${need[*]} needs root" >&2; exit 1; }
    sudo=(sudo)
fi

export DEBIAN_FRONTEND=noninteractive
# Lists are fetched only when a package is unknown to the ones already here.
for p in "${need[@]}"; do
    if ! apt-cache show "$p" >/dev/null 2>&1; then
        "${sudo[@]}" apt-get update -q
        break
    fi
done
echo "installing ${need[*]}"
"${sudo[@]}" apt-get install -y -q --no-install-recommends "${need[@]}"

for c in etcd etcdctl; do
    command -v "$c" >/dev/null 2>&1 || { echo "error: $c still missing after apt-get install" >&2; exit 1; }
done
if [[ -z "${PROTOC:-}" ]]; then
    command -v protoc >/dev/null 2>&1 || { echo "error: protoc still missing" >&2; exit 1; }
    [[ -f /usr/include/google/protobuf/descriptor.proto ]] || { echo "error: google/protobuf/descriptor.proto still missing" >&2; exit 1; }
fi
echo "installed: $(etcd --version | head -n1), $(protoc --version)"

#!/usr/bin/env bash
# Builds the self-contained bundle that the GPU check (scripts/gpu-check.sh)
# runs from on a lent GPU machine, where nothing can be installed and at most
# 64 MiB travel (tracked files plus carried paths): a stripped release binary
# of `nixl-keepalive` and the part of the NIXL runtime (.nixl-runtime, from
# scripts/install-nixl.sh) that VRAM over UCX's cuda_ipc needs, in the
# runtime's own relative layout so every library's RPATH $ORIGIN still
# resolves. See docs/gpu-check.md.
#
#   bash scripts/gpu-bundle.sh [--bin PATH] [--no-travel-limit] [OUTDIR]
#                                                       (default target/gpu-bundle)
#
# --bin PATH bundles that binary (stripped) instead of building
#   `cargo build --release --locked -p nixl-keepalive-cli --no-default-features`.
# --no-travel-limit skips the 64 MiB checks: for a bundle that never travels
#   (the tests bundle their debug binary, about 20 MB stripped against the
#   release binary's 5, to exercise the scripts on DRAM; the release
#   bundle's size is checked where it is built, CI's GPU bundle step).
#
# What is bundled is computed, not listed: the ELF NEEDED entries
# (readelf -d) of libnixl.so, libnixl_capi.so and plugins/libplugin_UCX.so,
# followed transitively through the runtime's own files. UCX opens its
# transport modules (nixl_cu12.libs/ucx/) with dlopen, so no NEEDED entry
# names them: each module is kept when everything it NEEDs is in the bundle,
# on this system, or one of the NVIDIA driver's own libraries (the device
# machine has those; this one has none); the RDMA providers (InfiniBand,
# mlx5 and its GPU-direct variants) and UCX's perftest modules are left out
# on purpose. The dropped modules, and why, go to OUTDIR/MANIFEST.txt and to
# stdout. Then every file is checked with ldd (LD_LIBRARY_PATH unset): a
# NEEDED library found nowhere, other than the driver's, fails the build.
# Fails when the bundle is 64 MiB or more, or when it and the working tree
# that travels with it are. Idempotent: it builds into a staging folder and
# swaps it in. Never downloads anything.
#
# Environment: NIXL_RUNTIME_DIR (default <repo>/.nixl-runtime),
# CARGO_TARGET_DIR (default <repo>/target).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo_root}"

readonly LIMIT=$((64 * 1024 * 1024))
# The NVIDIA driver's libraries: on the GPU machine, never in the bundle.
readonly DRIVER_LIBS=" libcuda.so.1 libnvidia-ml.so.1 "
readonly NIXL_DIR=".nixl_cu12.mesonpy.libs"
readonly DEPS_DIR="nixl_cu12.libs"

bin=""
out=""
travel_limit=1
while [[ $# -gt 0 ]]; do
    case "$1" in
        --no-travel-limit) travel_limit=0; shift ;;
        --bin) bin="$2"; shift 2 ;;
        --bin=*) bin="${1#--bin=}"; shift ;;
        -h|--help) sed -n '2,30p' "${BASH_SOURCE[0]}"; exit 0 ;;
        -*) echo "gpu-bundle.sh: unknown option $1" >&2; exit 2 ;;
        *) out="$1"; shift ;;
    esac
done
target_dir="${CARGO_TARGET_DIR:-${repo_root}/target}"
out="${out:-${target_dir}/gpu-bundle}"
runtime="${NIXL_RUNTIME_DIR:-${repo_root}/.nixl-runtime}"

for tool in readelf ldd strip du; do
    command -v "${tool}" >/dev/null 2>&1 || { echo "gpu-bundle.sh: '${tool}' is required" >&2; exit 1; }
done
if [[ ! -f "${runtime}/${NIXL_DIR}/libnixl.so" ]]; then
    echo "gpu-bundle.sh: no NIXL runtime in ${runtime}: run 'bash scripts/install-nixl.sh' first" >&2
    exit 1
fi

if [[ -z "${bin}" ]]; then
    echo "== building the release binary (--no-default-features: no demo, no fake)"
    cargo build --release --locked -p nixl-keepalive-cli --no-default-features
    bin="${target_dir}/release/nixl-keepalive"
    bin_how="cargo build --release --locked -p nixl-keepalive-cli --no-default-features"
else
    bin_how="given: ${bin}"
fi
[[ -x "${bin}" ]] || { echo "gpu-bundle.sh: no executable at ${bin}" >&2; exit 1; }

out_parent="$(dirname "${out}")"
mkdir -p "${out_parent}"
stage="$(mktemp -d "${out_parent}/.gpu-bundle.staging.XXXXXX")"
trap 'rm -rf "${stage}"' EXIT
mkdir -p "${stage}/bin" "${stage}/runtime"

# --- the NEEDED closure -----------------------------------------------------
# Index of the runtime's files by name (NEEDED entries are bare names).
declare -A by_name=()
while IFS= read -r -d '' f; do
    rel="${f#"${runtime}"/}"
    name="$(basename "${f}")"
    [[ -z "${by_name[${name}]:-}" ]] && by_name["${name}"]="${rel}"
done < <(find "${runtime}/${NIXL_DIR}" "${runtime}/${DEPS_DIR}" -type f -name '*.so*' -print0)

needed_of() { readelf -d "$1" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }
# Whether this system's loader knows a library (not in the runtime).
system_libs="$(ldconfig -p 2>/dev/null | awk 'NR > 1 { print $1 }' | sort -u)"
on_system() { grep -q -x -F "$1" <<<"${system_libs}"; }

# closure ROOT...: prints the runtime-relative paths of the files reached,
# and sets `unresolved` to the NEEDED names found nowhere (driver libs
# excluded, listed in `driver_needed`) and `system_needed` to those this
# system provides.
closure() {
    declare -A seen=()
    local -a todo=("$@")
    unresolved=""
    driver_needed=""
    system_needed=""
    while [[ ${#todo[@]} -gt 0 ]]; do
        local rel="${todo[-1]}"
        unset 'todo[-1]'
        [[ -n "${seen[${rel}]:-}" ]] && continue
        seen["${rel}"]=1
        local n
        while IFS= read -r n; do
            [[ -z "${n}" ]] && continue
            if [[ -n "${by_name[${n}]:-}" ]]; then
                todo+=("${by_name[${n}]}")
            elif [[ "${DRIVER_LIBS}" == *" ${n} "* ]]; then
                [[ " ${driver_needed} " == *" ${n} "* ]] || driver_needed+="${n} "
            elif on_system "${n}"; then
                [[ " ${system_needed} " == *" ${n} "* ]] || system_needed+="${n} "
            else
                [[ " ${unresolved} " == *" ${n} "* ]] || unresolved+="${n} "
            fi
        done < <(needed_of "${runtime}/${rel}")
    done
    closure_files="$(printf '%s\n' "${!seen[@]}" | sort)"
}

roots=("${NIXL_DIR}/libnixl.so" "${NIXL_DIR}/libnixl_capi.so" "${NIXL_DIR}/plugins/libplugin_UCX.so")
closure "${roots[@]}"
if [[ -n "${unresolved}" ]]; then
    echo "gpu-bundle.sh: NIXL needs libraries found neither in the runtime nor on this system: ${unresolved}" >&2
    exit 1
fi
files="${closure_files}"
all_system="${system_needed}"
all_driver="${driver_needed}"

kept_modules=""
dropped=""
while IFS= read -r -d '' m; do
    rel="${m#"${runtime}"/}"
    name="$(basename "${m}")"
    case "${name}" in
        libuct_ib*)
            dropped+="${name}: RDMA provider (InfiniBand/mlx5 verbs): no RDMA device on one GPU"$'\n'
            continue ;;
        libucx_perftest*)
            dropped+="${name}: UCX's perftest module, not a transport"$'\n'
            continue ;;
    esac
    closure "${rel}"
    if [[ -n "${unresolved}" ]]; then
        dropped+="${name}: NEEDS ${unresolved% } (in neither the wheel nor this system; UCX skips the module when dlopen fails)"$'\n'
        continue
    fi
    kept_modules+="${name}${driver_needed:+ (from the NVIDIA driver: ${driver_needed% })}"$'\n'
    files+=$'\n'"${closure_files}"
    all_system+="${system_needed}"
    all_driver+="${driver_needed}"
done < <(find "${runtime}/${DEPS_DIR}/ucx" -maxdepth 1 -type f -name '*.so*' -print0 | sort -z)

files="$(printf '%s\n' "${files}" | sed '/^$/d' | sort -u)"
while IFS= read -r rel; do
    mkdir -p "${stage}/runtime/$(dirname "${rel}")"
    cp -p "${runtime}/${rel}" "${stage}/runtime/${rel}"
done <<<"${files}"

strip -o "${stage}/bin/nixl-keepalive" "${bin}"
chmod 755 "${stage}/bin/nixl-keepalive"

# --- ldd: nothing NEEDED is missing (the driver's libraries aside) ----------
missing=""
driver_missing_here=""
while IFS= read -r -d '' f; do
    while IFS= read -r lib; do
        if [[ "${DRIVER_LIBS}" == *" ${lib} "* ]]; then
            [[ " ${driver_missing_here} " == *" ${lib} "* ]] || driver_missing_here+="${lib} "
        else
            missing+="${f#"${stage}"/}: ${lib}"$'\n'
        fi
    done < <(env -u LD_LIBRARY_PATH ldd "${f}" 2>/dev/null | sed -n 's/^[[:space:]]*\([^ ]*\) => not found.*/\1/p')
done < <(find "${stage}" -type f \( -name '*.so*' -o -name nixl-keepalive \) -print0)
if [[ -n "${missing}" ]]; then
    echo "gpu-bundle.sh: ldd finds NEEDED libraries missing:" >&2
    printf '%s' "${missing}" >&2
    exit 1
fi

uniq_words() { tr ' ' '\n' <<<"$1" | sed '/^$/d' | sort -u | tr '\n' ' '; }
size="$(du -sb "${stage}" | cut -f1)"
bin_size="$(stat -c %s "${stage}/bin/nixl-keepalive")"
nfiles="$(find "${stage}/runtime" -type f | wc -l)"
{
    echo "nixl-keepalive GPU bundle (scripts/gpu-bundle.sh), $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (working tree modified)')"
    echo "binary: bin/nixl-keepalive, ${bin_size} bytes stripped (${bin_how})"
    echo "runtime: runtime/ (NIXL_PREFIX), ${nfiles} files from ${runtime}"
    echo "size: ${size} bytes"
    echo "system libraries needed on the device (not bundled): $(uniq_words "${all_system}")"
    echo "NVIDIA driver libraries needed on the device (not bundled): $(uniq_words "${all_driver}")"
    echo
    echo "UCX modules kept:"
    printf '%s' "${kept_modules}" | sed 's/^/  /'
    echo "UCX modules dropped:"
    printf '%s' "${dropped}" | sed 's/^/  /'
    echo
    echo "files:"
    (cd "${stage}" && find . -type f ! -name MANIFEST.txt -printf '%s %P\n' | sort -k2)
} >"${stage}/MANIFEST.txt"

if (( travel_limit && size >= LIMIT )); then
    echo "gpu-bundle.sh: the bundle is ${size} bytes, not under 64 MiB (${LIMIT})" >&2
    exit 1
fi
tree="$(git ls-files -co --exclude-standard -z 2>/dev/null | du --files0-from=- -cb 2>/dev/null | tail -n1 | cut -f1 || echo 0)"
tree="${tree:-0}"
if (( travel_limit && size + tree >= LIMIT )); then
    echo "gpu-bundle.sh: the bundle (${size} bytes) and the working tree that travels with it (${tree}) are 64 MiB or more" >&2
    exit 1
fi

rm -rf "${out}"
mv "${stage}" "${out}"
trap - EXIT

echo "UCX modules kept:"
printf '%s' "${kept_modules}" | sed 's/^/  /'
echo "UCX modules dropped:"
printf '%s' "${dropped}" | sed 's/^/  /'
echo "needed on the device, not bundled: $(uniq_words "${all_system} ${all_driver}")"
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
echo "GPU BUNDLE ${out}: ${size} bytes ($(mib "${size}") MiB; binary $(mib "${bin_size}") MiB, ${nfiles} runtime files), limit 64 MiB; with the working tree $(mib $((size + tree))) MiB"

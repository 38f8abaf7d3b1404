#!/usr/bin/env bash
# Builds the Python wheel users install, the one vLLM's and NIXL's hosts
# take: nixl_keepalive-<version>-cp310-abi3-manylinux_2_28_x86_64.whl
# (CPython 3.10 and later, glibc 2.28 and later: RHEL 8, Ubuntu 20.04,
# Debian 11), release code, no debug info. Then checks it, and fails
# naming each check that did not hold:
#
#   - its tag is cp310-abi3-manylinux_2_28_x86_64 (file name and WHEEL);
#   - the extension, and the endpoint-close interposer it embeds, need no
#     glibc symbol version above GLIBC_2.28, nor a libstdc++ one above
#     RHEL 8's (GLIBCXX_3.4.25, CXXABI_1.3.11) (objdump -T, read here,
#     beside maturin's own manylinux check);
#   - the extension has no .debug_* section (readelf -S);
#   - the wheel is under WHEEL_MAX_BYTES (default 3 MiB; measured 1.5 MB)
#     and unpacks to under UNPACKED_MAX_BYTES (default 8 MiB; measured
#     3.8 MB);
#   - it installs into an empty venv and imports there, with no NIXL
#     (`nixl_keepalive.Config()`, `endpoint_close_mode()`).
#
#   bash scripts/build-wheel.sh [OUTDIR]     # default OUTDIR: target/wheelhouse
#
# The wheel is the only nixl_keepalive-*.whl left in OUTDIR. Idempotent:
# tools already installed are kept, and cargo rebuilds only what changed
# (a first build takes about 3 minutes on 2 cores).
#
# How: maturin --zig (maturin from python/requirements-dev.txt, ziglang
# from python/requirements-wheel.txt, both pinned, into <repo>/.venv) with
# --compatibility manylinux_2_28, cargo profile `wheel` (Cargo.toml).
# nixl-sys's C++ shim hands std::string objects to libnixl.so, so it must
# be compiled against libstdc++, not the libc++ that zig c++ brings: it is
# compiled by zig c++ against this machine's GCC headers (g++ is required)
# and glibc 2.28's headers (zig's), and linked to libstdc++.so.6. The shim
# itself refuses any other standard library (#error).
set -Eeuo pipefail
# Whatever else stops it says where.
trap 'echo "build-wheel.sh: FAILED at line ${LINENO}: ${BASH_COMMAND}" >&2' ERR
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo="$(pwd)"
out="${1:-${repo}/target/wheelhouse}"
max_bytes="${WHEEL_MAX_BYTES:-3145728}"
max_unpacked="${UNPACKED_MAX_BYTES:-8388608}"
glibc_floor="2.28"
tag="cp310-abi3-manylinux_${glibc_floor/./_}_x86_64"
triple="x86_64-unknown-linux-gnu"
start=$(date +%s)

fail() { echo "build-wheel.sh: $*" >&2; exit 1; }

[[ "$(uname -m)" == "x86_64" ]] || fail "the wheel is x86_64 only; this machine is $(uname -m)"
for tool in g++ objdump readelf sha256sum; do
    command -v "${tool}" >/dev/null 2>&1 \
        || fail "'${tool}' is required but not found (Debian: apt-get install g++ binutils coreutils)"
done

# The tools: maturin (install-python.sh), then ziglang, each idempotent.
bash scripts/install-python.sh
venv="${repo}/.venv"
requirements="${repo}/python/requirements-wheel.txt"
stamp="${venv}/.nixl-keepalive-wheel-tools"
want="$(sha256sum "${requirements}" | cut -d' ' -f1)"
if [[ ! -f "${stamp}" || "$(cat "${stamp}")" != "${want}" ]]; then
    echo "Installing the wheel's tools (${requirements#"${repo}/"}) into ${venv}"
    "${venv}/bin/python" -m pip install --quiet --disable-pip-version-check --require-hashes -r "${requirements}"
    printf '%s\n' "${want}" >"${stamp}"
fi
# maturin finds zig as `python -m ziglang` of the python on PATH.
export PATH="${venv}/bin:${PATH}"

# GCC's libstdc++ headers: the include directories g++ searches that are
# its C++ library's (…/c++/<version>…).
cxx_includes=()
while read -r dir; do
    cxx_includes+=("-I${dir}")
done < <(g++ -E -x c++ -v - </dev/null 2>&1 | sed -n '/^#include <...> search starts here:/,/^End of search list/p' \
    | sed -n 's|^ \(/.*/c++/[^ ]*\)$|\1|p')
((${#cxx_includes[@]} > 0)) || fail "cannot find libstdc++'s headers in g++'s include path (g++ -E -x c++ -v -)"
libstdcxx="$(g++ -print-file-name=libstdc++.so)"
[[ "${libstdcxx}" == /* && -e "${libstdcxx}" ]] \
    || fail "g++ has no libstdc++.so (got '${libstdcxx}'; Debian: apt-get install libstdc++-<N>-dev for g++ <N>)"

# cc-rs (nixl-sys/build.rs) reads these for the target: zig c++ against
# GCC's headers, glibc 2.28's stand-ins first (nixl-sys/shim/compat-glibc-2.28),
# and no `-lstdc++`, which zig would take for its own libc++; the link
# names libstdc++.so.6 instead.
triple_env="${triple//-/_}"
export "CXXFLAGS_${triple_env}=-nostdinc++ -I${repo}/nixl-sys/shim/compat-glibc-${glibc_floor} ${cxx_includes[*]}"
export "CXXSTDLIB_${triple_env}="
export "CARGO_TARGET_${triple_env^^}_RUSTFLAGS=-C link-arg=${libstdcxx}"
# Either would replace the flags above (cargo takes the first it finds).
for var in RUSTFLAGS CARGO_ENCODED_RUSTFLAGS; do
    if [[ -n "${!var:-}" ]]; then
        echo "build-wheel.sh: ignoring ${var}=${!var} (the wheel is built with its own flags)" >&2
        unset "${var}"
    fi
done

mkdir -p "${out}"
rm -f "${out}"/nixl_keepalive-*.whl
echo "Building the release wheel (maturin --zig, manylinux_${glibc_floor/./_}, profile wheel) into ${out}"
build_start=$(date +%s)
maturin build --locked --zig --compatibility "manylinux_${glibc_floor/./_}" --profile wheel \
    --manifest-path python/Cargo.toml --out "${out}"
build_s=$(( $(date +%s) - build_start ))

# --- the checks ---------------------------------------------------------
shopt -s nullglob
wheels=("${out}"/nixl_keepalive-*.whl)
shopt -u nullglob
((${#wheels[@]} == 1)) || fail "expected one nixl_keepalive-*.whl in ${out}, found ${#wheels[@]}"
wheel="${wheels[0]}"
name="$(basename "${wheel}")"
work="$(mktemp -d "${TMPDIR:-/tmp}/build-wheel.XXXXXX")"
trap 'rm -rf "${work}"' EXIT
"${venv}/bin/python" -m zipfile -e "${wheel}" "${work}/unpacked"

problems=()
[[ "${name}" == *"-${tag}.whl" ]] || problems+=("its file name ${name} does not end in -${tag}.whl")
wheel_tags="$(cat "${work}"/unpacked/*.dist-info/WHEEL | sed -n 's/^Tag: //p' | tr '\n' ' ')"
[[ "${wheel_tags}" == "${tag} " ]] || problems+=("its WHEEL says 'Tag: ${wheel_tags}', not exactly '${tag}'")

so="${work}/unpacked/nixl_keepalive/_native.abi3.so"
[[ -f "${so}" ]] || fail "${name} has no nixl_keepalive/_native.abi3.so"

# The highest version of one family (GLIBC, GLIBCXX, CXXABI) a file needs.
max_version() {
    objdump -T "$2" | { grep -oE "\b$1_[0-9]+(\.[0-9]+)+\b" || true; } | sed "s/^$1_//" | sort -uV | tail -n 1
}
# The interposer is embedded in the extension (nixl-sys/build.rs builds it
# in OUT_DIR; runtime.rs loads it from a memfd), where no manylinux check
# sees it: checked from the build that went into this wheel.
interposer=""
for file in target/"${triple}"/wheel/build/nixl-sys-*/out/libnixl_sys_ep_close.so; do
    if [[ -f "${file}" && ( -z "${interposer}" || "${file}" -nt "${interposer}" ) ]]; then interposer="${file}"; fi
done
[[ -n "${interposer}" ]] || problems+=("the endpoint-close interposer (target/${triple}/wheel/build/nixl-sys-*/out/libnixl_sys_ep_close.so) was not found to check")
# Each family's ceiling: glibc 2.28's, and for the C++ runtime RHEL 8's
# libstdc++ (GCC 8: GLIBCXX_3.4.25, CXXABI_1.3.11), the oldest that a
# glibc 2.28 host has.
check_max() {
    local family="$1" ceiling="$2" file="$3" v
    v="$(max_version "${family}" "${file}")"
    [[ -n "${v}" ]] || return 0
    if [[ "$(printf '%s\n%s\n' "${v}" "${ceiling}" | sort -V | tail -n 1)" != "${ceiling}" ]]; then
        problems+=("$(basename "${file}") needs ${family}_${v}, above ${family}_${ceiling}: $(objdump -T "${file}" | grep -E "${family}_${v//./\\.}\b" | awk '{print $NF}' | tr '\n' ' ')")
    fi
}
glibc_max="$(max_version GLIBC "${so}")"
for file in "${so}" ${interposer:+"${interposer}"}; do
    [[ -n "$(max_version GLIBC "${file}")" ]] \
        || problems+=("$(basename "${file}") has no GLIBC_ symbol versions: objdump -T read nothing")
    check_max GLIBC "${glibc_floor}" "${file}"
    check_max GLIBCXX 3.4.25 "${file}"
    check_max CXXABI 1.3.11 "${file}"
done

debug_sections="$(readelf -S -W "${so}" | grep -oE '\.(debug|zdebug)[_a-z.]*' | sort -u | tr '\n' ' ' || true)"
[[ -z "${debug_sections}" ]] || problems+=("the extension has debug sections: ${debug_sections}")

size=$(stat -c %s "${wheel}")
unpacked=$(du -sb "${work}/unpacked" | cut -f1)
(( size <= max_bytes )) || problems+=("the wheel is ${size} bytes, over the ceiling of ${max_bytes} (WHEEL_MAX_BYTES)")
(( unpacked <= max_unpacked )) || problems+=("the wheel unpacks to ${unpacked} bytes, over the ceiling of ${max_unpacked} (UNPACKED_MAX_BYTES)")

# Installs and imports into an empty venv: no NIXL, no site packages.
"${venv}/bin/python" -m venv --without-pip "${work}/venv"
if ! "${venv}/bin/python" -m pip --python "${work}/venv/bin/python" install --quiet --disable-pip-version-check \
    --no-index --no-deps "${wheel}"; then
    problems+=("pip refused to install ${name} into an empty venv")
elif ! smoke="$(cd "${work}" && "${work}/venv/bin/python" -c '
import nixl_keepalive as nk
nk.Config()
print("yes, endpoint_close_mode", nk.endpoint_close_mode())
' 2>&1)"; then
    problems+=("it does not import in an empty venv: ${smoke}")
    smoke=""
fi

mb() { awk -v b="$1" 'BEGIN { printf "%.2f MB", b / 1e6 }'; }
echo "-- ${wheel}"
echo "--   tag ${tag}; ${size} bytes ($(mb "${size}"), ceiling $(mb "${max_bytes}")), ${unpacked} bytes unpacked ($(mb "${unpacked}"), ceiling $(mb "${max_unpacked}"))"
echo "--   needs GLIBC_${glibc_max:-?} (floor ${glibc_floor}), GLIBCXX_$(max_version GLIBCXX "${so}"), CXXABI_$(max_version CXXABI "${so}"); NEEDED: $(readelf -d "${so}" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')"
echo "--   interposer ${interposer:+needs GLIBC_$(max_version GLIBC "${interposer}")}; debug sections: ${debug_sections:-none}"
echo "--   imports in an empty venv: ${smoke:-no}"
echo "--   built in ${build_s}s, all in $(( $(date +%s) - start ))s"
if ((${#problems[@]} > 0)); then
    for p in "${problems[@]}"; do echo "build-wheel.sh: FAILED: ${p}" >&2; done
    exit 1
fi
echo "build-wheel.sh: ${name} passed every check"

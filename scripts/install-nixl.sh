#!/usr/bin/env bash
# Installs the NIXL runtime (libraries only, with the bundled UCX) from the
# pinned PyPI wheel into <repo root>/.nixl-runtime. Idempotent: when the
# stamp says this exact wheel is already installed, it exits at once.
#
# No Python is needed at run time; python3/pip are used here only to fetch
# and unpack the wheel.
#
# Environment:
#   NIXL_WHEEL        path to an already downloaded wheel (skips pip download;
#                     the sha256 is still checked)
#   NIXL_RUNTIME_DIR  install here instead of <repo root>/.nixl-runtime
#   PIP               pip command to use (default: "python3 -m pip")
set -euo pipefail

readonly NIXL_VERSION="1.5.1"
readonly WHEEL_NAME="nixl_cu12-${NIXL_VERSION}-cp311-cp311-manylinux_2_28_x86_64.whl"
readonly WHEEL_SHA256="341d0dfa499f941c054614252f1d8047d1380e33f29c87707372ff5ec7d3779a"
# Only these folders are extracted; they must keep their relative layout
# because every library finds its neighbours through RPATH $ORIGIN.
readonly LIB_DIRS=(".nixl_cu12.mesonpy.libs/" "nixl_cu12.libs/")
# Left out: UCX's EFA transport module. It is the one UCX module that links a
# library the wheel does not bundle (libefa.so.1), so it only loads on a
# machine with rdma-core installed, and then drags the system libibverbs and
# libnl into the process next to the wheel's bundled copies; at exit the two
# libnl-route copies' destructors crash (SIGSEGV in rtnl_tc_unregister, seen
# on this kind of machine). EFA (AWS) is not used here; IB/mlx5 stay.
readonly EXCLUDE_RE='^nixl_cu12\.libs/ucx/libuct_ib_efa\.'

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${NIXL_RUNTIME_DIR:-${repo_root}/.nixl-runtime}"
stamp="${dest}/.installed"
expected_stamp="nixl-cu12==${NIXL_VERSION} sha256=${WHEEL_SHA256} exclude=uct_ib_efa"

if [[ -f "${stamp}" && "$(cat "${stamp}")" == "${expected_stamp}" \
      && -f "${dest}/.nixl_cu12.mesonpy.libs/libnixl.so" ]]; then
    echo "NIXL runtime ${NIXL_VERSION} already installed in ${dest}"
    exit 0
fi

for tool in python3 sha256sum; do
    if ! command -v "${tool}" >/dev/null 2>&1; then
        echo "install-nixl.sh: '${tool}' is required but not found" >&2
        exit 1
    fi
done

work="$(mktemp -d "${TMPDIR:-/tmp}/install-nixl.XXXXXX")"
trap 'rm -rf "${work}"' EXIT

if [[ -n "${NIXL_WHEEL:-}" ]]; then
    wheel="${NIXL_WHEEL}"
    echo "Using pre-downloaded wheel ${wheel}"
else
    echo "Downloading nixl-cu12==${NIXL_VERSION} with pip"
    read -r -a pip_cmd <<<"${PIP:-python3 -m pip}"
    "${pip_cmd[@]}" download --no-deps --only-binary=:all: \
        --python-version 3.11 --platform manylinux_2_28_x86_64 \
        --dest "${work}" "nixl-cu12==${NIXL_VERSION}"
    wheel="${work}/${WHEEL_NAME}"
fi

if [[ ! -f "${wheel}" ]]; then
    echo "install-nixl.sh: wheel not found at ${wheel}" >&2
    exit 1
fi

actual="$(sha256sum "${wheel}" | cut -d' ' -f1)"
if [[ "${actual}" != "${WHEEL_SHA256}" ]]; then
    echo "install-nixl.sh: sha256 mismatch for ${wheel}" >&2
    echo "  expected ${WHEEL_SHA256}" >&2
    echo "  actual   ${actual}" >&2
    exit 1
fi

# Extract into a staging folder next to the destination, then swap it in,
# so an interrupted run never leaves a half-installed runtime behind.
mkdir -p "$(dirname "${dest}")"
staging="$(mktemp -d "$(dirname "${dest}")/.nixl-runtime.staging.XXXXXX")"
trap 'rm -rf "${work}" "${staging}"' EXIT

python3 - "${wheel}" "${staging}" "${EXCLUDE_RE}" "${LIB_DIRS[@]}" <<'PY'
import os, re, sys, zipfile
wheel, out, exclude = sys.argv[1], sys.argv[2], re.compile(sys.argv[3])
prefixes = tuple(sys.argv[4:])
count = 0
with zipfile.ZipFile(wheel) as zf:
    for info in zf.infolist():
        name = info.filename
        if not name.startswith(prefixes) or name.endswith("/") or exclude.search(name):
            continue
        if os.path.isabs(name) or ".." in name.split("/"):
            sys.exit(f"refusing unsafe path in wheel: {name}")
        zf.extract(info, out)
        mode = (info.external_attr >> 16) & 0o777
        os.chmod(os.path.join(out, name), mode or 0o755)
        count += 1
if count == 0:
    sys.exit("no library files found in the wheel")
print(f"extracted {count} files")
PY

chmod 755 "${staging}"
printf '%s\n' "${expected_stamp}" >"${staging}/.installed"
rm -rf "${dest}"
mv "${staging}" "${dest}"
# nixl-sys's build script decides whether the real tests run (cfg
# nixl_runtime) and cannot watch a runtime that did not exist yet: a newer
# build.rs makes cargo run it again, so the tests built without the runtime
# stop being ignored.
touch "${repo_root}/nixl-sys/build.rs"

echo "NIXL runtime ${NIXL_VERSION} installed in ${dest}"
echo "  libnixl.so: ${dest}/.nixl_cu12.mesonpy.libs/libnixl.so"

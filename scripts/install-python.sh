#!/usr/bin/env bash
# Makes the Python environment the `nixl_keepalive` package is built and
# tested in: a venv at <repo root>/.venv (ignored by git) with the NIXL
# Python API (the `nixl-cu12` wheel, the same version and sha256 that
# scripts/install-nixl.sh pins for the runtime), maturin, pytest and numpy
# (python/requirements-dev.txt). Idempotent: when the stamp says this exact
# set is installed, it exits at once.
#
# The wheel is installed without its declared dependencies: it requires
# `torch`, which its Python API imports only when handed a tensor (it
# consults sys.modules), and which would be gigabytes here; `numpy`, the
# other one, comes from requirements-dev.txt.
#
# Environment:
#   NIXL_WHEEL   path to an already downloaded wheel (the sha256 is still
#                checked)
#   VENV_DIR     the venv to make (default: <repo root>/.venv)
#   PYTHON       the interpreter to make it with (default: python3; 3.11,
#                as the wheel is cp311)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV_DIR:-${repo_root}/.venv}"
python="${PYTHON:-python3}"
requirements="${repo_root}/python/requirements-dev.txt"

# One source of truth for the pinned wheel: scripts/install-nixl.sh.
pin() {
    sed -n "s/^readonly $1=\"\(.*\)\"$/\1/p" "${repo_root}/scripts/install-nixl.sh"
}
nixl_version="$(pin NIXL_VERSION)"
wheel_sha256="$(pin WHEEL_SHA256)"
wheel_name="$(pin WHEEL_NAME | sed "s/\${NIXL_VERSION}/${nixl_version}/")"
if [[ -z "${nixl_version}" || -z "${wheel_sha256}" || -z "${wheel_name}" ]]; then
    echo "install-python.sh: cannot read the NIXL pin from scripts/install-nixl.sh" >&2
    exit 1
fi

stamp="${venv}/.nixl-keepalive-installed"
expected_stamp="nixl-cu12==${nixl_version} sha256=${wheel_sha256} requirements=$(sha256sum "${requirements}" | cut -d' ' -f1)"
if [[ -f "${stamp}" && "$(cat "${stamp}")" == "${expected_stamp}" && -x "${venv}/bin/python" ]]; then
    echo "Python environment already installed in ${venv}"
    exit 0
fi

for tool in "${python}" sha256sum; do
    if ! command -v "${tool}" >/dev/null 2>&1; then
        echo "install-python.sh: '${tool}' is required but not found" >&2
        exit 1
    fi
done
version="$("${python}" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [[ "${version}" != "3.11" ]]; then
    echo "install-python.sh: ${python} is Python ${version}; the pinned NIXL wheel is for CPython 3.11 (set PYTHON)" >&2
    exit 1
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/install-python.XXXXXX")"
trap 'rm -rf "${work}"' EXIT

if [[ -n "${NIXL_WHEEL:-}" ]]; then
    wheel="${NIXL_WHEEL}"
else
    echo "Downloading nixl-cu12==${nixl_version} with pip"
    "${python}" -m pip download --no-deps --only-binary=:all: \
        --python-version 3.11 --platform manylinux_2_28_x86_64 \
        --dest "${work}" "nixl-cu12==${nixl_version}"
    wheel="${work}/${wheel_name}"
fi
actual="$(sha256sum "${wheel}" | cut -d' ' -f1)"
if [[ "${actual}" != "${wheel_sha256}" ]]; then
    echo "install-python.sh: sha256 mismatch for ${wheel}" >&2
    echo "  expected ${wheel_sha256}" >&2
    echo "  actual   ${actual}" >&2
    exit 1
fi

rm -f "${stamp}"
if [[ ! -x "${venv}/bin/python" ]]; then
    "${python}" -m venv "${venv}"
fi
"${venv}/bin/python" -m pip install --quiet --disable-pip-version-check -r "${requirements}"
"${venv}/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "${wheel}"
"${venv}/bin/python" -c 'import nixl_cu12; print("nixl_cu12 imports from", nixl_cu12.__file__)'
printf '%s\n' "${expected_stamp}" >"${stamp}"
echo "Python environment installed in ${venv}"

#!/usr/bin/env bash
# Makes the environment the vLLM tier runs in (scripts/test-vllm.sh): a venv
# at <repo root>/.venv-vllm (ignored by git) with
#   - vLLM ${VLLM_VERSION} from PyPI, one of the releases the tier is run on:
#     0.34.0 (the default, the current release) or 0.33.0; both pin torch
#     2.14.0 (about 4.6 GB downloaded, the venv 9.6 GB, 69 s in all here),
#     installed with uv (scripts/tier-lib.sh says why not pip) through its
#     cache <repo root>/.uv-cache (TIER_UV_CACHE), which the venv's files
#     are hard links into,
#   - NIXL's Python API as vLLM imports it: the meta package nixl==1.5.1 and,
#     for this torch (CUDA 13), nixl-cu13==1.5.1, both with --no-deps (their
#     declared dependencies would pull another torch),
#   - the test extras: pytest, pytest-timeout, pytest-asyncio, tblib, and ray
#     (vLLM's test_nixl_connector.py imports it at module level),
#   - that vLLM's own unit tests: the wheel has none, so its sdist is
#     fetched with pip (vLLM's build requirements installed first, then
#     `pip download --no-binary vllm --no-build-isolation` with
#     VLLM_TARGET_DEVICE=empty and VLLM_VERSION_OVERRIDE=<version>, see
#     docs/vllm.md) and its tests/ unpacked to <venv>/vllm-sdist/ (outside
#     git). Nothing of it is edited on disk.
# Idempotent: when the stamp says this exact set is installed, it exits at
# once. Nothing else in the repository downloads anything for this tier.
#
# Environment:
#   VLLM_VERSION  0.34.0 (default) or 0.33.0: the releases the tier is run on
#                 (docs/vllm.md); any other value stops here
#   VLLM_VENV   the venv to make or complete (default: <repo root>/.venv-vllm);
#               an existing venv that already has that vLLM is completed,
#               not reinstalled; one with another vLLM has it replaced
#   PYTHON      the interpreter to make it with (default: python3, >= 3.10)
set -euo pipefail
# shellcheck source=scripts/tier-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/tier-lib.sh"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VLLM_VENV:-${repo_root}/.venv-vllm}"
python="${PYTHON:-python3}"

# The releases the tier runs on: the ones python/nixl_keepalive/vllm.py
# lists as tested (TESTED_VLLM).
readonly TESTED_VLLM_VERSIONS="0.34.0 0.33.0"
VLLM_VERSION="${VLLM_VERSION:-0.34.0}"
if [[ " ${TESTED_VLLM_VERSIONS} " != *" ${VLLM_VERSION} "* ]]; then
    echo "install-vllm.sh: VLLM_VERSION=${VLLM_VERSION} is not a release the tier runs on;" \
        "accepted: ${TESTED_VLLM_VERSIONS}" >&2
    exit 2
fi
readonly VLLM_VERSION
# A requirement of a vLLM release that the package index cannot serve, and
# what is installed in its place ("old=>new"). vLLM 0.34.0 pins
# flashinfer-python==0.7.3, which is not on the index (2026-12-04: 0.7.2.post1,
# 0.7.2 and 0.7.4 are), so `pip install vllm==0.34.0` fails to resolve;
# 0.7.4 stands in (uv's --overrides: every other requirement as vLLM's
# metadata lists it). FlashInfer is CUDA attention kernels: the tier runs
# vLLM on CPU and never loads it.
declare -A REQUIREMENT_SUBSTITUTES=(
    ["0.34.0"]="flashinfer-python==0.7.3=>flashinfer-python==0.7.4"
)
# What uv must not resolve the way it would on its own (uv's --constraints).
# FlashInfer wants cuda-python>=12.0, and cuda-python 13.x pins
# cuda-bindings to its own version (newest 13.4.4), while CUTLASS's DSL
# wants cuda-bindings>=12.8 (newest 13.5.0). uv takes cuda-bindings 13.5.0
# and then cuda-python 12.6.2.post1, which predates the split and ships
# cuda/bindings/ itself: its files overwrite 13.5.0's, and vLLM's import of
# CUTLASS fails (no cudaLibrary_t). pip resolved cuda-python 13 here. The
# final check below refuses any two packages that install one file.
readonly RESOLUTION_CONSTRAINTS=("cuda-python>=13")
readonly NIXL_VERSION="1.5.1"
# ray: vLLM's test_nixl_connector.py imports it at module level.
readonly TEST_EXTRAS="pytest pytest-timeout pytest-asyncio tblib ray"
# NVIDIA Dynamo's vLLM launcher, for its connector-name check only
# (dynamo/vllm/kv_connector_protocols.py imports just the standard library):
# --no-deps, its native runtime is not needed.
readonly DYNAMO="ai-dynamo==1.6.1"
readonly BUILD_REQUIREMENTS='cmake ninja setuptools>=77.0.3,<81 setuptools-scm>=8 setuptools-rust>=1.9 wheel jinja2 packaging'

stamp="${venv}/.nixl-keepalive-vllm-installed"
expected_stamp="vllm==${VLLM_VERSION} constraints=${RESOLUTION_CONSTRAINTS[*]} nixl==${NIXL_VERSION} nixl-cu13==${NIXL_VERSION} extras=${TEST_EXTRAS} ${DYNAMO} sdist-tests=${VLLM_VERSION}"
sdist_dir="${venv}/vllm-sdist"
if [[ -f "${stamp}" && "$(cat "${stamp}")" == "${expected_stamp}" && -x "${venv}/bin/python" \
      && -f "${sdist_dir}/tests/v1/kv_connector/unit/test_nixl_connector.py" ]]; then
    echo "vLLM environment already installed in ${venv}"
    exit 0
fi

echo "install-vllm.sh: making the vLLM ${VLLM_VERSION} environment in ${venv}"
start=$(date +%s)
rm -f "${stamp}"
tier_make_venv install-vllm.sh "${python}" "${venv}" "vLLM ${VLLM_VERSION}"
pip=("${venv}/bin/python" -m pip --disable-pip-version-check)
tier_uv install-vllm.sh "${repo_root}" "${venv}"

installed_vllm="$("${venv}/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null || true)"
if [[ "${installed_vllm}" != "${VLLM_VERSION}" ]]; then
    if [[ -n "${installed_vllm}" ]]; then
        # Another release's tests would be left beside this one's.
        echo "install-vllm.sh: ${venv} has vLLM ${installed_vllm}; replacing it with ${VLLM_VERSION}"
        rm -rf "${sdist_dir}"
    fi
    tier_need_disk install-vllm.sh "vLLM ${VLLM_VERSION}" "${venv}" 10
fi
# Always, also in a venv that has this vLLM: uv then changes only what the
# constraints and the substitute say otherwise (seconds).
echo "Installing vllm==${VLLM_VERSION} into ${venv} (about 4.6 GB downloaded unless uv's cache has it)"
substitute="${REQUIREMENT_SUBSTITUTES[${VLLM_VERSION}]:-}"
requirement_files="$(mktemp -d "${TMPDIR:-/tmp}/install-vllm.XXXXXX")"
printf '%s\n' "${RESOLUTION_CONSTRAINTS[@]}" >"${requirement_files}/constraints.txt"
overrides=()
if [[ -n "${substitute}" ]]; then
    echo "install-vllm.sh: vLLM ${VLLM_VERSION}'s requirement ${substitute%%=>*} is not on the index;" \
        "installing ${substitute##*=>} in its place"
    printf '%s\n' "${substitute##*=>}" >"${requirement_files}/overrides.txt"
    overrides=(--overrides "${requirement_files}/overrides.txt")
fi
"${uv_pip[@]}" install --constraints "${requirement_files}/constraints.txt" "${overrides[@]}" \
    "vllm==${VLLM_VERSION}"
rm -rf "${requirement_files}"
if [[ -n "${substitute}" ]]; then
    # uv applies an override only to a requirement that exists: a vLLM
    # that no longer has it would pass silently, so what was installed is
    # checked.
    SUBSTITUTE="${substitute}" "${venv}/bin/python" - <<'PYEOF'
import importlib.metadata as m
import os

old, new = os.environ["SUBSTITUTE"].split("=>")
name, want = new.split("==")
try:
    got = m.version(name)
except m.PackageNotFoundError:
    got = "nothing"
if got != want:
    raise SystemExit(f"install-vllm.sh: {got} installed for {name}, not the stand-in {new} for {old}: "
                     "update REQUIREMENT_SUBSTITUTES")
PYEOF
fi
echo "Installing nixl==${NIXL_VERSION} and nixl-cu13==${NIXL_VERSION} (--no-deps)"
"${uv_pip[@]}" install --no-deps "nixl==${NIXL_VERSION}" "nixl-cu13==${NIXL_VERSION}"
echo "Installing the test extras: ${TEST_EXTRAS}"
# shellcheck disable=SC2086 # a list of requirement names
"${uv_pip[@]}" install ${TEST_EXTRAS}
echo "Installing ${DYNAMO} (--no-deps: its vLLM connector check only)"
"${uv_pip[@]}" install --no-deps "${DYNAMO}"

if [[ ! -f "${sdist_dir}/tests/v1/kv_connector/unit/test_nixl_connector.py" ]]; then
    echo "Fetching vLLM ${VLLM_VERSION}'s sdist for its unit tests"
    # shellcheck disable=SC2086 # a list of requirement specifiers
    "${uv_pip[@]}" install ${BUILD_REQUIREMENTS}
    work="$(mktemp -d "${TMPDIR:-/tmp}/install-vllm.XXXXXX")"
    trap 'rm -rf "${work}"' EXIT
    VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE="${VLLM_VERSION}" \
        "${pip[@]}" download --quiet --no-deps --no-binary vllm --no-build-isolation \
        "vllm==${VLLM_VERSION}" -d "${work}"
    archive="${work}/vllm-${VLLM_VERSION}.tar.gz"
    if [[ ! -f "${archive}" ]]; then
        echo "install-vllm.sh: pip did not save ${archive}" >&2
        ls -l "${work}" >&2
        exit 1
    fi
    rm -rf "${sdist_dir}.partial"
    mkdir -p "${sdist_dir}.partial"
    # Only tests/ (and the files its conftests read) are needed.
    tar -xzf "${archive}" -C "${sdist_dir}.partial" --strip-components=1 "vllm-${VLLM_VERSION}/tests"
    rm -rf "${sdist_dir}"
    mv "${sdist_dir}.partial" "${sdist_dir}"
fi

# Everything the tier needs, checked (a failure here exits non-zero, and
# no stamp is written).
CHECK_SDIST_DIR="${sdist_dir}" CHECK_VLLM_VERSION="${VLLM_VERSION}" CHECK_NIXL_VERSION="${NIXL_VERSION}" \
    "${venv}/bin/python" - <<'EOF'
import importlib.metadata as m
import importlib.util
import os
import sys

import nixl._api  # noqa: F401  (what vLLM imports)

want = {"vllm": os.environ["CHECK_VLLM_VERSION"], "nixl": os.environ["CHECK_NIXL_VERSION"],
        "nixl-cu13": os.environ["CHECK_NIXL_VERSION"]}
bad = [f"{name} {m.version(name)} (want {v})" for name, v in want.items() if m.version(name) != v]
missing = [mod for mod in ("vllm.distributed.kv_transfer.kv_connector.v1.nixl", "pytest", "pytest_timeout",
                           "pytest_asyncio", "tblib", "ray", "dynamo") if importlib.util.find_spec(mod) is None]
sdist = os.environ["CHECK_SDIST_DIR"]
tests = [t for t in ("test_nixl_connector.py", "test_nixl_heartbeat.py", "utils.py")
         if not os.path.isfile(os.path.join(sdist, "tests/v1/kv_connector/unit", t))]
if bad or missing or tests:
    sys.exit(f"install-vllm.sh: incomplete: wrong versions {bad}, modules missing {missing}, "
             f"sdist tests missing under {sdist}: {tests}")
print("vllm", m.version("vllm"), "| nixl", m.version("nixl"), "| nixl-cu13", m.version("nixl-cu13"),
      "| torch", m.version("torch"), "| pytest", m.version("pytest"))
EOF
tier_check_file_owners install-vllm.sh "${venv}"
printf '%s\n' "${expected_stamp}" >"${stamp}"
echo "vLLM environment installed in ${venv} in $(( $(date +%s) - start )) s"

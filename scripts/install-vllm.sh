#!/usr/bin/env bash
# Makes the environment the vLLM tier runs in (scripts/test-vllm.sh): a venv
# at <repo root>/.venv-vllm (ignored by git) with
#   - vLLM 0.33.0 from PyPI (pins torch 2.14.0; about 4.6 GB downloaded, the
#     venv about 11 GB, 5 minutes here),
#   - NIXL's Python API as vLLM imports it: the meta package nixl==1.5.1 and,
#     for this torch (CUDA 13), nixl-cu13==1.5.1, both with --no-deps (their
#     declared dependencies would pull another torch),
#   - the test extras: pytest, pytest-timeout, pytest-asyncio, tblib, and ray
#     (vLLM's test_nixl_connector.py imports it at module level),
#   - vLLM 0.33.0's own unit tests: the wheel has none, so its sdist is
#     fetched with pip (vLLM's build requirements installed first, then
#     `pip download --no-binary vllm --no-build-isolation` with
#     VLLM_TARGET_DEVICE=empty and VLLM_VERSION_OVERRIDE=0.33.0, see
#     docs/vllm.md) and its tests/ unpacked to <venv>/vllm-sdist/ (outside
#     git). Nothing of it is edited on disk.
# Idempotent: when the stamp says this exact set is installed, it exits at
# once. Nothing else in the repository downloads anything for this tier.
#
# Environment:
#   VLLM_VENV   the venv to make or complete (default: <repo root>/.venv-vllm);
#               an existing venv that already has vllm 0.33.0 is completed,
#               not reinstalled
#   PYTHON      the interpreter to make it with (default: python3, >= 3.10)
set -euo pipefail
# shellcheck source=scripts/tier-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/tier-lib.sh"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VLLM_VENV:-${repo_root}/.venv-vllm}"
python="${PYTHON:-python3}"

readonly VLLM_VERSION="0.33.0"
readonly NIXL_VERSION="1.5.1"
# ray: vLLM's test_nixl_connector.py imports it at module level.
readonly TEST_EXTRAS="pytest pytest-timeout pytest-asyncio tblib ray"
readonly BUILD_REQUIREMENTS='cmake ninja setuptools>=77.0.3,<81 setuptools-scm>=8 setuptools-rust>=1.9 wheel jinja2 packaging'

stamp="${venv}/.nixl-keepalive-vllm-installed"
expected_stamp="vllm==${VLLM_VERSION} nixl==${NIXL_VERSION} nixl-cu13==${NIXL_VERSION} extras=${TEST_EXTRAS} sdist-tests=${VLLM_VERSION}"
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

installed_vllm="$("${venv}/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null || true)"
if [[ "${installed_vllm}" != "${VLLM_VERSION}" ]]; then
    tier_need_disk install-vllm.sh "vLLM ${VLLM_VERSION}" "${venv}" 11 5
    echo "Installing vllm==${VLLM_VERSION} into ${venv} (about 4.6 GB downloaded)"
    "${pip[@]}" install --quiet "vllm==${VLLM_VERSION}"
fi
echo "Installing nixl==${NIXL_VERSION} and nixl-cu13==${NIXL_VERSION} (--no-deps)"
"${pip[@]}" install --quiet --no-deps "nixl==${NIXL_VERSION}" "nixl-cu13==${NIXL_VERSION}"
echo "Installing the test extras: ${TEST_EXTRAS}"
# shellcheck disable=SC2086 # a list of requirement names
"${pip[@]}" install --quiet ${TEST_EXTRAS}

if [[ ! -f "${sdist_dir}/tests/v1/kv_connector/unit/test_nixl_connector.py" ]]; then
    echo "Fetching vLLM ${VLLM_VERSION}'s sdist for its unit tests"
    # shellcheck disable=SC2086 # a list of requirement specifiers
    "${pip[@]}" install --quiet ${BUILD_REQUIREMENTS}
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
                           "pytest_asyncio", "tblib", "ray") if importlib.util.find_spec(mod) is None]
sdist = os.environ["CHECK_SDIST_DIR"]
tests = [t for t in ("test_nixl_connector.py", "test_nixl_heartbeat.py", "utils.py")
         if not os.path.isfile(os.path.join(sdist, "tests/v1/kv_connector/unit", t))]
if bad or missing or tests:
    sys.exit(f"install-vllm.sh: incomplete: wrong versions {bad}, modules missing {missing}, "
             f"sdist tests missing under {sdist}: {tests}")
print("vllm", m.version("vllm"), "| nixl", m.version("nixl"), "| nixl-cu13", m.version("nixl-cu13"),
      "| torch", m.version("torch"), "| pytest", m.version("pytest"))
EOF
printf '%s\n' "${expected_stamp}" >"${stamp}"
echo "vLLM environment installed in ${venv} in $(( $(date +%s) - start )) s"

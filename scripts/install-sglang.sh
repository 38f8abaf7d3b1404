#!/usr/bin/env bash
# Makes the environment the SGLang tier runs in (scripts/test-sglang.sh): a
# venv at <repo root>/.venv-sglang (ignored by git) with
#   - SGLang 0.5.23 from PyPI (pins torch 2.14.1, CUDA 13 wheels; about
#     4.1 GB downloaded), installed with uv (scripts/tier-lib.sh says why
#     not pip) through its cache <repo root>/.uv-cache (TIER_UV_CACHE),
#     which the venv's files are hard links into,
#   - NIXL's Python API as SGLang imports it (`from nixl._api import
#     nixl_agent`): the meta package nixl==1.5.1 and, for this torch (CUDA
#     13), nixl-cu13==1.5.1, both with --no-deps (their declared
#     dependencies would pull another torch); the same NIXL release as the
#     runtime of scripts/install-nixl.sh,
#   - pytest and pytest-timeout.
# SGLang runs on this CPU machine only as far as its disaggregation
# manager goes (python/tests_sglang/: no model, no GPU, DRAM buffers).
# Idempotent: when the stamp says this exact set is installed, it exits at
# once. Nothing else in the repository downloads anything for this tier.
#
# Environment:
#   SGLANG_VENV the venv to make or complete (default: <repo root>/.venv-sglang)
#   PYTHON      the interpreter to make it with (default: python3, >= 3.10)
set -euo pipefail
# shellcheck source=scripts/tier-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/tier-lib.sh"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SGLANG_VENV:-${repo_root}/.venv-sglang}"
python="${PYTHON:-python3}"

readonly SGLANG_VERSION="0.5.23"
readonly NIXL_VERSION="1.5.1"
readonly TEST_EXTRAS="pytest pytest-timeout"

stamp="${venv}/.nixl-keepalive-sglang-installed"
expected_stamp="sglang==${SGLANG_VERSION} nixl==${NIXL_VERSION} nixl-cu13==${NIXL_VERSION} extras=${TEST_EXTRAS}"
if [[ -f "${stamp}" && "$(cat "${stamp}")" == "${expected_stamp}" && -x "${venv}/bin/python" ]]; then
    echo "SGLang environment already installed in ${venv}"
    exit 0
fi

echo "install-sglang.sh: making the SGLang ${SGLANG_VERSION} environment in ${venv}"
start=$(date +%s)
rm -f "${stamp}"
tier_make_venv install-sglang.sh "${python}" "${venv}" "SGLang ${SGLANG_VERSION}"
tier_uv install-sglang.sh "${repo_root}" "${venv}"

installed="$("${venv}/bin/python" -c 'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null || true)"
if [[ "${installed}" != "${SGLANG_VERSION}" ]]; then
    tier_need_disk install-sglang.sh "SGLang ${SGLANG_VERSION}" "${venv}" 10
    echo "Installing sglang==${SGLANG_VERSION} into ${venv} (about 4.1 GB downloaded unless uv's cache has it)"
    "${uv_pip[@]}" install "sglang==${SGLANG_VERSION}"
fi
# Another NIXL flavour beside cu13 would make `nixl._api` pick by its own
# rules; this tier tests one.
"${uv_pip[@]}" uninstall nixl-cu12 >/dev/null 2>&1 || true
echo "Installing nixl==${NIXL_VERSION} and nixl-cu13==${NIXL_VERSION} (--no-deps)"
"${uv_pip[@]}" install --no-deps "nixl==${NIXL_VERSION}" "nixl-cu13==${NIXL_VERSION}"
echo "Installing the test extras: ${TEST_EXTRAS}"
# shellcheck disable=SC2086 # a list of requirement names
"${uv_pip[@]}" install ${TEST_EXTRAS}

# Everything the tier needs, checked (a failure here exits non-zero, and
# no stamp is written).
CHECK_SGLANG_VERSION="${SGLANG_VERSION}" CHECK_NIXL_VERSION="${NIXL_VERSION}" \
    "${venv}/bin/python" - <<'EOF'
import importlib.metadata as m
import importlib.util
import os
import sys

import nixl._api  # noqa: F401  (what SGLang's NixlKVManager imports)

want = {"sglang": os.environ["CHECK_SGLANG_VERSION"], "nixl": os.environ["CHECK_NIXL_VERSION"],
        "nixl-cu13": os.environ["CHECK_NIXL_VERSION"]}
bad = [f"{name} {m.version(name)} (want {v})" for name, v in want.items() if m.version(name) != v]
missing = [mod for mod in ("sglang.srt.disaggregation.nixl", "pytest", "pytest_timeout")
           if importlib.util.find_spec(mod) is None]
if bad or missing:
    sys.exit(f"install-sglang.sh: incomplete: wrong versions {bad}, modules missing {missing}")
print("sglang", m.version("sglang"), "| nixl", m.version("nixl"), "| nixl-cu13", m.version("nixl-cu13"),
      "| torch", m.version("torch"), "| pytest", m.version("pytest"))
EOF
tier_check_file_owners install-sglang.sh "${venv}"
printf '%s\n' "${expected_stamp}" >"${stamp}"
echo "SGLang environment installed in ${venv} in $(( $(date +%s) - start )) s"

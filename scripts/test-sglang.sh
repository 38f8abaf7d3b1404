#!/usr/bin/env bash
# The SGLang tier: nixl_keepalive.sglang (the keepalive inside SGLang's NIXL
# prefill, push mode) against SGLang 0.5.23's real disaggregation code and
# NIXL 1.5.1's real runtime, on DRAM, every rank its own process.
#
#   1. the environment (scripts/install-sglang.sh: <repo>/.venv-sglang, idempotent)
#   2. the wheel users install (scripts/build-wheel.sh: release, abi3,
#      manylinux_2_28) built and installed there
#   3. python/tests_sglang/ (real SGLang prefill and decode ranks, killed
#      and frozen for real)
#
# Exit non-zero on any failure. Without SGLang or NIXL the tests print
# SKIPPED; under CI=true or NIXL_KEEPALIVE_REQUIRE_REAL=1 that is a failure.
# Environment: SGLANG_VENV (default <repo>/.venv-sglang); extra arguments go
# to pytest.
set -euo pipefail
# shellcheck source=scripts/tier-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/tier-lib.sh"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo="$(pwd)"
start=$(date +%s)

venv="${SGLANG_VENV:-${repo}/.venv-sglang}"
export SGLANG_VENV="${venv}"
bash scripts/install-sglang.sh
py="${venv}/bin/python"

stamp() { echo "[test-sglang $(( $(date +%s) - start ))s] $*"; }

stamp "building the nixl_keepalive wheel"
tier_install_wheel "${repo}" "${py}" "${repo}/target/sglang-wheel"

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
export SGLANG_TIER_LOGS="${SGLANG_TIER_LOGS:-${repo}/target/sglang-tier-logs}"
rm -rf "${SGLANG_TIER_LOGS}"

stamp "python/tests_sglang: SGLang's real prefill and decode ranks"
status=0
"${py}" -m pytest -p no:cacheprovider -rs --durations=0 --timeout=600 python/tests_sglang "$@" || status=1
stamp "done (exit ${status}); the ranks' logs: ${SGLANG_TIER_LOGS}"
exit "${status}"

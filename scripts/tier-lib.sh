# shellcheck shell=bash
# Shared by the framework tiers' scripts (install-vllm.sh, test-vllm.sh,
# install-sglang.sh, test-sglang.sh); sourced, never run. Each tier has a
# venv of its own, because vLLM and SGLang pin different torch builds.

# tier_make_venv SCRIPT PYTHON VENV WHAT: makes VENV with PYTHON (>= 3.10)
# unless it exists; SCRIPT names the caller in messages, WHAT the thing
# that needs the Python version.
tier_make_venv() {
    local script="$1" python="$2" venv="$3" what="$4"
    if ! command -v "${python}" >/dev/null 2>&1; then
        echo "${script}: '${python}' is required but not found (set PYTHON)" >&2
        return 1
    fi
    if ! "${python}" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)'; then
        echo "${script}: ${python} is older than Python 3.10; ${what} needs >= 3.10 (set PYTHON)" >&2
        return 1
    fi
    if [[ ! -x "${venv}/bin/python" ]]; then
        if ! "${python}" -c 'import venv, ensurepip' 2>/dev/null; then
            echo "${script}: ${python} cannot make a venv with pip (no venv/ensurepip module: on Debian or Ubuntu install python3-venv)" >&2
            return 1
        fi
        echo "Making the venv ${venv}"
        "${python}" -m venv "${venv}"
    fi
}

# tier_install_wheel REPO PY WHEELS: builds the wheel users install
# (scripts/build-wheel.sh: release, cp310-abi3-manylinux_2_28, checked;
# cargo reuses the build when scripts/test.sh already made it) into WHEELS
# and installs it, no dependencies, into the interpreter PY.
tier_install_wheel() {
    local repo="$1" py="$2" wheels="$3"
    bash "${repo}/scripts/build-wheel.sh" "${wheels}"
    "${py}" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "${wheels}"/nixl_keepalive-*.whl
}

# The installer of the tiers' large installs (vLLM, SGLang and their torch):
# uv, pinned, put into the tier's venv by the venv's own pip. Why not pip
# itself: pip keeps every wheel it downloads (about 4.6 GB for vLLM) in a
# temporary folder until the last one is installed, so its peak is the venv
# plus the downloads, 16 GB for vLLM; CI once had 12 GB free at that tier
# and stopped there. uv unpacks each wheel into its cache as it arrives and
# hard-links the venv's files to the cache's, so the peak is about the venv
# (9.6 GB for vLLM 0.34.0, measured), and install-vllm.sh takes 69 s, not
# about 9 minutes. The cache sits beside the venv (TIER_UV_CACHE, default
# <repo>/.uv-cache) because hard links need one filesystem; a venv and its
# cache share their blocks, so removing a venv frees nothing while the
# cache holds them (.ci/run removes both).
readonly TIER_UV_VERSION="0.13.9"

# tier_uv SCRIPT REPO VENV: installs uv ${TIER_UV_VERSION} into VENV unless
# it is there, and sets the array `uv_pip` to `uv pip` (quiet), with
# UV_PYTHON (VENV's interpreter) and UV_CACHE_DIR (the tiers' cache)
# exported for it.
tier_uv() {
    local script="$1" repo="$2" venv="$3"
    if [[ "$("${venv}/bin/uv" --version 2>/dev/null)" != "uv ${TIER_UV_VERSION}"* ]]; then
        echo "${script}: installing uv ${TIER_UV_VERSION} into ${venv} (the installer of this tier's packages)"
        "${venv}/bin/python" -m pip install --quiet --disable-pip-version-check "uv==${TIER_UV_VERSION}"
    fi
    export UV_CACHE_DIR="${TIER_UV_CACHE:-${repo}/.uv-cache}"
    export UV_PYTHON="${venv}/bin/python"
    # Bytecode compiled at install, as pip does by default and uv does not:
    # without it every process compiles what it imports from source again
    # wherever PYTHONDONTWRITEBYTECODE is set (as on these machines). A
    # vLLM peer's imports took 24.5 s (22.9 s of CPU) without .pyc files
    # and 9.6 s with them, and the tiers start dozens of vLLM and SGLang
    # processes (docs/testing.md, "CI's steps and their time").
    export UV_COMPILE_BYTECODE=1
    # shellcheck disable=SC2034 # used by the scripts that source this file
    uv_pip=("${venv}/bin/uv" pip --quiet)
}

# tier_need_disk SCRIPT WHAT VENV VENV_GB: fails, before anything is
# installed, when the disk cannot hold WHAT: a venv of VENV_GB, less what
# uv's cache (UV_CACHE_DIR, set by tier_uv) already holds, since uv links
# those files instead of writing them again. Where the cache is on another
# filesystem than the venv, uv copies, and both filesystems need the whole.
# Without this check the install fails minutes in, as "No space left on
# device" with nothing said of how much was needed (CI saw it).
tier_need_disk() {
    local script="$1" what="$2" venv="$3" venv_gb="$4"
    local -a paths=("${venv}" "${UV_CACHE_DIR}")
    local -A need_kib=() free_kib=() mount=()
    local dir dev held_kib=0 path
    if [[ -d "${UV_CACHE_DIR}" ]]; then
        held_kib="$(du -sk "${UV_CACHE_DIR}" | awk '{ print $1 }')"
    fi
    for path in "${paths[@]}"; do
        dir="${path}"
        while [[ ! -d "${dir}" ]]; do dir="$(dirname "${dir}")"; done
        dev="$(stat -c %d "${dir}")"
        need_kib[$dev]=$(( venv_gb * 1024 * 1024 ))
        free_kib[$dev]="$(df -Pk "${dir}" | awk 'NR == 2 { print $4 }')"
        mount[$dev]="$(df -P "${dir}" | awk 'NR == 2 { print $6 }')"
    done
    local less=""
    if (( ${#need_kib[@]} == 1 )); then
        need_kib[$dev]=$(( need_kib[$dev] > held_kib ? need_kib[$dev] - held_kib : 0 ))
        less=", less the $(( held_kib / 1024 / 1024 )) GB uv's cache ${UV_CACHE_DIR} already holds"
    fi
    local short=0
    for dev in "${!need_kib[@]}"; do
        if (( free_kib[$dev] < need_kib[$dev] )); then
            echo "${script}: not enough disk for ${what}: ${mount[$dev]} needs $(( need_kib[$dev] / 1024 / 1024 )) GB free (the venv ${venv_gb} GB${less}) and has $(( free_kib[$dev] / 1024 / 1024 )) GB; free space there or set TIER_UV_CACHE and the venv's variable to a larger disk" >&2
            short=1
        fi
    done
    return "${short}"
}

# tier_check_file_owners SCRIPT VENV: fails when two installed packages in
# VENV wrote the same file, naming the packages and a few of the files. An installer replaces such a file
# with the last package's copy, so the first package runs on someone else's
# code: uv once gave vLLM cuda-python 12.6.2.post1 beside cuda-bindings
# 13.5.0, and vLLM's import failed in a module of neither. Always allowed:
# a top-level build_backend.py, which flashinfer-python and
# torch_c_dlpack_ext both ship (their build backend; nothing imports it at
# run time).
tier_check_file_owners() {
    local script="$1" venv="$2"
    CHECK_SCRIPT="${script}" "${venv}/bin/python" - <<'PYEOF'
import collections
import importlib.metadata as m
import os
import sys

allowed = {"build_backend.py"}
owners = collections.defaultdict(set)
for dist in m.distributions():
    for f in dist.files or []:
        path = str(f)
        if "__pycache__" in path or ".dist-info/" in path or path.startswith("..") or path in allowed:
            continue
        owners[path].add(f"{dist.metadata['Name']} {dist.version}")
shared = collections.defaultdict(list)
for path, names in owners.items():
    if len(names) > 1:
        shared[tuple(sorted(names))].append(path)
if shared:
    lines = [f"  {' and '.join(names)}: {len(paths)} file(s), e.g. {', '.join(sorted(paths)[:3])}"
             for names, paths in sorted(shared.items())]
    sys.exit(f"{os.environ['CHECK_SCRIPT']}: packages that overwrite each other's files:\n" + "\n".join(lines))
PYEOF
}

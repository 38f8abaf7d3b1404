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

# tier_need_disk SCRIPT WHAT VENV VENV_GB DOWNLOAD_GB: fails, before pip
# starts, when the disk cannot hold WHAT: the venv (VENV_GB, on VENV's
# filesystem), pip's temporary downloads (DOWNLOAD_GB, under TMPDIR) and,
# while pip's cache is on, their copy in it. Needs on one filesystem add
# up. pip's own failure comes minutes in, as "[Errno 28] No space left on
# device" with nothing said of how much was needed (CI saw it).
tier_need_disk() {
    local script="$1" what="$2" venv="$3" venv_gb="$4" download_gb="$5"
    local -a paths=("${venv}" "${TMPDIR:-/tmp}") gbs=("${venv_gb}" "${download_gb}")
    local -a labels=("the venv ${venv_gb} GB" "pip's temporary downloads ${download_gb} GB")
    local cache
    if cache="$("${venv}/bin/python" -m pip cache dir 2>/dev/null)" && [[ -n "${cache}" ]]; then
        paths+=("${cache}"); gbs+=("${download_gb}")
        labels+=("pip's cache ${download_gb} GB (PIP_NO_CACHE_DIR=1 turns it off)")
    fi
    # Each path's nearest existing folder, its filesystem and its free KiB.
    local -A need_kib=() free_kib=() mount=() parts=()
    local i dir dev
    for i in "${!paths[@]}"; do
        dir="${paths[$i]}"
        while [[ ! -d "${dir}" ]]; do dir="$(dirname "${dir}")"; done
        dev="$(stat -c %d "${dir}")"
        need_kib[$dev]=$(( ${need_kib[$dev]:-0} + ${gbs[$i]} * 1024 * 1024 ))
        free_kib[$dev]="$(df -Pk "${dir}" | awk 'NR == 2 { print $4 }')"
        mount[$dev]="$(df -P "${dir}" | awk 'NR == 2 { print $6 }')"
        parts[$dev]="${parts[$dev]:+${parts[$dev]}, }${labels[$i]}"
    done
    local short=0
    for dev in "${!need_kib[@]}"; do
        if (( free_kib[$dev] < need_kib[$dev] )); then
            echo "${script}: not enough disk for ${what}: ${mount[$dev]} needs $(( need_kib[$dev] / 1024 / 1024 )) GB free (${parts[$dev]}) and has $(( free_kib[$dev] / 1024 / 1024 )) GB; free space there or put the venv or TMPDIR on a larger disk" >&2
            short=1
        fi
    done
    return "${short}"
}

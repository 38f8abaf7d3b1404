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

# tier_install_wheel REPO PY WHEELS: builds our wheel (maturin, abi3, from
# REPO's .venv; scripts/install-python.sh makes it if missing) into WHEELS
# and installs it, no dependencies, into the interpreter PY.
tier_install_wheel() {
    local repo="$1" py="$2" wheels="$3"
    local maturin="${repo}/.venv/bin/maturin"
    if [[ ! -x "${maturin}" ]]; then
        bash "${repo}/scripts/install-python.sh"
    fi
    rm -rf "${wheels}"
    "${maturin}" build --locked --manifest-path "${repo}/python/Cargo.toml" --out "${wheels}"
    "${py}" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "${wheels}"/nixl_keepalive-*.whl
}

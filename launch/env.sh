# Sourced by the launchers: repo root, NVLink multicast off, and ensure_venv (create/reuse .venv).
# shellcheck shell=bash

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# The python the launchers use: the repo venv when it exists, else python3 on PATH.
repo_python() {
    local venv="${MOE_WAVE_VENV:-$REPO_ROOT/.venv}"
    if [ -x "$venv/bin/python" ]; then echo "$venv/bin/python"; else command -v python3; fi
}

# ensure_venv EXTRAS: create or reuse the venv ($MOE_WAVE_VENV, default $REPO_ROOT/.venv) and install
# moe-wave[EXTRAS] into it. A python3 that already imports torch (e.g. a CUDA build on a GPU host) is shared
# through --system-site-packages and never replaced; otherwise torch==$MOE_WAVE_TORCH is installed first
# (PIP_INDEX_URL / PIP_EXTRA_INDEX_URL may point at a CPU wheel index). The stamp (the pyproject hash) is
# written only after the installs succeeded and the runtime dependencies import, so a failed or partial
# install is retried on the next run instead of being skipped. --no-compile: pip would byte-compile every file of
# torch (about 30 of the 40 s a fresh CPU install takes here); Python compiles what it imports, when it does.
ensure_venv() {
    local extras="$1" venv="${MOE_WAVE_VENV:-$REPO_ROOT/.venv}" py="${PYTHON:-python3}" torch_ver="${MOE_WAVE_TORCH:-2.13.0}"
    if [ ! -x "$venv/bin/python" ]; then
        if "$py" -c "import torch" >/dev/null 2>&1; then
            echo "[moe-wave] $py has torch $("$py" -c 'import torch; print(torch.__version__)'): sharing it" >&2
            "$py" -m venv --system-site-packages "$venv"
        else
            "$py" -m venv "$venv"
        fi
    fi
    VENV_PY="$venv/bin/python"
    local stamp="$venv/.moe_wave_stamp.${extras:-base}" want
    want="$(sha256sum "$REPO_ROOT/pyproject.toml" | cut -d' ' -f1) [$extras] torch=$torch_ver"
    if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
        return 0
    fi
    rm -f "$stamp"
    if ! "$VENV_PY" -c "import torch" >/dev/null 2>&1; then
        echo "[moe-wave] installing torch==$torch_ver" >&2
        "$VENV_PY" -m pip install -q --no-compile "torch==$torch_ver" || { echo "[moe-wave] torch install failed" >&2; return 1; }
    fi
    local spec="$REPO_ROOT"
    [ -n "$extras" ] && spec="$REPO_ROOT[$extras]"
    echo "[moe-wave] installing moe-wave (editable) ${extras:+with [$extras]}" >&2
    "$VENV_PY" -m pip install -q --no-compile -e "$spec" || { echo "[moe-wave] pip install -e '$spec' failed" >&2; return 1; }
    # every runtime dependency must import before the stamp says the venv is ready
    "$VENV_PY" -c "import torch, numpy, moe_wave, moe_wave.comm" ||
        { echo "[moe-wave] the install in $venv does not import: not marking it ready" >&2; return 1; }
    echo "$want" >"$stamp"
}

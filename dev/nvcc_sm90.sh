#!/usr/bin/env bash
# Compile CUDA C++ for Hopper (sm_90a) on a machine without a GPU or a CUDA toolkit: registers, spills and shared
# memory per kernel (ptxas -v), before spending GPU time. The compiler comes from PyPI's NVIDIA wheels (nvcc, its
# crt headers, nvvm, cccl, the runtime headers: CUDA 13.0, the GPU host's version), unpacked once into .nvcc/
# (git-ignored, about 270 MB). Needs g++ (the host compiler) and pip.
#
#   bash dev/nvcc_sm90.sh FILE.cu [nvcc options ...]      e.g. the sparse core, with a variant's defines:
#     bash dev/nvcc_sm90.sh moe_wave/attention/sparse_core/csrc/sparse_core.cu -DQROPE=1 -DQRF=64 -DFP8=1
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NV="${MOE_WAVE_NVCC_DIR:-$ROOT/.nvcc}"
PKGS=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-cccl==13.0.85
      nvidia-cuda-runtime==13.0.96)
if [ ! -x "$NV/nvidia/cu13/bin/nvcc" ] || [ ! -x "$NV/nvidia/cu13/nvvm/bin/cicc" ]; then
    mkdir -p "$NV/wheels"
    python3 -m pip download --quiet --no-deps --dest "$NV/wheels" "${PKGS[@]}"
    for w in "$NV"/wheels/*.whl; do python3 -m zipfile -e "$w" "$NV"; done
    chmod +x "$NV"/nvidia/cu13/bin/* "$NV"/nvidia/cu13/nvvm/bin/*
    rm -rf "$NV/wheels"
fi
[ $# -ge 1 ] || { echo "usage: bash dev/nvcc_sm90.sh FILE.cu [nvcc options ...]" >&2; exit 2; }
src="$1"; shift
"$NV/nvidia/cu13/bin/nvcc" -arch=sm_90a -cubin -o "${TMPDIR:-/tmp}/$(basename "${src%.*}").cubin" "$src" \
    -Xptxas -v "$@" 2>&1 | grep -v "Compile time\|bytes gmem"

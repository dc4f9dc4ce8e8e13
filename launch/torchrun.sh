#!/usr/bin/env bash
# bash launch/torchrun.sh demo|info [args]: one rank per GPU (NPROC, default: GPU count, or 2 on CPU).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
PY="$(repo_python)"
NPROC="${NPROC:-$("$PY" -c 'import torch; print(torch.cuda.device_count() or 2)')}"
if command -v torchrun >/dev/null 2>&1; then RUN=(torchrun); else RUN=("$PY" -m torch.distributed.run); fi
exec "${RUN[@]}" --standalone --nproc-per-node="$NPROC" -m moe_wave "$@"

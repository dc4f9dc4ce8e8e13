#!/usr/bin/env bash
# bash launch/sweep.sh [sweep flags]: `moe-wave sweep` on one rank per GPU.
#   LAUNCHER=torchrun (default) | mpirun (through launch/mpirun.sh: python -m mpi4py) | spawn (no launcher:
#   the sweep spawns its ranks itself; CPU: 2 gloo ranks). NPROC / NP: rank count (default: GPU count, or 2).
# Examples:
#   bash launch/sweep.sh --preset v4-flash,balanced --tokens 512,2048 --waves 1,2,4,8 --trace "$OUT/traces"
#   LAUNCHER=spawn bash launch/sweep.sh --tokens 16,64 --waves 1,2 --iters 3       # CPU smoke run
# Output: a CSV (resumed when present), a JSON sidecar, a markdown summary and PNG plots beside it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$REPO_ROOT"
PY="$(repo_python)"
case "${LAUNCHER:-torchrun}" in
    torchrun)
        NPROC="${NPROC:-$("$PY" -c 'import torch; print(torch.cuda.device_count() or 2)')}"
        if command -v torchrun >/dev/null 2>&1; then RUN=(torchrun); else RUN=("$PY" -m torch.distributed.run); fi
        exec "${RUN[@]}" --standalone --nproc-per-node="$NPROC" -m moe_wave sweep "$@" ;;
    mpirun)
        NP="${NP:-${NPROC:-2}}" exec bash "$REPO_ROOT/launch/mpirun.sh" sweep "$@" ;;
    spawn)
        exec "$PY" -m moe_wave sweep ${NPROC:+--ranks "$NPROC"} "$@" ;;
    *)
        echo "LAUNCHER=${LAUNCHER}: must be torchrun, mpirun or spawn" >&2; exit 2 ;;
esac

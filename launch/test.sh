#!/usr/bin/env bash
# The test command: bash launch/test.sh [pytest args]. Creates/reuses .venv, then runs pytest.
# CPU tests run gloo ranks on loopback; GPU-marked tests are skipped without a GPU.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$REPO_ROOT"
ensure_venv test

export MASTER_ADDR=127.0.0.1 GLOO_SOCKET_IFNAME=lo  # tests talk to loopback only
export PYTHONDONTWRITEBYTECODE=1
rc=0
"$VENV_PY" -m pytest -q "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
    echo "[moe-wave] pytest collected no tests: failing" >&2
    exit 1
fi
exit "$rc"

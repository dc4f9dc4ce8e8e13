#!/usr/bin/env bash
# The demo: bash launch/demo.sh [demo args, see --help]. Creates/reuses .venv, then runs
# `python -m moe_wave demo`, which spawns its own ranks (CPU: 2 gloo ranks; GPU host: every GPU).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$REPO_ROOT"
ensure_venv ""
exec "$VENV_PY" -m moe_wave demo "$@"

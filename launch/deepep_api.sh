#!/usr/bin/env bash
# DeepEP's own tests, unmodified, against moe-wave's deep_ep (moe_wave.deepep_compat) and against real DeepEP V1,
# on this host's first two GPUs; their timing and bandwidth lines printed side by side.
#
#   bash launch/deepep_api.sh [--ours-only] [--tests intranode,low_latency] [--no-bench]
#
# After the tests, benchmarks/bench_ll.py times the low-latency calls of both implementations side by side (whole calls
# and CUDA-graph replays, against the bytes' time at the P2P copy limit); --no-bench skips it;
# BENCH_LL_PHASES=N adds the kernels' phase timestamps over N calls, BENCH_LL_TUNE="LIST" launch-knob variants.
#
# Needs DeepEP's kit in .deps/deepep (git-ignored: cp -r ../shared/deps/deepep .deps/ and carry it along). The
# tests run from a fresh copy of the kit's tarball. Real DeepEP is built once into DEEPEP_SITE (default
# .deps/deepep-site, ~85 s) and reused while it imports. Each test has a time limit (T_TEST seconds, default 120)
# and the whole script a budget (BUDGET_S, default 540: under the device tool's 10 minutes a command); a step that
# no longer fits is reported as not run.
# Full logs go to $OUT when the device tool sets it, else to results/deepep-api-<time> (or RES=<folder>).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"      # NVLink multicast off (NCCL, torch symm mem, NVSHMEM), REPO_ROOT
cd "$REPO_ROOT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
OURS_ONLY=""
TESTS="intranode low_latency"
BENCH=1
while [ $# -gt 0 ]; do
    case "$1" in
        --ours-only) OURS_ONLY=1 ;;
        --no-bench) BENCH="" ;;
        --tests) shift; TESTS="${1//,/ }" ;;
        *) echo "deepep_api.sh: unknown argument '$1' (--ours-only, --tests LIST, --no-bench)" >&2; exit 2 ;;
    esac
    shift
done
RES="${RES:-${OUT:-results/deepep-api-$(date -u +%Y%m%d-%H%M%S)}}"
mkdir -p "$RES"
KIT="$REPO_ROOT/.deps/deepep"
SITE="${DEEPEP_SITE:-$REPO_ROOT/.deps/deepep-site}"
LIMIT="${T_TEST:-120}"
BUDGET="${BUDGET_S:-540}"
T0=$SECONDS
limit_for() {  # limit_for SECONDS: the smaller of SECONDS and the budget left (0: does not fit)
    local left=$((BUDGET - (SECONDS - T0) - 15))
    if [ "$left" -lt 30 ]; then echo 0; elif [ "$1" -gt "$left" ]; then echo "$left"; else echo "$1"; fi
}
if [ ! -f "$KIT/build.sh" ] || ! ls "$KIT"/DeepEP-*.tar.gz >/dev/null 2>&1; then
    echo "deepep_api.sh: no DeepEP kit in $KIT: cp -r ../shared/deps/deepep .deps/ and carry .deps/deepep" >&2
    exit 2
fi
SRC="$(mktemp -d "${TMPDIR:-/tmp}/deepep_tests.XXXXXX")"
tar -xzf "$KIT"/DeepEP-*.tar.gz -C "$SRC"          # DeepEP's tests exactly as released
# a plain checkout runs without an install (moe_wave/comm links to ../comm)
BASE_PP="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
SHIM="$(PYTHONPATH="$BASE_PP" "$PY" -m moe_wave.deepep_compat)" || { echo "moe_wave.deepep_compat does not import" >&2; exit 1; }
{
    date -u +"date %Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
    echo "git ${MOE_WAVE_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}; shim $SHIM; results in $RES"
    echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST=$TORCH_SYMM_MEM_DISABLE_MULTICAST" \
         "NVSHMEM_DISABLE_NVLS=$NVSHMEM_DISABLE_NVLS"
} 2>&1 | tee "$RES/deepep_api.log"

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
declare -A RC
run_test() {  # run_test IMPL PYTHONPATH TEST: DeepEP's tests/test_TEST.py --num-processes 2 with that deep_ep
    local impl="$1" pp="$2" t="$3" log="$RES/$1_$3.log" lim
    lim=$(limit_for "$LIMIT")
    if [ "$lim" -eq 0 ]; then
        RC[$impl/$t]="not-run"; echo "=== $impl $t: not run (budget spent)" | tee -a "$RES/deepep_api.log"; return
    fi
    echo "=== $impl $t ($lim s)" | tee -a "$RES/deepep_api.log"
    # DeepEP's launcher reads RANK / WORLD_SIZE as the node's and spawns its own ranks: unset torchrun's
    env -C "$SRC/DeepEP" -u RANK -u WORLD_SIZE -u LOCAL_RANK CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0,1}" \
        PYTHONPATH="$pp" MASTER_ADDR=127.0.0.1 MASTER_PORT="$(free_port)" \
        timeout --kill-after=10 "$lim" "$PY" "tests/test_$t.py" --num-processes 2 >"$log" 2>&1
    RC[$impl/$t]=$?
    PYTHONPATH="$pp" "$PY" -c "import deep_ep, sys; print('deep_ep from', deep_ep.__file__)" >>"$log" 2>&1
    echo "=== $impl $t: rc=${RC[$impl/$t]} ($(grep -c ' passed' "$log") 'passed' lines)" | tee -a "$RES/deepep_api.log"
    tail -n 5 "$log" | sed 's/^/    /' | tee -a "$RES/deepep_api.log"
}

for t in $TESTS; do run_test moe_wave "$SHIM:$BASE_PP" "$t"; done
if [ -z "$OURS_ONLY" ]; then
    if ! PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "import deep_ep" >/dev/null 2>&1; then
        echo "=== building DeepEP into $SITE" | tee -a "$RES/deepep_api.log"
        lim=$(limit_for 200)
        [ "$lim" -gt 0 ] && timeout --kill-after=10 "$lim" bash "$KIT/build.sh" "$SITE" 2>&1 | tail -n 20 |
            tee -a "$RES/deepep_api.log"
    fi
    for t in $TESTS; do run_test deepep "$SITE${PYTHONPATH:+:$PYTHONPATH}" "$t"; done
fi

torchrun_step() {  # torchrun_step NAME LIMIT PYTHONPATH SCRIPT [ARGS...]: 2 ranks, its log in $RES/NAME.log
    local name="$1" lim pp="$3"
    lim=$(limit_for "$2")
    shift 3
    if [ "$lim" -eq 0 ]; then
        RC[$name]="not-run"; echo "=== $name: not run (budget spent)" | tee -a "$RES/deepep_api.log"; return
    fi
    echo "=== $name ($lim s)" | tee -a "$RES/deepep_api.log"
    env -u RANK -u WORLD_SIZE -u LOCAL_RANK PYTHONPATH="$pp" OUT="$RES" \
        timeout --kill-after=10 "$lim" "$PY" -m torch.distributed.run --standalone --nproc-per-node=2 \
        "$@" >"$RES/$name.log" 2>&1
    RC[$name]=$?
    [ "${RC[$name]}" = 124 ] && echo "$name: timed out after $lim s" >>"$RES/$name.log"
}

if [ -n "$BENCH" ]; then
    # the low-latency calls side by side (real DeepEP from the build when it imports)
    LL_ARGS=(--profile-host)
    [ -n "${BENCH_LL_PHASES:-}" ] && LL_ARGS+=(--phases "$BENCH_LL_PHASES")
    [ -n "${BENCH_LL_TUNE:-}" ] && LL_ARGS+=(--tune "$BENCH_LL_TUNE")
    torchrun_step bench_ll 150 "$SITE:$BASE_PP" benchmarks/bench_ll.py "${LL_ARGS[@]}"
    grep -v "^W1\|^\s*$" "$RES/bench_ll.log" 2>/dev/null | tail -n 70 | tee -a "$RES/deepep_api.log"
    # torch's own symmetric-memory all-to-all (all_to_all_vdev_2d, NVSHMEM) on the normal shape: a baseline, or why not
    torchrun_step probe_vdev 90 "$BASE_PP" benchmarks/probe_vdev.py
    grep "all_to_all_vdev_2d\|set_backend\|timed out" "$RES/probe_vdev.log" 2>/dev/null | tail -n 3 |
        tee -a "$RES/deepep_api.log"
    RC[probe_vdev]=0        # a finding either way
fi

# moe-wave's own GPU checks of the module: CUDA-graph capture and replay of both modes, a gloo group
lim=$(limit_for 240)
if [ "$lim" -gt 0 ]; then
    echo "=== moe_wave gpu tests ($lim s)" | tee -a "$RES/deepep_api.log"
    PYTHONPATH="$BASE_PP" timeout --kill-after=10 "$lim" "$PY" -m pytest -q -p no:cacheprovider -m "gpu or multigpu" \
        tests/test_gpu_deepep_compat.py tests/test_gpu_ll_direct.py $(ls tests/test_gpu_normal_kernels.py 2>/dev/null) \
        >"$RES/moe_wave_gpu_tests.log" 2>&1
    RC[moe_wave/gpu_tests]=$?
    tail -n 15 "$RES/moe_wave_gpu_tests.log" | sed 's/^/    /' | tee -a "$RES/deepep_api.log"
else
    RC[moe_wave/gpu_tests]="not-run"; echo "=== moe_wave gpu tests: not run (budget spent)" | tee -a "$RES/deepep_api.log"
fi

# side by side: the tests' own timing and bandwidth lines (rank 0's), ours first
PYTHONPATH="$BASE_PP" "$PY" - "$RES" <<'PYEOF' 2>&1 | tee -a "$RES/deepep_api.log"
import re, sys
from pathlib import Path

res = Path(sys.argv[1])
keys = [("intranode", r"\[layout\] Kernel performance"), ("intranode", r"\[tuning\] Best dispatch \(FP8\)"),
        ("intranode", r"\[tuning\] Best dispatch \(BF16\)"), ("intranode", r"\[tuning\] Best combine"),
        ("intranode", r"NVL chunk default.*"),
        ("low_latency", r"\[rank 0\] Dispatch \+ combine bandwidth"), ("low_latency", r"\[rank 0\] Dispatch bandwidth"),
        ("low_latency", r"\[rank 0\] Dispatch send/recv time")]


def lines(impl, test, pat):
    f = res / f"{impl}_{test}.log"
    if not f.exists():
        return ["(not run)"]
    got = [ln.strip() for ln in f.read_text(errors="replace").splitlines() if re.search(pat, ln)]
    return got or ["(no such line: see the log)"]


for test in ("intranode", "low_latency"):
    for impl in ("moe_wave", "deepep"):
        f = res / f"{impl}_{test}.log"
        if f.exists():
            text = f.read_text(errors="replace")
            bad = "Traceback" in text
            print(f"{test:12s} {impl:9s} {text.count(' passed'):3d} 'passed' lines, "
                  f"{'a traceback: see ' + f.name if bad else 'no traceback'}")
print()
for test, pat in keys:
    print(f"--- {test}: /{pat}/")
    for impl in ("moe_wave", "deepep"):
        for ln in lines(impl, test, pat):
            print(f"  {impl:9s} {ln}")
print("\nnote: the low-latency test's kineto figures (Dispatch/Combine bandwidth, send/recv time) are the average of the"
      "\nkernels named 'dispatch'/'combine': one kernel in DeepEP, two of several in moe-wave (its exchange runs in the"
      "\nengine's kernels); 'Dispatch + combine bandwidth' times whole calls on the caller's stream for both.")
PYEOF
echo "exit codes: $(for k in "${!RC[@]}"; do printf '%s=%s ' "$k" "${RC[$k]}"; done)" | tee -a "$RES/deepep_api.log"
rm -rf "$SRC"
bad=0; for k in "${!RC[@]}"; do [ "${RC[$k]}" != 0 ] && bad=1; done
exit $bad

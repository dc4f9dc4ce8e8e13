#!/usr/bin/env bash
# EP at the size of the host (issue 19): every GPU of one host as one EP group, in one call.
#
#   bash launch/gpu_ep.sh [--quick] [STAGE ...]
#
# STAGE (default: all, in this order):
#   deepep   build DeepEP V1 from the kit in .deps/deepep (once; reused from .deps/deepep-site while it imports)
#   tests    tests/test_gpu_moe.py + tests/test_gpu_comm.py under torchrun at N ranks (symm equals torch bit for
#            bit, empty ranks, graph replay; our deepep backend against torch when DeepEP is built)
#   comm     benchmarks/bench_comm.py: V4-Flash and V4-Pro dispatch/combine at 128..8192 tokens/rank for torch, symm
#            and DeepEP, eager and from CUDA graphs, each alone and beside the GEMM; the bytes all-to-all
#   deepep_tests   DeepEP's own tests/test_intranode.py and tests/test_low_latency.py at N processes, with their
#            defaults and at the V4-Flash layout
#   moe      benchmarks/bench_moe.py --backend symm --graph: the MoE layer replayed from graphs, W = 1, 2, 4, 8
#   demo     python -m moe_wave demo (V4-Flash layers, every GPU)
#   plan     python -m moe_wave plan fitted on the committed EP2 points and this run's: the EP{N} points held out
# --quick: the smaller grids (comm at 128 and 4096 tokens, no bytes section; moe V4-Flash only; a 2-layer demo),
#   for a smoke test, e.g. on a 2-GPU host.
#
# The whole call stays within BUDGET_S seconds (default 540: the GPU host's runner stops a command at 600); a
# stage gets at most its own limit (T_<STAGE>=seconds) and what is left of the budget, and a stage that no longer
# fits is not started and is reported as such (run it in a second call: bash launch/gpu_ep.sh comm moe).
# NVLink multicast stays off (launch/env.sh). Results go to RES (default results/ep<N>-<time>; with the runner's
# $OUT they are also packed into $OUT/results.tgz beside summary.txt and gpu_ep.log). The table is printed last.
#
# DeepEP's kit: copy ../shared/deps/deepep to .deps/deepep (git-ignored) and carry that folder to the GPU host.
set -uo pipefail
# NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1, REPO_ROOT
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$REPO_ROOT"
export PYTHONUNBUFFERED=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export MOE_WAVE_GIT_SHA="${MOE_WAVE_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

QUICK=""
STAGES=()
for a in "$@"; do
    case "$a" in
        --quick) QUICK=1 ;;
        deepep|tests|comm|deepep_tests|moe|demo|plan) STAGES+=("$a") ;;
        *) echo "gpu_ep.sh: unknown argument '$a' (stages: deepep tests comm deepep_tests moe demo plan; --quick)" >&2
           exit 2 ;;
    esac
done
[ ${#STAGES[@]} -eq 0 ] && STAGES=(deepep tests comm deepep_tests moe demo plan)

PY="${PYTHON:-python3}"
N="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
if [ "${N:-0}" -lt 2 ]; then
    echo "gpu_ep.sh: needs 2 or more GPUs, found ${N:-none}" >&2
    exit 2
fi
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | awk '{print tolower($NF)}')"
GPU="${GPU:-gpu}"
DAY="$(date -u +%Y-%m-%d)"
# results/ is git-ignored: on a GPU host that stays up between calls, a later call's plan stage finds this one's
RES="${RES:-results/ep${N}-$(date -u +%Y%m%d-%H%M%S)}"
mkdir -p "$RES"
LOG="$RES/gpu_ep.log"
TR=("$PY" -m torch.distributed.run --standalone --nproc-per-node="$N")
BUDGET="${BUDGET_S:-540}"
T0=$SECONDS
KIT="$REPO_ROOT/.deps/deepep"
SITE="${DEEPEP_SITE:-$REPO_ROOT/.deps/deepep-site}"
SRC="$REPO_ROOT/.deps/deepep-src"

{
    date -u +"date %Y-%m-%dT%H:%M:%SZ"
    echo "EP$N: $N GPUs, stages: ${STAGES[*]}${QUICK:+ (quick)}, budget ${BUDGET} s, results in $RES"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    nvidia-smi topo -m 2>/dev/null | head -$((N + 1))
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
                                  "nccl", ".".join(map(str, torch.cuda.nccl.version())))'
    echo "git $MOE_WAVE_GIT_SHA; NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE" \
         "TORCH_SYMM_MEM_DISABLE_MULTICAST=$TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS=$NVSHMEM_DISABLE_NVLS"
} 2>&1 | tee -a "$LOG"

declare -A STATUS
ORDER=()
LATER=()     # the stages a budget-spent call leaves for the next one
CUR=""
stage() {  # stage NAME LIMIT_S CMD...: run CMD under the smaller of LIMIT_S and the budget left
    local name="$1" limit="$2"; shift 2
    ORDER+=("$name")
    local left=$((BUDGET - (SECONDS - T0) - 15))
    if [ "$left" -lt 30 ]; then
        STATUS[$name]="not run: budget spent"
        LATER+=("$CUR")
        echo "=== $name: not started, ${left} s of the budget left" | tee -a "$LOG"
        return 1
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name ($limit s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$RES/$name.log" | tail -n 40 >>"$LOG"
    local rc=${PIPESTATUS[0]}
    STATUS[$name]="rc=$rc in $((SECONDS - t0)) s$([ "$rc" -eq 124 ] && echo " (time limit $limit s)")"
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
    return "$rc"
}

deepep_ready() { PYTHONPATH="$SITE:$PYTHONPATH" "$PY" -c "import deep_ep" >/dev/null 2>&1; }
use_deepep() {  # put the built DeepEP on PYTHONPATH (once) when it imports
    if deepep_ready && [[ ":$PYTHONPATH:" != *":$SITE:"* ]]; then export PYTHONPATH="$SITE:$PYTHONPATH"; fi
}
newest() {  # newest <file name>: this run's, else the newest of an earlier EP$N run under results/
    if [ -s "$RES/$1" ]; then echo "$RES/$1"; else ls -t results/ep"$N"-*/"$1" 2>/dev/null | head -1; fi
}
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

for s in "${STAGES[@]}"; do
    CUR="$s"
    case "$s" in
        deepep)
            if deepep_ready; then
                ORDER+=(deepep_build); STATUS[deepep_build]="reused $SITE"
            elif [ ! -f "$KIT/build.sh" ]; then
                ORDER+=(deepep_build)
                STATUS[deepep_build]="no kit in $KIT: cp -r ../shared/deps/deepep .deps/ and carry .deps/deepep"
            else
                stage deepep_build ${T_DEEPEP:-150} bash "$KIT/build.sh" "$SITE"
            fi
            use_deepep ;;
        tests)
            use_deepep
            stage tests ${T_TESTS:-150} "${TR[@]}" -m pytest -q -p no:cacheprovider -m "gpu or multigpu" \
                tests/test_gpu_moe.py tests/test_gpu_comm.py ;;
        comm)
            use_deepep
            args=(--sections bytes,tokens,graph --iters 8)
            [ -n "$QUICK" ] && args=(--quick --sections tokens,graph)
            stage comm ${T_COMM:-200} "${TR[@]}" benchmarks/bench_comm.py "${args[@]}" --carveout 0 \
                --hang-s 400 --out "$RES/comm.json" ;;
        deepep_tests)
            if ! deepep_ready; then
                ORDER+=(deepep_tests); STATUS[deepep_tests]="not run: DeepEP is not built (stage deepep)"
                continue
            fi
            if [ ! -d "$SRC/DeepEP/tests" ]; then mkdir -p "$SRC" && tar -xzf "$KIT"/DeepEP-*.tar.gz -C "$SRC"; fi
            # DeepEP's defaults (hidden 7168, top-8), then the V4-Flash layout (hidden 4096, top-6 of 256) at
            # 4096 tokens (normal mode) and 128 (low-latency mode), the points the issue's goals compare
            runs=("intranode" "low_latency")
            [ -z "$QUICK" ] && runs+=("intranode:flash:--num-tokens 4096 --hidden 4096 --num-topk 6 --num-experts 256"
                                     "low_latency:flash:--num-tokens 128 --hidden 4096 --num-topk 6 --num-experts 256")
            for run in "${runs[@]}"; do
                IFS=: read -r t tag extra <<<"$run"
                # shellcheck disable=SC2086 # $extra is a list of flags
                stage "deepep_$t${tag:+_$tag}" ${T_DEEPEP_TEST:-90} env -C "$SRC/DeepEP" -u RANK -u WORLD_SIZE \
                    -u LOCAL_RANK PYTHONPATH="$SITE:${PYTHONPATH#"$SITE:"}" MASTER_ADDR=127.0.0.1 \
                    MASTER_PORT="$(free_port)" "$PY" "tests/test_$t.py" --num-processes "$N" $extra
            done ;;       # (DeepEP's launcher reads RANK and WORLD_SIZE as the node's: unset)
        moe)
            shapes="v4-flash,v4-pro"; [ -n "$QUICK" ] && shapes="v4-flash"
            stage moe ${T_MOE:-200} "${TR[@]}" benchmarks/bench_moe.py --quick --shapes "$shapes" --backend symm --graph \
                --capacity measured --out "$RES/moe_graph.json" ;;
        demo)
            if [ -n "$QUICK" ]; then args=(--layers 2 --tokens 512); else args=(); fi
            stage demo ${T_DEMO:-120} "$PY" -m moe_wave demo "${args[@]}" ;;
        plan)
            data=()
            for f in comm.json moe_graph.json; do f="$(newest "$f")"; [ -n "$f" ] && data+=(--data "$f"); done
            for f in benchmarks/results/points/*.json; do data+=(--data "$f"); done    # the committed points
            stage plan ${T_PLAN:-60} "$PY" -m moe_wave plan --ep "$N,16,32,64" --tokens 128,4096 "${data[@]}" \
                --holdout-ep "$N" --json "$RES/plan.json" ;;
    esac
done

{
    "$PY" benchmarks/summarize.py "$RES" 2>&1
    for f in "$RES"/deepep_intranode*.log "$RES"/deepep_low_latency*.log; do
        [ -f "$f" ] && { echo; echo "DeepEP $(basename "$f" .log) (N=$N), best configurations and bandwidths:"
                         grep -E "Best|best|GB/s|avg_t" "$f" | grep -vE "^\s*$" | tail -n 12; }
    done
    [ -f "$RES/plan.log" ] && { echo; echo "cost model: error on the EP$N points it was not fitted on"
                                grep -E "held out|nothing held out" "$RES/plan.log"; }
    echo
    echo "to commit (the names moe_wave plan reads by default): comm.json -> benchmarks/$DAY-comm-${N}x${GPU}.json,"
    echo "  moe_graph.json (and .md) -> benchmarks/$DAY-moe-graph-${N}x${GPU}.json (.md)"
    if [ ${#LATER[@]} -gt 0 ]; then
        echo "not started for lack of time, for a second call: bash launch/gpu_ep.sh ${QUICK:+--quick }$(
            printf '%s\n' "${LATER[@]}" | awk '!seen[$0]++' | tr '\n' ' ')"
    fi
    echo "stages (EP$N, git $MOE_WAVE_GIT_SHA, $((SECONDS - T0)) s):"
    for k in "${ORDER[@]}"; do printf '  %-26s %s\n' "$k" "${STATUS[$k]}"; done
} 2>&1 | tee "$RES/summary.txt"
if [ -n "${OUT:-}" ]; then
    cp "$RES/summary.txt" "$LOG" "$OUT/" 2>/dev/null
    tar czf "$OUT/results.tgz" -C "$RES" .
fi

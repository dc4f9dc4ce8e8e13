#!/usr/bin/env bash
# Every GPU test and benchmark in one call, for the GPU host (2 x H200 today; any GPU count).
#
#   bash launch/gpu_all.sh [--quick] [STAGE ...]     STAGE: tests moe graph comm attn demo sweep (default: all),
#   partitions (bench_moe with both wave partitions under graphs), experts (tests + bench_experts + demo bf16/fp8,
#   one GPU), layer (one V4 layer part by part in bf16 and FP8: dev/profile_layer.py), xprofile (the expert
#   stage's kernels, dev/profile_experts.py), attn_ab (bench_attn of an old tree against this one, alternately:
#   OLD_TREE, AB_ARGS), experts_ab (bench_experts likewise: EXP_AB_ARGS), settings (the FP8 expert stage under
#   library settings side by side: dev/stage_settings.py, SETTINGS_ARGS; default: the fused first GEMM off, on
#   with 128-row and with 64-row tiles), gate_up (the first GEMM with SwiGLU on DeepGEMM's kernel: its tests,
#   dev/probe_gate_up_dg.py (GATE_UP_ARGS) and the stage under the choices around it (GATE_UP_SETTINGS)),
#   streams (bench_moe with the expert stages on one stream and on two), whole (the attention layer from a CUDA
#   graph with overlap off / on / without a cache: profile_attn --whole), trace (the CUDA C++ core's in-kernel
#   phases, dev/trace_core_cuda.py),
#   or commtests (the multi-GPU tests only), or deepep_api (DeepEP's own tests against moe-wave's deep_ep and
#   against DeepEP, side by side: launch/deepep_api.sh; needs the kit in .deps/deepep)
#   COMM_ARGS="--tune" adds bench_comm options ("--tune --memops": also the bare bytes all-to-all closed by
#   stream memory operations); T_<STAGE>=seconds sets a stage's time limit.
#
# Full results go to RES: a fresh folder per run (results/<date>-<time>, or a mktemp -d folder when the
# device tool's $OUT is set; pass RES=<folder> to reuse one, e.g. to resume a sweep's CSV). With $OUT they
# are packed into $OUT/results.tgz (it brings back at most 8 files). A short table is printed last.
# Each stage has its own time limit so that one hang cannot eat the whole run.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"      # NVLink multicast off, REPO_ROOT
cd "$REPO_ROOT"
export PYTHONUNBUFFERED=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# A copy of the tree without .git (the GPU host): pass MOE_WAVE_GIT_SHA=<commit> so results name it.
export MOE_WAVE_GIT_SHA="${MOE_WAVE_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
QUICK=""
STAGES=()
for a in "$@"; do
    case "$a" in
        --quick) QUICK="--quick" ;;
        *) STAGES+=("$a") ;;
    esac
done
[ ${#STAGES[@]} -eq 0 ] && STAGES=(tests moe graph comm attn demo sweep)
if [ -z "${RES:-}" ]; then
    if [ -n "${OUT:-}" ]; then RES="$(mktemp -d "${TMPDIR:-/tmp}/moe_wave_results.XXXXXX")"
    else RES="results/$(date +%Y-%m-%d-%H%M%S)"; fi
fi
mkdir -p "$RES"
echo "results in $RES"
LOG="$RES/gpu_all.log"
PY="${PYTHON:-python3}"
NGPU="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
TR=("$PY" -m torch.distributed.run --standalone --nproc-per-node="$NGPU")

# a plain checkout runs without an install (moe_wave/comm links to ../comm)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# DeepGEMM's FP8 GEMMs for the FP8 layers (fp8.fp8_matmul's "auto") where its kit was carried (.deps, see
# launch/deepgemm.sh); else cuBLAS, and the tests that need deep_gemm skip
if ls .deps/DeepGEMM-*.tar.gz >/dev/null 2>&1; then
    source launch/deepgemm.sh
    echo "deep_gemm importable: $MOE_WAVE_DEEPGEMM_OK" | tee -a "$LOG"
fi
MULTI_TESTS=(tests/test_gpu_moe.py tests/test_gpu_comm.py)
# tests that start their own ranks (subprocesses over a file store): plain pytest, outside torchrun, so that a
# torchrun rank that finished early cannot end them
OWN_RANK_TESTS=(tests/test_gpu_faults.py)

{
    date -u +"date %Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    nvidia-smi topo -m 2>/dev/null | head -5
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())))'
    echo "git $MOE_WAVE_GIT_SHA"
} 2>&1 | tee -a "$LOG"

declare -A STATUS
stage() {  # stage NAME LIMIT_S CMD...
    local name="$1" limit="$2"; shift 2
    echo "=== $name ($limit s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$RES/$name.log" | tail -n 60 >>"$LOG"
    local rc=${PIPESTATUS[0]}
    STATUS[$name]="rc=$rc $((SECONDS - t0))s"
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
}

for s in "${STAGES[@]}"; do
    case "$s" in
        tests)
            stage tests_multi ${T_TESTS:-180} "${TR[@]}" -m pytest -q -p no:cacheprovider -m "gpu or multigpu" \
                "${MULTI_TESTS[@]}"
            stage tests_faults ${T_FAULTS:-240} "$PY" -m pytest -q -p no:cacheprovider -m "gpu or multigpu" \
                "${OWN_RANK_TESTS[@]}"
            stage tests_single ${T_TESTS1:-120} "$PY" -m pytest -q -p no:cacheprovider -m "gpu" \
                tests/test_gpu_attention.py tests/test_symm_kernels.py tests/test_mhc_kernels.py
            # the deep_ep front door's kernels with P ranks emulated on this one GPU (real launches, relaunch path)
            stage tests_emulated ${T_TESTS1:-120} "$PY" -m pytest -q -p no:cacheprovider tests/test_ll_direct.py \
                tests/test_normal_kernels.py tests/test_expert_order.py
            # every schedule bit-identical to the serial one, layer by layer (V4-Flash layers, one GPU)
            stage check_stack ${T_CHECK:-120} "$PY" benchmarks/check_stack.py --repeats 2 ;;
        commtests)  # the multi-GPU tests only (comm backends, their failure paths, WaveMoE)
            stage tests_multi ${T_TESTS:-180} "${TR[@]}" -m pytest -q -p no:cacheprovider -m "gpu or multigpu" \
                "${MULTI_TESTS[@]}"
            stage tests_faults ${T_FAULTS:-240} "$PY" -m pytest -q -p no:cacheprovider -m "gpu or multigpu" \
                "${OWN_RANK_TESTS[@]}" ;;
        moe)   stage bench_moe ${T_MOE:-300} "${TR[@]}" benchmarks/bench_moe.py $QUICK --out "$RES/moe.json" ;;
        graph) # the symm backend with every kind replayed from a CUDA graph: SM copies vs copy engines
               for mode in kernel copy; do
                   stage bench_moe_graph_$mode ${T_GRAPH:-200} "${TR[@]}" benchmarks/bench_moe.py --quick --shapes v4-flash,balanced \
                       --backend symm --symm-mode $mode --graph --capacity measured --out "$RES/moe_graph_$mode.json"
               done ;;
        partitions)  # issue 15: both wave partitions (and experts with a row once per layer) under CUDA graphs
                     # (symm), V4-Flash, W 1 2 4
               stage bench_moe_partitions ${T_PART:-300} "${TR[@]}" benchmarks/bench_moe.py --quick --shapes v4-flash \
                   --tokens ${PART_TOKENS:-2048,8192} --waves 1,2,4 --backend symm --graph --capacity measured \
                   --partition experts,tokens,experts-once --out "$RES/moe_partitions.json" ;;
        experts)  # one EP rank's expert stage on one GPU: the tests (FP8 on DeepGEMM against its reference, graph
                  # replay, every W; the bf16 stage's row bound and sends once), then bench_experts (bf16 vs FP8 vs
                  # DeepGEMM's GEMMs alone vs the floor; EXP_SHAPES, EXP_TOKENS) and the default demo in bf16 and FP8
               # (EXP_TESTS / EXP_DEMO set but empty: that part left out, e.g. to split the stage over two calls)
               EXP_TESTS="${EXP_TESTS-tests/test_gpu_fp8_experts.py tests/test_gpu_gate_up_dg.py tests/test_gpu_moe.py \
                   tests/test_expert_order.py tests/test_fp8_experts.py}"
               if [ -n "$EXP_TESTS" ]; then
                   stage tests_experts ${T_TESTS1:-200} "$PY" -m pytest -q -p no:cacheprovider $EXP_TESTS
               fi
               stage bench_experts ${T_EXPERTS:-300} "$PY" benchmarks/bench_experts.py \
                   --shapes ${EXP_SHAPES:-v4-flash:128,v4-flash:32,v4-pro:192,v4-pro:48} \
                   --tokens ${EXP_TOKENS:-128,2048,8192} --out "$RES/experts.json"
               for p in ${EXP_DEMO-bf16 fp8}; do
                   stage demo_$p ${T_DEMO:-300} "$PY" -m moe_wave demo --precision $p
               done ;;
        streams)  # issue 15: the pipeline with the waves' expert stages on one stream and on two (the default)
               stage bench_moe_streams ${T_STREAMS:-240} "${TR[@]}" benchmarks/bench_moe.py --quick --shapes v4-flash \
                   --tokens ${PART_TOKENS:-2048,8192} --waves 1,4 --backend symm --graph --capacity measured \
                   --expert-streams 1,2 --out "$RES/moe_streams.json" ;;
        comm)  stage bench_comm ${T_COMM:-240} "${TR[@]}" benchmarks/bench_comm.py $QUICK ${COMM_ARGS:-} --out "$RES/comm.json" ;;
        attn)  # the attention kernels on CUDA (each against its torch twin; the core and top-k at the V4 shapes),
               # then the core and the top-k alone (the short table: TFLOP/s vs a dense GEMM, topk vs torch.topk)
               # (ATTN_TESTS: pytest's arguments, default the five files below; ATTN_ARGS: bench_attn's options,
               # default $QUICK; PROFILE_ARGS: profile_attn's, default --types csa;
               # ATTN_CORE=0 / ATTN_PROFILE=0 / ATTN_FP8=0 leave those out)
               stage attn_tests ${T_ATTNTEST:-420} "$PY" -m pytest -q -p no:cacheprovider --durations=12 ${ATTN_TESTS:-\
                   tests/test_attn_kernels.py tests/test_core_fusion.py tests/test_fp8.py tests/test_gpu_attention.py \
                   tests/test_core_cuda.py tests/test_bench_fp8_shapes.py}
               if [ "${ATTN_CORE:-1}" != 0 ]; then
                   stage bench_attn_core ${T_CORE:-180} "$PY" benchmarks/bench_attn.py --core --out "$RES/attn_core.json"
                   sed -n '/^sparse core (CUDA graphs)/,$p' "$RES/bench_attn_core.log"
                   # the CUDA C++ prefill core against the Triton one (Hopper only)
                   if "$PY" -c "from moe_wave.attention.sparse_core import cuda_impl
raise SystemExit(not cuda_impl.available())"; then
                       stage bench_core ${T_CORE:-180} "$PY" benchmarks/bench_core.py --out "$RES/core.json"
                       sed -n '/^dense bf16 GEMM/,$p' "$RES/bench_core.log"
                   fi
               fi
               stage bench_attn ${T_ATTN:-240} "$PY" benchmarks/bench_attn.py ${ATTN_ARGS:-$QUICK} --out "$RES/attn.json"
               # the FP8 projections alone at the layer's shapes against the square FP8 GEMM (ATTN_FP8=0: not)
               if [ "${ATTN_FP8:-1}" != 0 ]; then
                   stage fp8_shapes ${T_FP8:-120} "$PY" dev/bench_fp8_shapes.py --out "$RES/fp8_shapes.json"
               fi
               if [ "${ATTN_PROFILE:-1}" != 0 ]; then
                   stage profile_attn ${T_PROF:-120} "$PY" dev/profile_attn.py ${PROFILE_ARGS:---types csa}
               fi ;;
        attn_ab)  # before / after a change: bench_attn of the tree in OLD_TREE (default .deps/old, e.g. `git archive
                  # <commit> moe_wave comm launch pyproject.toml | tar -x -C .deps/old`) against this tree, alternately
                  # twice (AB_ARGS: the points, default V4-Flash prefill layers + decode 64, fp8a, graphs), then
                  # dev/compare_attn.py (after / before per point, within 2 %)
               OLD="${OLD_TREE:-.deps/old}"
               OLD_BENCH="$OLD/benchmarks/bench_attn.py"; [ -f "$OLD_BENCH" ] || OLD_BENCH="$OLD/launch/bench_attn.py"
               AB="${AB_ARGS:---shapes v4-flash --precision fp8a --batches 64 --no-eager --iters 20}"
               for k in 1 2; do
                   stage attn_before_$k ${T_AB:-200} env PYTHONPATH="$PWD/$OLD:$PYTHONPATH" "$PY" "$OLD_BENCH" $AB \
                       --out "$RES/attn_before_$k.json"
                   stage attn_after_$k ${T_AB:-200} "$PY" benchmarks/bench_attn.py $AB --out "$RES/attn_after_$k.json"
               done
               stage attn_compare 30 "$PY" dev/compare_attn.py "$RES"/attn_before_?.log -- "$RES"/attn_after_?.log
               cat "$RES/attn_compare.log" ;;
        experts_ab)  # before / after a change: bench_experts of the tree in OLD_TREE (default .deps/old, as attn_ab)
                     # against this tree, alternately twice (EXP_AB_ARGS: the points, default V4-Flash with 32 and
                     # 128 local experts at 128 and 2048 tokens, W = 1, 4, FP8), then dev/compare_experts.py
               OLD="${OLD_TREE:-.deps/old}"
               AB="${EXP_AB_ARGS:---shapes v4-flash:32,v4-flash:128 --tokens 128,2048 --waves 1,4 --precisions fp8}"
               for k in ${EXP_AB_ROUNDS:-1 2}; do
                   stage experts_before_$k ${T_AB:-200} env PYTHONPATH="$PWD/$OLD:$PYTHONPATH" "$PY" \
                       "$OLD/benchmarks/bench_experts.py" $AB --out "$RES/experts_before_$k.json"
                   stage experts_after_$k ${T_AB:-200} "$PY" benchmarks/bench_experts.py $AB \
                       --out "$RES/experts_after_$k.json"
               done
               stage experts_compare 30 "$PY" dev/compare_experts.py "$RES"/experts_before_?.json -- \
                   "$RES"/experts_after_?.json
               cat "$RES/experts_compare.log" ;;
        whole)  # the whole attention layer from a CUDA graph, overlap off / on / on without a cache
                # (WHOLE_SHAPES: presets, default v4-pro,v4-flash)
               for shape in $(echo "${WHOLE_SHAPES:-v4-pro,v4-flash}" | tr ',' ' '); do
                   stage whole_$shape ${T_WHOLE:-150} "$PY" dev/profile_attn.py --whole --shape "$shape" \
                       --types sliding,csa,hca --precision fp8a --rows 10
               done ;;
        trace)  # the CUDA C++ core's phases in cycles a tile, plain and with the layer's steps
               stage trace_core_cuda ${T_TRACE:-240} "$PY" dev/trace_core_cuda.py --out "$RES/trace_core_cuda.json"
               stage trace_core_cuda_fused ${T_TRACE:-240} "$PY" dev/trace_core_cuda.py --fused \
                   --out "$RES/trace_core_cuda_fused.json" ;;
        demo)  # the README's first command, as a new user runs it on this host (graphs, symm: the defaults)
               stage demo ${T_DEMO:-300} "$PY" -m moe_wave demo ;;
        sweep) stage sweep ${T_SWEEP:-240} "${TR[@]}" -m moe_wave sweep --preset v4-flash --tokens 512,2048,4096,8192 \
                   --waves 1,2,4,8 --shared bubbles --iters ${SWEEP_ITERS:-10} --out "$RES/sweep" --trace "$RES/sweep/trace"
               true ;;
        deepep_api)   # DeepEP's tests on moe-wave's deep_ep and on DeepEP (built from .deps/deepep), side by side
               stage deepep_api ${T_DEEPEP_API:-330} env RES="$RES/deepep_api" bash launch/deepep_api.sh ;;
        layer)  # where one V4 layer's time goes, part by part (mHC, norms, attention, MoE), in bf16 and FP8
                # (dev/profile_layer.py; LAYER_ARGS, e.g. "--layer 2 --tokens 2048")
               for p in bf16 fp8; do
                   stage profile_layer_$p ${T_LAYER:-120} "$PY" dev/profile_layer.py --precision $p ${LAYER_ARGS:-}
               done ;;
        xprofile)  # the expert stage's kernels under torch.profiler at W=1 and W=4 (XPROF_ARGS; default FP8)
               stage xprofile ${T_XPROF:-240} "$PY" dev/profile_experts.py ${XPROF_ARGS:---precision fp8 --tokens \
                   128,2048,8192 --waves 1,4 --rows 16} ;;
        settings)  # the FP8 expert stage under library settings, alternately (dev/stage_settings.py; SETTINGS_ARGS,
                   # default: the fused first GEMM off, with 128-row tiles everywhere and with 64-row ones
                   # everywhere, against the library's choice)
               F=fp8_experts.FUSED_GATE_UP_ROWS_PER_EXPERT
               stage settings ${T_SETTINGS:-300} "$PY" dev/stage_settings.py --out "$RES/stage_settings.json" \
                   ${SETTINGS_ARGS:---tokens 128,2048,8192 base off:$F=0 \
                   "f128:$F=1000000000;fp8_experts.FUSED_SMALL_TILE_ROWS_PER_EXPERT=0" \
                   "f64:$F=1000000000;fp8_experts.FUSED_SMALL_TILE_ROWS_PER_EXPERT=1000000000"}
               ;;
        gate_up)  # the first GEMM with SwiGLU + requant on DeepGEMM's kernel (gate_up_dg): its tests
                  # (GATE_UP_TESTS), dev/probe_gate_up_dg.py against DeepGEMM's GEMM alone and the DeepGEMM way, and
                  # reading the rows where they arrived against gather_pairs + gate_up_dg (GATE_UP_ARGS), then the
                  # stage under the choices around it (dev/stage_settings.py, GATE_UP_SETTINGS; default: the library,
                  # and gate_up_dg reading arrived FP8 rows where they are (GATE_UP_DG_SRC); V4-Flash:32, :128,
                  # V4-Pro:48 at 2048 and 8192 tokens, W=1 and 4; GATE_UP_SETTINGS="" or GATE_UP_ARGS="skip" leave
                  # that part out)
               GT="${GATE_UP_TESTS-tests/test_gpu_gate_up_dg.py}"
               if [ -n "$GT" ]; then
                   stage tests_gate_up ${T_TESTS1:-300} "$PY" -m pytest -q -p no:cacheprovider $GT
               fi
               if [ "${GATE_UP_ARGS:-}" != skip ]; then
                   stage probe_gate_up ${T_GATE_UP:-240} "$PY" dev/probe_gate_up_dg.py \
                       --out "$RES/probe_gate_up_dg.json" ${GATE_UP_ARGS:-}
               fi
               GS="${GATE_UP_SETTINGS-"--shapes v4-flash:32,v4-flash:128,v4-pro:48 --tokens 2048,8192 --waves 1,4 base
                   src:fp8_experts.GATE_UP_DG_SRC=True"}"
               if [ -n "$GS" ]; then
                   stage settings_gate_up ${T_SETTINGS:-300} "$PY" dev/stage_settings.py \
                       --out "$RES/stage_settings_gate_up.json" $GS
               fi ;;
        *) echo "unknown stage $s (tests commtests moe graph partitions experts experts_ab settings layer xprofile" \
               "gate_up streams comm attn" \
               "attn_ab whole trace demo sweep deepep_api)" ;;
    esac
done

"$PY" benchmarks/summarize.py "$RES" 2>&1 | tee "$RES/summary.txt"
echo "stages:"; for k in "${!STATUS[@]}"; do echo "  $k ${STATUS[$k]}"; done
if [ -n "${OUT:-}" ]; then
    cp "$RES/summary.txt" "$RES/gpu_all.log" "$OUT/" 2>/dev/null
    tar czf "$OUT/results.tgz" -C "$RES" .
fi

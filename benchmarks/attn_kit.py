"""What the attention benchmarks share: V4 attention layers at the real shapes (random weights, bf16 or the FP8
format), the timers (eager, replayed from a CUDA graph), the dense bf16 and FP8 GEMM yardsticks, the layer's
pieces as callables (each front-end branch, the sparse core, the output projection) and the JSON ``meta`` block.
``bench_attn.py`` is built on it, ``bench_core.py`` and the probes in ``dev/`` import it.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import git_sha  # noqa: E402

from moe_wave.attention import AttnConfig, ScheduleConfig, V4Attention  # noqa: E402
from moe_wave.attention.rope import RopeConfig  # noqa: E402
from moe_wave.attention.schedule import run_frontend  # noqa: E402
from moe_wave.attention.sparse_core import CoreConfig  # noqa: E402
from moe_wave.timing import as_graph, iteration_us  # noqa: E402

SHAPES = {  # hidden, heads, q_lora, o_groups, index_topk (spec 1.1)
    "v4-flash": dict(hidden=4096, heads=64, q_lora_rank=1024, o_groups=8, index_topk=512),
    "v4-pro": dict(hidden=7168, heads=128, q_lora_rank=1536, o_groups=16, index_topk=1024),
}
TYPES = {"sliding": ("sliding_attention", 0), "csa": ("compressed_sparse_attention", 4),
         "hca": ("heavily_compressed_attention", 128)}
CTX = 4096


def make_attn(shape: str, kind: str, dev, precision: str = "bf16",
              schedule: ScheduleConfig | None = None) -> V4Attention:
    s = SHAPES[shape]
    lt, ratio = TYPES[kind]
    rope = (RopeConfig(dim=64, theta=10000.0) if ratio == 0 else
            RopeConfig(dim=64, theta=160000.0, yarn_orig=65536, yarn_factor=16.0))
    cfg = AttnConfig(layer_type=lt, hidden=s["hidden"], heads=s["heads"], head_dim=512, q_lora_rank=s["q_lora_rank"],
                     o_groups=s["o_groups"], o_lora_rank=1024, window=128, rope=rope, ratio=ratio,
                     index_heads=64 if ratio == 4 else 0, index_dim=128 if ratio == 4 else 0,
                     index_topk=s["index_topk"] if ratio == 4 else 0)
    attn = V4Attention(cfg, schedule or ScheduleConfig(overlap=True)).to(dev, torch.bfloat16)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name.endswith(("sinks", "ape")):
                p.normal_(0, 0.5)
    if precision in ("fp8", "fp8a"):
        attn.quantize_fp8(wo_a_fp8="auto" if precision == "fp8a" else False)
    return attn.eval()


def fill_cache(cache, length: int) -> None:
    """A cache 'prefilled' to ``length`` tokens: random contents (timing does not depend on values)."""
    cache.length_B.fill_(length)
    cache.win_BWd.normal_()
    for st in (cache.comp, cache.index):
        if st is not None:
            st.kv_BRC.normal_()
            st.score_BRC.normal_()
            st.entries_BNd.normal_()


def time_eager(fn, inputs, iters: int, warmup: int) -> float:
    """Median us of ``fn(*inputs(i))``, each iteration from an idle device (``inputs(i)`` picks from a pool of
    tensors made beforehand: host work only)."""
    return statistics.median(iteration_us(lambda i: fn(*inputs(i)), iters, warmup, device="cuda"))


def time_graph(fn, static_inputs, pool, iters: int, warmup: int) -> float:
    """Capture ``fn(*static_inputs)`` once, then the median us of replays, fresh inputs copied in beforehand."""
    replay, _ = as_graph(lambda i: fn(*static_inputs), "cuda", warmup=3)

    def before(i):
        static_inputs[0].copy_(pool[i % len(pool)])
    times = iteration_us(replay, iters, warmup, device="cuda", before=before)
    del replay
    return statistics.median(times)


def time_alone(fn, iters: int, warmup: int = 3) -> float:
    """Median us of ``fn()`` replayed from a CUDA graph (inputs fixed: the core does not care about values)."""
    dummy = torch.zeros(1, device="cuda")
    return time_graph(lambda *_: fn(), [dummy], [dummy], iters, warmup)


def gemm_tflops(dev, n: int = 8192, iters: int = 20) -> float:
    """Dense bf16 [n, n] x [n, n] GEMM rate (TFLOP/s), median of ``iters`` replays: the yardstick of the core."""
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    us = time_alone(lambda: torch.mm(a, b, out=c), iters)
    return 2 * n ** 3 / us / 1e6


def fp8_gemm_tflops(dev, n: int = 8192, iters: int = 20) -> float:
    """The same product in the FP8 format (1 x 128 by 128 x 128 block scales, ``fp8.fp8_matmul``), its inputs
    quantised beforehand: the yardstick of the FP8 projections."""
    from moe_wave.fp8 import act_quant, fp8_matmul, weight_quant
    a_q, a_s = act_quant(torch.randn(n, n, device=dev, dtype=torch.bfloat16))
    b_q, b_s = weight_quant(torch.randn(n, n, device=dev))
    us = time_alone(lambda: fp8_matmul(a_q, a_s, b_q, b_s), iters)
    return 2 * n ** 3 / us / 1e6


def core_parts(attn: V4Attention, x, pos, cache):
    """The front-end's result for ``x`` (serial): the ``FrontEnd`` (queries and parts) the core consumes."""
    fe = run_frontend(attn, x, pos, cache, False)
    cache.join()
    return fe


def core_fn(attn: V4Attention, fe, pos, config: CoreConfig | None = None):
    """The core as the layer runs it (``V4Attention.core``: V's RoPE undone, the output quantised for a grouped
    FP8 wo_a), or the kernel with one tiling (``config``)."""
    if config is None:
        return lambda: attn.core(fe, pos)
    from moe_wave.attention.sparse_core import sparse_attention_fused
    q_rope = (pos, attn.freq_F, attn.cfg.eps) if fe.q_raw else None
    return lambda: sparse_attention_fused(fe.q_BSHd, fe.parts, attn.sinks, attn.cfg.head_dim ** -0.5, config=config,
                                          fallback=False, q_rope=q_rope, o_rope=(pos, attn.freq_F),
                                          out_fp8=attn.fp8_out(pos.numel()), tuning=attn.schedule.core)


def out_fn(attn: V4Attention, fe, o, pos):
    """The output projection on the core's result ``o`` (as the layer runs it)."""
    B, S = pos.shape
    if isinstance(o, tuple):
        return lambda: attn.output_q(o[0], o[1], B, S, fe.q_BSHd.dtype)
    return lambda: attn.project_out(o)


def _clone(o):
    return tuple(t.clone() for t in o) if isinstance(o, tuple) else o.clone()


def branches(attn: V4Attention):
    """Each front-end chain alone: name -> fn(x, pos, cache). An FP8 layer quantises x once, on the main stream
    (``run_frontend``): the q chain counts it; the window chain takes it made beforehand (once per input tensor,
    in the warm-up, outside what is timed)."""
    xq_of = {}

    def q(x, pos, cache):   # as run_frontend has it: the norm and RoPE left to the core where it does them
        attn.q_branch(attn.q_lora(x, attn.x_quant(x)), pos)

    def kv(x, pos, cache):
        if x.data_ptr() not in xq_of:
            xq_of[x.data_ptr()] = attn.x_quant(x)
        k = attn.window_kv(x, pos, xq_of[x.data_ptr()])
        attn.window_source(k, pos, cache)
        attn.window_write(k, pos, cache)

    def comp(x, pos, cache):
        c = attn.compressor
        kvc, sc = c.project(x, pos)
        c.emit(kvc, sc, pos, cache.comp, attn.freq_F)
        if attn.indexer is None:
            attn.hca_index(pos, cache)
        c.write_state(kvc, sc, pos, cache.comp)

    def index(x, pos, cache):
        ix = attn.indexer
        kvc, sc = ix.compressor.project(x, pos)
        ix.compressor.emit(kvc, sc, pos, cache.index, attn.freq_F)
        w = ix.weights(x)
        qI = ix.query(attn.q_lora(x), pos, attn.freq_F)
        attn.index_topk(qI, w, pos, cache)
        ix.compressor.write_state(kvc, sc, pos, cache.index)

    out = {"q": q, "kv": kv}
    if attn.compressor is not None:
        out["comp"] = comp
    if attn.indexer is not None:
        out["index"] = index
    return out


def meta(args) -> dict:
    sha = git_sha()
    n = torch.cuda.device_count()
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    return dict(date=datetime.datetime.now().isoformat(timespec="seconds"), command=" ".join(sys.argv), git_sha=sha,
                gpus=f"1 x {torch.cuda.get_device_name(0)} (of {n})", torch=torch.__version__,
                cuda=torch.version.cuda, hip=torch.version.hip,
                nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl), world_size=1,
                quick=args.quick, context=CTX, dtype="bfloat16", deep_gemm=deep_gemm_version())


def deep_gemm_version() -> str | None:
    """deep_gemm's version where it imports (fp8.fp8_matmul's "auto" runs on it then), else None."""
    try:
        import deep_gemm
        return getattr(deep_gemm, "__version__", "?")
    except Exception:  # noqa: BLE001
        return None

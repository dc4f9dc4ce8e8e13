"""One EP rank's expert stage on one GPU: bf16 against FP8, beside DeepGEMM's two grouped GEMMs alone and the floor.

    python benchmarks/bench_experts.py [--shapes v4-flash:128,v4-flash:32,v4-pro:192,v4-pro:48]
        [--tokens 128,2048,8192] [--waves 1,2,4] [--iters 20] [--out PATH]

One process holds ``e`` routed experts (v4-flash:128 is one rank's share at EP2, :32 at EP8; v4-pro:192 and :48),
so the stage sees what one rank of that EP size sees at T tokens per rank (top-6: T x 6 (row, slot) pairs, all
local). For each point it times, replayed from a CUDA graph with the L2 flushed, the stage from received rows to
rows ready for the combine (``expert_rows`` on pre-received rows, every wave in order, the layer's expert streams)
in bf16 (``torch._grouped_mm``) and in FP8 (``fp8_experts``: DeepGEMM's grouped GEMMs where ``deep_gemm``
imports; the rows arrive as FP8, ``fp8_rows``, as the layer sends them), at each wave count. Beside them, in the
same run:

- ``pack_us``: the sender's quantisation of its T rows (``fp8_rows.pack_rows``, before dispatch), and
  ``stage_bf16_rows_us``: the FP8 stage from bf16 rows (``WaveConfig.fp8_rows=False``: quantised at the stage);
- ``deepgemm_gemms_us``: DeepGEMM's two grouped FP8 GEMMs alone on rows already sorted and quantised (the
  contiguous psum layout and the masked layout; the faster of the two): the DeepEP + DeepGEMM baseline without
  its glue (ordering, quantisation, SwiGLU, the weighted sum);
- ``floor_us``: max(the stage's FLOPs at the run's FP8 (bf16) GEMM rate, its weight bytes at the run's copy
  bandwidth), both measured here (a square 8192 GEMM; a 2 GiB device copy, bytes read plus written).

Writes one JSON ({"meta", "rows"}, benchmarks/results/experts.json's shape) and prints a table with the goals of
the FP8 MoE issue beside the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import git_sha, now, out_path  # noqa: E402
from bench_moe import fullest_cell_capacity  # noqa: E402
from moe_wave import MoEConfig, WaveConfig, WaveMoE  # noqa: E402
from moe_wave.comm import EPGroup  # noqa: E402
from moe_wave.comm.options import SymmOptions  # noqa: E402
from moe_wave.experts import expert_rows  # noqa: E402
from moe_wave.fp8 import act_quant, fp8_matmul, weight_quant  # noqa: E402
from moe_wave.fp8_expert_kernels import aligned_capacity, aligned_groups  # noqa: E402
from moe_wave.fp8_experts import FP8RoutedExperts, fp8_gemm_grouped_library  # noqa: E402
from moe_wave.fp8_rows import pack_rows  # noqa: E402
from moe_wave.probe import pre_receive, routed_only  # noqa: E402
from moe_wave.timing import as_graph, iteration_us, l2_flush_buffer  # noqa: E402
from moe_wave.tools.bench import init_random_, random_inputs  # noqa: E402


def median_graph_us(fn, dev, iters: int, flush) -> float:
    replay = as_graph(lambda i: fn(), dev)[0]
    return statistics.median(iteration_us(replay, iters, 3, device=dev, flush=flush))


def ceilings(dev, iters: int, flush) -> dict:
    """The run's copy bandwidth (TB/s, bytes read + written) and GEMM rates (TFLOP/s, 8192^3)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 255)
    b = torch.empty_like(a)
    copy_us = median_graph_us(lambda: b.copy_(a), dev, iters, None)
    del a, b
    M = 8192
    x = torch.randn(M, M, device=dev, dtype=torch.bfloat16)
    w = torch.randn(M, M, device=dev, dtype=torch.bfloat16)
    bf16_us = median_graph_us(lambda: x @ w.t(), dev, iters, flush)
    xq, xs = act_quant(x)
    wq, ws = weight_quant(w)
    fp8_us = median_graph_us(lambda: fp8_matmul(xq, xs, wq, ws), dev, iters, flush)
    flops = 2.0 * M ** 3
    return {"copy_TBps": 2 * n / copy_us / 1e6, "bf16_TFLOPs": flops / bf16_us / 1e6,
            "fp8_TFLOPs": flops / fp8_us / 1e6}


def deepgemm_alone(ex: FP8RoutedExperts, counts: torch.Tensor, dev, iters: int, flush) -> dict:
    """DeepGEMM's two grouped GEMMs on rows already sorted by expert and quantised: contiguous (psum layout,
    groups aligned to 128 rows) and masked ([e, max_m, D] with per-expert counts)."""
    import deep_gemm as dg

    e, I, D = ex.num_local, ex.cfg.intermediate_size, ex.cfg.hidden_size
    pairs = int(counts.sum())
    offs = counts.cumsum(0).to(torch.int32)
    JA = aligned_capacity(pairs, e)
    _, ends = aligned_groups(offs)
    a = act_quant(torch.randn(JA, D, device=dev, dtype=torch.bfloat16))
    h = act_quant(torch.randn(JA, I, device=dev, dtype=torch.bfloat16))
    gu = torch.empty(JA, 2 * I, device=dev, dtype=torch.bfloat16)
    y = torch.empty(JA, D, device=dev, dtype=torch.bfloat16)

    def contiguous():
        dg.m_grouped_fp8_gemm_nt_contiguous((a[0], a[1].t()), (ex.gate_up, ex.gate_up_scale), gu, ends,
                                            use_psum_layout=True)
        dg.m_grouped_fp8_gemm_nt_contiguous((h[0], h[1].t()), (ex.down, ex.down_scale), y, ends, use_psum_layout=True)

    max_m = max(128, -(-int(counts.max()) // 128) * 128)
    masked_m = counts.to(torch.int32)
    expected = max(1, pairs // e)

    def mk(cols):       # each group's scales MN-major: [e, cols/128, max_m] seen as [e, max_m, cols/128]
        q, s = act_quant(torch.randn(e * max_m, cols, device=dev, dtype=torch.bfloat16))
        return q.view(e, max_m, cols), s.view(cols // 128, e, max_m).permute(1, 0, 2).contiguous().transpose(1, 2)

    ma, mh = mk(D), mk(I)
    mgu = torch.empty(e, max_m, 2 * I, device=dev, dtype=torch.bfloat16)
    my = torch.empty(e, max_m, D, device=dev, dtype=torch.bfloat16)

    def masked():
        dg.m_grouped_fp8_gemm_nt_masked(ma, (ex.gate_up, ex.gate_up_scale), mgu, masked_m, expected)
        dg.m_grouped_fp8_gemm_nt_masked(mh, (ex.down, ex.down_scale), my, masked_m, expected)

    out = {"deepgemm_contiguous_us": median_graph_us(contiguous, dev, iters, flush)}
    try:
        out["deepgemm_masked_us"] = median_graph_us(masked, dev, iters, flush)
    except RuntimeError as err:         # a layout this DeepGEMM refuses: recorded, the contiguous one stands
        out["deepgemm_masked_error"] = str(err).splitlines()[0][:200]
    out["deepgemm_gemms_us"] = min(v for k, v in out.items() if k.endswith("_us"))
    return out


def layouts_us(ex: FP8RoutedExperts, packed, stage_us, D: int, I: int, most_bytes: float = 16e9) -> dict:
    """The FP8 stage under each of the fused stage's layouts (``FP8RoutedExperts.gemm_layout``: the aligned one
    with DeepGEMM's psum GEMMs, the masked one with its masked GEMMs); a layout whose buffers would pass
    ``most_bytes`` is left out."""
    from moe_wave.fp8_experts import fp8_gemm_layout

    R, K = packed[0].expert_RK.shape
    out = {}
    keep = ex.gemm_layout
    try:
        for name in ("contiguous", "masked"):
            JA = fp8_gemm_layout(R, R * K, ex.num_local, name)[1]
            if JA * (3 * D + 5 * I) <= most_bytes:      # q, gu, hq, y
                ex.gemm_layout = name
                out[f"stage_{name}_us"] = round(stage_us(ex, packed, True), 1)
    finally:
        ex.gemm_layout = keep
    return out


def floor_us(prec: str, e: int, pairs: int, I: int, D: int, c: dict) -> float:
    flops = 2.0 * pairs * 3 * I * D
    weight_bytes = e * 3 * I * D * (1 if prec == "fp8" else 2)
    return max(flops / (c[f"{prec}_TFLOPs"] * 1e6), weight_bytes / (c["copy_TBps"] * 1e6))


GOALS = ("FP8 W=1 <= 0.60 x bf16 at 128 / 2048 tokens, <= 0.55 x at 8192 (v4-flash:128); FP8 <= 1.10 x DeepGEMM's "
         "two GEMMs alone; FP8 <= 1.30 x floor at 128 / 2048, <= 1.25 x at 8192; W=4 / W=1 <= 1.03")


def table(rows: list[dict]) -> str:
    head = ["shape", "e", "T", "bf16 W1", "fp8 W1", "fp8/bf16", "DG GEMMs", "fp8/DG", "floor", "fp8/floor",
            "bf16 W4/W1", "fp8 W4/W1", "pack", "fp8 bf16 rows", "fp8 contiguous / masked"]
    by = {(r["shape"], r["local_experts"], r["tokens_per_rank"], r["precision"], r["num_waves"]): r for r in rows}
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for (shape, e, T) in sorted({k[:3] for k in by}, key=lambda k: (k[0], -k[1], k[2])):
        def us(p, w):
            r = by.get((shape, e, T, p, w))
            return None if r is None else r["stage_us"]
        b1, f1, f4, b4 = us("bf16", 1), us("fp8", 1), us("fp8", 4), us("bf16", 4)
        r1 = by.get((shape, e, T, "fp8", 1), {})
        dgu, fl = r1.get("deepgemm_gemms_us"), r1.get("floor_us")

        def ratio(a, b):
            return f"{a / b:.3f}" if a and b else "-"
        def num(v):
            return f"{v:.1f}" if v else "-"
        lines.append(" | ".join([shape, str(e), str(T), num(b1), num(f1), ratio(f1, b1), num(dgu), ratio(f1, dgu),
                                 num(fl), ratio(f1, fl), ratio(b4, b1), ratio(f4, f1),
                                 str(r1.get("pack_us", "-")), str(r1.get("stage_bf16_rows_us", "-")),
                                 f"{r1.get('stage_contiguous_us', '-')} / {r1.get('stage_masked_us', '-')}"]))
    return "\n".join(lines)


@torch.no_grad()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="v4-flash:128,v4-flash:32,v4-pro:192,v4-pro:48",
                    help="comma list of preset:local_experts")
    ap.add_argument("--tokens", default="128,2048,8192")
    ap.add_argument("--waves", default="1,2,4")
    ap.add_argument("--precisions", default="bf16,fp8")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT/experts.json, else results/experts.json)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_experts: needs a GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    tokens = [int(t) for t in args.tokens.split(",")]
    waves = [int(w) for w in args.waves.split(",")]
    precs = args.precisions.split(",")
    flush = l2_flush_buffer(dev)
    c = ceilings(dev, args.iters, flush)
    lib = fp8_gemm_grouped_library(dev)
    meta = {"date": now(), "command": "python " + " ".join(sys.argv), "git_sha": git_sha(),
            "gpus": f"1 x {torch.cuda.get_device_name(dev)}", "torch": torch.__version__, "cuda": torch.version.cuda,
            "fp8_experts": lib, **{k: round(v, 3) for k, v in c.items()}}
    try:
        import deep_gemm
        meta["deep_gemm"] = getattr(deep_gemm, "__version__", "?")
    except ImportError:
        meta["deep_gemm"] = None
    print(json.dumps(meta), flush=True)
    path = args.out or out_path("experts.json", "results/experts.json")
    rows: list[dict] = []
    for spec in args.shapes.split(","):
        shape, e = spec.split(":")
        cfg = MoEConfig.preset(shape, num_experts=int(e))
        I, D, K = cfg.intermediate_size, cfg.hidden_size, cfg.top_k
        base = WaveMoE(cfg, ep=EPGroup.single(dev), wave=WaveConfig(backend="symm", symm=SymmOptions(
            capacity=max(tokens))), device=dev, dtype=torch.bfloat16)
        init_random_(base)
        experts = {"bf16": base.experts}
        if "fp8" in precs:
            experts["fp8"] = FP8RoutedExperts.from_dense(cfg, base.experts.gate_up, base.experts.down)
        if "bf16" not in precs:
            base.experts = None
            torch.cuda.empty_cache()
        for T in tokens:
            x, ids, w = random_inputs(base, T, 1)[0]
            pairs = T * K
            dgx = {}
            if "fp8" in precs and lib == "deepgemm":
                counts = torch.bincount(ids.reshape(-1), minlength=cfg.num_experts)
                dgx = deepgemm_alone(experts["fp8"], counts, dev, args.iters, flush)
            for W in waves:
                cap = max(128, fullest_cell_capacity(base, ids, w, W))
                moe = base.rescheduled(WaveConfig(backend="symm", num_waves=W, symm=base.wave.symm.replace(
                    capacity=cap)))
                got = pre_receive(moe.backend, x, ids, w, moe.plan)
                packed = pre_receive(moe.backend, pack_rows(x), ids, w, moe.plan, combine_width=D) \
                    if "fp8" in precs else None
                extra = moe.streams.extra[:1]

                def stage_us(ex, rows_in, fp8_rows: bool) -> float:
                    fn = (lambda g: expert_rows(g, ex, packed=fp8_rows))
                    return median_graph_us(lambda: routed_only(fn, rows_in, extra), dev, args.iters, flush)
                for prec in precs:
                    # FP8: from rows that arrived as FP8 (the layer's default, WaveConfig.fp8_rows)
                    t = stage_us(experts[prec], packed if prec == "fp8" else got, prec == "fp8")
                    row = {"shape": shape, "local_experts": int(e), "tokens_per_rank": T, "num_waves": W,
                           "precision": prec, "stage_us": round(t, 1), "capacity": cap,
                           "floor_us": round(floor_us(prec, int(e), pairs, I, D, c), 1),
                           "copy_TBps": round(c["copy_TBps"], 3), "gemm_TFLOPs": round(c[f"{prec}_TFLOPs"], 1)}
                    if prec == "fp8":
                        row.update({k: (round(v, 1) if isinstance(v, float) else v) for k, v in dgx.items()})
                        if W == 1:      # the sender's quantisation, and the stage from bf16 rows (fp8_rows=False)
                            row["pack_us"] = round(median_graph_us(lambda: pack_rows(x), dev, args.iters, flush), 1)
                            row["stage_bf16_rows_us"] = round(stage_us(experts[prec], got, False), 1)
                            row.update(layouts_us(experts[prec], packed, stage_us, D, I))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                del moe, got, packed
            with open(path, "w") as f:          # after every token count: a run cut short keeps what it measured
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
        del base, experts
        torch.cuda.empty_cache()
    print(f"\nexpert stage, one GPU ({meta['gpus']}, FP8 GEMMs: {lib}); copy {c['copy_TBps']:.2f} TB/s, bf16 "
          f"{c['bf16_TFLOPs']:.0f} TFLOP/s, FP8 {c['fp8_TFLOPs']:.0f} TFLOP/s; times in us (graph replay, median)")
    print(table(rows))
    print("goals: " + GOALS)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

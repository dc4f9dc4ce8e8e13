"""The attention layer's FP8 projections alone, at their own shapes, against the square FP8 GEMM of the same run.

    python dev/bench_fp8_shapes.py [--shape v4-flash] [--tokens 4096] [--iters 20] [--out PATH]

Each product is ``fp8.fp8_matmul`` (``torch._scaled_mm``, 1 x 128 activation by 128 x 128 weight block scales,
what the layer runs), its inputs quantised beforehand, timed from a CUDA graph (median of ``--iters`` replays).
Besides the layer's own calls it times the same work cut another way (by rows or by output columns, the grouped
wo_a with its inputs contiguous), to see whether cuBLAS's choice for a shape leaves speed on the table. Prints a
table (us, TFLOP/s, fraction of the square GEMM's rate) and writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from attn_kit import SHAPES, fp8_gemm_tflops, meta, time_alone  # noqa: E402

from moe_wave.fp8 import GroupedFP8, act_quant, fp8_matmul, weight_quant  # noqa: E402


def cases(M: int, hidden: int, heads: int, head_dim: int, q_lora: int, groups: int, o_rank: int, dev):
    """(name, flop, fn) for each product and each cut of it; fn() returns what it wrote (a cut by output columns:
    the list of its blocks), so that a test can check each cut against the whole."""
    def act(m, k):
        return act_quant(torch.randn(m, k, device=dev, dtype=torch.bfloat16))

    def wt(n, k):
        return weight_quant(torch.randn(n, k, device=dev) * k ** -0.5)

    def by_rows(xq, w, y, parts):              # each block's output rows are a contiguous slice of y
        r = M // parts

        def fn():
            for i in range(parts):
                fp8_matmul(xq[0][i * r:(i + 1) * r], xq[1][:, i * r:(i + 1) * r], *w, out=y[i * r:(i + 1) * r])
            return y
        return fn

    out = []
    x = act(M, hidden)
    for name, n in (("wq_a", q_lora), ("wkv", head_dim)):
        w = wt(n, hidden)
        out.append((f"{name} [{M}x{hidden}] -> {n}", 2 * M * hidden * n, lambda w=w: fp8_matmul(*x, *w)))
    qr = act(M, q_lora)
    N = heads * head_dim
    wb = wt(N, q_lora)
    y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    out.append((f"wq_b [{M}x{q_lora}] -> {N}", 2 * M * q_lora * N, lambda: fp8_matmul(*qr, *wb, out=y)))
    for parts in (2, 4):
        out.append((f"wq_b by {parts} row blocks", 2 * M * q_lora * N, by_rows(qr, wb, y, parts)))
    for parts in (2, 4):                       # by output columns (into separate tensors)
        c = N // parts
        ws = [(wb[0][i * c:(i + 1) * c], wb[1][i * c // 128:(i + 1) * c // 128]) for i in range(parts)]
        outs = [torch.empty(M, c, device=dev, dtype=torch.bfloat16) for _ in range(parts)]

        def cols(ws=ws, outs=outs):
            for w, o in zip(ws, outs):
                fp8_matmul(*qr, *w, out=o)
            return outs
        out.append((f"wq_b by {parts} column blocks", 2 * M * q_lora * N, cols))
    # the grouped wo_a as the layer runs it (GroupedFP8: group g's input is the column slice g of the core's
    # [M, H*d] output), and the same groups with their inputs copied out contiguous beforehand
    kg = N // groups
    o_q, o_s = act(M, N)
    wa = GroupedFP8(torch.randn(groups * o_rank, kg, device=dev) * kg ** -0.5, groups)
    flop_a = 2 * M * kg * o_rank * groups
    out.append((f"wo_a {groups} x [{M}x{kg}] -> {o_rank} (strided)", flop_a,
                lambda: wa.forward_q(o_q, o_s, torch.bfloat16)))
    z = torch.empty(groups, M, o_rank, device=dev, dtype=torch.bfloat16)
    kb, nb = kg // 128, o_rank // 128
    o_g = [o_q[:, g * kg:(g + 1) * kg].contiguous() for g in range(groups)]

    def wo_a_contig():
        for g in range(groups):
            fp8_matmul(o_g[g], o_s[g * kb:(g + 1) * kb], wa.weight[g * o_rank:(g + 1) * o_rank],
                       wa.weight_scale[g * nb:(g + 1) * nb], out=z[g])
        return z
    out.append(("wo_a, inputs contiguous", flop_a, wo_a_contig))
    zq = act(M, groups * o_rank)
    wbo = wt(hidden, groups * o_rank)
    yo = torch.empty(M, hidden, device=dev, dtype=torch.bfloat16)
    flop_b = 2 * M * groups * o_rank * hidden
    out.append((f"wo_b [{M}x{groups * o_rank}] -> {hidden}", flop_b, lambda: fp8_matmul(*zq, *wbo, out=yo)))
    out.append(("wo_b by 2 row blocks", flop_b, by_rows(zq, wbo, yo, 2)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="v4-flash", choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.quick = False
    if not torch.cuda.is_available():
        sys.exit("bench_fp8_shapes: needs a CUDA GPU")
    dev = torch.device("cuda")
    s = SHAPES[args.shape]
    square = fp8_gemm_tflops(dev)
    rows = []
    for name, flop, fn in cases(args.tokens, s["hidden"], s["heads"], 512, s["q_lora_rank"], s["o_groups"], 1024,
                                dev):
        us = time_alone(fn, args.iters)
        rows.append(dict(name=name, us=round(us, 1), tflops=round(flop / us / 1e6, 1),
                         vs_square=round(flop / us / 1e6 / square, 3)))
        print(f"{us:9.1f} us  {flop / us / 1e6:7.1f} TFLOP/s  {flop / us / 1e6 / square:5.2f}  {name}", flush=True)
    print(f"square FP8 GEMM [8192^3]: {square:.1f} TFLOP/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": dict(meta(args), context=args.tokens, square_fp8_tflops=round(square, 1)),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

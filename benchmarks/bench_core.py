"""The sparse attention core alone, on synthetic V4 prefill picks: the Triton kernel against the CUDA C++ (Hopper) one.

    python benchmarks/bench_core.py [--tokens 4096] [--iters 20] [--out PATH]

First a correctness pass (each implementation against the torch reference in fp32, the two against each other,
and each run twice: the bits must repeat), then the timing: CUDA graphs, V4-Flash (64 heads) and V4-Pro (128
heads), d = 512, for the three layer types' picks at a prefill of ``--tokens`` tokens (B = 1):

- sliding: the window only (the last 128 positions, -1 before the start);
- CSA: the window, then top-512 of the compressed entries (ratio 4) visible to the query, as ``topk_select``
  returns them (valid picks first, -1 after);
- HCA: the window, then every compressed entry (ratio 128), -1 where not yet visible.

Each row reports us, useful TFLOP/s (4 * H * d per valid pick) and the share of a dense bf16 GEMM timed in the same
run. The picks are random, not an indexer's: the kernels' cost depends on the pick count and the gather, not on
which rows are picked. (The Gluon kernels this benchmark also timed were deleted; their numbers are in
``benchmarks/results/attn.md``.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from attn_kit import gemm_tflops, time_alone  # noqa: E402  (the attention benchmarks' yardstick and timer)

from moe_wave.attention.sparse_core import (core_flops, cuda_impl, sparse_attention,  # noqa: E402
                                            sparse_attention_fused)

WINDOW, TOPK = 128, 512


def picks(kind: str, S: int, dev, g) -> list:
    """[(M, idx [1, S, J])] of a layer type at prefill (positions 0..S-1); the window's picks newest first, as the
    layer's (``kernels.picks``)."""
    s = torch.arange(S, device=dev)
    win = s[:, None] - torch.arange(WINDOW, device=dev)[None, :]
    parts = [(S, torch.where(win >= 0, win, -1))]
    if kind == "csa":
        M = S // 4
        vis = (s + 1) // 4                                              # compressed entries complete so far
        r = torch.rand(S, M, device=dev, generator=g)
        r = torch.where(torch.arange(M, device=dev)[None, :] < vis[:, None], r, -1.0)
        top = r.topk(min(TOPK, M), dim=1)
        parts.append((M, torch.where(top.values >= 0, top.indices, -1)))
    elif kind == "hca":
        M = S // 128
        j = torch.arange(M, device=dev)[None, :].expand(S, M)
        parts.append((M, torch.where(j < ((s + 1) // 128)[:, None], j, -1)))
    return [(M, idx[None].to(torch.int32).contiguous()) for M, idx in parts]


def make(kind: str, S: int, H: int, D: int, dev, seed: int = 0, dtype=torch.bfloat16):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(1, S, H, D, device=dev, generator=g).to(dtype)
    parts = [(torch.randn(1, M, D, device=dev, generator=g).to(dtype), idx) for M, idx in picks(kind, S, dev, g)]
    sinks = torch.randn(H, device=dev, generator=g)
    return q, parts, sinks


IMPLS = ("triton", "cuda")


def run(impl: str, q, parts, sinks):
    scale = q.shape[-1] ** -0.5
    (kv1, i1), (kv2, i2) = parts[0], parts[-1]
    if impl == "cuda":                      # the CUDA C++ kernel, launched directly
        out = torch.empty_like(q)
        cuda_impl.sparse_attention_cuda(q, out, sinks.float(), kv1, i1, kv2, i2, scale, len(parts) == 2)
        return out
    return sparse_attention_fused(q, parts, sinks, scale, impl=impl)


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def check(dev) -> list:
    """Both implementations against the fp32 torch reference on awkward cases; the bits repeat run to run."""
    rows = []
    g = torch.Generator(device=dev).manual_seed(1)
    cases = [  # name, B, S, H, D, [(M, J, how)]
        ("two parts, random -1", 2, 5, 64, 512, [(150, 130, "random"), (90, 70, "random")]),
        ("window tail + topk tail", 1, 7, 128, 512, [(300, 128, "tail"), (200, 200, "tail")]),
        ("one part, J % 64 != 0", 2, 3, 64, 512, [(100, 37, "random")]),
        ("all masked", 1, 4, 64, 512, [(50, 64, "none"), (40, 33, "none")]),
    ]
    for name, B, S, H, D, spec in cases:
        dtype = torch.bfloat16
        q = torch.randn(B, S, H, D, device=dev, generator=g).to(dtype)
        parts = []
        for M, J, how in spec:
            kv = torch.randn(B, M, D, device=dev, generator=g).to(dtype)
            idx = torch.randint(-1 if how == "random" else 0, M, (B, S, J), device=dev, generator=g)
            if how == "tail":
                keep = torch.randint(0, J + 1, (B, S, 1), device=dev, generator=g)
                idx = torch.where(torch.arange(J, device=dev) < keep, idx, -1)
            elif how == "none":
                idx.fill_(-1)
            idx[0, 0] = -1
            parts.append((kv, idx.to(torch.int32)))
        sinks = torch.randn(H, device=dev, generator=g)
        want = sparse_attention(q.float(), [(kv.float(), i) for kv, i in parts], sinks, D ** -0.5, kernels="off")
        row = dict(case=name)
        outs = {}
        for impl in IMPLS:
            a, b = run(impl, q, parts, sinks), run(impl, q, parts, sinks)
            outs[impl] = a
            row[f"{impl}_rel"] = round(rel(a, want), 5)
            row[f"{impl}_repeat"] = bool(torch.equal(a, b))
            row[f"{impl}_zero_row"] = bool(torch.equal(a[0, 0].float(), torch.zeros_like(a[0, 0].float())))
        row["cuda_vs_triton"] = round(rel(outs["cuda"], outs["triton"]), 5)
        row["ok"] = all(row[k] < 1.5e-2 for k in row if k.endswith("_rel")) and all(
            row[k] for k in row if k.endswith("_repeat") or k.endswith("_zero_row"))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def bench(dev, S: int, iters: int, gemm: float, only: str | None = None, impls: list | None = None) -> list:
    rows = []
    for shape, H in (("v4-flash", 64), ("v4-pro", 128)):
        for kind in ("sliding", "csa", "hca"):
            if only and only != f"{shape}:{kind}":
                continue
            q, parts, sinks = make(kind, S, H, 512, dev)
            useful, _ = core_flops(H, 512, [idx for _, idx in parts])
            row = dict(shape=shape, layer_type=kind, tokens=S, gflop=round(useful / 1e9, 2))
            for impl in IMPLS:
                if impls and impl not in impls:
                    row[f"{impl}_us"] = row[f"{impl}_tflops"] = row[f"{impl}_vs_gemm"] = float("nan")
                    continue
                us = time_alone(lambda: run(impl, q, parts, sinks), iters)
                row[f"{impl}_us"] = round(us, 1)
                row[f"{impl}_tflops"] = round(useful / us / 1e6, 1)
                row[f"{impl}_vs_gemm"] = round(useful / us / 1e6 / gemm, 3)
            row["cuda_vs_triton"] = round(row["triton_us"] / row["cuda_us"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument("--only", default=None, help="shape:type, e.g. v4-flash:csa (one row)")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness pass")
    ap.add_argument("--impls", default=None, help="comma list of implementations to time (default: all)")
    args = ap.parse_args()
    if not cuda_impl.available():
        raise SystemExit("bench_core: needs a Hopper GPU (sparse_core.cuda_impl.available() is False)")
    dev = torch.device("cuda")
    t0 = time.time()
    checks = [] if args.no_check else check(dev)
    gemm = gemm_tflops(dev)
    rows = bench(dev, args.tokens, args.iters, gemm, args.only, args.impls.split(",") if args.impls else None)
    print(f"\ndense bf16 GEMM {gemm:.0f} TFLOP/s; correctness: {sum(r['ok'] for r in checks)}/{len(checks)} ok")
    print(f"{'shape':9} {'type':8} {'GFLOP':>6} {'triton_us':>10} {'%gemm':>6} {'cuda_us':>8} {'%gemm':>6} {'x':>5}")
    for r in rows:
        print(f"{r['shape']:9} {r['layer_type']:8} {r['gflop']:>6.1f} {r['triton_us']:>10.1f} "
              f"{100 * r['triton_vs_gemm']:>5.0f}% {r['cuda_us']:>8.1f} {100 * r['cuda_vs_gemm']:>5.0f}% "
              f"{r['cuda_vs_triton']:>5.2f}")
    if args.out:
        meta = dict(command=" ".join(sys.argv), git_sha=os.environ.get("MOE_WAVE_GIT_SHA", "unknown"),
                    gpu=torch.cuda.get_device_name(), torch=torch.__version__, gemm_tflops=round(gemm, 1),
                    seconds=round(time.time() - t0, 1))
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, check=checks, bench=rows), f, indent=1)


if __name__ == "__main__":
    main()

"""The first grouped GEMM with SwiGLU + requant on DeepGEMM's own kernel (``gate_up_dg``) against DeepGEMM's GEMM
alone and the DeepGEMM way (its GEMM, then ``swiglu_quant``), on one GPU, in one run.

    python dev/probe_gate_up_dg.py [--shapes v4-flash:32,v4-flash:128,v4-pro:48] [--tokens 2048,8192]
        [--clusters 1,2] [--iters 20] [--out PATH]

For each point (one EP rank's share: e local experts, T tokens, top-6 with random routing; T received FP8 rows
(``fp8_rows``), copied into the aligned expert-major layout by ``gather_pairs``) it times, replayed from a CUDA
graph with the L2 flushed (median of --iters): DeepGEMM's ``m_grouped_fp8_gemm_nt_contiguous`` (psum layout) alone
on the layout's rows, it followed by ``swiglu_quant``, ``gate_up_dg`` in clusters of each of --clusters
(``gate_up_dg.CLUSTER``: 1 none, 2 the weight tiles multicast to a pair), the Triton ``gate_up_swiglu`` (on the
layout's rows), ``gather_pairs`` alone, and, from the received rows, ``gather_pairs`` + ``gate_up_dg`` against
``gate_up_dg`` reading them where they arrived (src_J; the library's CLUSTER); and checks that ``gate_up_dg``'s h
and scales equal the DeepGEMM way's bit for bit on every row in use, at every cluster size and both ways of reading
the rows. Needs ``deep_gemm`` (``source launch/deepgemm.sh``) and nvcc. Writes --out (default
$OUT/probe_gate_up_dg.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_experts import median_graph_us  # noqa: E402
from moe_wave.config import PRESETS  # noqa: E402
from moe_wave.expert_kernels import expert_order  # noqa: E402
from moe_wave.fp8_expert_kernels import (aligned_capacity, aligned_groups, block_ends, gate_up_swiglu,  # noqa: E402
                                         gather_pairs, swiglu_quant)
from moe_wave.fp8_rows import pack_rows, unpack_rows  # noqa: E402
from moe_wave.fp8_experts import quant_experts  # noqa: E402
import moe_wave.gate_up_dg as gd  # noqa: E402
from moe_wave.timing import l2_flush_buffer  # noqa: E402


def point(preset: str, e: int, T: int, clusters: list[int], iters: int, flush, dev) -> dict:
    import deep_gemm as dg

    cfg = PRESETS[preset]
    I, D, K, lim = cfg.intermediate_size, cfg.hidden_size, cfg.top_k, cfg.swiglu_limit
    g = torch.Generator(device=dev).manual_seed(T + e)
    picks = torch.rand(T, e, device=dev, generator=g).topk(min(K, e), dim=1).indices
    counts = torch.bincount(picks.flatten(), minlength=e)
    offs = counts.cumsum(0).to(torch.int32)
    pairs = int(offs[-1])
    JA = aligned_capacity(pairs, e)
    starts, ends = aligned_groups(offs)
    starts, ends = starts.to(torch.int32).contiguous(), ends.to(torch.int32).contiguous()
    bend = block_ends(starts, ends, JA)
    n = ends[-1:].contiguous()
    w, ws = quant_experts((torch.randn(e, 2 * I, D, device=dev) * 0.02))
    received = pack_rows(torch.randn(T, D, device=dev, dtype=torch.bfloat16))
    src, pos = expert_order(picks.to(torch.int32), e, offs, starts_e=starts, capacity=JA)
    q, s = gather_pairs(received, D, pos, JA)
    rows = torch.cat([torch.arange(a, b, device=dev) for a, b in zip(starts.tolist(), ends.tolist())])
    gu = torch.empty(JA, 2 * I, device=dev, dtype=torch.bfloat16)

    def gemm():
        dg.m_grouped_fp8_gemm_nt_contiguous((q, s.t()), (w, ws), gu, ends, use_psum_layout=True)

    def dg_way():
        gemm()
        return swiglu_quant(gu, None, None, lim, bend=bend)

    def ours():
        return gd.gate_up_dg(q, s, w, ws, ends, lim)

    def triton():
        return gate_up_swiglu(q, s, w, ws, starts, bend, lim, None, n=n, bm=128)

    def gather():
        return gather_pairs(received, D, pos, JA)

    def gathered():
        return gd.gate_up_dg(*gather(), w, ws, ends, lim)

    def in_place():
        return gd.gate_up_dg(*unpack_rows(received, D), w, ws, ends, lim, src_J=src)

    ref_q, ref_s = dg_way()

    def same(hq, hs) -> bool:           # h and its scales equal the DeepGEMM way's on every row in use
        return bool(torch.equal(hq[rows].view(torch.uint8), ref_q[rows].view(torch.uint8))
                    and torch.equal(hs[:, rows], ref_s[:, rows]))
    out = {"shape": f"{preset}:{e}", "tokens": T, "pairs": pairs, "JA": JA, "bits_equal": True}
    for name, fn in (("dg_gemm_us", gemm), ("dg_way_us", dg_way), ("triton_us", triton), ("gather_us", gather),
                     ("gather_gate_up_dg_us", gathered), ("gate_up_dg_src_us", in_place)):
        out[name] = median_graph_us(fn, dev, iters, flush)
    out["src_over_gather"] = out["gate_up_dg_src_us"] / out["gather_gate_up_dg_us"]
    out["src_bits_equal"] = same(*in_place())
    out["bits_equal"] &= out["src_bits_equal"]
    kept = gd.CLUSTER
    try:
        for c in clusters:
            gd.CLUSTER = c
            out["bits_equal"] &= same(*ours())
            out[f"gate_up_dg_c{c}_us"] = t = median_graph_us(ours, dev, iters, flush)
            out[f"gate_up_dg_c{c}_over_dg_gemm"] = t / out["dg_gemm_us"]
            out[f"gate_up_dg_c{c}_over_dg_way"] = t / out["dg_way_us"]
    finally:
        gd.CLUSTER = kept
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="v4-flash:32,v4-flash:128,v4-pro:48")
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--clusters", default="1,2")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    flush = l2_flush_buffer(dev)
    rows, clusters = [], [int(c) for c in args.clusters.split(",")]
    for spec in args.shapes.split(","):
        preset, e = spec.split(":")
        for T in map(int, args.tokens.split(",")):
            r = point(preset, int(e), T, clusters, args.iters, flush, dev)
            rows.append(r)
            print(json.dumps(r), flush=True)
    cols = [f"gate_up_dg c{c}" for c in clusters] + [f"c{c} / DG GEMM" for c in clusters] + \
        [f"c{c} / DG way" for c in clusters]
    print("| shape | tokens | pairs | DG GEMM | DG GEMM + swiglu_quant | Triton fused | " + " | ".join(cols)
          + " | gather_pairs | gather_pairs + gate_up_dg | gate_up_dg, src_J | src_J / gather | bits |")
    print("|---" * (11 + len(cols)) + "|")
    for r in rows:
        vals = [f"{r[f'gate_up_dg_c{c}_us']:.1f}" for c in clusters] + \
            [f"{r[f'gate_up_dg_c{c}_over_dg_gemm']:.3f}" for c in clusters] + \
            [f"{r[f'gate_up_dg_c{c}_over_dg_way']:.3f}" for c in clusters]
        print(f"| {r['shape']} | {r['tokens']} | {r['pairs']} | {r['dg_gemm_us']:.1f} | {r['dg_way_us']:.1f} | "
              f"{r['triton_us']:.1f} | " + " | ".join(vals) + f" | {r['gather_us']:.1f} | "
              f"{r['gather_gate_up_dg_us']:.1f} | {r['gate_up_dg_src_us']:.1f} | {r['src_over_gather']:.3f} | "
              f"{'equal' if r['bits_equal'] else 'DIFFER'} |")
    path = args.out or os.path.join(os.environ.get("OUT", "."), "probe_gate_up_dg.json")
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0 if all(r["bits_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

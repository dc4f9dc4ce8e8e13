"""The FP8 stage's first GEMM + SwiGLU + requant on one wave's inputs, four ways, bits compared and timed:

- ``dg``: ``gather_pairs`` (the FP8 rows into the layout), DeepGEMM's contiguous grouped GEMM into bf16 gu, then
  ``swiglu_quant`` (the library's way above 128 pairs an expert before the CUDA kernel);
- ``dg gemm``: DeepGEMM's GEMM alone (its rate, for reference);
- ``triton``: ``gate_up_swiglu`` reading the rows where they arrived (``src_J``, 128-row tiles);
- ``cuda lay`` / ``cuda src``: ``gate_up_cuda.gate_up_sm90`` (CTAs in pairs, the weights multicast) on the
  layout's rows (after ``gather_pairs``) and reading the rows where they arrived; ``src c1``: the latter with
  CTAs alone.

    python dev/probe_gate_up_sm90.py [--shapes v4-flash:32,v4-flash:128,v4-pro:48] [--tokens 2048,8192]
        [--waves 1,4] [--iters 30]

Inputs as ``dev/probe_wave_glue.py``'s (wave 0 of W, uniform top-k routing), random FP8 weights. Each way is
captured in a CUDA graph and timed alone (median, L2 flushed). Bits: h's e4m3 codes and scales of the groups'
rows against the ``triton`` way's (``same`` the fraction equal, ``dq`` the largest difference of dequantised h
over h's largest magnitude). One GPU (Hopper, with deep_gemm).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from probe_wave_glue import timed, wave_inputs  # noqa: E402

from moe_wave import MoEConfig  # noqa: E402
from moe_wave.expert_kernels import expert_order  # noqa: E402
from moe_wave.fp8_expert_kernels import (aligned_capacity, gate_up_swiglu, gather_pairs, layout_groups,  # noqa: E402
                                         swiglu_quant)
from moe_wave.fp8_experts import _deep_gemm_grouped, quant_experts  # noqa: E402
from moe_wave.fp8_rows import pack_rows, unpack_rows  # noqa: E402
from moe_wave.gate_up_cuda import available, gate_up_sm90  # noqa: E402
from moe_wave.timing import l2_flush_buffer  # noqa: E402


def compare(a, b, used, I):
    """(fraction of equal codes and scales, max |dequant(a) - dequant(b)| / max |dequant(b)|) on the used rows."""
    (qa, sa), (qb, sb) = a, b
    same = (torch.equal(sa[:, used], sb[:, used]),
            (qa.view(torch.uint8)[used] == qb.view(torch.uint8)[used]).float().mean().item())
    da = qa[used].float() * sa[:, used].t().repeat_interleave(128, 1)
    db = qb[used].float() * sb[:, used].t().repeat_interleave(128, 1)
    return same[1] if same[0] else -same[1], ((da - db).abs().max() / db.abs().max().clamp_min(1e-30)).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="v4-flash:32,v4-flash:128,v4-pro:48")
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--waves", default="1,4")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_gate_up_sm90: needs a GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    dg = _deep_gemm_grouped(dev)
    if dg is None or not available(0):
        print(f"probe_gate_up_sm90: deep_gemm {dg is not None}, the CUDA kernel {available(0)}", file=sys.stderr)
        return 2
    flush = l2_flush_buffer(dev)
    print("us per wave (graph, L2 flushed); same / dq against the triton way (a negative same: scales differ)")
    print(f"{'shape':>14} {'T':>5} {'W':>2} {'pairs':>6} {'dg':>8} {'dg gemm':>8} {'triton':>8} {'cuda lay':>8} "
          f"{'cuda src':>8} {'src c1':>8} {'src/dg':>7} {'same lay':>8} {'dq lay':>8} {'same src':>8} {'dq src':>8} "
          f"{'same c1':>8} {'dq c1':>8} {'same dg':>8} {'dq dg':>8}")
    for spec in args.shapes.split(","):
        name, e = spec.split(":")
        e = int(e)
        cfg = MoEConfig.preset(name, num_experts=e)
        I, D, K, lim = cfg.intermediate_size, cfg.hidden_size, cfg.top_k, cfg.swiglu_limit
        g = torch.Generator(device=dev).manual_seed(1)
        wq, ws = quant_experts(torch.randn(e, 2 * I, D, generator=g, device=dev, dtype=torch.bfloat16) * 0.02)
        for T in (int(t) for t in args.tokens.split(",")):
            for W in (int(v) for v in args.waves.split(",")):
                ex, _, counts, R = wave_inputs(T, K, e, W, dev)
                pairs = R * K
                JA = aligned_capacity(pairs, e)
                grp = layout_groups(counts, pairs, JA)
                src, pos = expert_order(ex, e, grp.offs, starts_e=grp.starts, capacity=JA)
                xp = pack_rows(torch.randn(R, D, generator=g, device=dev).to(torch.bfloat16))
                qr, sr = unpack_rows(xp, D)
                r_ = torch.arange(JA, device=dev)[:, None]
                used = ((r_ >= grp.starts[None]) & (r_ < grp.ends[None])).any(1)

                def way_dg():
                    q, s = gather_pairs(xp, D, pos, JA)
                    gu = torch.empty(JA, 2 * I, dtype=torch.bfloat16, device=dev)
                    dg.m_grouped_fp8_gemm_nt_contiguous((q, s.t()), (wq, ws), gu, grp.ends, use_psum_layout=True)
                    return swiglu_quant(gu, None, None, lim, None, bend=grp.bend)

                q0, s0 = gather_pairs(xp, D, pos, JA)
                gu0 = torch.empty(JA, 2 * I, dtype=torch.bfloat16, device=dev)

                def way_gemm():
                    dg.m_grouped_fp8_gemm_nt_contiguous((q0, s0.t()), (wq, ws), gu0, grp.ends, use_psum_layout=True)

                def way_tri():
                    return gate_up_swiglu(qr, sr, wq, ws, grp.starts, grp.bend, lim, src_J=src, n=grp.n, bm=128)

                def way_lay():
                    q, s = gather_pairs(xp, D, pos, JA)
                    return gate_up_sm90(q, s, wq, ws, grp.starts, grp.bend, lim, grp.n)

                def way_src():
                    return gate_up_sm90(qr, sr, wq, ws, grp.starts, grp.bend, lim, grp.n, src_J=src)

                def way_src64():
                    return gate_up_sm90(qr, sr, wq, ws, grp.starts, grp.bend, lim, grp.n, src_J=src, cluster=1)

                ref = way_tri()
                torch.cuda.synchronize()
                lay, srcw, s64, dgw = way_lay(), way_src(), way_src64(), way_dg()
                torch.cuda.synchronize()
                cmp = [compare(w, ref, used, I) for w in (lay, srcw, s64, dgw)]
                t = [timed(f, dev, args.iters, flush) for f in (way_dg, way_gemm, way_tri, way_lay, way_src,
                                                                way_src64)]
                print(f"{spec:>14} {T:5d} {W:2d} {int(counts.sum()):6d} " + " ".join(f"{x:8.1f}" for x in t)
                      + f" {t[4] / t[0]:7.3f} " + " ".join(f"{c[0]:8.4f} {c[1]:8.1e}" for c in cmp), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

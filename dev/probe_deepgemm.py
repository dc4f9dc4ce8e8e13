"""DeepGEMM's FP8 GEMMs against ``torch._scaled_mm`` on the V4 layer's projections, in one run.

Each projection (``SHAPES`` below) runs in the layer's format, 1 x 128 activation by 128 x 128
weight block scales (``fp8.act_quant`` / ``fp8.weight_quant``), with the activations' scales as the layer keeps
them ([K/128, M] contiguous, which is DeepGEMM's MN-major layout for SM90 as it is). Timed from CUDA graphs
(``attn_kit.time_alone``): torch's product (``fp8.fp8_matmul``), ``deep_gemm.fp8_gemm_nt`` per group on the
column slices of the input, and for the grouped wo_a DeepGEMM's masked grouped GEMM over a [G, M, K] view of the
same input and its contiguous grouped GEMM over a copy in group-major rows. Each output is compared with torch's
(bits, largest difference). Needs ``deep_gemm`` importable (``source launch/deepgemm.sh``).

    python dev/probe_deepgemm.py [--shape v4-flash|v4-pro] [--tokens 4096] [--iters 20] --out PATH
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from attn_kit import time_alone  # noqa: E402
from moe_wave import fp8  # noqa: E402

SHAPES = {  # name: (N, K, groups); x [T, groups * K] -> y [T, groups * N] (groups > 1: wo_a)
    "v4-flash": {"wq_a": (1024, 4096, 1), "wkv": (512, 4096, 1), "wq_b": (32768, 1024, 1),
                 "idx_wq_b": (8192, 1024, 1), "wo_a": (1024, 4096, 8), "wo_b": (4096, 8192, 1),
                 "square": (8192, 8192, 1)},
    "v4-pro": {"wq_a": (1536, 7168, 1), "wq_b": (65536, 1536, 1), "wo_a": (1024, 4096, 16),
               "wo_b": (7168, 16384, 1)},
}


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (out.float() - ref.float()).abs()
    return {"same_bits": bool(torch.equal(out, ref)), "max_diff": d.max().item(),
            "rel_diff": d.max().item() / max(ref.float().abs().max().item(), 1e-30),
            "frac_bits_equal": round((out == ref).float().mean().item(), 4)}


def probe(dg, name: str, N: int, K: int, G: int, T: int, iters: int) -> dict:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    x_q, s = fp8.act_quant(torch.randn(T, G * K, device=dev, dtype=torch.bfloat16))
    w_q, s_w = fp8.weight_quant(torch.randn(G * N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5)
    kb, nb = K // 128, N // 128
    ref = torch.empty(G, T, N, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(ref)

    def torch_call():
        for g in range(G):
            fp8.fp8_matmul(x_q[:, g * K:(g + 1) * K], s[g * kb:(g + 1) * kb], w_q[g * N:(g + 1) * N],
                           s_w[g * nb:(g + 1) * nb], out=ref[g])

    def dg_call():
        for g in range(G):
            dg.fp8_gemm_nt((x_q[:, g * K:(g + 1) * K], s[g * kb:(g + 1) * kb].t()),
                           (w_q[g * N:(g + 1) * N], s_w[g * nb:(g + 1) * nb]), out[g])

    gflop = 2 * T * N * K * G / 1e9
    torch_call()
    row = {"shape": name, "M": T, "N": N, "K": K, "groups": G, "gflop": gflop}
    row["torch_us"] = round(time_alone(torch_call, iters), 2)
    variants = [("dg", dg_call)]
    if G > 1:
        a3 = x_q.view(T, G, K).transpose(0, 1)                       # [G, T, K], strides (K, G*K, 1)
        sa3 = s.view(G, kb, T).transpose(1, 2)                       # [G, T, K/128], MN-major
        b3, sb3 = w_q.view(G, N, K), s_w.view(G, nb, kb)
        masked = torch.full((G,), T, dtype=torch.int32, device=dev)

        def dg_masked():
            dg.m_grouped_fp8_gemm_nt_masked((a3, sa3), (b3, sb3), out, masked, T)

        a_c = a3.reshape(G * T, K).contiguous()                      # group-major rows (a copy, not timed)
        sa_c = s.view(G, kb, T).permute(1, 0, 2).reshape(kb, G * T).contiguous().t()
        layout = torch.arange(G, dtype=torch.int32, device=dev).repeat_interleave(T)
        out_c = out.view(G * T, N)

        def dg_contig():
            dg.m_grouped_fp8_gemm_nt_contiguous((a_c, sa_c), (b3, sb3), out_c, layout)
        variants += [("dg_masked", dg_masked), ("dg_contig", dg_contig)]
    for vname, fn in variants:
        out.zero_()
        t0 = time.time()
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a refused layout is a result here
            row[vname] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        first_s = time.time() - t0
        cmp = compare(out, ref)
        us = time_alone(fn, iters)
        row[vname] = {"us": round(us, 2), "tflops": round(gflop / us * 1e3, 1), "first_call_s": round(first_s, 1),
                      **cmp}
    row["torch_tflops"] = round(gflop / row["torch_us"] * 1e3, 1)
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="v4-flash", choices=sorted(SHAPES))
    ap.add_argument("--only", default="", help="comma-separated projections (default: all of the shape's)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_deepgemm: needs a CUDA GPU")
    import deep_gemm as dg
    rows = []
    for name, (N, K, G) in SHAPES[a.shape].items():
        if a.only and name not in a.only.split(","):
            continue
        r = probe(dg, name, N, K, G, a.tokens, a.iters)
        rows.append(r)
        line = f"{name:9s} torch {r['torch_us']:8.2f} us {r['torch_tflops']:7.1f} TF/s"
        for v in ("dg", "dg_masked", "dg_contig"):
            if v in r:
                x = r[v]
                line += (f" | {v} ERROR {x['error'][:60]}" if "error" in x else
                         f" | {v} {x['us']:8.2f} us {x['tflops']:7.1f} TF/s x{r['torch_us'] / x['us']:.3f} "
                         f"bits={x['same_bits']} eq={x['frac_bits_equal']} rel={x['rel_diff']:.1e}")
        print(line, flush=True)
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(), "tokens": a.tokens, "shape": a.shape,
            "deep_gemm": getattr(dg, "__version__", "?")}
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""Every cuBLASLt algorithm for the V4 layer's FP8 projections, timed against ``torch._scaled_mm`` in one run.

torch takes the first algorithm of cuBLASLt's heuristic; this times the heuristic's whole list and every
(algorithm id, tile, stages, cluster, swizzle, custom option) cuBLASLt accepts, each in CUDA graphs, and checks each
output against torch's (bits, and the largest difference). wo_a also runs as one strided batch of its 8 groups.

    python launch/probe_cublaslt.py [--shape v4-flash|v4-pro] [--tokens 4096] [--limit 600] --out PATH
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import cublaslt  # launch/cublaslt.py, beside this script
from bench_attn import time_alone
from moe_wave import fp8
from moe_wave.timing import median_us

SHAPES = {  # name: (N, K, groups); x [T, groups * K] -> y [T, groups * N] (groups > 1: wo_a)
    "v4-flash": {"wq_a": (1024, 4096, 1), "wkv": (512, 4096, 1), "wq_b": (32768, 1024, 1),
                 "idx_wq_b": (8192, 1024, 1), "wo_a": (1024, 4096, 8), "wo_b": (4096, 8192, 1),
                 "square": (8192, 8192, 1)},
    "v4-pro": {"wq_a": (1536, 7168, 1), "wq_b": (65536, 1536, 1), "wo_a": (1024, 4096, 16),
               "wo_b": (7168, 16384, 1)},
}


def graph_us(fn, iters: int = 9) -> float:
    """Median us of ``fn()`` replayed from a CUDA graph (``bench_attn.time_alone``, as bench_fp8_shapes times these
    projections)."""
    return time_alone(fn, iters)


def eager_us(fn, reps: int = 4) -> float:
    """us per call over ``reps`` calls back to back after one (the screen before the graphs)."""
    return median_us(fn, 1, warmup=1, reps=reps, device="cuda")


def probe(name: str, N: int, K: int, G: int, T: int, limit: int, ws: torch.Tensor, seconds: float) -> dict:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(T, G * K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(G * N, K, device=dev, dtype=torch.bfloat16) * 0.02
    x_q, s = fp8.act_quant(x)
    w_q, s_w = fp8.weight_quant(w)
    kb, nb = K // 128, N // 128
    out = torch.empty(G, T, N, device=dev, dtype=torch.bfloat16)      # group-major, as GroupedFP8
    ref = torch.empty_like(out)

    def torch_call(o=ref):
        for g in range(G):
            fp8.fp8_matmul(x_q[:, g * K:(g + 1) * K], s[g * kb:(g + 1) * kb], w_q[g * N:(g + 1) * N],
                           s_w[g * nb:(g + 1) * nb], out=o[g])
    torch_call()
    row = {"shape": name, "M": T, "N": N, "K": K, "groups": G, "torch_us": graph_us(torch_call)}
    gflop = 2 * T * N * K * G / 1e9
    row["torch_tflops"] = round(gflop / row["torch_us"] * 1e-3 * 1e3, 1)

    def plan_rows(plan, one_call):
        cands = []
        heur = plan.heuristics(64, ws.numel())
        for i, h in enumerate(heur):
            cands.append(("heuristic", i, h))
        t0 = time.time()
        cfgs = plan.configurations(limit, ws.numel(), seconds)
        for i, h in enumerate(cfgs):
            cands.append(("config", i, h))
        rows = []
        for kind, i, h in cands:
            algo = h.algo
            out.zero_()
            try:
                one_call(plan, algo)
                torch.cuda.synchronize()
                us = eager_us(lambda: one_call(plan, algo))
            except RuntimeError as e:
                rows.append({"kind": kind, "i": i, "error": str(e)[:120], **cublaslt.config_of(algo)})
                continue
            d = (out.float() - ref.float()).abs().max().item()
            rows.append({"kind": kind, "i": i, "eager_us": round(us, 2), "max_diff": d,
                         "same_bits": bool(torch.equal(out, ref)), "workspace": int(h.workspace),
                         "waves": round(float(h.waves), 3), **cublaslt.config_of(algo)})
        ok = [r for r in rows if "eager_us" in r and r["max_diff"] < 1e-2 * max(1.0, ref.float().abs().max().item())]
        ok.sort(key=lambda r: r["eager_us"])
        best = []
        seen = set()
        for r in ok[:6] + [r for r in rows if r["kind"] == "heuristic" and r["i"] == 0 and "eager_us" in r]:
            key = (r["kind"], r["i"])
            if key in seen:
                continue
            seen.add(key)
            algo = (heur[r["i"]] if r["kind"] == "heuristic" else cfgs[r["i"]]).algo
            r["graph_us"] = round(graph_us(lambda: one_call(plan, algo)), 2)
            best.append(r)
        return {"candidates": len(cands), "heuristics": len(heur), "configs": len(cfgs),
                "enum_s": round(time.time() - t0, 1), "best": best, "all": rows}

    def per_group(plan, algo):
        for g in range(G):
            plan.run(algo, x_q[:, g * K:], s[g * kb:], w_q[g * N:], s_w[g * nb:], out[g], ws)

    plan = cublaslt.Plan(T, N, K, lda=G * K, ldd=N).scales(s, s_w)
    row["single"] = plan_rows(plan, per_group)
    if G > 1:
        bplan = cublaslt.Plan(T, N, K, lda=G * K, ldd=N, batch=G, strides=(K, N * K, T * N)).scales(s, s_w)

        def batched(plan, algo):
            plan.run(algo, x_q, s, w_q, s_w, out, ws)
        try:
            row["batched"] = plan_rows(bplan, batched)
        except RuntimeError as e:
            row["batched"] = {"error": str(e)}
    return row


def diagnose(ws: torch.Tensor) -> None:
    """How many algorithms cuBLASLt lists for wq_b's shape under each pair of scale modes (the binding's check)."""
    x_q, s = fp8.act_quant(torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16))
    w_q, s_w = fp8.weight_quant(torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16))
    for modes in ((5, 4), (4, 5), (4, 4), (0, 0)):
        for with_ptr in (False, True):
            try:
                p = cublaslt.Plan(256, 1024, 1024, scale_modes=modes)
                if with_ptr:
                    p.scales(s, s_w)
                n = len(p.heuristics(8, ws.numel()))
            except RuntimeError as e:
                n = str(e)
            print(f"diagnose: scale modes (A, B) {modes}, pointers {with_ptr}: {n}", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="v4-flash", choices=sorted(SHAPES))
    ap.add_argument("--only", default="", help="comma-separated projections (default: all of the shape's)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--limit", type=int, default=2000, help="configurations timed a product, at most")
    ap.add_argument("--enum-seconds", type=float, default=15.0, help="the configuration search's time a product")
    ap.add_argument("--no-diagnose", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if not cublaslt.available():
        raise SystemExit("probe_cublaslt: needs a CUDA GPU and cuBLASLt")
    ws = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    if not a.no_diagnose:
        diagnose(ws)
    rows = []
    for name, (N, K, G) in SHAPES[a.shape].items():
        if a.only and name not in a.only.split(","):
            continue
        r = probe(name, N, K, G, a.tokens, a.limit, ws, a.enum_seconds)
        rows.append(r)
        for part in ("single", "batched"):
            p = r.get(part)
            if not p or "best" not in p:
                continue
            for b in p["best"]:
                print(f"{name:9s} {part:7s} torch {r['torch_us']:8.2f} us | {b['kind']:9s} #{b['i']:<4d} "
                      f"graph {b.get('graph_us', 0):8.2f} eager {b['eager_us']:8.2f} bits={b['same_bits']} "
                      f"tile={b.get('tile')} stages={b.get('stages')} cluster={b.get('cluster')} id={b.get('id')} "
                      f"swz={b.get('swizzle')} custom={b.get('custom')} ws={b['workspace']}", flush=True)
            print(f"{name:9s} {part:7s} {p['heuristics']} heuristic, {p['configs']} configurations "
                  f"({p['enum_s']} s)", flush=True)
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(), "tokens": a.tokens, "shape": a.shape}
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

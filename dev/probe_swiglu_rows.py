"""The shared expert's SwiGLU + requant kernel (``fp8_expert_kernels.swiglu_quant_rows``) at 128-channel blocks per
step NB = 1, 2, 4, against the torch ops it replaced (fp32 gu, clamps on strided halves, silu, product, act_quant).

    python dev/probe_swiglu_rows.py [--rows 128,2048,8192] [--inter 2048,3072] [--iters 50]

Each variant is captured in a CUDA graph and timed alone (median, L2 flushed). One GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe_wave.fp8_expert_kernels import (ALIGN, FP8, _swiglu_quant_kernel, swiglu_quant_rows,  # noqa: E402
                                         swiglu_quant_rows_torch)
from moe_wave.timing import as_graph, iteration_us, l2_flush_buffer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="128,2048,8192")
    ap.add_argument("--inter", default="2048,3072", help="the shared expert's intermediate sizes (V4-Flash, V4-Pro)")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_swiglu_rows: needs a GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    flush = l2_flush_buffer(dev)
    print(f"{'M':>6} {'I':>6} {'torch ops':>10} {'lib':>8} {'NB=1':>8} {'NB=2':>8} {'NB=4':>8}  (us)")
    for I in (int(v) for v in args.inter.split(",")):
        for M in (int(v) for v in args.rows.split(",")):
            gu = (torch.randn(M, 2 * I, device=dev) * 4).to(torch.bfloat16)
            hq = torch.empty(M, I, dtype=FP8, device=dev)
            hs = torch.empty(I // 128, M, dtype=torch.float32, device=dev)

            def nb_fn(nb):
                return lambda i: _swiglu_quant_kernel[(-(-M // ALIGN), I // (nb * 128))](
                    gu, hs, M, hq, hs, I, M, 10.0, BR=16, NB=nb, BEND=False, CLAMP=True, INTERP=False, num_warps=4)

            fns = {"torch ops": lambda i: swiglu_quant_rows_torch(gu, 10.0),
                   "lib": lambda i: swiglu_quant_rows(gu, 10.0)}
            fns.update({f"NB={nb}": nb_fn(nb) for nb in (1, 2, 4) if (I // 128) % nb == 0})
            got = {}
            for name, fn in fns.items():
                replay = as_graph(fn, dev)[0]
                got[name] = statistics.median(iteration_us(replay, args.iters, 3, device=dev, flush=flush))
            print(f"{M:6d} {I:6d} " + " ".join(f"{got.get(k, float('nan')):{10 if k == 'torch ops' else 8}.1f}"
                                              for k in ("torch ops", "lib", "NB=1", "NB=2", "NB=4")))
    return 0


if __name__ == "__main__":
    sys.exit(main())

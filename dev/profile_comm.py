"""Where an eager exchange's host time goes: the symm backend's prepare, dispatch and combine under
torch.profiler (CPU and CUDA), V4-Flash layout, on every rank of a torchrun job.

    torchrun --standalone --nproc-per-node 2 dev/profile_comm.py [--tokens 128] [--backend symm] [--rows 25]

Rank 0 prints, per phase, the host wall time per call (no device sync inside the loop: what an eager
caller pays to enqueue) and the operators sorted by their own CPU time. The tables and a Chrome trace
of rank 0 go to $OUT when OUT is set.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from bench_common import init_ep, out_dir  # noqa: E402
from comm_bench.common import LAYOUTS, backend, token_case  # noqa: E402

from moe_wave.comm.backend import CombineOut  # noqa: E402
from moe_wave.comm.options import SymmOptions  # noqa: E402
from moe_wave.timing import align  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rank (default 128: decode)")
    ap.add_argument("--backend", default="symm", help="torch or symm")
    ap.add_argument("--calls", type=int, default=50, help="calls per phase")
    ap.add_argument("--rows", type=int, default=25, help="operators per table")
    args = ap.parse_args()
    ep = init_ep()
    D, E, K = LAYOUTS["v4-flash"]
    g = torch.Generator(device=ep.device).manual_seed(ep.rank)
    x, layout, _, cfg = token_case(ep, g, D, E, K, args.tokens)
    be = backend(ep, args.backend, cfg, SymmOptions(capacity=args.tokens))
    out = torch.zeros(args.tokens, D, device=ep.device)
    plan = be.prepare(layout)
    got = be.dispatch(x, plan, 0).wait()
    y = torch.randn_like(got.x_RD)
    fresh = CombineOut(out, accumulate=False)
    phases = {"prepare": lambda: be.prepare(layout),
              "dispatch": lambda: be.dispatch(x, plan, 0).wait(),
              "combine": lambda: be.combine(y, got.handle, fresh).wait()}
    text, out_to = [], out_dir()
    for name, fn in phases.items():
        for _ in range(5):
            fn()
        align(ep)
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        host_us = (time.perf_counter() - t0) / args.calls * 1e6
        align(ep)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                fn()
            torch.cuda.synchronize()   # HOST SYNC: the profile ends with the device work it launched
        dist.barrier()
        if ep.rank == 0:
            text.append(f"== {args.backend} {name}, {args.tokens} tokens/rank: host {host_us:.1f} us per call "
                        f"(enqueue only)\n"
                        + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                                    max_name_column_width=60))
            if out_to:
                prof.export_chrome_trace(os.path.join(out_to, f"profile_comm_{name}.json"))
    if ep.rank == 0:
        print("\n".join(text), flush=True)
        if out_to:
            with open(os.path.join(out_to, "profile_comm.txt"), "w") as f:
                f.write("\n".join(text))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""What stays exposed when a symm exchange runs beside the GEMM: a GPU timeline of one CUDA-graph round
trip (V4-Flash layout by default) beside the ~300 us GEMM, and the pieces beside the GEMM one at a time.

    torchrun --standalone --nproc-per-node 2 dev/profile_beside.py [--tokens 4096] \\
        [--variants copy+dense+memops,copy+dense] [--layout v4-flash]

For each symm variant (``SymmOptions.variant`` names, as in comm_bench.graph.GRAPH_VARIANTS) rank 0 prints:
  * alone / beside the GEMM / hidden for the dispatch, the combine, the round trip, its exchanges alone
    (``transfer``: the combine's sum left to the consumer, ``combine_deferred``) and that sum alone,
    each replayed from its own CUDA graph (hidden = 1 - exposed / alone, exposed the median of
    beside minus GEMM-alone samples taken in turns, as in bench_comm);
  * the GPU activities (kernels, copies) of the last profiled round trip and transfer beside the GEMM,
    both made ready at the same moment behind a sleep kernel, in start order, with their stream, start
    and end relative to the GEMM's start: an SM kernel of the exchange that waits for the GEMM's SMs is
    what keeps the exchange exposed. Stream memory operations are not GPU activities to the profiler:
    the gaps between copies show them.
The Chrome traces (one per variant and piece, rank 0) go to $OUT when OUT is set, else to a fresh temporary
folder that is named in the output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from bench_common import init_ep, out_dir  # noqa: E402
from comm_bench.common import LAYOUTS, Run, Settings, backend, beside, token_case  # noqa: E402
from comm_bench.graph import graph_replays  # noqa: E402

from moe_wave.comm.options import SymmOptions  # noqa: E402
from moe_wave.timing import align  # noqa: E402

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
PIECES = ("dispatch", "combine", "round_trip", "transfer", "sum")


def timeline(trace_path: str, gap_us: float = 500.0) -> list:
    """The GPU activities of the last burst in a Chrome trace (bursts are split by idle gaps), as
    (start, end, stream, category, name) in us relative to the burst's longest kernel (the GEMM)."""
    with open(trace_path) as f:
        ev = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    ev.sort(key=lambda e: e["ts"])
    if not ev:
        return []
    burst, end = [ev[-1]], ev[-1]["ts"]
    for e in reversed(ev[:-1]):
        if e["ts"] + e["dur"] < burst[-1]["ts"] - gap_us and e["ts"] + e["dur"] < end - gap_us:
            break
        burst.append(e)
    burst.reverse()
    t0 = max((e for e in burst if "sleep" not in e["name"]), key=lambda e: e["dur"])["ts"]
    return [(e["ts"] - t0, e["ts"] + e["dur"] - t0, e.get("args", {}).get("stream", "?"), e["cat"], e["name"])
            for e in burst]


def hidden_lines(run: Run, fns: dict) -> list[str]:
    """Alone, beside the GEMM and hidden, for each piece replayed from its graph."""
    text = []
    for piece in PIECES:
        f = fns[piece]
        alone = run.timed(lambda: f(0))
        g, both, exposed = run.pair(run.gemm, beside(lambda: f(0), run.gemm))
        text.append(f"  {piece:<10} alone {alone:7.1f} us  beside {both:7.1f} us (GEMM alone in turns {g:.1f}, "
                    f"paired exposed {exposed:6.1f})  hidden {1 - exposed / alone:5.2f}")
    return text


def profiled(run: Run, fn):
    """Three bursts of ``fn`` beside the GEMM under torch.profiler; returns the profile."""
    rt = beside(fn, run.gemm)
    for _ in range(3):
        rt()
    align(run.ep)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            # a 0.5 ms sleep kernel first, so that the GEMM and the exchange become ready at the same
            # moment, as back to back in the timed loop (not the exchange first while the host launches)
            torch.cuda._sleep(1_000_000)
            rt()
            align(run.ep)
            time.sleep(0.005)        # an idle gap between bursts
    return prof


def timeline_lines(run: Run, fns: dict, name: str, trace_dir: str) -> list[str]:
    """The GPU timeline of the last round trip and transfer beside the GEMM (rank 0 writes the traces)."""
    text = []
    for piece in ("round_trip", "transfer"):
        prof = profiled(run, lambda f=fns[piece]: f(0))
        if run.ep.rank != 0:
            continue
        path = os.path.join(trace_dir, f"beside_{name.replace('+', '_')}_{piece}.json")
        prof.export_chrome_trace(path)
        text.append(f"  timeline of the last {piece} beside the GEMM (us from the GEMM's start; {path}):")
        text += [f"    {a:8.1f} {b:8.1f}  stream {s:<4} {cat:<10} {n[:90]}"
                 for a, b, s, cat, n in timeline(path) if "sleep" not in n]
    return text


def variant_lines(run: Run, name: str, case, tokens: int, layout_name: str, trace_dir: str) -> list[str]:
    x, layout, _, cfg = case
    be = backend(run.ep, "symm", cfg, SymmOptions.variant(name, capacity=tokens))
    fns = graph_replays(be, x, layout)
    o = be.options
    text = [f"== symm-{name}, {layout_name}, {tokens} tokens/rank (mode {be.mode}, dense {o.dense}, "
            f"signal {o.signal})"]
    text += hidden_lines(run, fns)
    text += timeline_lines(run, fns, name, trace_dir)
    be.check()
    del be, fns
    align(run.ep)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank (default 4096)")
    ap.add_argument("--layout", default="v4-flash", choices=list(LAYOUTS))
    ap.add_argument("--variants", default="copy+dense+memops,copy+dense", help="comma list of symm variants")
    ap.add_argument("--iters", type=int, default=10, help="timed iterations per point")
    ap.add_argument("--carveout", type=int, default=0, help="SMs carved out of the GEMM (0: the whole GEMM)")
    args = ap.parse_args()
    ep = init_ep()
    D, E, K = LAYOUTS[args.layout]
    g = torch.Generator(device=ep.device).manual_seed(300 + ep.rank)
    case = token_case(ep, g, D, E, K, args.tokens)
    run = Run(ep, Settings(iters=args.iters, carveout=args.carveout), meta={})
    trace_dir = out_dir() or (tempfile.mkdtemp(prefix="profile_beside_") if ep.rank == 0 else "")
    if args.carveout:
        torch._C._set_sm_carveout_experimental(args.carveout)
    text = [f"GEMM 4096x7168x4096 alone {run.gemm_us:.1f} us (whole); carve-out {args.carveout} SMs for the rows below"]
    try:
        for name in args.variants.split(","):
            text += variant_lines(run, name, case, args.tokens, args.layout, trace_dir)
    finally:
        if args.carveout:
            torch._C._set_sm_carveout_experimental(None)
    if ep.rank == 0:
        print("\n".join(text), flush=True)
        if out_dir():
            with open(os.path.join(out_dir(), "profile_beside.txt"), "w") as f:
                f.write("\n".join(text) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""get_dispatch_layout of moe-wave's deep_ep on one GPU: the whole call as DeepEP's test_intranode times it, the
kernel alone, and where the host time goes.

    python benchmarks/bench_layout.py [--tokens 4096 --topk 8 --experts 256 --ranks 2]

The layout needs no peer: a one-rank NCCL group runs the same kernel as a rank of a larger group would, and
``--ranks`` sets the rank count the wrapper ``normal_kernels.dispatch_layout`` computes it for
(``is_token_in_rank`` [T, ranks]). Prints whole-call us (CUDA events
around each call, 50 after 50 warm-up, as DeepEP's ``bench``) of the deep_ep call (one rank) and of the kernel's
wrapper for ``--ranks``, the wrapper's kernels' GPU us (torch.profiler), and a cProfile of 200 deep_ep calls.
Writes $OUT/bench_layout.txt when OUT is set.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import git_sha, now, out_path  # noqa: E402


def bench(fn, warm: int = 50, iters: int = 50) -> float:
    """Mean us of ``fn`` with CUDA events around each call (DeepEP's tests' ``bench``: host time included)."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return sum(a.elapsed_time(b) for a, b in ev[1:]) / (iters - 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("nccl", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    from moe_wave.deepep_compat import Buffer
    from moe_wave.deepep_compat import normal_kernels as nk

    T, K, E, P = args.tokens, args.topk, args.experts, args.ranks
    scores = torch.randn(T, E, device="cuda").abs() + 1
    ids = scores.topk(K, dim=-1, sorted=False).indices
    buf = Buffer(dist.group.WORLD, int(1e8), 0, explicitly_destroy=True)

    def front():                       # the deep_ep call (this group: one rank)
        return buf.get_dispatch_layout(ids, E)

    def call():                        # the kernel's wrapper for P ranks
        return nk.dispatch_layout(ids, E, P)

    whole_front, whole = bench(front), bench(call)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            call()
        torch.cuda.synchronize()
    kern = {e.key: e.self_device_time_total / 20 for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA}
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(200):
        front()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12)
    lines = [f"# get_dispatch_layout on one {torch.cuda.get_device_name()}, {now()}, git {git_sha()}",
             f"tokens {T}, top-{K}, {E} experts",
             f"whole call (events around each, DeepEP's bench): Buffer.get_dispatch_layout (1 rank) "
             f"{whole_front:.1f} us; normal_kernels.dispatch_layout for {P} ranks {whole:.1f} us",
             "GPU per call: " + ", ".join(f"{k[:40]} {v:.1f} us" for k, v in kern.items()),
             "host profile of 200 calls:", s.getvalue()[-2500:]]
    text = "\n".join(lines)
    print(text)
    if out_path("bench_layout.txt"):
        Path(out_path("bench_layout.txt")).write_text(text + "\n")
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

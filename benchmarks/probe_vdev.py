"""torch's own symmetric-memory all-to-all as a baseline: does ``torch.ops.symm_mem.all_to_all_vdev_2d`` run here,
and how long does it take on DeepEP's normal-mode test shape?

    torchrun --standalone --nproc-per-node=2 benchmarks/probe_vdev.py [--tokens 4096 --hidden 7168 --topk 8 --experts 256]

It needs torch's NVSHMEM backend for symmetric memory (``symm_mem.set_backend("NVSHMEM")``). Each rank sends, per
(destination rank, expert), the rows of its tokens routed there (one row per (token, expert), as the op's 2-D
splits are per expert); bf16 rows. Where the op does not run, the line says why. Prints one line per rank 0 and
writes it to $OUT/probe_vdev.txt when OUT is set.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import git_sha, init_ep, report  # noqa: E402


_NVSHMEM = False     # the backend is set once per process


def probe(ep, args) -> tuple[float | None, str]:
    """(microseconds per call on the slowest rank, or None where the op does not run; a line saying which)."""
    import torch.distributed._symmetric_memory as symm_mem

    P, me = ep.size, ep.rank
    E, K, T, H = args.experts, args.topk, args.tokens, args.hidden
    e = E // P
    global _NVSHMEM
    if not _NVSHMEM:
        try:
            symm_mem.set_backend("NVSHMEM")
        except Exception as err:        # noqa: BLE001 - any failure is the finding
            return None, f"symm_mem.set_backend('NVSHMEM') failed: {type(err).__name__}: {err}"
        _NVSHMEM = True
    op = getattr(torch.ops.symm_mem, "all_to_all_vdev_2d", None)
    if op is None:
        return None, f"torch {torch.__version__} has no torch.ops.symm_mem.all_to_all_vdev_2d"
    g = torch.Generator().manual_seed(me)
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    # rows grouped by (destination rank, local expert): the op's input order
    counts = torch.bincount(ids.reshape(-1), minlength=E)                  # [E] = [P, e] rank-major
    rows = int(counts.sum())
    cap = int(1.5 * T * K)                                                 # output rows, a bound with slack
    try:
        group = ep.pg.group_name
        inp = symm_mem.empty(rows, H, dtype=torch.bfloat16, device=ep.device).normal_()
        out = symm_mem.empty(cap, H, dtype=torch.bfloat16, device=ep.device)
        in_splits = symm_mem.empty(E, dtype=torch.int64, device=ep.device)
        out_so = symm_mem.empty(2, E, dtype=torch.int64, device=ep.device)
        in_splits.copy_(counts)
        symm_mem.rendezvous(inp, group)
        symm_mem.rendezvous(out, group)
        symm_mem.rendezvous(in_splits, group)
        symm_mem.rendezvous(out_so, group)
        dist.barrier()

        def call():
            op(inp, out, in_splits, out_so, group, 1)

        for _ in range(3):
            call()
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            call()
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3 / args.iters
        got = int(out_so[0].sum())
    except Exception as err:        # noqa: BLE001 - any failure is the finding
        tb = traceback.format_exc().strip().splitlines()
        return None, (f"all_to_all_vdev_2d failed: {type(err).__name__}: {str(err).splitlines()[0][:300]} "
                      f"({tb[-3][:200]})")
    t = torch.tensor([us], device=ep.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item(), (f"all_to_all_vdev_2d ran: {t.item():.1f} us per call (slowest rank), {rows} rows sent by rank "
                      f"{me}, {got} received, bf16 hidden {H}, one row per (token, expert) ({P} ranks, {e} experts "
                      f"each)")


def probe_or_fewer(ep, args) -> tuple[float | None, str]:
    """``probe``; where the op refuses that many experts per rank, again with 8 per rank (saying so)."""
    us, line = probe(ep, args)
    if us is None and "NUM_TILES" in line and args.experts > 8 * ep.size:
        fewer = argparse.Namespace(**{**vars(args), "experts": 8 * ep.size})
        us2, line2 = probe(ep, fewer)
        return us2, f"{line}; with {fewer.experts} experts (8 per rank): {line2}"
    return us, line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    ep = init_ep()
    _, line = probe_or_fewer(ep, args)
    if ep.rank == 0:
        report(f"git {git_sha()}; torch {torch.__version__}; NVSHMEM_DISABLE_NVLS="
               f"{os.environ.get('NVSHMEM_DISABLE_NVLS')}\n{line}", "probe_vdev.txt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

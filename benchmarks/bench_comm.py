"""Communication benchmark: torch (NCCL), symm and deepep (when installed), alone and beside a GEMM.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_comm.py [--quick] [--sections graph] [--out comm.json]

Measures, in one run (ratios only mean something inside one run), by section (``benchmarks/comm_bench/``):
  * bytes: the P2P copy limit (a large copy into the next rank's GPU, per direction), and an all-to-all of
    B = 1 MB .. 1 GB per rank: NCCL ``all_to_all_single`` against a copy-engine all-to-all through symmetric
    memory, closed by a barrier kernel ("symm"), by completion flags ("symm-flags") or, with --memops, by
    stream memory operations ("symm-memops");
  * tokens: the V4-Flash (D 4096, top-6 of 256) and V4-Pro (D 7168, top-6 of 384) dispatch and combine
    layouts at T = 128..8192, bf16, uniform random routing, one wave, for every backend (DeepEP skips the
    layouts with more than 128 experts per rank, and the row says so);
  * graph: the symm backend's variants with prepare, dispatch, combine and the round trip each replayed from
    a CUDA graph (backend "symm-<variant>[g]");
  * tune (--tune): the row-copy kernels' launch shape (``SymmOptions.copy``);
  * moe: WaveMoE (V4-Flash shape) serial vs pipelined on each backend;
  * vdev (not by default): torch's own symmetric-memory all-to-all (``all_to_all_vdev_2d``, NVSHMEM) on DeepEP's
    normal test shape, or the reason it does not run (``benchmarks/probe_vdev.py``).
Every exchange is also timed beside a ~300 us bf16 GEMM on the compute stream (hidden fraction = 1 -
(beside - gemm) / alone, beside and GEMM-alone samples taken in turns and paired). CUDA events around
--reps back-to-back calls, warm-up, medians over --iters samples, random data, ranks aligned by a barrier
before each sample, the slowest rank. Writes ``{"meta": {...}, "rows": [...]}`` to --out (default
$OUT/comm.json when OUT is set) as the rows come, and prints a table last.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib.util
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import git_sha, init_ep, now, out_path  # noqa: E402
from comm_bench.bytes import bytes_rows, p2p_limit  # noqa: E402
from comm_bench.common import DEFAULT_SECTIONS, MB, SECTIONS, Run, Settings  # noqa: E402
from comm_bench.graph import graph_rows  # noqa: E402
from comm_bench.moe import moe_rows  # noqa: E402
from comm_bench.table import table  # noqa: E402
from comm_bench.tokens import token_rows  # noqa: E402
from comm_bench.tune import tune_rows  # noqa: E402
from comm_bench.vdev import vdev_rows  # noqa: E402

ROWS = {"bytes": bytes_rows, "tokens": token_rows, "graph": graph_rows, "tune": tune_rows, "moe": moe_rows,
        "vdev": vdev_rows}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="few sizes and iterations (about a minute)")
    ap.add_argument("--out", default=out_path("comm.json"), help="JSON path (default $OUT/comm.json when OUT is set)")
    ap.add_argument("--backends", default="torch,symm,deepep", help="comma list; deepep is skipped when absent")
    ap.add_argument("--no-graph", action="store_true", help="skip the rows replayed from CUDA graphs")
    ap.add_argument("--tune", action="store_true", help="also the tune section (the row copies' launch shape)")
    ap.add_argument("--iters", type=int, default=0, help="timed samples per point (default 20, quick 8)")
    ap.add_argument("--reps", type=int, default=int(os.environ.get("BENCH_REPS", "10")),
                    help="back-to-back calls per sample (default $BENCH_REPS or 10)")
    ap.add_argument("--carveout", type=int, default=int(os.environ.get("BENCH_GEMM_CARVEOUT", "16")),
                    help="SMs the GEMM leaves free in the carve-out rows, 0: none (default $BENCH_GEMM_CARVEOUT or 16)")
    ap.add_argument("--hang-s", type=int, default=int(os.environ.get("BENCH_HANG_S", "600")),
                    help="dump every thread's stack and exit after this many seconds (default $BENCH_HANG_S or 600)")
    ap.add_argument("--memops", action="store_true",
                    help="also the bytes all-to-all closed by stream memory operations (comm.symm_memops)")
    ap.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                    help=f"comma list of {','.join(SECTIONS)} (--tune adds tune); --memops --sections bytes keeps "
                         "the memops rows and the graph baselines only")
    return ap


def settings(args, ap: argparse.ArgumentParser) -> Settings:
    """The run's settings from the flags (an unknown section is a usage error)."""
    wanted = [x for x in args.sections.split(",") if x] + (["tune"] if args.tune else [])
    bad = [x for x in wanted if x not in SECTIONS]
    if bad:
        ap.error(f"--sections {args.sections}: unknown {bad}; choose from {','.join(SECTIONS)}")
    sections = tuple(x for x in SECTIONS if x in wanted)
    backends = tuple(b for b in args.backends.split(",") if b != "deepep" or importlib.util.find_spec("deep_ep"))
    if args.no_graph:
        sections = tuple(x for x in sections if x != "graph")
    if "symm" not in backends:
        sections = tuple(x for x in sections if x not in ("graph", "tune"))
    return Settings(quick=args.quick, iters=args.iters or (8 if args.quick else 20), reps=args.reps,
                    carveout=args.carveout, graphs=not args.no_graph, memops=args.memops, sections=sections,
                    backends=backends, out=args.out)


def meta(ep) -> dict:
    return dict(date=now(), command=" ".join([os.path.basename(sys.executable)] + sys.argv), git_sha=git_sha(),
                gpus=f"{ep.size} x {torch.cuda.get_device_name(ep.device)}", torch=torch.__version__,
                nccl=".".join(map(str, torch.cuda.nccl.version())), world_size=ep.size)


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    s = settings(args, ap)
    faulthandler.dump_traceback_later(args.hang_s, exit=True)
    ep = init_ep()
    run = Run(ep, s, meta(ep))
    run.p2p = p2p_limit(run, (256 if s.quick else 1024) * MB)
    run.log(f"P2P {run.p2p:.0f} GB/s, GEMM {run.gemm_us:.0f} us")
    for name in s.sections:
        run.add(ROWS[name](run))
    gemm_end = run.timed(run.gemm)      # the baseline every hidden fraction uses, once more: did it drift?
    if ep.rank == 0:
        print(f"P2P copy limit {run.p2p:.0f} GB/s per direction; GEMM 4096x7168x4096 {run.gemm_us:.0f} us "
              f"({gemm_end:.0f} us at the end of the run)")
        print(table(run.rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

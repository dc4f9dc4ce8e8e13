"""Benchmark of the wave-pipelined MoE block: serial vs pipelined vs comm-only vs compute-only.

    torchrun --nproc-per-node=2 benchmarks/bench_moe.py [--quick] [--out PATH] [--trace DIR]
    python benchmarks/bench_moe.py --quick                  # no launcher: spawns one rank per GPU (2 gloo on CPU)

Shapes (bf16 on GPU, random weights drawn on the device): V4-Flash (D 4096, I 2048, E 256, K 6), V4-Pro
(D 7168, I 3072, E 384, K 6) and ``balanced`` (comm ~ compute); tokens per rank 128, 512, 2048, 8192;
waves 1, 2, 4, 8 (experts partition unless --partition, torch backend); shared expert in the bubbles or after the
experts (serial). Every point is measured by ``moe_wave.tools.bench.measure`` (see its docstring for the definitions):
medians of CUDA-event timings after warm-up, fresh random inputs, L2 flushed, barrier per iteration, max
over ranks; pipelined is first checked against serial. ``p2p_limit_GBps`` (meta) is a 256 MB copy
GPU0 -> GPU1 measured in the same run. Writes ``{"meta", "rows"}`` to --out (default $OUT/moe.json, else
results/<date>-moe-<P>gpu.json; never the committed benchmarks/) and a markdown summary beside it, then prints a short table.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import git_sha, out_dir  # noqa: E402

from moe_wave import MoEConfig, WaveConfig, WaveMoE  # noqa: E402
from moe_wave.comm import detect_launcher, init_from_env, spawn  # noqa: E402
from moe_wave.comm.deepep import MAX_LOCAL_EXPERTS  # noqa: E402
from moe_wave.comm.layout import WavePlan, compute_layout, split_partition  # noqa: E402
from moe_wave.env import read_env  # noqa: E402
from moe_wave.timing import slowest  # noqa: E402
from moe_wave.tools.bench import BenchConfig, init_random_, measure, random_inputs  # noqa: E402
from moe_wave.tools.demo import format_table  # noqa: E402
from moe_wave.tools.flags import add_symm_args, symm_options  # noqa: E402
from moe_wave.tools.sweep_report import run_meta  # noqa: E402
from moe_wave.tools.trace import Tracer  # noqa: E402

FULL = dict(shapes=("v4-flash", "v4-pro", "balanced"), tokens=(128, 512, 2048, 8192), waves=(1, 2, 4, 8),
            placements=("bubbles", "serial"))
QUICK = dict(shapes=("v4-flash", "v4-pro", "balanced"), tokens=(128, 2048, 8192), waves=(1, 2, 4, 8),
             placements=("bubbles",))


def p2p_limit_GBps(ep) -> float:
    """A 256 MB device-to-device copy GPU0 -> GPU1 on rank 0 while the others wait (0 when not possible)."""
    val = 0.0
    if ep.rank == 0 and ep.device.type == "cuda" and torch.cuda.device_count() >= 2:
        try:
            src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda:0").fill_(1)
            dst = torch.empty(256 << 20, dtype=torch.uint8, device="cuda:1")
            dst.copy_(src)
            torch.cuda.synchronize(0)    # HOST SYNC: both devices idle before the clock starts
            torch.cuda.synchronize(1)
            t0 = time.perf_counter()
            for _ in range(5):
                dst.copy_(src)
            torch.cuda.synchronize(0)    # HOST SYNC: the copies are done when the clock stops
            torch.cuda.synchronize(1)
            val = 5 * src.numel() / (time.perf_counter() - t0) / 1e9
            del src, dst
        except RuntimeError:  # no peer access in this process
            val = 0.0
    return round(slowest(ep, [val])[0], 1)


def rank_main(ep, args) -> dict:
    grid = dict(QUICK if args.quick else FULL)
    if args.tokens:
        grid["tokens"] = tuple(int(t) for t in args.tokens.split(","))
    if args.waves:
        grid["waves"] = tuple(int(w) for w in args.waves.split(","))
    dtype = torch.bfloat16 if ep.device.type == "cuda" else torch.float32
    shapes = args.shapes.split(",") if args.shapes else grid["shapes"]
    bench = BenchConfig(warmup=args.warmup, iters=args.iters, pool=args.pool, graph=args.graph)
    backends = args.backend.split(",")
    streams = [int(n) for n in args.expert_streams.split(",")]
    partitions = args.partition.split(",")
    p2p = p2p_limit_GBps(ep)
    symm = symm_options(args, read_env(), backends)    # flag > MOE_WAVE_SYMM_* > default
    rows, t_start = [], time.perf_counter()
    with Tracer(args.trace, ep.rank) as tracer:
        for shape in shapes:
            cfg = MoEConfig.preset(shape)
            if cfg.num_experts % ep.size:
                raise ValueError(f"shape {shape}: num_experts={cfg.num_experts} must be divisible by {ep.size} ranks")
            moe = init_random_(WaveMoE(cfg, ep=ep, device=ep.device, dtype=dtype))
            if args.precision == "fp8":
                moe.quantize_fp8()
            for T, placement, W, backend, ns, part in itertools.product(
                    grid["tokens"], grid["placements"], grid["waves"], backends, streams, partitions):
                if backend == "deepep" and cfg.num_experts // ep.size > MAX_LOCAL_EXPERTS:
                    rows.append({"shape": shape, "tokens_per_rank": T, "num_waves": W, "backend": backend,
                                 "skipped": f"DeepEP V1 supports at most {MAX_LOCAL_EXPERTS} experts per rank; "
                                            f"{cfg.num_experts} experts on {ep.size} ranks is "
                                            f"{cfg.num_experts // ep.size}"})
                    continue
                partition, sends = split_partition(part)
                cap = args.symm_capacity or capacity(args, moe, T, W, partition, sends)
                m = moe.rescheduled(WaveConfig(num_waves=W, shared_placement=placement, backend=backend,
                                               symm=symm.replace(capacity=cap), expert_streams=ns,
                                               partition=partition, sends=sends))
                label = (f"{shape} T={T} W={W} shared={placement} {backend}{' graph' if args.graph else ''}"
                         f" streams={ns} partition={part}")
                r = measure(m, T, bench, tracer=tracer, label=label)
                if hasattr(m.backend, "check"):
                    m.backend.check()   # a fixed-capacity backend: raise if any row did not fit
                rows.append({"shape": shape, "tokens_per_rank": T, "num_waves": W, "cuda_graph": args.graph,
                             "effective_waves": m.plan.num_waves, "partition": part, "backend": backend,
                             "shared_placement": placement, "expert_streams": ns,
                             "dtype": str(dtype).removeprefix("torch."), "precision": args.precision, **r,
                             "link_util": round(r["GBps"] / p2p, 3) if p2p else None})
                if ep.rank == 0:
                    print(f"[{time.perf_counter() - t_start:6.1f}s] {label}: serial {r['serial_us']:.0f} "
                          f"pipelined {r['pipelined_us']:.0f} comm {r['comm_only_us']:.0f} compute "
                          f"{r['compute_only_us']:.0f} us, check {r['check']}", flush=True)
            del moe, m
            if ep.device.type == "cuda":
                torch.cuda.empty_cache()
    return {"rows": rows, "p2p": p2p, "world_size": ep.size}


def capacity(args, moe: WaveMoE, tokens: int, waves: int, partition: str = "experts", sends: str = "wave") -> int:
    """Rows per (wave, peer) for fixed-capacity backends (symm). 'worst': every token, never
    overflows. 'measured': the fullest (wave, peer) cell of one routed random batch, max over ranks,
    times --capacity-margin. Static buffers make the expert stage's gather scale with the capacity,
    so a tight one is what a deployment would use; check() after each point verifies it held."""
    if args.capacity == "worst" or tokens == 0:
        return max(tokens, 128)
    x_TD, ids_TK, w_TK = random_inputs(moe, tokens, 1, seed=12345)[0]
    return max(128, min(tokens, fullest_cell_capacity(moe, ids_TK, w_TK, waves, partition, args.capacity_margin,
                                                      sends)))


def fullest_cell_capacity(moe: WaveMoE, ids_TK: torch.Tensor, w_TK: torch.Tensor, waves: int,
                          partition: str = "experts", margin: float = 1.25, sends: str = "wave") -> int:
    """Rows of the fullest (wave, peer) cell of this routing, max over ranks, times ``margin``, plus one."""
    plan = WavePlan.make(num_ranks=moe.ep.size, num_local_experts=moe.num_local, num_waves=waves,
                         partition=partition, sends=sends)
    fullest = slowest(moe.ep, [compute_layout(ids_TK, w_TK, plan).send_counts_WP.max().item()])[0]  # HOST SYNC: setup
    return int(fullest * margin) + 1


def default_out(world_size: int) -> Path:
    if out_dir():
        return Path(out_dir()) / "moe.json"
    kind = f"{world_size}gpu" if torch.cuda.is_available() else f"cpu{world_size}"
    return Path("results") / f"{datetime.date.today().isoformat()}-moe-{kind}.json"   # never the committed benchmarks/


COLS = ["shape", "tokens_per_rank", "num_waves", "partition", "backend", "cuda_graph", "shared_placement", "serial_us",
        "pipelined_us", "comm_only_us", "compute_only_us", "ideal_us", "exposed_us", "overlap_ratio", "speedup", "GBps",
        "check", "skipped"]


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# moe-wave MoE benchmark, {meta['date']}", "",
             f"{meta['gpus']}, torch {meta['torch']}, NCCL {meta['nccl']}, git {meta['git_sha'][:10]}, "
             f"P2P copy limit {meta['p2p_limit_GBps']} GB/s", "", f"`{meta['command']}`", "",
             "Times in microseconds (median, max over ranks). speedup = serial / pipelined; exposed = pipelined - "
             "compute_only; overlap = 1 - exposed / comm_only.", "",
             "| " + " | ".join(COLS) + " |", "|" + "---|" * len(COLS)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in COLS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short run: 2 shapes, 2 token counts, W 1 and 4")
    ap.add_argument("--shapes", default=None, help="comma list of presets (default: the grid's)")
    ap.add_argument("--iters", type=int, default=15, help="timed iterations per kind")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--pool", type=int, default=3, help="distinct random inputs rotated through")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/moe.json, else results/<date>-moe-<kind>.json)")
    ap.add_argument("--trace", default=None, metavar="DIR", help="per-rank chrome traces (one iteration per kind)")
    ap.add_argument("--ranks", type=int, default=None, help="ranks to spawn without a launcher")
    ap.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                    help="fp8: the experts in DeepSeek-V4's FP8 format (WaveMoE.quantize_fp8); rows carry it")
    ap.add_argument("--backend", default="torch", help="comma list of comm backends (torch, symm, deepep)")
    ap.add_argument("--capacity", choices=("worst", "measured"), default="worst",
                    help="rows per (wave, peer) of fixed-capacity backends (symm): every token, or the fullest "
                         "cell of a routed sample times --capacity-margin")
    ap.add_argument("--capacity-margin", type=float, default=1.25)
    ap.add_argument("--expert-streams", default="2", help="comma list of WaveConfig.expert_streams (1-4; the library's "
                    "default is 2)")
    ap.add_argument("--tokens", default=None, help="comma list of tokens per rank (default: the grid's)")
    ap.add_argument("--waves", default=None, help="comma list of wave counts (default: the grid's)")
    ap.add_argument("--partition", default="experts", help="comma list of WaveConfig.partition (experts, tokens), "
                    "or experts-once (the experts partition with WaveConfig.sends='once')")
    ap.add_argument("--graph", action="store_true",
                    help="time CUDA-graph replays of each kind (needs a sync-free backend: --backend symm)")
    add_symm_args(ap)
    args = ap.parse_args()

    launch = detect_launcher()
    if launch.kind == "none":
        res = spawn(rank_main, args.ranks, args=(args,), timeout_s=300, deadline_s=3600)[0]
    else:
        ep = init_from_env(timeout_s=300)
        res = rank_main(ep, args)
        dist.destroy_process_group()
        if ep.rank != 0:
            return 0
    rows = res["rows"]
    meta = {**run_meta(res["world_size"], " ".join(["benchmarks/bench_moe.py"] + sys.argv[1:]), git_sha()),
            "p2p_limit_GBps": res["p2p"]}
    out = Path(args.out) if args.out else default_out(res["world_size"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(markdown(meta, rows))
    print(f"\nwrote {out} and {out.with_suffix('.md')}")
    print(format_table(COLS, [[r.get(c, "") for c in COLS] for r in rows]))
    return 0 if all(r.get("check") == "ok" for r in rows if "skipped" not in r) else 1


if __name__ == "__main__":
    sys.exit(main())

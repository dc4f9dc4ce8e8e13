"""Why the expert stage costs more with more waves: its kernels at W = 1 and at W = 4, side by side (one GPU).

    python dev/profile_experts.py [--preset v4-flash] [--experts 128] [--tokens 128,2048] [--waves 1,4]
                                     [--sends wave,once]
                                     [--capacity measured|max] [--precision bf16|fp8]

One process holds ``--experts`` routed experts (128: one rank's share of V4-Flash at EP2), so the expert stage
sees what a rank of EP2 sees. For each token count and wave count it times the routed experts on pre-received
rows (``probe.routed_only``, the benchmark's compute_only without the shared expert) replayed from a CUDA graph,
then records one eager run under torch.profiler and prints the device time per kernel name at each W, with the
difference: the kernels whose time grows with W are the per-wave cost. Written to $OUT/profile_experts.txt too.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from bench_moe import fullest_cell_capacity  # noqa: E402
from bench_common import report  # noqa: E402
from moe_wave import MoEConfig, WaveConfig, WaveMoE  # noqa: E402
from moe_wave.comm import EPGroup  # noqa: E402
from moe_wave.comm.options import SymmOptions  # noqa: E402
from moe_wave.probe import routed_only  # noqa: E402
from moe_wave.timing import as_graph, iteration_us, l2_flush_buffer  # noqa: E402
from moe_wave.tools.bench import init_random_, pre_receive, random_inputs  # noqa: E402


def kernels(prof) -> dict:
    out = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.key][0] += e.self_device_time_total
            out[e.key][1] += e.count
    return out


@torch.no_grad()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="v4-flash")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--tokens", default="128,2048")
    ap.add_argument("--waves", default="1,4")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rows", type=int, default=14)
    ap.add_argument("--capacity", choices=("measured", "max"), default="measured",
                    help="rows per wave: 1.25 x the fullest wave of this routing (as bench_moe --capacity "
                    "measured), or the largest --tokens for every point (the per-wave launches then sized for it)")
    ap.add_argument("--sends", default="wave", help="comma list of WaveConfig.sends (wave, once): a row per (token, "
                    "wave) or once per layer (its sum kept over the waves); each gets its own tables")
    ap.add_argument("--precision", choices=("bf16", "fp8"), default="bf16", help="the routed experts in bf16 or "
                    "in FP8 (WaveMoE.quantize_fp8: DeepGEMM's grouped GEMMs where deep_gemm imports)")
    ap.add_argument("--expert-streams", type=int, default=1, help="streams the waves' expert stages take turns "
                    "on (WaveConfig.expert_streams: 2 lets one wave's kernels start in the last one's GEMM tail)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("profile_experts: needs a GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    cfg = MoEConfig.preset(args.preset, num_experts=args.experts)
    tokens = [int(t) for t in args.tokens.split(",")]
    waves = [int(w) for w in args.waves.split(",")]
    base = WaveMoE(cfg, ep=EPGroup.single(dev), wave=WaveConfig(backend="symm", symm=SymmOptions(
        capacity=max(tokens))), device=dev, dtype=torch.bfloat16)
    init_random_(base)
    if args.precision == "fp8":
        base.quantize_fp8()
    flush = l2_flush_buffer(dev)
    lines = [f"profile_experts: {args.preset} shapes, {args.experts} local experts, top-{cfg.top_k}, one GPU, "
             f"routed experts ({args.precision}) on pre-received rows, capacity {args.capacity}, expert streams {args.expert_streams}"]
    for sends in args.sends.split(","):
        lines.append(f"\n== sends: {sends}")
        for T in tokens:
            x, ids, w = random_inputs(base, T, 1)[0]
            tables, times = {}, {}
            for W in waves:
                cap = (max(tokens) if args.capacity == "max" else
                       max(128, fullest_cell_capacity(base, ids, w, W, sends=sends)))
                moe = base.rescheduled(WaveConfig(backend="symm", num_waves=W, sends=sends,
                                                  symm=base.wave.symm.replace(capacity=cap)))
                got = pre_receive(moe, x, ids, w)       # the rows as the layer sends them (FP8 rows included)
                extra = moe.streams.extra[:args.expert_streams - 1]
                replay = as_graph(lambda i: routed_only(moe.routed_rows, got, extra), dev)[0]
                times[W] = statistics.median(iteration_us(replay, args.iters, 3, device=dev, flush=flush))
                routed_only(moe.routed_rows, got)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    routed_only(moe.routed_rows, got)
                    torch.cuda.synchronize()
                tables[W] = kernels(prof)
            lines.append(f"\n{T} tokens: graph replay " + ", ".join(f"W={W} {times[W]:.1f} us" for W in waves)
                         + f"  (W={waves[-1]} / W={waves[0]} = {times[waves[-1]] / times[waves[0]]:.3f})")
            a, b = tables[waves[0]], tables[waves[-1]]
            names = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, [0, 0])[0] - a.get(k, [0, 0])[0]))
            lines.append(f"  {'W=' + str(waves[0]) + ' us':>10} {'calls':>6} {'W=' + str(waves[-1]) + ' us':>10} "
                         f"{'calls':>6} {'diff us':>9}  kernel")
            for k in names[:args.rows]:
                ua, ca = a.get(k, [0.0, 0])
                ub, cb = b.get(k, [0.0, 0])
                lines.append(f"  {ua:10.1f} {ca:6d} {ub:10.1f} {cb:6d} {ub - ua:9.1f}  {k[:90]}")
            lines.append(f"  {sum(v[0] for v in a.values()):10.1f} {sum(v[1] for v in a.values()):6d} "
                         f"{sum(v[0] for v in b.values()):10.1f} {sum(v[1] for v in b.values()):6d}  (all kernels)")
    report("\n".join(lines), "profile_experts.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())

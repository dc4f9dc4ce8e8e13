"""The FP8 stage at decode sizes with its weights' L2 prefetch at several budgets (one GPU).

    python dev/prefetch_sweep.py [--shapes v4-flash:32,v4-flash:128,v4-pro:48] [--tokens 128,2048] [--waves 1,4]
                                 [--configs 0,0.4,0.8,0.4L,0.8L] [--rounds 2]

For each shape, token count and wave count it times ``bench_experts``' FP8 stage (rows arrived as FP8, the
layout "auto" takes, CUDA-graph replay with the L2 flushed, median of --iters) under each configuration:
``fp8_expert_kernels.PREFETCH_L2_FRACTION`` set to its number (0: no prefetch), ``PREFETCH_EVICT_LAST`` where it
ends in L, and ``fp8_experts.PREFETCH_ROWS_PER_EXPERT`` lifted so that every point reads ahead; the configurations
in turn --rounds times (each point the smallest of its rounds), beside the same run's DeepGEMM GEMMs alone.
Prints a table and writes $OUT/prefetch_sweep.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_experts as be  # noqa: E402
from moe_wave import fp8_expert_kernels as fk  # noqa: E402
from moe_wave import fp8_experts as fx  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="v4-flash:32,v4-flash:128,v4-pro:48")
    ap.add_argument("--tokens", default="128,2048")
    ap.add_argument("--waves", default="1,4")
    ap.add_argument("--configs", default="0,0.4,0.8,0.4L,0.8L")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    flush = be.l2_flush_buffer(dev)
    fracs = args.configs.split(",")
    fx.PREFETCH_ROWS_PER_EXPERT = 10 ** 9
    out = []
    for spec in args.shapes.split(","):
        shape, e = spec.split(":")
        cfg = be.MoEConfig.preset(shape, num_experts=int(e))
        base = be.WaveMoE(cfg, ep=be.EPGroup.single(dev), wave=be.WaveConfig(backend="symm", symm=be.SymmOptions(
            capacity=8192)), device=dev, dtype=torch.bfloat16)
        be.init_random_(base)
        ex = be.FP8RoutedExperts.from_dense(cfg, base.experts.gate_up, base.experts.down)
        base.experts = None
        torch.cuda.empty_cache()
        for T in [int(t) for t in args.tokens.split(",")]:
            x, ids, w = be.random_inputs(base, T, 1)[0]
            counts = torch.bincount(ids.reshape(-1), minlength=cfg.num_experts)
            dg = be.deepgemm_alone(ex, counts, dev, args.iters, flush)["deepgemm_gemms_us"]
            for W in [int(v) for v in args.waves.split(",")]:
                cap = max(128, be.fullest_cell_capacity(base, ids, w, W))
                moe = base.rescheduled(be.WaveConfig(backend="symm", num_waves=W, symm=base.wave.symm.replace(
                    capacity=cap)))
                packed = be.pre_receive(moe.backend, be.pack_rows(x), ids, w, moe.plan, combine_width=cfg.hidden_size)
                extra = moe.streams.extra[:1]
                best = {}
                for _ in range(args.rounds):
                    for f in fracs:
                        fk.PREFETCH_L2_FRACTION, fk.PREFETCH_EVICT_LAST = float(f.rstrip("L")), f.endswith("L")
                        t = be.median_graph_us(lambda: be.routed_only(
                            lambda g: be.expert_rows(g, ex, packed=True), packed, extra), dev, args.iters, flush)
                        best[f] = min(best.get(f, t), t)
                for f in fracs:
                    row = {"shape": spec, "tokens": T, "waves": W, "config": f, "stage_us": round(best[f], 1),
                           "vs_off": round(best[f] / best[fracs[0]], 3), "deepgemm_gemms_us": round(dg, 1),
                           "vs_deepgemm": round(best[f] / dg, 3)}
                    out.append(row)
                    print(json.dumps(row), flush=True)
                del moe, packed
        del base, ex
        torch.cuda.empty_cache()
    head = ["shape", "T", "W", "config", "stage us", "/ first config", "DG alone", "/ DG"]
    print("\n" + " | ".join(head) + "\n" + " | ".join("---" for _ in head))
    for r in out:
        print(" | ".join(str(r[k]) for k in ("shape", "tokens", "waves", "config", "stage_us", "vs_off",
                                              "deepgemm_gemms_us", "vs_deepgemm")))
    path = os.path.join(os.environ.get("OUT", "."), "prefetch_sweep.json")
    with open(path, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(dev), "l2_bytes": fk.l2_bytes(dev), "rows": out}, f, indent=1)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

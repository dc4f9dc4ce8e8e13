"""The FP8 expert stage under library settings (module constants), side by side in one run (one GPU).

    python dev/stage_settings.py [--shapes v4-flash:32,v4-flash:128,v4-pro:48] [--tokens 128,2048] [--waves 1,4]
        [--rounds 2] CONFIG [CONFIG ...]

A CONFIG is ``name`` or ``name:module.CONST=value[;module.CONST=value...]`` (modules under ``moe_wave``; values
are Python literals), e.g. ``off:fp8_experts.FUSED_GATE_UP_ROWS_PER_EXPERT=0``; the first CONFIG is the baseline.
For each shape, token count and wave count it times ``bench_experts``' FP8 stage (rows arrived as FP8, the layout
"auto" takes, CUDA-graph replay with the L2 flushed, median of --iters) under each CONFIG (the library's values
restored between them), the CONFIGs in turn --rounds times (each point the smallest of its rounds), beside the
same run's DeepGEMM GEMMs alone. Prints a table and writes --out (default $OUT/stage_settings.json).
``bash launch/gpu_all.sh settings`` runs it on the candidates of benchmarks/results/experts.md.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_experts as be  # noqa: E402


def parse(spec: str) -> tuple[str, list]:
    name, _, body = spec.partition(":")
    sets = []
    for a in filter(None, body.split(";")):
        target, _, value = a.partition("=")
        mod, _, const = target.rpartition(".")
        m = importlib.import_module("moe_wave." + mod)
        if not hasattr(m, const):
            raise SystemExit(f"stage_settings: {spec!r}: moe_wave.{mod} has no {const}")
        sets.append((m, const, ast.literal_eval(value)))
    return name, sets


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--shapes", default="v4-flash:32,v4-flash:128,v4-pro:48")
    ap.add_argument("--tokens", default="128,2048")
    ap.add_argument("--waves", default="1,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT/stage_settings.json, else ./)")
    args = ap.parse_args()
    configs = [parse(c) for c in args.configs]
    dev = torch.device("cuda", 0)
    flush = be.l2_flush_buffer(dev)
    out = []
    for spec in args.shapes.split(","):
        shape, e = spec.split(":")
        cfg = be.MoEConfig.preset(shape, num_experts=int(e))
        tokens = [int(t) for t in args.tokens.split(",")]
        base = be.WaveMoE(cfg, ep=be.EPGroup.single(dev), wave=be.WaveConfig(backend="symm", symm=be.SymmOptions(
            capacity=max(tokens))), device=dev, dtype=torch.bfloat16)
        be.init_random_(base)
        ex = be.FP8RoutedExperts.from_dense(cfg, base.experts.gate_up, base.experts.down)
        base.experts = None
        torch.cuda.empty_cache()
        for T in tokens:
            x, ids, w = be.random_inputs(base, T, 1)[0]
            counts = torch.bincount(ids.reshape(-1), minlength=cfg.num_experts)
            dg = be.deepgemm_alone(ex, counts, dev, args.iters, flush)["deepgemm_gemms_us"]
            for W in [int(v) for v in args.waves.split(",")]:
                cap = max(128, be.fullest_cell_capacity(base, ids, w, W))
                moe = base.rescheduled(be.WaveConfig(backend="symm", num_waves=W, symm=base.wave.symm.replace(
                    capacity=cap)))
                packed = be.pre_receive(moe.backend, be.pack_rows(x), ids, w, moe.plan, combine_width=cfg.hidden_size)
                extra = moe.streams.extra[:1]
                best: dict = {}
                for _ in range(args.rounds):
                    for name, sets in configs:
                        kept = [(m, c, getattr(m, c)) for m, c, _ in sets]
                        try:
                            for m, c, v in sets:
                                setattr(m, c, v)
                            t = be.median_graph_us(lambda: be.routed_only(
                                lambda g: be.expert_rows(g, ex, packed=True), packed, extra), dev, args.iters, flush)
                        finally:
                            for m, c, v in kept:
                                setattr(m, c, v)
                        best[name] = min(best.get(name, t), t)
                first = best[configs[0][0]]
                for name, _ in configs:
                    row = {"shape": spec, "tokens": T, "waves": W, "config": name, "stage_us": round(best[name], 1),
                           "vs_first": round(best[name] / first, 3), "deepgemm_gemms_us": round(dg, 1),
                           "vs_deepgemm": round(best[name] / dg, 3)}
                    out.append(row)
                    print(json.dumps(row), flush=True)
                del moe, packed
        del base, ex
        torch.cuda.empty_cache()
    keys = ("shape", "tokens", "waves", "config", "stage_us", "vs_first", "deepgemm_gemms_us", "vs_deepgemm")
    print("\n" + " | ".join(keys) + "\n" + " | ".join("---" for _ in keys))
    for r in out:
        print(" | ".join(str(r[k]) for k in keys))
    path = args.out or os.path.join(os.environ.get("OUT", "."), "stage_settings.json")
    with open(path, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(dev), "configs": args.configs, "rows": out}, f, indent=1)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

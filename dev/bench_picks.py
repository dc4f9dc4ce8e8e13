"""The sparse core on the layer's int32 picks against the same picks as int64, in alternating rounds (A B A B ..),
so that a drift of the GPU's clocks during the run falls on both (one H200, CUDA graphs).

    python dev/bench_picks.py [--shapes v4-flash,v4-pro] [--types sliding,csa,hca] [--rounds 4] [--iters 10]

The front-end makes int32 picks where the kernels run (``kernels.picks``, ``topk_select(dtype=torch.int32)``);
before, they were int64. Per shape and layer type (4096-token prefill, V4's FP8 layer as ``bench_attn --precision
fp8a`` builds it) it prints each round's core time for both and the medians; a JSON of the rounds goes to --out
(default $OUT/picks.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from attn_kit import CTX, core_fn, core_parts, make_attn, meta, time_alone  # noqa: E402
from bench_common import out_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="v4-flash,v4-pro")
    ap.add_argument("--types", default="sliding,csa,hca")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.quick = False
    dev = torch.device("cuda")
    rows = []
    for shape in args.shapes.split(","):
        for kind in args.types.split(","):
            attn = make_attn(shape, kind, dev, "fp8a")
            cache = attn.new_cache(1, CTX + 8)
            pos = torch.arange(CTX, device=dev)[None]
            x = torch.randn(1, CTX, attn.cfg.hidden, device=dev, dtype=torch.bfloat16)
            fe = core_parts(attn, x, pos, cache)
            dtypes = sorted({str(idx.dtype) for _, idx in fe.parts})
            fe64 = replace(fe, parts=[(src, idx.long()) for src, idx in fe.parts])
            fns = {"int32": core_fn(attn, fe, pos), "int64": core_fn(attn, fe64, pos)}
            got = {k: [] for k in fns}
            for _ in range(args.rounds):
                for k, fn in fns.items():
                    got[k].append(round(time_alone(fn, args.iters), 2))
            row = dict(shape=shape, layer_type=kind, layer_picks=dtypes, rounds=got,
                       int32_us=statistics.median(got["int32"]), int64_us=statistics.median(got["int64"]))
            row["int32_over_int64"] = round(row["int32_us"] / row["int64_us"], 4)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del attn, cache, fe, fe64, fns, x
            torch.cuda.empty_cache()
    out = args.out or out_path("picks.json", os.path.join("results", "picks.json"))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"meta": meta(args), "rows": rows}, f, indent=1)
    print(f"\nwrote {out}\n{'shape':9} {'type':8} {'int32 us':>9} {'int64 us':>9} {'ratio':>7}")
    for r in rows:
        print(f"{r['shape']:9} {r['layer_type']:8} {r['int32_us']:>9.1f} {r['int64_us']:>9.1f} "
              f"{r['int32_over_int64']:>7.3f}")


if __name__ == "__main__":
    main()

"""Schedule-equivalence and determinism check of a V4 layer stack on one GPU, module by module.

    python benchmarks/check_stack.py [--preset v4-flash] [--layers 4] [--tokens 2048] [--repeats 3]

Builds the stack once, records every layer's input under the all-serial schedule, then feeds each
layer that same input under every schedule (attention streams on/off x MoE wave pipeline on/off),
``--repeats`` times each, and compares the attention output and the MoE output of each layer with
the first all-serial run. Serial against itself must be bit-identical (determinism), and so must every
overlapped schedule: it runs the same kernels on the same data with the same summation order, only on other
streams. A race shows up as an error that changes between repeats. Prints one row per (layer, module,
schedule) with the largest relative error over the repeats; exits 1 when a row exceeds --tol (default 0:
bit for bit).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402,F401  (the repo on sys.path)

from moe_wave.tools.stack import build_layer_stack, layer_kind, stack_inputs  # noqa: E402

MODES = {"serial": (False, False), "attn": (True, False), "moe": (False, True), "both": (True, True)}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (HOST SYNC: a check, outside any timing)."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="v4-flash")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tol", type=float, default=0.0, help="largest relative error allowed (default 0: bit for bit)")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    layers = build_layer_stack(args.preset, args.layers, device=dev, dtype=dtype, seed=0)
    X, pos, ids = stack_inputs(layers, args.tokens, seed=1)
    seen: dict = {}

    def hook(name):
        def f(mod, inp, out):
            seen[name] = out.detach().clone()
        return f

    for i, layer in enumerate(layers):
        layer.attn.register_forward_hook(hook((i, "attn")))
        layer.moe.register_forward_hook(hook((i, "moe")))
    ins, ref = [], {}
    for i, layer in enumerate(layers):  # the serial stack: each layer's input and reference outputs
        ins.append(X)
        X = layer(X, positions=pos, input_ids=ids, validate=False, overlap=False, moe_overlap=False)
        ref[(i, "attn")], ref[(i, "moe")], ref[(i, "layer")] = seen[(i, "attn")], seen[(i, "moe")], X.clone()
    worst, bad = {}, False
    for r in range(args.repeats):
        for mode, (ao, mo) in MODES.items():
            for i, layer in enumerate(layers):
                out = layer(ins[i], positions=pos, input_ids=ids, validate=False, overlap=ao, moe_overlap=mo)
                for part, got in (("attn", seen[(i, "attn")]), ("moe", seen[(i, "moe")]), ("layer", out)):
                    e = rel(got, ref[(i, part)])
                    key = (i, part, mode)
                    worst.setdefault(key, []).append(e)
    print(f"{'layer':>5} {'kind':>13} {'part':>5}  " + "  ".join(f"{m:>17}" for m in MODES)
          + "   (max rel err over repeats / min)")
    for i in range(len(layers)):
        for part in ("attn", "moe", "layer"):
            cells = []
            for mode in MODES:
                errs = worst[(i, part, mode)]
                bad |= max(errs) > args.tol
                cells.append(f"{max(errs):8.1e}/{min(errs):8.1e}")
            print(f"{i:5d} {layer_kind(layers[i]):>13} {part:>5}  " + "  ".join(cells))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

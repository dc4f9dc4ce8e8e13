"""Where the CUDA C++ sparse core's time goes: its phases in clock cycles, per tile and per item, on bench_core's
V4 prefill picks, plus the core's time with parts of the work left out (probes, wrong results).

    python dev/trace_core_cuda.py [--kinds sliding,csa,hca] [--heads 64] [--tokens 4096] [--variants V|V]
                                     [--fused] [--out PATH]

Phases (the trace of an instrumented build, ``instrumented(trace=...)``): math warpgroup 0's thread 0 and the copy
warpgroup's thread 0
of every CTA add the cycles between stamps; the table shows each phase's cycles per round of two tiles (per item
for q, the output and the copy warpgroup's counts and q slot), averaged over all CTAs. "x reads" is the wait for
the other warpgroup's row maxima, "x free wait" the wait for its P; the output is split into "o sums wait" (the
other warpgroup's row sums), "o scale, rope", "o fp8 staging" and "output" (the stores and the next item's start);
"cp q landed" is the copy warpgroup's wait for q's copies, "cp q prologue" q's RoPE turn and the tail's sums of
squares, "cp picks" the picks' loads of a tile; in round 0 "tile wait" holds the math's sums of q's squares. Each
compile variant (``--variants``: more ``#define``s of the kernel's profiling hooks, e.g. ``NOREUSE 1``, ``NOTMA 1``,
``PROBE 2``) is timed and its output compared with the default kernel's, bit for bit (a switch that reorders work
only gives the same bits; a probe does not).

``instrumented`` is the harness: the library's kernel source and variant (``sparse_core.cuda_build``) built with
the profiling hooks the library never sets (``csrc/sparse_core.cu``: TRACE adds each phase's clock cycles into a
[CTAs, 32] int64 tensor; PROBE 2 / 8 / 16 skip the tiles' copies / q's RoPE turn / the output's stores, wrong
results; NOREUSE 1 copies every row of the window ring; NOTMA 1 stores with the threads where TMA would).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from attn_kit import time_alone  # noqa: E402
from bench_core import make  # noqa: E402
from bench_common import git_sha  # noqa: E402

from moe_wave.attention.sparse_core import cuda_impl  # noqa: E402


def instrumented(q, out, sinks, kv1, i1, kv2, i2, scale, two, *, defines: str = "", trace=None, probe: int = 0,
                 **kw) -> None:
    """``cuda_impl.sparse_attention_cuda`` built with profiling hooks: ``defines`` (';'-separated NAME VALUE pairs),
    ``probe`` (PROBE's bits), ``trace`` (a zeroed int64 [CTAs, 32] tensor, CTAs = ``cuda_impl.ctas_resident``: TRACE
    adds each phase's cycles there, per CTA). Not cached on disk; same arguments as the library's launch."""
    variant, a, n_ctas, tmap, keep = cuda_impl.prepare(q, out, sinks, kv1, i1, kv2, i2, scale, two, **kw)
    extra = "".join(f"#define {d.strip()}\n" for d in defines.split(";") if d.strip())
    if probe:
        extra += f"#define PROBE {probe}\n"
    if trace is not None:
        if not (trace.dtype == torch.int64 and trace.is_contiguous() and trace.numel() >= 32 * n_ctas):
            raise ValueError(f"trace must be a contiguous int64 tensor of >= {32 * n_ctas} elements")
        extra += "#define TRACE 1\n"
        a.trace = trace.data_ptr()
    cuda_impl.launch(cuda_impl.kernel(q.device.index, variant, extra_defines=extra), n_ctas, a, i1, i2, tmap)
    del keep

PHASES = {0: "q wait", 1: "tile wait", 2: "QK", 3: "x reads", 4: "softmax", 5: "PV", 6: "output", 7: "tile top",
          8: "cp counts", 9: "cp q wait", 10: "cp picks", 11: "cp slot wait", 12: "cp issue", 16: "x free wait",
          19: "o sums wait", 20: "o scale, rope", 21: "o fp8 staging", 22: "cp q landed", 23: "cp q prologue"}
PER_ITEM = {0, 6, 8, 9, 19, 20, 21, 22, 23}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default="sliding,csa,hca")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--variants", default="", help="compile variants also timed: '|'-separated, each a "
                    "';'-separated list of defines (instrumented's defines)")
    ap.add_argument("--trace-variants", action="store_true", help="the phases of each variant too (one more compile "
                    "each, with TRACE)")
    ap.add_argument("--fused", action="store_true", help="with the layer's steps, as its prefill runs the core: q "
                    "raw (norm and a 64-channel RoPE tail inside), the output's inverse RoPE and FP8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for kind in args.kinds.split(","):
        q, parts, sinks = make(kind, args.tokens, args.heads, 512, dev)
        (kv1, i1), (kv2, i2) = parts[0], parts[-1]
        out = torch.empty_like(q)
        scale, two = 512 ** -0.5, len(parts) == 2
        row = dict(kind=kind, heads=args.heads, tokens=args.tokens, fused=args.fused)
        kw = {}
        if args.fused:                          # V4's RoPE (64 channels), positions 0..S-1, FP8 out
            S = args.tokens
            pos = torch.arange(S, device=dev)
            freq = 10000.0 ** (-torch.arange(32, device=dev, dtype=torch.float32) / 32)
            out = torch.empty(1, S, args.heads, 512, dtype=torch.float8_e4m3fn, device=dev)
            kw = dict(q_rope=(pos, freq, 1e-6), o_rope=(pos, freq),
                      scales=torch.empty(args.heads * 4, S, device=dev))
        for probe in (0, 2):                    # (2: without the tiles' copies)
            row[f"probe{probe}_us"] = round(time_alone(lambda: instrumented(
                q, out, sinks, kv1, i1, kv2, i2, scale, two, probe=probe, **kw), args.iters), 1)
        def result(**extra):                    # the output (and FP8 scales) of one run, copied
            out.view(torch.uint8).fill_(0xFF)   # (a run that writes nothing, a probe's, does not match the last one)
            if "scales" in kw:
                kw["scales"].fill_(float("nan"))
            instrumented(q, out, sinks, kv1, i1, kv2, i2, scale, two, **kw, **extra)
            return [out.view(torch.uint8).clone()] + ([kw["scales"].clone()] if "scales" in kw else [])

        want = result()
        for v in filter(None, args.variants.split("|")):
            row[f"{v}_us"] = round(time_alone(lambda: instrumented(
                q, out, sinks, kv1, i1, kv2, i2, scale, two, defines=v, **kw), args.iters), 1)
            # a variant that changes no arithmetic (the order of work only) gives the default kernel's bits
            row[f"{v}_same_bits"] = all(torch.equal(x, y) for x, y in zip(result(defines=v), want))
        n = cuda_impl.ctas_resident(dev.index or 0)

        def phases(defines=""):                 # the traced kernel's cycles a round / an item, and the counts
            tr = torch.zeros(n, 32, dtype=torch.int64, device=dev)
            instrumented(q, out, sinks, kv1, i1, kv2, i2, scale, two, trace=tr, defines=defines,
                                            **kw)
            tot = tr.sum(0).tolist()
            items, tiles = max(tot[14], 1), max(tot[15], 1)
            return tot, {PHASES[k]: round(tot[k] / (items if k in PER_ITEM else tiles)) for k in PHASES}

        row["ctas"] = n
        tot, row["cycles"] = phases()
        row.update(items=tot[14], tiles=tot[15], rows_kept=tot[24])
        if args.trace_variants:
            for v in filter(None, args.variants.split("|")):
                row[f"cycles {v}"] = phases(v)[1]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'kind':8} " + " ".join(f"{'probe' + str(p):>8}" for p in (0, 2))
          + "   cycles a round (q / output / counts / q slot: an item)")
    for r in rows:
        print(f"{r['kind']:8} " + " ".join(f"{r[f'probe{p}_us']:>8.1f}" for p in (0, 2)) + "   "
              + " ".join(f"{k[:-3]}: {v}{'' if r.get(k[:-3] + '_same_bits', True) else ' (BITS DIFFER)'}"
                         for k, v in r.items() if k.endswith("_us") and not k.startswith("probe"))
              + "   "
              + ", ".join(f"{k} {v}" for k, v in r["cycles"].items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=dict(git_sha=git_sha(), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                     command=" ".join(sys.argv)), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

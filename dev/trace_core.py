"""Where an item's time goes inside the warp-specialized sparse core: an in-kernel timeline.

    python dev/trace_core.py [--kinds sliding,csa,hca] [--heads 64] [--tokens 4096] [--out PATH]

The kernel (``core_gluon._sparse_core_ws`` with ``trace=``) writes, for every (query, 64-head block) item, the
SM's cycle counter at fixed points of the math partition's and the loader's path, and the global ns timer at the
item's start. This script runs the core on ``bench_core``'s synthetic V4 prefill picks, in two modes:

- ``plain``: bf16 q in, bf16 out (the core alone, as ``bench_core`` times it);
- ``layer``: as the attention layer's prefill calls it: q raw (its norm and RoPE in the core's prologue), the
  output's inverse RoPE and ``act_quant`` for the FP8 wo_a in its epilogue.

It prints the median of each phase over the items (each program's first and last items left out, us), the
kernel's time with and without the trace (the stamps cost a little), and how far apart the programs start the
same item (whether the SMs move in step, so that their q loads and output stores come in bursts).

Math partition, per item: ``q wait`` (until the loader's q_full), ``tile 0`` (its kv_full and QK), ``tiles``
(up to the last QK), ``last PV`` (its softmax, PV and the output written to shared memory), ``stage`` (read back,
buffer released), ``store`` (the epilogue's math and global stores), ``to next`` (to the next item's start).
Loader, per item: ``q_empty`` (the wait for the math's last QK of the item before), ``tile 0 issue``, ``q ready``
(q's copies landed, its prologue; negative with ``qpro=1``, which runs it before tile 0's issue), ``slot wait``
(tile 1's buffer, held by the item before's output staging).
With the QK1 kernel (``--variants "qk1=1"``) the math phases are warpgroup 0's, and ``w1 end`` is from warpgroup 0's
start of an item to warpgroup 1's end of it (with W1OUT: its stores of the whole output).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from bench_attn import parse_core_opts, time_alone  # noqa: E402
from bench_core import make  # noqa: E402

from moe_wave.attention import core_gluon  # noqa: E402

MATH = (("q wait", 0, 1), ("tile 0", 1, 2), ("tiles", 2, 6), ("last PV", 6, 3), ("stage", 3, 4),
        ("store", 4, 5))
LOADER = (("q_empty", 8, 9), ("tile 0 issue", 9, 10), ("q ready", 10, 11), ("slot wait", 14, 12),
          ("rest", 12, 13), ("w1 end", 0, 15))


# the steps around the core that each mode fuses: q's norm and RoPE, the output's inverse RoPE, act_quant
MODES = dict(plain="", layer="qof", qrope="q", orope="o", fp8="f")


def steps(mode: str, q) -> dict:
    """The mode's steps as ``sparse_attention_gluon``'s keywords (positions and frequencies made once, outside
    the timed calls)."""
    B, S = q.shape[:2]
    pos = torch.arange(B * S, device=q.device)
    freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, device=q.device, dtype=torch.float32) / 64))
    return {k: v for k, v in (("q_rope", (pos, freq, 1e-6)), ("o_rope", (pos, freq))) if k[0] in MODES[mode]}


def launch(mode: str, kw: dict, q, parts, sinks, trace=None, opts=None):
    """One call of the warp-specialized core (kw: ``steps(mode, q)``) into fresh outputs; returns (out, scales or
    None)."""
    B, S, H, D = q.shape
    (kv1, i1), (kv2, i2) = parts[0], parts[-1]
    scales = None
    if "f" in MODES[mode]:
        scales = torch.empty(H * D // 128, B * S, device=q.device, dtype=torch.float32)
        out = torch.empty(B, S, H, D, device=q.device, dtype=torch.float8_e4m3fn)
    else:
        out = torch.empty_like(q)
    opts = dict(opts or {})
    probe = opts.pop("PROBE", 0)
    core_gluon.sparse_attention_gluon(q, out, sinks, kv1, i1, kv2, i2, D ** -0.5, len(parts) == 2, ws=True,
                                      trace=trace, opts=opts, scales=scales, probe=probe, **kw)
    return out, scales


def same(a, b) -> bool:
    """Both calls' outputs (and scales) bit for bit."""
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and (
        a[1] is None or torch.equal(a[1].view(torch.int32), b[1].view(torch.int32)))


def rel_diff(a, b) -> float:
    """How far output a is from b: the relative L2 norm of the difference of their values (FP8: times the
    scales), for variants that round in another order (PAIR)."""
    def val(o):
        x = o[0].float()
        if o[1] is not None:
            B, S, H, D = x.shape
            x = x.view(B * S, H * D // 128, 128) * o[1].t()[:, :, None]
        return x.reshape(-1)
    va, vb = val(a), val(b)
    return float((va - vb).norm() / vb.norm().clamp_min(1e-30))


def analyse(tr: np.ndarray, G: int) -> dict:
    """Phase medians (us) from the int32 stamps; the clock rate from each program's first and last ns stamps."""
    n = tr.shape[0]
    tr = tr.astype(np.int64)
    # (32-bit counters wrap; a phase may be negative: with QPRO q is ready before tile 0 is issued)
    d = lambda a, b: (b - a + (1 << 31)) % (1 << 32) - (1 << 31)       # noqa: E731
    items = np.arange(n)
    prog, k = items % G, items // G
    last_k = np.array([(n - 1 - p) // G for p in range(G)])
    rates = []
    for p in range(G):
        first, last = p, p + last_k[p] * G
        if last > first:
            rates.append(d(tr[first, 0], tr[last, 0]) / max(d(tr[first, 7], tr[last, 7]), 1))   # cycles per ns
    ghz = float(np.median(rates))
    us = lambda cyc: cyc / ghz / 1e3                                   # noqa: E731
    inner = (k > 0) & (k < last_k[prog])
    res = dict(clock_ghz=round(ghz, 3), items=n, programs=G)
    for name, a, b in MATH + LOADER:
        stamped = tr[:, a].any() and tr[:, b].any()                    # (col 11: only with q's prologue)
        res[name] = round(float(np.median(us(d(tr[inner, a], tr[inner, b])))), 2) if stamped else float("nan")
    nxt = items + G
    ok = inner & (nxt < n)
    res["to next"] = round(float(np.median(us(d(tr[ok, 5], tr[nxt[ok], 0])))), 2)
    res["item"] = round(float(np.median(us(d(tr[ok, 0], tr[nxt[ok], 0])))), 2)
    # from the q_empty the math gave (its last QK of the item before) to q_full: q's copies and prologue
    res["q load+prep"] = round(float(np.median(us(d(tr[nxt[ok], 9], tr[nxt[ok], 11])))), 2) \
        if tr[:, 11].any() else float("nan")
    # lockstep: the spread of the programs' start of their k-th item (global ns timer)
    t0 = tr[:, 7]
    spread = []
    for kk in range(1, int(last_k.min())):
        ts = np.array([d(t0[0], t0[p + kk * G]) for p in range(G)], dtype=np.float64)
        spread.append((np.percentile(ts, 90) - np.percentile(ts, 10)) / 1e3)
    res["start spread p10-p90 (us)"] = round(float(np.median(spread)), 2) if spread else float("nan")
    res["span (us)"] = round(float(d(t0.min(), t0.max())) / 1e3, 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default="sliding,csa,hca")
    ap.add_argument("--modes", default="layer,plain", help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--variants", default="base", help="semicolon list of the kernel's switches to compare, "
                    "e.g. 'base;ors=1;qpf=1' (core_gluon.WS_OPTS; base: the defaults); each is checked bit for bit "
                    "against the first; probe=N (3-9, profiling: core_gluon._ws_opts says what each leaves out)")
    ap.add_argument("--heads", type=int, default=64, help="64: V4-Flash, 128: V4-Pro")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None, help="JSON results (the phases' medians)")
    ap.add_argument("--raw", default=None, help="a folder for each run's stamps (.npy, int32 [items, 16])")
    args = ap.parse_args()
    if not core_gluon.available():
        raise SystemExit("trace_core: needs a Hopper GPU with Triton's Gluon (core_gluon.available() is False)")
    dev = torch.device("cuda")
    rows, t_start = [], time.time()
    G = torch.cuda.get_device_properties(dev).multi_processor_count
    try:                # each variant's switches (its items without "=", such as "base", name it only)
        variants = [(var, parse_core_opts(",".join(kv for kv in var.split(",") if "=" in kv), ("PROBE",),
                                          "--variants")) for var in args.variants.split(";")]
    except ValueError as e:
        sys.exit(f"trace_core: {e}")
    for kind in args.kinds.split(","):
        q, parts, sinks = make(kind, args.tokens, args.heads, 512, dev)
        n_items = args.tokens * (args.heads // core_gluon.BH)
        for mode in args.modes.split(","):
            first, kw = None, steps(mode, q)
            for var, opts in variants:
                trace = torch.zeros(n_items, 16, device=dev, dtype=torch.int32)
                plain_us = time_alone(lambda: launch(mode, kw, q, parts, sinks, opts=opts), args.iters)
                traced_us = time_alone(lambda: launch(mode, kw, q, parts, sinks, trace, opts), args.iters)
                ref = launch(mode, kw, q, parts, sinks, opts=opts)
                got = launch(mode, kw, q, parts, sinks, trace, opts)
                torch.cuda.synchronize()
                first = first or ref
                row = dict(kind=kind, mode=mode, variant=var, heads=args.heads, tokens=args.tokens,
                           us=round(plain_us, 1), traced_us=round(traced_us, 1), same_bits_traced=same(ref, got),
                           same_bits_as_first=same(ref, first), rel_to_first=f"{rel_diff(ref, first):.1e}",
                           **analyse(trace.cpu().numpy(), min(G, n_items)))
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.raw:
                    np.save(os.path.join(args.raw, f"{kind}-{mode}-{var.replace(',', '_').replace('=', '')}.npy"),
                            trace.cpu().numpy())
    cols = ["us", "traced_us", "item"] + [m[0] for m in MATH] + ["to next"] + [m[0] for m in LOADER] + [
        "q load+prep", "start spread p10-p90 (us)"]
    print("\nmedian us an item (each program's first and last left out)")
    for r0 in range(0, len(rows), 8):
        part = rows[r0:r0 + 8]
        print(f"{'':14}" + "".join(f"{r['kind'][:5] + '/' + r['mode'][:5]:>13}" for r in part))
        print(f"{'variant':14}" + "".join(f"{r['variant'][:12]:>13}" for r in part))
        for c in cols + ["same_bits_as_first", "rel_to_first"]:
            print(f"{c[:14]:14}" + "".join(f"{str(r[c]):>13}" for r in part))
    if args.out:
        meta = dict(command=" ".join(sys.argv), git_sha=os.environ.get("MOE_WAVE_GIT_SHA", "unknown"),
                    gpu=torch.cuda.get_device_name(), torch=torch.__version__, seconds=round(time.time() - t_start, 1))
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

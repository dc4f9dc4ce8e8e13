"""Where the attention layer's time goes: a kernel table per part (torch.profiler, one GPU).

    python dev/profile_attn.py [--shape v4-flash] [--types csa,hca,sliding] [--tokens 4096] [--rows 12]
                                  [--precision bf16|fp8|fp8a]
    python dev/profile_attn.py --decode 64 --types csa       (a decode step, batch 64, 4096-token cache)
    python dev/profile_attn.py --micro-only                  (only each kernel alone)
    python dev/profile_attn.py --whole --shape v4-pro        (the whole layer from a CUDA graph, overlap off / on)

For each layer type it runs each front-end branch alone (the chains ``bench_attn.py`` times:
q, window kv, compressor, indexer incl. q_lora), then the sparse core and the output projection alone on the
front-end's result, each under torch.profiler after warm-up, and prints the kernels sorted by total device
time, with the part's total and the count of kernels. Last, each Triton kernel alone on the V4-Flash prefill
shapes: the small ones and their variants by device time (``small``; ``--small-only`` only those), then the
larger ones (the core with the achieved TFLOP/s, the top-k against torch.topk). The same tables go to
$OUT/profile_attn.txt when OUT is set.
"""

from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from attn_kit import (CTX, _clone, branches, core_fn, core_parts, fill_cache, make_attn, out_fn,  # noqa: E402
                      time_eager)
from bench_common import out_path  # noqa: E402


def _on_gpu(events) -> list:
    """The profiler's events (or averages) that ran on the GPU: the kernels, memsets and copies."""
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]


def kernel_table(prof, rows: int) -> tuple[str, float, int]:
    evs = _on_gpu(prof.key_averages())
    evs.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in evs)
    count = sum(e.count for e in evs)
    lines = [f"    {'us/iter':>9} {'calls':>6}  kernel"]
    for e in evs[:rows]:
        lines.append(f"    {e.self_device_time_total:9.1f} {e.count:6d}  {e.key[:110]}")
    return "\n".join(lines), total, count


def _profile(fn, n: int = 1):
    """torch.profiler over n calls of ``fn()`` after three warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()   # HOST SYNC: the warm-up stays out of the profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()   # HOST SYNC: the profile ends with the kernels it launched
    return prof


def profiled(fn, rows: int) -> tuple[str, float, int]:
    """``fn()`` under torch.profiler after three warm-up calls: the kernel table (see ``kernel_table``)."""
    return kernel_table(_profile(fn), rows)


def micro(dev) -> str:
    """Each fused kernel alone on the V4-Flash prefill shapes (CUDA events, median of 20)."""
    from moe_wave.attention.sparse_core import sparse_attention_fused
    from moe_wave.attention import kernels as K
    from moe_wave.attention.kernels import index_scores, norm_rope
    from moe_wave.attention.topk import topk_select

    def t(fn):
        return time_eager(fn, lambda i: (), 20, 3)

    S = 4096
    pos = torch.arange(S, device=dev)[None]
    freq = torch.rand(32, device=dev)
    q = torch.randn(1, S, 64, 512, device=dev, dtype=torch.bfloat16)
    qi = torch.randn(1, S, 64, 128, device=dev, dtype=torch.bfloat16)
    ql = torch.randn(1, S, 1024, device=dev, dtype=torch.bfloat16)
    w = torch.rand(1, S, 64, device=dev)
    k = torch.randn(1, S // 4, 128, device=dev, dtype=torch.bfloat16)
    sc = torch.randn(1, S, S // 4, device=dev)
    kv = torch.randn(1, S + 128, 512, device=dev, dtype=torch.bfloat16)
    comp = torch.randn(1, S // 4 + 1, 512, device=dev, dtype=torch.bfloat16)
    win = (torch.arange(S, device=dev)[:, None] + 128 - torch.arange(128, device=dev))[None]   # 128 rows each
    top = torch.stack([torch.randperm(S // 4, device=dev)[:512] for _ in range(64)]).repeat(S // 64, 1)[None]
    sinks = torch.zeros(64, device=dev)
    qd = torch.randn(64, 1, 64, 128, device=dev, dtype=torch.bfloat16)      # a decode step: 64 rows, 4096 cached
    wd = torch.rand(64, 1, 64, device=dev)
    kd = torch.randn(64, S // 4, 128, device=dev, dtype=torch.bfloat16)
    posd = torch.full((64, 1), S, device=dev)
    core_flop = 4 * 64 * 512 * S * (128 + 512)
    rows = [("q heads norm+rope in place [4096,64,512]", lambda: norm_rope(q, pos, freq, out=q), 2 * q.nbytes, 0),
            ("indexer q rope, new tensor [4096,64,128]", lambda: norm_rope(qi, pos, freq, norm=False), 2 * qi.nbytes,
             0),
            ("indexer q rope in place", lambda: norm_rope(qi, pos, freq, norm=False, out=qi), qi.nbytes // 2, 0),
            ("q_lora rms_norm [4096,1024]", lambda: norm_rope(ql, weight=torch.ones(1024, device=dev)), 2 * ql.nbytes,
             0),
            ("index_scores heads-on-M [4096 x 1024 x 64h x 128]", lambda: index_scores(qi, w, k, pos, 4, "heads"), 0,
             0),
            ("index_scores queries-on-M [4096 x 1024 x 64h x 128]", lambda: index_scores(qi, w, k, pos, 4, "queries"),
             0, 0),
            ("index_scores heads-on-M, decode [64 x 1 x 1024 x 64h x 128]",
             lambda: index_scores(qd, wd, kd, posd, 4, "heads"), 0, 0),
            ("index_scores queries-on-M, decode", lambda: index_scores(qd, wd, kd, posd, 4, "queries"), 0, 0),
            ("torch.topk 512 of 1024 (unsorted) [4096 rows]", lambda: sc.topk(512, dim=-1, sorted=False), 0, 0),
            ("topk_select 512 of 1024 [4096 rows]", lambda: topk_select(sc, 512), 0, 0),
            ("sparse core [4096 x 64h x (128 + 512) x 512]",
             lambda: sparse_attention_fused(q, [(kv, win), (comp, top)], sinks, 512 ** -0.5), 0, core_flop)]
    o = torch.randn(1, S, 64, 512, device=dev, dtype=torch.bfloat16)
    rows.insert(1, ("o inverse rope, tail in place [4096,64,512]",
                    lambda: norm_rope(o, pos, freq, norm=False, inverse=True, out=o), o.nbytes // 4, 0))
    for tile, warps in NORM_ROPE_CHOICES:
        def tuned(tile=tile, warps=warps):
            with mock.patch.multiple(K, NORM_ROPE_TILE=tile, NORM_ROPE_WARPS=warps):
                norm_rope(q, pos, freq, out=q)
        rows.insert(1, (f"q heads norm+rope, {tile} channels / program, {warps} warps", tuned, 2 * q.nbytes, 0))
    lines = ["== kernels alone (V4-Flash prefill 4096)"]
    for name, fn, nbytes, flop in rows:
        us = t(fn)
        rate = f"  ({nbytes / us / 1e3:.0f} GB/s)" if nbytes else (f"  ({flop / us / 1e6:.0f} TFLOP/s)" if flop else "")
        lines.append(f"    {us:8.1f} us  {name}{rate}")
    return "\n".join(lines)


def kernel_times(fn, n: int = 10) -> dict:
    """Each kernel's device time a call of ``fn`` and its calls a call: {name: (us, calls)} (torch.profiler over n
    calls after three warm-up calls: no launch cost or gap in it, which for a kernel of a few us is most of an
    event-timed call)."""
    evs = _on_gpu(_profile(fn, n).key_averages())
    return {e.key: (e.self_device_time_total / n, e.count // n) for e in evs}


def kernel_us(fn, n: int = 10) -> float:
    """The device time of ``fn``'s kernels a call (``kernel_times`` summed)."""
    return sum(us for us, _ in kernel_times(fn, n).values())


def timeline(fn, width: int = 60) -> list[str]:
    """One call of ``fn``'s kernels in the order they started: start and end (us from the first start), duration,
    the stream (the profiler's resource id) and the name; idle stretches of the GPU (no kernel running) marked."""
    evs = sorted(_on_gpu(_profile(fn, 1).events()), key=lambda e: e.time_range.start)
    if not evs:
        return []
    t0, busy_to, out = evs[0].time_range.start, evs[0].time_range.start, []
    for e in evs:
        a, b = e.time_range.start, e.time_range.end
        if a > busy_to + 1:
            out.append(f"      {'':>8} {'':>8} {a - busy_to:7.1f}  idle")
        busy_to = max(busy_to, b)
        out.append(f"      {a - t0:8.1f} {b - t0:8.1f} {b - a:7.1f}  s{getattr(e, 'device_resource_id', '?')!s:<4} "
                   f"{e.name[:width]}")
    return out


def whole_layer(attn, x, pos, cache, rows: int, reps: int = 10, rounds: int = 3, decode: bool = False,
                show_timeline: bool = False) -> str:
    """The whole layer replayed from a CUDA graph: overlap off, on (the schedule's defaults) and on without a cache
    (no ring writes): each replay's time (CUDA events; the median of ``rounds`` rounds of ``reps`` replays, the
    graphs taking turns, so that a drift of the clocks reaches them all) and each kernel's device time a replay in each, the kernels that differ
    most between off and on first (where an overlapped layer loses what its front-end gained). Kernel times of
    concurrent kernels include their waits for SMs; the replay times are what counts. A decode step (``decode``) has
    no run without a cache. ``show_timeline``: each run's kernels of one replay in the order they started
    (``timeline``)."""
    from moe_wave.timing import as_graph, iteration_us

    # name: (overlap, cache)
    runs = {"serial": (False, cache), "overl.": (True, cache), "no cache": (True, None)}
    if decode:
        del runs["no cache"]
    replays, samples, kern = {}, {n: [] for n in runs}, {}
    for name, (overlap, c) in runs.items():
        def fn(i, overlap=overlap, c=c):
            attn(x, positions=pos, cache=c, validate=False, overlap=overlap)
            if c is not None:
                c.join()
        replays[name], _ = as_graph(fn, x.device, warmup=3)
    for _ in range(rounds):
        for name, replay in replays.items():
            samples[name] += iteration_us(replay, reps, 3, device="cuda")
    times = {n: sorted(v)[len(v) // 2] for n, v in samples.items()}
    for name, replay in replays.items():
        kern[name] = kernel_times(lambda: replay(0), reps)
    keys = sorted(set().union(*kern.values()),
                  key=lambda k: -abs(kern["overl."].get(k, (0, 0))[0] - kern["serial"].get(k, (0, 0))[0]))
    lines = [f"    replay (median of {rounds} x {reps}): " + ", ".join(f"{n} {t:.1f} us" for n, t in times.items())
             + "; kernels a replay: " + " / ".join(f"{sum(v[0] for v in kern[n].values()):.1f}" for n in runs),
             "    " + " ".join(f"{n:>10}" for n in runs) + f" {'calls':>5}  kernel"]
    for k in keys[:rows]:
        vals = [kern[n].get(k, (0.0, 0)) for n in runs]
        lines.append("    " + " ".join(f"{v[0]:10.1f}" for v in vals) + f" {max(v[1] for v in vals):5d}  {k[:90]}")
    if show_timeline:
        for name, replay in replays.items():
            lines += [f"    timeline, {name}: start, end, us; stream; kernel"] + timeline(lambda: replay(0))
    return "\n".join(lines)


def small(dev) -> str:
    """The front-end's small kernels and their variants, each alone (``kernel_us``: the kernels' device time),
    V4-Flash prefill shapes: q_lora's norm and quantisation (chained / fused), the window kv's norm and RoPE (rows a
    program), the compressors' pooling (HCA's split by channel pairs a program)."""
    from moe_wave.attention import compressor_kernels as CK, kernels as K
    from moe_wave.fp8 import act_quant

    def with_(mod, name, value, fn):
        def run():
            with mock.patch.object(mod, name, value):
                fn()
        return run

    S = 4096
    pos = torch.arange(S, device=dev)[None]
    freq = torch.rand(32, device=dev)
    ql = torch.randn(1, S, 1024, device=dev, dtype=torch.bfloat16)
    qw = torch.rand(1024, device=dev) + 0.5
    kv = torch.randn(1, S, 512, device=dev, dtype=torch.bfloat16)
    kw = torch.rand(512, device=dev) + 0.5
    rows = [("q_lora norm then act_quant (two kernels) [4096, 1024]",
             lambda: act_quant(K.norm_rope(ql, weight=qw).view(S, 1024))),
            ("q_lora rms_norm_quant (one kernel)", lambda: K.rms_norm_quant(ql, qw))]
    for n in (1, K.NORM_ROPE_ROWPOS_ROWS, 16):
        rows.append((f"window kv norm+rope in place [4096, 512], {n} rows a program",
                     with_(K, "NORM_ROPE_ROWPOS_ROWS", n,
                           lambda: K.norm_rope(kv, pos, freq, weight=kw, out=kv))))
    for kind, ratio, mult in (("HCA", 128, 1), ("CSA", 4, 2)):
        C, J = 512 * mult, ratio * mult
        ck = torch.randn(1, S, C, device=dev, dtype=torch.bfloat16)
        cs = torch.randn(1, S, C, device=dev, dtype=torch.bfloat16)
        rk = torch.randn(1, J, C, device=dev)
        rs = torch.randn(1, J, C, device=dev)
        ape = torch.randn(ratio, C, device=dev, dtype=torch.bfloat16)
        ent = torch.zeros(1, S // ratio + 2, 512, device=dev, dtype=torch.bfloat16)

        def pool(ck=ck, cs=cs, rk=rk, rs=rs, ape=ape, ent=ent, ratio=ratio, mult=mult):
            CK.pool_entries(ck, cs, rk, rs, ape, pos, kw, freq, ent, ratio=ratio, mult=mult, eps=1e-6)
        if kind == "CSA":
            rows.append((f"{kind} pool_entries [4096, {C}]", pool))
            continue
        for pairs in (32, 16, 8, 4):
            rows.append((f"{kind} pool_entries [4096, {C}], split {pairs} pairs a program",
                         with_(CK, "POOL_SPLIT_PAIRS", pairs, pool)))
    lines = ["== small kernels alone, their device time (V4-Flash prefill 4096)"]
    for name, fn in rows:
        lines.append(f"    {kernel_us(fn):8.1f} us  {name}")
    return "\n".join(lines)


# norm_rope's (channels per program, warps) timed against the default in the micro table
NORM_ROPE_CHOICES = ((8192, 4), (8192, 8), (16384, 8), (2048, 4))


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="v4-flash")
    ap.add_argument("--types", default="csa,hca,sliding")
    ap.add_argument("--tokens", type=int, default=CTX)
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--decode", type=int, default=0, metavar="B",
                    help="profile a decode step of batch B on a CTX-token cache instead of a prefill")
    ap.add_argument("--micro-only", action="store_true", help="only the tables of each kernel alone")
    ap.add_argument("--whole", action="store_true",
                    help="instead of the parts, the whole layer from a CUDA graph with overlap off, on, on without a "
                         "cache, on with the ring writes deferred, on with high-priority side streams (each replay's "
                         "time, each kernel's device time)")
    ap.add_argument("--timeline", action="store_true",
                    help="with --whole: each run's kernels of one replay in the order they started, idle gaps marked")
    ap.add_argument("--small-only", action="store_true",
                    help="of the kernels alone, only the small ones' table (with --types '': that table alone)")
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp8", "fp8a"),
                    help="the projections' format, as bench_attn.py --precision (default bf16)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    out = []
    for kind in [] if args.micro_only else [t for t in args.types.split(",") if t]:
        attn = make_attn(args.shape, kind, dev, args.precision)
        B, S, start = (args.decode, 1, CTX) if args.decode else (1, args.tokens, 0)
        mode = f"decode batch {B}, cache {CTX}" if args.decode else f"prefill {S}"

        def cache_for():
            c = attn.new_cache(B, start + S + 8)
            if args.decode:
                fill_cache(c, CTX)
            return c

        x = torch.randn(B, S, attn.cfg.hidden, device=dev, dtype=torch.bfloat16)
        pos = (start + torch.arange(S, device=dev)).expand(B, -1).contiguous()
        if args.whole:
            out.append(f"== {args.shape} {kind} {args.precision} {mode}: the whole layer from a CUDA graph\n"
                       + whole_layer(attn, x, pos, cache_for(), args.rows, decode=bool(args.decode),
                                     show_timeline=args.timeline))
            print(out[-1], flush=True)
            continue
        parts_run = {f"branch {name}": (lambda fn=fn, c=cache_for(): fn(x, pos, c))
                     for name, fn in branches(attn).items()}
        cache = cache_for()
        fe = core_parts(attn, x, pos, cache)
        core = core_fn(attn, fe, pos)
        o = _clone(core())
        parts_run.update({"core": core, "output": out_fn(attn, fe, o, pos)})
        for name, fn in parts_run.items():
            table, total, count = profiled(fn, args.rows)
            out.append(f"== {args.shape} {kind} {args.precision} {mode}: {name}: {total:.0f} us of kernels, {count} "
                       f"launches\n{table}")
            print(out[-1], flush=True)
        del attn, cache, fe, o, parts_run
        torch.cuda.empty_cache()
    if args.decode or args.whole:
        name = "profile_attn_whole.txt" if args.whole else "profile_attn_decode.txt"
        if out_path(name):
            with open(out_path(name), "w") as f:
                f.write("\n".join(out) + "\n")
        return
    out.append(small(dev))
    print(out[-1], flush=True)
    if not args.small_only:
        out.append(micro(dev))
        print(out[-1], flush=True)
    if out_path("profile_attn.txt"):
        with open(out_path("profile_attn.txt"), "w") as f:
            f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()

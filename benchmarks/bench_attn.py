"""Benchmark of the V4 attention front-end: serial vs overlapped streams, critical path, whole layer.

    python benchmarks/bench_attn.py [--quick] [--out PATH]        # one GPU; torchrun also works (rank 0 runs)
    python benchmarks/bench_attn.py --core [--out PATH]           # the sparse core and the top-k alone (fast)

Shapes: V4-Flash and V4-Pro attention (bf16, random weights of the real shapes, no HF), each with its projections
in bf16 and in the checkpoints' FP8 format (``--precision``, ``V4Attention.quantize_fp8``). Per layer type
(sliding, csa c4 + indexer, hca c128): prefill of 4096 tokens (eager) and decode at batch 1, 8, 64,
128 against a cache holding 4096 tokens (CUDA graphs); prefill is timed twice, eager and replayed
from a CUDA graph (as serving stacks capture fixed prefill sizes), since eager launches on a slow
host can hide what the streams do. Columns (microseconds, medians over many
iterations, CUDA events, after warm-up, fresh random inputs each iteration):
  serial_us          front-end up to the core, all branches on one stream (overlap off)
  overlapped_us      the same with the branches on side streams
  critical_path_us   the longest branch timed alone (q chain, window kv, compressor, indexer incl. q_lora)
  layer_serial_us / layer_us   the whole attention layer (front-end + core + output projection)
  core_us / output_us          the sparse core alone / the output projection alone (on the front-end's result)
  core_int64_picks_us          the same core on the parts' picks as int64 (the front-end makes int32)
  core_tflops        the core's useful FLOPs (4 * H * d per valid pick: QK and PV) per second, against
                     gemm_tflops, a dense bf16 8192^3 GEMM timed in the same run (core_vs_gemm = the ratio);
                     fp8_gemm_tflops: the same GEMM in the FP8 format (block scales), the projections' yardstick
``--core`` times only the core (prefill 4096 and decode batch 64, every layer type, both shapes; on CSA each
tiling of ``sparse_core.FALLBACKS`` and ``EXTRA_TILINGS`` in prefill and key / value splits in decode) and the
indexer's top-k (``topk.topk_select`` against
``torch.topk``), and prints one short table.
Writes JSON {"meta", "rows"} to --out (default $OUT/attn.json, else benchmarks/<date>-attn-1gpu.json),
prints a table last and the recommended ``ScheduleConfig.decode_overlap_min_batch``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
from dataclasses import replace

import torch
from triton.runtime.errors import OutOfResources

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_kit import (CTX, SHAPES, TYPES, _clone, branches, core_fn, core_parts, fill_cache,  # noqa: E402
                      fp8_gemm_tflops, gemm_tflops, make_attn, meta, out_fn, time_alone, time_eager, time_graph)
from bench_common import out_path  # noqa: E402

from moe_wave.attention import ScheduleConfig  # noqa: E402
from moe_wave.attention.sparse_core import (FALLBACKS, CoreConfig, CoreTuning, core_flops, core_impl,  # noqa: E402
                                            default_config)
from moe_wave import fp8  # noqa: E402
from moe_wave.env import read_env  # noqa: E402
from moe_wave.attention.topk import topk_select  # noqa: E402
from moe_wave.attention.schedule import run_frontend  # noqa: E402

# more tilings timed on the CSA prefill besides the fallback ladder (tuning data, not used by the layer)
EXTRA_TILINGS = (CoreConfig(num_stages=3), CoreConfig(block_n=32, num_stages=3), CoreConfig(block_n=32),
                 CoreConfig(block_dv=256, num_warps=4), CoreConfig(num_warps=16),
                 CoreConfig(num_warps=16, num_stages=3),
                 CoreConfig(block_n=32, num_warps=16, num_stages=3), CoreConfig(block_dk=256),
                 CoreConfig(block_dk=256, num_warps=16), CoreConfig(block_n=128, num_warps=16, num_stages=1))


@torch.no_grad()
def measure(shape: str, kind: str, mode: str, batch: int, iters: int, warmup: int, dev, graph: bool,
            debug: bool = False, precision: str = "bf16", tokens: int = CTX,
            schedule: ScheduleConfig | None = None) -> dict:
    attn = make_attn(shape, kind, dev, precision, schedule)
    D = attn.cfg.hidden
    S = tokens if mode == "prefill" else 1
    start = 0 if mode == "prefill" else CTX
    cache = attn.new_cache(batch, max(CTX, S) + 8)
    if mode == "decode":
        fill_cache(cache, CTX)
    pos = (start + torch.arange(S, device=dev)).expand(batch, -1).contiguous()
    pool = [torch.randn(batch, S, D, device=dev, dtype=torch.bfloat16) for _ in range(4)]

    def frontend(overlap):
        def fn(x, p, c):
            run_frontend(attn, x, p, c, overlap)
            c.join()
        return fn

    def layer(overlap):
        def fn(x, p, c):
            attn(x, positions=p, cache=c, validate=False, overlap=overlap)
            c.join()  # eager warm-up leaves deferred writes; a capture may not wait on them
        return fn

    fe = core_parts(attn, pool[0], pos, cache)
    core = core_fn(attn, fe, pos)
    o = _clone(core())
    output = out_fn(attn, fe, o, pos)
    useful, _ = core_flops(attn.cfg.heads, attn.cfg.head_dim, [idx for _, idx in fe.parts])   # HOST SYNC (setup)
    # the same core on int64 picks (what the front-end made before kernels.picks and topk_select's int32)
    core64 = core_fn(attn, replace(fe, parts=[(src, idx.long()) for src, idx in fe.parts]), pos)
    fns = {"serial": frontend(False), "overlapped": frontend(True), "layer_serial": layer(False),
           "layer": layer(True), "core": lambda x, p, c: core(), "core_int64": lambda x, p, c: core64(),
           "output": lambda x, p, c: output()}
    fns.update({f"branch_{k}": v for k, v in branches(attn).items()})
    res = {}
    if graph:
        static = [pool[0].clone(), pos, cache]
        for name, fn in fns.items():
            if debug:
                print("capture", shape, kind, batch, name, flush=True)
            res[name] = time_graph(fn, static, pool, iters, warmup)
    else:
        for name, fn in fns.items():
            res[name] = time_eager(fn, lambda i: (pool[i % len(pool)], pos, cache), iters, warmup)
    crit = max(v for k, v in res.items() if k.startswith("branch_"))
    row = dict(shape=shape, layer_type=kind, precision=precision, mode=mode, batch=batch, tokens=batch * S, context=CTX,
               cuda_graph=graph, serial_us=round(res["serial"], 2),
               overlapped_us=round(res["overlapped"], 2), critical_path_us=round(crit, 2),
               layer_serial_us=round(res["layer_serial"], 2), layer_us=round(res["layer"], 2),
               core_us=round(res["core"], 2), core_int64_picks_us=round(res["core_int64"], 2),
               output_us=round(res["output"], 2), core_gflop=round(useful / 1e9, 2),
               core_tflops=round(useful / res["core"] / 1e6, 1))
    row.update({f"{k}_us": round(v, 2) for k, v in res.items() if k.startswith("branch_")})
    del attn, cache, pool, fe, o, output
    torch.cuda.empty_cache()
    return row


def topk_rows(dev, rows: int, n: int, causal: bool) -> torch.Tensor:
    """fp32 [1, rows, n] scores as the indexer leaves them: random, -inf past each row's visible prefix
    (prefill: row t sees (t + 1) // 4 entries) or all visible (decode)."""
    s = torch.randn(1, rows, n, device=dev)
    if causal:
        vis = (torch.arange(rows, device=dev) + 1) // 4
        s = s.masked_fill(torch.arange(n, device=dev) >= vis[:, None], float("-inf"))
    return s


def topk_point(dev, rows: int, n: int, k: int, causal: bool, iters: int) -> dict:
    """topk_select against torch.topk (unsorted, then -inf picks to -1, as the indexer needs) on one score
    tensor; ``same_set``: both pick the same ids on every row (random scores: no ties)."""
    s = topk_rows(dev, rows, n, causal)
    k = min(k, n)

    def torch_topk():
        v, i = s.topk(k, dim=-1, sorted=False)
        return torch.where(v == float("-inf"), torch.full_like(i, -1), i)

    ours, ref = topk_select(s, k), torch_topk()
    same = bool(torch.equal(ours.sort(-1).values, ref.sort(-1).values))   # HOST SYNC (check)
    return dict(rows=rows, n=n, k=k, causal=causal, topk_select_us=round(time_alone(lambda: topk_select(s, k), iters), 2),
                topk_select_int32_us=round(time_alone(lambda: topk_select(s, k, torch.int32), iters), 2),
                torch_topk_us=round(time_alone(torch_topk, iters), 2), same_set=same)


def tiling(c: CoreConfig) -> str:
    split = f" k/{c.split_k}" if c.split_k else ""
    return f"h{c.block_h} n{c.block_n} dk{c.block_dk} dv{c.block_dv} w{c.num_warps} s{c.num_stages}{split}"


@torch.no_grad()
def core_bench(dev, iters: int, gemm: float) -> dict:
    """The sparse core alone per shape / layer type: prefill 4096 (B=1) and decode batch 64 on a 4096-token
    cache; on CSA also other tilings (prefill: the fallback ladder and EXTRA_TILINGS; decode: 64-key
    tiles in 1-4 splits, 32-key tiles in 2-8 splits). Then the top-k."""
    rows, tilings = [], []
    for shape in SHAPES:
        for kind in TYPES:
            attn = make_attn(shape, kind, dev)
            for mode, batch in (("prefill", 1), ("decode", 64)):
                S, start = (CTX, 0) if mode == "prefill" else (1, CTX)
                cache = attn.new_cache(batch, CTX + 8)
                if mode == "decode":
                    fill_cache(cache, CTX)
                pos = (start + torch.arange(S, device=dev)).expand(batch, -1).contiguous()
                x = torch.randn(batch, S, attn.cfg.hidden, device=dev, dtype=torch.bfloat16)
                fe = core_parts(attn, x, pos, cache)
                q, parts = fe.q_BSHd, fe.parts
                H, d = attn.cfg.heads, attn.cfg.head_dim
                useful, nominal = core_flops(H, d, [idx for _, idx in parts])   # HOST SYNC (setup)
                us = time_alone(core_fn(attn, fe, pos), iters)
                o = _clone(core_fn(attn, fe, pos)())
                out_us = time_alone(out_fn(attn, fe, o, pos), iters)
                cfg = default_config(H, d, q.dtype)
                # the layer's core call has o_rope: at prefill the CUDA core on Hopper, at decode fused in Triton
                impl = core_impl(q, parts, fusions=True)
                label = {"cuda": "cuda (sparse_core.cuda_impl)"}.get(impl) or tiling(cfg)
                rows.append(dict(shape=shape, layer_type=kind, mode=mode, batch=batch, tokens=batch * S,
                                 core_us=round(us, 2), output_us=round(out_us, 2), gflop=round(useful / 1e9, 2),
                                 gflop_nominal=round(nominal / 1e9, 2), tflops=round(useful / us / 1e6, 1),
                                 vs_gemm=round(useful / us / 1e6 / gemm, 3),
                                 config=label))
                print(json.dumps(rows[-1]), flush=True)
                if kind == "csa":   # the ladder in prefill; in decode no split, the keys or the values split
                    cands = [*FALLBACKS, *EXTRA_TILINGS] if mode == "prefill" else [
                        replace(cfg, split_k=n) for n in (1, 2, 3, 4)] + [
                        replace(cfg, block_n=32, split_k=n) for n in (2, 4, 6, 8)] + [
                        replace(cfg, block_n=32, num_stages=3, split_k=n) for n in (4, 8)]
                    for c in cands:
                        try:
                            t = time_alone(core_fn(attn, fe, pos, c), iters)
                        except OutOfResources as e:   # this tiling does not fit this GPU
                            t = float("nan")
                            print(f"{tiling(c)}: {e}", flush=True)
                        tilings.append(dict(shape=shape, mode=mode, config=tiling(c.fit(H, d)), core_us=round(t, 2),
                                            tflops=round(useful / t / 1e6, 1)))
                        print(json.dumps(tilings[-1]), flush=True)
                del cache, q, parts, o, x, fe
            del attn
            torch.cuda.empty_cache()
    topk = [topk_point(dev, CTX, CTX // 4, k, True, iters) for k in (512, 1024)]
    topk.append(topk_point(dev, 64, CTX // 4, 512, False, iters))
    for t in topk:
        print(json.dumps(t), flush=True)
    return dict(core=rows, tilings=tilings, topk=topk)


def print_core(res: dict, gemm: float) -> None:
    print(f"\nsparse core (CUDA graphs) vs a dense bf16 GEMM of this run: {gemm:.0f} TFLOP/s")
    print(f"{'shape':9} {'type':7} {'mode':7} {'tok':>5} {'core_us':>9} {'GFLOP':>7} {'TFLOP/s':>8} {'%gemm':>6} "
          f"{'output_us':>9}  tiling")
    for r in res["core"]:
        print(f"{r['shape']:9} {r['layer_type']:7} {r['precision']:4} {r['mode']:7} {r['tokens']:>5} {r['core_us']:>9.1f} {r['gflop']:>7.1f} "
              f"{r['tflops']:>8.1f} {100 * r['vs_gemm']:>5.0f}% {r['output_us']:>9.1f}  {r['config']}")
    for t in res["tilings"]:
        print(f"  {t['shape']} csa {t['mode']}, {t['config']}: {t['core_us']:.1f} us, {t['tflops']:.1f} TFLOP/s")
    for t in res["topk"]:
        print(f"top-k {t['k']} of {t['n']}, {t['rows']} rows{' (causal)' if t['causal'] else ''}: topk_select "
              f"{t['topk_select_us']:.1f} us (int32 ids {t['topk_select_int32_us']:.1f}), torch.topk "
              f"{t['torch_topk_us']:.1f} us, same set: {t['same_set']}")


def decode_policy(rows) -> dict:
    """Smallest decode batch from which overlap never loses (whole layer), per shape; 0 = always on."""
    out = {}
    for shape in sorted({r["shape"] for r in rows}):
        dec = sorted((r for r in rows if r["shape"] == shape and r["mode"] == "decode"), key=lambda r: r["batch"])
        batches = sorted({r["batch"] for r in dec})
        if not batches:
            continue
        pays = {b: all(r["layer_us"] <= r["layer_serial_us"] for r in dec if r["batch"] == b) for b in batches}
        thr = None
        for b in reversed(batches):
            if not pays[b]:
                break
            thr = b
        out[shape] = 0 if thr == batches[0] else (thr if thr is not None else max(batches) + 1)
    return out


def parse_opts(text: str, names: tuple, flag: str) -> dict:
    """'NAME=VALUE,...' to {name: int}: each name one of ``names`` (any case), each value an integer; ``flag`` names
    the option in the error."""
    names = sorted(names)
    opts = {}
    for item in (t for t in text.split(",") if t):
        name, sep, value = item.partition("=")
        name = name.strip().lower()
        if not sep or name not in names or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"{flag} {item!r}: must be NAME=INTEGER with NAME one of {', '.join(names)}")
        opts[name] = int(value)
    return opts


CORE_OPTS = ("cuda", "cuda_max_picks", "fuse_max_waves", "q_norm_inside")     # CoreTuning's fields
LAYER_OPTS = ("wo_a_overlap", "wo_a_overlap_min_tokens")                     # ScheduleConfig's


def parse_core_opts(text: str) -> dict:
    """--core-opts: 'cuda_max_picks=4096,fuse_max_waves=2' -> CoreTuning's keywords (booleans as 0 / 1)."""
    opts = parse_opts(text, CORE_OPTS, "--core-opts")
    return {k: bool(v) if k in ("cuda", "q_norm_inside") else v for k, v in opts.items()}


def parse_layer_opts(text: str) -> dict:
    """--layer-opts' variant 'NAME=VALUE,...' of ``LAYER_OPTS`` ('' or 'default': none) -> ScheduleConfig's
    keywords (booleans as 0 / 1)."""
    opts = parse_opts("" if text == "default" else text, LAYER_OPTS, "--layer-opts")
    return {k: bool(v) if k == "wo_a_overlap" else v for k, v in opts.items()}


def _choices(flag: str, text: str, allowed: tuple) -> list[str]:
    """A comma list of ``allowed`` values; exits with one line naming the flag, the value and the choices."""
    got = [p for p in text.split(",") if p]
    for p in got:
        if p not in allowed:
            sys.exit(f"bench_attn: {flag} {p!r}: must be {', '.join(allowed[:-1])} or {allowed[-1]}")
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="V4-Flash only, decode batches 1 and 64, fewer iterations")
    ap.add_argument("--out", default=None, help="JSON output path (default $OUT/attn.json or benchmarks/)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per point")
    ap.add_argument("--debug", action="store_true", help="print each capture before it starts")
    ap.add_argument("--core", action="store_true", help="only the sparse core and the top-k (see above)")
    ap.add_argument("--shapes", default=None, help="comma list of presets (default: v4-flash with --quick, else all)")
    ap.add_argument("--batches", default=None, help="comma list of decode batches ('' for none; default: 1,64 with "
                    "--quick, else 1,8,64,128)")
    ap.add_argument("--no-eager", action="store_true", help="leave out the eager prefill point")
    ap.add_argument("--precision", default="bf16,fp8", help="comma list: bf16 (the projections in bf16), fp8 (in "
                    "the checkpoints' FP8 format, V4Attention.quantize_fp8), fp8a (the same with wo_a_fp8='auto': "
                    "the grouped FP8 wo_a from WO_A_FP8_MIN_TOKENS tokens a call on); default bf16,fp8")
    ap.add_argument("--prefill-tokens", default=str(CTX), help=f"comma list of prefill lengths (default {CTX})")
    ap.add_argument("--q-norm", default="core", help="comma list: core (q's norm and RoPE inside the core's "
                    "kernel where it does them, sparse_core.q_norm_inside: the default), branch (on the q branch "
                    "everywhere, CoreTuning(q_norm_inside=False)); default core")
    ap.add_argument("--core-cuda", default="on", help="comma list: on (the CUDA C++ core where it takes the call, "
                    "CoreTuning.cuda: the default), off (the Triton kernel); on,off measures both in one run")
    ap.add_argument("--fp8-gemm", default=None, help="comma list: auto (DeepGEMM where deep_gemm imports, else "
                    "cuBLAS), cublas, deepgemm (fp8.set_fp8_gemm); auto,cublas measures both in one run; default: "
                    "MOE_WAVE_FP8_GEMM, else auto")
    ap.add_argument("--layer-opts", default="", help="'|'-separated variants, each a comma list NAME=VALUE of the "
                    f"layer's ScheduleConfig fields ({', '.join(LAYER_OPTS)}; '' or 'default': the defaults), every "
                    "variant measured in one run, e.g. 'wo_a_overlap=0|wo_a_overlap=1'")
    ap.add_argument("--core-opts", default="", help="comma list NAME=VALUE of the sparse core's CoreTuning for this "
                    f"run ({', '.join(CORE_OPTS)}; e.g. cuda_max_picks=4096); default: its defaults. (The CUDA "
                    "core's profiling builds: dev/trace_core_cuda.py)")
    args = ap.parse_args()
    try:
        core_opts = parse_core_opts(args.core_opts)
    except ValueError as e:
        sys.exit(f"bench_attn: {e}")
    if not torch.cuda.is_available():
        sys.exit("bench_attn: needs a CUDA/ROCm GPU")
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun only rank 0 measures
        return
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dev = torch.device("cuda")
    torch.manual_seed(0)
    gemm = gemm_tflops(dev)
    precisions = _choices("--precision", args.precision, ("bf16", "fp8", "fp8a"))
    q_norms = _choices("--q-norm", args.q_norm, ("core", "branch"))
    try:
        layer_opts = [(v or "default", parse_layer_opts(v)) for v in args.layer_opts.split("|")]
    except ValueError as e:
        sys.exit(f"bench_attn: {e}")
    cudas = _choices("--core-cuda", args.core_cuda, ("on", "off"))
    try:
        gemms = [p for p in (args.fp8_gemm or read_env().fp8_gemm or "auto").split(",") if p]
    except ValueError as e:
        sys.exit(f"bench_attn: {e}")
    for p in gemms:
        if p not in fp8.FP8_GEMMS:
            sys.exit(f"bench_attn: --fp8-gemm {p!r}: must be one of {', '.join(fp8.FP8_GEMMS)}")
    gemm8 = fp8_gemm_tflops(dev) if {"fp8", "fp8a"} & set(precisions) and not args.core else None
    print(f"dense bf16 GEMM 8192^3: {gemm:.0f} TFLOP/s" + (f"; FP8 (block scales): {gemm8:.0f}" if gemm8 else ""),
          flush=True)
    if args.core:
        res = core_bench(dev, args.iters or 20, gemm)
        out = args.out or out_path("attn_core.json", os.path.join("results", f"{datetime.date.today()}-attn-core-1gpu.json"))
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump({"meta": {**meta(args), "gemm_tflops": round(gemm, 1)}, **res}, f, indent=1)
        print(f"wrote {out}")
        print_core(res, gemm)
        return
    shapes = args.shapes.split(",") if args.shapes else (["v4-flash"] if args.quick else list(SHAPES))
    batches = [int(b) for b in args.batches.split(",") if b] if args.batches is not None else (
        [1, 64] if args.quick else [1, 8, 64, 128])
    iters = args.iters or (10 if args.quick else 30)
    rows = []
    for shape in shapes:
        for kind, precision, q_norm, cuda, gemm_lib, (opts_name, opts) in itertools.product(
                TYPES, precisions, q_norms, cudas, gemms, layer_opts):
            lengths = [int(t) for t in args.prefill_tokens.split(",") if t]
            points = ([] if args.no_eager else [("prefill", 1, False, CTX)]) + [
                ("prefill", 1, True, t) for t in lengths] + [("decode", b, True, CTX) for b in batches]
            for mode, b, graph, tokens in points:
                n = max(5, iters // 3) if mode == "prefill" else iters
                core = CoreTuning(**{"q_norm_inside": q_norm == "core", "cuda": cuda == "on", **core_opts})
                schedule = ScheduleConfig(overlap=True, core=core, **opts)
                fp8.set_fp8_gemm(gemm_lib)
                lib = fp8.fp8_gemm_library(dev) if precision != "bf16" else "-"
                try:
                    row = measure(shape, kind, mode, b, n, warmup=3 if mode == "prefill" else 5, dev=dev,
                                  graph=graph, debug=args.debug, precision=precision, tokens=tokens,
                                  schedule=schedule)
                finally:
                    fp8.set_fp8_gemm(None)
                row["q_norm"], row["core_cuda"], row["layer_opts"], row["fp8_gemm"] = q_norm, cuda, opts_name, lib
                row["core_vs_gemm"] = round(row["core_tflops"] / gemm, 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
    policy = decode_policy(rows)
    out = args.out or out_path("attn.json", os.path.join("results", f"{datetime.date.today()}-attn-1gpu.json"))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"meta": {**meta(args), "decode_overlap_min_batch": policy, "gemm_tflops": round(gemm, 1),
                            "fp8_gemm_tflops": round(gemm8, 1) if gemm8 else None}, "rows": rows}, f, indent=1)
    hdr = (f"{'opts':15} {'shape':9} {'type':7} {'prec':4} {'qn':6} {'cuda':4} {'gemm':8} {'mode':7} {'graph':5} {'tok':>5} "
           f"{'serial':>9} "
           f"{'overlap':>9} {'crit':>9} {'layer_ser':>10} {'layer':>9} {'core':>9} {'core64':>8} {'output':>8} "
           f"{'TFLOP/s':>8} {'%gemm':>6}")
    print(f"\nwrote {out}\ndense bf16 GEMM: {gemm:.0f} TFLOP/s\n{hdr}")
    for r in rows:
        print(f"{r['layer_opts'][:15]:15} {r['shape']:9} {r['layer_type']:7} {r['precision']:4} {r['q_norm']:6} "
              f"{r['core_cuda']:4} {r.get('fp8_gemm', '-'):8} {r['mode']:7} "
              f"{'yes' if r['cuda_graph'] else 'no':5} {r['tokens']:>5} "
              f"{r['serial_us']:>9.1f} {r['overlapped_us']:>9.1f} {r['critical_path_us']:>9.1f} {r['layer_serial_us']:>10.1f} "
              f"{r['layer_us']:>9.1f} {r['core_us']:>9.1f} {r['core_int64_picks_us']:>8.1f} {r['output_us']:>8.1f} "
              f"{r['core_tflops']:>8.1f} "
              f"{100 * r['core_vs_gemm']:>5.0f}%")
    print(f"recommended ScheduleConfig.decode_overlap_min_batch: {policy}")


if __name__ == "__main__":
    main()

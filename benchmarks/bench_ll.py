"""Low-latency dispatch and combine, moe-wave's deep_ep against real DeepEP V1, in one run (DeepEP's test shape).

    torchrun --standalone --nproc-per-node=2 benchmarks/bench_ll.py [--tokens 128 --hidden 7168 --topk 8 --experts 288]

Implementations: moe-wave's direct kernels ("ours"), moe-wave on its exchange engine (``Buffer(ll="engine")``,
"ours-engine"), and real DeepEP when ``import deep_ep`` finds it (put its build on PYTHONPATH; moe-wave's shim is
never taken for it). Each is timed three ways, FP8 dispatch (as DeepEP's test) and bf16 combine:

- whole calls: CUDA events around each eager call on the caller's stream (what DeepEP's test_low_latency calls
  "Dispatch + combine": host work included);
- graph: the same calls captured in CUDA graphs and replayed (GPU time only);
- remote bytes over the P2P copy limit (a 256 MB copy GPU0 -> GPU1 in the same run): the least time the bytes that
  cross NVLink can take. Ours sends each token once per rank that holds one of its experts (FP8 row + scales, and
  its top-k ids and slots to every rank) and gets back one partial sum per (token, rank) (bf16; fp32 in
  "ours-fp32"), after the top-k weights went out; DeepEP sends a row per (token, expert) each way.

The SMs a phase occupies: ours launches one program per SM at most (``ll_direct.num_programs``); DeepEP's
low-latency kernels take every SM. Prints a markdown table; writes it and a JSON under $OUT when set.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import git_sha, init_ep, now, out_path, report  # noqa: E402
from bench_moe import p2p_limit_GBps  # noqa: E402


def _inputs(N, H, K, E, rank):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(N, H, generator=g).to(torch.bfloat16)
    scores = torch.randn(N, E, generator=g).abs() + 1
    ids = scores.topk(K, dim=1).indices
    w = torch.rand(N, K, generator=g)
    return x.cuda(), ids.cuda(), w.cuda()


def _real_deep_ep():
    try:
        import deep_ep
    except ImportError as err:
        return None, f"not importable ({err})"
    if getattr(deep_ep, "MOE_WAVE", False):
        return None, "only moe-wave's shim is on the path"
    return deep_ep, ""


def _buffer(impl, group, N, H, E):
    P = dist.get_world_size()
    if impl == "deepep":
        deep_ep, _ = _real_deep_ep()
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(N, H, P, E)
        return deep_ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=E // P,
                              allow_nvlink_for_low_latency_mode=True, explicitly_destroy=True)
    from moe_wave.deepep_compat import Buffer

    return Buffer(group, 0, Buffer.get_low_latency_rdma_size_hint(N, H, P, E), low_latency_mode=True,
                  explicitly_destroy=True, ll="engine" if impl == "ours-engine" else "auto",
                  ll_partial="fp32" if impl == "ours-fp32" else "bf16", ll_fast_launch=impl != "ours-jit")


def _time(fn_a, fn_b, iters):
    """Mean ms of fn_a and fn_b called in turn (CUDA events on the current stream around each)."""
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(iters)]
    for e in ev:
        e[0].record()
        fn_a()
        e[1].record()
        fn_b()
        e[2].record()
    torch.cuda.synchronize()
    a = sorted(e[0].elapsed_time(e[1]) for e in ev)
    b = sorted(e[1].elapsed_time(e[2]) for e in ev)
    mid = slice(iters // 10, iters - iters // 10)        # the middle 80 %
    return sum(a[mid]) / len(a[mid]), sum(b[mid]) / len(b[mid])


def _graph_time(buf, disp, comb, args):
    """Mean (dispatch, combine) ms of the calls captured once each in CUDA graphs and replayed in turn."""
    N, H, E = args.tokens, args.hidden, args.experts
    buf.clean_low_latency_buffer(N, H, E)
    torch.cuda.synchronize()
    gd, gc = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(gd, stream=s):
            disp()
        with torch.cuda.graph(gc, stream=s):
            comb()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    dist.barrier()
    for _ in range(args.warmup):
        gd.replay(), gc.replay()
    torch.cuda.synchronize()
    dist.barrier()
    graph = _time(gd.replay, gc.replay, args.iters)
    torch.cuda.synchronize()
    dist.barrier()
    return graph


def _phases(buf, disp, comb, iters):
    """Where the kernels' time goes: each call alone (a barrier before it, a sync after), the kernels recording the
    GPU's global timer at their phase boundaries (``DirectLL.times``); median us from the kernel's start, per
    word (``ll_direct.TIME_WORDS``), this rank. A wait includes the peer's lateness (ranks start apart)."""
    from moe_wave.deepep_compat.ll_direct import TIME_WORDS

    direct = buf._ll.direct
    times = direct.times = torch.zeros(16, dtype=torch.int64, device="cuda")
    got = {"d": [], "c": []}
    try:
        for i in range(iters + 3):
            for kind, fn in (("d", disp), ("c", comb)):
                times.zero_()
                times[0] = 2 ** 63 - 1
                torch.cuda.synchronize()
                dist.barrier()
                fn()
                torch.cuda.synchronize()
                if i >= 3:
                    got[kind].append(times.tolist())
    finally:
        direct.times = None
    out = {}
    for kind, runs in got.items():
        for w, name in enumerate(TIME_WORDS[kind]):
            ds = sorted((r[w] - r[0]) / 1e3 for r in runs if r[w] > 0)
            out[f"{'dispatch' if kind == 'd' else 'combine'}: {name}"] = round(ds[len(ds) // 2], 2) if ds else None
    return out


def _tune(buf, disp, comb, args):
    """Graph (dispatch, combine) us of ours under each ``--tune`` variant (``LLTune`` fields), in one run."""
    from dataclasses import fields, replace

    from moe_wave.deepep_compat.config import LLTune

    direct = buf._ll.direct
    keep = direct.tune
    names = sorted(f.name for f in fields(LLTune))
    rows = []
    try:
        for var in args.tune.split(";"):
            tune = keep
            for kv in filter(None, var.split(",")):
                k, v = kv.split("=")
                if k not in names:
                    raise SystemExit(f"--tune {var!r}: {k!r} is not one of {names}")
                tune = replace(tune, **{k: int(v)})
            direct.tune = tune
            for _ in range(3):
                disp(), comb()
            torch.cuda.synchronize()
            g = _graph_time(buf, disp, comb, args)
            rows.append(dict(variant=var or "default", graph_dispatch_us=round(g[0] * 1e3, 1),
                             graph_combine_us=round(g[1] * 1e3, 1)))
    finally:
        direct.tune = keep
    return rows


def bench_impl(impl, ep, args):
    N, H, K, E = args.tokens, args.hidden, args.topk, args.experts
    x, ids, w = _inputs(N, H, K, E, ep.rank)
    buf = _buffer(impl, ep.pg, N, H, E)
    P, e = ep.size, E // ep.size
    state = {}

    def disp():
        state["h"] = buf.low_latency_dispatch(x, ids, N, E, use_fp8=True, async_finish=False,
                                              return_recv_hook=False)[2]

    y = torch.randn(e, P * N, H, device="cuda").to(torch.bfloat16)

    def comb():
        buf.low_latency_combine(y, ids, w, state["h"], async_finish=False, return_recv_hook=False)

    for _ in range(args.warmup):
        disp(), comb()
    torch.cuda.synchronize()
    dist.barrier()
    whole = _time(disp, comb, args.iters)
    if args.profile_host and impl == "ours":      # where a call's host time goes (rank 0 prints)
        import cProfile
        import io
        import pstats

        torch.cuda.synchronize()
        dist.barrier()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            disp(), comb()
        prof.disable()
        torch.cuda.synchronize()
        if ep.rank == 0:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
            print("host profile of 100 dispatch + combine pairs (ours):\n" + out.getvalue()[-4000:])
    graph = _graph_time(buf, disp, comb, args)
    extra = {}
    if impl == "ours" and args.phases:
        extra["phases"] = _phases(buf, disp, comb, args.phases)
    if impl == "ours" and args.tune:
        extra["tune"] = _tune(buf, disp, comb, args)
    buf.destroy()
    # remote bytes (this rank's sends)
    S = H // 128
    dst = torch.where(ids >= 0, ids // e, -1)
    hit = torch.stack([(dst == p).any(1) for p in range(P)], 1)            # [N, P]
    remote = hit.clone()
    remote[:, ep.rank] = False
    if impl == "deepep":
        pairs = int(((dst >= 0) & (dst != ep.rank)).sum())
        d_bytes = pairs * (H + 4 * S + 16)
        c_bytes = pairs * 2 * H
    else:
        all_ids = [torch.empty_like(ids) for _ in range(P)]
        dist.all_gather(all_ids, ids)
        recv_remote = sum(int(((a // e) == ep.rank).any(1).sum()) for r, a in enumerate(all_ids) if r != ep.rank)
        d_bytes = int(remote.sum()) * (H + 4 * S) + N * K * 8 * (P - 1) + e * 4 * (P - 1)
        c_bytes = N * K * 4 * (P - 1) + recv_remote * (4 if impl == "ours-fp32" else 2) * H
    if impl.startswith("ours") and impl != "ours-engine":
        from moe_wave.deepep_compat.ll_direct import num_programs
        sms = num_programs(ep.device, max(N, P * N, e))
    elif impl == "deepep":
        sms = torch.cuda.get_device_properties(ep.device).multi_processor_count
    else:
        sms = None
    return dict(extra, impl=impl, whole_dispatch_us=whole[0] * 1e3, whole_combine_us=whole[1] * 1e3,
                graph_dispatch_us=graph[0] * 1e3, graph_combine_us=graph[1] * 1e3, dispatch_remote_bytes=d_bytes,
                combine_remote_bytes=c_bytes, sms=sms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=288)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--impls", default="deepep,ours-engine,ours-jit,ours-fp32,ours",
                    help="ours (direct kernels), ours-fp32 (fp32 partial sums), ours-jit (every launch through "
                         "Triton's JIT), ours-engine (the exchange engine), deepep (real DeepEP, when importable)")
    ap.add_argument("--profile-host", action="store_true", help="cProfile 100 eager calls of ours (rank 0 prints)")
    ap.add_argument("--phases", type=int, default=0, metavar="N",
                    help="N calls of ours with the kernels' phase timestamps (median us from each kernel's start)")
    ap.add_argument("--tune", default="", help="variants of ours' launch knobs, e.g. 'warps=8;bh=4096,br=8192' "
                    "(LLTune fields; an empty variant is the default), timed from CUDA graphs")
    args = ap.parse_args()
    ep = init_ep()
    p2p = p2p_limit_GBps(ep)
    rows, skipped = [], []
    for impl in args.impls.split(","):
        if impl == "deepep":
            mod, why = _real_deep_ep()
            if mod is None:
                skipped.append(f"deepep: {why}")
                continue
        r = bench_impl(impl, ep, args)
        # every rank's figures: the slowest rank counts
        t = torch.tensor([r[k] for k in ("whole_dispatch_us", "whole_combine_us", "graph_dispatch_us",
                                         "graph_combine_us")], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        for k, v in zip(("whole_dispatch_us", "whole_combine_us", "graph_dispatch_us", "graph_combine_us"),
                        t.tolist()):
            r[k] = round(v, 1)
        for k in ("dispatch", "combine"):
            r[f"{k}_copy_limit_us"] = round(r[f"{k}_remote_bytes"] / (p2p * 1e3), 1) if p2p else None
        rows.append(r)
    if ep.rank == 0:
        hdr = ("impl", "whole disp", "whole comb", "whole sum", "graph disp", "graph comb", "disp bytes->us",
               "comb bytes->us", "SMs")
        lines = [f"# Low-latency mode, {ep.size} x {torch.cuda.get_device_name()}, {now()}", "",
                 f"git {git_sha()}; torch {torch.__version__}; P2P copy limit {p2p} GB/s; tokens {args.tokens}, "
                 f"hidden {args.hidden}, top-{args.topk}, {args.experts} experts; FP8 dispatch, bf16 combine; us, "
                 f"the slowest rank", "", "`torchrun --standalone --nproc-per-node=" + str(ep.size) +
                 " benchmarks/bench_ll.py " + " ".join(sys.argv[1:]) + "`", "",
                 "| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
        for r in rows:
            lines.append(f"| {r['impl']} | {r['whole_dispatch_us']} | {r['whole_combine_us']} | "
                         f"{round(r['whole_dispatch_us'] + r['whole_combine_us'], 1)} | {r['graph_dispatch_us']} | "
                         f"{r['graph_combine_us']} | {r['dispatch_remote_bytes'] / 1e6:.2f} MB -> "
                         f"{r['dispatch_copy_limit_us']} | {r['combine_remote_bytes'] / 1e6:.2f} MB -> "
                         f"{r['combine_copy_limit_us']} | {r['sms']} |")
        base = {r["impl"]: r for r in rows}
        if "ours" in base and "deepep" in base:
            o, d = base["ours"], base["deepep"]
            def ratio(k):
                return o[k] / d[k]

            whole = (o["whole_dispatch_us"] + o["whole_combine_us"]) / (d["whole_dispatch_us"] + d["whole_combine_us"])
            lines += ["", f"ours / DeepEP: whole dispatch {ratio('whole_dispatch_us'):.2f}, whole combine "
                      f"{ratio('whole_combine_us'):.2f}, whole sum {whole:.2f}; graph dispatch "
                      f"{ratio('graph_dispatch_us'):.2f}, graph combine {ratio('graph_combine_us'):.2f}"]
        if "ours" in base and base["ours"]["dispatch_copy_limit_us"]:
            o = base["ours"]
            lines += [f"ours / its bytes at the copy limit (graph): dispatch "
                      f"{o['graph_dispatch_us'] / o['dispatch_copy_limit_us']:.2f}, combine "
                      f"{o['graph_combine_us'] / o['combine_copy_limit_us']:.2f}"]
        for r in rows:
            if r.get("phases"):
                lines += ["", f"{r['impl']}, kernel phases (rank 0; median us from the kernel's start, {args.phases} "
                          "calls each alone after a barrier; waits include the peer's lateness):", ""]
                lines += [f"- {k}: {v}" for k, v in r["phases"].items()]
            if r.get("tune"):
                lines += ["", f"{r['impl']}, launch knobs (graph us, slowest rank not taken: rank 0):", "",
                          "| variant | graph disp | graph comb |", "|---|---|---|"]
                lines += [f"| {t['variant']} | {t['graph_dispatch_us']} | {t['graph_combine_us']} |" for t in r["tune"]]
        lines += [f"skipped: {s}" for s in skipped]
        report("\n".join(lines), "bench_ll.md")
        path = out_path("bench_ll.json")
        if path:
            Path(path).write_text(json.dumps(dict(p2p_GBps=p2p, args=vars(args), rows=rows, skipped=skipped,
                                                  git=git_sha()), indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Communication benchmark: torch (NCCL), symm and deepep (when installed), alone and beside a GEMM.

Legend: T tokens per rank, D hidden, K top-k, E experts, P ranks, B bytes per rank.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --standalone --nproc-per-node 2 launch/bench_comm.py [--quick] [--out comm.json]

Measures, in one run (ratios only mean something inside one run):
  * the P2P copy limit: a large copy into the next rank's GPU (copy engine), per direction;
  * all-to-all of B = 1 MB .. 1 GB per rank: NCCL ``all_to_all_single`` vs a copy-engine all-to-all
    through symmetric memory (layout "bytes"), closed by a barrier kernel ("symm") or by completion
    flags that the copy engines write after the data ("symm-flags", ``comm.symm_signal``);
  * the V4-Flash (D 4096, top-6 of 256) and V4-Pro (D 7168, top-6 of 384) dispatch and combine
    layouts at T = 128..8192, bf16, uniform random routing, one wave, for every backend;
  * the symm backend's variants (``GRAPH_VARIANTS``: data mode kernel or copy, sparse or dense blocks,
    closed by the barrier kernel or by stream memory operations) with prepare, dispatch, combine and
    the round trip each replayed from a CUDA graph (backend "symm-<variant>[g]");
  * combine writes a fresh fp32 output (``accumulate=False``: WaveMoE's first wave, and what DeepEP's
    combine does); ``combine_accumulate_us`` adds into an existing one (later waves);
  * each backend's dispatch+combine beside a ~300 us bf16 GEMM on the compute stream
    (hidden fraction = 1 - (beside - gemm) / alone, beside and GEMM-alone samples taken in turns and
    paired: the GEMM drifts by up to ~8 % over a run);
  * WaveMoE (V4-Flash shape) serial vs pipelined on each backend (symm: each of ``MOE_VARIANTS``).
CUDA events around BENCH_REPS (default 10) back-to-back calls, warm-up, medians over iterations,
random data, ranks aligned by a barrier before each sample. Writes ``{"meta": {...}, "rows": [...]}`` to --out (default $OUT/comm.json when OUT is set)
and prints a table last.
"""

from __future__ import annotations

import os

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v

import argparse  # noqa: E402
import datetime  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from moe_wave import MoEConfig, WaveConfig, WaveMoE  # noqa: E402
from moe_wave.comm import EPGroup  # noqa: E402
from moe_wave.comm.layout import WavePlan, compute_layout  # noqa: E402
from moe_wave.comm.symm import parse_variant  # noqa: E402
from moe_wave.moe import make_backend  # noqa: E402
from moe_wave.bench import as_graph  # noqa: E402
from moe_wave.comm import streams as st  # noqa: E402
from moe_wave.comm.symm_memops import MemopSignal  # noqa: E402
from moe_wave.comm.symm_signal import CopySignal  # noqa: E402

LAYOUTS = {"v4-flash": (4096, 256, 6), "v4-pro": (7168, 384, 6)}
CARVEOUT = int(os.environ.get("BENCH_GEMM_CARVEOUT", "16"))   # SMs the GEMM leaves free in the carveout rows
MB = 1 << 20
NO_GRAPH = False    # --no-graph
MEMOPS = False      # --memops
SECTIONS = ("bytes", "tokens", "graph", "moe")   # --sections (tune: with --tune, or named)


REPS = int(os.environ.get("BENCH_REPS", "10"))


def init_ep() -> EPGroup:
    """This torchrun rank's GPU (LOCAL_RANK) and an NCCL group over all ranks."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return EPGroup.from_process_group()


def _sample(fn, reps: int) -> float:
    """Microseconds per fn() call over ``reps`` back-to-back calls, ranks aligned by a barrier first."""
    torch.cuda.synchronize()
    dist.barrier()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / reps


def _slowest(*values: float) -> list:
    """Every rank reports the slowest rank's value of each (the collective finishes with the slowest)."""
    t = torch.tensor(values, device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def timed(fn, iters: int, warm: int = 3, reps: int | None = None) -> float:
    """Median microseconds per fn() call: CUDA events around ``reps`` back-to-back calls, ranks aligned by
    a barrier before each sample. Back to back, the ranks' launch skew after the barrier (tens of us)
    is paid once per sample, not once per call: the collectives synchronise the ranks at every call."""
    reps = reps or REPS
    for _ in range(warm):
        fn()
    return _slowest(statistics.median(_sample(fn, reps) for _ in range(iters)))[0]


def timed_pair(base, fn, iters: int, warm: int = 3, reps: int | None = None) -> tuple:
    """(base us, fn us, fn - base us): medians of samples taken in turns, base then fn, and of the paired
    differences. The GEMM alone drifts by up to ~8 % over a run (305-337 us on 2 x H200): each beside
    sample is compared with the GEMM sample taken just before it."""
    reps = reps or REPS
    for _ in range(warm):
        base()
        fn()
    pairs = [(_sample(base, reps), _sample(fn, reps)) for _ in range(iters)]
    a, b = zip(*pairs)
    return tuple(_slowest(statistics.median(a), statistics.median(b), statistics.median(y - x for x, y in pairs)))


def gemm_fn(n: int = 4096, k: int = 7168):
    """The ~300 us bf16 GEMM on cuBLASLt: torch's SM carve-out (``_set_sm_carveout_experimental``) only
    reaches cuBLASLt (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET), so every GEMM here, carved or not, uses it."""
    torch.backends.cuda.preferred_blas_library("cublaslt")
    a = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return lambda: torch.mm(a, b)


def beside(comm_fn, gemm) -> callable:
    """comm_fn on a side stream (its backend's streams behind it) while the GEMM runs on this one."""
    side = torch.cuda.Stream()

    def run():
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            comm_fn()
        gemm()
        cur.wait_stream(side)
    return run


# ------------------------------------------------------------------------------------ bytes layout
def _symm_alloc(ep: EPGroup, nbytes: int):
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=ep.device)
    hdl = symm_mem.rendezvous(buf, ep.pg.group_name)
    buf.zero_()
    return buf, hdl


def p2p_limit(ep: EPGroup, nbytes: int) -> float:
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=ep.device)
    hdl = symm_mem.rendezvous(buf, ep.pg.group_name)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=ep.device)
    peer = hdl.get_buffer((ep.rank + 1) % ep.size, [nbytes], torch.uint8, 0)
    us = timed(lambda: peer.copy_(src, non_blocking=True), 10)
    hdl.barrier(channel=0)
    return nbytes / us / 1e3


def bytes_rows(ep: EPGroup, sizes, iters: int, gemm, gemm_us: float, p2p: float) -> list:
    import torch.distributed._symmetric_memory as symm_mem

    rows, P = [], ep.size
    for nb in sizes:
        n = nb // 2 // P * P
        x = torch.randn(n, device=ep.device, dtype=torch.bfloat16)
        out = torch.empty_like(x)
        buf = symm_mem.empty(n, dtype=torch.bfloat16, device=ep.device)
        hdl = symm_mem.rendezvous(buf, ep.pg.group_name)
        chunk = n // P
        peers = [hdl.get_buffer(p, [P, chunk], torch.bfloat16, 0) for p in range(P)]
        xs = x.view(P, chunk)

        def nccl():
            dist.all_to_all_single(out, x, group=ep.pg)

        def symm():  # one stream: eager, a second one for the local block measured slower (host work)
            for p in range(P):
                peers[p][ep.rank].copy_(xs[p], non_blocking=True)
            hdl.barrier(channel=0)

        loc = torch.cuda.Stream()

        def symm2():  # for the graph: the local block on a second stream, beside the NVLink copies
            cur = torch.cuda.current_stream()
            loc.wait_stream(cur)
            with torch.cuda.stream(loc):
                peers[ep.rank][ep.rank].copy_(xs[ep.rank], non_blocking=True)
            for p in range(P):
                if p != ep.rank:
                    peers[p][ep.rank].copy_(xs[p], non_blocking=True)
            cur.wait_stream(loc)
            hdl.barrier(channel=0)

        def closed_by(sig):   # symm2 with sig.begin() / sig.end() around it instead of the barrier kernel
            def run():
                cur = torch.cuda.current_stream()
                sig.begin()
                loc.wait_stream(cur)
                with torch.cuda.stream(loc):
                    peers[ep.rank][ep.rank].copy_(xs[ep.rank], non_blocking=True)
                copies()
                sig.end()
                cur.wait_stream(loc)
            return run

        # completion flags written by the copy engines; a barrier of stream memory operations (no kernel,
        # no SM, and no timeout either)
        sig = CopySignal(ep, lambda nbytes: _symm_alloc(ep, nbytes), 120000)
        symm3 = closed_by(sig)
        mem = MemopSignal(ep, lambda nbytes: _symm_alloc(ep, nbytes)) if MEMOPS else None
        symm4 = closed_by(mem)

        def verify(name, fn):   # what arrived equals NCCL's all_to_all of the same input
            x.normal_()
            torch.cuda.synchronize()
            dist.barrier()
            buf.fill_(float("nan"))
            torch.cuda.synchronize()
            dist.barrier()
            fn()
            torch.cuda.synchronize()
            dist.barrier()
            nccl()
            torch.cuda.synchronize()
            if not torch.equal(buf, out):
                raise RuntimeError(f"bytes all-to-all {name} at {n * 2 / MB:.0f} MB: the received bytes differ from "
                                   f"NCCL's all_to_all_single of the same input")
            log(ep, f"{name} {n * 2 / MB:.0f} MB: received bytes equal NCCL's")

        def nolocal():     # symm2 without this rank's own block: is the local copy on the critical path?
            copies()
            hdl.barrier(channel=0)

        def smlocal():     # the local block by the SMs (an elementwise kernel) beside the NVLink copies
            cur = torch.cuda.current_stream()
            loc.wait_stream(cur)
            with torch.cuda.stream(loc):
                torch.mul(xs[ep.rank], 1, out=peers[ep.rank][ep.rank])
            copies()
            cur.wait_stream(loc)
            hdl.barrier(channel=0)

        def copies():      # where the fixed cost goes: the copies alone (no barrier), the barrier alone,
            for p in range(P):     # and one plain copy of the bytes that cross into the next rank
                if p != ep.rank:
                    peers[p][ep.rank].copy_(xs[p], non_blocking=True)

        nxt, src_n = peers[(ep.rank + 1) % P][ep.rank], xs[(ep.rank + 1) % P]
        half = chunk // 2
        other = torch.cuda.Stream()

        def copy2():    # the same bytes as two copies on two streams (two copy engines, if they help)
            cur = torch.cuda.current_stream()
            other.wait_stream(cur)
            with torch.cuda.stream(other):
                nxt[half:].copy_(src_n[half:], non_blocking=True)
            nxt[:half].copy_(src_n[:half], non_blocking=True)
            cur.wait_stream(other)

        cases = [("torch", False, nccl), ("symm", False, symm)]
        verify("symm", symm)
        if mem is not None:
            verify("symm-memops", symm4)
            cases.append(("symm-memops", False, symm4))
            if not NO_GRAPH:
                try:
                    g4 = as_graph(lambda i: symm4(), ep.device)[0]
                    verify("symm-memops[g]", lambda: g4(0))
                    cases.append(("symm-memops", True, g4))
                except RuntimeError as e:    # the driver may not capture stream memory operations
                    log(ep, f"symm-memops: no CUDA graph: {e}")
        if MEMOPS and len(SECTIONS) == 1:   # --memops --sections bytes: those rows and the graph baselines
            cases = [c for c in cases if c[0] == "symm-memops"] + [
                ("torch", True, as_graph(lambda i: nccl(), ep.device)[0]),
                ("symm", True, as_graph(lambda i: symm2(), ep.device)[0])]
        elif not NO_GRAPH:   # each replayed from a CUDA graph: no host work, the bandwidth itself
            cases += [("torch", True, as_graph(lambda i: nccl(), ep.device)[0]),
                      ("symm", True, as_graph(lambda i: symm2(), ep.device)[0]),
                      ("symm-flags", True, as_graph(lambda i: symm3(), ep.device)[0])]
            for name, f in (("p2p-copy", lambda i: nxt.copy_(src_n, non_blocking=True)),
                            ("p2p-copy2", lambda i: copy2()),
                            ("symm-copies", lambda i: copies()),
                            ("symm-barrier", lambda i: hdl.barrier(channel=0)),
                            ("symm-nolocal", lambda i: nolocal()), ("symm-smlocal", lambda i: smlocal())):
                t = timed(lambda g=as_graph(f, ep.device)[0]: g(0), iters)
                rows.append(dict(backend=name, graph=True, layout="bytes", diag=True, tokens_per_rank=0,
                                 bytes_per_rank=n * 2, alone_us=t, p2p_limit_GBps=p2p))
                hdl.barrier(channel=0)
        for name, graph, fn in cases:
            fn = (lambda f=fn: f(0)) if graph else fn
            alone = timed(fn, iters)
            rows.append(dict(backend=name, graph=graph, layout="bytes", tokens_per_rank=0, bytes_per_rank=n * 2,
                             dispatch_us=alone, combine_us=alone, p2p_limit_GBps=p2p, alone_us=alone,
                             algbw_GBps=n * 2 * (P - 1) / P / alone / 1e3,
                             **beside_gemm(fn, gemm, gemm_us, iters, carveout=None if graph else 0)))
        sig.check()
        del buf, hdl, peers, cases, sig, mem
        torch.cuda.synchronize()
    return rows


# ------------------------------------------------------------------------------------ token layouts
def token_case(ep: EPGroup, g, D: int, E: int, K: int, T: int):
    """Random bf16 tokens and uniform top-K routing of T tokens: (x, layout, rows sent, MoEConfig)."""
    x = torch.randn(T, D, device=ep.device, dtype=torch.bfloat16, generator=g)
    ids = torch.argsort(torch.rand(T, E, device=ep.device, generator=g), 1)[:, :K]
    w = torch.rand(T, K, device=ep.device, generator=g)
    plan = WavePlan.make(num_ranks=ep.size, num_local_experts=E // ep.size, num_waves=1)
    layout = compute_layout(ids, w, plan)
    sent = int(layout.send_counts_WP.sum())          # HOST SYNC: outside the timed region
    return x, layout, sent, MoEConfig(hidden_size=D, intermediate_size=256, num_experts=E, top_k=K)


def token_cases(ep: EPGroup, layouts, tokens, seed: int):
    """(layout name, D, T, x, layout, rows sent, MoEConfig) for every layout and token count, one generator."""
    g = torch.Generator(device=ep.device).manual_seed(seed + ep.rank)
    for lname in layouts:
        D, E, K = LAYOUTS[lname]
        for T in tokens:
            yield (lname, D, T) + token_case(ep, g, D, E, K, T)


def token_rows(ep: EPGroup, backends, layouts, tokens, iters: int, gemm, gemm_us: float, p2p: float) -> list:
    rows = []
    for lname, D, T, x, layout, sent, cfg in token_cases(ep, layouts, tokens, 0):
        for bname in backends:
            log(ep, f"{bname} {lname} T={T}")
            streams = st.Streams.for_device(ep.device)
            be = make_backend(bname, ep, streams, cfg, WaveConfig(backend=bname, max_tokens_per_rank=T))
            xplan = be.prepare(layout)
            got = be.dispatch(x, xplan, 0).wait()
            y = torch.randn_like(got.x_RD)
            out = torch.zeros(T, D, device=ep.device)
            prep = timed(lambda: be.prepare(layout), iters)
            disp = timed(lambda: be.dispatch(x, xplan, 0).wait(), iters)
            comb_acc = timed(lambda: be.combine(y, got.handle, out).wait(), iters)
            comb = timed(lambda: be.combine(y, got.handle, out, accumulate=False).wait(), iters)

            def round_trip():   # as WaveMoE runs one wave: the combine writes a fresh output
                r = be.dispatch(x, xplan, 0).wait()
                be.combine(y, r.handle, out, accumulate=False).wait()   # the plan is fixed: same shapes
            alone = timed(round_trip, iters)
            rows.append(dict(backend=bname, layout=lname, tokens_per_rank=T, bytes_per_rank=sent * D * 2,
                             prepare_us=prep, dispatch_us=disp, combine_us=comb,
                             combine_accumulate_us=comb_acc, p2p_limit_GBps=p2p,
                             alone_us=alone, dispatch_GBps=sent * D * 2 / disp / 1e3,
                             **beside_gemm(round_trip, gemm, gemm_us, iters, carveout=0)))
            if hasattr(be, "check"):
                be.check()
            del be, xplan, got
            save(ep, rows)
    return rows


def graph_replays(ep: EPGroup, be, x, layout) -> dict:
    """prepare, dispatch, combine (accumulating and fresh) and the round trip, each captured in a CUDA
    graph: {name: replay function}. The dispatches leave this rank's own rows in x where the backend can
    (``local_view``, as WaveMoE dispatches: dense blocks copy no local rows)."""
    T, D = x.shape
    out = torch.zeros(T, D, device=ep.device)
    # A captured graph's outputs hold nothing until it is replayed: replay each one before the next
    # capture's eager warm-up reads them (the plan's tables, the received metadata).
    prep, xplan = as_graph(lambda i: be.prepare(layout), ep.device)
    prep(0)
    disp, got = as_graph(lambda i: be.dispatch(x, xplan, 0, local_view=True).wait(), ep.device)
    disp(0)
    y = torch.randn_like(got.x_RD)
    comb, _ = as_graph(lambda i: be.combine(y, got.handle, out).wait(), ep.device)
    fresh, _ = as_graph(lambda i: be.combine(y, got.handle, out, accumulate=False).wait(), ep.device)

    def trip(i):   # as WaveMoE runs one wave: the combine writes a fresh output
        r = be.dispatch(x, xplan, 0, local_view=True).wait()
        be.combine(y, r.handle, out, accumulate=False).wait()
    rt, _ = as_graph(trip, ep.device)

    def transfer(i):   # the round trip's exchanges alone: the sum is left to the consumer (reduce=False)
        r = be.dispatch(x, xplan, 0, local_view=True).wait()
        return be.combine(y, r.handle, out, accumulate=False, reduce=False).wait()
    tr, total = as_graph(transfer, ep.device)
    tr(0)
    sm, _ = as_graph(lambda i: total(), ep.device)    # that sum alone (the combine's gather_add)
    return dict(prepare=prep, dispatch=disp, combine_accumulate=comb, combine=fresh, round_trip=rt, transfer=tr,
                sum=sm)


def graph_case(ep: EPGroup, be, x, layout, iters: int):
    """prepare, dispatch, combine, the round trip, its exchanges alone (``transfer``: the combine's sum left
    to the consumer) and that sum alone, each replayed from a CUDA graph: (timings, round trip, transfer)."""
    g = graph_replays(ep, be, x, layout)
    t = {n: timed(lambda f=f: f(0), iters) for n, f in g.items()}
    be.check()
    return (dict(prepare_us=t["prepare"], dispatch_us=t["dispatch"], combine_us=t["combine"],
                 combine_accumulate_us=t["combine_accumulate"], alone_us=t["round_trip"],
                 transfer_us=t["transfer"], sum_us=t["sum"]),
            (lambda: g["round_trip"](0)), (lambda: g["transfer"](0)))


def beside_gemm(rt, gemm, gemm_us: float, iters: int, carveout: int | None = None, also: dict | None = None) -> dict:
    """rt beside the GEMM (and each of ``also``: ``beside_gemm_<name>_us``), then beside the GEMM with
    ``carveout`` (default CARVEOUT) SMs left free (as DeepEP reserves SMs for its own kernels), where torch
    can carve them out. Beside the whole GEMM, samples alternate with the GEMM alone (``timed_pair``:
    ``exposed_us`` is the median of the paired differences, ``gemm_row_us`` the GEMM's median); the
    carved GEMM alone is timed too, and the carved rows still count against the whole GEMM: the
    carve-out's own cost is not forgiven."""
    carveout = CARVEOUT if carveout is None else carveout
    g, b, d = timed_pair(gemm, beside(rt, gemm), iters)
    row = dict(gemm_row_us=g, beside_gemm_us=b, exposed_us=d, gemm_us=gemm_us)
    for name, fn in (also or {}).items():     # before any carve-out: once lifted, the GEMM seemed slower
        _, row[f"beside_gemm_{name}_us"], row[f"exposed_{name}_us"] = timed_pair(gemm, beside(fn, gemm), iters)
    if carveout and hasattr(torch._C, "_set_sm_carveout_experimental"):
        torch._C._set_sm_carveout_experimental(carveout)
        try:
            row.update(carveout_sms=carveout, gemm_carveout_us=timed(gemm, iters),
                       beside_gemm_carveout_us=timed(beside(rt, gemm), iters))
        finally:
            torch._C._set_sm_carveout_experimental(None)
        # the GEMM once the carve-out is lifted: in the run of git 5506822 it seemed to stay slower (~350 vs
        # 306 us), so every row times what it compares beside the whole GEMM before its carve-out
        row["gemm_after_carveout_us"] = timed(gemm, iters)
    return row


# symm variants: data mode, then "+sparse" / "+dense" (blocks; neither: the backend's choice by the fill)
# and "+flags" / "+memops" (the signal that closes an exchange; neither: the barrier kernel)
GRAPH_VARIANTS = ("kernel", "copy+sparse", "copy+dense", "kernel+memops", "copy+dense+memops")


def variant(be, name: str) -> None:
    """Set a symm backend's data mode, blocks and signal from a variant name (before its first call)."""
    be.mode, be.dense, be.signal = parse_variant(name)


def graph_rows(ep: EPGroup, layouts, tokens, iters: int, gemm, gemm_us: float, p2p: float) -> list:
    """The symm backend as it is meant to run: prepare, dispatch, combine and the round trip each
    captured in a CUDA graph and replayed (no host work at all), in both data modes."""
    rows = []
    for lname, D, T, x, layout, sent, cfg in token_cases(ep, layouts, tokens, 100):
        for mode in GRAPH_VARIANTS:
            log(ep, f"graph symm-{mode} {lname} T={T}")
            streams = st.Streams.for_device(ep.device)
            be = make_backend("symm", ep, streams, cfg, WaveConfig(backend="symm", max_tokens_per_rank=T))
            variant(be, mode)
            t, rt, tr = graph_case(ep, be, x, layout, iters)
            rows.append(dict(backend=f"symm-{mode}", graph=True, layout=lname, tokens_per_rank=T,
                             bytes_per_rank=sent * D * 2, **t, p2p_limit_GBps=p2p,
                             dispatch_GBps=sent * D * 2 / t["dispatch_us"] / 1e3,
                             **beside_gemm(rt, gemm, gemm_us, iters, also={"transfer": tr})))
            del be, rt, tr
            torch.cuda.synchronize()
            save(ep, rows)
    return rows


# (symm variant, step elements, warps, rows in flight per program, grid cap, SMs carved out of the GEMM
# beside it: None = not beside the GEMM, 0 = beside the whole GEMM); grid 0 is the full grid (one program
# a tile). Variants as in GRAPH_VARIANTS.
TUNE = (("kernel", 2048, 4, 1, 0, None), ("kernel", 4096, 8, 1, 0, None), ("kernel", 4096, 16, 1, 0, None),
        ("kernel", 2048, 8, 4, 0, None), ("kernel", 2048, 4, 1, 0, 32), ("kernel", 4096, 16, 16, 32, 32),
        ("kernel", 2048, 4, 1, 0, 0), ("copy+sparse", 2048, 4, 1, 0, 0),
        ("copy+sparse", 2048, 4, 1, 0, 16), ("copy+sparse", 2048, 4, 1, 0, 24),
        ("copy+sparse+flags", 2048, 4, 1, 0, 16), ("copy+sparse+memops", 2048, 4, 1, 0, 24),
        ("kernel+memops", 2048, 4, 1, 0, 0), ("kernel+memops", 2048, 4, 1, 0, 32),
        ("copy+dense", 2048, 4, 1, 0, 0), ("copy+dense", 2048, 4, 1, 0, 8), ("copy+dense", 2048, 4, 1, 0, 16),
        ("copy+dense+memops", 2048, 4, 1, 0, 0), ("copy+dense+memops", 2048, 4, 1, 0, 8),
        ("copy+dense+memops", 2048, 4, 1, 0, 16), ("copy+dense+memops", 2048, 4, 1, 0, 24),
        ("copy+dense+memops", 2048, 4, 1, 0, 32))


def tune_rows(ep: EPGroup, iters: int, p2p: float, gemm, gemm_us: float) -> list:
    """scatter_rows / gather_add step, warps, rows in flight and grid cap (symm, V4-Flash, 4096 tokens,
    CUDA graphs, both data modes); beside the GEMM with the given SMs carved out. ``hidden_vs_best``
    counts the exposed time against the fastest round trip alone (the first row), so a slower capped
    copy that hides well is not flattered."""
    from moe_wave.comm import symm_kernels as sk

    rows, (D, E, K), T = [], LAYOUTS["v4-flash"], 4096
    g = torch.Generator(device=ep.device).manual_seed(200 + ep.rank)
    x, layout, sent, cfg = token_case(ep, g, D, E, K, T)
    keep = sk.COPY_BLOCK, sk.COPY_WARPS, sk.COPY_ROWS, sk.COPY_GRID
    best = None
    try:
        for mode, block, warps, nrows, grid, carve in TUNE:
            sk.COPY_BLOCK, sk.COPY_WARPS, sk.COPY_ROWS, sk.COPY_GRID = block, warps, nrows, grid
            log(ep, f"tune {mode} block {block} warps {warps} rows {nrows} grid {grid} carve {carve}")
            be = make_backend("symm", ep, st.Streams.for_device(ep.device), cfg,
                              WaveConfig(backend="symm", max_tokens_per_rank=T))
            variant(be, mode)
            t, rt, _ = graph_case(ep, be, x, layout, iters)
            best = min(best or t["alone_us"], t["alone_us"])
            row = dict(backend=f"symm-{mode}-tune", graph=True, layout="v4-flash", tokens_per_rank=T,
                       copy_block=block, copy_warps=warps, copy_rows=nrows, copy_grid=grid,
                       bytes_per_rank=sent * D * 2, **t, p2p_limit_GBps=p2p,
                       dispatch_GBps=sent * D * 2 / t["dispatch_us"] / 1e3)
            if carve is not None:
                row.update(beside_gemm(rt, gemm, gemm_us, iters, carveout=carve))
                row["hidden_vs_best"] = 1 - (row.get("beside_gemm_carveout_us", row["beside_gemm_us"]) - gemm_us) / best
            rows.append(row)
            del be, rt
            save(ep, rows)
    finally:
        sk.COPY_BLOCK, sk.COPY_WARPS, sk.COPY_ROWS, sk.COPY_GRID = keep
    return rows


MOE_VARIANTS = ("kernel", "copy", "copy+memops", "kernel+memops")   # "copy": blocks by the fill (2 waves, 2 ranks: dense)


def moe_rows(ep: EPGroup, backends, T: int, iters: int) -> list:
    rows = []
    cfg = MoEConfig.preset("v4-flash")
    names = [b for b in backends if b != "symm"] + ([f"symm-{v}" for v in MOE_VARIANTS] if "symm" in backends else [])
    for name in names:
        bname = name.split("-")[0]
        log(ep, f"moe {name} T={T}")
        m = WaveMoE(cfg, ep=ep, wave=WaveConfig(num_waves=2, backend=bname, max_tokens_per_rank=T),
                    device=ep.device, dtype=torch.bfloat16)
        if bname == "symm":
            variant(m.backend, name.split("-", 1)[1])
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.02)
        x = torch.randn(T, cfg.hidden_size, device=ep.device, dtype=torch.bfloat16)
        serial = timed(lambda: m(x, overlap=False), iters)
        piped = timed(lambda: m(x, overlap=True), iters)
        rows.append(dict(backend=name, layout="moe:v4-flash", tokens_per_rank=T, num_waves=2, serial_us=serial,
                         pipelined_us=piped))
        del m
        torch.cuda.empty_cache()
    return rows


_SAVE = {}


def log(ep: EPGroup, msg: str) -> None:
    if ep.rank == 0:
        print(f"[bench_comm] {msg}", flush=True)


def save(ep: EPGroup, rows) -> None:
    """Write what is measured so far (rank 0), so a run cut short still leaves its rows."""
    if ep.rank == 0 and _SAVE.get("out"):
        with open(_SAVE["out"], "w") as f:
            json.dump({"meta": _SAVE["meta"], "rows": _SAVE["done"] + list(rows)}, f, indent=1)


def meta(ep: EPGroup) -> dict:
    from moe_wave.sweep import git_sha

    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                git_sha=git_sha(),
                gpus=f"{ep.size} x {torch.cuda.get_device_name(ep.device)}", torch=torch.__version__,
                nccl=".".join(map(str, torch.cuda.nccl.version())), world_size=ep.size)


def table(rows) -> str:
    lines = [f"{'backend':15} {'layout':14} {'T':>5} {'MB/rank':>8} {'disp_us':>8} {'comb_us':>8} {'alone':>8} "
             f"{'beside':>8} {'gemm':>7} {'hidden':>6} {'serial':>8} {'piped':>8}"]
    extra = []
    for r in rows:
        g_us = r.get("gemm_row_us", r.get("gemm_us", 0))     # the GEMM timed in the same row where it was
        exp = r.get("exposed_us", r.get("beside_gemm_us", 0) - g_us)      # paired differences where measured
        hid = (1 - exp / r["alone_us"]) if "beside_gemm_us" in r else None
        if "algbw_GBps" in r:
            extra.append(f"{r['backend']}{'[g]' if r.get('graph') else ''} bytes {r['bytes_per_rank'] / MB:.0f} MB: "
                         f"{r['algbw_GBps']:.0f} GB/s across, {100 * r['algbw_GBps'] / r['p2p_limit_GBps']:.0f}% of P2P")
        if r.get("diag"):
            extra.append(f"{r['backend']}[g] bytes {r['bytes_per_rank'] / MB:.0f} MB: {r['alone_us']:.1f} us")
            continue
        if "beside_gemm_carveout_us" in r:
            hc = 1 - (r["beside_gemm_carveout_us"] - g_us) / r["alone_us"]
            tag = f"/{r.get('copy_rows', 1)}x{r['copy_grid']}" if r.get("copy_grid") else ""
            vs = f", vs the best alone {r['hidden_vs_best']:.2f}" if "hidden_vs_best" in r else ""
            extra.append(f"{r['backend']}[g]{tag} {r['layout']} T={r['tokens_per_rank']} "
                         f"(alone {r['alone_us']:.0f} us): GEMM with {r['carveout_sms']} SMs carved out "
                         f"{r['gemm_carveout_us']:.0f} us (whole {r['gemm_us']:.0f}), beside "
                         f"{r['beside_gemm_carveout_us']:.0f} us, hidden {hc:.2f}{vs}")
        if "beside_gemm_transfer_us" in r:
            ht = 1 - r.get("exposed_transfer_us", r["beside_gemm_transfer_us"] - g_us) / r["transfer_us"]
            extra.append(f"{r['backend']}[g] {r['layout']} T={r['tokens_per_rank']}: exchanges alone (the sum left "
                         f"to the consumer) {r['transfer_us']:.0f} us, beside the GEMM {r['beside_gemm_transfer_us']:.0f} "
                         f"us, hidden {ht:.2f}; the sum alone {r['sum_us']:.0f} us")
        f = lambda k: f"{r[k]:8.1f}" if k in r else f"{'':8}"  # noqa: E731
        name = r["backend"] + ("[g]" if r.get("graph") else "") + (
            f"/{r.get('copy_rows', 1)}x{r['copy_grid']}" if r.get("copy_grid") else "")
        lines.append(f"{name:15} {r['layout']:14} {r['tokens_per_rank']:5d} "
                     f"{r.get('bytes_per_rank', 0) / MB:8.1f} {f('dispatch_us')} {f('combine_us')} {f('alone_us')} "
                     f"{f('beside_gemm_us')} {g_us:7.1f} "
                     f"{'' if hid is None else f'{hid:6.2f}':>6} {f('serial_us')} {f('pipelined_us')}")
    return "\n".join(lines + extra)


def main() -> None:
    global NO_GRAPH, MEMOPS, SECTIONS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="few sizes and iterations (about a minute)")
    ap.add_argument("--out", default=os.path.join(os.environ["OUT"], "comm.json") if os.environ.get("OUT") else None)
    ap.add_argument("--backends", default="torch,symm,deepep", help="comma list; deepep is skipped when absent")
    ap.add_argument("--no-graph", action="store_true", help="skip the rows replayed from CUDA graphs")
    ap.add_argument("--tune", action="store_true", help="also sweep scatter_rows' step size and warps")
    ap.add_argument("--iters", type=int, default=0, help="timed iterations per point (default 20, quick 8)")
    ap.add_argument("--memops", action="store_true",
                    help="also the bytes all-to-all closed by stream memory operations (comm.symm_memops with "
                         "acknowledgements, as a bare exchange: no watchdog here)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help="comma list of bytes,tokens,graph,tune,moe (--tune adds tune); --memops --sections bytes "
                         "keeps the memops rows and the graph baselines only")
    args = ap.parse_args()
    NO_GRAPH, MEMOPS = args.no_graph, args.memops
    SECTIONS = tuple(x for x in args.sections.split(",") if x)
    bad = [x for x in SECTIONS if x not in ("bytes", "tokens", "graph", "tune", "moe")]
    if bad:
        ap.error(f"--sections {args.sections}: unknown {bad}; choose from bytes,tokens,graph,tune,moe")
    import faulthandler

    faulthandler.dump_traceback_later(int(os.environ.get("BENCH_HANG_S", "600")), exit=True)
    ep = init_ep()
    backends = [b for b in args.backends.split(",") if b != "deepep" or importlib.util.find_spec("deep_ep")]
    iters = args.iters or (8 if args.quick else 20)
    sizes = [1 * MB, 16 * MB, 64 * MB] if args.quick else [1 * MB, 16 * MB, 64 * MB, 256 * MB, 1024 * MB]
    tokens = [128, 4096] if args.quick else [128, 512, 2048, 4096, 8192]
    _SAVE.update(out=args.out, meta=meta(ep), done=[])
    gemm = gemm_fn()
    gemm_us = timed(gemm, iters)
    p2p = p2p_limit(ep, (256 if args.quick else 1024) * MB)
    log(ep, f"P2P {p2p:.0f} GB/s, GEMM {gemm_us:.0f} us")
    rows = []
    if "bytes" in SECTIONS:
        _SAVE["done"] = rows = bytes_rows(ep, sizes, iters, gemm, gemm_us, p2p)
        save(ep, [])
    if "tokens" in SECTIONS:
        _SAVE["done"] = rows = rows + token_rows(ep, backends, list(LAYOUTS), tokens, iters, gemm, gemm_us, p2p)
    if "graph" in SECTIONS and not args.no_graph and "symm" in backends:
        _SAVE["done"] = rows = rows + graph_rows(ep, list(LAYOUTS), tokens, iters, gemm, gemm_us, p2p)
    if (args.tune or "tune" in SECTIONS) and "symm" in backends:
        _SAVE["done"] = rows = rows + tune_rows(ep, iters, p2p, gemm, gemm_us)
    if "moe" in SECTIONS:
        _SAVE["done"] = rows = rows + moe_rows(ep, backends, 512 if args.quick else 4096, max(3, iters // 2))
    save(ep, [])
    gemm_end = timed(gemm, iters)      # the baseline every hidden fraction uses, once more: did it drift?
    if ep.rank == 0:
        print(f"P2P copy limit {p2p:.0f} GB/s per direction; GEMM 4096x7168x4096 {gemm_us:.0f} us "
              f"({gemm_end:.0f} us at the end of the run)")
        print(table(rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

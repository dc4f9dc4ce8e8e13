"""Section "graph": the symm backend as it is meant to run, every call replayed from a CUDA graph.

Legend: T tokens per rank, D hidden.

For each variant (``GRAPH_VARIANTS``: data mode kernel or copy, sparse or dense blocks, closed by the
barrier kernel or by stream memory operations): prepare, dispatch, combine (fresh and accumulating), the
round trip, its exchanges alone (``transfer``: ``combine_deferred``, the sum left to the consumer) and that
sum alone, each captured in its own CUDA graph; then the round trip and the transfer beside the GEMM.
"""

from __future__ import annotations

import torch

from moe_wave.comm.backend import CombineOut
from moe_wave.comm.options import SymmOptions
from moe_wave.timing import as_graph

from .common import LAYOUTS, Run, backend, beside_gemm, token_cases

__all__ = ["GRAPH_VARIANTS", "graph_replays", "graph_case", "graph_rows"]

# symm variants (SymmOptions.variant): data mode, then "+sparse" / "+dense" (blocks; neither: the backend's
# choice by the fill) and "+flags" / "+memops" (the signal that closes an exchange; neither: the barrier kernel)
GRAPH_VARIANTS = ("kernel", "copy+sparse", "copy+dense", "kernel+memops", "copy+dense+memops")


def graph_replays(be, x, layout) -> dict:
    """prepare, dispatch, combine (accumulating and fresh), the round trip, its exchanges alone and their
    sum, each captured in a CUDA graph: {name: replay function}. The dispatches leave this rank's own rows in
    x where the backend can (``local_view``, as WaveMoE dispatches: dense blocks copy no local rows)."""
    T, D = x.shape
    dev = x.device
    out = torch.zeros(T, D, device=dev)
    acc, fresh = CombineOut(out), CombineOut(out, accumulate=False)
    # A captured graph's outputs hold nothing until it is replayed: replay each one before the next
    # capture's eager warm-up reads them (the plan's tables, the received metadata).
    prep, xplan = as_graph(lambda i: be.prepare(layout), dev)
    prep(0)
    disp, got = as_graph(lambda i: be.dispatch(x, xplan, 0, local_view=True).wait(), dev)
    disp(0)
    y = torch.randn_like(got.x_RD)
    comb, _ = as_graph(lambda i: be.combine(y, got.handle, acc).wait(), dev)
    comb_fresh, _ = as_graph(lambda i: be.combine(y, got.handle, fresh).wait(), dev)

    def trip(i):   # as WaveMoE runs one wave: the combine writes a fresh output
        r = be.dispatch(x, xplan, 0, local_view=True).wait()
        be.combine(y, r.handle, fresh).wait()
    rt, _ = as_graph(trip, dev)

    def transfer(i):   # the round trip's exchanges alone: the sum is returned, not run
        r = be.dispatch(x, xplan, 0, local_view=True).wait()
        return be.combine_deferred(y, r.handle, fresh).wait()
    tr, total = as_graph(transfer, dev)
    tr(0)
    sm, _ = as_graph(lambda i: total(), dev)    # that sum alone (the combine's gather_add)
    return dict(prepare=prep, dispatch=disp, combine_accumulate=comb, combine=comb_fresh, round_trip=rt,
                transfer=tr, sum=sm)


def graph_case(run: Run, be, x, layout):
    """Each of ``graph_replays`` timed: (timings, round trip, transfer) (the last two: functions of no
    arguments, for the GEMM beside them)."""
    g = graph_replays(be, x, layout)
    t = {n: run.timed(lambda f=f: f(0)) for n, f in g.items()}
    be.check()
    return (dict(prepare_us=t["prepare"], dispatch_us=t["dispatch"], combine_us=t["combine"],
                 combine_accumulate_us=t["combine_accumulate"], alone_us=t["round_trip"],
                 transfer_us=t["transfer"], sum_us=t["sum"]),
            (lambda: g["round_trip"](0)), (lambda: g["transfer"](0)))


def graph_rows(run: Run) -> list:
    rows = []
    for lname, D, T, x, layout, sent, cfg in token_cases(run.ep, list(LAYOUTS), run.s.tokens, 100):
        for name in GRAPH_VARIANTS:
            run.log(f"graph symm-{name} {lname} T={T}")
            be = backend(run.ep, "symm", cfg, SymmOptions.variant(name, capacity=T))
            t, rt, tr = graph_case(run, be, x, layout)
            rows.append(dict(backend=f"symm-{name}", graph=True, layout=lname, tokens_per_rank=T,
                             bytes_per_rank=sent * D * 2, **t, p2p_limit_GBps=run.p2p,
                             dispatch_GBps=sent * D * 2 / t["dispatch_us"] / 1e3,
                             **beside_gemm(run, rt, also={"transfer": tr})))
            del be, rt, tr
            torch.cuda.synchronize()     # the graphs' buffers are freed before the next variant allocates
            run.save(rows)
    return rows

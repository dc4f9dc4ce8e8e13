"""Timing probes of one MoE layer's parts: the exchanges alone and the expert compute alone.

Legend: T local tokens, D hidden, K top-k, W waves, R received rows.

A probe takes what the wave pipeline takes, a comm backend, an expert function and a wave plan, and
runs one part of the pipeline without the other:

    comm_only      layout, count exchange, every wave's dispatch and combine in pipeline order, the
                   experts replaced by an identity that returns the received rows
    pre_receive    every wave's received rows, copied out of the backend's buffers
    routed_only    the expert function on pre-received rows (no communication)
    probe_times    the medians of the three above at several wave plans, slowest rank

``moe_wave.autowave`` fits its cost model on ``probe_times``; the benchmark tools time the same
functions. Every rank of the backend's group must call them together.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Callable

import torch

from moe_wave.comm import streams as st
from moe_wave.comm.backend import CommBackend, Received
from moe_wave.comm.layout import WavePlan, compute_layout

from .pipeline import fork_turns, join_turns, run_waves
from .profiling import annotate
from .timing import iteration_us, slowest

__all__ = ["comm_only", "pre_receive", "routed_only", "probe_times", "ProbeTimes"]

ExpertFn = Callable[[Received], torch.Tensor]


def _identity(got: Received) -> torch.Tensor:
    return got.x_RD


def comm_only(backend: CommBackend, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor,
              plan: WavePlan, combine_width: int | None = None) -> torch.Tensor:
    """Layout, count exchange, every wave's dispatch and combine; no expert compute. Returns the fp32
    sum of the received rows sent back (x times the routing weights). ``combine_width``: x's rows are packed
    (``WaveMoE.wire``): the rows sent back are that wide, as allocated (no compute), and the sum means nothing."""
    with annotate("layout"):
        layout = compute_layout(ids_TK, w_TK, plan)
    with annotate("prepare"):
        xplan = backend.prepare(layout)
    back = _identity if combine_width is None else (
        lambda got: got.x_RD.new_empty(got.x_RD.shape[0], combine_width))
    out_TD = torch.zeros(x_TD.shape[0], combine_width or x_TD.shape[1], dtype=torch.float32, device=x_TD.device)
    return run_waves(x_TD, xplan, backend, back, out_TD, overlap=True, combine_width=combine_width)


def pre_receive(backend: CommBackend, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor,
                plan: WavePlan, combine_width: int | None = None) -> list[Received]:
    """Every wave's received rows, copied: fixed-buffer backends reuse their receive buffers. ``combine_width``:
    as ``comm_only``'s (the buffers then sized for packed rows out, rows of that width back)."""
    xplan = backend.prepare(compute_layout(ids_TK, w_TK, plan))
    got = []
    for w in range(xplan.num_waves):
        r = backend.dispatch(x_TD, xplan, w, combine_width=combine_width).wait()
        got.append(dataclasses.replace(r, x_RD=r.x_RD.clone(), expert_RK=r.expert_RK.clone(),
                                       weight_RK=r.weight_RK.clone()))
    return got


def routed_only(expert_fn: ExpertFn, received: list[Received], expert_streams: tuple = ()) -> None:
    """``expert_fn`` on every wave's received rows, in wave order; no communication. ``expert_streams``: more
    streams the waves take turns on, as the pipeline's (``WaveConfig.expert_streams``): wave w on the caller's
    stream or on ``expert_streams[w % n - 1]``, joined at the end."""
    if not received:
        return
    dev = received[0].x_RD.device
    turns = fork_turns(dev, expert_streams if len(received) > 1 else ())
    for w, got in enumerate(received):
        with st.on(turns[w % len(turns)]), annotate(f"wave{w}.experts"):
            expert_fn(got)
    join_turns(dev, turns)


@dataclass(frozen=True)
class ProbeTimes:
    """Medians in microseconds, slowest rank.

    Attributes:
        fixed_us: layout + count exchange (``backend.prepare``), which no wave count changes.
        comm_us: W -> ``comm_only`` (fixed_us included).
        compute_us: W -> ``routed_only``.
    """

    fixed_us: float
    comm_us: dict[int, float]
    compute_us: dict[int, float]


@torch.no_grad()
def probe_times(backend: CommBackend, expert_fn: ExpertFn, x_TD: torch.Tensor, ids_TK: torch.Tensor,
                w_TK: torch.Tensor, plans: list[WavePlan], *, ep, iters: int = 5, warmup: int = 1,
                combine_width: int | None = None) -> ProbeTimes:
    """Time the probes on this batch at every plan of ``plans`` (the first one also times ``prepare``).

    ``ep`` is the backend's ``EPGroup``: every rank calls together, the ranks are aligned before each
    iteration and each median is the slowest rank's. x_TD: the rows as dispatched (``WaveMoE.wire``), with
    ``combine_width`` where they are packed."""
    def med(fn) -> float:
        return statistics.median(iteration_us(lambda i: fn(), iters, warmup, ep=ep, device=x_TD.device))

    fixed = med(lambda: backend.prepare(compute_layout(ids_TK, w_TK, plans[0])))
    comm = [med(lambda p=p: comm_only(backend, x_TD, ids_TK, w_TK, p, combine_width)) for p in plans]
    got = [pre_receive(backend, x_TD, ids_TK, w_TK, p, combine_width) for p in plans]
    comp = [med(lambda g=g: routed_only(expert_fn, g)) for g in got]
    agg = slowest(ep, [fixed, *comm, *comp])
    n = len(plans)
    waves = [p.num_waves for p in plans]
    return ProbeTimes(fixed_us=agg[0], comm_us=dict(zip(waves, agg[1:1 + n])), compute_us=dict(zip(waves, agg[1 + n:])))

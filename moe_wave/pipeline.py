"""The wave pipeline: dispatch, expert compute and combine, overlapped across waves.

Legend: T local tokens, D hidden, W waves, R received rows.

Issue order (one host thread; GPU work lands on three streams):

    comm stream:    dispatch(0) dispatch(1) combine(0) dispatch(2) combine(1) ... combine(W-1)
    compute stream:             experts(0)   experts(1)            experts(2) ...
    alt stream:     shared expert pieces (``hooks``), tail released just before combine(W-1)

dispatch(w+1) is always issued before combine(w), so the next wave's tokens travel while this
wave computes, and the finished wave's results travel while the next one computes. With
``overlap=False`` the very same operations run strictly one after another: the ``serial``
baseline of every benchmark. Compute stages never communicate.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from moe_wave.comm.backend import CommBackend, ExchangePlan, Received

from .profiling import annotate

__all__ = ["run_waves", "PipelineHooks"]


class PipelineHooks(Protocol):
    def before_last_combine(self) -> None: ...


def run_waves(x_TD: torch.Tensor, plan: ExchangePlan, backend: CommBackend,
              expert_fn: Callable[[Received], torch.Tensor], out_TD: torch.Tensor, *,
              overlap: bool = True, hooks: PipelineHooks | None = None, fresh: bool = False) -> torch.Tensor:
    """Run every wave; ``out_TD`` (fp32) receives sum_k w_k * expert_k(x) per token: added to what it
    holds, or, with ``fresh``, written over it (wave 0 combines with accumulate=False, so out_TD may
    come from ``torch.empty``)."""
    W = plan.num_waves
    if not overlap:
        for w in range(W):
            with annotate(f"wave{w}.dispatch"):
                got = backend.dispatch(x_TD, plan, w).wait()
            with annotate(f"wave{w}.experts"):
                y_RD = expert_fn(got)
            if w == W - 1 and hooks is not None:
                hooks.before_last_combine()
            with annotate(f"wave{w}.combine"):
                backend.combine(y_RD, got.handle, out_TD, accumulate=w > 0 or not fresh).wait()
        return out_TD

    with annotate("wave0.dispatch"):
        dispatches = {0: backend.dispatch(x_TD, plan, 0)}
    if W > 1:
        with annotate("wave1.dispatch"):
            dispatches[1] = backend.dispatch(x_TD, plan, 1)
    combines = []
    for w in range(W):
        got = dispatches.pop(w).wait()
        with annotate(f"wave{w}.experts"):
            y_RD = expert_fn(got)
        if w == W - 1 and hooks is not None:
            hooks.before_last_combine()
        with annotate(f"wave{w}.combine"):
            combines.append(backend.combine(y_RD, got.handle, out_TD, accumulate=w > 0 or not fresh))
        if w + 2 < W:
            with annotate(f"wave{w + 2}.dispatch"):
                dispatches[w + 2] = backend.dispatch(x_TD, plan, w + 2)
    for c in combines:
        c.wait()
    return out_TD

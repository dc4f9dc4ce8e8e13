"""The wave pipeline: dispatch, expert compute and combine, overlapped across waves.

Legend: T local tokens, D hidden, W waves, R received rows.

Issue order (one host thread; GPU work lands on three streams):

    comm stream:    dispatch(0) dispatch(1) combine(0) dispatch(2) combine(1) ... combine(W-1)
    compute stream:             experts(0)   experts(1)            experts(2) ...
    alt stream:     shared expert pieces (``hooks``), tail released just before combine(W-1)

dispatch(w+1) is always issued before combine(w), so the next wave's tokens travel while this
wave computes, and the finished wave's results travel while the next one computes. With
``expert_streams`` the expert stages take turns on the current stream and those (wave w on stream w mod n):
experts(w+1) depends only on dispatch(w+1), so its small kernels and the head of its grouped GEMM may fill
the tail of experts(w) instead of waiting behind it (its timings: benchmarks/results/moe.md). The combines keep
their order on the comm stream, so the sums are the same bit for bit. With
``overlap=False`` the very same operations run strictly one after another: the ``serial``
baseline of every benchmark. Compute stages never communicate.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from moe_wave.comm import streams as st
from moe_wave.comm.backend import CombineOut, CommBackend, ExchangePlan, Received

from .profiling import annotate

__all__ = ["run_waves", "PipelineHooks", "fork_turns", "join_turns"]


class PipelineHooks(Protocol):
    def before_last_combine(self) -> None: ...

    def before_last_wait(self) -> None: ...


def fork_turns(device, expert_streams: tuple) -> tuple:
    """The streams the waves' expert stages take turns on: (None,) for the caller's stream, then the extra
    ``expert_streams``, each made to wait for what the caller queued so far (on CPU just (None,)). Wave w runs on
    ``turns[w % len(turns)]``; ``join_turns`` brings them back."""
    main = st.current_stream(device)
    turns = (None,) + tuple(s for s in expert_streams if s is not None) if main is not None else (None,)
    for s in turns[1:]:
        st.wait_stream(s, main)
    return turns


def join_turns(device, turns: tuple) -> None:
    """The caller's stream waits for every stream of ``fork_turns`` (a CUDA-graph capture needs each stream it
    forked joined back)."""
    main = st.current_stream(device)
    for s in turns[1:]:
        st.wait_stream(main, s)


def run_waves(x_TD: torch.Tensor, plan: ExchangePlan, backend: CommBackend,
              expert_fn: Callable[[Received], torch.Tensor], out_TD: torch.Tensor, *,
              overlap: bool = True, hooks: PipelineHooks | None = None, fresh: bool = False,
              add_TD: torch.Tensor | None = None, dst_TD: torch.Tensor | None = None,
              local_view: bool = False, expert_streams: tuple = (),
              combine_width: int | None = None) -> torch.Tensor:
    """Run every wave; ``out_TD`` (fp32) receives sum_k w_k * expert_k(x) per token: added to what it
    holds, or, with ``fresh``, written over it (wave 0 combines with accumulate=False, so out_TD may
    come from ``torch.empty``). The last wave's sum adds ``add_TD`` and goes to ``dst_TD`` (see
    ``comm.backend``: the layer's output in one pass); returns ``dst_TD`` if given, else ``out_TD``.
    ``hooks.before_last_wait()`` runs just before the last combine's wait (``add_TD`` is read then).
    ``local_view``: the dispatches may leave this rank's own rows in x (``Received.local``; ``expert_fn``
    must read rows with ``comm.backend.rows_of`` or honour ``local`` itself). ``expert_streams``: more
    streams the expert stages take turns on (pipelined schedule only; see the module docstring).
    ``combine_width``: the width of ``expert_fn``'s rows where x's rows travel packed (``comm.backend``)."""
    W = plan.num_waves

    def dispatch(w: int):
        return backend.dispatch(x_TD, plan, w, local_view=local_view, combine_width=combine_width)

    def combine(w: int, y_RD, handle):
        last = w == W - 1
        return backend.combine(y_RD, handle, CombineOut(out_TD, accumulate=w > 0 or not fresh,
                                                        add_TD=add_TD if last else None,
                                                        dst_TD=dst_TD if last else None))

    def wait(w: int, pending) -> None:
        if w == W - 1 and hooks is not None:
            hooks.before_last_wait()
        pending.wait()

    if not overlap:
        for w in range(W):
            with annotate(f"wave{w}.dispatch"):
                got = dispatch(w).wait()
            with annotate(f"wave{w}.experts"):
                y_RD = expert_fn(got)
            if w == W - 1 and hooks is not None:
                hooks.before_last_combine()
            with annotate(f"wave{w}.combine"):
                wait(w, combine(w, y_RD, got.handle))
        return out_TD if dst_TD is None else dst_TD

    with annotate("wave0.dispatch"):
        dispatches = {0: dispatch(0)}
    if W > 1:
        with annotate("wave1.dispatch"):
            dispatches[1] = dispatch(1)
    turns = fork_turns(x_TD.device, expert_streams if W > 1 else ())
    combines = []
    for w in range(W):
        with st.on(turns[w % len(turns)]):    # None: the caller's stream
            got = dispatches.pop(w).wait()
            with annotate(f"wave{w}.experts"):
                y_RD = expert_fn(got)
            if w == W - 1 and hooks is not None:
                hooks.before_last_combine()
            with annotate(f"wave{w}.combine"):
                combines.append(combine(w, y_RD, got.handle))
            if w + 2 < W:
                with annotate(f"wave{w + 2}.dispatch"):
                    dispatches[w + 2] = dispatch(w + 2)
    join_turns(x_TD.device, turns)
    for w, c in enumerate(combines):
        wait(w, c)
    return out_TD if dst_TD is None else dst_TD

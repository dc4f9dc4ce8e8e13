"""Normal mode on the exchange engine (``moe_wave.comm.deepep_normal``): the symm backend's one-wave exchange with
compact receive buffers; its CPU emulation on gloo ranks. ``Buffer`` runs it where the direct kernels do not
(``CompatOptions.normal``), and the direct path hands it rows that are not whole 4-byte words, with the counts it
gathered in its own shape (``Counts``: so every rank's first exchange of a dispatch has one shape, whichever path
its rows take).

Also here: the gate (``gate``), the first exchange of every call on CPU ranks that has no count all-gather of
its own (a combine, a low-latency dispatch or combine).

Legend: T local tokens, H hidden, K top-k, P ranks, E experts (e = E / P local), X received rows (compact).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from moe_wave.comm.deepep_normal import (CompactExchange, CompactPlan, capacity_for, gather_rows, routing_counts,
                                        routing_layout)
from moe_wave.comm.header import CallHeader, check_headers
from moe_wave.comm.options import SymmOptions

from .config import Config, topk_idx_t
from .guard import Guard, head_at
from .normal import IntranodeHandle, NormalMode, Route, cached_header, dispatch_header, handle_matrices, pack_x

__all__ = ["EngineNormal", "Counts", "gate"]


def gate(ep, header: CallHeader) -> None:
    """CPU ranks (gloo): ``header`` gathered alone, in the shape of the engine's count all-gather (a row of
    ``head_at(P)`` zeros, then the header; ``EngineNormal._gather``), and checked on the host before any row
    moves: ``HeaderMismatch`` on every rank. Every call on CPU ranks that exchanges anything starts with an
    all-gather of this shape (a dispatch's count gather, a cached dispatch's, and this gate for a combine, a
    low-latency dispatch and a low-latency combine), so any two calls meet there, whatever their kinds: the
    headers name each rank's call kind, never gloo's size-mismatch abort (SIGABRT) or a collective of another
    type waiting until gloo's timeout. One all-gather and host read, on CPU ranks only (their exchanges are
    host-driven anyway); the GPU paths never call it (``guard``)."""
    G = gather_rows(ep, torch.tensor([0] * head_at(ep.size) + header.encode(), dtype=torch.int64))
    check_headers(G[:, head_at(ep.size):].tolist())


class Counts(NamedTuple):
    """A dispatch's gathered counts as ``EngineNormal.dispatch`` reads them: every rank's tokens per destination
    [P(src), P(dst)] and its tokens [P], on the device, and the first on the host as lists (None where nothing is
    read on the host: ``num_worst_tokens`` on a GPU)."""

    counts_PP: torch.Tensor
    tokens_P: torch.Tensor
    host_PP: Optional[list]


class EngineNormal(NormalMode):
    """Normal mode on ``CompactExchange`` (see the module docstring).

    Args:
        ep: the group; options: the symm backend's options; comm_stream: the Buffer's communication stream;
        guard: the Buffer's fault status (``guard.Guard``).
    """

    def __init__(self, ep, options: SymmOptions | None, comm_stream, guard: Guard):
        self.ep, self.guard = ep, guard
        self.exchange = CompactExchange(ep, options, comm_stream=comm_stream)

    def close(self) -> None:
        self.exchange.close()

    def layout(self, topk_idx_TK, num_experts):
        in_rank, per_expert = routing_counts(topk_idx_TK, num_experts, self.ep.size)
        return in_rank.sum(0, dtype=torch.int32), per_expert, in_rank

    def handle_rows(self, handle):
        cp = handle.state
        if not isinstance(cp, CompactPlan):
            raise ValueError("the handle comes from the direct kernels, x does not fit them (rows of whole 4-byte "
                             "words)")
        return cp.plan.layout.num_tokens, cp.rows

    def _capacity(self, rows: int) -> int:
        """The smallest block capacity already made that holds ``rows``, else a new one (the same on every rank:
        ``rows`` is a global figure and the backends were made in the same order everywhere)."""
        made = [c for c in self.exchange._backends if c >= rows]
        return min(made) if made else capacity_for(rows)

    def _gather(self, per_rank_P: torch.Tensor, T: int, header, worst: int, on_host: bool):
        """The count all-gather, row of rank p: [its tokens per rank [P] | its tokens | its guard words | its call
        header] (the same width for a dispatch and a cached one); the guard words folded, and with ``on_host`` the
        headers checked on the host (``HeaderMismatch`` on every rank before any row moves). Returns (the gather,
        on the host as lists or None)."""
        P = self.ep.size
        G = self.exchange.count_matrix(self.guard.count_row(per_rank_P, T, header, on_host))
        # HOST SYNC (DeepEP waits on the CPU here too) where on_host on a GPU; on CPU ranks the gather is host memory
        host = G.tolist() if on_host else None
        self.guard.read_counts(G, P, G[:, :P].sum(0), worst, host)
        return G, host

    def cached_dispatch(self, x, handle, call):
        rows, unpack = pack_x("dispatch", x)
        if rows.device.type == "cpu" and self.ep.size > 1:
            # CPU ranks (gloo, host-driven anyway): the call header first, in the shape of a dispatch's count gather,
            # so a cached dispatch meeting another call is a HeaderMismatch, not gloo's abort or a timeout
            self._gather(torch.zeros(self.ep.size, dtype=torch.long), rows.shape[0], cached_header(x, handle, call),
                         0, True)
            self.guard.snapshot()       # the gather folded the guard words
        got, _, _ = self.exchange.dispatch(rows, handle.state)
        return unpack(got)

    def dispatch(self, x, route: Route, config: Config, counts: Counts | None = None):
        """``NormalMode.dispatch``. ``counts``: what the caller gathered already, its headers checked and the guard
        words folded (the direct path's count all-gather, ``normal_direct.CountGather``); None: this dispatch
        gathers its own (``_gather``)."""
        rows, unpack = pack_x("dispatch", x)
        P, me, T = self.ep.size, self.ep.rank, rows.shape[0]
        in_rank, worst = route.in_rank, route.worst
        head = dispatch_header(x, route)
        if counts is None:
            # the call header rides the count all-gather (guard): read on the host where the counts are (without
            # num_worst_tokens: the received count and the capacity every rank agrees on)
            G, host = self._gather(route.per_rank, T, head, worst, not worst or rows.device.type == "cpu")
            counts = Counts(G[:, :P], G[:, P], None if host is None else [row[:P] for row in host])
        counts_PP, tokens_P, host_PP = counts
        if worst:
            capacity, X, num_recv = self._capacity(worst), worst, None
        else:
            num_recv = sum(row[me] for row in host_PP)
            capacity, X = self._capacity(max(max(row) for row in host_PP)), num_recv
        layout = routing_layout(in_rank, route.topk_idx, route.topk_weights, route.per_expert)
        cp = self.exchange.make_plan(layout, counts_PP, capacity, X, num_recv)
        got, meta, weight = self.exchange.dispatch(rows, cp)
        recv_src = meta[:, -1].contiguous()
        recv_idx = recv_w = None
        if route.topk_idx is not None:
            K = route.topk_idx.shape[1]
            recv_idx, recv_w = meta[:, :K].to(topk_idx_t), weight[:, :K].contiguous()
        counts_e = []
        if not worst:
            # HOST SYNC: the per-expert list is a host list (DeepEP's CPU wait covers it)
            a = route.alignment
            counts_e = [-(-c // a) * a for c in cp.plan.pairs_We[0].tolist()]
        src_X = torch.div(cp.row_X, cp.plan.capacity, rounding_mode="floor").clamp(max=P - 1)
        mats = handle_matrices(counts_PP, tokens_P, in_rank, src_X, cp.valid_X, recv_src, config.num_channels, me)
        handle = IntranodeHandle((*mats[:3], recv_src, in_rank, mats[3]), cp, head)
        return unpack(got), recv_idx, recv_w, counts_e, handle

    def combine(self, x, handle, topk_weights, biases):
        cp = handle.state
        add = None
        for b in biases:
            add = b.float() if add is None else add + b.float()
        combined = torch.empty(cp.plan.layout.num_tokens, x.shape[1], dtype=x.dtype, device=x.device)
        self.exchange.combine(x.contiguous(), cp, out_TH=combined, add_TH=add)
        weights = None
        if topk_weights is not None:
            weights = self.exchange.combine(topk_weights.contiguous(), cp)
        return combined, weights

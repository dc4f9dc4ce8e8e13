"""Normal mode on the direct kernels (``normal_kernels``): one Triton launch per layout, dispatch and combine,
straight into the peers' symmetric memory. ``Buffer`` runs it on CUDA ranks of an NCCL group with Triton (and on
one CPU rank under TRITON_INTERPRET=1); rows that are not whole 4-byte words go to the exchange engine
(``normal_engine``), as do cached dispatches and combines of the handles it made.

Which path a dispatch's rows take is each rank's own choice (its x's row width), so the count all-gather comes
first and has one shape on both (``CountGather``; the engine path reads its counts from it): a rank whose rows
take the other path (another hidden size or dtype, which the header holds) is a ``HeaderMismatch`` on every
rank, never gathers of different widths (gloo's SIGABRT; NCCL a hang or a read past a buffer).

Legend: T local tokens, H hidden, K top-k, P ranks, E experts (e = E / P local), X received rows (compact), nch
channels, S scale words.
"""

from __future__ import annotations

import torch

from moe_wave.comm.deepep_normal import capacity_for
from moe_wave.comm.group import EPGroup
from moe_wave.comm.header import CallHeader

from . import normal_kernels as nk
from .config import Config, topk_idx_t
from .guard import Guard, tail_at
from .normal import IntranodeHandle, NormalMode, Route, dispatch_header, handle_matrices, words
from .normal_engine import Counts, EngineNormal
from .normal_plan import DirectPlan, NormalState, clip_plan

__all__ = ["DirectNormal", "CountGather", "symm_alloc"]


class CountGather:
    """A direct dispatch's count all-gather, of a width every rank agrees on before it is made.

    Row of rank p: [its channel counts [P * nch] | its tokens | its guard words [WORDS] | its call header
    [NUM_FIELDS] | its tokens per expert, in a tail of ``experts`` columns]. The tail's width is the number of
    experts every rank agreed on at the last dispatch that read the gather on the host (0 before the first): a
    rank whose ``num_experts`` differs sends zeros there, so the gather itself never mismatches (gloo aborts an
    all-gather whose sizes differ; NCCL hangs or reads past a buffer), and the header (which holds
    ``num_experts``) tells every rank of the mismatch. Where the header agrees and names another number of
    experts than the tail's, every rank gathers its tokens per expert once more, at the new width, and keeps it
    (one more all-gather and host read, only when the number of experts changes). Only a dispatch without
    ``num_worst_tokens`` needs the per-expert counts (its list); with it the tail is never read.

    Args:
        exchange: what gathers (``CompactExchange.count_matrix``); guard: the Buffer's ``Guard``; nch: channels.
    """

    def __init__(self, exchange, guard: Guard, nch: int):
        self.exchange, self.guard, self.nch = exchange, guard, nch
        self.experts = 0

    def __call__(self, chan_PN: torch.Tensor, per_expert_E: torch.Tensor, T: int, header: CallHeader, worst: int,
                 on_host: bool):
        """Gather, fold the guard words (and, without ``on_host``, the headers on the device) and, with
        ``on_host``, check the headers on the host (``HeaderMismatch`` on every rank before any row moves).

        Returns (chan_PPN [P(src), P(dst), nch] and tokens_P on the device; the gather on the host or None; every
        rank's tokens per expert [P, E] on the host, or None with ``worst``)."""
        P, nch = chan_PN.shape[0], self.nch
        E, Ew = per_expert_E.numel(), self.experts
        tail = per_expert_E.long() if E == Ew else chan_PN.new_zeros(Ew)
        G = self.exchange.count_matrix(self.guard.count_row(chan_PN, T, header, on_host, tail))
        F = P * nch
        H1 = tail_at(F)
        chan_G = G[:, :F].reshape(P, P, nch)
        host = G.cpu() if on_host else None
        self.guard.read_counts(G, F, chan_G.sum(2).sum(0), worst, host)
        per_expert_PE = None
        if not worst:
            if E != Ew:         # every rank: the headers agree on E, and every rank agreed on Ew before
                per_expert_PE = self.exchange.count_matrix(per_expert_E.long()).cpu()
                self.experts = E
            else:
                per_expert_PE = host[:, H1:]
        return chan_G, G[:, F], host, per_expert_PE


class DirectNormal(NormalMode):
    """Normal mode on the direct kernels (see the module docstring).

    Args:
        ep: the group; engine: the fallback (``EngineNormal``) for rows of other widths; guard: the Buffer's
        fault status; channels, rows: the kernels' channels and tokens per chunk; timeout_ms: how long a wait for a
        peer lasts; fast_launch: ``triton_launch.Launcher``'s fast path; alloc: ``NormalState``'s allocator
        (default ``symm_alloc``; the tests give gloo ranks their own memory, where only the gathers cross).
    """

    def __init__(self, ep: EPGroup, engine: EngineNormal, guard: Guard, channels: int, rows: int, timeout_ms: int,
                 fast_launch: bool = True, alloc=None):
        self.ep, self.engine, self.guard = ep, engine, guard
        self.nch, self.rows = channels, rows
        self.counts = CountGather(engine.exchange, guard, channels)
        self.state = NormalState(ep.rank, ep.size, ep.device, alloc or symm_alloc(ep, timeout_ms), timeout_ms,
                                 fast_launch=fast_launch)

    def close(self) -> None:
        self.engine.close()
        self.state = None           # the regions (their symmetric memory goes with the state)

    def layout(self, topk_idx_TK, num_experts):
        return nk.dispatch_layout(topk_idx_TK, num_experts, self.ep.size, fast=self.state.fast_launch)

    def handle_rows(self, handle):
        plan = handle.state
        if isinstance(plan, DirectPlan):
            return plan.T, plan.rows
        return self.engine.handle_rows(handle)

    def cached_dispatch(self, x, handle, call):
        plan = handle.state
        w = words("dispatch", x)
        if not isinstance(plan, DirectPlan):
            return self.engine.cached_dispatch(x, handle, call)
        if w is None:
            raise ValueError("dispatch: the handle comes from the direct kernels, x does not fit them (rows of whole "
                             "4-byte words)")
        a, sc, unpack = w
        oa, ob = nk.dispatch(self.state, plan, a, sc, rows=self.rows)
        if plan.recv_pad is not None:
            oa.masked_fill_(plan.recv_pad, 0)
            if ob is not None:
                ob.masked_fill_(plan.recv_pad, 0)
        return unpack(oa, ob)

    def dispatch(self, x, route: Route, config: Config):
        w = words("dispatch", x)
        P, me, nch = self.ep.size, self.ep.rank, self.nch
        in_rank, per_expert, topk_idx, topk_weights = route.in_rank, route.per_expert, route.topk_idx, \
            route.topk_weights
        T = in_rank.shape[0]
        E = per_expert.numel()
        e = E // P
        # the call header rides the count all-gather (guard), read on the host where the counts are; the gather
        # comes before the path is taken, in one shape for both (module docstring)
        on_host = not route.worst or in_rank.device.type == "cpu"
        head = dispatch_header(x, route)
        chan_G, tokens_P, host, per_expert_PE = self.counts(nk.channel_counts(in_rank, nch), per_expert, T, head,
                                                            route.worst, on_host)
        counts_PP = chan_G.sum(2)
        if w is None:
            # rows of another width: the engine's exchange, on these counts (``host``: read on the host above)
            host_PP = None if host is None else host[:, :P * nch].reshape(P, P, nch).sum(2).tolist()
            return self.engine.dispatch(x, route, config, Counts(counts_PP, tokens_P, host_PP))
        a, sc, unpack = w
        if route.worst:
            X, cap, num_recv, counts_e = route.worst, capacity_for(route.worst), None, []
        else:
            # HOST SYNC (DeepEP waits on the CPU here too; ``host`` above): the received counts, the capacity every
            # rank agrees on, the per-expert list
            recv = host[:, :P * nch].reshape(P, P, nch).sum(2).sum(0)
            X = num_recv = int(recv[me])
            cap = capacity_for(int(recv.max()))
            got_e = per_expert_PE[:, me * e:(me + 1) * e].sum(0)
            counts_e = [-(-c // route.alignment) * route.alignment for c in got_e.tolist()]
            self.state.check("dispatch")        # a fault of an earlier call (the host already waited here)
        plan = nk.make_plan(me, in_rank, chan_G, X, cap, num_recv)
        if route.worst:
            plan = clip_plan(plan, X)           # rows past num_worst_tokens are neither sent nor received
        S = sc.shape[1] if sc is not None else 0
        K = topk_idx.shape[1] if topk_idx is not None else 0
        parts = [] if sc is None else [sc]
        if K:
            parts += [topk_idx.to(torch.int32), topk_weights.contiguous().view(torch.int32)]
        parts.append(torch.arange(T, dtype=torch.int32, device=a.device)[:, None])
        oa, ob = nk.dispatch(self.state, plan, a, torch.cat(parts, 1), rows=self.rows)
        recv_src = ob[:, S + 2 * K].contiguous()
        scales = ob[:, :S].contiguous() if sc is not None else None
        recv_idx = recv_w = None
        if K:
            ids = ob[:, S:S + K].long()
            local = ids - me * e
            mine = (ids >= 0) & (local >= 0) & (local < e)
            recv_idx = torch.where(mine, local, -1).to(topk_idx_t)
            recv_w = torch.where(mine, ob[:, S + K:S + 2 * K].contiguous().view(torch.float32), 0.0)
        if plan.recv_pad is not None:
            pad = plan.recv_pad
            oa.masked_fill_(pad, 0)
            recv_src.masked_fill_(pad[:, 0], -1)
            if scales is not None:
                scales.masked_fill_(pad, 0)
            if K:
                recv_idx.masked_fill_(pad, -1)
                recv_w.masked_fill_(pad, 0.0)
        recv_P = counts_PP[:, me]
        end_P = torch.cumsum(recv_P, 0)
        src_X = torch.searchsorted(end_P, torch.arange(X, device=a.device), right=True)
        mats = handle_matrices(counts_PP, tokens_P, in_rank, src_X.clamp(max=P - 1), src_X < P, recv_src,
                               config.num_channels, me)
        handle = IntranodeHandle((*mats[:3], recv_src, in_rank, plan.head), plan, head)
        return unpack(oa, scales), recv_idx, recv_w, counts_e, handle

    def combine(self, x, handle, topk_weights, biases):
        plan = handle.state
        if not isinstance(plan, DirectPlan):
            return self.engine.combine(x, handle, topk_weights, biases)
        return nk.combine(self.state, plan, x.contiguous(), None if topk_weights is None else
                          topk_weights.contiguous(), tuple(b.contiguous() for b in biases), rows=self.rows)


def symm_alloc(ep: EPGroup, timeout_ms: int):
    """``alloc(nbytes) -> [P] uint8``: a zeroed symmetric-memory allocation and every rank's view of it (collective,
    outside CUDA-graph capture; the handles are kept for the Buffer's life)."""
    kept = []

    def alloc(nbytes: int) -> list:
        if ep.size == 1 or ep.device.type != "cuda":
            return [torch.zeros(nbytes, dtype=torch.uint8, device=ep.device)]
        import torch.distributed._symmetric_memory as symm_mem

        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("deep_ep.Buffer: run one dispatch and combine of this size eagerly before capturing a "
                               "CUDA graph (the normal-mode regions are allocated, by every rank, on first use)")
        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=ep.device)
        hdl = symm_mem.rendezvous(buf, ep.pg.group_name)
        buf.zero_()
        views = [hdl.get_buffer(p, [nbytes], torch.uint8, 0) for p in range(ep.size)]
        hdl.barrier(channel=0, timeout_ms=timeout_ms)      # every rank's copy zeroed before anyone signals
        kept.append((buf, hdl))
        return views

    return alloc

"""DeepEP's low-latency mode on the exchange engine (``EngineLowLatency``): gloo ranks on CPU (the tests), and
``Buffer(ll="engine")`` on a GPU for comparisons; the direct kernels are ``ll_direct``'s.

Legend: N local tokens (<= T, the most any rank dispatches), H hidden, S = H / 128, K top-k, P ranks, E experts,
e = E / P local experts, PT = P * T receive slots per local expert, R = P * T received block rows.

    dispatch:  (send) FP8 cast where asked (``ll_kernels.pack_fp8``); the routing layout and the engine's count
               exchange (``CompactExchange.prepare``, blocks of T rows: no rank can overflow them); the rows go out
               (``send``). (receive) each received row's top-k slots of local experts get their expert-major slots
               (sources in rank order, each source's tokens in order: deterministic), and ``ll_kernels.expand``
               copies rows, scales and source indices there.
    combine:   (send) the caller's top-k weights follow the dispatch's routing to the ranks that hold the experts;
               there each received row's weighted sum over its local experts (fp32, ``reduce_rows``) goes back
               through the engine's combine, which adds the ranks' sums per token in fp32. (receive) the sum is
               stored into ``out`` (``store_out``).

Streams: what reads the caller's ``x`` and ``topk_idx`` (the FP8 cast or a copy of the rows, the routing) runs on
the caller's stream, so they may be reused at once, as after DeepEP's send phase; the exchange runs on the
communication stream behind it. A receive hook (``return_recv_hook``) returns after the send, while the caller's
stream computes; ``hook()`` orders the caller's stream after the exchange and runs the receive side there. Without
the hook the receive side runs on the communication stream too, and ``async_finish`` returns its event. The
combine reads the experts' outputs ``x`` on the communication stream (after the weights have travelled): keep
them until the hook has run or the event has completed.

Everything has static shapes and no host read: with the engine's buffers made by an eager call first, a dispatch
and a combine can be captured in a CUDA graph. On the engine ranks cannot be masked: its barrier waits for every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe_wave.comm.backend import CombineOut
from moe_wave.comm.deepep_normal import CompactExchange, routing_counts, routing_layout
from moe_wave.comm.header import CallHeader
from moe_wave.comm.options import SymmOptions
from moe_wave.comm.symm_plan import SymmPlan
from moe_wave.comm.triton_gate import triton_ok

from . import ll_kernels as kern
from .low_latency import LowLatencyHandle, LowLatencyMode, outputs
from .normal_engine import gate
from .utils import EventHandle, EventOverlap

__all__ = ["EngineLowLatency", "slots"]

_WANT = {"auto": None, "triton": True, "torch": False}


@dataclass(frozen=True)
class _State:
    """What the combine needs: the buffer set, the engine plan, each received (row, slot)'s expert-major slot."""

    set_index: int
    plan: SymmPlan = field(repr=False)
    dest_RK: torch.Tensor = field(repr=False)
    num_tokens: int = 0
    top_k: int = 0


def slots(expert_RK: torch.Tensor, P: int, T: int, e: int):
    """(dest_RK int64: ``expert * PT + slot`` of each received (row, slot) of a local expert, else -1; counts [P, e]).
    Received rows are P blocks of T rows in rank order, each in its source's token order, so slots follow that
    order: rank by rank, token by token (device-side)."""
    R = expert_RK.shape[0]
    valid = expert_RK >= 0
    ids = expert_RK.long().clamp(min=0)
    hot = torch.zeros(R, e + 1, dtype=torch.int32, device=expert_RK.device)
    hot.scatter_(1, torch.where(valid, ids, e), 1)
    hot_PTe = hot[:, :e].reshape(P, T, e)
    count_Pe = hot_PTe.sum(1)
    begin_Pe = torch.cumsum(count_Pe, 0) - count_Pe
    slot_Re = (torch.cumsum(hot_PTe, 1) - 1 + begin_Pe[:, None, :]).reshape(R, e)
    dest = ids * (P * T) + torch.gather(slot_Re, 1, ids)
    return torch.where(valid, dest, -1), count_Pe


class EngineLowLatency(LowLatencyMode):
    """The low-latency mode on the exchange engine (see the module docstring).

    Args:
        ep: the group; comm_stream: the buffer's communication stream (None on CPU); options: the engine's options.
    """

    def __init__(self, ep, comm_stream, guard, options: SymmOptions | None = None):
        super().__init__(ep, comm_stream, guard)
        options = options or SymmOptions()
        self.kernels = triton_ok(ep.device, _WANT[options.kernels])
        self._sets = [CompactExchange(ep, options, comm_stream) for _ in range(2)]

    def close(self) -> None:
        for s in self._sets:
            s.close()
        super().close()

    # ------------------------------------------------------------------ streams
    def _run(self, prep, send, receive, inputs, outputs, async_finish: bool, hook: bool):
        """``prep()`` on the caller's stream (it reads what the caller may overwrite next), ``send(*prepped)`` on the
        communication stream, then ``receive(*sent)`` there or in the hook (module docstring). Returns (what
        ``send`` returned, the event, the hook or None)."""
        prepped = prep()
        comm = self.comm_stream
        if comm is None:
            sent = send(*prepped)
            if hook:
                return sent, EventOverlap(None), lambda: receive(*sent)
            receive(*sent)
            return sent, EventOverlap(EventHandle() if async_finish else None), None
        caller = torch.cuda.current_stream(self.ep.device)
        capturing = torch.cuda.is_current_stream_capturing()
        comm.wait_stream(caller)
        with torch.cuda.stream(comm):
            sent = send(*prepped)
        if not capturing:
            for t in (*inputs, *prepped):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(comm)
        if hook:
            return sent, EventOverlap(None), lambda: receive(*sent)    # the engine's wait orders it after comm
        with torch.cuda.stream(comm):
            receive(*sent)
        if not capturing:
            for t in outputs:
                t.record_stream(comm)
        if async_finish:
            return sent, EventOverlap(EventHandle(comm), tuple(t for t in (*inputs, *outputs) if t is not None)), None
        caller.wait_stream(comm)
        return sent, EventOverlap(None), None

    # ------------------------------------------------------------------ dispatch and combine
    def _gate(self, header: CallHeader) -> None:
        """CPU ranks (gloo): the call header checked across ranks first (``normal_engine.gate``: an all-gather of
        the shape every call's first exchange has there, so a call of another kind on a peer is a
        ``HeaderMismatch`` too), before the buffer set is taken. GPUs: nothing (``low_latency``)."""
        if self.ep.size > 1 and self.ep.device.type == "cpu":
            gate(self.ep, header)

    def _dispatch(self, x, topk_idx, T, E, K, stats, fp8, round_scale, use_ue8m0, async_finish, hook, call):
        P, (N, H) = self.ep.size, x.shape
        e = E // P
        header = CallHeader(kind="deep_ep.Buffer.low_latency_dispatch", module=0, call=call, overlap=False,
                            hidden=H, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, top_k=K, experts=E, rows=T)
        self._gate(header)
        set_index = self._take_set()
        ex = self._sets[set_index]
        dev = x.device
        recv, phys, scales, count, info, layout_range = outputs(e, P, T, H, fp8, bool(use_ue8m0), dev)
        info.fill_(-1)
        dest = torch.empty(P * T, K, dtype=torch.int64, device=dev)

        guard = self.guard

        def prep():
            # on the caller's stream: the rows and the routing, so that x and topk_idx may be reused at once, as
            # after DeepEP's send phase; ids outside [-1, E) count as -1 and are a fault (guard)
            ids = guard.check_ids(topk_idx, E)
            in_rank, per_expert = routing_counts(ids, E, P)
            layout = routing_layout(in_rank, ids, None, per_expert)
            if fp8:
                rows = torch.empty(N, H + 4 * (H // 128), dtype=torch.uint8, device=dev)
                (kern.pack_fp8 if self.kernels else kern.pack_fp8_torch)(x.contiguous(), rows, bool(round_scale))
            else:
                rows = x.clone(memory_format=torch.contiguous_format) if hook else x.contiguous()
            # the guard's words taken here, behind the check that wrote them: the next call's check (this stream)
            # cannot meet them on the communication stream
            return rows, layout, guard.words()

        def send(rows, layout, words):
            # the header travels with the counts too (on CPU ranks the count row's width is checked there); the
            # guard's words ride the count rows, so every rank folds every rank's fault in this call
            plan = ex.prepare(layout, T, header, extra=words)
            guard.fold(plan.extra_PA, None, 0)
            guard.snapshot()
            pending, bufs = ex.send(rows, plan)
            return plan, pending, bufs

        def receive(plan, pending, bufs):
            got = pending.wait()
            d, count_Pe = slots(got.expert_RK[:, :K], P, T, e)
            dest.copy_(d)
            (kern.expand if self.kernels else kern.expand_torch)(got.x_RD, d, got.expert_RK[:, K].contiguous(), recv,
                                                                phys, info, H, fp8, bool(use_ue8m0))
            ex.read(plan, bufs, "recv")
            counts = count_Pe.sum(0)
            count.copy_(counts)
            begin_Pe = torch.cumsum(count_Pe, 0) - count_Pe
            layout_range.copy_(((begin_Pe << 32) | count_Pe).t())
            if stats is not None:
                stats.add_(counts.to(stats.dtype))
            guard.poison(recv, phys)
            if phys is not None and use_ue8m0:
                guard.poison_words(phys, -1)

        made = [t for t in (recv, phys, count, info, layout_range, dest) if t is not None]
        sent, event, hook_fn = self._run(prep, send, receive, (x, topk_idx, stats), made, async_finish, hook)
        state = _State(set_index, sent[0], dest, N, K)
        handle = LowLatencyHandle((info, layout_range, T, H, E), state)
        return (recv, scales) if fp8 else recv, count, handle, event, hook_fn

    def _combine(self, st, y, topk_idx, topk_weights, result, async_finish, hook, call):
        P, N = self.ep.size, st.num_tokens
        e, PT, H = y.shape
        T = PT // P
        ex, plan = self._sets[st.set_index], st.plan
        self._gate(CallHeader(kind="deep_ep.Buffer.low_latency_combine", module=0, call=call, overlap=False, hidden=H,
                              dtype=y.dtype, top_k=st.top_k, experts=e * P, rows=T))

        def prep():     # on the caller's stream: the weights as the combine is called
            return (torch.where(topk_idx >= 0, topk_weights, 0.0).contiguous(),)

        def send(w):
            pending_w, bufs_w = ex.send(w, plan)
            got_w = pending_w.wait()          # on this stream: ordered after the weights' exchange
            blocks = torch.empty(P * T, H, dtype=torch.float32, device=y.device)
            (kern.reduce_rows if self.kernels else kern.reduce_rows_torch)(y.view(e * PT, H), st.dest_RK,
                                                                            got_w.x_RD, blocks)
            ex.read(plan, bufs_w, "recv")
            acc = torch.empty(N, H, dtype=torch.float32, device=y.device)
            pending, bufs = ex.send_back(blocks, plan, CombineOut(acc, accumulate=False))
            return pending, bufs, acc

        def receive(pending, bufs, acc):
            pending.wait()                    # the ranks' sums added per token (fp32), on this stream
            ex.read(plan, bufs, "comb")
            kern.store_out(acc, result, self.kernels)
            self.guard.poison(result)

        _, event, hook_fn = self._run(prep, send, receive, (y, topk_idx, topk_weights), [result], async_finish, hook)
        return result, event, hook_fn

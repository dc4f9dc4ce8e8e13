"""DeepEP's low-latency mode with no NVSHMEM: expert-major receive buffers, no host sync.

Two paths. On CUDA ranks of an NCCL group with Triton, the direct kernels of ``ll_direct`` run: one launch per call
(two with a receive hook) straight through peer memory, with rank masks. Elsewhere (gloo ranks on CPU: the tests;
or with ``MOE_WAVE_LL_PATH=engine``, for comparisons) the calls run on the exchange engine, as described below.

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

Two buffer sets, used in turn by successive dispatches (a combine uses its dispatch's set), so two low-latency
operations can be in flight, as in DeepEP. The returned tensors are fresh (they stay valid), except the zero-copy
combine buffer (``next_combine_buffer``), one per set.

Everything has static shapes and no host read: with the engine's buffers made by an eager call first, a dispatch
and a combine can be captured in a CUDA graph. On the engine ranks cannot be masked: its barrier waits for every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from moe_wave.comm.backend import CombineOut
from moe_wave.comm.deepep_normal import CompactExchange, routing_counts, routing_layout
from moe_wave.comm.options import SymmOptions
from moe_wave.comm.symm_plan import SymmPlan
from moe_wave.comm.triton_gate import triton_ok

from . import ll_kernels as kern
from .ll_direct import DirectLL, combine_launch, dispatch_launch
from .utils import EventHandle, EventOverlap

__all__ = ["LowLatency", "LowLatencyHandle", "rdma_size_hint", "check_overlap_kwargs", "slots"]

_WANT = {"auto": None, "triton": True, "torch": False}
# which path the GPU takes: "auto" (the direct kernels where they run), "direct", or "engine" (the exchange engine,
# for comparisons)
PATH_ENV = "MOE_WAVE_LL_PATH"
# SGLang's single-batch-overlap keywords (DeepEP forks): accepted while their feature is off
OVERLAP_KWARGS = frozenset({"overlap", "packed_recv_count", "comp_signal", "block_m", "threshold", "num_sms",
                            "src_signals", "src_signal_expect_value"})


def rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """DeepEP 567632d ``get_low_latency_rdma_size_hint`` (``csrc/config.hpp`` ``LowLatencyLayout``), bytes."""
    T, E, S = num_max_dispatch_tokens_per_rank, num_experts, hidden // 128
    dispatch_msg = 16 + max(hidden * 2, hidden + S * 4)
    combine_msg = S * 4 + hidden * 2
    send = max(T * dispatch_msg, E * T * combine_msg)
    recv = max(E * T * dispatch_msg, E * T * combine_msg)
    signal = -(-(E * 4) // 128) * 128
    total = 2 * (send + recv + signal)
    return (total + 128) // 128 * 128


def check_overlap_kwargs(kwargs: dict) -> None:
    """SGLang passes its single-batch-overlap keywords whenever that feature is configured; with ``overlap`` false
    they change nothing. ``overlap=True`` needs a DeepEP fork's signalling kernels."""
    unknown = sorted(set(kwargs) - OVERLAP_KWARGS)
    if unknown:
        raise TypeError(f"low_latency_combine() got unexpected keyword arguments {unknown}")
    if kwargs.get("overlap"):
        raise NotImplementedError("deep_ep.Buffer.low_latency_combine(overlap=True): SGLang's single-batch overlap "
                                  "needs a DeepEP fork's signalling kernels; run with that feature off")


class LowLatencyHandle(tuple):
    """DeepEP's low-latency handle ``(src_info int32 [e, PT], layout_range int64 [e, P], T, H, E)``, plus ``state``.

    ``src_info[i][j]`` is the source token index of expert i's slot j; ``layout_range[i][p]`` is ``begin << 32 |
    count`` of the slots holding rank p's tokens."""

    def __new__(cls, items, state: "_State"):
        h = super().__new__(cls, items)
        h.state = state
        return h


@dataclass(frozen=True)
class _State:
    """What the combine needs: the buffer set, the engine plan, each received (row, slot)'s expert-major slot."""

    set_index: int
    plan: SymmPlan = field(repr=False)
    dest_RK: torch.Tensor = field(repr=False)
    num_tokens: int = 0
    top_k: int = 0


@dataclass(frozen=True)
class _DirectState:
    """What the direct path's combine needs: the buffer set and the region (its ``posmap`` holds the slots)."""

    set_index: int
    region: object = field(repr=False)
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


def _outputs(e: int, P: int, T: int, H: int, fp8: bool, ue8m0: bool, dev):
    """A dispatch's fresh outputs: (recv [e, PT, H] fp8 or bf16, the scales' physical tensor or None, the scales
    (column-major in the last two dimensions) or None, count int32 [e], src_info int32 [e, PT], layout_range int64
    [e, P])."""
    PT = P * T
    recv = torch.empty(e, PT, H, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=dev)
    phys = scales = None
    if fp8:
        phys = torch.empty(e, H // 512, PT, dtype=torch.int32, device=dev) if ue8m0 else \
            torch.empty(e, H // 128, PT, dtype=torch.float32, device=dev)
        scales = phys.transpose(1, 2)
    return (recv, phys, scales, torch.empty(e, dtype=torch.int32, device=dev),
            torch.empty(e, PT, dtype=torch.int32, device=dev), torch.empty(e, P, dtype=torch.int64, device=dev))


def _check(what: str, name: str, t, shape, dtypes) -> None:
    ok = isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(shape) and t.dtype in dtypes
    if not ok:
        got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{what}: {name} is {got}: must be {list(shape)} of {', '.join(map(str, dtypes))}")


def _pos_int(what: str, name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{what}: {name}={v!r} must be an int > 0")
    return v


class LowLatency:
    """The low-latency half of ``deep_ep.Buffer`` (see the module docstring).

    Args:
        ep: the group; comm_stream: the buffer's communication stream (None on CPU); options: the engine's options.
    """

    def __init__(self, ep, comm_stream, options: SymmOptions | None = None, shrink: bool = False):
        options = options or SymmOptions()
        self.ep, self.comm_stream = ep, comm_stream
        self.kernels = triton_ok(ep.device, _WANT[options.kernels])
        self._sets = [CompactExchange(ep, options, comm_stream) for _ in range(2)]
        self._next = 0
        self._combine_bufs: dict = {}
        path = os.environ.get(PATH_ENV, "auto")
        if path not in ("auto", "direct", "engine"):
            raise ValueError(f"{PATH_ENV}={path!r}: must be auto, direct or engine")
        peer = ep.device.type == "cuda" and ep.size > 1 and "nccl" in ep.backend and self.kernels
        if path == "direct" and not peer:
            raise ValueError(f"{PATH_ENV}=direct needs CUDA ranks of an NCCL group with Triton; here: "
                             f"{ep.device.type}, {ep.size} rank(s), {ep.backend}, Triton {self.kernels}")
        # the direct kernels (``ll_direct``): peer memory, one launch per call and phase
        self.direct = DirectLL(ep, options.timeout_ms, shrink) if peer and path != "engine" else None

    def close(self) -> None:
        for s in self._sets:
            s.close()
        self._combine_bufs.clear()
        if self.direct is not None:
            self.direct.close()

    def clean(self, T: int, H: int, E: int) -> None:
        """Back to the first buffer set (every rank calls it, as in DeepEP). Nothing else is left dirty: slot
        counts are recomputed by every dispatch."""
        for name, v in (("num_max_dispatch_tokens_per_rank", T), ("hidden", H), ("num_experts", E)):
            _pos_int("clean_low_latency_buffer", name, v)
        self._next = 0

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

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x, topk_idx, T, E, stats, wait_stats, use_fp8, round_scale, use_ue8m0, async_finish, hook):
        """DeepEP's ``low_latency_dispatch``.

        Args:
            x: bf16 [N, H], N <= T, H a multiple of 128 (of 512 with ``use_ue8m0``).
            topk_idx: [N, K] int64 (or int32) global experts, -1: none.
            T: the most tokens any rank dispatches (the same on every rank); E: experts, a multiple of P.
            stats: None or int32 [e], += each local expert's received count. wait_stats: None or int64 [P, ...]:
                accepted, not measured (it stays as it is).
            use_fp8, round_scale, use_ue8m0: FP8 rows with one scale per 128 channels, scales rounded to powers of
                two, and those packed as UE8M0 bytes (needs round_scale).
            async_finish / hook: see the module docstring (not both).

        Returns:
            recv_x: bf16 [e, PT, H], or (fp8 [e, PT, H], scales float32 [e, PT, S] or int32 [e, PT, S / 4], both
            column-major in the last two dimensions); recv_count int32 [e]; the handle; the event; the hook or None.
        """
        what = "low_latency_dispatch"
        P = self.ep.size
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16:
            raise ValueError(f"{what}: x must be a bf16 [N, H] tensor, got "
                             f"{tuple(getattr(x, 'shape', ()))} {getattr(x, 'dtype', type(x).__name__)}")
        N, H = x.shape
        _pos_int(what, "num_max_dispatch_tokens_per_rank", T)
        _pos_int(what, "num_experts", E)
        if N > T:
            raise ValueError(f"{what}: x has {N} tokens, more than num_max_dispatch_tokens_per_rank={T}")
        if E % P:
            raise ValueError(f"{what}: num_experts={E} must be a multiple of the {P} ranks")
        if H % 128 or (use_fp8 and use_ue8m0 and H % 512):
            raise ValueError(f"{what}: hidden={H} must be a multiple of 128 (of 512 with use_ue8m0)")
        if use_ue8m0 and not round_scale:
            raise ValueError(f"{what}: use_ue8m0=True needs round_scale=True (DeepEP's rule)")
        if async_finish and hook:
            raise ValueError(f"{what}: async_finish and return_recv_hook cannot both be set")
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or topk_idx.shape[0] != N \
                or topk_idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{what}: topk_idx must be int64 [{N}, K], got "
                             f"{tuple(getattr(topk_idx, 'shape', ()))} {getattr(topk_idx, 'dtype', '')}")
        e, K = E // P, topk_idx.shape[1]
        if stats is not None:
            _check(what, "cumulative_local_expert_recv_stats", stats, (e,), (torch.int32, torch.int64))
        if wait_stats is not None and (not isinstance(wait_stats, torch.Tensor) or wait_stats.dtype != torch.int64
                                       or wait_stats.shape[0] != P):
            raise ValueError(f"{what}: dispatch_wait_recv_cost_stats must be int64 with {P} rows")
        fp8 = bool(use_fp8)
        if self.direct is not None:
            return self._dispatch_direct(x, topk_idx, T, E, K, stats, fp8, bool(round_scale), bool(use_ue8m0),
                                         async_finish, hook)
        set_index, self._next = self._next, self._next ^ 1
        ex = self._sets[set_index]
        dev = x.device
        recv, phys, scales, count, info, layout_range = _outputs(e, P, T, H, fp8, bool(use_ue8m0), dev)
        info.fill_(-1)
        dest = torch.empty(P * T, K, dtype=torch.int64, device=dev)

        def prep():
            # on the caller's stream: the rows and the routing, so that x and topk_idx may be reused at once, as
            # after DeepEP's send phase
            in_rank, per_expert = routing_counts(topk_idx, E, P)
            layout = routing_layout(in_rank, topk_idx, None, per_expert)
            if fp8:
                rows = torch.empty(N, H + 4 * (H // 128), dtype=torch.uint8, device=dev)
                (kern.pack_fp8 if self.kernels else kern.pack_fp8_torch)(x.contiguous(), rows, bool(round_scale))
            else:
                rows = x.clone(memory_format=torch.contiguous_format) if hook else x.contiguous()
            return rows, layout

        def send(rows, layout):
            plan = ex.prepare(layout, T)
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

        outputs = [t for t in (recv, phys, count, info, layout_range, dest) if t is not None]
        sent, event, hook_fn = self._run(prep, send, receive, (x, topk_idx, stats), outputs, async_finish, hook)
        state = _State(set_index, sent[0], dest, N, K)
        handle = LowLatencyHandle((info, layout_range, T, H, E), state)
        return (recv, scales) if fp8 else recv, count, handle, event, hook_fn

    # ------------------------------------------------------------------ the direct path
    def _launch(self, fn, async_finish: bool, hook: bool, inputs, outputs, send, receive):
        """Stream rules of the direct path: ``send()`` on the caller's stream (then the hook runs ``receive()`` on
        the stream current when it is called), or both in one launch: on the caller's stream, or with
        ``async_finish`` on the communication stream (inputs and outputs marked used there, an event returned)."""
        if hook:
            send()
            return EventOverlap(None), receive
        if not async_finish or self.comm_stream is None:
            fn()
            return EventOverlap(EventHandle() if async_finish else None), None
        caller = torch.cuda.current_stream(self.ep.device)
        comm = self.comm_stream
        comm.wait_stream(caller)
        with torch.cuda.stream(comm):
            fn()
        if not torch.cuda.is_current_stream_capturing():
            for t in (*inputs, *outputs):
                if t is not None:
                    t.record_stream(comm)
        return EventOverlap(EventHandle(comm), tuple(t for t in (*inputs, *outputs) if t is not None)), None

    def _dispatch_direct(self, x, topk_idx, T, E, K, stats, fp8, round_scale, ue8m0, async_finish, hook):
        d = self.direct
        d.check()
        P, me = self.ep.size, self.ep.rank
        N, H = x.shape
        e = E // P
        rg = d.region(T, H, K, E)
        set_index, self._next = self._next, self._next ^ 1
        recv, phys, scales, count, info, layout_range = _outputs(e, P, T, H, fp8, ue8m0, x.device)
        # the kernel reads rows as 8-byte words: rows contiguous and 16-byte aligned, or a copy
        xc = x if x.stride(1) == 1 and not x.data_ptr() % 16 and not x.stride(0) % 8 else x.clone()
        ids = topk_idx if topk_idx.stride(1) == 1 else topk_idx.contiguous()
        out = recv.view(torch.uint8) if fp8 else recv

        def go(send: bool, receive: bool):
            dispatch_launch(rg, set_index, me, xc, ids, d.mask, d.fault_addr, d.timeout_ms, out, phys, info, count,
                            layout_range, stats, send=send, recv=receive, fp8=fp8, round_scale=round_scale,
                            ue8m0=ue8m0)

        event, hook_fn = self._launch(lambda: go(True, True), async_finish, hook, (xc, ids, stats),
                                      (recv, phys, count, info, layout_range), lambda: go(True, False),
                                      lambda: go(False, True))
        handle = LowLatencyHandle((info, layout_range, T, H, E), _DirectState(set_index, rg, N, K))
        return (recv, scales) if fp8 else recv, count, handle, event, hook_fn

    def _combine_direct(self, st: _DirectState, y, topk_idx, topk_weights, result, async_finish, hook):
        d = self.direct
        d.check()
        me, H = self.ep.rank, y.shape[-1]
        y2 = y.view(-1, H)
        ids = topk_idx if topk_idx.stride(1) == 1 else topk_idx.contiguous()
        w = topk_weights if topk_weights.stride(1) == 1 else topk_weights.contiguous()

        def go(weights: bool, partials: bool, receive: bool):
            combine_launch(st.region, st.set_index, me, y2, ids, w, d.mask, d.fault_addr, d.timeout_ms, result,
                           weights=weights, partials=partials, recv=receive, part_bf16=d.part_bf16)

        event, hook_fn = self._launch(lambda: go(True, True, True), async_finish, hook, (y, ids, w), (result,),
                                      lambda: go(True, True, False), lambda: go(False, False, True))
        return result, event, hook_fn

    # ------------------------------------------------------------------ combine
    def next_combine_buffer(self, handle) -> torch.Tensor:
        """The zero-copy combine buffer of the handle's buffer set: bf16 [e, PT, H], to be filled by the caller."""
        st = self._state("get_next_low_latency_combine_buffer", handle)
        _, _, T, H, E = handle
        key = (st.set_index, T, H, E)
        if key not in self._combine_bufs:
            P = self.ep.size
            self._combine_bufs[key] = torch.empty(E // P, P * T, H, dtype=torch.bfloat16, device=self.ep.device)
        return self._combine_bufs[key]

    @staticmethod
    def _state(what: str, handle) -> _State:
        if not isinstance(handle, LowLatencyHandle):
            raise ValueError(f"{what}: handle must be the handle low_latency_dispatch returned, got "
                             f"{type(handle).__name__}")
        return handle.state

    def combine(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish, hook, out, wait_stats):
        """DeepEP's ``low_latency_combine``: ``combined[t] = sum_k topk_weights[t, k] * (expert topk_idx[t, k]'s row
        for t)`` over the slots with ``topk_idx >= 0``, fp32 sums stored in bf16.

        Args:
            x: bf16 [e, PT, H] the experts' outputs in the dispatch's layout (ignored with ``zero_copy``: the
                buffer ``next_combine_buffer`` gave is read instead).
            topk_idx, topk_weights: [N, K] (int64, float32): the dispatch's tokens.
            out: None or bf16 [N, H] to write into (returned).
        """
        what = "low_latency_combine"
        st = self._state(what, handle)
        if use_logfmt:
            raise NotImplementedError("deep_ep.Buffer.low_latency_combine(use_logfmt=True): the LogFMT wire format is "
                                      "not implemented; combine in bf16 (use_logfmt=False)")
        if async_finish and hook:
            raise ValueError(f"{what}: async_finish and return_recv_hook cannot both be set")
        _, _, T, H, E = handle
        P, N, K = self.ep.size, st.num_tokens, st.top_k
        e, PT = E // P, P * T
        _check(what, "x", x, (e, PT, H), (torch.bfloat16,))
        _check(what, "topk_idx", topk_idx, (N, K), (torch.int64, torch.int32))
        _check(what, "topk_weights", topk_weights, (N, K), (torch.float32,))
        if out is not None:
            _check(what, "out", out, (N, H), (torch.bfloat16,))
            if out.stride(1) != 1:
                raise ValueError(f"{what}: out must have contiguous rows")
        if wait_stats is not None and (not isinstance(wait_stats, torch.Tensor) or wait_stats.dtype != torch.int64):
            raise ValueError(f"{what}: combine_wait_recv_cost_stats must be an int64 tensor")
        y = self.next_combine_buffer(handle) if zero_copy else x.contiguous()
        result = out if out is not None else torch.empty(N, H, dtype=torch.bfloat16, device=x.device)
        if isinstance(st, _DirectState):
            return self._combine_direct(st, y, topk_idx, topk_weights, result, async_finish, hook)
        ex, plan = self._sets[st.set_index], st.plan

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

        _, event, hook_fn = self._run(prep, send, receive, (x, y, topk_idx, topk_weights), [result], async_finish,
                                      hook)
        return result, event, hook_fn

    # ------------------------------------------------------------------ rank masks
    def update_mask(self, rank: int, mask: bool) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.ep.size:
            raise ValueError(f"low_latency_update_mask_buffer: rank_to_mask={rank!r} must be in [0, {self.ep.size})")
        if self.direct is not None:     # on the current stream, ordered with the calls around it
            self.direct.mask[rank:rank + 1].fill_(1 if mask else 0)
            return
        if mask:
            raise NotImplementedError("deep_ep.Buffer.low_latency_update_mask_buffer(mask=True): moe-wave's exchange "
                                      "waits for every rank, so a rank cannot be masked out; rebuild the Buffer over "
                                      "the surviving ranks' group instead")

    def query_mask(self, mask_status: torch.Tensor) -> None:
        """No rank is ever masked: ``mask_status`` (int32 [P]) is zeroed."""
        _check("low_latency_query_mask_buffer", "mask_status", mask_status, (self.ep.size,), (torch.int32,))
        if self.direct is not None:
            mask_status.copy_(self.direct.mask)
            return
        mask_status.zero_()

    def clean_mask(self) -> None:
        """Unmask every rank (the direct path); elsewhere nothing is ever masked."""
        if self.direct is not None:
            self.direct.mask.zero_()

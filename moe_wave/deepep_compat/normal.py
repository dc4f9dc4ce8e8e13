"""Normal mode's interface (``NormalMode``): what ``Buffer.get_dispatch_layout``, ``dispatch`` and ``combine``
delegate to, with two implementations chosen once when the Buffer is made: ``normal_direct.DirectNormal`` (one
Triton launch per call into peers' symmetric memory) and ``normal_engine.EngineNormal`` (the symm backend's
exchange; its CPU emulation on gloo ranks). Both return rows grouped by source rank in rank order, each source's
rows in its token order, every time. Also here: DeepEP's intranode handle and the row formats both move.

Legend: T local tokens, H hidden, K top-k, P ranks, E experts (e = E / P local), X received rows (compact), S
scale columns.

Stream rules (DeepEP's, ``comm_scope``): a call queues its work on the buffer's communication stream, which first
waits for ``previous_event`` or, without one, for the caller's current stream. With ``async_finish`` the call
returns an ``EventOverlap`` recorded on the communication stream; without it the caller's stream waits before the
call returns (a call with neither runs on the caller's stream: the same order, less host time). Outputs are made
on the communication stream and marked as used by the caller's stream (and inputs as used by the communication
stream), so either may free them early.

Host waits: a ``dispatch`` without ``num_worst_tokens`` reads the received counts on the host (DeepEP's CPU wait);
with ``num_worst_tokens`` nothing is read and the call can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from moe_wave.comm.header import CallHeader

from .checks import ROW_DTYPES, fp8_pair, tensor
from .config import Config
from .utils import EventHandle, EventOverlap

__all__ = ["NormalMode", "Route", "IntranodeHandle", "pack_x", "words", "dispatch_header", "cached_header",
           "handle_matrices", "Scope", "comm_scope"]


@dataclass(frozen=True)
class Route:
    """A dispatch's checked routing arguments (``get_dispatch_layout``'s outputs and the top-k)."""

    per_rank: torch.Tensor
    in_rank: torch.Tensor
    per_expert: torch.Tensor
    topk_idx: Optional[torch.Tensor]
    topk_weights: Optional[torch.Tensor]
    alignment: int
    worst: int
    call: int = 0           # the Buffer's dispatch number, cached ones included (the call header's)


class IntranodeHandle(tuple):
    """DeepEP's intranode handle, the 6-tuple ``(rank_prefix_matrix [P, P], channel_prefix_matrix [P, ch],
    recv_channel_prefix_matrix [P, ch], recv_src_idx [X], is_token_in_rank [T, P], send_head [T, P])`` (all int32
    but ``is_token_in_rank``; ch = ``config.num_sms // 2``), plus ``state``: the exchange plan that cached dispatches
    and combines reuse.

    ``rank_prefix_matrix[i][j]`` is the tokens ranks 0..i send rank j. ``send_head[t][p]`` is token t's row in the
    block it sends rank p (-1: not sent), where DeepEP stores a ring-buffer slot. ``header``: the call header of the
    dispatch that made it (a cached dispatch's header starts from it).
    """

    def __new__(cls, items, state, header: CallHeader | None = None):
        h = super().__new__(cls, items)
        h.state, h.header = state, header
        return h


class NormalMode(ABC):
    """One implementation of normal mode. Its methods run inside the Buffer's stream scope on checked arguments
    and return the outputs (the Buffer adds the event)."""

    @abstractmethod
    def layout(self, topk_idx_TK: torch.Tensor, num_experts: int) -> tuple:
        """(num_tokens_per_rank int32 [P], num_tokens_per_expert int32 [E], is_token_in_rank bool [T, P]);
        ``topk_idx_TK`` holds ids in [-1, E) (the guard has replaced the others)."""

    @abstractmethod
    def dispatch(self, x, route: Route, config: Config) -> tuple:
        """(recv_x, recv_topk_idx or None, recv_topk_weights or None, the per-expert list, the handle)."""

    @abstractmethod
    def cached_dispatch(self, x, handle: IntranodeHandle, call: int):
        """recv_x along a handle's routing (``call``: the Buffer's dispatch number, for the call header)."""

    @abstractmethod
    def combine(self, x: torch.Tensor, handle: IntranodeHandle, topk_weights, biases: tuple) -> tuple:
        """(combined_x [T, H], combined_topk_weights [T, K] or None)."""

    @abstractmethod
    def handle_rows(self, handle: IntranodeHandle) -> tuple[int, int]:
        """(T, X) of the dispatch that made ``handle``; ValueError if another implementation made it."""

    def close(self) -> None:
        """Release the memory (the Buffer's ``destroy``)."""


def pack_x(what: str, x) -> tuple[torch.Tensor, Callable]:
    """(rows to send [T, W], ``unpack(rows [X, W]) -> recv_x`` in x's form). An (fp8, scales) pair travels as one
    byte row: the fp8 bytes, then the scales' bytes (so both arrive bit for bit)."""
    if isinstance(x, torch.Tensor):
        tensor(what, "x", x, 2, ROW_DTYPES)
        return x.contiguous(), lambda r: r
    fp8_pair(what, x)
    x8, sc = x
    T, H = x8.shape
    S = sc.shape[1] if sc.dim() == 2 else 1
    sc2 = sc.reshape(T, S).contiguous()
    rows = torch.cat([x8.contiguous().view(torch.uint8), sc2.view(torch.uint8).reshape(T, 4 * S)], 1)

    def unpack(r: torch.Tensor):
        n = r.shape[0]
        scales = r[:, H:].contiguous().view(sc.dtype)
        return r[:, :H].contiguous().view(x8.dtype), scales.view(n) if sc.dim() == 1 else scales.view(n, S)

    return rows, unpack


def words(what: str, x):
    """The direct kernels' form of x: (rows as int32 words [T, WA], the scales as int32 words [T, S] (row-major)
    or None, ``unpack(words [X, WA], scale words [X, S] or None) -> recv_x`` in x's form); None where a row is not
    whole words (the engine path takes those)."""
    if isinstance(x, torch.Tensor):
        tensor(what, "x", x, 2, ROW_DTYPES)
        if x.shape[1] * x.element_size() % 4:
            return None
        return x.contiguous().view(torch.int32), None, lambda a, s: a.view(x.dtype)
    fp8_pair(what, x)
    x8, sc = x
    T, H = x8.shape
    if H % 4:
        return None
    S = sc.shape[1] if sc.dim() == 2 else 1

    def unpack(a, s):
        return a.view(torch.uint8).view(x8.dtype), (s.view(sc.dtype) if sc.dim() == 2 else s.view(sc.dtype).view(-1))

    # scales row-major: DeepEP's callers often pass them column-major ([T, S] with strides (1, T)), and a kernel
    # reading a row's S words 4*T bytes apart issues one memory transaction per word
    return x8.contiguous().view(torch.uint8).view(torch.int32), sc.reshape(T, S).contiguous().view(torch.int32), \
        unpack


def dispatch_header(x, route: Route) -> CallHeader:
    """A dispatch's call header (``guard``'s module docstring): x's hidden size, dtype and scale columns, the top-k
    width, the experts, ``num_worst_tokens`` and the Buffer's dispatch number."""
    x8 = x if isinstance(x, torch.Tensor) else x[0]
    scales = 0 if isinstance(x, torch.Tensor) else (x[1].shape[1] if x[1].dim() == 2 else 1)
    return CallHeader(kind="deep_ep.Buffer.dispatch", module=0, call=route.call, overlap=False, hidden=x8.shape[1],
                      dtype=x8.dtype, top_k=0 if route.topk_idx is None else route.topk_idx.shape[1],
                      experts=route.per_expert.numel(), rows=route.worst, scales=scales)


def cached_header(x, handle: IntranodeHandle, call: int) -> CallHeader:
    """A cached dispatch's call header: the handle's dispatch's top-k width, experts and ``num_worst_tokens``, x's
    hidden size, dtype and scale columns, the Buffer's dispatch number, ``cached``."""
    x8 = x if isinstance(x, torch.Tensor) else x[0]
    scales = 0 if isinstance(x, torch.Tensor) else (x[1].shape[1] if x[1].dim() == 2 else 1)
    base = handle.header or CallHeader(kind="deep_ep.Buffer.dispatch", module=0, call=0, overlap=False, hidden=0,
                                       dtype=None)
    return replace(base, call=call, hidden=x8.shape[1], dtype=x8.dtype, scales=scales, cached=True)


def handle_matrices(counts_PP, tokens_P, in_rank_TP, src_X, valid_X, recv_src_X, ch: int, me: int):
    """(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, send_head), int32, on the device.

    Channel c of a rank with n tokens covers tokens [c * ceil(n / ch), (c + 1) * ceil(n / ch)), as DeepEP splits them:
    ``channel_prefix_matrix[p][c]`` counts this rank's tokens for p in channels 0..c; ``recv_channel_prefix_matrix[
    s][c]`` is where source s's channel c starts among the rows s sent here."""
    P, dev = counts_PP.shape[0], counts_PP.device
    T = in_rank_TP.shape[0]
    rank_prefix = torch.cumsum(counts_PP, 0).to(torch.int32)
    per = max(-(-T // ch), 1)
    chan_T = torch.arange(T, device=dev) // per
    chan = torch.zeros(P, ch, dtype=torch.long, device=dev)
    chan.index_add_(1, chan_T, in_rank_TP.t().long())
    chan_prefix = torch.cumsum(chan, 1).to(torch.int32)
    # the receive side: each valid row's source (src_X) and that source's channel of its token
    X = src_X.shape[0]
    per_src = torch.clamp(-(-tokens_P // ch), min=1)[src_X]
    key = torch.where(valid_X, src_X * ch + (recv_src_X.long() // per_src).clamp(max=ch - 1), P * ch)
    recv_chan = torch.zeros(P * ch + 1, dtype=torch.long, device=dev).index_add_(0, key, torch.ones(X, dtype=torch.long,
                                                                                                  device=dev))
    recv_chan = recv_chan[:-1].view(P, ch)
    recv_chan_prefix = (torch.cumsum(recv_chan, 1) - recv_chan).to(torch.int32)
    send_head = torch.where(in_rank_TP, torch.cumsum(in_rank_TP.long(), 0) - 1, -1).to(torch.int32)
    return rank_prefix, chan_prefix, recv_chan_prefix, send_head


class Scope:
    """What a call made inside ``comm_scope``: its outputs (for stream lifetimes) and the returned event."""

    def __init__(self):
        self.outputs: list = []
        self.event: EventOverlap | None = None

    def out(self, *tensors):
        """Register outputs (tensors and tuples of them); returns them as given."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.outputs.append(t)
            elif isinstance(t, tuple):
                self.outputs.extend(u for u in t if isinstance(u, torch.Tensor))
        return tensors[0] if len(tensors) == 1 else tensors


@contextlib.contextmanager
def comm_scope(comm, device, what: str, previous_event, async_finish: bool, inputs=()):
    """Run the block on ``comm`` (the communication stream; None on CPU) under the module's rules."""
    scope = Scope()
    if comm is None:
        yield scope
        scope.event = EventOverlap(EventHandle() if async_finish else None)
        return
    if previous_event is None and not async_finish:
        # DeepEP's rules here: the comm stream waits for the caller's, runs the call, and the caller's waits for
        # it before the call returns. Running on the caller's stream orders the work the same, without the two
        # waits, the stream switch and the record_stream calls (host time DeepEP's tests count).
        yield scope
        scope.event = EventOverlap(None)
        return
    caller = torch.cuda.current_stream(device)
    if previous_event is not None:
        ev = previous_event.event if isinstance(previous_event, EventOverlap) else previous_event
        if ev is None:
            raise ValueError(f"{what}: previous_event holds no event")
        ev.wait_on(comm)
    else:
        comm.wait_stream(caller)
    with torch.cuda.stream(comm):
        yield scope
    if not torch.cuda.is_current_stream_capturing():
        for t in inputs:
            for u in (t if isinstance(t, tuple) else (t,)):
                if isinstance(u, torch.Tensor) and u.is_cuda:
                    u.record_stream(comm)
        for t in scope.outputs:
            t.record_stream(caller)
    if async_finish:
        scope.event = EventOverlap(EventHandle(comm), tuple(scope.outputs))
    else:
        caller.wait_stream(comm)
        scope.event = EventOverlap(None)

"""DeepEP-style normal-mode exchange over the ``symm`` backend: received rows compacted, grouped by source rank.

``deep_ep.Buffer`` runs this on gloo ranks (the CPU emulation) and where the direct kernels do not run
(``moe_wave.deepep_compat.normal_kernels``: one Triton launch per call on CUDA ranks), and with
``Buffer(normal="engine")`` for comparisons.

Legend: T local tokens, K top-k, P ranks, e local experts (E = P*e), H row width (elements), C capacity rows per
source block, X rows of a compact receive buffer (the received count, or a caller's worst case), M meta slots
(K + 1: the top-k slots and the source token index).

DeepEP's normal ``dispatch`` returns the received rows compacted: source rank 0's rows first, then rank 1's, ...,
each source's rows in its token order. The symm backend receives into fixed blocks ``[P, C]`` whose block p holds,
in rows ``0 .. count_p - 1``, the rows p sent here in p's token order (sparse blocks, one wave). The compact order
is therefore the blocks' valid prefixes in rank order: one gather after the dispatch (``CompactPlan.row_X``) and
its inverse, one scatter into the blocks, before the combine.

    counts:   every rank's per-destination token counts, all-gathered ([P, P] on the device): DeepEP's rank prefix
              matrix, the receive offsets, and (read on the host where DeepEP waits too) the capacity.
    layout:   ``routing_layout``: one wave; send rows in (destination, token) order from ``is_token_in_rank``; each
              row's meta holds the top-k slots as the destination's local experts (-1 elsewhere, weight 0, as
              DeepEP does) and the source token index; the per-expert counts are the caller's.
    exchange: ``SymmBackend.prepare / dispatch / combine`` with sparse blocks (kernel mode where Triton runs);
              a combine returns each token's rows summed over the ranks that received it, in fp32.

Ordering of buffer reuse: a peer may write a block only after this rank has read what the last exchange left
there. Every exchange ends with a barrier and the reads follow it, so an exchange into buffers read since the last
barrier was queued (a cached dispatch, two combines in a row) first passes an entry barrier (``fence``). Every
call queues its work behind the caller's stream, so a barrier queued later also follows the reads queued before
it. On the emulated transport (CPU) the collectives already order it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from .backend import CombineOut
from .group import EPGroup
from .layout import DispatchLayout, WavePlan
from .options import SymmOptions
from .symm import SymmBackend, SymmHandle
from .symm_plan import SymmPlan

__all__ = ["CompactExchange", "CompactPlan", "routing_counts", "routing_layout", "compact_rows", "capacity_for",
           "gather_rows", "ENTRY_CHANNEL"]


def gather_rows(ep, row: torch.Tensor) -> torch.Tensor:
    """[P, n] int64: row i is rank i's ``row`` (n values; one all-gather on the current stream)."""
    mine = row.to(torch.long).reshape(1, -1).contiguous()
    if ep.size == 1:
        return mine.clone()
    out = torch.empty(ep.size, mine.shape[1], dtype=torch.long, device=mine.device)
    if "nccl" in ep.backend:
        dist.all_gather_into_tensor(out, mine, group=ep.pg)
    else:
        dist.all_gather(list(out.unbind(0)), mine[0], group=ep.pg)
    return out


# the barrier channel of the entry fence: the backend's one-wave exchanges use channels 0 (dispatch) and 1 (combine)
ENTRY_CHANNEL = 2
MIN_CAPACITY = 128


def capacity_for(rows: int) -> int:
    """The block capacity for ``rows`` rows: the next power of two, at least ``MIN_CAPACITY`` (few sizes, so few
    symmetric allocations)."""
    c = MIN_CAPACITY
    while c < rows:
        c *= 2
    return c


def routing_counts(topk_idx_TK: torch.Tensor, num_experts: int, P: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(is_token_in_rank [T, P] bool, tokens per expert [E] int32) from top-k ids (-1, or any id outside [0, E):
    none), on the device."""
    ids = topk_idx_TK.long()
    valid = (ids >= 0) & (ids < num_experts)
    e = num_experts // P
    dump_E = torch.where(valid, ids, num_experts).reshape(-1)
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
    per_expert.scatter_add_(0, dump_E, torch.ones_like(dump_E, dtype=torch.int32))
    in_rank = torch.zeros(ids.shape[0], P + 1, dtype=torch.bool, device=ids.device)
    in_rank.scatter_(1, torch.where(valid, ids // e, P), True)
    return in_rank[:, :P].contiguous(), per_expert[:num_experts]


def routing_layout(in_rank_TP: torch.Tensor, topk_idx_TK: torch.Tensor | None, topk_w_TK: torch.Tensor | None,
                   per_expert_E: torch.Tensor) -> DispatchLayout:
    """A one-wave ``DispatchLayout`` that sends token t to every rank p with ``in_rank_TP[t, p]`` (device-side, no
    host sync).

    Meta slots (``send_expert_SK`` is [S, M]): slot k < K is top-k slot k as the destination's local expert, or -1
    where that expert lives elsewhere or the slot is -1 (weight 0 there); slot K is the source token index (weight
    0). Without top-k, M = 1. ``pair_counts_WPe`` is ``per_expert_E`` (the counts the caller passed, as DeepEP
    exchanges them).
    """
    T, P = in_rank_TP.shape
    dev = in_rank_TP.device
    E = per_expert_E.numel()
    e = E // P
    hit_F = in_rank_TP.t().reshape(-1)                      # (peer, token) order
    # a stable sort puts the hits first in (peer, token) order, with no nonzero() (a host sync)
    flat_S = torch.argsort(hit_F.logical_not().to(torch.int8), stable=True)
    tok_S = flat_S % max(T, 1)
    peer_S = flat_S // max(T, 1)
    slots = [tok_S[:, None].to(torch.int32)]
    weights = [torch.zeros(tok_S.shape[0], 1, dtype=torch.float32, device=dev)]
    if topk_idx_TK is not None:
        ids_SK = topk_idx_TK.long()[tok_S]
        local_SK = ids_SK - (peer_S * e)[:, None]
        mine_SK = (ids_SK >= 0) & (local_SK >= 0) & (local_SK < e)
        slots.insert(0, torch.where(mine_SK, local_SK, -1).to(torch.int32))
        w_SK = torch.zeros_like(local_SK, dtype=torch.float32) if topk_w_TK is None else topk_w_TK.float()[tok_S]
        weights.insert(0, torch.where(mine_SK, w_SK, 0.0))
    send_counts = in_rank_TP.sum(0, dtype=torch.long).view(1, P)
    zero = torch.zeros((), dtype=torch.long, device=dev)
    return DispatchLayout(plan=WavePlan(num_ranks=P, num_local_experts=max(e, 1), num_waves=1), num_tokens=T,
                          send_token_S=tok_S, send_expert_SK=torch.cat(slots, 1).contiguous(),
                          send_weight_SK=torch.cat(weights, 1).contiguous(), send_counts_WP=send_counts,
                          pair_counts_WPe=per_expert_E.long().view(1, P, max(e, 1)), ids_min=zero, ids_max=zero)


def compact_rows(counts_PP: torch.Tensor, me: int, C: int, X: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For compact row j < X: (the block row ``src * C + i`` it comes from, or ``P * C`` past the received count;
    valid). Device-side: sources in rank order, each source's rows in its order."""
    P = counts_PP.shape[0]
    recv_P = counts_PP[:, me]
    end_P = torch.cumsum(recv_P, 0)
    j_X = torch.arange(X, device=counts_PP.device)
    src_X = torch.searchsorted(end_P, j_X, right=True)
    valid_X = src_X < P
    src_c = src_X.clamp(max=P - 1)
    row_X = src_c * C + j_X - (end_P - recv_P)[src_c]
    return torch.where(valid_X, row_X, P * C), valid_X


@dataclass(frozen=True)
class CompactPlan:
    """One dispatch layout's exchange state (what DeepEP keeps in its handle).

    Attributes:
        plan: the symm backend's plan (one wave, sparse blocks).
        backend: the backend that made it (its capacity is ``plan.capacity``).
        counts_PP: [P, P] int64 tokens rank i sends rank j (device).
        row_X: [X] int64 block row of compact row j, ``P * C`` past the received count.
        valid_X: [X] bool.
        num_recv: received rows, or None where it was never read on the host (worst-case buffers).
        meta_slots: M.
    """

    plan: SymmPlan
    backend: SymmBackend = field(repr=False, compare=False)
    counts_PP: torch.Tensor
    row_X: torch.Tensor
    valid_X: torch.Tensor
    num_recv: int | None
    meta_slots: int

    @property
    def rows(self) -> int:
        return self.row_X.shape[0]


class CompactExchange:
    """DeepEP-style dispatch/combine with compact receive buffers (see the module docstring).

    Args:
        ep: the group (NCCL on a GPU, gloo on CPU: the emulated transport).
        options: the symm options; the capacity is chosen per call (``backend``) and blocks are always sparse.
        comm_stream: where the backend queues its transfers (the caller runs everything on it).
    """

    def __init__(self, ep: EPGroup, options: SymmOptions | None = None, comm_stream=None):
        self.ep, self.comm_stream = ep, comm_stream
        self.options = replace(options or SymmOptions(), dense=False)
        self._backends: dict[int, SymmBackend] = {}
        self._unfenced: set = set()     # (id(buffers), kind) read since the last barrier was queued

    def backend(self, capacity: int) -> SymmBackend:
        """The backend of block capacity ``capacity`` (collective on first use: every rank asks for the same)."""
        if capacity not in self._backends:
            # host tensors made without a device (the backend's pinned status words) stay on the host even where
            # the caller made CUDA the default device (DeepEP's tests call torch.set_default_device("cuda"))
            with torch.device("cpu"):
                self._backends[capacity] = SymmBackend(self.ep, replace(self.options, capacity=capacity),
                                                       comm_stream=self.comm_stream)
        return self._backends[capacity]

    def close(self) -> None:
        self._backends.clear()
        self._unfenced.clear()

    # ------------------------------------------------------------------ counts and plans
    def count_matrix(self, per_rank_P: torch.Tensor) -> torch.Tensor:
        """[P, P] int64: row i is rank i's ``per_rank_P`` (``gather_rows``)."""
        return gather_rows(self.ep, per_rank_P)

    def make_plan(self, layout: DispatchLayout, counts_PP: torch.Tensor, capacity: int, rows: int,
                  num_recv: int | None) -> CompactPlan:
        """Prepare the exchange (count exchange and index tables on the device) and the compact row map."""
        plan = self.prepare(layout, capacity)
        row_X, valid_X = compact_rows(counts_PP, self.ep.rank, capacity, rows)
        return CompactPlan(plan=plan, backend=self.backend(capacity), counts_PP=counts_PP, row_X=row_X,
                           valid_X=valid_X, num_recv=num_recv, meta_slots=layout.send_expert_SK.shape[1])

    # ------------------------------------------------------------------ the exchanges, fenced
    def prepare(self, layout: DispatchLayout, capacity: int, header=None, extra=None) -> SymmPlan:
        """The backend's prepare (its count exchange ends with a barrier that fences every earlier read; ``header``
        and ``extra``: the call header and the words it carries, see ``SymmBackend.prepare``)."""
        plan = self.backend(capacity).prepare(layout, header, extra)
        self._unfenced.clear()
        return plan

    @staticmethod
    def _key(backend: SymmBackend, bufs, kind: str) -> tuple:
        # every dtype and width shares one backend's metadata blocks: a dispatch writes them whatever its rows
        return (id(backend), kind) if kind == "recv" else (id(bufs), kind)

    def fence(self, backend: SymmBackend, bufs, kind: str) -> None:
        """The entry barrier, where this rank read the ``kind`` block ("recv": rows and metadata; "comb") that the
        next exchange writes since the last barrier (peer memory only)."""
        if self._key(backend, bufs, kind) in self._unfenced and bufs.hdl is not None:
            bufs.hdl.barrier(channel=ENTRY_CHANNEL, timeout_ms=self.options.timeout_ms)
        self._unfenced.clear()

    def read(self, plan: SymmPlan, bufs, kind: str) -> None:
        """Record that this rank has queued reads of ``bufs``' ``kind`` block (the next exchange into it fences)."""
        self._unfenced.add(self._key(self.backend(plan.capacity), bufs, kind))

    def send(self, x_TH: torch.Tensor, plan: SymmPlan):
        """Start the rows of ``x_TH`` along ``plan``: (the backend's Pending[Received], the receive buffers). Call
        ``read(plan, bufs, "recv")`` once the received rows' readers are queued."""
        backend = self.backend(plan.capacity)
        bufs = backend.transport.buffers(x_TH.dtype, x_TH.shape[1], 1, plan.layout.send_expert_SK.shape[1])
        self.fence(backend, bufs, "recv")
        return backend.dispatch(x_TH, plan, 0), bufs

    def send_back(self, y_RH: torch.Tensor, plan: SymmPlan, out: CombineOut, deferred: bool = False):
        """Start a combine of block rows ``y_RH`` [P * C, H] along ``plan``: (the backend's Pending, the buffers);
        ``deferred``: the Pending returns the sum as a function (``SymmBackend.combine_deferred``)."""
        backend = self.backend(plan.capacity)
        bufs = backend.transport.buffers(y_RH.dtype, y_RH.shape[1], 1, plan.layout.send_expert_SK.shape[1])
        self.fence(backend, bufs, "comb")
        start = backend.combine_deferred if deferred else backend.combine
        return start(y_RH, SymmHandle(0, plan, bufs), out), bufs

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x_TH: torch.Tensor, cp: CompactPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows of ``x_TH`` to the ranks of the plan. Returns (rows [X, H] in compact order, zero past the received
        count; meta [X, M] int32 and weights [X, M] float32 of the same rows, slot -1 / weight 0 past it)."""
        pending, bufs = self.send(x_TH, cp.plan)
        got = pending.wait()
        src = cp.row_X.clamp(max=got.x_RD.shape[0] - 1)
        rows = got.x_RD.index_select(0, src)
        meta = got.expert_RK.index_select(0, src)
        weight = got.weight_RK.index_select(0, src)
        if cp.num_recv is None:         # worst-case rows: those past the received count are padding
            inval = cp.valid_X.logical_not()[:, None]
            rows.masked_fill_(inval, 0)
            meta.masked_fill_(inval, -1)
            weight.masked_fill_(inval, 0.0)
        self.read(cp.plan, bufs, "recv")
        return rows, meta, weight

    # ------------------------------------------------------------------ combine
    def combine(self, y_XH: torch.Tensor, cp: CompactPlan, out_TH: torch.Tensor | None = None,
                add_TH: torch.Tensor | None = None) -> torch.Tensor:
        """Each token's rows summed (fp32) over the ranks that received it, plus ``add_TH``; stored in ``out_TH``
        (any float dtype; a fresh fp32 tensor when None), which is returned. ``y_XH`` is in compact order (rows
        past the received count are ignored)."""
        plan = cp.plan
        P, C, H = self.ep.size, plan.capacity, y_XH.shape[1]
        T = plan.layout.num_tokens
        if y_XH.shape[0] != cp.rows:
            raise ValueError(f"combine: x has {y_XH.shape[0]} rows: must have the dispatch's {cp.rows} received rows")
        blocks = torch.empty(P * C + 1, H, dtype=y_XH.dtype, device=y_XH.device)
        blocks.index_copy_(0, cp.row_X, y_XH)           # rows past the count land in the last (dump) row
        acc = torch.empty(T, H, dtype=torch.float32, device=y_XH.device)
        out = CombineOut(acc, accumulate=False, add_TD=add_TH, dst_TD=out_TH)
        pending, bufs = self.send_back(blocks[:P * C], plan, out)
        pending.wait()
        self.read(plan, bufs, "comb")
        return out.result

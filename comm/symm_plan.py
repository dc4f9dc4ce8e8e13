"""The ``symm`` backend's plan: the data mode and block layout of a layer call, and its index tables.

Legend: T local tokens, K top-k, P ranks, W waves, e local experts, S send rows, C capacity rows per
(wave, peer), N = min(C, T) rows a block can hold from this rank, M = 2K metadata int32 per row.

Two block layouts:

- sparse blocks: row i of block (wave, peer) is the i-th row this rank sends that peer in that wave (one per
  token with at least one of the peer's experts in the wave), in send order;
- dense blocks (copy mode): row i of block (wave, peer) is token start_w + i of the wave's token range, sent
  whether or not it has an expert on the peer (its metadata then says expert -1). The dispatch then copies x
  as it is, with no pack kernel, at the price of the rows that carry no pair.

``choose`` takes the mode and the layout for one prepare from what every rank shares (the plan, top-k, the
options), never from a call's token count: all ranks must pick the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import ExchangePlan
from .options import AUTO_COPY_MIN_TOKENS, DENSE_FILL, SymmOptions
from .symm_once import OnceTables
from .symm_tables import densify, densify_torch

__all__ = ["SymmPlan", "DenseTables", "choose", "dense_fill", "wave_token_ranges", "wave_rows"]


def dense_fill(num_ranks: int, num_waves: int, top_k: int, partition: str) -> float:
    """Expected fraction of a dense block's rows that carry at least one pair, under uniform routing."""
    cells = num_ranks * num_waves if partition == "experts" else num_ranks
    return 1.0 - (1.0 - 1.0 / cells) ** top_k


def wave_token_ranges(T: int, W: int, partition: str) -> tuple:
    """(start, length) of each wave's tokens: all T for "experts", the contiguous chunks of
    ``compute_layout`` (token t in wave t*W // T) for "tokens"."""
    if partition == "experts":
        return tuple((0, T) for _ in range(W))
    bounds = [-(-w * T // W) for w in range(W + 1)]
    return tuple((bounds[w], bounds[w + 1] - bounds[w]) for w in range(W))


def choose(options: SymmOptions, mode: str, plan, top_k: int) -> tuple[str, bool]:
    """(data mode, dense blocks) for one prepare. ``mode`` is the backend's resolved mode ("auto" only where
    Triton runs); "auto" takes copy mode with dense blocks where they are expected to fill (``DENSE_FILL``)
    and the capacity reaches ``AUTO_COPY_MIN_TOKENS``, kernel mode otherwise. A plan that sends a row once per
    layer (``plan.once``) takes sparse blocks ("auto": kernel mode): its blocks hold the rows whose first wave
    it is, which no token range describes."""
    if plan.once:
        if options.dense:
            raise ValueError("SymmOptions.dense=True with WaveConfig.sends='once': a wave's block holds the rows whose "
                             "first wave it is, not a token range; use dense=None or False")
        return ("kernel" if mode == "auto" else mode), False
    full = dense_fill(plan.num_ranks, plan.num_waves, top_k, plan.partition) >= DENSE_FILL
    if mode == "auto":
        mode = ("copy" if options.dense is not False and full and options.capacity >= AUTO_COPY_MIN_TOKENS
                else "kernel")
    return mode, mode == "copy" and (full if options.dense is None else options.dense)


@dataclass(frozen=True)
class SymmPlan(ExchangePlan):
    """The exchange plan plus the device-side index tables of the symm backend.

    Attributes:
        capacity: C.
        mode: the data mode of this plan's exchanges, "kernel" or "copy" (``choose``).
        tok_WPN: [W, P, N] int64 token of row i of the block for (wave, peer); junk where invalid.
        row_WPN: [W, P, N] int64 send row (into the layout's S rows) of the same; None for dense blocks.
        send_dst_WPN: [W, P, N] int64 i where row i is valid (i < count and i < C), else -1.
        recv_dst_WPC: [W, P, C] int64 i where received row i of source p is valid, else -1.
        meta_SM: [S, M] int32 the send rows' (local expert, weight) slots.
        slot_WTP: [W, T, P] int64 row ``p*C + i`` of the comb block where token t's result from peer
            p lands in wave w, -1 where t sent nothing to p in that wave (the inverse of tok_WPN);
            None where the combine accumulates with torch ops (no Triton).
        src_PC: [P, C] int64 ``p*C + i``: the rows of y that go back to peer p.
        stale_WPC1: [W, P, C, 1] bool, True where received row i of source p is past its count (its
            metadata is reset in place at dispatch: expert -1, weight 0); sparse blocks only.
        pairs_We: [W, e] int64 (row, slot) pairs received per local expert: the exchanged counts summed
            over the sources.
        recv_rows_WP: [W, P] int64 rows of block (wave, source) that hold a received row: the count capped at
            C (``Received.rows_P``: the combine reads no row past it).
        once: ``symm_once.OnceTables`` where a row crosses once per layer (``WavePlan.sends == "once"``), else
            None.
        dense: ((start, rows) per wave) for dense blocks; None for sparse blocks.
        meta_WPCM: [W, P, C, M] int32, dense blocks only: the (local expert, weight) slots of each row
            for peer p (expert -1 and weight 0 where the token has none of p's experts in wave w, and in
            the rows past the wave's tokens: the whole block is sent, so no stale row remains).
        extra_PA: [P, A] int64 the words each source added to its count rows (``SymmBackend.prepare``'s
            ``extra``), or None.
    """

    capacity: int = 0
    mode: str = "copy"
    tok_WPN: torch.Tensor | None = None
    row_WPN: torch.Tensor | None = None
    send_dst_WPN: torch.Tensor | None = None
    recv_dst_WPC: torch.Tensor | None = None
    meta_SM: torch.Tensor | None = None
    slot_WTP: torch.Tensor | None = None
    src_PC: torch.Tensor | None = None
    stale_WPC1: torch.Tensor | None = None
    pairs_We: torch.Tensor | None = None
    recv_rows_WP: torch.Tensor | None = None
    once: OnceTables | None = None
    dense: tuple | None = None
    meta_WPCM: torch.Tensor | None = None
    extra_PA: torch.Tensor | None = None

    def tensors(self) -> tuple:
        """Every device tensor the plan holds (for stream lifetimes)."""
        own = tuple(t for t in (self.tok_WPN, self.row_WPN, self.send_dst_WPN, self.recv_dst_WPC, self.meta_SM,
                                self.slot_WTP, self.pairs_We, self.recv_rows_WP, self.stale_WPC1, self.meta_WPCM,
                                self.extra_PA)
                    if t is not None)
        return own + (self.once.tensors() if self.once is not None else ())


def wave_rows(x_TD: torch.Tensor, plan: SymmPlan, wave: int) -> torch.Tensor:
    """Dense blocks: x's rows of wave ``wave`` (its token range, capped at the capacity), a view."""
    start, n = plan.dense[wave]
    return x_TD[start:start + n]


class DenseTables:
    """The routing-independent tables of dense blocks, per (T, W, P, partition), made once outside any capture
    (the first prepare of a shape runs eagerly), and ``densify``: dense blocks from the sparse tables."""

    def __init__(self, capacity: int, device: torch.device):
        self.capacity, self.device = capacity, device
        self._cache: dict = {}

    def static(self, T: int, plan) -> dict:
        W, P, C, dev = plan.num_waves, plan.num_ranks, self.capacity, self.device
        key = (T, W, P, plan.partition)
        if key not in self._cache:
            N = min(C, T)
            ranges = wave_token_ranges(T, W, plan.partition)
            start_W1 = torch.tensor([a for a, _ in ranges], dtype=torch.long).view(W, 1)
            len_W1 = torch.tensor([n for _, n in ranges], dtype=torch.long).view(W, 1)
            i_N = torch.arange(N)
            tok_WPN = (start_W1 + i_N).clamp(max=max(T - 1, 0)).view(W, 1, N).expand(W, P, N)
            send_dst_WPN = torch.where(i_N < len_W1.clamp(max=C), i_N, -1).view(W, 1, N).expand(W, P, N)
            self._cache[key] = dict(
                ranges=tuple((a, min(n, N)) for a, n in ranges), max_len=max((n for _, n in ranges), default=0),
                counts_WP=len_W1.expand(W, P).contiguous().to(dev), rng_W2=torch.cat([start_W1, len_W1], 1).to(dev),
                start_W=start_W1.view(W).to(dev),
                tok_WPN=tok_WPN.contiguous().to(dev), send_dst_WPN=send_dst_WPN.contiguous().to(dev))
        return self._cache[key]

    def densify(self, tabs: dict, meta_SM, slot_WTP, static: dict, K: int) -> dict:
        """Each send row's metadata moves to its token's row of the block, and the combine's slots point at
        those rows (``symm_tables.densify``: one Triton launch where ``slot_WTP`` exists, its torch twin
        elsewhere)."""
        C = self.capacity
        if slot_WTP is not None:
            meta = densify(slot_WTP, tabs["row_WPN"], meta_SM, static["rng_W2"], C, K, static["max_len"])
        else:
            meta = densify_torch(tabs["tok_WPN"], tabs["row_WPN"], tabs["send_dst_WPN"], meta_SM, None,
                                 static["start_W"], C, K)
        return dict(tok_WPN=static["tok_WPN"], send_dst_WPN=static["send_dst_WPN"], row_WPN=None,
                    meta_WPCM=meta, dense=static["ranges"])

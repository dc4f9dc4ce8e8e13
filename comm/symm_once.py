"""The ``symm`` backend when a row crosses once per layer (``WavePlan.sends == "once"``, see ``comm.layout``).

Legend: T local tokens, K top-k, P ranks, W waves, e local experts, C capacity rows per (wave, peer) block,
N = min(C, T), D hidden, me this rank.

Dispatch is unchanged: block (b, p) of wave b holds the rows whose first wave on that peer is b, with all of
their slots there. What changes:

- The expert stage of wave w reads every block that has arrived, b <= w: the receive buffer is one
  [W * P * C, D] view (``Received.x_RD``) with ``Received.rows_P`` bounding each of its W * P blocks (0 for
  the blocks still to come), and only the experts of wave w count (``pairs_We``). A row's results are summed
  over its waves in its row of y (``Received.once``: fp32 within a wave, x's dtype between waves); after its
  last wave that row holds the finished sum.
- Combine c sends home the rows whose last wave is c, from every arrived block, into the source's ``comb``
  at the index the row arrived at: row (b, p, i) of y goes to row (b, me, i) of rank p's comb. Nothing can
  overflow there (the dispatch's block sizes bound it), no row crosses twice, and the sizes stay static: the
  receiver finds the rows of combine c from their slots (``combine_dst``), the source knows them from its
  own routing (``OnceTables.slot_WTP`` / ``last_WPN``).
- The source sums combine c's rows per token over the peers, in peer order, from the flat
  [W * P * C, D] comb (``gather_add``), or with torch ops block by block where Triton does not run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .symm_heap import Buffers, _capturing
from .symm_kernels import RowTargets, scatter_rows
from .triton_gate import tl, triton

DST_BLOCK = 256

__all__ = ["OnceTables", "once_tables", "combine_dst", "emulated_rows", "comb_targets", "home_targets", "send_home",
           "flag_layer_overflow"]


@dataclass(frozen=True)
class OnceTables:
    """What prepare adds to a ``SymmPlan`` for ``sends == "once"``.

    Attributes:
        rows_WB: [W, W * P] int64: ``Received.rows_P`` of the expert stage of wave w: the received rows of block
            (b, p) (flat b * P + p) for b <= w, 0 for the blocks still to come.
        pairs_We: [W, e] int64: the (row, slot) pairs of wave w's experts, over every block (they all arrive by
            wave w), 0 for the other experts.
        src_PN: [P, W * C] int64: row b * P * C + p * C + i of y for entry b * C + i of peer p (static).
        slot_WTP: [W, T, P] int64 (where Triton runs): the flat comb row b * P * C + p * C + i holding token t's
            sum from peer p after combine c = w, -1 where that sum comes home in another combine (or never).
        last_WPN: [W, P, N] int64: the last wave of the send row i of block (w, p), -1 where the row is invalid.
        state: the expert stage's scratch shared by the waves of this call (y, the running sums).
    """

    rows_WB: torch.Tensor
    pairs_We: torch.Tensor
    src_PN: torch.Tensor
    slot_WTP: torch.Tensor | None
    last_WPN: torch.Tensor
    state: dict = field(default_factory=dict, compare=False, repr=False)

    def tensors(self) -> tuple:
        return tuple(t for t in (self.rows_WB, self.pairs_We, self.src_PN, self.slot_WTP, self.last_WPN)
                     if t is not None)


def once_tables(layout, recv_pairs_WPe: torch.Tensor, recv_rows_WP: torch.Tensor, tabs: dict,
                slot_WTP: torch.Tensor | None, C: int) -> OnceTables:
    """The tables above from the layout and the exchanged counts (device ops, no host sync)."""
    plan = layout.plan
    W, P = plan.num_waves, plan.num_ranks
    dev = recv_rows_WP.device
    w_ = torch.arange(W, device=dev)
    rows_WB = torch.where(w_[None, :, None] <= w_[:, None, None], recv_rows_WP[None], 0).reshape(W, W * P)
    wave_e = plan.wave_of_local_expert(dev)
    pairs_We = torch.where(wave_e[None, :] == w_[:, None], recv_pairs_WPe.sum((0, 1))[None, :], 0)
    b_, p_, i_ = (torch.arange(n, device=dev) for n in (W, P, C))
    src_PN = (b_[None, :, None] * (P * C) + p_[:, None, None] * C + i_[None, None, :]).reshape(P, W * C)
    flat = None
    if slot_WTP is not None:
        flat_TP = torch.where(slot_WTP >= 0, slot_WTP + b_[:, None, None] * (P * C), -1).amax(0)   # one b per (t, p)
        flat = torch.where(layout.last_TP[None] == w_[:, None, None], flat_TP[None], -1)
    send_dst, row = tabs["send_dst_WPN"], tabs["row_WPN"]
    S = layout.send_last_S.shape[0]
    last_WPN = (torch.where(send_dst >= 0, layout.send_last_S[row.clamp(max=max(S - 1, 0))], -1) if S
                else torch.full_like(send_dst, -1))
    return OnceTables(rows_WB=rows_WB, pairs_We=pairs_We, src_PN=src_PN, slot_WTP=flat, last_WPN=last_WPN)


def flag_layer_overflow(recv_PX: torch.Tensor, W: int, P: int, C: int, status: torch.Tensor) -> None:
    """A source's rows to one peer over the whole layer must fit one block (C rows): the expert stage gathers a
    wave's pairs into the rows of one wave's blocks. Where some do not, ``status`` gets a capacity overflow with
    wave -1 (the layer) and its poison word, as ``symm_tables`` reports a block's (the first error sticks). Every
    rank sees every rank's counts, so all of them flag it alike. Device ops, no host sync."""
    tot_PP = recv_PX[:, :W * P].view(P, W, P).sum(1)                   # [src, dst] rows over the layer
    over = (tot_PP > C).flatten()
    first = torch.argmax(over.to(torch.int32))
    count = tot_PP.flatten().index_select(0, first.view(1))[0]
    zero = torch.zeros((), dtype=torch.long, device=status.device)
    new = torch.stack([over.any().long(), first // P, zero - 1, first % P, count, zero, zero, zero, zero])
    keep = (status[0] > 0) | (status[5] > 0) | ~over.any()
    status[:9].copy_(torch.where(keep, status[:9], new))
    status[9:10].copy_(torch.maximum(status[9:10], over.any().long().view(1)))


def combine_dst(recv_meta: torch.Tensor, recv_rows_WP: torch.Tensor, wave: int, num_local_experts: int,
                kernel: bool = False) -> torch.Tensor:
    """[P, W * C] int64, the receiver's destinations for combine ``wave``: entry b * C + i of peer p is
    b * P * C + i (row (b, me, i) of p's comb, counted from its block (0, me)) where received row i of block
    (b, p) is valid and its last wave (the largest wave of its slots' experts) is ``wave``; -1 elsewhere.
    ``kernel``: one Triton launch (``_dst_kernel``) instead of these torch ops (about ten launches)."""
    if kernel:
        W, P, C, M = recv_meta.shape
        dst = torch.empty(P, W * C, dtype=torch.long, device=recv_meta.device)
        if dst.numel():
            _dst_kernel[(P * W, triton.cdiv(C, DST_BLOCK))](recv_meta, recv_rows_WP.contiguous(), dst, wave, W, P,
                                                              C, M, num_local_experts, K=M // 2,
                                                              BLOCK=DST_BLOCK)
        return dst
    W, P, C, M = recv_meta.shape
    e, dev = num_local_experts, recv_meta.device
    ids = recv_meta[:wave + 1, ..., :M // 2].long()
    last = torch.where((ids >= 0) & (ids < e), ids * W // e, -1).amax(-1)          # [b, P, C]
    i_ = torch.arange(C, device=dev)
    b_ = torch.arange(wave + 1, device=dev)[:, None, None]
    ok = (last == wave) & (i_ < recv_rows_WP[:wave + 1, :, None])
    dst = torch.full((P, W, C), -1, dtype=torch.long, device=dev)
    dst[:, :wave + 1] = torch.where(ok, b_ * (P * C) + i_, -1).permute(1, 0, 2)
    return dst.view(P, W * C)


def comb_targets(combs, me: int) -> RowTargets:
    """Every rank's ``comb`` [W, P, C, D] (``combs[p]``: rank p's, peer memory) as one ``scatter_rows`` block per
    rank that starts at its block (0, me) and spans to the end of block (W - 1, me): row b * P * C + i of it is
    row i of block (b, me), where ``combine_dst`` sends row (b, p, i) of y."""
    W, P, C, D = combs[0].shape
    rows = (W - 1) * P * C + C
    return RowTargets.of(c.reshape(-1, D)[me * C:me * C + rows] for c in combs)


def home_targets(bufs: Buffers, combs, me: int) -> RowTargets:
    """``comb_targets(combs, me)``, kept on ``bufs``: built on first use, which must come before any capture (a
    pointer table copied from the host)."""
    if bufs.once_targets is None:
        if _capturing():
            raise RuntimeError("symm sends='once': run one combine eagerly before capturing a CUDA graph (its pointer "
                               "table is built on first use)")
        bufs.once_targets = comb_targets(combs, me)
    return bufs.once_targets


def send_home(y_RD: torch.Tensor, plan, bufs: Buffers, wave: int, targets: RowTargets, skip: int | None,
              tune) -> None:
    """Combine ``wave`` with Triton (peer memory, or one rank): the rows whose last wave this is, found in one launch
    (``combine_dst``), copied by one ``scatter_rows`` into ``targets`` (``home_targets``), ``skip`` left out."""
    dst = combine_dst(bufs.recv_meta, plan.recv_rows_WP, wave, plan.layout.plan.num_local_experts, kernel=True)
    scatter_rows(y_RD, targets, plan.once.src_PN, dst, skip=skip, tune=tune)


def emulated_rows(comb: torch.Tensor, back: torch.Tensor, last_WPN: torch.Tensor, wave: int) -> None:
    """The emulated transport's combine ``wave``: ``back`` [P(src), wave + 1, C, D] holds every source's y rows of
    blocks b <= wave (as they sit at the source, for this rank); the rows whose last wave is ``wave`` go into
    ``comb`` [W, P, C, D] at (b, src, i), the others are left alone (an earlier combine's rows may still be read)."""
    N = last_WPN.shape[2]
    if N == 0:
        return
    take = (last_WPN[:wave + 1] == wave)[..., None]                              # [b, P, N, 1]
    cur = comb[:wave + 1, :, :N]
    cur.copy_(torch.where(take, back.transpose(0, 1)[:, :, :N], cur))


if triton is not None:

    @triton.jit
    def _dst_kernel(meta_ptr, rows_ptr, dst_ptr, WAVE, W, P, C, M, E, K: tl.constexpr, BLOCK: tl.constexpr):
        # program (p * W + b, tile): rows i of block (b, p); the last wave of a row from its K expert ids
        pb = tl.program_id(0)
        p = pb // W
        b = pb - p * W
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = i < C
        ok = m & (i < tl.load(rows_ptr + b * P + p)) & (i * 0 + b <= WAVE)     # (a vector: the interpreter masks)
        base = ((b * P + p) * C + i).to(tl.int64) * M
        last = tl.full([BLOCK], -1, tl.int32)
        for k in tl.static_range(K):
            x = tl.load(meta_ptr + base + k, mask=ok, other=-1)
            last = tl.maximum(last, tl.where((x >= 0) & (x < E), x * W // E, -1))
        val = tl.where(ok & (last == WAVE), (b * P * C + i).to(tl.int64), -1)
        tl.store(dst_ptr + p.to(tl.int64) * W * C + b * C + i, val, mask=m)

"""Row copies for the ``symm`` backend: Triton kernels that read device-side counts, and their torch twins.

Legend: P destination blocks (one per peer), N rows per block (programs), D row width (elements),
C capacity rows of a destination block, T tokens.

``scatter_rows`` copies ``src[src_idx[p, i]] -> block_p[dst_idx[p, i]]`` for every (p, i) with
``dst_idx[p, i] >= 0``, for all P blocks in one launch. The blocks are named by a device pointer
table (``RowTargets``, built once per buffer, outside any capture), so a block may be a peer's
symmetric-memory buffer (the writes then travel over NVLink/xGMI from the SMs) or a local one. The
index arrays are computed on the device from the exchanged counts (``dst_idx`` is -1 past the valid
count and past the capacity), so no size ever reaches the host and the grid is static (P*N rows in
tiles of ``CopyTuning.rows`` rows, an upper bound): the kernel is CUDA-graph capturable and never touches a row that
``dst_idx`` does not name. Rows alternate peers (row j serves block j % P), so the local block's copy
and the NVLink writes run side by side; ``skip`` leaves one block out. An optional second row set
(the per-row metadata) goes with the same ``dst_idx`` in the same program.

``gather_add`` sums each token's returned rows from every peer block in peer order, in fp32, one
block optionally read from another tensor (``local``), into the output or over it (``accumulate``).

Both kernels also run on CPU tensors under ``TRITON_INTERPRET=1`` (the CI checks them against the
torch twins there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .options import CopyTuning
from .triton_gate import tl, triton

__all__ = ["RowTargets", "scatter_rows", "scatter_rows_torch", "gather_add", "gather_add_torch", "poison_rows"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8)
_UNIT = 16   # block offsets are kept in units of 16 elements where they allow it (16-byte vector stores)
_DEFAULT = CopyTuning()


@dataclass(frozen=True)
class RowTargets:
    """P destination blocks of equal shape [C, D] as one device table, for ``scatter_rows``.

    The table holds each block's start relative to ``base`` (the first block), in elements divided by
    ``unit`` (16 where every offset and the row stride allow it: the kernel then knows its stores are
    16-element aligned and vectorises them). Build it once per buffer, outside CUDA-graph capture (it
    copies from the host); the blocks must stay allocated while it is used.

    Attributes:
        base: the first block (its storage anchors the addresses).
        offs_P: [P] int64 (block start - base start) / unit, in elements.
        unit: 16 or 1.
        rows: C; width: D; stride: the blocks' row stride (elements).
    """

    base: torch.Tensor
    offs_P: torch.Tensor
    unit: int
    rows: int
    width: int
    stride: int

    @classmethod
    def of(cls, blocks) -> "RowTargets":
        blocks = list(blocks)
        if not blocks:
            raise ValueError("RowTargets.of: needs at least one block")
        b0 = blocks[0]
        for i, b in enumerate(blocks):
            if b.dim() != 2 or b.shape != b0.shape or b.dtype != b0.dtype or b.stride() != b0.stride():
                raise ValueError(f"RowTargets.of: block {i} is {tuple(b.shape)} {b.dtype} stride {b.stride()}; every "
                                 f"block must match block 0: {tuple(b0.shape)} {b0.dtype} stride {b0.stride()}")
            if b.stride(1) != 1 or b.device != b0.device:
                raise ValueError(f"RowTargets.of: block {i} must have contiguous rows on {b0.device}")
        es = b0.element_size()
        delta = [b.data_ptr() - b0.data_ptr() for b in blocks]
        if any(d % es for d in delta):
            raise ValueError("RowTargets.of: block addresses must differ by whole elements")
        el = [d // es for d in delta]
        unit = _UNIT if all(e % _UNIT == 0 for e in el) and b0.stride(0) % _UNIT == 0 else 1
        offs = torch.tensor([e // unit for e in el], dtype=torch.int64, device=b0.device)
        return cls(base=b0, offs_P=offs, unit=unit, rows=b0.shape[0], width=b0.shape[1], stride=b0.stride(0))

    @property
    def num_blocks(self) -> int:
        return self.offs_P.shape[0]


if triton is not None:

    @triton.jit
    def _scatter_rows_kernel(src_ptr, dst_ptr, offs_ptr, src_idx_ptr, dst_idx_ptr, D, src_stride, dst_stride,
                             src2_ptr, dst2_ptr, offs2_ptr, src2_idx_ptr, D2, src2_stride, dst2_stride, Q, N, SKIP,
                             UNIT: tl.constexpr, UNIT2: tl.constexpr, HAS2: tl.constexpr, BLOCK_D: tl.constexpr,
                             NUM_BLOCKS: tl.constexpr, BLOCK_D2: tl.constexpr, ROWS: tl.constexpr):
        # Rows j = 0 .. Q*N-1 (Q = P, or P - 1 when block SKIP < P is left out) in tiles of ROWS; row j
        # serves block j % Q (past SKIP), so a tile mixes the local block's copy with the NVLink writes. A
        # tile's loads are all issued before its stores: ROWS rows in flight per program. With a capped
        # grid (``CopyTuning.grid``) each program walks tiles t, t + G, t + 2G, ...
        for t in range(tl.program_id(0), tl.cdiv(Q * N, ROWS), tl.num_programs(0)):
            j = t * ROWS + tl.arange(0, ROWS)
            q = j % Q
            p = tl.where(q >= SKIP, q + 1, q)
            k = p.to(tl.int64) * N + j // Q
            d = tl.load(dst_idx_ptr + k, mask=j < Q * N, other=-1)
            ok = d >= 0
            s = tl.load(src_idx_ptr + k, mask=ok, other=0).to(tl.int64)
            # UNIT 16: the block offsets are multiples of 16 elements, so the stores are aligned vectors
            dst = tl.load(offs_ptr + p, mask=ok, other=0) * UNIT + d.to(tl.int64) * dst_stride
            for c in tl.static_range(NUM_BLOCKS):
                offs = c * BLOCK_D + tl.arange(0, BLOCK_D)
                m = ok[:, None] & (offs < D)[None, :]
                v = tl.load(src_ptr + s[:, None] * src_stride + offs[None, :], mask=m)
                tl.store(dst_ptr + dst[:, None] + offs[None, :], v, mask=m)
            if HAS2:
                s2 = tl.load(src2_idx_ptr + k, mask=ok, other=0).to(tl.int64)
                dst2 = tl.load(offs2_ptr + p, mask=ok, other=0) * UNIT2 + d.to(tl.int64) * dst2_stride
                offs2 = tl.arange(0, BLOCK_D2)
                m2 = ok[:, None] & (offs2 < D2)[None, :]
                v2 = tl.load(src2_ptr + s2[:, None] * src2_stride + offs2[None, :], mask=m2)
                tl.store(dst2_ptr + dst2[:, None] + offs2[None, :], v2, mask=m2)


    @triton.jit
    def _gather_add_kernel(out_ptr, src_ptr, loc_ptr, slot_ptr, add_ptr, dst_ptr, poison_ptr, D, T, P, LOCAL,
                           out_stride, src_stride, loc_stride, add_stride, dst_stride, BLOCK_D: tl.constexpr,
                           NUM_BLOCKS: tl.constexpr, ROWS: tl.constexpr, ACC: tl.constexpr, ADD: tl.constexpr,
                           POISON: tl.constexpr):
        # ROWS tokens a tile (capped grid: several tiles a program); block LOCAL (< P) is read from loc;
        # add (ADD) is added after the peers, and the fp32 sum is stored in dst's dtype; a nonzero poison
        # word (POISON) stores NaN instead
        for t in range(tl.program_id(0), tl.cdiv(T, ROWS), tl.num_programs(0)):
            row = t * ROWS + tl.arange(0, ROWS).to(tl.int64)
            rm = row < T
            for c in tl.static_range(NUM_BLOCKS):
                offs = c * BLOCK_D + tl.arange(0, BLOCK_D)
                m = rm[:, None] & (offs < D)[None, :]
                if ACC:
                    acc = tl.load(out_ptr + row[:, None] * out_stride + offs[None, :], mask=m)
                else:   # out's old contents are not read (0 + v is v exactly: the same sums as from zeros)
                    acc = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
                for p in range(P):
                    r = tl.load(slot_ptr + row * P + p, mask=rm, other=-1).to(tl.int64)
                    mr = m & (r >= 0)[:, None]
                    rr = tl.maximum(r, 0)[:, None]
                    if p == LOCAL:
                        v = tl.load(loc_ptr + rr * loc_stride + offs[None, :], mask=mr, other=0.0)
                    else:
                        v = tl.load(src_ptr + rr * src_stride + offs[None, :], mask=mr, other=0.0)
                    acc += v.to(tl.float32)
                if ADD:
                    acc += tl.load(add_ptr + row[:, None] * add_stride + offs[None, :], mask=m).to(tl.float32)
                if POISON:   # one word, cached: read where it is used
                    acc = tl.where(tl.load(poison_ptr) != 0, float("nan"), acc)
                # to dst's dtype: on the GPU round to nearest even, as torch's casts (TRITON_INTERPRET truncates)
                tl.store(dst_ptr + row[:, None] * dst_stride + offs[None, :], acc.to(dst_ptr.dtype.element_ty),
                         mask=m)


def _check(src: torch.Tensor, tg: RowTargets, src_idx: torch.Tensor, dst_idx: torch.Tensor, what: str) -> None:
    if src.dim() != 2 or src.shape[1] != tg.width or src.dtype != tg.base.dtype:
        raise ValueError(f"scatter_rows: {what} {tuple(src.shape)} {src.dtype} must be 2-D {tg.base.dtype} rows of "
                         f"width {tg.width} (the target blocks')")
    if src.dtype not in _DTYPES:
        raise ValueError(f"scatter_rows: {what}.dtype={src.dtype} must be one of {_DTYPES}")
    if src.stride(1) != 1:
        raise ValueError(f"scatter_rows: rows of {what} must be contiguous (stride(1) == 1)")
    want = (tg.num_blocks, dst_idx.shape[-1]) if dst_idx.dim() == 2 else None
    if dst_idx.dim() != 2 or src_idx.shape != dst_idx.shape or tuple(dst_idx.shape) != want:
        raise ValueError(f"scatter_rows: {what} indices {tuple(src_idx.shape)} / dst_idx {tuple(dst_idx.shape)} must "
                         f"both be [P={tg.num_blocks}, N]")
    if src_idx.device != src.device or dst_idx.device != src.device or tg.base.device != src.device:
        raise ValueError(f"scatter_rows: {what}, its indices and the target blocks must be on one device")


def _shape(D: int, tune: CopyTuning) -> tuple[int, int]:
    """(elements a program moves per step of a row, rows a program keeps in flight)."""
    return min(triton.next_power_of_2(D), tune.rows_block), tune.rows


def _launch(tiles: int, rows: int, block: int, tune: CopyTuning):
    """(grid, warps) for ``tiles`` tiles of ``rows`` x ``block`` elements."""
    warps = tune.warps or max(1, min(16, rows * block // 512))
    return (min(tiles, tune.grid) if tune.grid > 0 else tiles,), warps


def scatter_rows(src_ND: torch.Tensor, targets: RowTargets, src_idx_PN: torch.Tensor, dst_idx_PN: torch.Tensor,
                 src2_ND: torch.Tensor | None = None, targets2: RowTargets | None = None,
                 src2_idx_PN: torch.Tensor | None = None, skip: int | None = None,
                 tune: CopyTuning = _DEFAULT) -> None:
    """``block_p[dst_idx_PN[p, i]] = src_ND[src_idx_PN[p, i]]`` where ``dst_idx_PN[p, i] >= 0``, every
    block p of ``targets`` but ``skip`` in one launch (Triton, ``tune.rows`` rows a program; ``tune`` is the
    launch shape, see ``CopyTuning``). With ``src2_ND``,
    each such row also copies ``src2_ND[src2_idx_PN[p, i]]`` to row ``dst_idx_PN[p, i]`` of block p of
    ``targets2``.

    ``dst_idx_PN`` values must be < ``targets.rows`` (the caller's tables guarantee it; -1 skips a row:
    no read, no write).
    """
    _check(src_ND, targets, src_idx_PN, dst_idx_PN, "src")
    has2 = src2_ND is not None
    if has2:
        if targets2 is None or src2_idx_PN is None or targets2.num_blocks != targets.num_blocks:
            raise ValueError("scatter_rows: src2 needs targets2 with the same block count and src2_idx")
        _check(src2_ND, targets2, src2_idx_PN, dst_idx_PN, "src2")
    P, N = dst_idx_PN.shape
    if skip is not None and not 0 <= skip < P:
        raise ValueError(f"scatter_rows: skip={skip} must name one of the {P} blocks (or be None)")
    Q, skip = (P, P) if skip is None else (P - 1, skip)     # skip == P: no block is left out
    D = src_ND.shape[1]
    if N == 0 or D == 0 or Q == 0:
        return
    block, rows = _shape(D, tune)
    grid, warps = _launch(triton.cdiv(Q * N, rows), rows, block, tune)
    s2, t2, i2 = (src2_ND, targets2, src2_idx_PN) if has2 else (src_ND, targets, src_idx_PN)
    _scatter_rows_kernel[grid](
        src_ND, targets.base, targets.offs_P, src_idx_PN.contiguous(), dst_idx_PN.contiguous(), D,
        src_ND.stride(0), targets.stride,
        s2, t2.base, t2.offs_P, i2.contiguous(), s2.shape[1], s2.stride(0), t2.stride, Q, N, skip,
        UNIT=targets.unit, UNIT2=t2.unit, HAS2=has2, BLOCK_D=block, NUM_BLOCKS=triton.cdiv(D, block),
        BLOCK_D2=triton.next_power_of_2(max(s2.shape[1], 1)), ROWS=rows, num_warps=warps)


def scatter_rows_torch(src_ND: torch.Tensor, blocks, src_idx_PN: torch.Tensor, dst_idx_PN: torch.Tensor,
                       skip: int | None = None) -> None:
    """The reference of ``scatter_rows`` in torch, on a list of P [C, D] blocks (tests and CPU).

    HOST SYNC: boolean indexing sizes the valid rows on the host; this path is for tests only.
    """
    for p, blk in enumerate(blocks):
        if p == skip:
            continue
        ok = dst_idx_PN[p] >= 0
        blk[dst_idx_PN[p][ok]] = src_ND[src_idx_PN[p][ok]]


def gather_add(out_TD: torch.Tensor, src_RD: torch.Tensor, slot_TP: torch.Tensor,
               local_RD: torch.Tensor | None = None, local: int | None = None, *, accumulate: bool = True,
               add_TD: torch.Tensor | None = None, dst_TD: torch.Tensor | None = None,
               poison: torch.Tensor | None = None, tune: CopyTuning = _DEFAULT) -> None:
    """``out_TD[t] += sum_p src_RD[slot_TP[t, p]]`` over the slots >= 0, in p order, in fp32 (Triton,
    ``tune.rows`` tokens a program: one read-modify-write of each output row, no atomics). With ``local``,
    block ``local``'s rows are read from ``local_RD`` at the same row index instead (the combine reads
    this rank's own results where the experts left them, with no copy). ``accumulate=False``: ``out_TD =``
    instead of ``+=`` (its old contents are never read; the sums are those from a zero ``out_TD``).
    ``add_TD`` is added after the peers' rows; ``dst_TD`` (any float dtype) receives the sum instead of
    ``out_TD``, which is then only read (``accumulate``): the same fp32 operations as summing into
    ``out_TD``, adding ``add_TD`` to it and casting. ``poison``: a one-element int64 device word; where it is
    nonzero every stored row is NaN (a fault the device detected: no plausible result leaves the kernel)."""
    if out_TD.dtype != torch.float32 or out_TD.dim() != 2 or src_RD.dim() != 2 or out_TD.shape[1] != src_RD.shape[1]:
        raise ValueError(f"gather_add: out {tuple(out_TD.shape)} {out_TD.dtype} must be 2-D fp32 with the width of "
                         f"src {tuple(src_RD.shape)}")
    for name, t in (("add", add_TD), ("dst", dst_TD)):
        if t is not None and (t.shape != out_TD.shape or not t.is_floating_point() or t.stride(1) != 1):
            raise ValueError(f"gather_add: {name} {tuple(t.shape)} {t.dtype} must be a float tensor shaped like out "
                             f"{tuple(out_TD.shape)} with contiguous rows")
    if slot_TP.dim() != 2 or slot_TP.shape[0] != out_TD.shape[0]:
        raise ValueError(f"gather_add: slot {tuple(slot_TP.shape)} must be [T={out_TD.shape[0]}, P]")
    loc = src_RD if local is None else local_RD
    if local is not None and (loc is None or loc.shape != src_RD.shape or loc.dtype != src_RD.dtype
                              or not 0 <= local < slot_TP.shape[1]):
        raise ValueError(f"gather_add: local={local} needs local_RD shaped like src {tuple(src_RD.shape)} "
                         f"{src_RD.dtype} and 0 <= local < P={slot_TP.shape[1]}")
    if out_TD.stride(1) != 1 or src_RD.stride(1) != 1 or loc.stride(1) != 1:
        raise ValueError("gather_add: rows of out, src and local must be contiguous (stride(1) == 1)")
    T, D = out_TD.shape
    if T == 0 or D == 0:
        return
    slot = slot_TP.contiguous()
    P = slot.shape[1]
    block, rows = _shape(D, tune)
    grid, warps = _launch(triton.cdiv(T, rows), rows, block, tune)
    if poison is not None and (poison.numel() != 1 or poison.dtype != torch.int64 or poison.device != out_TD.device):
        raise ValueError(f"gather_add: poison must be one int64 word on {out_TD.device}")
    add = out_TD if add_TD is None else add_TD
    dst = out_TD if dst_TD is None else dst_TD
    _gather_add_kernel[grid](out_TD, src_RD, loc, slot, add, dst, slot if poison is None else poison, D, T, P,
                             P if local is None else local,
                             out_TD.stride(0), src_RD.stride(0), loc.stride(0), add.stride(0), dst.stride(0),
                             BLOCK_D=block, NUM_BLOCKS=triton.cdiv(D, block), ROWS=rows, ACC=accumulate,
                             ADD=add_TD is not None, POISON=poison is not None, num_warps=warps)


def gather_add_torch(out_TD: torch.Tensor, src_RD: torch.Tensor, slot_TP: torch.Tensor,
                     local_RD: torch.Tensor | None = None, local: int | None = None, *,
                     accumulate: bool = True, add_TD: torch.Tensor | None = None,
                     dst_TD: torch.Tensor | None = None, poison: torch.Tensor | None = None) -> None:
    """The reference of ``gather_add`` in torch (``out_TD`` is written even with ``dst_TD``)."""
    if not accumulate:
        out_TD.zero_()
    for p in range(slot_TP.shape[1]):
        r = slot_TP[:, p]
        src = local_RD if p == local else src_RD
        out_TD += torch.where((r >= 0)[:, None], src[r.clamp(min=0)].float(), 0.0)
    if add_TD is not None:
        out_TD += add_TD.float()
    poison_rows(out_TD, poison)
    if dst_TD is not None:
        dst_TD.copy_(out_TD)


def poison_rows(t: torch.Tensor, poison: torch.Tensor | None) -> None:
    """``t`` = NaN where the one-element device word ``poison`` is nonzero (no host sync)."""
    if poison is not None:
        t.masked_fill_(poison.reshape(()) != 0, float("nan"))

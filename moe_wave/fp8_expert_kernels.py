"""The FP8 expert stage's glue kernels: rows into the aligned expert-major layout as FP8, and SwiGLU + requant.

Legend: R received rows, K slots per row, D hidden, I intermediate, e local experts, JA rows of the aligned
expert-major layout (its capacity), A the alignment of a group's first row (DeepGEMM's M block, 128).

The layout (``aligned_groups``): expert x's pairs take rows astart[x] .. astart[x] + count[x] - 1, with
astart[x] a multiple of A, so each expert's rows are whole GEMM row blocks, as DeepGEMM's grouped GEMMs want;
``pos_RK`` (``expert_kernels.expert_order`` with ``starts_e``) names each (row, slot) pair's row there, -1 for the
slots of no local expert. The rows between a group's end and the next group's start are padding that no kernel
writes and no consumer reads (a GEMM row depends only on its own input row).

    layout_groups(counts_e, cap, JA, max_m) a wave's groups in the aligned (max_m 0) or masked layout, their
                                           sizes, cut flags and block ends from the device counts, one launch
    quant_pairs(x_RD, pos_RK, JA)          q [JA, D] e4m3 and s [D/128, JA] fp32 (``moe_wave.fp8``'s activation
                                           format): each received row read once, quantised per 128 channels and
                                           written to the rows of its local pairs
    gather_pairs(p_RW, D, pos_RK, JA)      the same from rows that arrived quantised (``fp8_rows``' packed rows):
                                           each pair's e4m3 row and scales copied, no arithmetic
    swiglu_quant(gu_J2I, starts, ends, lim) the V4 SwiGLU (gate clamped from above, up both ways) of each group
                                           row in fp32, quantised the same way for the second GEMM: hq [JA, I],
                                           hs [I/128, JA]; by 128-row blocks of the layout (``block_ends``)
    swiglu_quant_rows(gu_M2I, lim)         the same for every row of a dense [M, 2I] (the shared expert): hq
                                           [M, I], hs [I/128, M], ``act_quant``'s format
    gate_up_swiglu(q, s, w, ws, starts, bend, lim) the first GEMM and ``swiglu_quant`` in one kernel: each
                                           program's [gate | up] tile (BM rows x 128 channels of each) is
                                           computed from the FP8 rows and weights with their block scales and
                                           turned into h's e4m3 values and scales in registers, gu never written;
                                           the rows from the layout, or (src_J) from the received FP8 rows

Each has a torch twin (``*_torch``) with the same bits; tests/test_fp8_experts.py compares them on CPU under
``TRITON_INTERPRET=1``. The kernels' grids are capped by the SM count and loop over the rows; a row's K
positions are loaded once, each step takes several 128-channel blocks, and a step's results go to every pair of
the row in one masked store.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from moe_wave.comm.backend import rows_of
from moe_wave.comm.triton_gate import interpreting, sm_count, tl, triton, triton_ok

from .fp8_quant import BLOCK, FP8, act_quant_torch, dequant_act, dequant_weight

__all__ = ["ALIGN", "Groups", "layout_groups", "layout_groups_torch", "aligned_groups", "masked_groups", "quant_pairs",
           "quant_pairs_torch", "gather_pairs", "gather_pairs_torch", "swiglu_quant", "swiglu_quant_torch",
           "aligned_capacity", "block_ends", "gate_up_swiglu", "gate_up_swiglu_torch", "swiglu_quant_rows",
           "swiglu_quant_rows_torch"]

ALIGN = 128
ROW_PROGRAMS_PER_SM = 8
# gate_up_swiglu's software pipeline's stages (4 measured faster than 2 and 3; 5 passes 228 KiB of shared memory at
# 128-row tiles), warps (8 faster than 4) and programs an SM (2 no faster)
GATE_UP_STAGES = 4
GATE_UP_WARPS = 8
GATE_UP_PROGRAMS_PER_SM = 1
# swiglu_quant_rows takes one 128-channel block a step below this many programs an SM with two (measured faster at
# 128 and 2048 rows of the shared expert's 2048 and 3072 channels, two as fast or faster at 8192 rows)
SWIGLU_ROWS_PROGRAMS_PER_SM = 4
# swiglu_quant splits each 128-row block of the layout over this many programs (32 rows each): one wave of four
# holds a quarter of the pairs, and with a program per block too few loads were in flight (dev/probe_wave_glue.py,
# one H100: a wave's 34.8 -> 22.2 us at V4-Flash's 32 local experts and 2048 tokens; the same or less at every
# size and W = 1)
SWIGLU_ROW_SPLIT = 4
# gather_pairs copies up to this many 128-channel blocks of a row a step, and where that is the whole row, runs this
# many programs an SM (dev/probe_wave_glue.py, one H100, V4-Flash's 4096 channels: 0.88-1.00 x at W = 1 and
# 0.82-0.88 x on one wave of four against 8 blocks and 8 programs; quant_pairs, which quantises, keeps 8 and 8)
PAIRS_PACKED_BLOCKS = 32
PAIRS_ROW_PROGRAMS_PER_SM = 4


def aligned_capacity(pairs: int, e: int, align: int = ALIGN) -> int:
    """Rows of the aligned layout that hold ``pairs`` pairs over ``e`` experts in the worst case (every nonempty
    group padded by align - 1), rounded up to a whole block."""
    worst = pairs + min(e, pairs) * (align - 1)
    return max(align, -(-worst // align) * align)


def aligned_groups(offs_e: torch.Tensor, align: int = ALIGN) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts_e int32 [e], ends_e int32 [e]) of the aligned layout from the cumulative group ends ``offs_e``:
    group x starts at the sum of the earlier groups' counts, each rounded up to ``align``, and ends (exclusive)
    count[x] rows later. ``ends_e`` is DeepGEMM's psum layout (group x is rows align_up(ends[x-1]) .. ends[x])."""
    cnt = torch.diff(offs_e.to(torch.int32), prepend=offs_e.new_zeros(1, dtype=torch.int32))
    padded = (cnt + (align - 1)) // align * align
    starts = torch.cumsum(padded, 0, dtype=torch.int32) - padded
    return starts, starts + cnt


def _group_rows(JA: int, group_rows: int | None, what: str) -> int:
    if group_rows is None:
        return max(JA, 1)
    if group_rows <= 0 or JA % group_rows or group_rows % ALIGN:
        raise ValueError(f"{what}: group_rows={group_rows}: must be a multiple of {ALIGN} that divides the layout's "
                         f"rows {JA}")
    return group_rows


def masked_groups(offs_e: torch.Tensor, max_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts_e, ends_e) int32 of the masked layout: expert x's rows at x * max_m .. x * max_m + count[x] - 1
    (DeepGEMM's ``m_grouped_fp8_gemm_nt_masked`` on [e, max_m, .] views); max_m % 128 == 0 and >= every count."""
    cnt = torch.diff(offs_e.to(torch.int32), prepend=offs_e.new_zeros(1, dtype=torch.int32))
    starts = torch.arange(cnt.numel(), device=offs_e.device, dtype=torch.int32) * max_m
    return starts, starts + cnt


def quant_pairs_torch(x_RD: torch.Tensor, pos_RK: torch.Tensor, JA: int,
                      local: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant_pairs`` by torch ops (rows of the layout that no pair takes are zeros here, where the kernel leaves
    them unwritten)."""
    R, K = pos_RK.shape
    D = x_RD.shape[1]
    q = torch.zeros(JA, D, dtype=FP8, device=x_RD.device)
    s = torch.zeros(D // BLOCK, JA, dtype=torch.float32, device=x_RD.device)
    ok = (pos_RK >= 0) & (pos_RK < JA)
    r = torch.arange(R, device=x_RD.device)[:, None].expand(R, K)[ok]
    p = pos_RK[ok]
    q[p], s[:, p] = act_quant_torch(rows_of(x_RD, r, local))
    return q, s


def gather_pairs_torch(p_RW: torch.Tensor, D: int, pos_RK: torch.Tensor, JA: int,
                       local: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``gather_pairs`` by torch ops (unused rows zeros)."""
    from .fp8_rows import unpack_rows

    R, K = pos_RK.shape
    q = torch.zeros(JA, D, dtype=FP8, device=p_RW.device)
    s = torch.zeros(D // BLOCK, JA, dtype=torch.float32, device=p_RW.device)
    ok = (pos_RK >= 0) & (pos_RK < JA)
    r = torch.arange(R, device=p_RW.device)[:, None].expand(R, K)[ok]
    p = pos_RK[ok]
    q_R, s_R = unpack_rows(rows_of(p_RW, r, local), D)
    q[p], s[:, p] = q_R, s_R.t()
    return q, s


def swiglu_quant_torch(gu_J2I: torch.Tensor, starts_e: torch.Tensor, ends_e: torch.Tensor,
                       limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``swiglu_quant`` by torch ops (rows outside the groups zeros)."""
    JA, I2 = gu_J2I.shape
    I = I2 // 2
    j = torch.arange(JA, device=gu_J2I.device)
    p = j[((j[:, None] >= starts_e[None, :]) & (j[:, None] < ends_e[None, :])).any(1)]
    gate, up = gu_J2I[p, :I].float(), gu_J2I[p, I:].float()
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    hq = torch.zeros(JA, I, dtype=FP8, device=gu_J2I.device)
    hs = torch.zeros(I // BLOCK, JA, dtype=torch.float32, device=gu_J2I.device)
    hq[p], hs[:, p] = act_quant_torch(F.silu(gate) * up)
    return hq, hs


def gate_up_swiglu_torch(q_JD: torch.Tensor, s: torch.Tensor, w_eND: torch.Tensor, ws: torch.Tensor,
                         starts_e: torch.Tensor, ends_e: torch.Tensor, limit: float,
                         group_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up_swiglu`` by torch ops: each group's gu = bf16(dequantised rows @ dequantised weights^T) in fp32
    (the kernel's bits wherever the sums are exact in fp32; its block-by-block promotion adds in another order
    elsewhere), then ``swiglu_quant_torch``'s SwiGLU and quantisation (hs [I/128, JA] whatever group_rows). Rows
    outside the groups zeros."""
    JA, D = q_JD.shape
    I = w_eND.shape[1] // 2
    _group_rows(JA, group_rows, "gate_up_swiglu")
    s_DJ = s if group_rows is None else s.permute(1, 0, 2).reshape(D // BLOCK, JA)
    gu = torch.zeros(JA, 2 * I, dtype=torch.bfloat16, device=q_JD.device)
    for x, (a, b) in enumerate(zip(starts_e.tolist(), ends_e.tolist())):
        if b > a:
            gu[a:b] = (dequant_act(q_JD[a:b], s_DJ[:, a:b]) @ dequant_weight(w_eND[x], ws[x]).t()).to(torch.bfloat16)
    return swiglu_quant_torch(gu, starts_e, ends_e, limit)


def block_ends(starts_e: torch.Tensor, ends_e: torch.Tensor, JA: int, align: int = ALIGN) -> torch.Tensor:
    """int32 [JA / align]: for each ``align``-row block of the layout, the end (exclusive) of the group it belongs
    to, or its own start where it holds no group's row (padding, or past the last group): the block's rows in use
    are [b * align, min(b * align + align, end)). Groups start at multiples of ``align`` in increasing order (the
    aligned layout, or the masked one's x * max_m); a block belongs to the last group starting at or before it.
    On the device, no host sync."""
    nb = JA // align
    b0 = torch.arange(nb, device=starts_e.device, dtype=torch.int32) * align
    x = torch.searchsorted(starts_e.to(torch.int32).contiguous(), b0, right=True) - 1     # the group of block b
    return torch.maximum(ends_e.to(torch.int32)[x.clamp_min(0)], b0)


class Groups(NamedTuple):
    """A wave's groups in one layout of the FP8 stage, from one launch (``layout_groups``); int32 views of one
    buffer. offs: the cumulative group sizes (``expert_order``'s offs_e); starts, ends: each group's rows (ends
    is the contiguous GEMMs' psum layout); m: each group's size (the masked GEMMs' masked_m); over: 1 where an
    expert's pairs passed max_m (masked layout; 0 in the aligned one); n [1]: the rows the weighted sum may read
    (the aligned layout's last end; the masked layout's JA: its pairs lie below, its lost ones at pos LOST); bend:
    ``block_ends``."""
    offs: torch.Tensor
    starts: torch.Tensor
    ends: torch.Tensor
    m: torch.Tensor
    over: torch.Tensor
    n: torch.Tensor
    bend: torch.Tensor


def layout_groups(counts_e: torch.Tensor, cap: int, JA: int, max_m: int = 0) -> Groups:
    """The groups of the aligned layout (max_m 0: ``aligned_groups``) or the masked one (``masked_groups``, each
    count cut at max_m) from a wave's device pair counts per expert (int [e]), their running sum clamped to
    ``cap`` pairs (a capacity overflow, reported elsewhere, must not send a group past them), for a layout of JA
    rows, with ``block_ends``: what ``layout_groups_torch`` computes in about twenty small launches, in one."""
    e = counts_e.numel()
    if JA % ALIGN or max_m % ALIGN or max_m < 0 or e < 1:
        raise ValueError(f"layout_groups: JA={JA}, max_m={max_m}, {e} experts: JA and max_m must be multiples of "
                         f"{ALIGN} (max_m >= 0) over at least one expert")
    nblk = JA // ALIGN
    buf = torch.empty(5 * e + 1 + nblk, dtype=torch.int32, device=counts_e.device)
    be = max(16, triton.next_power_of_2(e))
    bb = max(1, min(64, 8192 // be))
    _groups_kernel[(max(1, triton.cdiv(nblk, bb)),)](counts_e.contiguous(), buf, e, cap, max_m, nblk, JA,
                                                    MASKED=max_m > 0, BE=be, BB=bb, num_warps=4)
    return _groups_of(buf, e)


def _groups_of(buf: torch.Tensor, e: int) -> Groups:
    m, offs, starts, ends, over = buf[:5 * e].view(5, e).unbind(0)
    return Groups(offs, starts, ends, m, over, buf[5 * e:5 * e + 1], buf[5 * e + 1:])


def layout_groups_torch(counts_e: torch.Tensor, cap: int, JA: int, max_m: int = 0) -> Groups:
    """``layout_groups`` by torch ops (``aligned_groups`` / ``masked_groups`` and ``block_ends``)."""
    offs = counts_e.cumsum(0).clamp(max=cap).to(torch.int32)
    cnt = torch.diff(offs, prepend=offs.new_zeros(1))
    if max_m:
        offs = torch.cumsum(cnt.clamp(max=max_m), 0, dtype=torch.int32)
        starts, ends = masked_groups(offs, max_m)
        n = torch.full((1,), JA, dtype=torch.int32, device=offs.device)
    else:
        starts, ends = aligned_groups(offs)
        n = ends[-1:]
    over = (cnt > max_m).to(torch.int32) if max_m else torch.zeros_like(cnt)
    buf = torch.cat([ends - starts, offs, starts, ends, over, n, block_ends(starts, ends, JA)]).to(torch.int32)
    return _groups_of(buf, counts_e.numel())


def _grid(R: int, device: torch.device, per_sm: int = ROW_PROGRAMS_PER_SM) -> int:
    if device.type != "cuda":
        return max(1, min(R, 16))
    return max(1, min(R, per_sm * sm_count(device)))


def _check_pos(pos_RK: torch.Tensor, R: int) -> torch.Tensor:
    if pos_RK.dim() != 2 or pos_RK.shape[0] != R:
        raise ValueError(f"pos_RK {tuple(pos_RK.shape)}: must be [R={R}, K]")
    return pos_RK.contiguous()


def _blocks_per_step(C: int, most: int) -> int:
    """128-channel blocks a kernel step takes: the largest power of two <= most that divides C / 128."""
    nb = 1
    while nb * 2 <= most and (C // BLOCK) % (nb * 2) == 0:
        nb *= 2
    return nb


def _rows_to_pairs(src: tuple, row0: int, loc: tuple | None, pos: torch.Tensor, R: int, D: int, JA: int,
                   packed: bool, device, group_rows: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    G = _group_rows(JA, group_rows, "gather_pairs" if packed else "quant_pairs")
    q = torch.empty(JA, D, dtype=FP8, device=device)
    s = torch.empty((D // BLOCK, JA) if group_rows is None else (JA // G, D // BLOCK, G), dtype=torch.float32,
                    device=device)
    if R and D:
        L = 0 if loc is None else loc[0].shape[0]
        loc = src if not L else loc
        K = pos.shape[1]
        nb = _blocks_per_step(D, PAIRS_PACKED_BLOCKS if packed else 8)
        per_sm = PAIRS_ROW_PROGRAMS_PER_SM if packed and nb * BLOCK == D else ROW_PROGRAMS_PER_SM
        _pairs_kernel[(_grid(R, device, per_sm),)](
            src[0], src[1], src[0].stride(0), src[1].stride(0), loc[0], loc[1], loc[0].stride(0), loc[1].stride(0),
            row0, L, pos, q, s, R, K, D, G, JA, KP=triton.next_power_of_2(K), NB=nb, PACKED=packed,
            INTERP=interpreting(), num_warps=8)
    return q, s


def quant_pairs(x_RD: torch.Tensor, pos_RK: torch.Tensor, JA: int, local: tuple | None = None,
                group_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [JA, D] e4m3, s [D/128, JA] fp32): row pos[r, k] of q is x[r] quantised per 128 channels (pow2 scales,
    ``moe_wave.fp8``'s format), for every slot with 0 <= pos < JA (a position past the layout, the masked
    layout's lost pairs, is not written); the other rows are left as allocated. ``local`` =
    (row0, x_LD) (``Received.local``): rows row0 .. row0 + L - 1 are read from x_LD. D % 128 == 0.
    ``group_rows`` = G: s is [JA / G, D/128, G] instead (each group's scales MN-major: the masked layout's)."""
    R, D = x_RD.shape
    if D % BLOCK:
        raise ValueError(f"quant_pairs: D={D} must be a multiple of {BLOCK}")
    pos = _check_pos(pos_RK, R)
    row0, loc = (0, None) if local is None or not local[1].numel() else local
    if loc is not None and (loc.shape[1] != D or loc.dtype != x_RD.dtype or loc.stride(1) != 1):
        raise ValueError(f"quant_pairs: local rows {tuple(loc.shape)} {loc.dtype} must be [L, {D}] {x_RD.dtype} "
                         f"rows with unit channel stride")
    x = x_RD if x_RD.stride(1) == 1 else x_RD.contiguous()
    return _rows_to_pairs((x, x), row0, None if loc is None else (loc, loc), pos, R, D, JA, False, x_RD.device,
                          group_rows)


def gather_pairs(p_RW: torch.Tensor, D: int, pos_RK: torch.Tensor, JA: int, local: tuple | None = None,
                 group_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant_pairs`` for rows that arrived quantised (``fp8_rows``' packed rows of D channels, [R, Dw] bf16):
    each pair's row of q and column of s copied from its row's e4m3 values and scales, no arithmetic. ``local``
    = (row0, packed rows [L, Dw]) as ``Received.local``."""
    from .fp8_rows import unpack_rows

    R = p_RW.shape[0]
    pos = _check_pos(pos_RK, R)
    row0, loc = (0, None) if local is None or not local[1].numel() else local
    return _rows_to_pairs(unpack_rows(p_RW, D), row0, None if loc is None else unpack_rows(loc, D), pos, R, D, JA,
                          True, p_RW.device, group_rows)


def swiglu_quant(gu_J2I: torch.Tensor, starts_e: torch.Tensor | None, ends_e: torch.Tensor | None, limit: float,
                 group_rows: int | None = None, bend: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(hq [JA, I] e4m3, hs [I/128, JA] fp32): for every row of the groups (rows starts[x] .. ends[x] - 1 of
    expert x, the aligned layout), h = silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32 from the row's
    [gate | up] (limit <= 0: no clamp), quantised per 128 channels; the padding rows are left as allocated. By
    128-row blocks of the layout (each within one group: ``block_ends``; SWIGLU_ROW_SPLIT programs a block), dense
    rows, no pair positions: the cost follows the pairs, whatever number of slots each received row has.
    I % 128 == 0, JA % 128 == 0.
    ``group_rows`` = G: hs is [JA / G, I/128, G] (as ``quant_pairs``'). ``bend``: the layout's ``block_ends``
    where the caller has them (``layout_groups``), in place of starts and ends."""
    JA, I2 = gu_J2I.shape
    I = I2 // 2
    if bend is None and (starts_e is None or ends_e is None):
        raise ValueError("swiglu_quant: starts_e and ends_e are needed where bend (the block ends) is not given")
    if I % BLOCK or I2 % 2 or JA % ALIGN:
        raise ValueError(f"swiglu_quant: gu {tuple(gu_J2I.shape)}: must be [JA, 2 * I] with I a multiple of {BLOCK} "
                         f"and JA of {ALIGN}")
    G = _group_rows(JA, group_rows, "swiglu_quant")
    hq = torch.empty(JA, I, dtype=FP8, device=gu_J2I.device)
    hs = torch.empty((I // BLOCK, JA) if group_rows is None else (JA // G, I // BLOCK, G), dtype=torch.float32,
                     device=gu_J2I.device)
    if JA and I:
        nb = _blocks_per_step(I, 2)
        _swiglu_quant_kernel[(JA // ALIGN * SWIGLU_ROW_SPLIT, I // (nb * BLOCK))](
            gu_J2I, block_ends(starts_e, ends_e, JA) if bend is None else bend, JA, hq, hs, I, G, float(limit),
            BR=16, NB=nb, BEND=True, CLAMP=limit > 0, INTERP=interpreting(), RS=SWIGLU_ROW_SPLIT, num_warps=4)
    return hq, hs


def swiglu_quant_rows(gu_M2I: torch.Tensor, limit: float,
                      kernels: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The V4 SwiGLU of every row of gu [M, 2I] (gate | up, e.g. a dense projection's bf16 output) in fp32,
    quantised for the next FP8 GEMM in ``act_quant``'s format: (hq [M, I] e4m3, hs [I/128, M] fp32). One launch
    of ``swiglu_quant``'s kernel over all M rows (any M) where Triton runs (``kernels`` None or True; False, or
    no Triton: ``swiglu_quant_rows_torch``, the torch ops). I % 128 == 0."""
    M, I2 = gu_M2I.shape
    I = I2 // 2
    if I % BLOCK or I2 % 2:
        raise ValueError(f"swiglu_quant_rows: gu {tuple(gu_M2I.shape)}: must be [M, 2 * I] with I a multiple of "
                         f"{BLOCK}")
    if kernels is False or not triton_ok(gu_M2I.device, want=kernels):
        return swiglu_quant_rows_torch(gu_M2I, limit)
    gu = gu_M2I.contiguous()
    hq = torch.empty(M, I, dtype=FP8, device=gu.device)
    hs = torch.empty(I // BLOCK, M, dtype=torch.float32, device=gu.device)
    if M and I:
        blocks = -(-M // ALIGN)     # two channel blocks a step where that still gives every SM 4 programs, else one
        sms = sm_count(gu.device) if gu.is_cuda else 1
        nb = _blocks_per_step(I, 2 if blocks * (I // (2 * BLOCK)) >= SWIGLU_ROWS_PROGRAMS_PER_SM * sms else 1)
        _swiglu_quant_kernel[(blocks, I // (nb * BLOCK))](
            gu, hs, M, hq, hs, I, M, float(limit), BR=16, NB=nb, BEND=False, CLAMP=limit > 0,
            INTERP=interpreting(), num_warps=4)
    return hq, hs


def swiglu_quant_rows_torch(gu_M2I: torch.Tensor, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``swiglu_quant_rows`` by torch ops."""
    from .experts import swiglu

    I = gu_M2I.shape[1] // 2
    gu = gu_M2I.float()
    return act_quant_torch(swiglu(gu[:, :I], gu[:, I:], limit))


def gate_up_swiglu(q: torch.Tensor, s: torch.Tensor, w_eND: torch.Tensor, ws: torch.Tensor,
                   starts_e: torch.Tensor, bend: torch.Tensor, limit: float, group_rows: int | None = None,
                   src_J: torch.Tensor | None = None, local: tuple | None = None,
                   n: torch.Tensor | None = None, bm: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``swiglu_quant`` of the first grouped GEMM's rows without the GEMM's bf16 rows: (hq [JA, I] e4m3, hs
    [I/128, JA] fp32, or [JA / G, I/128, G] with ``group_rows`` = G) from FP8 rows and the experts' [gate | up]
    weights w_eND [e, 2I, D] e4m3 with their 128 x 128 block scales ws [e, 2I/128, D/128]. The rows:

    - src_J None: q [JA, D] and s, the layout's rows and scales (``quant_pairs``' format and group_rows);
    - src_J [JA] (``expert_order``'s, with the layout's starts): row j of the layout is row src_J[j] of the
      received FP8 rows q [R, D] e4m3 with their scales s [R, D/128] fp32 (``fp8_rows.unpack_rows``' views, any
      row strides), read where they arrived: no copy into the layout. ``local`` = (row0, q_L, s_L): rows row0 ..
      row0 + L - 1 are read from those views instead (``Received.local``'s packed rows, unpacked).

    Tile (t, b) takes rows b * bm .. of the layout (``bm`` 64 or 128; the rows up to their group's end, ``bend``;
    the group, the last one starting at or before them, from ``starts_e``) and h's channels t * 128 ..: per
    128-channel block of D it adds the e4m3 product of the rows with the gate's and the up's weight rows, times the
    row's and the weight block's scales (the GEMM's promotion in fp32), rounds gu to bf16 as the GEMM writes it,
    and turns it into h's e4m3 values and scale in registers. ``GATE_UP_PROGRAMS_PER_SM`` programs an SM take the
    tiles in turn, the channel tile fastest (a block of rows is read from memory once and from L2 by its other
    tiles), up to the layout's rows in use, ``n`` (``Groups.n``; default JA): the capacity's empty tail costs no
    launch.
    D % 128 == I % 128 == JA % 128 == 0."""
    e, I2, D = w_eND.shape
    I = I2 // 2
    JA = q.shape[0] if src_J is None else src_J.shape[0]
    if (q.shape[1] != D or I % BLOCK or I2 % 2 or JA % ALIGN or D % BLOCK or ws.shape != (e, I2 // BLOCK, D // BLOCK)
            or q.stride(1) != 1):
        raise ValueError(f"gate_up_swiglu: rows {tuple(q.shape)}, weights {tuple(w_eND.shape)}, scales "
                         f"{tuple(ws.shape)}: must be [rows, D] (unit channel stride), [e, 2I, D] and "
                         f"[e, 2I/128, D/128] with I and D multiples of {BLOCK} and the layout's rows of {ALIGN}")
    if bm not in (64, 128):
        raise ValueError(f"gate_up_swiglu: bm={bm}: must be 64 or 128")
    G = _group_rows(JA, group_rows, "gate_up_swiglu")
    hq = torch.empty(JA, I, dtype=FP8, device=q.device)
    hs = torch.empty((I // BLOCK, JA) if group_rows is None else (JA // G, I // BLOCK, G), dtype=torch.float32,
                     device=q.device)
    DB = D // BLOCK
    if src_J is None:           # the layout's scales: (j // G) * DB * G + kb * G + j % G
        sa = (G, DB * G, 1, G)
    else:                       # a row's scales: s[r, kb]
        if s.shape != (q.shape[0], DB) or s.stride(1) != 1:
            raise ValueError(f"gate_up_swiglu: row scales {tuple(s.shape)} stride {s.stride()}: must be "
                             f"[{q.shape[0]}, {DB}] with unit stride along D/128")
        sa = (1 << 30, 0, s.stride(0), 1)
    row0, (lq, ls) = (0, (q, s)) if local is None or not local[1].numel() else (local[0], local[1:])
    L = 0 if local is None else local[1].shape[0]
    if JA and I and e:
        if n is None:
            n = torch.full((1,), JA, dtype=torch.int32, device=q.device)
        tiles = I // BLOCK * (JA // bm)
        progs = min(tiles, GATE_UP_PROGRAMS_PER_SM * sm_count(q.device)) if q.is_cuda else min(tiles, 16)
        _gate_up_kernel[(progs,)](
            q, q.stride(0), s, *sa, src_J if src_J is not None else q, lq, lq.stride(0), ls, ls.stride(0), row0, L,
            w_eND, ws, starts_e, bend, n, hq, hs, e, D, I, G, float(limit), BM=bm,
            BE=max(16, triton.next_power_of_2(e)), SRC=src_J is not None, CLAMP=limit > 0, INTERP=interpreting(),
            num_warps=GATE_UP_WARPS, num_stages=GATE_UP_STAGES)
    return hq, hs


if triton is not None:
    from .fp8_quant import e4m3_rne, pow2_scale_bits

    @triton.jit
    def _quant_tile(v, KP: tl.constexpr, NB: tl.constexpr, INTERP: tl.constexpr):
        # (q e4m3, s fp32 [KP, NB]) of a [KP, NB * 128] fp32 tile: one pow2 scale per row and 128 channels
        # (moe_wave.fp8's activation format)
        v3 = tl.reshape(v, [KP, NB, 128])
        sbits, ibits = pow2_scale_bits(tl.maximum(tl.max(tl.abs(v3), axis=2), 1e-4))
        z = v3 * ibits.to(tl.float32, bitcast=True)[:, :, None]
        if INTERP:                      # the interpreter's float8 cast is off (fp8.e4m3_rne)
            q = e4m3_rne(z)
        else:
            q = z.to(tl.float8e4nv)
        return tl.reshape(q, [KP, NB * 128]), sbits.to(tl.float32, bitcast=True)

    @triton.jit
    def _pairs_kernel(q_src, s_src, sq_row, ss_row, q_loc, s_loc, lq_row, ls_row, ROW0, L, pos_ptr, q_ptr, s_ptr,
                      R, K, D, G, JA, KP: tl.constexpr, NB: tl.constexpr, PACKED: tl.constexpr,
                      INTERP: tl.constexpr):
        # rows r = pid, pid + programs, ...: the row's K positions loaded once; a row with a local pair is read
        # once, NB 128-channel blocks a step, and each step's e4m3 values and scales stored at every pair's row in
        # one masked store. PACKED: the source holds e4m3 values (q_src) and scales (s_src) already (fp8_rows);
        # else q_src is the bf16 rows, quantised here. Rows ROW0 .. ROW0 + L - 1 come from the *_loc pointers.
        # The scales go in groups of G rows: [JA / G, D / 128, G] (G = JA: [D / 128, JA]). Positions outside
        # [0, JA) are not written.
        kk = tl.arange(0, KP)
        c = tl.arange(0, NB * 128)
        nb = tl.arange(0, NB)
        for rr in range(tl.program_id(0), R, tl.num_programs(0)):
            r = tl.zeros([], tl.int64) + rr
            p = tl.load(pos_ptr + r * K + kk, mask=kk < K, other=-1)
            ok = (p >= 0) & (p < JA)
            if tl.max(ok.to(tl.int32), axis=0) != 0:
                if (r >= ROW0) & (r < ROW0 + L):
                    qb = q_loc + (r - ROW0) * lq_row
                    sb = s_loc + (r - ROW0) * ls_row
                else:
                    qb = q_src + r * sq_row
                    sb = s_src + r * ss_row
                for d0 in range(0, D, NB * 128):
                    if PACKED:
                        q = tl.load(qb + d0 + c)[None, :]
                        sc = tl.load(sb + d0 // 128 + nb)[None, :]
                    else:
                        q, sc = _quant_tile(tl.load(qb + d0 + c).to(tl.float32)[None, :], 1, NB, INTERP)
                    tl.store(q_ptr + p[:, None] * D + d0 + c[None, :], q, mask=ok[:, None])
                    pg = p.to(tl.int64)[:, None]
                    tl.store(s_ptr + (pg // G) * (D // 128) * G + (d0 // 128 + nb[None, :]).to(tl.int64) * G + pg % G,
                             sc, mask=ok[:, None])

    @triton.jit
    def _groups_kernel(cnt_ptr, out_ptr, E, CAP, G, NBLK, N_MASKED, MASKED: tl.constexpr, BE: tl.constexpr,
                       BB: tl.constexpr):
        # every program scans the E counts (out: [m | offs | starts | ends | over] E each, n, then the NBLK block
        # ends; program 0 writes the first six) and writes BB block ends: the end of the last group starting at
        # or before the block (groups start in increasing order, so their ends never decrease: the largest end
        # among them), or the block's start where that end is before it
        x = tl.arange(0, BE)
        mx = x < E
        c = tl.load(cnt_ptr + x, mask=mx, other=0).to(tl.int64)
        inc = tl.cumsum(c, 0)
        cnt = (tl.minimum(inc, CAP) - tl.minimum(inc - c, CAP)).to(tl.int32)
        if MASKED:
            m = tl.minimum(cnt, G)
            starts = x * G
            offs = tl.cumsum(m, 0)
            over = (cnt > G).to(tl.int32)
        else:
            m = cnt
            pad = (cnt + 127) // 128 * 128
            starts = tl.cumsum(pad, 0) - pad
            offs = tl.minimum(inc, CAP).to(tl.int32)
            over = tl.zeros([BE], tl.int32)
        ends = starts + m
        if tl.program_id(0) == 0:
            tl.store(out_ptr + x, m, mask=mx)
            tl.store(out_ptr + E + x, offs, mask=mx)
            tl.store(out_ptr + 2 * E + x, starts, mask=mx)
            tl.store(out_ptr + 3 * E + x, ends, mask=mx)
            tl.store(out_ptr + 4 * E + x, over, mask=mx)
            if MASKED:
                tl.store(out_ptr + 5 * E, N_MASKED)
            else:
                tl.store(out_ptr + 5 * E, tl.max(tl.where(mx, ends, 0), 0))
        b = tl.program_id(0) * BB + tl.arange(0, BB)
        b0 = b * 128
        sel = (starts[None, :] <= b0[:, None]) & mx[None, :]
        last = tl.max(tl.where(sel, ends[None, :], 0), 1)
        tl.store(out_ptr + 5 * E + 1 + b, tl.maximum(last, b0), mask=b < NBLK)

    @triton.jit
    def _swiglu_quant_kernel(gu_ptr, bend_ptr, M, hq_ptr, hs_ptr, I, G, limit, BR: tl.constexpr, NB: tl.constexpr,
                             BEND: tl.constexpr, CLAMP: tl.constexpr, INTERP: tl.constexpr, RS: tl.constexpr = 1):
        # program (b * RS + s, t): part s of RS of the 128-row block b of the aligned layout (its rows in use, up to
        # its group's end; without BEND the rows below M) by channels t * NB * 128 ..: BR rows a step, each
        # [BR, NB * 128] tile of gate / up turned and quantised per row and 128 channels; the scales in groups of G
        # rows as _pairs_kernel's
        blk = tl.program_id(0) // RS
        b0 = blk * 128
        s0 = (tl.program_id(0) % RS) * (128 // RS)
        i0 = tl.program_id(1) * NB * 128
        if BEND:
            n = tl.minimum(tl.load(bend_ptr + blk) - b0, 128)
        else:
            n = tl.minimum(M - b0, 128)
        n = tl.minimum(n, s0 + 128 // RS)
        c = tl.arange(0, NB * 128)
        nb = tl.arange(0, NB)
        for r0 in range(s0, n, BR):
            rows = b0 + r0 + tl.arange(0, BR)
            ok = (r0 + tl.arange(0, BR)) < n
            row = gu_ptr + rows.to(tl.int64)[:, None] * 2 * I + i0 + c[None, :]
            gate = tl.load(row, mask=ok[:, None], other=0.0).to(tl.float32)
            up = tl.load(row + I, mask=ok[:, None], other=0.0).to(tl.float32)
            q, sc = _quant_tile(_swiglu(gate, up, limit, CLAMP), BR, NB, INTERP)
            tl.store(hq_ptr + rows.to(tl.int64)[:, None] * I + i0 + c[None, :], q, mask=ok[:, None])
            rg = rows.to(tl.int64)[:, None]
            tl.store(hs_ptr + (rg // G) * (I // 128) * G + (i0 // 128 + nb[None, :]).to(tl.int64) * G + rg % G, sc,
                     mask=ok[:, None])

    @triton.jit
    def _swiglu(gate, up, limit, CLAMP: tl.constexpr):
        # V4's SwiGLU in fp32: silu(min(gate, limit)) * clamp(up, -limit, limit) (CLAMP), else silu(gate) * up
        if CLAMP:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        return gate / (1.0 + tl.exp(-gate)) * up

    @triton.jit
    def _bf16_round(v, INTERP: tl.constexpr):
        # fp32 v rounded to bf16 (nearest even) and back: the interpreter's bf16 cast does not round to nearest,
        # so there by integer ops on the bits (finite values)
        if INTERP:
            b = v.to(tl.int32, bitcast=True)
            return ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        return v.to(tl.bfloat16).to(tl.float32)

    @triton.jit
    def _gate_up_kernel(a_ptr, a_row, sa_ptr, SA_G, SA_GS, SA_R, SA_K, src_ptr, la_ptr, la_row, lsa_ptr, lsa_row,
                        ROW0, L, w_ptr, ws_ptr, starts_ptr, bend_ptr, n_ptr, hq_ptr, hs_ptr, E, D, I, G, limit,
                        BM: tl.constexpr, BE: tl.constexpr, SRC: tl.constexpr, CLAMP: tl.constexpr,
                        INTERP: tl.constexpr):
        # tiles pid, pid + programs, .. up to the rows in use (n_ptr): tile (t, b), t fastest, is rows b * BM .. of
        # the layout (those in use: up to their 128-row block's group end) by h's channels t * 128 ..; two
        # [BM, 128] fp32 accumulators (gate, up), each 128-channel step of D promoted by the row's and the weight
        # block's scales; then SwiGLU and the requant as _swiglu_quant_kernel's. The row's scale for step kb sits
        # at (r // SA_G) * SA_GS + (r % SA_G) * SA_R + kb * SA_K; SRC: the layout's row j is source row r = src[j]
        # (rows ROW0 .. ROW0 + L - 1 from the la / lsa pointers), else r = j
        NT = I // 128
        DB = D // 128
        x = tl.arange(0, BE)
        st = tl.load(starts_ptr + x, mask=x < E, other=0x7FFFFFFF)
        c = tl.arange(0, 128)
        tiles = (tl.load(n_ptr) + BM - 1) // BM * NT
        for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
            m0 = tile // NT * BM
            i0 = tile % NT * 128
            n = tl.minimum(tl.load(bend_ptr + m0 // 128) - m0, BM)
            if n > 0:
                ex = tl.max(tl.where(st <= m0, x, -1), 0).to(tl.int64)
                ok = tl.arange(0, BM) < n
                rows = (m0 + tl.arange(0, BM)).to(tl.int64)
                if SRC:
                    r = tl.load(src_ptr + rows, mask=ok, other=0).to(tl.int64)
                    here = (r >= ROW0) & (r < ROW0 + L)
                    a_rows = tl.where(here, la_ptr + (r - ROW0) * la_row, a_ptr + r * a_row)
                    sa_rows = tl.where(here, lsa_ptr + (r - ROW0) * lsa_row, sa_ptr + r * SA_R)
                else:
                    a_rows = a_ptr + rows * a_row
                    sa_rows = sa_ptr + (rows // SA_G) * SA_GS + (rows % SA_G) * SA_R
                g_ptrs = w_ptr + ex * 2 * I * D + (i0 + c).to(tl.int64)[:, None] * D + c[None, :]
                sw = ws_ptr + ex * (2 * I // 128) * DB + (i0 // 128) * DB
                acc_g = tl.zeros([BM, 128], tl.float32)
                acc_u = tl.zeros([BM, 128], tl.float32)
                for kb in range(0, DB):
                    a = tl.load(a_rows[:, None] + kb * 128 + c[None, :], mask=ok[:, None], other=0.0)
                    sa = tl.load(sa_rows + kb * SA_K, mask=ok, other=0.0)
                    bg = tl.load(g_ptrs + kb * 128)
                    bu = tl.load(g_ptrs + I * D + kb * 128)
                    sg = tl.load(sw + kb)
                    su = tl.load(sw + (I // 128) * DB + kb)
                    acc_g += tl.dot(a, tl.trans(bg)) * (sa[:, None] * sg)
                    acc_u += tl.dot(a, tl.trans(bu)) * (sa[:, None] * su)
                h = _swiglu(_bf16_round(acc_g, INTERP), _bf16_round(acc_u, INTERP), limit, CLAMP)
                q, sc = _quant_tile(h, BM, 1, INTERP)
                tl.store(hq_ptr + rows[:, None] * I + i0 + c[None, :], q, mask=ok[:, None])
                tl.store(hs_ptr + (rows // G) * (I // 128) * G + (i0 // 128) * G + rows % G, tl.reshape(sc, [BM]),
                         mask=ok)

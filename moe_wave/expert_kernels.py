"""The expert stage's kernels for device-side counts (fixed-capacity backends, CUDA graphs).

Legend: R received rows, K slots per row, J = R*K (row, slot) pairs sorted expert-major, n the valid
pairs (a device scalar: the last group offset), D hidden, I intermediate.

With counts on the device only, ``expert_rows`` cannot size anything by n on the host, so the torch
path gathers, activates, weights and sums all J pairs, with the invalid ones masked to zero. At 4096
tokens per rank, 2 ranks and top-6 that is about four times the valid pairs and several GB of memory
traffic per wave. These kernels read n on the device and skip the pairs past it, and find the expert-major
order without a sort (a stable argsort is a multi-pass radix sort, a fixed cost on every wave):

    expert_order(expert_RK, e, offs_e)    src[p] = r and pos[r, k] = p for the pair (r, k) at position p of
                                          the expert-major order (the stable argsort's, when offs_e holds
                                          the actual group ends); pos -1 for slots of no local expert. Three
                                          launches over blocks of BLOCK_J pairs: per-block expert histograms,
                                          their prefix over the blocks, then per pair that plus an in-block rank
    gather_rows(x_RD, src_J, n, local)    xs[j] = x[src[j]] for j < n (rows past n untouched; rows
                                          that ``local`` holds read there)
    swiglu_rows(gu_J2I, limit, n)         the V4 SwiGLU (clamped gate and up) for j < n
                                          (both: a grid capped by the SM count, each program looping over rows
                                          j = pid, pid + programs, ... below n: launch cost follows n, not J)
    weighted_sum(out_JD, pos_RK, w_RK, n) y[r] = sum over k in order of w[r, k] * out[pos[r, k]] for
                                          the slots with pos < n, in fp32; rows with none are 0, rows with a
                                          slot at pos LOST (a pair that found no room) NaN

Each has a torch twin (``*_torch``) with the same meaning; tests/test_moe.py and tests/test_expert_order.py
compare them (on CPU under ``TRITON_INTERPRET=1``). The kernels run wherever Triton does
(``moe_wave.comm.triton_gate``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_wave.comm.backend import rows_of
from moe_wave.comm.triton_gate import sm_count, tl, triton, triton_ok

__all__ = ["expert_order", "expert_order_torch", "gather_rows", "gather_rows_torch", "swiglu_rows",
           "swiglu_rows_torch", "weighted_sum", "weighted_sum_torch", "weighted_sum_once", "LOST"]

BLOCK_D = 1024
# the position of a pair that found no room in its group (``expert_order``'s ``lost``): the weighted sums make
# its row NaN, loud as a capacity overflow's
LOST = -2
ROW_PROGRAMS_PER_SM = 8
# the weighted sums a program per row: channels a step and warps (dev/probe_wave_glue.py, one H100: 4096 on 8 warps
# against 1024 on 4, 0.91-0.95 x at W = 1 and 0.80-0.84 x on one wave of four at 2048 and 8192 tokens, V4-Flash
# with 32 and 128 local experts, V4-Pro with 48)
WSUM_ROW_BLOCK = 4096
WSUM_ROW_WARPS = 8
# (row, slot) pairs per program of expert_order; its in-block ranks compare each pair with the block's others,
# PLACE_COLS columns per step (a [BLOCK_J, PLACE_COLS] mask: the whole [128, 128] one took 255 registers), on
# PLACE_WARPS warps
BLOCK_J = 128
PLACE_COLS = 32
PLACE_WARPS = 4
# expert_order's scan of the block histograms: experts per program, blocks per step
SCAN_EXPERTS = 16
SCAN_BLOCKS = 256


def expert_order_torch(expert_RK: torch.Tensor, e: int, offs_e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``expert_order`` by a stable argsort; the same result, guard included: a pair whose position would fall
    past its group's end (offs_e) or past J gets pos -1, and the positions of a group that no pair takes read 0.
    Entries of src_J past offs_e[-1] are 0 here (the kernel leaves them unwritten)."""
    R, K = expert_RK.shape
    J = R * K
    ids = expert_RK.reshape(-1).long()
    valid = (ids >= 0) & (ids < e)
    key = torch.where(valid, ids, e)
    order = torch.argsort(key, stable=True)
    sorted_at = torch.empty_like(order)
    sorted_at[order] = torch.arange(J, device=ids.device)
    counts = torch.bincount(key, minlength=e + 1)
    bounds = F.pad(offs_e.long(), (1, 1))                     # [0, ends..., 0]: group x is bounds[x] .. bounds[x+1]
    p = bounds[key] + sorted_at - (counts.cumsum(0) - counts)[key]
    ok = valid & (p >= 0) & (p < bounds[key + 1].clamp(max=J))
    pos = torch.where(ok, p, -1)
    src = torch.zeros(J, dtype=torch.long, device=ids.device)
    src[pos[ok]] = torch.div(torch.arange(J, device=ids.device), K, rounding_mode="floor")[ok]
    return src, pos.view(R, K)


def gather_rows_torch(x_RD: torch.Tensor, src_J: torch.Tensor, n: torch.Tensor, out: torch.Tensor,
                      local: tuple | None = None) -> torch.Tensor:
    j = torch.arange(src_J.shape[0], device=src_J.device)
    keep = j < n
    out[keep] = rows_of(x_RD, src_J[keep], local)
    return out


def swiglu_rows_torch(gu_J2I: torch.Tensor, limit: float, n: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    I = gu_J2I.shape[1] // 2
    keep = torch.arange(gu_J2I.shape[0], device=gu_J2I.device) < n
    gate, up = gu_J2I[keep, :I].float(), gu_J2I[keep, I:].float()
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    out[keep] = (F.silu(gate) * up).to(out.dtype)
    return out


def weighted_sum_torch(out_JD: torch.Tensor, pos_RK: torch.Tensor, w_RK: torch.Tensor, n: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    R, K = pos_RK.shape
    acc = torch.zeros(R, out_JD.shape[1], dtype=torch.float32, device=out_JD.device)
    for k in range(K):            # slot order: the same sum on every run
        p = pos_RK[:, k]
        valid = (p >= 0) & (p < n)
        rows = out_JD.index_select(0, torch.where(valid, p, 0)).float()
        acc += torch.where(valid[:, None], rows * w_RK[:, k:k + 1].float(), 0.0)
        acc[p == LOST] = float("nan")
    return acc.to(dtype)


def expert_order(expert_RK: torch.Tensor, e: int, offs_e: torch.Tensor, rows_P: torch.Tensor | None = None, *,
                 starts_e: torch.Tensor | None = None, capacity: int | None = None,
                 lost: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, slot) pairs sorted expert-major, without a sort or atomics: (src_J [J] int64, pos_RK [R, K] int64).

    The pair (r, k) with 0 <= expert_RK[r, k] = x < e sits at p = (offs_e[x - 1], or 0 for x = 0) + the number
    of pairs of expert x before it in flat order r * K + k: pos_RK[r, k] = p and src_J[p] = r. Slots of no local
    expert (-1, or any id outside [0, e)) get pos -1. With offs_e (int32 [e], the cumulative group ends) equal
    to the actual counts this is the stable argsort's order, n = offs_e[-1] positions.

    Entries of src_J at n and past are left unwritten (``torch.empty``): the consumers read only j < n. When
    offs_e disagrees with the pairs (a capacity overflow, reported by other checks) nothing is written out of
    bounds and every src_J[j < n] is still a row index: a pair past its group's end (or past J) gets pos -1,
    and the positions of a group that too few pairs fill read row 0.

    Three launches (no atomics, the same result on every run): ``_hist_kernel`` (one program per block of
    BLOCK_J pairs) writes each block's expert histogram and sets src_J to row 0 on the block's range of
    positions below n; ``_scan_kernel`` turns the histograms into each expert's pairs in the earlier blocks (an
    exclusive prefix over the blocks, SCAN_EXPERTS experts per program); ``_place_kernel`` (one program per
    block) numbers each pair of expert x as (offs_e[x - 1]) + (x's pairs in earlier blocks) + (its rank among
    the block's pairs of x), and writes pos, and src at the positions within the guard (overwriting the zeros
    of the first launch).

    ``rows_P`` (``Received.rows_P``): the rows are P blocks of R // P, and only the first rows_P[p] of block p
    are read; the slots of the others count as -1 (pos -1), and a block of pairs that holds none of the read
    rows skips its in-block ranks (a fixed-capacity buffer's empty tail costs a launch, not its size).

    ``starts_e`` (int32 [e]): group x starts there instead of at offs_e[x - 1] (its size is still offs_e[x] -
    offs_e[x - 1]): the aligned layout of the FP8 stage (``fp8_expert_kernels.aligned_groups``), whose positions
    run up to ``capacity`` (default J): src_J then has ``capacity`` entries, and only those of pairs are written.

    ``lost`` = over_e (int32 [e]): a pair of expert x with over_e[x] != 0 that falls outside its group gets pos
    ``LOST`` instead of -1 (the masked FP8 layout's groups cut at max_m: the weighted sums make its row NaN).
    """
    if not triton_ok(expert_RK.device, want=True):
        raise ValueError(f"expert_order: expert_RK is on {expert_RK.device}, where its Triton kernels cannot run: it "
                         f"needs a GPU tensor (or, on CPU, Triton's interpreter: TRITON_INTERPRET=1)")
    for name, t in (("offs_e", offs_e), ("rows_P", rows_P), ("starts_e", starts_e),
                    ("lost", lost)):
        if t is not None and t.device != expert_RK.device:
            raise ValueError(f"expert_order: {name} is on {t.device}: must be on expert_RK's device {expert_RK.device}")
    R, K = expert_RK.shape
    cap = R * K if capacity is None else capacity
    if cap < R * K and starts_e is None:
        raise ValueError(f"expert_order: capacity={cap} must be >= the {R * K} pairs")
    # with starts_e the positions run below the aligned layout's end, which the caller sizes ``capacity`` for
    # (it may hold fewer rows than R * K slots where the counts are bounded: rows that stay over several waves)
    src = torch.empty(max(cap, R * K), dtype=torch.long, device=expert_RK.device)[:cap]
    pos = torch.empty(R, K, dtype=torch.long, device=expert_RK.device)
    _order_into(expert_RK, e, offs_e, src, pos, rows_P, starts_e, lost)
    return src, pos


def _row_blocks(rows_P: torch.Tensor | None, R: int, like: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(counts, rows per block) for the kernels' row bound: ``rows_P`` as given (P blocks of R // P rows), or one
    block of R rows whose count is never read (``HAS_ROWS=False``)."""
    if rows_P is None:
        return like, max(R, 1)
    P = rows_P.numel()
    if P < 1 or R % P:
        raise ValueError(f"rows_P has {P} entries: the R={R} rows must split into that many equal blocks")
    if rows_P.device != like.device:
        raise ValueError(f"rows_P is on {rows_P.device}: must be on the rows' device {like.device}")
    return rows_P.reshape(P), max(R // P, 1)


def _order_into(expert_RK: torch.Tensor, e: int, offs_e: torch.Tensor, src: torch.Tensor, pos: torch.Tensor,
                rows_P: torch.Tensor | None = None, starts_e: torch.Tensor | None = None,
                lost: torch.Tensor | None = None) -> None:
    """``expert_order`` into the caller's buffers: src (at least J entries; those at J and past untouched) and
    pos (contiguous [R, K])."""
    R, K = expert_RK.shape
    J = R * K
    if not J:
        return
    cnt, rb = _row_blocks(rows_P, R, offs_e)
    nb = triton.cdiv(J, BLOCK_J)
    nbins = max(64, triton.next_power_of_2(e + 1))   # bin e: no local expert; tl.histogram wants a warp multiple
    hist = torch.empty(nb, nbins, dtype=torch.int32, device=expert_RK.device)   # every entry written by K1
    s_r, s_k = expert_RK.stride()
    key = torch.empty(J, dtype=torch.int32, device=expert_RK.device)          # every entry written by K1
    _hist_kernel[(nb,)](expert_RK, s_r, s_k, offs_e, hist, src, key, cnt, rb, K, J, e, BLOCK=BLOCK_J, NBINS=nbins,
                        HAS_ROWS=rows_P is not None, num_warps=4)
    _scan_kernel[(nbins // SCAN_EXPERTS,)](hist, nb, NBINS=nbins, BX=SCAN_EXPERTS, CB=SCAN_BLOCKS, num_warps=4)
    starts, cap = (offs_e, J) if starts_e is None else (starts_e, src.shape[0])   # positions below cap only
    over = offs_e if lost is None else lost                                   # read only with HAS_LOST
    _place_kernel[(nb,)](key, offs_e, starts, hist, src, pos, over, K, J, cap, e, NBINS=nbins, BLOCK=BLOCK_J,
                         CH=PLACE_COLS, STARTS=starts_e is not None, HAS_LOST=lost is not None,
                         num_warps=PLACE_WARPS)


def _rows_grid(J: int, device: torch.device) -> int:
    """Programs of a row kernel over the first n of J rows (n on the device): J up to ROW_PROGRAMS_PER_SM per SM.
    A grid of J programs, most of them exiting at once past n, cost ~25 us per launch at a capacity of 8192 rows x
    6 slots on an H200 (dev/profile_experts.py), per wave."""
    if device.type != "cuda":
        return max(1, min(J, 64))
    return max(1, min(J, ROW_PROGRAMS_PER_SM * sm_count(device)))


def gather_rows(x_RD: torch.Tensor, src_J: torch.Tensor, n: torch.Tensor, local: tuple | None = None) -> torch.Tensor:
    """[J, D] in x's dtype; rows j >= n are left as allocated (``torch.empty``). ``local`` = (row0, x_LD)
    (``Received.local``): source rows row0 .. row0 + L - 1 are read from x_LD instead."""
    J, D = src_J.shape[0], x_RD.shape[1]
    out = torch.empty(J, D, dtype=x_RD.dtype, device=x_RD.device)
    row0, loc = (0, x_RD[:0]) if local is None else local
    if loc.shape[1:] != x_RD.shape[1:] or loc.dtype != x_RD.dtype or (loc.numel() and loc.stride(0) != D):
        raise ValueError(f"gather_rows: local rows {tuple(loc.shape)} {loc.dtype} must be contiguous [L, {D}] "
                         f"{x_RD.dtype} rows")
    if J and D:
        _gather_kernel[(_rows_grid(J, x_RD.device),)](x_RD, src_J, n, out, D, loc if loc.numel() else x_RD, row0,
                                                       loc.shape[0], BLOCK=min(BLOCK_D, triton.next_power_of_2(D)))
    return out


def swiglu_rows(gu_J2I: torch.Tensor, limit: float, n: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[J, I] in ``dtype``: silu(clamp(gate, max=limit)) * clamp(up, +-limit) in fp32 (limit <= 0: no clamp)."""
    J, I2 = gu_J2I.shape
    out = torch.empty(J, I2 // 2, dtype=dtype, device=gu_J2I.device)
    if J and I2:
        _swiglu_kernel[(_rows_grid(J, gu_J2I.device),)](gu_J2I, n, out, I2 // 2, float(limit), CLAMP=limit > 0,
                                                         BLOCK=min(BLOCK_D, triton.next_power_of_2(I2 // 2)))
    return out


def _wsum_grid(R: int, D: int, block: int, device: torch.device) -> tuple[tuple[int, int], bool]:
    """(grid, split) of the weighted sums. Where a program per (row, block of channels) fits the row programs'
    cap (``_rows_grid``; decode-sized waves), that grid, each program loading its row's slots at once
    (``_slot_sum_split``): at 128 tokens a wave's sum took 5.3 us instead of 15.1 (V4-Flash, 32 local experts,
    one H100). Else a program per row (capped), a slot at a time: the split form measured 1.5 x slower there on
    the sparse rows of W=4 at 8192 tokens (benchmarks/results/experts.md)."""
    blocks = triton.cdiv(D, block)
    if R * blocks <= _rows_grid(1 << 30, device):
        return (max(R, 1), blocks), True
    return (_rows_grid(R, device), 1), False


def _wsum_launch(R: int, D: int, device: torch.device) -> tuple[tuple[int, int], bool, int, int]:
    """(grid, split, channels a step, warps) of the weighted sums: ``_wsum_grid``'s choice, the split grid by
    BLOCK_D channels on 4 warps, a program per row by WSUM_ROW_BLOCK on WSUM_ROW_WARPS."""
    bd = min(BLOCK_D, triton.next_power_of_2(D))
    grid, split = _wsum_grid(R, D, bd, device)
    if split:
        return grid, True, bd, 4
    return grid, False, min(WSUM_ROW_BLOCK, triton.next_power_of_2(D)), WSUM_ROW_WARPS


def weighted_sum(out_JD: torch.Tensor, pos_RK: torch.Tensor, w_RK: torch.Tensor, n: torch.Tensor,
                 dtype: torch.dtype, rows_P: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """[R, D] in ``dtype`` (see the module docstring), into ``out`` if given (contiguous). ``rows_P``
    (``Received.rows_P``): only the first rows_P[p] rows of each of the P blocks of R // P rows are written, the
    others are left as they were; the grid (``_wsum_grid``: rows capped by the SM count, or rows by blocks of
    channels where they are few) loops over the rows, so the launch follows the rows read, not R."""
    R, K = pos_RK.shape
    D = out_JD.shape[1]
    y = torch.empty(R, D, dtype=dtype, device=out_JD.device) if out is None else out
    if y.shape != (R, D) or y.dtype != dtype or not y.is_contiguous():
        raise ValueError(f"weighted_sum: out {tuple(y.shape)} {y.dtype}: must be contiguous {(R, D)} {dtype}")
    if R and D:
        cnt, rb = _row_blocks(rows_P, R, n)
        grid, split, bd, nw = _wsum_launch(R, D, out_JD.device)
        _wsum_kernel[grid](out_JD, pos_RK.contiguous(), w_RK.contiguous(), n, y, cnt, rb, R, K, D,
                           HAS_ROWS=rows_P is not None, SPLIT=split,
                           KP=triton.next_power_of_2(K), BLOCK=bd, num_warps=nw)
    return y


def weighted_sum_once(out_JD: torch.Tensor, pos_RK: torch.Tensor, w_RK: torch.Tensor, n: torch.Tensor,
                      y: torch.Tensor, rows_P: torch.Tensor | None, once) -> None:
    """``weighted_sum`` for rows that stay over several waves (``comm.backend.OnceRows`` ``once``), in place: for
    each read row r with a pair of this wave (pos in [0, n)), y[r] = (y[r] unless r's block is of this wave,
    ``r // (R // once.num_waves) == once.wave``: the row's first) + sum over k in order of w[r, k] *
    out[pos[r, k]], in fp32, stored in y's dtype. Rows without a pair of this wave are not touched."""
    R, K = pos_RK.shape
    D = out_JD.shape[1]
    if y.shape != (R, D) or not y.is_contiguous():
        raise ValueError(f"weighted_sum_once: y {tuple(y.shape)} must be contiguous {(R, D)}")
    if not (R and D):
        return
    cnt, rb = _row_blocks(rows_P, R, n)
    grid, split, bd, nw = _wsum_launch(R, D, out_JD.device)
    _wsum_once_kernel[grid](out_JD, pos_RK.contiguous(), w_RK.contiguous(), n, y, cnt, rb, R, K, D, once.wave,
                            R // once.num_waves, HAS_ROWS=rows_P is not None, SPLIT=split,
                            KP=triton.next_power_of_2(K), BLOCK=bd, num_warps=nw)


if triton is not None:
    LOST_POS = tl.constexpr(LOST)

    @triton.jit
    def _read_rows(j, K, J, cnt_ptr, RB, HAS_ROWS: tl.constexpr):
        # (row of pair j, the pair is read): j < J and, with HAS_ROWS, its row within the first cnt[blk] rows of
        # its block of RB rows
        r = j // K
        m = j < J
        if HAS_ROWS:
            blk = r // RB
            m = m & ((r - blk * RB) < tl.load(cnt_ptr + blk, mask=m, other=0))
        return r, m

    @triton.jit
    def _hist_kernel(ids_ptr, stride_r, stride_k, offs_ptr, hist_ptr, src_ptr, key_ptr, cnt_ptr, RB, K, J, E,
                     BLOCK: tl.constexpr, NBINS: tl.constexpr, HAS_ROWS: tl.constexpr):
        # block b: key[j] = the expert of pair j, E for none (another cell's slot, or its row past the bound);
        # hist[b, x] = the block's pairs of expert x (bin E and up: none, and the lanes past J); src = 0 (row 0)
        # on the block's positions below n, for the positions that no pair will take
        b = tl.program_id(0)
        j = b * BLOCK + tl.arange(0, BLOCK)
        r, mr = _read_rows(j, K, J, cnt_ptr, RB, HAS_ROWS)
        ids = tl.load(ids_ptr + r * stride_r + (j - r * K) * stride_k, mask=mr, other=-1)
        key = tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)
        tl.store(key_ptr + j, key, mask=j < J)
        tl.store(hist_ptr + b * NBINS + tl.arange(0, NBINS), tl.histogram(key, NBINS))
        n = tl.minimum(tl.load(offs_ptr + E - 1, mask=E > 0, other=0).to(tl.int32), J)
        tl.store(src_ptr + j, tl.zeros([BLOCK], tl.int64), mask=j < n)

    @triton.jit
    def _scan_kernel(hist_ptr, nb, NBINS: tl.constexpr, BX: tl.constexpr, CB: tl.constexpr):
        # in place, for BX experts per program: hist[b, x] <- the pairs of x in blocks 0 .. b - 1 (an exclusive
        # prefix over the blocks, CB blocks at a time)
        x = tl.program_id(0) * BX + tl.arange(0, BX)
        run = tl.zeros([BX], tl.int32)
        for c0 in range(0, nb, CB):
            c = c0 + tl.arange(0, CB)
            ptr = hist_ptr + c[:, None] * NBINS + x[None, :]
            mk = c[:, None] < nb
            h = tl.load(ptr, mask=mk, other=0)
            tl.store(ptr, tl.cumsum(h, 0) - h + run[None, :], mask=mk)
            run += tl.sum(h, 0)

    @triton.jit
    def _place_kernel(key_ptr, offs_ptr, starts_ptr, hist_ptr, src_ptr, pos_ptr, over_ptr, K, J, CAP, E,
                      NBINS: tl.constexpr, BLOCK: tl.constexpr, CH: tl.constexpr, STARTS: tl.constexpr,
                      HAS_LOST: tl.constexpr):
        # the pair j of expert x in block b goes to p = offs[x - 1] + (pairs of x in blocks 0 .. b - 1: the
        # scanned hist[b, x]) + (pairs of x before j in block b: compared CH columns at a time, against the keys
        # reloaded from memory, which keeps the [BLOCK, CH] masks small); outside its group (or past J, or no
        # expert): pos -1 (HAS_LOST: LOST where over[x] != 0), no write. A block with no valid pair skips the
        # in-block ranks.
        b = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        j = b * BLOCK + i
        m = j < J
        key = tl.load(key_ptr + j, mask=m, other=E)
        valid = key < E
        before = tl.load(hist_ptr + b * NBINS + key, mask=valid, other=0)
        rank = tl.zeros([BLOCK], tl.int32)
        if tl.max(valid.to(tl.int32), 0) > 0:
            for c in tl.static_range(BLOCK // CH):
                col = c * CH + tl.arange(0, CH)
                kc = tl.load(key_ptr + b * BLOCK + col, mask=b * BLOCK + col < J, other=E)
                same = (kc[None, :] == key[:, None]) & (col[None, :] < i[:, None])     # [BLOCK, CH]
                rank += tl.sum(same.to(tl.int32), 1)
        prev = tl.load(offs_ptr + key - 1, mask=valid & (key > 0), other=0).to(tl.int32)
        end = tl.load(offs_ptr + key, mask=valid, other=0).to(tl.int32)
        if STARTS:      # group x at starts[x], offs[x] - offs[x - 1] long (the aligned layout)
            start = tl.load(starts_ptr + key, mask=valid, other=0).to(tl.int32)
            end = start + end - prev
        else:
            start = prev
        end = tl.minimum(end, CAP)
        p = start + before + rank
        ok = valid & (p >= 0) & (p < end)
        miss = tl.full([BLOCK], -1, tl.int32)
        if HAS_LOST:
            over = tl.load(over_ptr + key, mask=valid, other=0)
            miss = tl.where(over != 0, LOST_POS, miss)
        tl.store(pos_ptr + j, tl.where(ok, p, miss).to(tl.int64), mask=m)
        tl.store(src_ptr + p, (j // K).to(tl.int64), mask=ok)

    @triton.jit
    def _gather_kernel(x_ptr, src_ptr, n_ptr, out_ptr, D, loc_ptr, ROW0, L, BLOCK: tl.constexpr):
        # rows j = pid, pid + programs, ... below n (the grid is capped: its size follows the GPU, not J);
        # source rows ROW0 .. ROW0 + L - 1 come from loc (this rank's own tokens, not copied into x)
        n = tl.load(n_ptr)
        for j in range(tl.program_id(0), n, tl.num_programs(0)):
            jj = tl.zeros([], tl.int64) + j                                # int64 offsets (an int in the interpreter)
            s = tl.load(src_ptr + jj).to(tl.int64)
            if (s >= ROW0) & (s < ROW0 + L):
                base = loc_ptr + (s - ROW0) * D
            else:
                base = x_ptr + s * D
            for d0 in range(0, D, BLOCK):
                d = d0 + tl.arange(0, BLOCK)
                m = d < D
                tl.store(out_ptr + jj * D + d, tl.load(base + d, mask=m), mask=m)

    @triton.jit
    def _swiglu_kernel(gu_ptr, n_ptr, out_ptr, I, limit, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
        # rows j = pid, pid + programs, ... below n (a capped grid, as _gather_kernel)
        n = tl.load(n_ptr)
        for j in range(tl.program_id(0), n, tl.num_programs(0)):
            jj = tl.zeros([], tl.int64) + j
            row = gu_ptr + jj * 2 * I
            for i0 in range(0, I, BLOCK):
                i = i0 + tl.arange(0, BLOCK)
                m = i < I
                gate = tl.load(row + i, mask=m, other=0.0).to(tl.float32)
                up = tl.load(row + I + i, mask=m, other=0.0).to(tl.float32)
                if CLAMP:
                    gate = tl.minimum(gate, limit)
                    up = tl.minimum(tl.maximum(up, -limit), limit)
                h = gate / (1.0 + tl.exp(-gate)) * up
                tl.store(out_ptr + jj * I + i, h.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _row_read(r, cnt_ptr, RB, HAS_ROWS: tl.constexpr):
        # row r is below its block's count (every row without HAS_ROWS)
        if HAS_ROWS:
            blk = r // RB
            return (r - blk * RB) < tl.load(cnt_ptr + blk)
        return r >= 0

    @triton.jit
    def _slot_sum(out_ptr, pos_ptr, w_ptr, r, n, K, D, d, m, BLOCK: tl.constexpr):
        # sum over k in order of w[r, k] * out[pos[r, k], d] for the slots with pos in [0, n), in fp32, a slot at
        # a time (a wave of many rows: one program per row)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(K):
            p = tl.load(pos_ptr + r * K + k)
            if (p >= 0) & (p < n):
                w = tl.load(w_ptr + r * K + k).to(tl.float32)
                acc += w * tl.load(out_ptr + p.to(tl.int64) * D + d, mask=m, other=0.0).to(tl.float32)
            elif p == LOST_POS:
                acc += float("nan")
        return acc

    @triton.jit
    def _slot_sum_split(out_ptr, pos_ptr, w_ptr, r, n, K, D, d, m, KP: tl.constexpr, BLOCK: tl.constexpr):
        # _slot_sum for one block of channels of a decode-sized wave (a program per (row, block)): the row's K
        # positions and weights loaded once, and its K rows' loads not waiting on one another
        kk = tl.arange(0, KP)
        pv = tl.load(pos_ptr + r * K + kk, mask=kk < K, other=-1)
        wv = tl.load(w_ptr + r * K + kk, mask=kk < K, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(KP):
            p = tl.sum(tl.where(kk == k, pv, 0), 0).to(tl.int64) + tl.zeros([BLOCK], tl.int64)
            ok = (p >= 0) & (p < n)
            w = tl.sum(tl.where(kk == k, wv, 0.0), 0)
            x = tl.load(out_ptr + p * D + d, mask=m & ok, other=0.0).to(tl.float32)
            acc += tl.where(ok, w * x, tl.where(p == LOST_POS, float("nan"), 0.0))
        return acc

    @triton.jit
    def _row_sum(out_ptr, pos_ptr, w_ptr, r, n, K, D, d0, SPLIT: tl.constexpr, KP: tl.constexpr,
                 BLOCK: tl.constexpr):
        # (the slot sum of row r on channels d0 .., the channel mask); SPLIT: the row's slots loaded at once
        d = d0 + tl.arange(0, BLOCK)
        m = d < D
        if SPLIT:
            acc = _slot_sum_split(out_ptr, pos_ptr, w_ptr, r, n, K, D, d, m, KP, BLOCK)
        else:
            acc = _slot_sum(out_ptr, pos_ptr, w_ptr, r, n, K, D, d, m, BLOCK)
        return acc, d, m

    @triton.jit
    def _wsum_kernel(out_ptr, pos_ptr, w_ptr, n_ptr, y_ptr, cnt_ptr, RB, R, K, D, HAS_ROWS: tl.constexpr,
                     SPLIT: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
        # rows r = pid, pid + programs, ... of all R (a capped grid, whatever the blocks' fill), every block of
        # channels; SPLIT: program (r, c), the channels c * BLOCK .. only (``_wsum_grid``); with HAS_ROWS the rows
        # past their block's count are not written
        n = tl.load(n_ptr)
        for rr in range(tl.program_id(0), R, tl.num_programs(0)):
            r = tl.zeros([], tl.int64) + rr                                # int64 offsets
            if _row_read(r, cnt_ptr, RB, HAS_ROWS):
                for d0 in range(tl.program_id(1) * BLOCK, D, tl.num_programs(1) * BLOCK):
                    acc, d, m = _row_sum(out_ptr, pos_ptr, w_ptr, r, n, K, D, d0, SPLIT, KP, BLOCK)
                    tl.store(y_ptr + r * D + d, acc.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _wsum_once_kernel(out_ptr, pos_ptr, w_ptr, n_ptr, y_ptr, cnt_ptr, RB, R, K, D, WAVE, RPW,
                          HAS_ROWS: tl.constexpr, SPLIT: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
        # as _wsum_kernel, for the rows with a pair of this wave only, and adding the row's sum so far (y) unless
        # the row's block is of this wave
        n = tl.load(n_ptr)
        for rr in range(tl.program_id(0), R, tl.num_programs(0)):
            r = tl.zeros([], tl.int64) + rr
            has = tl.zeros([], tl.int32)
            if _row_read(r, cnt_ptr, RB, HAS_ROWS):
                kk = tl.arange(0, KP)
                p = tl.load(pos_ptr + r * K + kk, mask=kk < K, other=-1)
                has = tl.max((((p >= 0) & (p < n)) | (p == LOST_POS)).to(tl.int32), 0)
            if has != 0:
                for d0 in range(tl.program_id(1) * BLOCK, D, tl.num_programs(1) * BLOCK):
                    s, d, m = _row_sum(out_ptr, pos_ptr, w_ptr, r, n, K, D, d0, SPLIT, KP, BLOCK)
                    if r // RPW != WAVE:
                        s = tl.load(y_ptr + r * D + d, mask=m, other=0.0).to(tl.float32) + s
                    tl.store(y_ptr + r * D + d, s.to(y_ptr.dtype.element_ty), mask=m)

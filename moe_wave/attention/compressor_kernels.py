"""Fused Triton kernels of the compressor (``compressor.py``), with the torch ops they replace as fallback.

Legend: B batch, S chunk length, C channels of a pooled pair (kv and its gate score), R ring slots, N entry slots,
d entry dim, m the compression ratio.

* ``pool_entries``: the compressor's gated pooling of every window a chunk touches, from the ring
  and the chunk, with its RMSNorm and RoPE, written into the entry cache: one launch (two for HCA's long
  windows, whose channels spread over several programs) instead of ~30 torch ops (gathers of [n, R, C] fp32
  tiles, softmax, norm, rope, scatter).
* ``ring_write``: the compressor's ring update (the chunk's last tokens' fp32 kv and score) in one launch.

As in ``kernels``: CUDA/ROCm tensors, or CPU under ``TRITON_INTERPRET=1``; the caller decides with
``kernels.use_kernels``.
"""

from __future__ import annotations

import torch

from moe_wave.comm.triton_gate import tl, triton

__all__ = ["pool_entries", "ring_write", "POOL_SPLIT_PAIRS", "POOL_SPLIT_MIN_SLOTS"]


if triton is not None:

    @triton.jit
    def _entry_norm_rope(pe, po, pair, pmask, win, m, w_ptr, freq_ptr, eps, DIM: tl.constexpr,
                         PAIRS: tl.constexpr, F: tl.constexpr):
        # An entry's RMSNorm and RoPE at its window's start (position win * m), from its pooled channels in the
        # model dtype's values as fp32 pairs (pe: channels 2i, po: 2i + 1 of pair i)
        ms = (tl.sum(pe * pe, axis=0) + tl.sum(po * po, axis=0)) / DIM
        inv = 1.0 / tl.sqrt(ms + eps)
        we = tl.load(w_ptr + 2 * pair, mask=pmask, other=0.0).to(tl.float32)
        wo = tl.load(w_ptr + 2 * pair + 1, mask=pmask, other=0.0).to(tl.float32)
        pe = pe * inv * we
        po = po * inv * wo
        fi = pair - (PAIRS - F)
        rot = (fi >= 0) & pmask
        f = tl.load(freq_ptr + tl.maximum(fi, 0), mask=rot, other=0.0)
        ang = (win * m).to(tl.float32) * f
        c = tl.cos(ang)
        s = tl.sin(ang)
        return tl.join(tl.where(rot, pe * c - po * s, pe), tl.where(rot, pe * s + po * c, po))

    @triton.jit
    def _slots(v, ND: tl.constexpr):
        # a per-slot vector [BJ] shaped to broadcast against ND-dimensional [BJ, channels...] tiles
        if ND == 2:
            return v[:, None]
        else:
            return v[:, None, None]

    @triton.jit
    def _pool_slots(kv_ptr, sc_ptr, rkv_ptr, rsc_ptr, ape_ptr, b, win, p0, S, RR, m, s_kv_b, s_kv_s, s_sc_b, s_sc_s,
                    s_r_b, s_r_r, ch_e, mk, DIM: tl.constexpr, CM: tl.constexpr, J: tl.constexpr, BJ: tl.constexpr,
                    ND: tl.constexpr):
        # The gated pooling of a window's J slots for the channels ch_e ([1, ...], mask mk): an online softmax over
        # slot blocks of BJ, per channel; returns the pooled fp32 channels (ch_e's shape without its slot dim)
        run_max = tl.max(tl.full(ch_e.shape, -1e30, tl.float32), axis=0)
        run_sum = run_max * 0.0
        acc = run_max * 0.0
        for j0 in range(0, J, BJ):
            jj = j0 + tl.arange(0, BJ)                                   # slots
            q = (win - CM + 1) * m + jj                                  # source positions
            valid = (jj < J) & (q >= 0) & (q < p0 + S)
            chunk = valid & (q >= p0)
            ring = valid & (q < p0)
            if CM == 2:
                choff = tl.where(jj < m, 0, DIM)                         # A-half of window i-1, B-half of i
            else:
                choff = jj * 0
            ch = _slots(choff, ND) + ch_e
            crow = _slots(tl.where(chunk, q - p0, 0).to(tl.int64), ND)
            rrow = _slots((tl.where(ring, q, 0) % RR).to(tl.int64), ND)
            mc = _slots(chunk, ND) & mk
            mr = _slots(ring, ND) & mk
            kv = tl.load(kv_ptr + b * s_kv_b + crow * s_kv_s + ch, mask=mc, other=0.0).to(tl.float32)
            sc = tl.load(sc_ptr + b * s_sc_b + crow * s_sc_s + ch, mask=mc, other=0.0).to(tl.float32)
            sc += tl.load(ape_ptr + _slots(jj % m, ND) * (CM * DIM) + ch, mask=mc, other=0.0).to(tl.float32)
            kv += tl.load(rkv_ptr + b * s_r_b + rrow * s_r_r + ch, mask=mr, other=0.0)
            sc += tl.load(rsc_ptr + b * s_r_b + rrow * s_r_r + ch, mask=mr, other=0.0)
            sc = tl.where(_slots(valid, ND) & mk, sc, -1e30)
            new_max = tl.maximum(run_max, tl.max(sc, axis=0))
            alpha = tl.exp(run_max - new_max)
            e = tl.exp(sc - new_max[None])
            run_sum = run_sum * alpha + tl.sum(e, axis=0)
            acc = acc * alpha + tl.sum(e * kv, axis=0)
            run_max = new_max
        return acc / run_sum

    @triton.jit
    def _pool_kernel(kv_ptr, sc_ptr, rkv_ptr, rsc_ptr, ape_ptr, pos_ptr, w_ptr, freq_ptr, out_ptr, tmp_ptr,
                     S, N, RR, m, eps, s_kv_b, s_kv_s, s_sc_b, s_sc_s, s_r_b, s_r_r, s_o_b, s_o_n,
                     DIM: tl.constexpr, CM: tl.constexpr, PAIRS: tl.constexpr, BLOCK: tl.constexpr,
                     F: tl.constexpr, J: tl.constexpr, BJ: tl.constexpr, SPLIT: tl.constexpr):
        # Program (window touched by the chunk, batch row, block of BLOCK channel pairs): the gated pooling of its
        # J slots; with one block (not SPLIT) of all channels, then the RMSNorm and RoPE at the window's start and
        # the store into the entries, the slots' tiles [BJ, BLOCK, 2] (channel pairs); SPLIT (the channels over
        # several programs, for few windows of many slots: HCA's prefill has 33 windows of 128 slots), tiles of
        # [BJ, 2 * BLOCK] contiguous channels, and the pooled block goes to tmp [B, n, DIM] (model dtype) for
        # ``_entry_finish_kernel`` to normalise (each layout the faster for its case: benchmarks/results/attn.md)
        i = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        p0 = tl.load(pos_ptr + b * S)
        win = p0 // m + i
        if (win * m < p0 + S) & (win < N):                               # else: the reference's trash slot
            if SPLIT:
                c0 = tl.program_id(2) * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
                cmask = c0 < DIM
                pooled = _pool_slots(kv_ptr, sc_ptr, rkv_ptr, rsc_ptr, ape_ptr, b, win, p0, S, RR, m, s_kv_b, s_kv_s,
                                     s_sc_b, s_sc_s, s_r_b, s_r_r, c0[None, :], cmask[None, :], DIM, CM, J, BJ, 2)
                tl.store(tmp_ptr + (b * tl.num_programs(0) + i) * DIM + c0, pooled.to(out_ptr.dtype.element_ty),
                         mask=cmask)
            else:
                pair = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
                two = tl.arange(0, 2)
                col = 2 * pair[:, None] + two[None, :]                  # [BLOCK, 2] channel within DIM
                cmask = (pair[:, None] < PAIRS) & (two[None, :] < 2)
                pooled = _pool_slots(kv_ptr, sc_ptr, rkv_ptr, rsc_ptr, ape_ptr, b, win, p0, S, RR, m, s_kv_b, s_kv_s,
                                     s_sc_b, s_sc_s, s_r_b, s_r_r, col[None, :, :], cmask[None, :, :], DIM, CM, J,
                                     BJ, 3)
                pe, po = tl.split(pooled.to(out_ptr.dtype.element_ty).to(tl.float32))   # the model dtype, as HF
                y = _entry_norm_rope(pe, po, pair, pair < PAIRS, win, m, w_ptr, freq_ptr, eps, DIM, PAIRS, F)
                tl.store(out_ptr + b * s_o_b + win * s_o_n + col, y.to(out_ptr.dtype.element_ty), mask=cmask)

    @triton.jit
    def _entry_finish_kernel(tmp_ptr, pos_ptr, w_ptr, freq_ptr, out_ptr, S, N, m, eps, s_o_b, s_o_n,
                             DIM: tl.constexpr, PAIRS: tl.constexpr, BLOCK: tl.constexpr, F: tl.constexpr):
        # SPLIT's second step: program (window, batch row) normalises and rotates the entry pooled into tmp
        i = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        p0 = tl.load(pos_ptr + b * S)
        win = p0 // m + i
        if (win * m < p0 + S) & (win < N):
            pair = tl.arange(0, BLOCK)
            two = tl.arange(0, 2)
            col = 2 * pair[:, None] + two[None, :]
            cmask = (pair[:, None] < PAIRS) & (two[None, :] < 2)
            pooled = tl.load(tmp_ptr + (b * tl.num_programs(0) + i) * DIM + col, mask=cmask, other=0.0)
            pe, po = tl.split(pooled.to(tl.float32))
            y = _entry_norm_rope(pe, po, pair, pair < PAIRS, win, m, w_ptr, freq_ptr, eps, DIM, PAIRS, F)
            tl.store(out_ptr + b * s_o_b + win * s_o_n + col, y.to(out_ptr.dtype.element_ty), mask=cmask)

    @triton.jit
    def _ring_write_kernel(kv_ptr, sc_ptr, ape_ptr, pos_ptr, rkv_ptr, rsc_ptr, S, K, RR, m, C,
                           s_kv_b, s_kv_s, s_sc_b, s_sc_s, s_r_b, s_r_r, BC: tl.constexpr):
        # Program (one of the chunk's last K tokens, batch row, block of BC channels): the token's fp32 kv and
        # score (gate + ape[pos mod m]) into its ring row pos mod RR
        t = S - K + tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        c = tl.program_id(2) * BC + tl.arange(0, BC)
        cm = c < C
        p = tl.load(pos_ptr + b * S + t)
        row = (p % RR).to(tl.int64)
        kv = tl.load(kv_ptr + b * s_kv_b + t * s_kv_s + c, mask=cm, other=0.0).to(tl.float32)
        sc = tl.load(sc_ptr + b * s_sc_b + t * s_sc_s + c, mask=cm, other=0.0).to(tl.float32)
        sc = sc + tl.load(ape_ptr + (p % m) * C + c, mask=cm, other=0.0).to(tl.float32)
        tl.store(rkv_ptr + b * s_r_b + row * s_r_r + c, kv, mask=cm)
        tl.store(rsc_ptr + b * s_r_b + row * s_r_r + c, sc, mask=cm)


POOL_SPLIT_PAIRS = 16   # SPLIT's channel pairs a program (32 channels: 16 programs a 512-channel entry;
#                         dev/profile_attn.py times the choices)
POOL_SPLIT_MIN_SLOTS = 64   # SPLIT only for windows of this many slots or more (HCA's 128; CSA's 8 stay one program)


def pool_entries(kv_BSC: torch.Tensor, score_BSC: torch.Tensor, ring_kv_BRC: torch.Tensor,
                 ring_score_BRC: torch.Tensor, ape_mC: torch.Tensor, pos_BS: torch.Tensor, norm_weight: torch.Tensor,
                 freq_F: torch.Tensor, entries_BNd: torch.Tensor, *, ratio: int, mult: int, eps: float,
                 split: bool | None = None) -> None:
    """The compressor's emit (see ``compressor.Compressor.emit`` for the math): one launch, or two with ``split``.

    Args:
        kv_BSC, score_BSC: the chunk's projections as the GEMMs left them (model dtype, no ape yet).
        ring_kv_BRC, ring_score_BRC: fp32 ring of the previous tokens (ape included), row pos mod R.
        ape_mC: [m, C] position bias; pos_BS: positions (each row contiguous from pos[:, 0]);
        norm_weight: [d]; freq_F: fp32 [F] (ape and the weight are read in their own dtype, as fp32).
        entries_BNd: [B, N+1, d] written in place at every complete or partial window the chunk
            touches (windows past the capacity are skipped: the reference sends them to the trash row N).
        split: each entry's channels pooled by several programs (POOL_SPLIT_PAIRS pairs each, in blocks of more
            slots) and normalised by a second kernel. None (default): for windows of POOL_SPLIT_MIN_SLOTS slots or
            more (HCA's 128: its 4096-token prefill has 33 windows, 33 programs without it), whatever the chunk, so
            that an entry's bits do not depend on how the sequence was chunked or batched. The two differ by the
            online softmax's slot blocks (fp32 rounding).
    """
    B, S, C = kv_BSC.shape
    d = entries_BNd.shape[-1]
    N = entries_BNd.shape[1] - 1
    R = ring_kv_BRC.shape[1]
    J = mult * ratio
    if C != mult * d or R != J or S == 0:
        raise ValueError(f"pool_entries: C={C}, R={R}, S={S}: need C = mult*d = {mult * d}, R = mult*ratio = {J}, "
                         "S > 0")
    kv = kv_BSC if kv_BSC.stride(-1) == 1 else kv_BSC.contiguous()
    sc = score_BSC if score_BSC.stride(-1) == 1 else score_BSC.contiguous()
    rkv, rsc = ring_kv_BRC.contiguous(), ring_score_BRC.contiguous()
    n = (S + ratio - 2) // ratio + 1
    pairs = d // 2
    if split is None:
        split = J >= POOL_SPLIT_MIN_SLOTS and pairs > POOL_SPLIT_PAIRS
    block = POOL_SPLIT_PAIRS if split else triton.next_power_of_2(pairs)
    BJ = min(triton.next_power_of_2(J), max(8, 2048 // block))   # tiles of 4096 elements
    tmp = torch.empty(B, n, d, dtype=entries_BNd.dtype, device=kv.device) if split else entries_BNd
    ape, w, freq = ape_mC.contiguous(), norm_weight.contiguous(), freq_F.float().contiguous()
    pos = pos_BS.contiguous()
    _pool_kernel[(n, B, triton.cdiv(pairs, block))](
        kv, sc, rkv, rsc, ape, pos, w, freq, entries_BNd, tmp, S, N, R, ratio, float(eps), kv.stride(0),
        kv.stride(1), sc.stride(0), sc.stride(1), rkv.stride(0), rkv.stride(1), entries_BNd.stride(0),
        entries_BNd.stride(1), DIM=d, CM=mult, PAIRS=pairs, BLOCK=block, F=freq_F.numel(), J=J, BJ=BJ,
        SPLIT=bool(split), num_warps=4 if split else 8)
    if split:
        _entry_finish_kernel[(n, B)](tmp, pos, w, freq, entries_BNd, S, N, ratio, float(eps), entries_BNd.stride(0),
                                     entries_BNd.stride(1), DIM=d, PAIRS=pairs, BLOCK=triton.next_power_of_2(pairs),
                                     F=freq_F.numel(), num_warps=4)


def ring_write(kv_BSC: torch.Tensor, score_BSC: torch.Tensor, ape_mC: torch.Tensor, pos_BS: torch.Tensor,
               ring_kv_BRC: torch.Tensor, ring_score_BRC: torch.Tensor, ratio: int) -> None:
    """The compressor's ring update (``compressor.Compressor.write_state``) in one launch: each of the chunk's
    last min(S, R) tokens' fp32 kv and score (gate + ape[pos mod m], the same fp32 sum) into ring row pos mod R,
    instead of ~10 torch ops (casts, the ape gather, the remainders, two scatters)."""
    B, S, C = kv_BSC.shape
    R = ring_kv_BRC.shape[1]
    K = min(S, R)
    if ring_kv_BRC.stride(-1) != 1 or ring_score_BRC.stride(-1) != 1 or ring_kv_BRC.stride() != ring_score_BRC.stride():
        raise ValueError(f"ring_write: ring strides {ring_kv_BRC.stride()} (kv) and {ring_score_BRC.stride()} "
                         "(score): the two rings must have the same strides, the channels contiguous (stride 1)")
    if K == 0:
        return
    kv = kv_BSC if kv_BSC.stride(-1) == 1 else kv_BSC.contiguous()
    sc = score_BSC if score_BSC.stride(-1) == 1 else score_BSC.contiguous()
    BC = min(1024, triton.next_power_of_2(C))
    _ring_write_kernel[(K, B, triton.cdiv(C, BC))](
        kv, sc, ape_mC.contiguous(), pos_BS.contiguous(), ring_kv_BRC, ring_score_BRC, S, K, R, ratio, C,
        kv.stride(0), kv.stride(1), sc.stride(0), sc.stride(1), ring_kv_BRC.stride(0), ring_kv_BRC.stride(1),
        BC=BC, num_warps=4)



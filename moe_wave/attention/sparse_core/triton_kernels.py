"""The sparse attention core as one Triton kernel, tiled for the tensor cores (the math is ``reference.run``'s).

Legend: B batch, S queries, H query heads, d head_dim (K = V), M rows of a key source, J picks per query,
BH heads per tile, BN keys per tile, BDK channels per QK step, BDV value channels per program.

All H query heads of a token share one K = V head, so a token's heads form the M side of a GEMM: a program
takes one query (b, s), BH of its heads and BDV of the d value channels, and walks its picked rows in BN-key
tiles, the window part first, then the compressed part, in one online softmax (fp32, exp2 domain):

    scores[BH, BN] = q[BH, d] . kv[BN, d]^T     (one dot over all d when BDK = d, else d/BDK dots)
    acc[BH, BDV]  += p[BH, BN] . kv[BN, BDV]    (the same tile reused as V when BDV = BDK = d)

With BH = 64 and BN = 64 (bf16) both products are 64 x 64 x 512 / 64 x 512 x 64 tensor-core GEMMs; V4-Pro's 128
heads take two head blocks. A -1 pick is masked (its row is not loaded, its logit is -inf); a part's loop stops
after its last valid pick, so the trailing -1s of a short window, a young HCA row or a top-k with fewer visible
entries than k cost nothing. The sink is a logit with no value: it starts the running max and sum (m = sink,
l = 1), so a query with every pick masked gets o = 0, as the torch reference does.

When one program per (query, head block) would leave SMs idle (decode: batch x head blocks below half the
SMs), the query's tiles are split into runs, one program each (``CoreConfig.split_k``); each writes its running
max, sum and unnormalised acc (fp32) and ``_combine_kernel`` merges the runs in split order.

The steps around the core (constexpr flags, all off by default; ``triton_impl`` sets them) run inside these kernels
on small grids (decode and short chunks, where they cost less than the launches and passes they save); on large
ones the dispatcher runs them as the unfused passes around the plain kernel (``CoreTuning.fuse_max_waves``). The
math of the steps:

- ``q_rope`` (prologue): q comes raw from q_b; as a program loads its q tile it applies what ``kernels.norm_rope``
  does (per-head RMSNorm over d in fp32, then RoPE of the last 2F channels, fp32, rounded to q's dtype), so the
  separate pass over q [B, S, H, d] goes away. With QK in chunks (BDK < d) the norm factor takes one pass over q
  before the loop and each chunk holding rope channels is rotated as it is loaded (the pair partners, channel
  c ^ 1, by a second load).
- ``o_rope`` / ``out_fp8`` (epilogue, in the core kernel or, when the keys are split, in ``_combine_kernel``): the
  output rounded to q's dtype, then the inverse RoPE of its last 2F channels (fp32, the partners by a split /
  join of the tile, rounded again), then ``fp8.act_quant``: per (row, 128 channels) s = pow2_ceil(max(amax,
  1e-4) / 448) (bit ops), e4m3(o / s) (round to nearest even), o_q [B*S, H*d] and s [H*d/128, B*S]. These are
  the unfused chain's roundings in its order, so the result has its bits (``core -> rope_tail(inverse) ->
  act_quant``): the rotation's multiply-add is pinned to fma(x_swap, -+sin, x * cos), as in ``norm_rope``'s
  kernel (the compiler would otherwise contract it either way), and under the interpreter, whose float8 cast
  does not round to nearest even, the e4m3 encoding is integer ops. A program's value block (BDV >= 128) holds
  whole 128-channel scale blocks.

Deterministic: every output element is written by one program, keys and splits are visited in a fixed order, no
atomics: the same inputs give the same bits on every run.
"""

from __future__ import annotations

from moe_wave.comm.triton_gate import tl, triton

if triton is not None:
    from moe_wave.fp8 import e4m3_rne as _e4m3_rne, pow2_scale_bits

__all__ = ["picks_chunk"]


def picks_chunk(J1: int, J2: int, block_n: int) -> int:
    """Picks per load when a program counts its tiles: every pick of the longer part in one load (a power of two),
    up to 2048."""
    return min(2048, 1 << (max(J1, J2, block_n) - 1).bit_length())


if triton is not None:

    @triton.jit
    def _mm(a, b, acc, IEEE: tl.constexpr):
        # acc + a @ b, accumulated in place (wgmma). IEEE: exact fp32 products (fp32 inputs, and the
        # interpreter, whose 16-bit dots are wrong: the operands are widened there, keeping their rounding)
        if IEEE:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _n_tiles(idx_row, J, BN: tl.constexpr, JC: tl.constexpr):
        # BN-key tiles up to this query's last valid pick (trailing -1s cost nothing); the picks read JC at a
        # time (JC >= J on the V4 shapes: one load, not a chain of dependent loads at the program's start)
        last = tl.full((), 0, tl.int32)
        for t0 in range(0, J, JC):
            jj = t0 + tl.arange(0, JC)
            picks = tl.load(idx_row + jj, mask=jj < J, other=-1).to(tl.int32)
            last = tl.maximum(last, tl.max(tl.where(picks >= 0, jj + 1, 0), axis=0))
        return tl.cdiv(last, BN)

    @triton.jit
    def _q_prologue(x, qrow, dk, hmask, qinv, qpos, freq_ptr, D: tl.constexpr, RF: tl.constexpr, LO: tl.constexpr,
                    W: tl.constexpr, INTERP: tl.constexpr):
        # q's channels dk = LO .. LO+W (x, as loaded, [BH, W]) as norm_rope(q, pos, freq) has them: times qinv
        # (1 / rms per head), the rope channels (the last RF of d, pairs (2i, 2i+1): a second load of the pair
        # partners, tail channels only) rotated by pos * freq, in fp32, rounded once to q's dtype. qrow: [BH, 1]
        # pointers to the heads' rows.
        y = x.to(tl.float32) * qinv[:, None]
        if RF > 0:
            if LO + W > D - RF:                                         # this chunk holds rope channels
                ct = dk - (D - RF)
                tail = (ct >= 0) & (dk < D)
                xs = tl.load(qrow + (dk ^ 1)[None, :], mask=hmask[:, None] & tail[None, :], other=0.0)
                xs = xs.to(tl.float32) * qinv[:, None]
                ang = qpos * tl.load(freq_ptr + tl.maximum(ct, 0) // 2, mask=tail, other=0.0)
                c = tl.cos(ang)
                sn = tl.sin(ang)
                sn = tl.where((dk % 2) == 0, -sn, sn)                   # even: x*cos - x_odd*sin; odd: + x_even*sin
                y = tl.where(tail[None, :], _rot(y, xs, c, sn, INTERP), y)
        return y.to(x.dtype)

    @triton.jit
    def _rot(x, xs, c, sn, INTERP: tl.constexpr):
        # x * cos + x_partner * (+-sin) [BH, W], rounded as norm_rope's kernel rounds it where the chain runs: its
        # `xt * c + xs * s` is pinned to fma(xs, s, xt * c) there and here, as left to itself the compiler
        # contracts this expression either way, by context. The interpreter rounds each product and the sum.
        if INTERP:
            return x * c[None, :] + xs * sn[None, :]
        return tl.fma(xs, sn[None, :], x * c[None, :])

    @triton.jit
    def _q_inv_rms(q_row, hmask, eps, D: tl.constexpr, BD: tl.constexpr, BDK: tl.constexpr):
        # 1 / rms over the d channels of each head (fp32), a pass over q in BDK-channel chunks (BDK < d)
        ss = tl.zeros((hmask.shape[0],), tl.float32)
        for d0 in tl.static_range(0, BD, BDK):
            dk = d0 + tl.arange(0, BDK)
            x = tl.load(q_row + dk[None, :], mask=hmask[:, None] & (dk[None, :] < D), other=0.0).to(tl.float32)
            ss += tl.sum(x * x, axis=1)
        return 1.0 / tl.sqrt(ss / D + eps)

    @triton.jit
    def _epilogue(o, o_ptr, o_off, omask, odt_ptr, sc_ptr, pos_ptr, freq_ptr, row, M, h, hmask, dv0,
                  D: tl.constexpr, BH: tl.constexpr, BDV: tl.constexpr, RF: tl.constexpr, OROPE: tl.constexpr,
                  FP8: tl.constexpr, INTERP: tl.constexpr):
        # The normalised output o [BH, BDV] (fp32; channels dv0 ..) rounded to q's dtype (odt_ptr's), then as the
        # unfused chain has it: OROPE: rope_tail(inverse) of the last RF channels in fp32 from those values (the
        # pair partner by a split / join of the tile), rounded again; FP8: act_quant of each 128 channels (row
        # `row` of M): s = pow2_ceil(max(amax, 1e-4) / 448) by bit ops, e4m3(y * (1 / s)) to o_ptr, s to
        # sc_ptr[(h * D / 128 + block) * M + row].
        dv = dv0 + tl.arange(0, BDV)
        y = o.to(odt_ptr.dtype.element_ty)
        if OROPE:
            x = y.to(tl.float32)
            ev, od = tl.split(tl.reshape(y, (BH, BDV // 2, 2)))         # (in q's dtype: half the bytes to move)
            xs = tl.reshape(tl.join(od, ev), (BH, BDV)).to(tl.float32)  # xs[:, c] = x[:, c ^ 1]
            ct = dv - (D - RF)
            tail = (ct >= 0) & (dv < D)
            ang = tl.load(pos_ptr + row).to(tl.float32) * tl.load(freq_ptr + tl.maximum(ct, 0) // 2, mask=tail,
                                                                   other=0.0)
            c = tl.cos(ang)
            sn = tl.sin(ang)
            sn = -sn                                                    # inverse: rotate by -angle
            sn = tl.where((dv % 2) == 0, -sn, sn)
            y = tl.where(tail[None, :], _rot(x, xs, c, sn, INTERP), x).to(odt_ptr.dtype.element_ty)
        if FP8:
            y3 = tl.reshape(y.to(tl.float32), (BH, BDV // 128, 128))
            amax = tl.maximum(tl.max(tl.abs(y3), axis=2), 1e-4)
            sbits, ibits = pow2_scale_bits(amax)                        # act_quant's scale, the same bits
            inv = ibits.to(tl.float32, bitcast=True)                    # 1 / s, exact (s a power of two)
            z = tl.reshape(y3 * inv[:, :, None], (BH, BDV))
            if INTERP:                                                  # the interpreter's fp8 cast is off
                zq = _e4m3_rne(z)
            else:
                zq = z.to(tl.float8e4nv, fp_downcast_rounding="rtne")
            tl.store(o_ptr + o_off, zq, mask=omask)
            blk = dv0 // 128 + tl.arange(0, BDV // 128)
            tl.store(sc_ptr + (h[:, None] * (D // 128) + blk[None, :]).to(tl.int64) * M + row,
                     sbits.to(tl.float32, bitcast=True), mask=hmask[:, None] & (blk < D // 128)[None, :])
        else:
            tl.store(o_ptr + o_off, y, mask=omask)

    @triton.jit
    def _core_part(q_ptr, kv_b, idx_row, q_full, b, s, h, hmask, J, t_lo, t_hi, s_q_b, s_q_s, s_q_h, s_kv_m,
                   qk_scale, m_i, l_i, acc, dv, qinv, qpos, qfreq_ptr, D: tl.constexpr, BD: tl.constexpr,
                   BN: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, IEEE: tl.constexpr, QROPE: tl.constexpr,
                   QRF: tl.constexpr, INTERP: tl.constexpr):
        # One key source: the online softmax over tiles t_lo..t_hi of this query's picks idx_row[:J].
        for t in range(t_lo, t_hi):
            j = t * BN + tl.arange(0, BN)
            row = tl.load(idx_row + j, mask=j < J, other=-1).to(tl.int32)   # (int64 picks: half the registers)
            ok = row >= 0
            rows = kv_b + tl.maximum(row, 0).to(tl.int64)[:, None] * s_kv_m
            if BDK == BD:
                dk = tl.arange(0, BD)
                k = tl.load(rows + dk[None, :], mask=ok[:, None] & (dk[None, :] < D), other=0.0)
                sc = _mm(q_full, tl.trans(k), tl.zeros((h.shape[0], BN), tl.float32), IEEE)
            else:
                sc = tl.zeros((h.shape[0], BN), tl.float32)
                for d0 in tl.static_range(0, BD, BDK):
                    dk = d0 + tl.arange(0, BDK)
                    qc = tl.load(q_ptr + b * s_q_b + s * s_q_s + h[:, None] * s_q_h + dk[None, :],
                                 mask=hmask[:, None] & (dk[None, :] < D), other=0.0)
                    if QROPE:                                           # q as norm_rope has it, chunk by chunk
                        qc = _q_prologue(qc, q_ptr + b * s_q_b + s * s_q_s + h[:, None] * s_q_h, dk, hmask, qinv,
                                         qpos, qfreq_ptr, D, QRF, d0, BDK, INTERP)
                    k = tl.load(rows + dk[None, :], mask=ok[:, None] & (dk[None, :] < D), other=0.0)
                    sc = _mm(qc, tl.trans(k), sc, IEEE)
            if (BDK == BD) and (BDV == BD):
                v = k                                                   # K = V: the tile is the values too
            else:
                v = tl.load(rows + dv[None, :], mask=ok[:, None] & (dv[None, :] < D), other=0.0)
            sc = tl.where(ok[None, :], sc * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = _mm(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit(do_not_specialize=["S", "H", "J1", "J2", "NDV", "NSPLIT"])   # one compile for every length
    def _sparse_core_kernel(q_ptr, o_ptr, sink_ptr, kv1_ptr, idx1_ptr, kv2_ptr, idx2_ptr, ws_ml_ptr, ws_acc_ptr,
                            qpos_ptr, qfreq_ptr, opos_ptr, ofreq_ptr, sc_ptr, eps,
                            S, H, J1, J2, NDV, NSPLIT, qk_scale, s_q_b, s_q_s, s_q_h, s_o_b, s_o_s, s_o_h,
                            s_k1_b, s_k1_m, s_i1_b, s_i1_s, s_k2_b, s_k2_m, s_i2_b, s_i2_s,
                            D: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                            BDK: tl.constexpr, BDV: tl.constexpr, TWO: tl.constexpr, SPLIT: tl.constexpr,
                            IEEE: tl.constexpr, QROPE: tl.constexpr, QRF: tl.constexpr, OROPE: tl.constexpr,
                            ORF: tl.constexpr, FP8: tl.constexpr, INTERP: tl.constexpr, JC: tl.constexpr):
        # Program (query b*S+s, head block, split * NDV + value block); see the module docstring. With SPLIT,
        # split i of NSPLIT takes the i-th run of the query's tiles (window tiles, then compressed tiles) and
        # writes its running max, sum and unnormalised acc for _combine_kernel; only split 0 counts the sink.
        # QROPE: q is raw (q_b's output): RMSNorm (eps) and RoPE (qpos, qfreq, the last QRF channels) on load.
        # OROPE / FP8: the output's inverse RoPE (opos, ofreq, ORF) / FP8 quantisation (scales to sc_ptr), here
        # or, with SPLIT, in _combine_kernel. INTERP: Triton's CPU interpreter runs it (its rope and fp8 roundings).
        bs = tl.program_id(0)
        b = (bs // S).to(tl.int64)
        s = (bs % S).to(tl.int64)
        h = tl.program_id(1) * BH + tl.arange(0, BH)
        hmask = h < H
        split = tl.program_id(2) // NDV
        dv = (tl.program_id(2) % NDV) * BDV + tl.arange(0, BDV)
        qinv = tl.zeros((BH,), tl.float32)
        qpos = tl.full((), 0.0, tl.float32)
        if QROPE:
            qpos = tl.load(qpos_ptr + bs).to(tl.float32)
            if BDK < BD:                                                # per head 1 / rms, once per program
                qinv = _q_inv_rms(q_ptr + b * s_q_b + s * s_q_s + h[:, None] * s_q_h, hmask, eps, D, BD, BDK)
        q_full = tl.zeros((BH, BD), q_ptr.dtype.element_ty)
        if BDK == BD:                                                   # the whole q tile, loaded once
            dq = tl.arange(0, BD)
            q_full = tl.load(q_ptr + b * s_q_b + s * s_q_s + h[:, None] * s_q_h + dq[None, :],
                             mask=hmask[:, None] & (dq[None, :] < D), other=0.0)
            if QROPE:
                xq = q_full.to(tl.float32)
                qinv = 1.0 / tl.sqrt(tl.sum(xq * xq, axis=1) / D + eps)
                q_full = _q_prologue(q_full, q_ptr + b * s_q_b + s * s_q_s + h[:, None] * s_q_h, dq, hmask, qinv,
                                     qpos, qfreq_ptr, D, QRF, 0, BD, INTERP)
        idx1 = idx1_ptr + b * s_i1_b + s * s_i1_s
        idx2 = idx2_ptr + b * s_i2_b + s * s_i2_s
        n1 = _n_tiles(idx1, J1, BN, JC)
        n2 = 0
        if TWO:
            n2 = _n_tiles(idx2, J2, BN, JC)
        lo = n1 * 0
        hi = n1 + n2
        if SPLIT:
            per = tl.cdiv(n1 + n2, NSPLIT)
            lo = tl.minimum(split * per, n1 + n2)
            hi = tl.minimum(lo + per, n1 + n2)
        m_i = tl.load(sink_ptr + h, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full((BH,), 1.0, tl.float32) * (split == 0).to(tl.float32)
        acc = tl.zeros((BH, BDV), tl.float32)
        m_i, l_i, acc = _core_part(q_ptr, kv1_ptr + b * s_k1_b, idx1, q_full, b, s, h, hmask, J1,
                                   tl.minimum(lo, n1), tl.minimum(hi, n1), s_q_b, s_q_s, s_q_h, s_k1_m,
                                   qk_scale, m_i, l_i, acc, dv, qinv, qpos, qfreq_ptr, D, BD, BN, BDK, BDV, IEEE,
                                   QROPE, QRF, INTERP)
        if TWO:
            m_i, l_i, acc = _core_part(q_ptr, kv2_ptr + b * s_k2_b, idx2, q_full, b, s, h, hmask, J2,
                                       tl.maximum(lo, n1) - n1, tl.maximum(hi, n1) - n1, s_q_b, s_q_s, s_q_h,
                                       s_k2_m, qk_scale, m_i, l_i, acc, dv, qinv, qpos, qfreq_ptr, D, BD, BN, BDK,
                                       BDV, IEEE, QROPE, QRF, INTERP)
        if SPLIT:                                                       # partials: [B*S, NSPLIT, 2, H], [.., H, D]
            r = bs.to(tl.int64) * NSPLIT + split
            mine = hmask & ((h * 0 + tl.program_id(2) % NDV) == 0)      # one value block writes m and l
            tl.store(ws_ml_ptr + (r * 2) * H + h, m_i, mask=mine)
            tl.store(ws_ml_ptr + (r * 2 + 1) * H + h, l_i, mask=mine)
            tl.store(ws_acc_ptr + (r * H + h[:, None]) * D + dv[None, :], acc,
                     mask=hmask[:, None] & (dv[None, :] < D))
        elif OROPE or FP8:
            _epilogue(acc / l_i[:, None], o_ptr, b * s_o_b + s * s_o_s + h[:, None] * s_o_h + dv[None, :],
                      hmask[:, None] & (dv[None, :] < D), q_ptr, sc_ptr, opos_ptr, ofreq_ptr, bs.to(tl.int64),
                      tl.num_programs(0), h, hmask, (tl.program_id(2) % NDV) * BDV, D, BH, BDV, ORF, OROPE, FP8,
                      INTERP)
        else:
            o = acc / l_i[:, None]
            tl.store(o_ptr + b * s_o_b + s * s_o_s + h[:, None] * s_o_h + dv[None, :],
                     o.to(o_ptr.dtype.element_ty), mask=hmask[:, None] & (dv[None, :] < D))

    @triton.jit(do_not_specialize=["S", "H", "NSPLIT"])
    def _combine_kernel(ws_ml_ptr, ws_acc_ptr, o_ptr, odt_ptr, sc_ptr, pos_ptr, freq_ptr, S, H, NSPLIT,
                        s_o_b, s_o_s, s_o_h, D: tl.constexpr, BH: tl.constexpr, BDV: tl.constexpr,
                        RF: tl.constexpr, OROPE: tl.constexpr, FP8: tl.constexpr, INTERP: tl.constexpr):
        # The splits of one query merged in split order (deterministic): o = sum_i w_i acc_i / sum_i w_i l_i,
        # w_i = 2^(m_i - max_i m_i); then the core kernel's epilogue (OROPE / FP8, odt_ptr: q, for its dtype).
        bs = tl.program_id(0)
        b = (bs // S).to(tl.int64)
        s = (bs % S).to(tl.int64)
        h = tl.program_id(1) * BH + tl.arange(0, BH)
        hmask = h < H
        dv = tl.program_id(2) * BDV + tl.arange(0, BDV)
        r0 = bs.to(tl.int64) * NSPLIT
        m = tl.full((BH,), float("-inf"), tl.float32)
        for i in range(0, NSPLIT):
            m = tl.maximum(m, tl.load(ws_ml_ptr + ((r0 + i) * 2) * H + h, mask=hmask, other=0.0))
        den = tl.zeros((BH,), tl.float32)
        acc = tl.zeros((BH, BDV), tl.float32)
        for i in range(0, NSPLIT):
            w = tl.exp2(tl.load(ws_ml_ptr + ((r0 + i) * 2) * H + h, mask=hmask, other=0.0) - m)
            den += w * tl.load(ws_ml_ptr + ((r0 + i) * 2 + 1) * H + h, mask=hmask, other=1.0)
            part = tl.load(ws_acc_ptr + ((r0 + i) * H + h[:, None]) * D + dv[None, :],
                           mask=hmask[:, None] & (dv[None, :] < D), other=0.0)
            acc += w[:, None] * part
        if OROPE or FP8:
            _epilogue(acc / den[:, None], o_ptr, b * s_o_b + s * s_o_s + h[:, None] * s_o_h + dv[None, :],
                      hmask[:, None] & (dv[None, :] < D), odt_ptr, sc_ptr, pos_ptr, freq_ptr, bs.to(tl.int64),
                      tl.num_programs(0), h, hmask, tl.program_id(2) * BDV, D, BH, BDV, RF, OROPE, FP8, INTERP)
        else:
            tl.store(o_ptr + b * s_o_b + s * s_o_s + h[:, None] * s_o_h + dv[None, :],
                     (acc / den[:, None]).to(o_ptr.dtype.element_ty), mask=hmask[:, None] & (dv[None, :] < D))


"""The sparse attention core as one Triton kernel, tiled for the tensor cores (the math is ``core.sparse_attention``).

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

Optional fusions (constexpr flags of the kernels, all off by default; ``sparse_attention_fused``'s keywords).
By default they run inside the kernels on small grids (decode and short chunks, where they cost less than the
launches and passes they save) and as the unfused passes around the plain kernel on large ones (this kernel is at
its register limit: at a 4096-token prefill the fused prologue costs more than norm_rope's pass); see
``FUSE_MAX_WAVES``, ``fuse`` overrides. On a large grid, Hopper's warp-specialized Gluon kernel (``core_gluon``)
runs them instead: ``q_rope`` on each item's q in shared memory before its first QK (the RoPE tail rotated in
place, the norm a factor of each head's scores, so within bf16 rounding of the chain rather than its bits),
``o_rope`` / ``out_fp8`` in its epilogue with the chain's bits (``q_norm_inside`` says where the layer then
leaves q raw). The math of the steps:

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
  kernel (the compiler would otherwise contract it either way: before ``norm_rope`` was pinned too, it rounded
  2-5 elements of 150 000 the other way at d = 128 on an H200), and under the interpreter, whose float8 cast
  does not round
  to nearest even, the e4m3 encoding is integer ops. A program's value block (BDV >= 128) holds whole 128-channel
  scale blocks.

Deterministic: every output element is written by one program, keys and splits are visited in a fixed order, no
atomics: the same inputs give the same bits on every run. ``CoreConfig`` picks the tiling; the default and the
split count depend only on shapes and dtype (``default_config``, ``_splits``); a config the GPU cannot hold
(shared memory) falls back to the next one of ``FALLBACKS`` at its first launch, which then sticks for that
shape.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from moe_wave.comm.triton_gate import interpreting, sm_count, tl, triton
from moe_wave.fp8 import act_quant

if triton is not None:
    from moe_wave.fp8 import e4m3_rne as _e4m3_rne, pow2_scale_bits

from . import core_cuda, core_gluon
from .kernels import norm_rope

__all__ = ["CoreConfig", "default_config", "FALLBACKS", "FUSE_MAX_WAVES", "sparse_attention_fused", "check_fusion",
           "core_impl", "core_flops"]

_LOG2E = 1.4426950408889634


@dataclass(frozen=True, kw_only=True)
class CoreConfig:
    """Tiling of the sparse core kernel (powers of two, each >= 16).

    block_h: query heads per program (the GEMM's M); block_n: picked keys per tile (N of QK, K of PV);
    block_dk: channels per QK dot (d rounded up to a power of two = one dot); block_dv: value channels per
    program (below d the QK is recomputed per value block); split_k: programs per query and head block, each
    over a run of its key tiles, merged by a second kernel in a fixed order (0: auto, more than one only when
    the grid would leave SMs idle, as in decode; 1: never); num_warps / num_stages: Triton's launch options.
    """

    block_h: int = 64
    block_n: int = 64
    block_dk: int = 512
    block_dv: int = 512
    num_warps: int = 8
    num_stages: int = 2
    split_k: int = 0

    def __post_init__(self):
        for name in ("block_h", "block_n", "block_dk", "block_dv"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"CoreConfig.{name}={v}: must be a power of two >= 16")
        if self.split_k < 0:
            raise ValueError(f"CoreConfig.split_k={self.split_k}: must be >= 0 (0: auto)")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"CoreConfig num_warps={self.num_warps}, num_stages={self.num_stages}: "
                             "num_warps a power of two <= 16, num_stages >= 1")

    def fit(self, H: int, D: int) -> "CoreConfig":
        """This config clipped to the problem: blocks no larger than the (power-of-two) head count and d."""
        return _fit(self, H, D)


# Tried in order when a config does not fit the GPU (triton OutOfResources at its first launch).
FALLBACKS = (
    CoreConfig(),                                                              # 64 x 64 tiles, d in one dot
    CoreConfig(num_stages=1),
    CoreConfig(block_dk=128, block_dv=256),                                    # QK in 4 dots, half the values
    CoreConfig(block_h=32, block_n=32, block_dk=64, block_dv=128, num_warps=4, num_stages=1),
)


@lru_cache(maxsize=256)
def _fit(cfg: CoreConfig, H: int, D: int) -> CoreConfig:
    bd = _pow2(D)
    return replace(cfg, block_h=min(cfg.block_h, max(16, _pow2(H))), block_dk=min(cfg.block_dk, bd),
                   block_dv=min(cfg.block_dv, bd))


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132                      # the interpreter: any fixed number keeps the choice shape-only
    return sm_count(device)


@lru_cache(maxsize=256)
def default_config(H: int, D: int, dtype: torch.dtype) -> CoreConfig:
    """The tiling for a problem: 64 heads x 64 keys with d in one dot for 16-bit inputs, the keys split
    across programs when the grid is small (``CoreConfig.split_k`` = 0); small exact tiles for fp32 (fp32 runs
    the tests and the CPU parity checks, not the model). Shapes and dtype only: the same call, the same bits."""
    if dtype == torch.float32:
        cfg = CoreConfig(block_h=32, block_n=32, block_dk=64, block_dv=128, num_warps=4, num_stages=1)
        return cfg.fit(H, D)
    return CoreConfig().fit(H, D)


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
        # x * cos + x_partner * (+-sin) [BH, W], rounded as norm_rope's kernel rounds it where the chain runs: on a
        # GPU its `xt * c + xs * s` compiles to fma(xs, s, xt * c) (seen on an H200, Triton 3.6); pinned here, as
        # left to itself the compiler contracts this expression either way, by context. The interpreter rounds
        # each product and the sum.
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


# sparse_attention_fused(fuse=None) runs q_rope / o_rope / out_fp8 inside the kernels up to this many waves of
# programs (query x head block) and as the unfused passes beyond. The kernel is at its register limit, so the fused
# steps cost ~15-20 us per wave, against ~80 us + ~8 us per wave for the passes (H200, V4-Flash, 64 heads, all
# three steps: S=128 (1 wave) 92 us fused vs 164 us chained, core alone 79; 4096-token prefill (31 waves) 2552 vs
# 2183, core alone 1845; decode batch 64 and 8: 110 / 106 vs 215 / 222).
FUSE_MAX_WAVES = 4

_CHOSEN: dict = {}   # (device, shape key, requested config) -> the config that launched


def _splits(cfg: CoreConfig, B: int, S: int, H: int, J: int, device: torch.device) -> int:
    """Key splits per query: ``cfg.split_k``, or (0 = auto) as many as fit the SMs in one wave of programs when one
    program per query and head block would leave half of them idle (decode), at most one per key tile. (On one H200,
    V4-Flash CSA decode at batch 64: 2 splits 57 us, 3 splits 76 us: a second, partial wave of programs costs more
    than the SMs it fills.)"""
    if cfg.split_k:
        return cfg.split_k
    programs = B * S * triton.cdiv(H, cfg.block_h)
    if 2 * programs > _sm_count(device):
        return 1
    return max(1, min(_sm_count(device) // programs, triton.cdiv(max(J, 1), cfg.block_n)))


@dataclass(frozen=True)
class _Fusion:
    """The optional prologue / epilogue of one call (see ``sparse_attention_fused``), checked, on q's device."""

    qpos: torch.Tensor | None = None            # [B*S] positions of q's RoPE; None: no prologue
    qfreq: torch.Tensor | None = None           # fp32 [F]
    eps: float = 0.0
    opos: torch.Tensor | None = None            # [B*S] positions of the output's inverse RoPE; None: none
    ofreq: torch.Tensor | None = None
    fp8: bool = False

    @property
    def key(self) -> tuple:
        return (self.qpos is not None, self.opos is not None, self.fp8)


def check_fusion(q_BSHd: torch.Tensor, q_rope=None, o_rope=None, out_fp8: bool = False) -> _Fusion:
    """The fusion arguments of ``sparse_attention_fused`` / ``core.sparse_attention`` checked (clear errors)."""
    B, S, H, D = q_BSHd.shape

    def rope(name, pos, freq):
        F = 0 if freq is None else freq.numel()
        if 2 * F > D:
            raise ValueError(f"sparse_attention: {name} has {F} frequencies, 2 * {F} > d={D}")
        if pos is None or pos.numel() != B * S:
            got = None if pos is None else tuple(pos.shape)
            raise ValueError(f"sparse_attention: {name} positions {got} must be [B={B}, S={S}]")
        f = freq.float().contiguous() if F else torch.zeros(0, dtype=torch.float32, device=q_BSHd.device)
        return pos.reshape(-1).contiguous(), f

    fu = {}
    if q_rope is not None:
        if len(q_rope) != 3:
            raise ValueError(f"sparse_attention: q_rope must be (pos_BS, freq_F, eps), got {len(q_rope)} items")
        fu["qpos"], fu["qfreq"] = rope("q_rope", q_rope[0], q_rope[1])
        fu["eps"] = float(q_rope[2])
    if o_rope is not None:
        if len(o_rope) != 2:
            raise ValueError(f"sparse_attention: o_rope must be (pos_BS, freq_F), got {len(o_rope)} items")
        fu["opos"], fu["ofreq"] = rope("o_rope", o_rope[0], o_rope[1])
    if out_fp8 and D % 128:
        raise ValueError(f"sparse_attention: out_fp8 needs head_dim d={D} to be a multiple of 128 (one scale per "
                         f"128 channels of a head)")
    return _Fusion(**fu, fp8=bool(out_fp8))


def _launch(cfg: CoreConfig, q, out, sinks, kv1, i1, kv2, i2, scale: float, two: bool, fu: _Fusion,
            scales: torch.Tensor | None) -> None:
    B, S, H, D = q.shape
    BD = _pow2(D)
    J1, J2 = i1.shape[-1], (i2.shape[-1] if two else 0)
    ndv = triton.cdiv(D, cfg.block_dv)
    nsplit = _splits(cfg, B, S, H, J1 + J2, q.device)
    if nsplit > 1:
        ws_ml = torch.empty(B * S * nsplit * 2 * H, dtype=torch.float32, device=q.device)
        ws_acc = torch.empty(B * S * nsplit * H * D, dtype=torch.float32, device=q.device)
    else:
        ws_ml = ws_acc = sinks                                          # unused
    unused = sinks
    qpos, qfreq = (fu.qpos, fu.qfreq) if fu.qpos is not None else (unused, unused)
    opos, ofreq = (fu.opos, fu.ofreq) if fu.opos is not None else (unused, unused)
    sc = scales if scales is not None else unused
    qrf = 0 if fu.qfreq is None else 2 * fu.qfreq.numel()
    orf = 0 if fu.ofreq is None else 2 * fu.ofreq.numel()
    orope, fp8, interp = fu.opos is not None, fu.fp8, interpreting()
    grid = (B * S, triton.cdiv(H, cfg.block_h), ndv * nsplit)
    _sparse_core_kernel[grid](
        q, out, sinks, kv1, i1, kv2, i2, ws_ml, ws_acc, qpos, qfreq, opos, ofreq, sc, fu.eps,
        S, H, J1, J2, ndv, nsplit, float(scale) * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        kv1.stride(0), kv1.stride(1), i1.stride(0), i1.stride(1), kv2.stride(0), kv2.stride(1), i2.stride(0),
        i2.stride(1), D=D, BD=BD, BH=cfg.block_h, BN=cfg.block_n, BDK=cfg.block_dk, BDV=cfg.block_dv,
        TWO=two, SPLIT=nsplit > 1, IEEE=q.dtype == torch.float32 or interpreting(), QROPE=fu.qpos is not None,
        QRF=qrf, OROPE=orope, ORF=orf, FP8=fp8, INTERP=interp, JC=core_gluon.picks_chunk(J1, J2, cfg.block_n),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if nsplit > 1:
        bdv = min(128, BD)
        _combine_kernel[(B * S, triton.cdiv(H, cfg.block_h), triton.cdiv(D, bdv))](
            ws_ml, ws_acc, out, q, sc, opos, ofreq, S, H, nsplit, out.stride(0), out.stride(1), out.stride(2), D=D,
            BH=cfg.block_h, BDV=bdv, RF=orf, OROPE=orope, FP8=fp8, INTERP=interp, num_warps=4)


def sparse_attention_fused(q_BSHd: torch.Tensor, parts: list, sinks_H: torch.Tensor, scale: float,
                           config: CoreConfig | None = None, fallback: bool = True, *, q_rope=None, o_rope=None,
                           out_fp8: bool = False, fuse: bool | None = None, impl: str = "auto"):
    """``core.sparse_attention`` as one Triton kernel (one or two parts), see the module docstring.

    Args:
        q_BSHd: queries (bf16/fp16 for the tensor-core path; fp32 runs exact small tiles).
        parts: ``(kv_BMd, idx_BSJ)`` pairs (the window, then the compressed entries); ids index dim 1 of
            ``kv_BMd``, -1 is masked. kv is cast to q's dtype.
        sinks_H: per-head sink logits; scale: softmax scale.
        config: tiling (default ``default_config``); clipped to H and d.
        fallback: on a GPU that cannot hold ``config``, run the next of ``FALLBACKS`` (False: raise triton's
            OutOfResources, as a benchmark of that very tiling wants).
        q_rope: ``(pos_BS, freq_F, eps)``: q is raw (q_b's output); the kernel applies
            ``kernels.norm_rope(q, pos, freq, eps=eps)`` (per-head RMSNorm without weight, then RoPE of the last
            2F channels, fp32, rounded to q's dtype) as it loads q. freq may be None or empty (norm only).
        o_rope: ``(pos_BS, freq_F)``: the output's last 2F channels get the inverse RoPE
            (``rope_tail(o, pos, freq, inverse=True)``), computed in fp32 from the output rounded to q's dtype.
        out_fp8: return ``moe_wave.fp8.act_quant_torch(o.reshape(B*S, H*d))`` of the q-dtype output (after
            o_rope) instead of o; d must be a multiple of 128.
        fuse: where q_rope / o_rope / out_fp8 run: True: inside the kernels; False: as the unfused chain around
            the plain kernel (``norm_rope``, then ``norm_rope(inverse)`` in place and ``fp8.act_quant``); None
            (default): inside when the grid is at most ``FUSE_MAX_WAVES`` waves of programs, else the chain. Same
            results either way (the epilogue's bits; the prologue's to the rounding of its sum of squares).
        impl: which kernel runs a plain call (no fusion inside, one program per query and head block):
            "gluon": ``core_gluon`` (Hopper; an error where ``core_gluon.supported`` says no), "triton": this
            module's kernel, "auto" (default): Gluon where supported (prefill on an H100 / H200) and no ``config`` is
            given, else Triton; and where Gluon would run, ``core_cuda``'s CUDA C++ kernel if it takes the call
            (d = 512, bf16, V4's RoPE tails, up to ``core_cuda.MAX_PICKS`` picks a query: V4's three layer
            types) and ``core_cuda.ENABLED``, with or without the fused steps.
            The two agree to bf16 rounding, not bit for bit (their sums run in different orders); each repeats
            its own bits. ``config`` tiles the Triton kernel only.
    Returns:
        o_BSHd in q's dtype (0 for a query whose every pick is masked); with ``out_fp8`` the pair ``(o_q, s)``:
        o_q float8_e4m3fn ``[B*S, H*d]``, s fp32 ``[H*d/128, B*S]`` contiguous (powers of two).
    """
    if not 1 <= len(parts) <= 2:
        raise ValueError(f"sparse_attention_fused: {len(parts)} parts, supports 1 or 2")
    B, S, H, D = q_BSHd.shape
    fu = check_fusion(q_BSHd, q_rope, o_rope, out_fp8)
    q = q_BSHd if q_BSHd.stride(-1) == 1 else q_BSHd.contiguous()
    srcs = []
    for kv, idx in parts:
        if kv.shape[0] != B or kv.shape[-1] != D or tuple(idx.shape[:2]) != (B, S):
            raise ValueError(f"sparse_attention_fused: part kv {tuple(kv.shape)} / idx {tuple(idx.shape)} must be "
                             f"[B={B}, M, d={D}] / [B={B}, S={S}, J]")
        kv = kv.to(q.dtype)
        kv = kv if kv.stride(-1) == 1 else kv.contiguous()
        srcs.append((kv, idx if idx.stride(-1) == 1 else idx.contiguous()))
    two = len(srcs) == 2
    (kv1, i1), (kv2, i2) = srcs[0], srcs[1] if two else srcs[0]
    # the kernels read the sinks in their dtype and widen them (no fp32 copy a call: a launch of its own)
    wide = sinks_H.dtype in (torch.float32, torch.bfloat16, torch.float16)
    sinks = (sinks_H if wide else sinks_H.float()).contiguous()
    want = (config or default_config(H, D, q.dtype)).fit(H, D)
    if fuse is None:
        fuse = _fuse_inside(q, want)
    if impl not in ("auto", "triton", "gluon"):
        raise ValueError(f"sparse_attention_fused: impl={impl!r} must be 'auto', 'triton' or 'gluon'")
    J = i1.shape[-1] + (i2.shape[-1] if two else 0)
    if B * S * H and not fuse and fu.key != (False, False, False) and _ws_runs(q, len(srcs), J, want, config, impl):
        # the warp-specialized Gluon kernel runs the chain's steps: q's norm and RoPE as an item's q arrives (the
        # norm a factor of the scores: within bf16 rounding of the chain), the output's in its epilogue (its bits);
        # or, where it runs, the CUDA C++ kernel (core_cuda: a CTA a query, one an SM), the same steps
        out, scales, result = _outputs(q, fu)
        if _cuda_runs(q, len(srcs), fu, J, impl) and _run_cuda(q, out, sinks, kv1, i1, kv2, i2, scale, two, fu,
                                                              scales):
            return result
        try:
            core_gluon.sparse_attention_gluon(q, out, sinks, kv1, i1, kv2, i2, scale, two,
                                              o_rope=(fu.opos, fu.ofreq) if fu.opos is not None else None,
                                              scales=scales,
                                              q_rope=(fu.qpos, fu.qfreq, fu.eps) if fu.qpos is not None else None)
            return result
        except core_gluon.WSUnavailable:        # it did not compile here (warned once): the chain below runs
            pass
    if B * S * H and not fuse and fu.key != (False, False, False):    # the unfused chain around the plain kernel
        if fu.qpos is not None:
            q = norm_rope(q, fu.qpos, fu.qfreq, eps=fu.eps)
        o = sparse_attention_fused(q, srcs, sinks, scale, config, fallback, impl=impl)
        if fu.opos is not None:
            norm_rope(o, fu.opos, fu.ofreq, norm=False, inverse=True, out=o)
        return act_quant(o.reshape(B * S, H * D)) if fu.fp8 else o
    if fu.fp8 and want.block_dv < 128:
        raise ValueError(f"sparse_attention_fused: out_fp8 needs CoreConfig.block_dv >= 128 (a program's value "
                         f"channels hold whole 128-channel scale blocks), got block_dv={want.block_dv}")
    out, scales, result = _outputs(q, fu)
    if B * S * H == 0:
        return result
    if impl != "triton":
        if _gluon_runs(q, len(srcs), J, want, config, impl, fu.key != (False, False, False)):
            if _cuda_runs(q, len(srcs), None, J, impl) and _run_cuda(q, out, sinks, kv1, i1, kv2, i2, scale, two,
                                                                      None, None):
                return result
            try:
                core_gluon.sparse_attention_gluon(q, out, sinks, kv1, i1, kv2, i2, scale, two)
                return result
            except core_gluon.COMPILE_ERRORS as e:                      # raised before anything runs
                if impl == "gluon":
                    raise
                core_gluon.mark_broken(e)                               # warn once; Triton from now on
        if impl == "gluon":
            raise ValueError(f"sparse_attention_fused: impl='gluon' cannot run this call (needs a Hopper GPU, "
                             f"bf16/fp16 q, d in 64..512 a power of two, heads a multiple of {core_gluon.BH}, "
                             f"no fused steps); q {tuple(q.shape)} {q.dtype} on "
                             f"{q.device}")
    key = (q.device, q.dtype, H, D, two, want, fu.key)
    cfg = _CHOSEN.get(key, want)
    ladder = [cfg] + [c.fit(H, D) for c in FALLBACKS if fallback and key not in _CHOSEN
                      and not (fu.fp8 and c.fit(H, D).block_dv < 128)]
    for i, c in enumerate(ladder):
        try:
            _launch(c, q, out, sinks, kv1, i1, kv2, i2, scale, two, fu, scales)
        except triton.runtime.errors.OutOfResources:
            if i == len(ladder) - 1:
                raise
            continue
        _CHOSEN[key] = c
        return result
    raise AssertionError("unreachable: the ladder either launched or raised")


def _cuda_runs(q: torch.Tensor, n_parts: int, fu: _Fusion | None, J: int, impl: str) -> bool:
    # where a Gluon kernel would run a prefill call (the caller knows): the CUDA C++ kernel instead, under impl
    # "auto", if enabled and it takes the call (J picks a query: up to core_cuda.MAX_PICKS)
    if impl != "auto" or not core_cuda.ENABLED:
        return False
    qrf = 2 * fu.qfreq.numel() if fu is not None and fu.qpos is not None else 0
    orf = 2 * fu.ofreq.numel() if fu is not None and fu.opos is not None else 0
    return core_cuda.supported(q, n_parts, qrf, orf, J)


def _run_cuda(q, out, sinks, kv1, i1, kv2, i2, scale, two, fu: _Fusion | None, scales) -> bool:
    # launch core_cuda's kernel; False (warned once, the Gluon kernels from now on) where it does not compile here,
    # and False for this call where its operands break a rule of that kernel alone (16-byte alignment, positions of
    # two dtypes): the Gluon kernel takes them
    try:
        core_cuda.sparse_attention_cuda(
            q, out, sinks, kv1, i1, kv2, i2, scale, two,
            q_rope=(fu.qpos, fu.qfreq, fu.eps) if fu is not None and fu.qpos is not None else None,
            o_rope=(fu.opos, fu.ofreq) if fu is not None and fu.opos is not None else None, scales=scales)
        return True
    except ValueError:                                                  # checked before anything runs
        return False
    except RuntimeError as e:                                           # NVRTC / the driver, before anything runs
        core_cuda.mark_broken(e)
        return False


def _outputs(q: torch.Tensor, fu: _Fusion):
    """(out the kernels write [B, S, H, d], FP8 scales or None, what the call returns)."""
    B, S, H, D = q.shape
    if fu.fp8:
        o_q = torch.empty(B * S, H * D, dtype=torch.float8_e4m3fn, device=q.device)
        scales = torch.empty(H * D // 128, B * S, dtype=torch.float32, device=q.device)
        return o_q.view(B, S, H, D), scales, (o_q, scales)
    out = torch.empty_like(q)
    return out, None, out


def _fuse_inside(q: torch.Tensor, want: CoreConfig) -> bool:
    # the fused steps run inside the kernel up to FUSE_MAX_WAVES waves of programs (query x head block)
    B, S, H, _ = q.shape
    return B * S * triton.cdiv(H, want.block_h) <= FUSE_MAX_WAVES * _sm_count(q.device)


def _gluon_runs(q: torch.Tensor, n_parts: int, J: int, want: CoreConfig, config: CoreConfig | None, impl: str,
                fused_inside: bool) -> bool:
    # impl="gluon": whenever core_gluon supports the call; "auto": only without a Triton tiling (config) and not
    # where the Triton kernel would split the keys (decode: its splits fill the SMs); "triton": never
    if impl == "triton" or (impl == "auto" and config is not None):
        return False
    B, S, H, _ = q.shape
    nsplit = 1 if impl == "gluon" else _splits(want, B, S, H, J, q.device)
    return core_gluon.supported(q, n_parts, nsplit, fused_inside)


# the layer leaves q's norm and RoPE to the warp-specialized kernel where it runs (``q_norm_inside``); False: on the q
# branch everywhere (benchmarks compare the two)
WS_Q_NORM = True


def q_norm_inside(q_BSHd: torch.Tensor, n_parts: int) -> bool:
    """Whether ``sparse_attention_fused(q_rope=...)`` of this q (raw, [B, S, H, d]) with ``n_parts`` parts and no
    tiling of its own applies q's norm and RoPE inside Hopper's warp-specialized Gluon kernel, as an item's q
    arrives in shared memory (a large grid: prefill). There it saves ``norm_rope``'s pass over q (a read and a
    write of B*S*H*d elements: on one H200, V4-Flash prefill at 4096 tokens, the attention layer 104-129 us
    faster); on small grids the chain (or the Triton kernel's prologue) runs instead, where the layer prefers the
    norm on its q branch (``V4Attention.q_heads``). ``WS_Q_NORM = False`` says no everywhere."""
    B, S, H, D = q_BSHd.shape
    if not WS_Q_NORM or not B * S * H or not q_BSHd.is_cuda or triton is None:
        return False
    want = default_config(H, D, q_BSHd.dtype).fit(H, D)
    return not _fuse_inside(q_BSHd, want) and _ws_runs(q_BSHd, n_parts, 0, want, None, "auto")


def _ws_runs(q: torch.Tensor, n_parts: int, J: int, want: CoreConfig, config: CoreConfig | None, impl: str) -> bool:
    # a call with fused steps on a large grid (not fused inside the Triton kernel) runs the warp-specialized Gluon
    # kernel, which does those steps itself
    return _gluon_runs(q, n_parts, J, want, config, impl, False) and core_gluon.ws_supported()


def core_impl(q_BSHd: torch.Tensor, parts: list, *, fusions: bool = False, config: CoreConfig | None = None,
              impl: str = "auto", fuse: bool | None = None) -> str:
    """Which kernel ``sparse_attention_fused`` runs for this call: "cuda", "gluon" or "triton" (benchmarks label their
    rows with it). fusions: the call has q_rope / o_rope / out_fp8 (inside the Triton kernel on small grids, as
    separate passes around a plain call on large ones, see ``FUSE_MAX_WAVES``)."""
    H, D = q_BSHd.shape[2:]
    want = (config or default_config(H, D, q_BSHd.dtype)).fit(H, D)
    inside = fusions and (_fuse_inside(q_BSHd, want) if fuse is None else fuse)
    J = sum(idx.shape[-1] for _, idx in parts)
    if not _gluon_runs(q_BSHd, len(parts), J, want, config, impl, inside):
        return "triton"
    return "cuda" if _cuda_runs(q_BSHd, len(parts), None, J, impl) else "gluon"


def core_flops(H: int, D: int, idx_parts: list) -> tuple[float, float]:
    """(useful, nominal) FLOPs of the core: 4*H*d per (query, pick) (QK and PV), counting the valid picks
    (``idx >= 0``, a device reduction: a host sync) or every pick."""
    valid = sum(int((idx >= 0).sum()) for idx in idx_parts)   # HOST SYNC: benchmarks only
    nominal = sum(idx.numel() for idx in idx_parts)
    return 4.0 * H * D * valid, 4.0 * H * D * nominal

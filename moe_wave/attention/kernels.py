"""Fused Triton kernels of the attention front-end, with the torch ops they replace as fallback.

Legend: R rows (vectors of d channels), d channels, F = r/2 rope frequencies, B batch, S queries,
h indexer heads, e indexer head dim, N compressed-entry slots.

* ``norm_rope``: RMSNorm (optional weight) and the interleaved tail RoPE (optional, forward or
  inverse) of every row in one pass: one read and one write of the tensor instead of ~15 torch ops
  with fp32 temporaries (the q heads alone are 4096 x 64 x 512 at a 4096-token prefill).
* ``pool_entries``: the compressor's gated pooling of every window a chunk touches, from the ring
  and the chunk, with its RMSNorm and RoPE, written into the entry cache: one launch (two for HCA's long
  windows, whose channels spread over several programs) instead of ~30 torch ops (gathers of [n, R, C] fp32
  tiles, softmax, norm, rope, scatter).
* ``ring_write``: the compressor's ring update (the chunk's last tokens' fp32 kv and score) in one launch.
* ``picks``: each query's rows of the sliding window (or HCA's visible entries) in one launch, int32.
* ``index_scores``: the lightning indexer's ``sum_h w[t,h] * ReLU(q[t,h] . k[j])`` with the causal
  visibility mask, one [BS, BN] tile per program looping over heads, without the [S, h, N]
  intermediate; tiles that no query of the block can see are skipped.

The sparse core is in ``sparse_core/`` and the indexer's top-k in ``topk.py``.
Each kernel runs on CUDA/ROCm tensors (and on CPU under ``TRITON_INTERPRET=1``, which the tests use to check
them against the torch versions). Callers decide with ``use_kernels(t, mode)``, ``mode`` being
``ScheduleConfig.kernels``: "auto" (Triton on a GPU), "off" (torch ops everywhere), "on" (Triton wherever
it can run). Called directly, a kernel function runs Triton wherever it can and its torch twin elsewhere.
The kernels compute in fp32 and round once at the end; the torch ops round the way HF does (e.g.
q * rsqrt(..).to(bf16)), so the two agree to the dtype's rounding, not bit for bit.
"""

from __future__ import annotations

import torch

from moe_wave.comm.triton_gate import interpreting, tl, triton, triton_ok
from moe_wave.fp8 import BLOCK, FP8, QAct, act_quant

if triton is not None:
    from moe_wave.fp8 import e4m3_rne, pow2_scale_bits

__all__ = ["KERNEL_MODES", "index_scores", "index_scores_torch", "norm_rope", "norm_rope_torch", "picks",
           "pool_entries", "prefix_picks_torch", "ring_write", "rms_norm_quant", "use_kernels", "window_picks_torch"]

KERNEL_MODES = ("auto", "on", "off")
_WANT = {"auto": None, "on": True, "off": False}


def use_kernels(t: torch.Tensor, mode: str = "auto") -> bool:
    """True when the Triton kernels run on ``t``'s device under ``mode`` (``ScheduleConfig.kernels``): "auto" on
    a GPU with Triton, "on" also on CPU under Triton's interpreter, "off" never."""
    if mode not in _WANT:
        raise ValueError(f"kernels={mode!r}: must be one of {KERNEL_MODES}")
    return triton_ok(t.device, want=_WANT[mode])


def _direct(t: torch.Tensor) -> bool:
    """A kernel function called directly runs Triton wherever Triton can run."""
    return triton_ok(t.device, want=True)


# ----------------------------------------------------------------------------------- norm + rope
def norm_rope_torch(x: torch.Tensor, pos: torch.Tensor | None = None, freq_F: torch.Tensor | None = None, *,
                    norm: bool = True, weight: torch.Tensor | None = None, eps: float = 1e-6,
                    inverse: bool = False) -> torch.Tensor:
    """Reference of ``norm_rope`` in fp32 (a new tensor in x's dtype, rounded once)."""
    y = x.float()
    if norm:
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + eps)
        if weight is not None:
            y = y * weight.float()
    if freq_F is not None and freq_F.numel():
        F = freq_F.numel()
        rows = pos.numel()
        lead = y.shape[:-1]
        yv = y.reshape(rows, -1, y.shape[-1])                       # [P, H, d]
        ang = pos.reshape(rows, 1, 1).float() * freq_F.float()      # [P, 1, F]
        cos, sin = ang.cos(), ang.sin()
        if inverse:
            sin = -sin
        t = yv[..., -2 * F:]
        a, b = t[..., 0::2], t[..., 1::2]
        rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
        y = torch.cat([yv[..., :-2 * F], rot], dim=-1).reshape(*lead, -1)
    return y.to(x.dtype)


if triton is not None:

    @triton.jit
    def _norm_rope_kernel(x_ptr, out_ptr, pos_ptr, freq_ptr, w_ptr, sc_ptr, H, eps,
                          D: tl.constexpr, HC: tl.constexpr, BH: tl.constexpr, TC: tl.constexpr, BT: tl.constexpr,
                          HB: tl.constexpr, NORM: tl.constexpr, WEIGHT: tl.constexpr, INVERSE: tl.constexpr,
                          HEAD: tl.constexpr, QUANT: tl.constexpr, ROWPOS: tl.constexpr, INTERP: tl.constexpr):
        # Program (p, hb): rows p*H + hb*HB .. +HB (rows of one position share its cos/sin). A row is
        # HC leading channels (the "head", no RoPE) then TC = 2F rotated channels (the "tail"), each
        # loaded as a contiguous [HB, channels] tile. RoPE pairs (2i, 2i+1) are split out of the tail's tile
        # in registers (not a second load with the pair swapped, channel c ^ 1: Triton made that 2-byte loads,
        # 32 a thread at d = 128): y_even = x_even*cos - x_odd*sin, y_odd = x_odd*cos + x_even*sin.
        # QUANT (no RoPE, HC a multiple of 128): the normalised rows, rounded to x's dtype, leave in act_quant's
        # format instead: e4m3 to out_ptr, the scales to sc_ptr [HC/128, rows] (fp8.act_quant's bits).
        # ROWPOS (one row a position, e.g. the window's kv): program p takes rows p*HB .. +HB of the H rows, each
        # at its own position (its own cos/sin; the same values and roundings).
        p = tl.program_id(0)
        if ROWPOS:
            h = p * HB + tl.arange(0, HB)
            hmask = h < H
            row = h.to(tl.int64)[:, None] * D
        else:
            h = tl.program_id(1) * HB + tl.arange(0, HB)
            hmask = h < H
            row = (p.to(tl.int64) * H + h)[:, None] * D
        ss = tl.zeros((HB,), tl.float32)
        if HEAD:
            ch = tl.arange(0, BH)
            mh = hmask[:, None] & (ch < HC)[None, :]
            xh = tl.load(x_ptr + row + ch[None, :], mask=mh, other=0.0).to(tl.float32)
            if NORM:
                ss += tl.sum(xh * xh, axis=1)
        if TC > 0:
            ct = tl.arange(0, BT)
            tmask = ct < TC
            mt = hmask[:, None] & tmask[None, :]
            xt = tl.load(x_ptr + row + HC + ct[None, :], mask=mt, other=0.0).to(tl.float32)
            if NORM:
                ss += tl.sum(xt * xt, axis=1)
        if NORM:
            inv = (1.0 / tl.sqrt(ss / D + eps))[:, None]
        if HEAD:
            if NORM:
                xh = xh * inv
                if WEIGHT:
                    xh = xh * tl.load(w_ptr + ch, mask=ch < HC, other=0.0).to(tl.float32)[None, :]
            if QUANT:
                y3 = tl.reshape(xh.to(x_ptr.dtype.element_ty).to(tl.float32), (HB, BH // 128, 128))
                amax = tl.maximum(tl.max(tl.abs(y3), axis=2), 1e-4)
                sbits, ibits = pow2_scale_bits(amax)
                z = tl.reshape(y3 * ibits.to(tl.float32, bitcast=True)[:, :, None], (HB, BH))
                if INTERP:                                  # the interpreter's float8 cast is off
                    zq = e4m3_rne(z)
                else:
                    zq = z.to(tl.float8e4nv, fp_downcast_rounding="rtne")
                tl.store(out_ptr + row + ch[None, :], zq, mask=mh)
                blk = tl.arange(0, BH // 128)
                rid = (p * H + h).to(tl.int64)
                tl.store(sc_ptr + blk[None, :].to(tl.int64) * (tl.num_programs(0) * H) + rid[:, None],
                         sbits.to(tl.float32, bitcast=True), mask=hmask[:, None] & (blk < HC // 128)[None, :])
            else:
                tl.store(out_ptr + row + ch[None, :], xh.to(out_ptr.dtype.element_ty), mask=mh)
        if TC > 0:
            if NORM:
                xt = xt * inv
                if WEIGHT:
                    xt = xt * tl.load(w_ptr + HC + ct, mask=tmask, other=0.0).to(tl.float32)[None, :]
            xe, xo = tl.split(tl.reshape(xt, (HB, BT // 2, 2)))  # pair i: channels 2i, 2i + 1 (from one load)
            fi = tl.arange(0, BT // 2)
            f = tl.load(freq_ptr + fi, mask=fi < TC // 2, other=0.0)
            if ROWPOS:
                ang = tl.load(pos_ptr + h, mask=hmask, other=0).to(tl.float32)[:, None] * f[None, :]
                c = tl.cos(ang)
                s = tl.sin(ang)
            else:
                ang = tl.load(pos_ptr + p).to(tl.float32) * f
                c = tl.cos(ang)[None, :]
                s = tl.sin(ang)[None, :]
            if INVERSE:
                s = -s
            # pinned to fma(x_odd, -sin, x_even * cos) and fma(x_even, sin, x_odd * cos): left to itself the
            # compiler contracts these either way, by context (a few elements in 10^5 the other way), and the core's
            # fused epilogues (sparse_core.triton_kernels._rot, the CUDA core) round them this way; the interpreter
            # rounds each product and the sum
            if INTERP:
                ye = xe * c - xo * s
                yo = xo * c + xe * s
            else:
                ye = tl.fma(xo, -s, xe * c)
                yo = tl.fma(xe, s, xo * c)
            y = tl.reshape(tl.join(ye, yo), (HB, BT))
            tl.store(out_ptr + row + HC + ct[None, :], y.to(out_ptr.dtype.element_ty), mask=mt)


# norm_rope's program size: rows (heads) of one position per program up to this many channels in all, and its
# warps (dev/profile_attn.py --micro-only times the choices)
NORM_ROPE_TILE = 4096
NORM_ROPE_WARPS = 4
# one row a position (the window's kv, [B*S, 512]): this many rows (positions) a program, a power of two (a row a
# program took 7.0 us for V4-Flash's 4096-token prefill on one H200: 4096 programs of 576 channels)
NORM_ROPE_ROWPOS_ROWS = 8


def norm_rope(x: torch.Tensor, pos: torch.Tensor | None = None, freq_F: torch.Tensor | None = None, *,
              norm: bool = True, weight: torch.Tensor | None = None, eps: float = 1e-6, inverse: bool = False,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm (``norm``, times ``weight`` when given) then RoPE of the last ``2F`` channels.

    Args:
        x: [..., d], d even; rows are the vectors. ``pos`` gives one position per group of rows:
            with P = pos.numel(), rows r*H .. r*H+H-1 (H = rows / P) share pos[r] (e.g. x [B, S, H, d]
            and pos [B, S]).
        freq_F: fp32 [F] inverse frequencies (``rope.inv_freq``), None or empty: no RoPE.
        inverse: rotate by -angle (undo RoPE).
        out: where to write (may be ``x`` itself); default a new tensor.
    Returns:
        ``out`` (x's shape and dtype). Triton wherever it runs (a GPU, or CPU under the interpreter), else the
        torch ops.
    """
    d = x.shape[-1]
    F = 0 if freq_F is None else freq_F.numel()
    if d % 2 or 2 * F > d:
        raise ValueError(f"norm_rope: last dim {d} must be even and >= 2 * freq ({2 * F})")
    if weight is not None and weight.numel() != d:
        raise ValueError(f"norm_rope: weight has {weight.numel()} elements, must equal the last dim {d}")
    if not (_direct(x) and x.is_contiguous() and x.numel()):
        y = norm_rope_torch(x, pos, freq_F, norm=norm, weight=weight, eps=eps, inverse=inverse)
        if out is None:
            return y
        out.copy_(y)
        return out
    R = x.numel() // d
    if F:
        P = pos.numel()
        if P == 0 or R % P:
            raise ValueError(f"norm_rope: {R} rows do not split into groups for {P} positions")
        H = R // P
        pos_c = pos.reshape(-1).contiguous()
        freq_c = freq_F.float().contiguous()
    else:
        P, H, pos_c, freq_c = 1, R, x, x   # no RoPE: one group of all rows; unused pointers
    in_place = out is not None and out.data_ptr() == x.data_ptr()
    if out is None:
        out = torch.empty_like(x)
    head = norm or not in_place or F == 0     # RoPE alone, in place: only the rotated tail is touched
    hc, tc = d - 2 * F, 2 * F
    bh = triton.next_power_of_2(max(hc, 1))
    bt = triton.next_power_of_2(max(tc, 1))
    width = (bh if head else 0) + (bt if tc else 0)
    rowpos = bool(F) and H == 1      # one row a position: programs of several positions (HB by the shape alone)
    hb = NORM_ROPE_ROWPOS_ROWS if rowpos else _rows_tile(H, width)
    w = weight.contiguous() if weight is not None else x
    _norm_rope_kernel[(triton.cdiv(P, hb), 1) if rowpos else (P, triton.cdiv(H, hb))](
        x, out, pos_c, freq_c, w, x, P if rowpos else H, float(eps), D=d, HC=hc, BH=bh, TC=tc, BT=bt, HB=hb,
        NORM=bool(norm), WEIGHT=weight is not None, INVERSE=bool(inverse), HEAD=bool(head and hc > 0), QUANT=False,
        ROWPOS=rowpos, INTERP=interpreting(), num_warps=NORM_ROPE_WARPS)
    return out


def _rows_tile(rows: int, width: int) -> int:
    """``_norm_rope_kernel``'s rows a program (HB, a power of two): up to ``NORM_ROPE_TILE`` channels of a tile
    ``width`` wide, and no more than ``rows`` rounded up (one definition: a row's sum's bits depend on HB)."""
    hb = max(1, min(triton.next_power_of_2(rows), NORM_ROPE_TILE // width))
    return 1 << (hb.bit_length() - 1)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> QAct:
    """``act_quant(rms_norm(x, weight, eps))`` in one pass: the rows of x [..., K] (K a multiple of 128) normalised
    (fp32, times weight), rounded to x's dtype, then quantised to the FP8 format, with the same bits as that chain
    (``norm_rope``'s program and sums, then ``fp8.act_quant``'s scale and rounding). Returns the ``QAct`` that
    ``FP8Linear`` takes in place of the normalised tensor (V4's q_lora feeds two FP8 projections: wq_b and the
    indexer's). Triton wherever it runs (a GPU, or CPU under the interpreter), else the chain's torch ops."""
    K = x.shape[-1] if x.dim() else 0
    if K <= 0 or K % BLOCK:
        raise ValueError(f"rms_norm_quant: last dim {K} must be a positive multiple of {BLOCK}")
    if weight is not None and weight.numel() != K:
        raise ValueError(f"rms_norm_quant: weight has {weight.numel()} elements, must equal the last dim {K}")
    M = x.numel() // K
    if not (_direct(x) and x.is_contiguous() and M):
        q, s = act_quant(norm_rope(x, weight=weight, eps=eps).reshape(M, K))
        return QAct(q, s, x.shape, x.dtype)
    q = torch.empty(M, K, dtype=FP8, device=x.device)
    s = torch.empty(K // BLOCK, M, dtype=torch.float32, device=x.device)
    bh = triton.next_power_of_2(K)
    hb = _rows_tile(M, bh)
    w = weight.contiguous() if weight is not None else x
    _norm_rope_kernel[(1, triton.cdiv(M, hb))](
        x, q, x, x, w, s, M, float(eps), D=K, HC=K, BH=bh, TC=0, BT=1, HB=hb, NORM=True,
        WEIGHT=weight is not None, INVERSE=False, HEAD=True, QUANT=True, ROWPOS=False, INTERP=interpreting(),
        num_warps=NORM_ROPE_WARPS)
    return QAct(q, s, x.shape, x.dtype)


# ----------------------------------------------------------------------------------- indexer
def index_scores_torch(qI_BShe: torch.Tensor, w_BSh: torch.Tensor, k_BNe: torch.Tensor, pos_BS: torch.Tensor,
                       ratio: int) -> torch.Tensor:
    """Reference: fp32 [B, S, N] scores, -inf where entry j is not visible to query t (j >= (pos+1)//ratio)."""
    s = torch.einsum("bshe,bne->bshn", qI_BShe.float(), k_BNe.float()).relu()
    score = (s * w_BSh.float()[..., None]).sum(dim=2)
    N = k_BNe.shape[1]
    vis = torch.arange(N, device=pos_BS.device) < ((pos_BS + 1) // ratio)[..., None]
    return score.masked_fill(~vis, float("-inf"))


if triton is not None:

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        # a @ b in fp32: exact products for fp32 inputs (IEEE), the tensor cores' for 16-bit ones
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _index_scores_kernel(q_ptr, w_ptr, k_ptr, pos_ptr, out_ptr, S, N, Hh, ratio,
                             sq_b, sq_s, sq_h, sw_b, sw_s, sk_b, sk_n, so_b, so_s,
                             E: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
        ps = tl.program_id(0)
        pn = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        s = ps * BS + tl.arange(0, BS)
        n = pn * BN + tl.arange(0, BN)
        e = tl.arange(0, E)
        smask = s < S
        nmask = n < N
        pos = tl.load(pos_ptr + b * S + s, mask=smask, other=-1)
        vis = (pos + 1) // ratio                                           # entries < vis are visible
        out = tl.full((BS, BN), float("-inf"), tl.float32)
        if pn * BN < tl.max(vis, axis=0):                                  # some query of the block sees the tile
            k = tl.load(k_ptr + b * sk_b + n[:, None] * sk_n + e[None, :], mask=nmask[:, None], other=0.0)
            kT = tl.trans(k)
            acc = tl.zeros((BS, BN), tl.float32)
            for h in range(0, Hh):
                q = tl.load(q_ptr + b * sq_b + s[:, None] * sq_s + h * sq_h + e[None, :], mask=smask[:, None],
                            other=0.0)
                dot = _dot(q, kT, IEEE)
                wh = tl.load(w_ptr + b * sw_b + s * sw_s + h, mask=smask, other=0.0)
                acc += wh[:, None] * tl.maximum(dot, 0.0)
            see = (n[None, :] < vis[:, None]) & nmask[None, :]
            out = tl.where(see, acc, out)
        tl.store(out_ptr + b * so_b + s[:, None] * so_s + n[None, :], out, mask=smask[:, None] & nmask[None, :])


    @triton.jit
    def _index_scores_heads_kernel(q_ptr, w_ptr, k_ptr, pos_ptr, out_ptr, S, N, Hh, ratio,
                                   sq_b, sq_s, sq_h, sw_b, sw_s, sk_b, sk_n, so_b, so_s,
                                   E: tl.constexpr, BH: tl.constexpr, BQ: tl.constexpr, BN: tl.constexpr,
                                   IEEE: tl.constexpr):
        # Program (block of BQ queries of batch row b, block of BN entries): the entry tile is loaded once; per
        # query its heads form the dot's M side (one [BH, E] x [E, BN] dot per head block, all rows useful even
        # for one query: decode), then the ReLU, the head weights and the sum over heads.
        pq = tl.program_id(0)
        pn = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        n = pn * BN + tl.arange(0, BN)
        e = tl.arange(0, E)
        hh = tl.arange(0, BH)
        nmask = n < N
        k = tl.load(k_ptr + b * sk_b + n[:, None] * sk_n + e[None, :], mask=nmask[:, None], other=0.0)
        kT = tl.trans(k)
        s0 = pq * BQ
        for s in range(s0, tl.minimum(s0 + BQ, S)):
            vis = (tl.load(pos_ptr + b * S + s) + 1) // ratio                 # entries < vis are visible
            out = tl.full((BN,), float("-inf"), tl.float32)
            if pn * BN < vis:
                acc = tl.zeros((BN,), tl.float32)
                for h0 in range(0, Hh, BH):
                    h = h0 + hh
                    hm = h < Hh
                    q = tl.load(q_ptr + b * sq_b + s * sq_s + h[:, None] * sq_h + e[None, :], mask=hm[:, None],
                                other=0.0)
                    dot = _dot(q, kT, IEEE)
                    wh = tl.load(w_ptr + b * sw_b + s * sw_s + h, mask=hm, other=0.0)
                    acc += tl.sum(wh[:, None] * tl.maximum(dot, 0.0), axis=0)
                out = tl.where((n < vis) & nmask, acc, out)
            tl.store(out_ptr + b * so_b + s * so_s + n, out, mask=nmask)


# Which scores kernel: "heads" puts a query's heads on the dot's M side (every row useful for any S); "queries" puts
# 64 queries on M and loops over the heads (in decode 63 of its 64 rows are padding). On one H200
# (dev/profile_attn.py, V4-Flash, 1024 entries, 64 heads): decode batch 64 13 us vs 136 us, prefill 4096 262 us vs
# 132 us. So "heads" below INDEX_QUERIES_MIN queries per row, "queries" from there on.
INDEX_QUERIES_MIN = 64


def index_scores(qI_BShe: torch.Tensor, w_BSh: torch.Tensor, k_BNe: torch.Tensor, pos_BS: torch.Tensor,
                 ratio: int, kernel: str | None = None) -> torch.Tensor:
    """fp32 [B, S, N] indexer scores with the causal mask (-inf: not visible). See the module docstring.

    Args:
        qI_BShe: indexer queries (RoPE applied); w_BSh: fp32 head weights (scales folded in);
        k_BNe: compressed indexer keys (only the first N slots are scored); pos_BS: positions.
        kernel: "heads" or "queries" (default: chosen by S, see ``INDEX_QUERIES_MIN``).
    """
    B, S, Hh, E = qI_BShe.shape
    N = k_BNe.shape[1]
    if not _direct(qI_BShe) or E & (E - 1) or E < 16 or B * S * N == 0:
        return index_scores_torch(qI_BShe, w_BSh, k_BNe, pos_BS, ratio)
    q = qI_BShe if qI_BShe.stride(-1) == 1 else qI_BShe.contiguous()
    k = k_BNe.to(q.dtype)
    k = k if k.stride(-1) == 1 else k.contiguous()
    w = w_BSh.float()
    pos = pos_BS.contiguous()
    out = torch.empty(B, S, N, dtype=torch.float32, device=q.device)
    args = (q, w, k, pos, out, S, N, Hh, int(ratio), q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1),
            k.stride(0), k.stride(1), out.stride(0), out.stride(1))
    ieee = q.dtype == torch.float32
    kind = kernel or ("heads" if S < INDEX_QUERIES_MIN else "queries")
    if kind == "heads":
        BQ, BN = 16, 64
        _index_scores_heads_kernel[(triton.cdiv(S, BQ), triton.cdiv(N, BN), B)](
            *args, E=E, BH=min(64, max(16, triton.next_power_of_2(Hh))), BQ=BQ, BN=BN, IEEE=ieee, num_warps=4)
    elif kind == "queries":
        BS, BN = 64, 64
        _index_scores_kernel[(triton.cdiv(S, BS), triton.cdiv(N, BN), B)](*args, E=E, BS=BS, BN=BN, IEEE=ieee,
                                                                           num_warps=4, num_stages=2)
    else:
        raise ValueError(f"index_scores: kernel={kind!r} must be 'heads' or 'queries'")
    return out


# ----------------------------------------------------------------------------------- compressor
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
        # ``_entry_finish_kernel`` to normalise (on one H200, V4-Flash's HCA prefill: 8.7 us against 23.7 with
        # [BJ, BLOCK, 2] tiles; CSA's one program a window took 59.4 us with 2-D tiles against 18.8 with these)
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


POOL_SPLIT_PAIRS = 16   # SPLIT's channel pairs a program (32 channels: 16 programs a 512-channel entry; one
#                         H200, HCA's 4096-token prefill: 8.7 us, 32 pairs 11.0, 8 pairs 10.5)
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


# ----------------------------------------------------------------------------------- picks
def window_picks_torch(pos_BS: torch.Tensor, window: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Reference of ``picks(pos, window=W)``: each query's W window rows [B, S, W] in the key source ``[ring |
    chunk]`` (``V4Attention.window_source``): key position t - w (w = 0 .. W-1) at row W + (t - w - p0) when it is
    in the chunk (p0 = the row's first position), at its ring row (t - w) mod W when older, -1 before position 0."""
    q_BSW = pos_BS[..., None] - torch.arange(window, device=pos_BS.device)    # key positions t, t-1, ..
    p0_B11 = pos_BS[:, :1, None]
    idx_BSW = torch.where(q_BSW >= p0_B11, window + q_BSW - p0_B11, q_BSW % window)
    return torch.where(q_BSW >= 0, idx_BSW, torch.full_like(idx_BSW, -1)).to(dtype)


def prefix_picks_torch(pos_BS: torch.Tensor, slots: int, ratio: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Reference of ``picks(pos, slots=N, ratio=m)``: HCA's compressed entries for each query [B, S, N], entry n
    where its window is complete at the query (n < (t + 1) // m), else -1."""
    n_N = torch.arange(slots, device=pos_BS.device)
    vis_BSN = n_N < ((pos_BS + 1) // ratio)[..., None]
    return torch.where(vis_BSN, n_N, torch.full_like(n_N, -1)).to(dtype)


if triton is not None:

    @triton.jit
    def _picks_kernel(pos_ptr, out_ptr, rows, S, W, ratio, BR: tl.constexpr, BW: tl.constexpr,
                      PREFIX: tl.constexpr):
        # BR query rows (b * S + s) of W picks each, a program. Window (PREFIX off): key position t - w at row
        # W + (t - w - p0) from the chunk's start p0 on, else (t - w) mod W in the ring (from t mod W, t >= 0),
        # -1 below 0. PREFIX: entry w if w < (t + 1) // ratio, else -1. The
        # arithmetic in int32 (positions and rows below 2^31; int64 division is a long software sequence on GPUs:
        # the window's picks took 10.7 us at 4096 x 128 on an H200 with it)
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        rmask = r < rows
        w = tl.arange(0, BW)
        t = tl.load(pos_ptr + r, mask=rmask, other=0).to(tl.int32)
        if PREFIX:
            idx = tl.where(w[None, :] < ((t + 1) // ratio)[:, None], w[None, :], -1)
        else:
            p0 = tl.load(pos_ptr + (r // S) * S, mask=rmask, other=0).to(tl.int32)
            kp = t[:, None] - w[None, :]
            ring = (t % W)[:, None] - w[None, :]                        # (t - w) mod W, one division a row
            ring = tl.where(ring < 0, ring + W, ring)
            idx = tl.where(kp >= p0[:, None], W + kp - p0[:, None], ring)
            idx = tl.where(kp >= 0, idx, -1)
        tl.store(out_ptr + r.to(tl.int64)[:, None] * W + w[None, :], idx.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & (w[None, :] < W))


def picks(pos_BS: torch.Tensor, *, window: int = 0, slots: int = 0, ratio: int = 1,
          dtype: torch.dtype = torch.int32, kernel: bool | None = None) -> torch.Tensor:
    """Each query's rows of a key part in one launch, instead of ~10 torch ops on [B, S, W] int64 tensors:
    ``window=W``: the sliding window's W rows in the source ``[ring | chunk]`` (``window_picks_torch``);
    ``slots=N, ratio=m``: HCA's N compressed entries, the incomplete ones -1 (``prefix_picks_torch``).
    pos_BS: int64 [B, S], each row's positions consecutive from its first. Returns [B, S, W or N] in ``dtype``
    (int32: what the core kernels read with the fewest registers). ``kernel``: None, Triton wherever it runs, else
    the torch ops; False, the torch ops (a caller's ``use_kernels``)."""
    if (window > 0) == (slots > 0):
        raise ValueError(f"picks: window={window}, slots={slots}: give exactly one of them > 0")
    if ratio <= 0:
        raise ValueError(f"picks: ratio={ratio} must be > 0")
    if pos_BS.dim() != 2:
        raise ValueError(f"picks: pos_BS {tuple(pos_BS.shape)} must be [B, S]")
    if pos_BS.numel() >= 2 ** 31:
        raise ValueError(f"picks: {pos_BS.numel()} query rows: the kernel counts rows in int32 (< 2^31)")
    if not (kernel is not False and _direct(pos_BS) and pos_BS.numel()):
        if window:
            return window_picks_torch(pos_BS, window, dtype)
        return prefix_picks_torch(pos_BS, slots, ratio, dtype)
    B, S = pos_BS.shape
    W = window or slots
    out = torch.empty(B, S, W, dtype=dtype, device=pos_BS.device)
    bw = triton.next_power_of_2(W)
    br = max(1, min(64, 4096 // bw))
    _picks_kernel[(triton.cdiv(B * S, br),)](pos_BS.contiguous(), out, B * S, S, W, ratio, BR=br, BW=bw,
                                            PREFIX=slots > 0, num_warps=4)
    return out

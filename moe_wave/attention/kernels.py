"""Fused Triton kernels of the attention front-end, with the torch ops they replace as fallback.

Legend: R rows (vectors of d channels), d channels, F = r/2 rope frequencies, B batch, S queries,
h indexer heads, e indexer head dim, N compressed-entry slots.

* ``norm_rope``: RMSNorm (optional weight) and the interleaved tail RoPE (optional, forward or
  inverse) of every row in one pass: one read and one write of the tensor instead of ~15 torch ops
  with fp32 temporaries (the q heads alone are 4096 x 64 x 512 at a 4096-token prefill).
* ``compressor_kernels``: the compressor's pooling (``pool_entries``) and ring update (``ring_write``).
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
           "prefix_picks_torch", "rms_norm_quant", "use_kernels", "window_picks_torch"]

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
# one row a position (the window's kv, [B*S, 512]): this many rows (positions) a program, a power of two (one row a
# program leaves the programs too small: dev/profile_attn.py times the choices)
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
# 64 queries on M and loops over the heads (in decode 63 of its 64 rows are padding): "heads" below
# INDEX_QUERIES_MIN queries per row, "queries" from there on (each the faster there: dev/profile_attn.py,
# benchmarks/results/attn.md).
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
        # arithmetic in int32 (positions and rows below 2^31; int64 division is a long software sequence on GPUs)
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

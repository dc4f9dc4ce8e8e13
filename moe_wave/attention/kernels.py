"""Fused Triton kernels of the attention front-end, with the torch ops they replace as fallback.

Legend: R rows (vectors of d channels), d channels, F = r/2 rope frequencies, B batch, S queries,
h indexer heads, e indexer head dim, N compressed-entry slots.

* ``norm_rope``: RMSNorm (optional weight) and the interleaved tail RoPE (optional, forward or
  inverse) of every row in one pass: one read and one write of the tensor instead of ~15 torch ops
  with fp32 temporaries (the q heads alone are 4096 x 64 x 512 at a 4096-token prefill).
* ``index_scores``: the lightning indexer's ``sum_h w[t,h] * ReLU(q[t,h] . k[j])`` with the causal
  visibility mask, one [BS, BN] tile per program looping over heads, without the [S, h, N]
  intermediate; tiles that no query of the block can see are skipped.

Both run on CUDA/ROCm tensors (and on CPU under ``TRITON_INTERPRET=1``, which the CI uses to check
them against the torch versions). ``use_kernels(t)`` decides; environment ``MOE_WAVE_ATTN_KERNELS``:
"auto" (default: Triton on a GPU), "0" (torch ops everywhere), "1" (Triton wherever it can run).
The kernels compute in fp32 and round once at the end; the torch ops round the way HF does (e.g.
q * rsqrt(..).to(bf16)), so the two agree to the dtype's rounding, not bit for bit.
"""

from __future__ import annotations

import os

import torch

try:  # optional: without Triton the torch ops run
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["KERNELS_ENV", "index_scores", "index_scores_torch", "norm_rope", "norm_rope_torch", "use_kernels"]

KERNELS_ENV = "MOE_WAVE_ATTN_KERNELS"


def use_kernels(t: torch.Tensor) -> bool:
    """True when the Triton kernels should run on ``t``'s device (see the module docstring)."""
    mode = os.environ.get(KERNELS_ENV, "auto").strip().lower()
    if triton is None or mode in ("0", "off", "false", "no"):
        return False
    if t.device.type == "cpu":
        return mode in ("1", "on", "true", "yes") and os.environ.get("TRITON_INTERPRET", "0") == "1"
    return True


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
    def _norm_rope_kernel(x_ptr, out_ptr, pos_ptr, freq_ptr, w_ptr, R, H, eps,
                          HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, F: tl.constexpr, ROWS: tl.constexpr,
                          NORM: tl.constexpr, WEIGHT: tl.constexpr, INVERSE: tl.constexpr):
        pid = tl.program_id(0)
        r = pid * ROWS + tl.arange(0, ROWS)                              # [ROWS]
        j = tl.arange(0, BLOCK_HALF)                                     # channel pair j = (2j, 2j+1)
        rmask = r < R
        jmask = j < HALF
        m = rmask[:, None] & jmask[None, :]
        base = r.to(tl.int64)[:, None] * (2 * HALF) + 2 * j[None, :]
        xe = tl.load(x_ptr + base, mask=m, other=0.0).to(tl.float32)
        xo = tl.load(x_ptr + base + 1, mask=m, other=0.0).to(tl.float32)
        if NORM:
            ms = (tl.sum(xe * xe, axis=1) + tl.sum(xo * xo, axis=1)) / (2 * HALF)
            inv = 1.0 / tl.sqrt(ms + eps)
            xe = xe * inv[:, None]
            xo = xo * inv[:, None]
            if WEIGHT:
                we = tl.load(w_ptr + 2 * j, mask=jmask, other=0.0).to(tl.float32)
                wo = tl.load(w_ptr + 2 * j + 1, mask=jmask, other=0.0).to(tl.float32)
                xe = xe * we[None, :]
                xo = xo * wo[None, :]
        if F > 0:
            p = tl.load(pos_ptr + r // H, mask=rmask, other=0).to(tl.float32)
            fi = j - (HALF - F)
            rot = (fi >= 0) & jmask
            f = tl.load(freq_ptr + tl.maximum(fi, 0), mask=rot, other=0.0)
            ang = p[:, None] * f[None, :]
            c = tl.cos(ang)
            s = tl.sin(ang)
            if INVERSE:
                s = -s
            ye = xe * c - xo * s
            yo = xe * s + xo * c
            xe = tl.where(rot[None, :], ye, xe)
            xo = tl.where(rot[None, :], yo, xo)
        tl.store(out_ptr + base, xe.to(out_ptr.dtype.element_ty), mask=m)
        tl.store(out_ptr + base + 1, xo.to(out_ptr.dtype.element_ty), mask=m)


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
        ``out`` (x's shape and dtype). Triton when ``use_kernels(x)``, else the torch ops.
    """
    d = x.shape[-1]
    F = 0 if freq_F is None else freq_F.numel()
    if d % 2 or 2 * F > d:
        raise ValueError(f"norm_rope: last dim {d} must be even and >= 2 * freq ({2 * F})")
    if weight is not None and weight.numel() != d:
        raise ValueError(f"norm_rope: weight has {weight.numel()} elements, must equal the last dim {d}")
    if not (use_kernels(x) and x.is_contiguous() and x.numel()):
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
        H, pos_c, freq_c = 1, x, x   # unused pointers
    if out is None:
        out = torch.empty_like(x)
    half = d // 2
    block_half = triton.next_power_of_2(half)
    rows = max(1, min(16, 2048 // block_half))
    w = weight.contiguous() if weight is not None else x
    _norm_rope_kernel[(triton.cdiv(R, rows),)](
        x, out, pos_c, freq_c, w, R, H, float(eps), HALF=half, BLOCK_HALF=block_half, F=F, ROWS=rows,
        NORM=bool(norm), WEIGHT=weight is not None, INVERSE=bool(inverse), num_warps=4)
    return out


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
                if IEEE:
                    dot = tl.dot(q, kT, input_precision="ieee")
                else:
                    dot = tl.dot(q, kT)
                wh = tl.load(w_ptr + b * sw_b + s * sw_s + h, mask=smask, other=0.0)
                acc += wh[:, None] * tl.maximum(dot, 0.0)
            see = (n[None, :] < vis[:, None]) & nmask[None, :]
            out = tl.where(see, acc, out)
        tl.store(out_ptr + b * so_b + s[:, None] * so_s + n[None, :], out, mask=smask[:, None] & nmask[None, :])


def index_scores(qI_BShe: torch.Tensor, w_BSh: torch.Tensor, k_BNe: torch.Tensor, pos_BS: torch.Tensor,
                 ratio: int) -> torch.Tensor:
    """fp32 [B, S, N] indexer scores with the causal mask (-inf: not visible). See the module docstring.

    Args:
        qI_BShe: indexer queries (RoPE applied); w_BSh: fp32 head weights (scales folded in);
        k_BNe: compressed indexer keys (only the first N slots are scored); pos_BS: positions.
    """
    B, S, Hh, E = qI_BShe.shape
    N = k_BNe.shape[1]
    if not use_kernels(qI_BShe) or E & (E - 1) or E < 16 or B * S * N == 0:
        return index_scores_torch(qI_BShe, w_BSh, k_BNe, pos_BS, ratio)
    q = qI_BShe if qI_BShe.stride(-1) == 1 else qI_BShe.contiguous()
    k = k_BNe.to(q.dtype)
    k = k if k.stride(-1) == 1 else k.contiguous()
    w = w_BSh.float()
    pos = pos_BS.contiguous()
    out = torch.empty(B, S, N, dtype=torch.float32, device=q.device)
    BS, BN = 64, 64
    grid = (triton.cdiv(S, BS), triton.cdiv(N, BN), B)
    _index_scores_kernel[grid](q, w, k, pos, out, S, N, Hh, int(ratio),
                               q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1),
                               k.stride(0), k.stride(1), out.stride(0), out.stride(1),
                               E=E, BS=BS, BN=BN, IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2)
    return out

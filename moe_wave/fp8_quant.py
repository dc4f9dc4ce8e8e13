"""The FP8 format of the released DeepSeek-V4 checkpoints (spec section 5) and its quantisation: the constants,
the torch reference, the Triton kernel (``act_quant``) and the kernel helpers other Triton kernels that write this
format share (``pow2_scale_bits``, ``e4m3_rne``). The GEMM and the FP8 layers are in ``moe_wave.fp8``, which
imports every name here back (import them from there).

Legend: M rows (tokens), K input channels, N output channels, G groups of a grouped projection.

Format, as the official inference code and the checkpoints have it:

- **weights**: float8 e4m3 ``[N, K]`` with one fp32 scale per 128 x 128 block, ``[ceil(N/128), ceil(K/128)]``;
  the scales are powers of two (``scale_fmt`` ue8m0): w ~= w_q * scale.
- **activations**, quantised on the fly: one power-of-two scale per (row, 128 channels):
  ``s = pow2_ceil(max(amax, 1e-4) / 448)``, ``x_q = e4m3(x / s)`` (round to nearest even; |x / s| <= 448, so
  nothing saturates). Scales are stored channel-block-major, ``[K/128, M]`` contiguous, the layout cuBLAS takes
  for 1 x 128 scaling (``s.t()`` is the ``[M, K/128]`` view with strides ``(1, M)``).

``pow2_ceil`` is exact (the exponent of the fp32 bits, rounded up when any mantissa bit is set), so the torch
reference here, the Triton kernel and the sparse core's fused epilogue give the same bits.
"""

from __future__ import annotations

import torch

from .comm.triton_gate import tl, triton, triton_ok

__all__ = ["BLOCK", "FP8_MAX", "AMAX_FLOOR", "FP8", "pow2_ceil", "act_quant", "act_quant_torch", "weight_quant",
           "dequant_weight", "dequant_act"]

BLOCK = 128
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
FP8 = torch.float8_e4m3fn


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= s (fp32, s > 0 and finite), exactly: round the fp32 exponent up when any
    mantissa bit is set."""
    bits = s.float().contiguous().view(torch.int32)
    return ((bits + 0x7FFFFF) & 0x7F800000).view(torch.float32)


def act_quant_torch(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference activation quantisation: (x_q [M, K] e4m3, s [K/128, M] fp32 contiguous), see the module
    docstring. K must be a multiple of 128."""
    M, K = x_MK.shape
    if K % BLOCK:
        raise ValueError(f"act_quant: K={K} must be a multiple of {BLOCK}")
    xb = x_MK.float().view(M, K // BLOCK, BLOCK)
    amax = xb.abs().amax(-1).clamp_min(AMAX_FLOOR)                  # [M, K/128]
    s = pow2_ceil(amax / FP8_MAX)
    q = (xb * (1.0 / s)[..., None]).to(FP8).view(M, K)
    return q, s.t().contiguous()


def weight_quant(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight in the checkpoints' format: (w_q [N, K] e4m3, s [ceil(N/128), ceil(K/128)] fp32, powers of two).
    Edge blocks may be partial."""
    N, K = w_NK.shape
    nb, kb = -(-N // BLOCK), -(-K // BLOCK)
    pad = torch.zeros(nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=w_NK.device)
    pad[:N, :K] = w_NK.float()
    blocks = pad.view(nb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(AMAX_FLOOR)      # [nb, kb]
    s = pow2_ceil(amax / FP8_MAX)
    q = (blocks * (1.0 / s)[:, None, :, None]).to(FP8).view(nb * BLOCK, kb * BLOCK)[:N, :K].contiguous()
    return q, s.contiguous()


def dequant_weight(w_q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] from ``weight_quant``'s pair."""
    N, K = w_q.shape
    full = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:N, :K]
    return w_q.float() * full


def dequant_act(x_q: torch.Tensor, s_KbM: torch.Tensor) -> torch.Tensor:
    """fp32 [M, K] from ``act_quant``'s pair."""
    return x_q.float() * s_KbM.t().repeat_interleave(BLOCK, 1)

if triton is not None:

    @triton.jit
    def pow2_scale_bits(amax):
        # The fp32 bits of s = pow2_ceil(amax / 448) and of 1 / s (both exact powers of two), as act_quant_torch
        # computes s: the division correctly rounded (Triton's `/` is approximate on fp32), so that
        # amax = 448 * 2^k gives s = 2^k. The one definition for every kernel that writes this format.
        sbits = (tl.div_rn(amax, 448.0).to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000
        return sbits, 0x7F000000 - sbits

    @triton.jit
    def e4m3_rne(x):
        # float8e4nv of fp32 x (|x| <= 448), round to nearest even, by integer ops: the interpreter's float8 cast
        # rounds ties away and drops the mantissa's carry into the exponent (the GPU casts in hardware instead)
        bits = x.to(tl.int32, bitcast=True)
        a = bits & 0x7FFFFFFF
        e = a >> 23
        nrm = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)     # normal: 3 mantissa bits, exponent rebiased
        m = (a & 0x7FFFFF) | 0x800000
        sh = tl.minimum(tl.maximum(141 - e, 21), 31)                    # subnormal: round(m * 2^(e - 141))
        q = m >> sh
        rem = m - (q << sh)
        half = (rem * 0 + 1) << (sh - 1)
        q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
        code = tl.where(e >= 121, nrm, q) | ((bits >> 24) & 0x80)
        return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)

    @triton.jit
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, s_xm, s_xg, s_qm, s_sj, s_sm, NPG: tl.constexpr,
                          BM: tl.constexpr):
        # Program (row block, 128-channel block j): j's group g = j // NPG holds NPG blocks; the input row m of
        # group g starts at x + g*s_xg + m*s_xm (a flat [M, K] row: s_xg = NPG*128; a group-major [G, M, Kg]
        # stack: s_xg = M*Kg). Output: q [M, K] with rows s_qm apart (K, or a column slice's), s [K/128, M] with
        # strides (s_sj, s_sm) ((M, 1) contiguous; (1, row) for scales stored beside each row, fp8_rows).
        m = tl.program_id(0) * BM + tl.arange(0, BM)
        j = tl.program_id(1)
        g = j // NPG
        c = tl.arange(0, 128)
        rmask = m < M
        x = tl.load(x_ptr + g.to(tl.int64) * s_xg + m.to(tl.int64)[:, None] * s_xm + (j % NPG) * 128 + c[None, :],
                    mask=rmask[:, None], other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
        sbits, ibits = pow2_scale_bits(amax)
        s = sbits.to(tl.float32, bitcast=True)
        q = (x * ibits.to(tl.float32, bitcast=True)[:, None]).to(tl.float8e4nv)
        tl.store(q_ptr + m.to(tl.int64)[:, None] * s_qm + j * 128 + c[None, :], q, mask=rmask[:, None])
        tl.store(s_ptr + j.to(tl.int64) * s_sj + m.to(tl.int64) * s_sm, s, mask=rmask)


def act_quant(x: torch.Tensor, groups: int = 1, kernels: bool | None = None,
              out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations in the FP8 format: (x_q [M, K] e4m3, s [K/128, M] fp32), see the module docstring.

    Args:
        x: [M, K] with unit channel stride (any row stride), or, with ``groups`` G > 1, a group-major stack
            [G, M, Kg] quantised as the [M, G*Kg] matrix whose row m is the G rows m side by side (a grouped
            projection's outputs, read without a copy).
        kernels: the Triton kernel on a GPU (None or True; False: the torch ops). On CPU always
            ``act_quant_torch``: Triton's interpreter does not round to float8 correctly. Both give the same bits.
        out: (q, s) to write into, returned: q [M, K] e4m3 with unit channel stride (any row stride: e.g. a
            column slice of a wider activation), s [K/128, M] fp32 with any strides (e.g. a row slice of its
            scales, or the transposed view of scales stored beside each row: ``fp8_rows``).
    """
    if groups > 1:
        if x.dim() != 3 or x.shape[0] != groups:
            raise ValueError(f"act_quant: x {tuple(x.shape)} must be [G={groups}, M, Kg] with groups={groups}")
        G, M, Kg = x.shape
    else:
        if x.dim() != 2:
            raise ValueError(f"act_quant: x {tuple(x.shape)} must be [M, K]")
        (M, Kg), G = x.shape, 1
    if Kg % BLOCK:
        raise ValueError(f"act_quant: channels per group {Kg} must be a multiple of {BLOCK}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    K = G * Kg
    if out is not None:
        q, s = out
        if tuple(q.shape) != (M, K) or q.dtype != FP8 or (M and q.stride(-1) != 1) or \
                tuple(s.shape) != (K // BLOCK, M) or s.dtype != torch.float32:
            raise ValueError(f"act_quant: out q {tuple(q.shape)} {q.dtype} stride {q.stride()}, s {tuple(s.shape)} "
                             f"{s.dtype}: need q [M={M}, K={K}] {FP8} with unit channel stride and s [K/128, M] "
                             "fp32")
    if not (x.is_cuda and triton_ok(x.device, want=kernels) and M):
        flat = x if G == 1 else x.permute(1, 0, 2).reshape(M, K)
        if out is None:
            return act_quant_torch(flat)
        q_t, s_t = act_quant_torch(flat)
        return q.copy_(q_t), s.copy_(s_t)
    if out is None:
        q = torch.empty(M, K, dtype=FP8, device=x.device)
        s = torch.empty(K // BLOCK, M, dtype=torch.float32, device=x.device)
    s_xm = x.stride(-2)
    s_xg = x.stride(0) if G > 1 else Kg
    bm = 16
    _act_quant_kernel[(triton.cdiv(M, bm), K // BLOCK)](x, q, s, M, s_xm, s_xg, q.stride(0), s.stride(0), s.stride(1),
                                                        NPG=Kg // BLOCK, BM=bm, num_warps=4)
    return q, s

"""FP8 block-scaled linear layers in the released DeepSeek-V4 checkpoints' format (spec section 5).

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

On a Hopper GPU the product is ``torch._scaled_mm`` with 1 x 128 (activations) by 128 x 128 (weights) scaling
(cuBLAS, CUDA >= 12.9); elsewhere (CPU, or a GPU whose torch refuses that recipe) the same math runs dequantised
in fp32 (``fp8_matmul_ref``), which is also the tests' oracle.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "FP8_MAX", "pow2_ceil", "act_quant_torch", "weight_quant", "dequant_weight", "dequant_act",
           "fp8_matmul_ref"]

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


def fp8_matmul_ref(x_q: torch.Tensor, s_KbM: torch.Tensor, w_q: torch.Tensor, s_w: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """x @ w^T from the quantised pairs, dequantised and multiplied in fp32, rounded once to ``out_dtype``."""
    return (dequant_act(x_q, s_KbM) @ dequant_weight(w_q, s_w).t()).to(out_dtype)

"""FP8 rows on the wire: a token's row quantised once where it is produced, then moved as e4m3 values + scales.

Legend: T rows, D hidden (a multiple of 128), Dw = packed_width(D).

One packed row is D e4m3 bytes followed by D/128 fp32 scales (``moe_wave.fp8``'s activation format: one power of
two per 128 channels), D + D/32 bytes rounded up to 16 (DeepEP moves rows in 16-byte units; V4's D = 4096 and 7168
need no padding): 0.516 x the bf16 row. A [T, Dw] bf16 tensor holds T packed rows (bf16 is only the container,
Dw = that byte count / 2): every comm backend moves bf16 rows by copying them and never
computes on dispatched rows, so each carries packed rows as it is (``WaveMoE`` dispatches them with
``combine_width=D``: the results come back as bf16 rows of D).

    pack_rows(x_TD)          -> [T, Dw] bf16 container (one pass: ``fp8.act_quant`` into the container)
    unpack_rows(p_TW, D)     -> (q [T, D] e4m3, s [T, D/128] fp32): views of the container, no copy
    dequant_rows(p_TW, D)    -> [T, D] bf16, q * s: exact (an e4m3 value times a power of two is a bf16 value),
                                so ``fp8.act_quant`` of it gives back the same values (the same q and s, or 2q and
                                s/2 where a block's largest |q| was 224: the same products, bit for bit)

A consumer that takes FP8 rows as they are (the fused expert stage: ``fp8_expert_kernels.gather_pairs``) reads
them through ``unpack_rows``; any other reads ``dequant_rows``.
"""

from __future__ import annotations

import torch

from .fp8_quant import BLOCK, FP8, act_quant

__all__ = ["packed_width", "is_packed", "pack_rows", "unpack_rows", "dequant_rows"]


def packed_width(D: int) -> int:
    """bf16 elements of one packed row of D channels (D % 128 == 0)."""
    if D % BLOCK:
        raise ValueError(f"FP8 rows: hidden size D={D} must be a multiple of {BLOCK} (one scale per {BLOCK} channels)")
    return -(-(D + D // 32) // 16) * 8


def is_packed(x: torch.Tensor, D: int) -> bool:
    """Whether x has the shape and dtype of packed rows of D channels (x is [rows, Dw] bf16)."""
    return x.dim() == 2 and x.dtype == torch.bfloat16 and D % BLOCK == 0 and x.shape[1] == packed_width(D)


def unpack_rows(p_TW: torch.Tensor, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [T, D] e4m3, s [T, D/128] fp32) viewing the packed rows (rows may have any stride that keeps the
    scales 4-byte aligned: a container row or a slice of rows of one)."""
    if not is_packed(p_TW, D) or p_TW.stride(1) != 1:
        raise ValueError(f"unpack_rows: {tuple(p_TW.shape)} {p_TW.dtype} stride {p_TW.stride()}: must be packed "
                         f"rows of D={D}, [rows, {packed_width(D) if D % BLOCK == 0 else '?'}] bf16 with unit stride")
    b = p_TW.view(torch.uint8)
    return b[:, :D].view(FP8), b[:, D:D + D // 32].view(torch.float32)


def dequant_rows(p_TW: torch.Tensor, D: int) -> torch.Tensor:
    """[T, D] bf16 rows q * s of the packed rows (exact, see the module docstring)."""
    q, s = unpack_rows(p_TW, D)
    T = q.shape[0]
    return (q.float().view(T, D // BLOCK, BLOCK) * s[..., None]).view(T, D).to(torch.bfloat16)


def pack_rows(x_TD: torch.Tensor, kernels: bool | None = None) -> torch.Tensor:
    """[T, Dw] bf16 container of x's rows quantised per 128 channels (see the module docstring): ``fp8.act_quant``
    writing straight into the container (``kernels``: its Triton kernel on a GPU, None or True; False: the torch
    ops; the same bits either way)."""
    if x_TD.dim() != 2:
        raise ValueError(f"pack_rows: x {tuple(x_TD.shape)} must be [T, D]")
    T, D = x_TD.shape
    out = torch.empty(T, packed_width(D), dtype=torch.bfloat16, device=x_TD.device)
    q, s = unpack_rows(out, D)
    act_quant(x_TD, kernels=kernels, out=(q, s.t()))
    return out

"""Row copies for the ``symm`` backend: a Triton kernel that reads device-side counts, and its torch twin.

Legend: N rows to copy (programs), D row width (elements), C capacity rows of a destination block.

Both functions copy ``src[src_idx[i]] -> dst[dst_idx[i]]`` for the rows i with ``dst_idx[i] >= 0``.
The index arrays are computed on the device from the exchanged counts (``dst_idx`` is -1 past the
valid count and past the capacity), so no size ever reaches the host and the launch grid is static
(N = an upper bound): the kernel is CUDA-graph capturable and never writes a row that ``dst_idx``
does not name. ``dst`` may be a peer's symmetric-memory buffer (the writes then travel over
NVLink/xGMI from the SMs) or a local staging block.

The kernel also runs on CPU tensors under ``TRITON_INTERPRET=1`` (the CI checks it against
``copy_rows_torch`` there).
"""

from __future__ import annotations

import os

import torch

__all__ = ["copy_rows", "copy_rows_torch", "gather_add", "gather_add_torch", "triton_ok"]

try:  # Triton is optional: the symm backend falls back to copy engines without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# Elements a copy_rows program moves per step. Environment MOE_WAVE_COPY_ROWS_BLOCK overrides (a power
# of two); on 2 x H200 4096 (a whole V4-Flash row, 8 warps) measured no better than 2048
# (benchmarks/2026-11-30-comm-2xh200-rowblock.json).
_COPY_BLOCK = int(os.environ.get("MOE_WAVE_COPY_ROWS_BLOCK", "2048"))
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8)


def triton_ok(device: torch.device | str) -> bool:
    """True when ``copy_rows`` can run on ``device`` (a GPU, or CPU under TRITON_INTERPRET=1)."""
    if triton is None:
        return False
    if torch.device(device).type == "cpu":
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    return True


if triton is not None:

    @triton.jit
    def _copy_rows_kernel(src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, D, src_stride, dst_stride,
                          BLOCK_D: tl.constexpr, NUM_BLOCKS: tl.constexpr):
        i = tl.program_id(0)
        s = tl.load(src_idx_ptr + i).to(tl.int64)
        d = tl.load(dst_idx_ptr + i).to(tl.int64)
        width = tl.where(d >= 0, D, 0)  # a skipped row masks every column (a plain block mask)
        d = tl.maximum(d, 0)  # masked below; keeps the address in range for the interpreter
        for c in tl.static_range(NUM_BLOCKS):
            offs = c * BLOCK_D + tl.arange(0, BLOCK_D)
            m = offs < width
            v = tl.load(src_ptr + s * src_stride + offs, mask=m)
            tl.store(dst_ptr + d * dst_stride + offs, v, mask=m)


    @triton.jit
    def _gather_add_kernel(out_ptr, src_ptr, slot_ptr, D, P, out_stride, src_stride,
                           BLOCK_D: tl.constexpr, NUM_BLOCKS: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        for c in tl.static_range(NUM_BLOCKS):
            offs = c * BLOCK_D + tl.arange(0, BLOCK_D)
            m = offs < D
            acc = tl.load(out_ptr + t * out_stride + offs, mask=m)
            for p in range(P):
                r = tl.load(slot_ptr + t * P + p)
                width = tl.where(r >= 0, D, 0)
                acc += tl.load(src_ptr + tl.maximum(r, 0) * src_stride + offs, mask=offs < width,
                               other=0.0).to(tl.float32)
            tl.store(out_ptr + t * out_stride + offs, acc, mask=m)


def _check(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1]:
        raise ValueError(f"copy_rows: src {tuple(src.shape)} and dst {tuple(dst.shape)} must be 2-D with equal widths")
    if src.dtype != dst.dtype:
        raise ValueError(f"copy_rows: src.dtype={src.dtype} must equal dst.dtype={dst.dtype}")
    if src_idx.shape != dst_idx.shape or src_idx.dim() != 1:
        raise ValueError(f"copy_rows: src_idx {tuple(src_idx.shape)} and dst_idx {tuple(dst_idx.shape)} must be "
                         "1-D of equal length")
    if src.stride(1) != 1 or dst.stride(1) != 1:
        raise ValueError("copy_rows: rows of src and dst must be contiguous (stride(1) == 1)")


def copy_rows(src_ND: torch.Tensor, dst_CD: torch.Tensor, src_idx_N: torch.Tensor, dst_idx_N: torch.Tensor) -> None:
    """``dst_CD[dst_idx_N[i]] = src_ND[src_idx_N[i]]`` where ``dst_idx_N[i] >= 0`` (Triton, one program a row).

    Args:
        src_ND: [*, D] rows to read (any supported dtype).
        dst_CD: [C, D] destination rows, same dtype (may live on a peer GPU: a symmetric-memory view).
        src_idx_N: [N] int64 source row of each program.
        dst_idx_N: [N] int64 destination row, or -1 to skip (no read, no write).
    """
    _check(src_ND, dst_CD, src_idx_N, dst_idx_N)
    if src_ND.dtype not in _DTYPES:
        raise ValueError(f"copy_rows: dtype {src_ND.dtype} must be one of {_DTYPES}")
    N, D = src_idx_N.shape[0], src_ND.shape[1]
    if N == 0 or D == 0:
        return
    block = min(triton.next_power_of_2(D), _COPY_BLOCK)
    _copy_rows_kernel[(N,)](src_ND, dst_CD, src_idx_N, dst_idx_N, D, src_ND.stride(0), dst_CD.stride(0),
                            BLOCK_D=block, NUM_BLOCKS=triton.cdiv(D, block),
                            num_warps=8 if block >= 4096 else 4 if block >= 1024 else 1)


def copy_rows_torch(src_ND: torch.Tensor, dst_CD: torch.Tensor, src_idx_N: torch.Tensor,
                    dst_idx_N: torch.Tensor) -> None:
    """The reference of ``copy_rows`` in torch (tests and CPU).

    HOST SYNC: boolean indexing sizes the valid rows on the host; this path is for tests only.
    """
    _check(src_ND, dst_CD, src_idx_N, dst_idx_N)
    ok = dst_idx_N >= 0
    dst_CD[dst_idx_N[ok]] = src_ND[src_idx_N[ok]]


def gather_add(out_TD: torch.Tensor, src_RD: torch.Tensor, slot_TP: torch.Tensor) -> None:
    """``out_TD[t] += sum_p src_RD[slot_TP[t, p]]`` over the slots >= 0, in p order, in fp32 (Triton,
    one program a token: one read-modify-write of each output row, no atomics)."""
    if out_TD.dtype != torch.float32 or out_TD.dim() != 2 or src_RD.dim() != 2 or out_TD.shape[1] != src_RD.shape[1]:
        raise ValueError(f"gather_add: out {tuple(out_TD.shape)} {out_TD.dtype} must be 2-D fp32 with the width of "
                         f"src {tuple(src_RD.shape)}")
    if slot_TP.dim() != 2 or slot_TP.shape[0] != out_TD.shape[0]:
        raise ValueError(f"gather_add: slot {tuple(slot_TP.shape)} must be [T={out_TD.shape[0]}, P]")
    if out_TD.stride(1) != 1 or src_RD.stride(1) != 1:
        raise ValueError("gather_add: rows of out and src must be contiguous (stride(1) == 1)")
    T, D = out_TD.shape
    if T == 0 or D == 0:
        return
    slot = slot_TP.contiguous()
    block = min(triton.next_power_of_2(D), 2048)
    _gather_add_kernel[(T,)](out_TD, src_RD, slot, D, slot.shape[1], out_TD.stride(0), src_RD.stride(0),
                             BLOCK_D=block, NUM_BLOCKS=triton.cdiv(D, block), num_warps=4 if block >= 1024 else 1)


def gather_add_torch(out_TD: torch.Tensor, src_RD: torch.Tensor, slot_TP: torch.Tensor) -> None:
    """The reference of ``gather_add`` in torch."""
    for p in range(slot_TP.shape[1]):
        r = slot_TP[:, p]
        out_TD += torch.where((r >= 0)[:, None], src_RD[r.clamp(min=0)].float(), 0.0)

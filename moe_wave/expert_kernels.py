"""The expert stage's kernels for device-side counts (fixed-capacity backends, CUDA graphs).

Legend: R received rows, K slots per row, J = R*K (row, slot) pairs sorted expert-major, n the valid
pairs (a device scalar: the last group offset), D hidden, I intermediate.

With counts on the device only, ``expert_rows`` cannot size anything by n on the host, so the torch
path gathers, activates, weights and sums all J pairs, with the invalid ones masked to zero. At 4096
tokens per rank, 2 ranks and top-6 that is about four times the valid pairs and several GB of memory
traffic per wave. These kernels read n on the device and skip the pairs past it:

    gather_rows(x_RD, src_J, n, local)    xs[j] = x[src[j]] for j < n (rows past n untouched; rows
                                          that ``local`` holds read there)
    swiglu_rows(gu_J2I, limit, n)         the V4 SwiGLU (clamped gate and up) for j < n
    weighted_sum(out_JD, pos_RK, w_RK, n) y[r] = sum over k in order of w[r, k] * out[pos[r, k]] for
                                          the slots with pos < n, in fp32; rows with none are 0

Each has a torch twin (``*_torch``) with the same meaning; tests/test_moe.py compares them (on CPU under
``TRITON_INTERPRET=1``). The kernels run wherever Triton does (``moe_wave.comm.triton_gate``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_wave.comm.backend import rows_of
from moe_wave.comm.triton_gate import tl, triton

__all__ = ["gather_rows", "gather_rows_torch", "swiglu_rows", "swiglu_rows_torch", "weighted_sum",
           "weighted_sum_torch"]

BLOCK_D = 1024


def gather_rows_torch(x_RD: torch.Tensor, src_J: torch.Tensor, n: torch.Tensor, out: torch.Tensor,
                      local: tuple | None = None) -> torch.Tensor:
    j = torch.arange(src_J.shape[0], device=src_J.device)
    keep = j < n
    out[keep] = rows_of(x_RD, src_J[keep], local)
    return out


def swiglu_rows_torch(gu_J2I: torch.Tensor, limit: float, n: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    I = gu_J2I.shape[1] // 2
    keep = torch.arange(gu_J2I.shape[0], device=gu_J2I.device) < n
    gate, up = gu_J2I[keep, :I].float(), gu_J2I[keep, I:].float()
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    out[keep] = (F.silu(gate) * up).to(out.dtype)
    return out


def weighted_sum_torch(out_JD: torch.Tensor, pos_RK: torch.Tensor, w_RK: torch.Tensor, n: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    R, K = pos_RK.shape
    acc = torch.zeros(R, out_JD.shape[1], dtype=torch.float32, device=out_JD.device)
    for k in range(K):            # slot order: the same sum on every run
        p = pos_RK[:, k]
        valid = (p >= 0) & (p < n)
        rows = out_JD.index_select(0, torch.where(valid, p, 0)).float()
        acc += torch.where(valid[:, None], rows * w_RK[:, k:k + 1].float(), 0.0)
    return acc.to(dtype)


def gather_rows(x_RD: torch.Tensor, src_J: torch.Tensor, n: torch.Tensor, local: tuple | None = None) -> torch.Tensor:
    """[J, D] in x's dtype; rows j >= n are left as allocated (``torch.empty``). ``local`` = (row0, x_LD)
    (``Received.local``): source rows row0 .. row0 + L - 1 are read from x_LD instead."""
    J, D = src_J.shape[0], x_RD.shape[1]
    out = torch.empty(J, D, dtype=x_RD.dtype, device=x_RD.device)
    row0, loc = (0, x_RD[:0]) if local is None else local
    if loc.shape[1:] != x_RD.shape[1:] or loc.dtype != x_RD.dtype or (loc.numel() and loc.stride(0) != D):
        raise ValueError(f"gather_rows: local rows {tuple(loc.shape)} {loc.dtype} must be contiguous [L, {D}] "
                         f"{x_RD.dtype} rows")
    if J and D:
        _gather_kernel[(J,)](x_RD, src_J, n, out, D, loc if loc.numel() else x_RD, row0, loc.shape[0],
                             BLOCK=min(BLOCK_D, triton.next_power_of_2(D)))
    return out


def swiglu_rows(gu_J2I: torch.Tensor, limit: float, n: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[J, I] in ``dtype``: silu(clamp(gate, max=limit)) * clamp(up, +-limit) in fp32 (limit <= 0: no clamp)."""
    J, I2 = gu_J2I.shape
    out = torch.empty(J, I2 // 2, dtype=dtype, device=gu_J2I.device)
    if J and I2:
        _swiglu_kernel[(J,)](gu_J2I, n, out, I2 // 2, float(limit), CLAMP=limit > 0,
                             BLOCK=min(BLOCK_D, triton.next_power_of_2(I2 // 2)))
    return out


def weighted_sum(out_JD: torch.Tensor, pos_RK: torch.Tensor, w_RK: torch.Tensor, n: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """[R, D] in ``dtype`` (see the module docstring)."""
    R, K = pos_RK.shape
    D = out_JD.shape[1]
    y = torch.empty(R, D, dtype=dtype, device=out_JD.device)
    if R and D:
        _wsum_kernel[(R,)](out_JD, pos_RK.contiguous(), w_RK.contiguous(), n, y, K, D,
                           BLOCK=min(BLOCK_D, triton.next_power_of_2(D)))
    return y


if triton is not None:

    @triton.jit
    def _gather_kernel(x_ptr, src_ptr, n_ptr, out_ptr, D, loc_ptr, ROW0, L, BLOCK: tl.constexpr):
        # source rows ROW0 .. ROW0 + L - 1 come from loc (this rank's own tokens, not copied into x)
        j = tl.program_id(0)
        if j < tl.load(n_ptr):
            s = tl.load(src_ptr + j).to(tl.int64)
            if (s >= ROW0) & (s < ROW0 + L):
                base = loc_ptr + (s - ROW0) * D
            else:
                base = x_ptr + s * D
            for d0 in range(0, D, BLOCK):
                d = d0 + tl.arange(0, BLOCK)
                m = d < D
                tl.store(out_ptr + j.to(tl.int64) * D + d, tl.load(base + d, mask=m), mask=m)

    @triton.jit
    def _swiglu_kernel(gu_ptr, n_ptr, out_ptr, I, limit, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
        j = tl.program_id(0)
        if j < tl.load(n_ptr):
            row = gu_ptr + j.to(tl.int64) * 2 * I
            for i0 in range(0, I, BLOCK):
                i = i0 + tl.arange(0, BLOCK)
                m = i < I
                gate = tl.load(row + i, mask=m, other=0.0).to(tl.float32)
                up = tl.load(row + I + i, mask=m, other=0.0).to(tl.float32)
                if CLAMP:
                    gate = tl.minimum(gate, limit)
                    up = tl.minimum(tl.maximum(up, -limit), limit)
                h = gate / (1.0 + tl.exp(-gate)) * up
                tl.store(out_ptr + j.to(tl.int64) * I + i, h.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _wsum_kernel(out_ptr, pos_ptr, w_ptr, n_ptr, y_ptr, K, D, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        n = tl.load(n_ptr)
        for d0 in range(0, D, BLOCK):
            d = d0 + tl.arange(0, BLOCK)
            m = d < D
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for k in range(K):
                p = tl.load(pos_ptr + r * K + k)
                if (p >= 0) & (p < n):
                    w = tl.load(w_ptr + r * K + k).to(tl.float32)
                    acc += w * tl.load(out_ptr + p.to(tl.int64) * D + d, mask=m, other=0.0).to(tl.float32)
            tl.store(y_ptr + r * D + d, acc.to(y_ptr.dtype.element_ty), mask=m)

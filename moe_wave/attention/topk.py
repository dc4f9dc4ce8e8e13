"""The indexer's top-k as a per-row selection kernel: the picked set of ``torch.topk``, with a fixed tie rule.

Legend: R rows (B * S queries), N scored entries per row, K picks.

``topk_select(score, k)`` returns, per row, the ids of the k largest finite scores (-inf means "not visible"
and is never picked; a row with fewer than k finite scores is padded with -1), **in ascending id order,
valid ids first, then the -1s**. The core does not care about the order; the fixed order lets it stop after the
last valid pick.

Tie rule: when several entries share the k-th largest score, the ones with the **lowest ids** are picked
(0.0 and -0.0 are one value). Without a tie at the boundary this is exactly ``torch.topk``'s set; with one,
``torch.topk`` (whose choice among ties is unspecified) picks the same values, possibly other ids.
``topk_select_torch`` is the reference of the rule (a stable descending sort). NaN scores are not supported.

The kernel (one program per row, the row in registers): scores become order-preserving integer keys
(fp32 bits, negatives with their magnitude bits flipped); a 32-step bitwise search finds the k-th largest
key T (the largest T with count(key >= T) >= k; a radix select, 8 bits per step with 256-bin histograms,
is slower: benchmarks/results/attn.md); the picks are key > T plus the
first (k - count(key > T)) entries equal to T by id (a prefix sum), written compacted by a second prefix sum.
No atomics, no sort: deterministic. Rows longer than ``MAX_N`` entries (contexts over 4 * MAX_N tokens) use the
torch reference.
"""

from __future__ import annotations

import torch

from moe_wave.comm.triton_gate import tl, triton, triton_ok

__all__ = ["topk_select", "topk_select_torch", "MAX_N"]

MAX_N = 16384


def topk_select_torch(score_RN: torch.Tensor, k: int) -> torch.Tensor:
    """Reference of ``topk_select``: int64 [..., k] ids, valid ascending then -1 (see the module docstring)."""
    N = score_RN.shape[-1]
    k = int(k)
    s = score_RN.float()
    s = torch.where(s == 0, torch.zeros_like(s), s)             # -0.0 ties with 0.0
    top = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :min(k, N)]
    ok = s.gather(-1, top) > float("-inf")
    ids = torch.where(ok, top, torch.full_like(top, N)).sort(dim=-1).values
    ids = torch.where(ids == N, torch.full_like(ids, -1), ids)
    if k > N:
        ids = torch.cat([ids, ids.new_full((*ids.shape[:-1], k - N), -1)], dim=-1)
    return ids


if triton is not None:

    @triton.jit
    def _topk_kernel(s_ptr, out_ptr, N, K, s_row, o_row, BLOCK: tl.constexpr, KB: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        n = tl.arange(0, BLOCK)
        x = tl.load(s_ptr + r * s_row + n, mask=n < N, other=float("-inf")).to(tl.float32)
        valid = x > float("-inf")
        x = tl.where(x == 0.0, 0.0, x)                                   # -0.0 -> 0.0
        bits = x.to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)               # signed order of the floats
        ukey = tl.where(valid, key.to(tl.int64) - (-2147483648), -1)     # in [0, 2^32); -1: never picked
        kv = tl.minimum(tl.sum(valid.to(tl.int32), axis=0), K)           # picks that exist
        one = tl.full((), 1, tl.int64)
        thr = tl.full((), 0, tl.int64)
        for i in tl.static_range(32):                                     # largest thr with #(ukey >= thr) >= kv
            cand = thr | (one << (31 - i))
            cnt = tl.sum((ukey >= cand).to(tl.int32), axis=0)
            thr = tl.where(cnt >= kv, cand, thr)
        gt = ukey > thr
        eq = (ukey == thr) & valid
        need = kv - tl.sum(gt.to(tl.int32), axis=0)
        tie_rank = tl.cumsum(eq.to(tl.int32), axis=0) - eq.to(tl.int32)  # equal entries before this one
        sel = gt | (eq & (tie_rank < need))
        slot = tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(out_ptr + r * o_row + slot, n.to(out_ptr.dtype.element_ty), mask=sel)
        kk = tl.arange(0, KB)
        tl.store(out_ptr + r * o_row + kk, tl.full((KB,), -1, out_ptr.dtype.element_ty), mask=(kk >= kv) & (kk < K))


def topk_select(score_BSN: torch.Tensor, k: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """[B, S, k] ids of the k largest finite scores per row (see the module docstring for the order and the tie
    rule), int64 or ``dtype`` (int32: what the core kernels read with the fewest registers). Triton where it runs
    (and N <= MAX_N), else ``topk_select_torch``."""
    *lead, N = score_BSN.shape
    k = int(k)
    if k < 0:
        raise ValueError(f"topk_select: k={k}: must be >= 0")
    if dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_select: dtype={dtype}: must be torch.int32 or torch.int64")
    if k == 0:
        return torch.empty(*lead, 0, dtype=dtype, device=score_BSN.device)
    if not triton_ok(score_BSN.device, want=True) or N > MAX_N or N == 0 or score_BSN.numel() == 0:
        return topk_select_torch(score_BSN, k).to(dtype)
    s = score_BSN.reshape(-1, N)
    s = s if s.stride(-1) == 1 else s.contiguous()
    R = s.shape[0]
    out = torch.empty(R, k, dtype=dtype, device=s.device)
    block = max(16, triton.next_power_of_2(N))
    _topk_kernel[(R,)](s, out, N, k, s.stride(0), out.stride(0), BLOCK=block,
                       KB=max(16, triton.next_power_of_2(k)), num_warps=4 if block <= 2048 else 8)
    return out.view(*lead, k)

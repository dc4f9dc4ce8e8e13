"""Fused Triton kernels of the mHC sites (``moe_wave.mhc``): three launches per layer site instead of ~90.

Legend: T tokens (B*S), N hc streams, D hidden, K = N*D, F = (2+N)*N mixing coefficients.

    hc_mix(X_TK, fn_FK)                    the partial sums of X @ fn^T and of X^2 over KS slices of K (split-K:
                                           enough programs to fill the GPU at any T; fp32 dots as three TF32 passes,
                                           "tf32x3": the error of an fp32 GEMM at tensor-core speed)
    hc_collapse(X_TND, mix, base, scale, eps, hc_eps, iters)
                                           per token: the slices summed in order, mix = rsqrt(mean(X^2) + eps) *
                                           (X @ fn^T) (the RMS norm folded in as a per-row scale), pre, post and
                                           the Sinkhorn-balanced comb (the same steps as
                                           ``HyperConnection.weights``), and h = sum_n pre_n X_n
    hc_expand(out_TD, X_TND, post_TN, comb_TNN)
                                           X'[k] = post_k * out + sum_j comb[j, k] X[j], in fp32, one rounding
                                           to X's dtype (the torch path rounds post * out and the mix first)

The torch ops of ``moe_wave.mhc`` are the reference (and the CPU path); these match them within the dtype's
rounding (tests/test_mhc_kernels.py, CPU under TRITON_INTERPRET=1 and CUDA). N must be a power of two (V4: 4).
Deterministic: no atomics, fixed reduction orders.
"""

from __future__ import annotations

import torch

from moe_wave.comm.triton_gate import tl, triton

__all__ = ["hc_mix", "hc_collapse", "hc_expand", "fits"]


def fits(N: int) -> bool:
    """Whether the kernels take N hc streams (a power of two)."""
    return N >= 1 and N & (N - 1) == 0


if triton is not None:
    @triton.jit
    def _mix_kernel(x_ptr, fn_ptr, mix_ptr, sq_ptr, T, K, F, K_SLICE, F_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        sl = tl.program_id(1)
        rmask = rows < T
        fcols = tl.arange(0, F_PAD)
        fmask = fcols < F
        acc = tl.zeros([BLOCK_T, F_PAD], dtype=tl.float32)
        sq = tl.zeros([BLOCK_T], dtype=tl.float32)
        k_end = tl.minimum(K, (sl + 1) * K_SLICE)
        for k0 in range(sl * K_SLICE, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < k_end
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                        other=0.0).to(tl.float32)
            sq += tl.sum(x * x, 1)
            w = tl.load(fn_ptr + fcols[None, :] * K + ks[:, None], mask=fmask[None, :] & kmask[:, None], other=0.0)
            acc = tl.dot(x, w, acc, input_precision="tf32x3")   # three TF32 passes: fp32-level error
        tl.store(mix_ptr + (sl * T + rows[:, None]) * F_PAD + fcols[None, :], acc, mask=rmask[:, None])
        tl.store(sq_ptr + sl * T + rows, sq, mask=rmask)

    @triton.jit
    def _collapse_kernel(x_ptr, mix_ptr, sq_ptr, base_ptr, scale_ptr, h_ptr, post_ptr, comb_ptr, T, D, KS, eps,
                         hc_eps, iters, N: tl.constexpr, F_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_D: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        rmask = rows < T
        n = tl.arange(0, N)
        jk = n[:, None] * N + n[None, :]                                          # [N(j), N(k)]
        # the split-K slices, summed in slice order (deterministic)
        m_pre = tl.zeros([BLOCK_T, N], dtype=tl.float32)
        m_post = tl.zeros([BLOCK_T, N], dtype=tl.float32)
        m_comb = tl.zeros([BLOCK_T, N, N], dtype=tl.float32)
        sq = tl.zeros([BLOCK_T], dtype=tl.float32)
        for sl in range(KS):
            m_row = mix_ptr + (sl * T + rows[:, None]) * F_PAD
            m_pre += tl.load(m_row + n[None, :], mask=rmask[:, None], other=0.0)
            m_post += tl.load(m_row + N + n[None, :], mask=rmask[:, None], other=0.0)
            m_comb += tl.load(m_row[:, :, None] + 2 * N + jk[None, :, :], mask=rmask[:, None, None], other=0.0)
            sq += tl.load(sq_ptr + sl * T + rows, mask=rmask, other=0.0)
        rs = 1.0 / tl.sqrt(sq / (N * D) + eps)
        s0 = tl.load(scale_ptr)
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        pre = tl.sigmoid(m_pre * rs[:, None] * s0 + tl.load(base_ptr + n)[None, :]) + hc_eps
        post = 2.0 * tl.sigmoid(m_post * rs[:, None] * s1 + tl.load(base_ptr + N + n)[None, :])
        c = m_comb * rs[:, None, None] * s2 + tl.load(base_ptr + 2 * N + jk)[None, :, :]     # [BT, j, k]
        c = tl.exp(c - tl.max(c, 2)[:, :, None])
        c = c / tl.sum(c, 2)[:, :, None] + hc_eps                                 # softmax over k, + eps
        c = c / (tl.sum(c, 1)[:, None, :] + hc_eps)                               # columns
        for _ in range(iters - 1):                                                # Sinkhorn: rows, then columns
            c = c / (tl.sum(c, 2)[:, :, None] + hc_eps)
            c = c / (tl.sum(c, 1)[:, None, :] + hc_eps)
        tl.store(post_ptr + rows[:, None] * N + n[None, :], post, mask=rmask[:, None])
        tl.store(comb_ptr + rows[:, None, None] * (N * N) + jk[None, :, :], c, mask=rmask[:, None, None])
        for d0 in range(0, D, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            dmask = ds < D
            m3 = rmask[:, None, None] & dmask[None, None, :]
            x = tl.load(x_ptr + rows[:, None, None].to(tl.int64) * (N * D) + n[None, :, None] * D + ds[None, None, :],
                        mask=m3, other=0.0).to(tl.float32)
            h = tl.sum(x * pre[:, :, None], 1)
            tl.store(h_ptr + rows[:, None].to(tl.int64) * D + ds[None, :], h.to(h_ptr.dtype.element_ty),
                     mask=rmask[:, None] & dmask[None, :])

    @triton.jit
    def _expand_kernel(out_ptr, x_ptr, post_ptr, comb_ptr, y_ptr, T, D, N: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_D: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        rmask = rows < T
        ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        dmask = ds < D
        n = tl.arange(0, N)
        dt = y_ptr.dtype.element_ty
        # post and comb rounded to X's dtype first, as the torch path does
        post = tl.load(post_ptr + rows[:, None] * N + n[None, :], mask=rmask[:, None], other=0.0).to(dt).to(tl.float32)
        jk = n[:, None] * N + n[None, :]
        comb = tl.load(comb_ptr + rows[:, None, None] * (N * N) + jk[None, :, :], mask=rmask[:, None, None],
                       other=0.0).to(dt).to(tl.float32)                            # [BT, j, k]
        o = tl.load(out_ptr + rows[:, None].to(tl.int64) * D + ds[None, :], mask=rmask[:, None] & dmask[None, :],
                    other=0.0).to(tl.float32)
        base = rows[:, None, None].to(tl.int64) * (N * D) + n[None, :, None] * D + ds[None, None, :]
        m3 = rmask[:, None, None] & dmask[None, None, :]
        x = tl.load(x_ptr + base, mask=m3, other=0.0).to(tl.float32)              # [BT, j, BD]
        mixed = tl.sum(comb[:, :, :, None] * x[:, :, None, :], 1)                 # [BT, k, BD]
        y = post[:, :, None] * o[:, None, :] + mixed
        tl.store(y_ptr + base, y.to(dt), mask=m3)


_MIX_BLOCK_T, _MIX_BLOCK_K = 128, 32    # the fastest of the four tiles dev/profile_layer.py compares
_PROGRAMS = 1024      # split-K target: several programs per SM of a Hopper-class GPU


def hc_mix(X_TK: torch.Tensor, fn_FK: torch.Tensor, block_t: int = _MIX_BLOCK_T,
           block_k: int = _MIX_BLOCK_K) -> tuple[torch.Tensor, torch.Tensor]:
    """(mix slices [KS, T, F_PAD] fp32, sum-of-squares slices [KS, T] fp32) of X @ fn^T (X contiguous).
    ``block_t`` / ``block_k``: the tile (powers of two >= 16; dev/profile_layer.py times the choices)."""
    T, K = X_TK.shape
    F = fn_FK.shape[0]
    F_PAD = max(16, triton.next_power_of_2(F))
    tiles = max(1, triton.cdiv(T, block_t))
    chunks = triton.cdiv(K, block_k)
    KS = max(1, min(chunks, triton.cdiv(_PROGRAMS, tiles)))
    k_slice = triton.cdiv(chunks, KS) * block_k
    KS = triton.cdiv(K, k_slice)
    mix = torch.empty(KS, T, F_PAD, dtype=torch.float32, device=X_TK.device)
    sq = torch.empty(KS, T, dtype=torch.float32, device=X_TK.device)
    if T:
        _mix_kernel[(tiles, KS)](X_TK, fn_FK.float().contiguous(), mix, sq, T, K, F, k_slice, F_PAD=F_PAD,
                                 BLOCK_T=block_t, BLOCK_K=block_k, num_warps=4)
    return mix, sq


def hc_collapse(X_TND: torch.Tensor, mix: tuple, base: torch.Tensor, scale: torch.Tensor, eps: float,
                hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h [T, D] in X's dtype, post [T, N] fp32, comb [T, N, N] fp32) from ``hc_mix``'s slices; see the module
    docstring."""
    T, N, D = X_TND.shape
    mix_slices, sq_slices = mix
    h = torch.empty(T, D, dtype=X_TND.dtype, device=X_TND.device)
    post = torch.empty(T, N, dtype=torch.float32, device=X_TND.device)
    comb = torch.empty(T, N, N, dtype=torch.float32, device=X_TND.device)
    if T:
        BLOCK_T = 8
        _collapse_kernel[(triton.cdiv(T, BLOCK_T),)](X_TND, mix_slices, sq_slices, base.float().contiguous(),
                                                     scale.float().contiguous(), h, post, comb, T, D,
                                                     mix_slices.shape[0], eps, hc_eps, iters, N=N,
                                                     F_PAD=mix_slices.shape[2], BLOCK_T=BLOCK_T,
                                                     BLOCK_D=min(256, triton.next_power_of_2(D)), num_warps=4)
    return h, post, comb


def hc_expand(out_TD: torch.Tensor, X_TND: torch.Tensor, post_TN: torch.Tensor, comb_TNN: torch.Tensor) -> torch.Tensor:
    """[T, N, D] in X's dtype: X'[k] = post_k * out + sum_j comb[j, k] X[j]."""
    T, N, D = X_TND.shape
    y = torch.empty_like(X_TND)
    if T:
        BLOCK_T, BLOCK_D = 4, min(128, triton.next_power_of_2(D))
        _expand_kernel[(triton.cdiv(T, BLOCK_T), triton.cdiv(D, BLOCK_D))](
            out_TD, X_TND, post_TN.contiguous(), comb_TNN.contiguous(), y, T, D, N=N, BLOCK_T=BLOCK_T,
            BLOCK_D=BLOCK_D, num_warps=4)
    return y

"""The low-latency mode's own kernels (Triton, each with a torch twin that runs where Triton does not).

Legend: N local tokens, H hidden, S = H / 128 scale groups, K top-k, e local experts, PT = P * T receive slots per
expert (T the most tokens a rank may dispatch), R = P * C received block rows (C = T).

``dispatch_kernel`` and ``combine_kernel`` each have two phases, as DeepEP's low-latency kernels have a send and a
receive phase:

- dispatch, phase 0 (send side): per token, the FP8 cast with one scale per 128 channels (DeepEP's
  ``calculate_fp8_scales``: ``amax / 448``, or with ``round_scale`` the power of two at or above it), into a byte
  row ``[fp8 H | float32 scales S]``;
- dispatch, phase 1 (receive side): every received (row, top-k slot) of a local expert to its expert-major slot
  ``dest`` = expert * PT + slot: the row, its scales (column-major ``[e, S, PT]`` floats, or UE8M0 bytes packed
  four to an int32 ``[e, S / 4, PT]``), and the source token index;
- combine, phase 0 (receive side): per received row, the weighted sum over its local slots of the expert outputs
  ``x[dest]`` (fp32), to be sent back;
- combine, phase 1 (source side): the fp32 sums, added over the ranks by the engine, stored into ``out``.

DeepEP's own test profiles the kernels by name (exactly one profiled kernel name containing "dispatch" and one
containing "combine", and ``::dispatch`` twice per call with a receive hook). The Triton kernels therefore carry
C++-mangled names that profilers demangle to ``moe_wave::dispatch()`` and ``moe_wave::combine()``; nothing else
here or in the engine has those words in its kernel names.
"""

from __future__ import annotations

import torch

from moe_wave.comm.triton_gate import tl, triton

__all__ = ["pack_fp8", "pack_fp8_torch", "expand", "expand_torch", "reduce_rows", "reduce_rows_torch", "store_out",
           "FP8_MAX"]

FP8_MAX = 448.0
_MARGIN = 1e-4
fp8_scales = None       # a Triton function where Triton is installed (below)

if triton is not None:

    @triton.jit
    def fp8_scales(amax, ROUND: tl.constexpr):
        """(scale, 1 / scale) of an FP8 e4m3 cast from a group's amax: ``448 / amax``, or with ``ROUND`` the power of
        two at or above ``amax / 448`` (DeepEP's ``calculate_fp8_scales``, ``fast_log2_ceil`` / ``fast_pow2``)."""
        if ROUND:
            bits = (amax * (1.0 / 448.0)).to(tl.int32, bitcast=True)
            ex = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
            scale = ((127 - ex) << 23).to(tl.float32, bitcast=True)
            scale_inv = ((127 + ex) << 23).to(tl.float32, bitcast=True)
        else:
            scale = 448.0 / amax
            scale_inv = amax * (1.0 / 448.0)
        return scale, scale_inv

    @triton.jit
    def _ZN8moe_wave8dispatchEv(x_ptr, sx, q_ptr, sc_ptr, so_q, so_sc, src_ptr, ss, ss_sc, dest_ptr, tok_ptr, K,
                                recv_ptr, rs_ptr, info_ptr, H, S, PT, PHASE: tl.constexpr, FP8: tl.constexpr,
                                ROUND: tl.constexpr, UE8M0: tl.constexpr, BLOCK: tl.constexpr, SB: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        if PHASE == 0:      # token pid: FP8 cast, one scale per 128 channels
            g = tl.arange(0, 128)
            for s in range(S):
                v = tl.load(x_ptr + pid * sx + s * 128 + g).to(tl.float32)
                amax = tl.maximum(tl.max(tl.abs(v), 0), 1e-4)
                scale, scale_inv = fp8_scales(amax, ROUND)
                tl.store(q_ptr + pid * so_q + s * 128 + g, (v * scale).to(q_ptr.dtype.element_ty))
                tl.store(sc_ptr + pid * so_sc + s, scale_inv)
        else:               # pair pid = row * K + k: the row to its expert-major slot, if it has one
            d = tl.load(dest_ptr + pid)
            ok = d >= 0
            r = pid // K
            dd = tl.maximum(d, 0)
            for c in range(0, H, BLOCK):
                offs = c + tl.arange(0, BLOCK)
                m = (offs < H) & ((d + tl.zeros([BLOCK], dtype=tl.int64)) >= 0)
                tl.store(recv_ptr + dd * H + offs, tl.load(src_ptr + r * ss + offs, mask=m), mask=m)
            if FP8:
                ex_i = dd // PT
                slot = dd % PT
                s = tl.arange(0, SB)
                ms = (s < S) & ((d + tl.zeros([SB], dtype=tl.int64)) >= 0)
                sc = tl.load(sc_ptr + r * ss_sc + s, mask=ms, other=1.0)
                if UE8M0:   # exponent byte s of the int32 group s // 4, column-major [e, S / 4, PT] int32
                    byte = ((sc.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)
                    tl.store(rs_ptr + ex_i * (S * PT) + (s // 4) * (PT * 4) + slot * 4 + s % 4, byte, mask=ms)
                else:       # column-major [e, S, PT] float32
                    tl.store(rs_ptr + ex_i * (S * PT) + s * PT + slot, sc, mask=ms)
            tl.store(info_ptr + dd, tl.load(tok_ptr + r), mask=ok)

    @triton.jit
    def _ZN8moe_wave7combineEv(y_ptr, dest_ptr, w_ptr, sw, out_ptr, so, src_ptr, K, H, PHASE: tl.constexpr,
                               BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        for c in range(0, H, BLOCK):
            offs = c + tl.arange(0, BLOCK)
            m = offs < H
            if PHASE == 0:      # received row pid: sum_k w[k] * y[dest[k]] over its local slots, fp32
                acc = tl.zeros((BLOCK,), dtype=tl.float32)
                for k in range(K):
                    d = tl.load(dest_ptr + pid * K + k)
                    w = tl.load(w_ptr + pid * sw + k)
                    v = tl.load(y_ptr + tl.maximum(d, 0) * H + offs,
                                mask=m & ((d + tl.zeros([BLOCK], dtype=tl.int64)) >= 0), other=0.0)
                    acc += w * v.to(tl.float32)
                tl.store(out_ptr + pid * so + offs, acc, mask=m)
            else:               # token pid: the summed row into out's dtype
                v = tl.load(src_ptr + pid * H + offs, mask=m)
                tl.store(out_ptr + pid * so + offs, v.to(out_ptr.dtype.element_ty), mask=m)


def _block(H: int) -> int:
    return min(triton.next_power_of_2(max(H, 16)), 2048)


# ---------------------------------------------------------------------------- dispatch, phase 0
def pack_fp8(x_NH: torch.Tensor, row_NB: torch.Tensor, round_scale: bool) -> None:
    """x (bf16 [N, H]) into byte rows [N, H + 4S]: the fp8 values, then the float32 scales (Triton)."""
    N, H = x_NH.shape
    if N == 0:
        return
    q, sc = _row_views(row_NB, H)
    _ZN8moe_wave8dispatchEv[(N,)](x_NH, x_NH.stride(0), q, sc, q.stride(0), sc.stride(0), x_NH, 0, 0, x_NH, x_NH, 1,
                                  x_NH, x_NH, x_NH, H, H // 128, 1, PHASE=0, FP8=True, ROUND=round_scale, UE8M0=False,
                                  BLOCK=128, SB=16)


def pack_fp8_torch(x_NH: torch.Tensor, row_NB: torch.Tensor, round_scale: bool) -> None:
    """The same with torch ops."""
    N, H = x_NH.shape
    q, sc = _row_views(row_NB, H)
    v = x_NH.float().view(N, H // 128, 128)
    amax = v.abs().amax(-1).clamp(min=_MARGIN)
    if round_scale:
        bits = (amax * (1.0 / FP8_MAX)).view(torch.int32)
        ex = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        scale, scale_inv = ((127 - ex) << 23).view(torch.float32), ((127 + ex) << 23).view(torch.float32)
    else:
        scale, scale_inv = FP8_MAX / amax, amax * (1.0 / FP8_MAX)
    q.copy_((v * scale[..., None]).view(N, H).to(q.dtype))
    sc.copy_(scale_inv)


def _row_views(row_NB: torch.Tensor, H: int):
    """(fp8 [N, H], float32 [N, S]) views of byte rows [N, H + 4S]."""
    return row_NB[:, :H].view(torch.float8_e4m3fn), row_NB[:, H:].view(torch.float32)


# ---------------------------------------------------------------------------- dispatch, phase 1
def expand(rows_RB: torch.Tensor, dest_RK: torch.Tensor, tok_R: torch.Tensor, recv, scales, info_ePT: torch.Tensor,
           H: int, fp8: bool, ue8m0: bool) -> None:
    """Every pair (r, k) with ``dest_RK[r, k] >= 0`` copies row r (its H data elements) to row ``dest`` of ``recv``
    ([e, PT, H]), its scales into ``scales`` (the physical tensor behind the column-major scales: float32
    [e, S, PT], or int32 [e, S / 4, PT] with UE8M0) and ``tok_R[r]`` to ``info_ePT[dest]`` (Triton)."""
    R, K = dest_RK.shape
    if R * K == 0:
        return
    PT = info_ePT.shape[-1]
    data = rows_RB[:, :H] if fp8 else rows_RB
    sc = rows_RB[:, H:].view(torch.float32) if fp8 else rows_RB
    rs = (scales.view(torch.uint8) if ue8m0 else scales) if fp8 else recv
    recv = recv.view(torch.uint8) if fp8 else recv       # fp8 rows move as bytes
    S = H // 128
    _ZN8moe_wave8dispatchEv[(R * K,)](data, 0, data, sc, 0, 0, data, data.stride(0), sc.stride(0) if fp8 else 0,
                                      dest_RK.contiguous(), tok_R, K, recv, rs, info_ePT, H, S, PT, PHASE=1, FP8=fp8,
                                      ROUND=False, UE8M0=ue8m0, BLOCK=_block(H),
                                      SB=triton.next_power_of_2(max(S, 1)))


def expand_torch(rows_RB: torch.Tensor, dest_RK: torch.Tensor, tok_R: torch.Tensor, recv, scales,
                 info_ePT: torch.Tensor, H: int, fp8: bool, ue8m0: bool) -> None:
    """The same with torch ops (a dump row absorbs the pairs with no slot)."""
    R, K = dest_RK.shape
    e, PT = info_ePT.shape
    dump = e * PT
    d_RK = torch.where(dest_RK >= 0, dest_RK, dump)
    data = rows_RB[:, :H] if fp8 else rows_RB
    rv = recv.view(torch.uint8) if fp8 else recv          # fp8 rows move as bytes
    flat = torch.empty(dump + 1, H, dtype=rv.dtype, device=rv.device)
    flat[:dump] = rv.view(dump, H)
    info = torch.cat([info_ePT.view(-1), info_ePT.new_zeros(1)])
    for k in range(K):
        flat.index_copy_(0, d_RK[:, k], data)
        info.index_copy_(0, d_RK[:, k], tok_R)
    rv.view(dump, H).copy_(flat[:dump])
    info_ePT.view(-1).copy_(info[:dump])
    if fp8:
        S = H // 128
        sc_RS = rows_RB[:, H:].view(torch.float32)
        vals = sc_RS.view(torch.int32).bitwise_right_shift(23).bitwise_and(0xFF).to(torch.uint8) if ue8m0 else sc_RS
        # scales row-major [e * PT + 1, S] first, then into the column-major layout
        rm = torch.empty(dump + 1, S, dtype=vals.dtype, device=vals.device)
        for k in range(K):
            rm.index_copy_(0, d_RK[:, k], vals)
        if ue8m0:
            scales.view(torch.uint8).view(e, S // 4, PT, 4).copy_(rm[:dump].view(e, PT, S // 4, 4).transpose(1, 2))
        else:
            scales.copy_(rm[:dump].view(e, PT, S).transpose(1, 2))


# ---------------------------------------------------------------------------- combine
def reduce_rows(y_eH: torch.Tensor, dest_RK: torch.Tensor, w_RK: torch.Tensor, out_RH: torch.Tensor) -> None:
    """``out_RH[r] = sum_k w_RK[r, k] * y_eH[dest_RK[r, k]]`` over the slots with ``dest >= 0``, fp32 (Triton)."""
    R, K = dest_RK.shape
    H = y_eH.shape[1]
    if R == 0:
        return
    _ZN8moe_wave7combineEv[(R,)](y_eH, dest_RK.contiguous(), w_RK, w_RK.stride(0), out_RH, out_RH.stride(0), y_eH, K,
                                 H, PHASE=0, BLOCK=_block(H))


def reduce_rows_torch(y_eH: torch.Tensor, dest_RK: torch.Tensor, w_RK: torch.Tensor, out_RH: torch.Tensor) -> None:
    out_RH.zero_()
    for k in range(dest_RK.shape[1]):
        d = dest_RK[:, k]
        v = y_eH.index_select(0, d.clamp(min=0)).float()
        out_RH.add_(torch.where((d >= 0)[:, None], v * w_RK[:, k:k + 1], 0.0))


def store_out(src_NH: torch.Tensor, out_NH: torch.Tensor, kernels: bool) -> None:
    """``out_NH[:] = src_NH`` (fp32 sums into out's dtype): combine's phase 1 (Triton), or ``copy_``."""
    N, H = src_NH.shape
    if not kernels:
        out_NH.copy_(src_NH)
    elif N:
        _ZN8moe_wave7combineEv[(N,)](src_NH, src_NH, src_NH, 0, out_NH, out_NH.stride(0), src_NH, 0, H, PHASE=1,
                                     BLOCK=_block(H))

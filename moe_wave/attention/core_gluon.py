"""The sparse attention core's prefill kernel for Hopper, in Gluon (Triton's explicit-layout dialect).

The math is ``core.sparse_attention`` (``core_kernel``'s module docstring has the legend and the online softmax);
this kernel exists because two things that decide the speed cannot be asked of the Triton compiler:

- **Who computes what.** A program holds one query's 64 heads (V4's KV head is shared, so the heads are the
  GEMM's M side) and its 8 warps form two warpgroups. Triton lays a dot whose result feeds another dot out along M
  (``warpsPerCTA = [8, 1]``), and with 64 rows both warpgroups then compute the same QK tile: a third of the
  tensor work wasted. Here QK is split along the keys (``[4, 2]``: each warpgroup 64 heads x BN/2 keys, the row
  max and sum exchanged through shared memory) and PV along the value channels (each warpgroup 64 x d/2).
- **When the gathered rows travel.** The picked KV rows are gathered with ``cp.async`` into a ring of NBUF
  shared-memory tiles. The copy of tile t + NBUF - 1 is issued once PV(t - 1) has released its buffer (one wait
  covers it and QK(t)), so it travels during the softmax and PV(t); the picks (row indices) are read one tile
  ahead of their copy, so no copy waits on an index load. (Triton's pipeliner treats the gather as an indirect
  load: it issues the next tile only after a synchronous load of its indices. Issuing the copy while QK(t) still
  runs, by waiting for PV(t - 1) alone, makes ptxas serialise every wgmma: 36 waits in the SASS in place of 2.)

Everything else is as in the Triton kernel: the window part, then the compressed part, in one online softmax
(fp32, exp2 domain), the sink as the running max's start (m = sink, l = 1), a -1 pick masked (its row is not read
and its logit is -inf), each part's tiles up to its last valid pick, bf16/fp16 in and out, one program per
(query, 64-head block), every output element written once in a fixed order: the same inputs give the same bits
on every run. It takes the plain call only (no key splits, no fused prologue / epilogue): prefill's grids, where
``core_kernel.sparse_attention_fused`` runs those steps as separate passes anyway. ``supported`` says when it
applies; the Triton kernel runs everywhere else (and on CPU, under the interpreter, which Gluon does not have).
"""

from __future__ import annotations

import functools
import warnings

import torch

from moe_wave.comm.triton_gate import triton

try:  # Gluon: Triton's experimental dialect; anything missing means "not available", never an import error
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, \
        warpgroup_mma_init, warpgroup_mma_wait
    # cp.async of a pointer tensor: `async_load` from Triton 3.7 on, `async_copy_global_to_shared` before
    _cp_async = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
    # a CTA-wide barrier: `barrier` from Triton 3.7 on, `thread_barrier` before
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
except Exception:  # pragma: no cover - depends on the install
    gluon = gl = None

__all__ = ["available", "supported", "mark_broken", "picks_chunk", "sparse_attention_gluon", "BH", "BN", "NBUF"]

BH = 64     # heads per program (the GEMM's M: one wgmma row block per warpgroup)
BN = 64     # picked keys per tile
NBUF = 2    # tiles in the shared-memory ring (with d = 512: q 64 KB + 2 x 64 KB of keys)
_LOG2E = 1.4426950408889634


_BROKEN: str | None = None   # why this install cannot compile the kernel (see mark_broken), once it failed


def mark_broken(err: BaseException) -> None:
    """The kernel failed to compile or launch here (Gluon is experimental: its API moves between Triton releases):
    warn once and leave every later call to the Triton kernel (``available`` is False from now on)."""
    global _BROKEN
    if _BROKEN is None:
        _BROKEN = f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"
        warnings.warn(f"moe_wave: the Gluon sparse-attention kernel does not compile with Triton "
                      f"{getattr(triton, '__version__', '?')} ({_BROKEN}); the Triton kernel runs instead",
                      stacklevel=3)


def picks_chunk(J1: int, J2: int, block_n: int) -> int:
    """Picks per load when a program of either core kernel counts its tiles: every pick of the longer part in one
    load (a power of two), up to 2048."""
    return min(2048, 1 << (max(J1, J2, block_n) - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _hopper(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] == 9


def available() -> bool:
    """Gluon imports, a Hopper GPU (sm_90) is current, and the kernel has not failed to compile here."""
    if gluon is None or triton is None or _BROKEN is not None or not torch.cuda.is_available():
        return False
    return _hopper(torch.cuda.current_device())


def supported(q: torch.Tensor, n_parts: int, nsplit: int, fused: bool) -> bool:
    """True when this kernel runs the call: Hopper, 16-bit q, d a power of two in 64..512, whole 64-head blocks,
    one or two parts, no key splits, no fusions."""
    if fused or nsplit != 1 or not 1 <= n_parts <= 2 or not q.is_cuda:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False
    D, H = q.shape[-1], q.shape[-2]
    if D not in (64, 128, 256, 512) or H % BH:
        return False
    return available()


if gl is not None:

    @gluon.jit
    def _picks(T, n1, idx1, J1, idx2, J2, BN: gl.constexpr, layout: gl.constexpr, TWO: gl.constexpr):
        # the row ids of tile T of the query's tile sequence (part 1's tiles, then part 2's), in `layout`; -1 for
        # masked picks and for T past the end
        # (int32 from here on, whatever the picks' dtype: int64 picks, as the layer's indexer gives them, would
        # double these registers in a kernel at its register limit)
        jj = gl.arange(0, BN, layout=layout)
        j1 = T * BN + jj
        r = gl.load(idx1 + j1, mask=(j1 < J1) & (T < n1), other=-1).to(gl.int32)
        if TWO:
            j2 = (T - n1) * BN + jj
            r2 = gl.load(idx2 + j2, mask=(j2 < J2) & (j2 >= 0) & (T >= n1), other=-1).to(gl.int32)
            r = gl.maximum(r, r2)                                      # one of the two is -1
        return r

    @gluon.jit
    def _gather(T, n1, kv1, s_k1_m, kv2, s_k2_m, rows, buf, D: gl.constexpr, BD: gl.constexpr,
                layout: gl.constexpr, TWO: gl.constexpr):
        # cp.async of tile T's picked rows into `buf` (a -1 row is zero-filled: its p is 0, and 0 * its value
        # must not be NaN); rows: [BN] in SliceLayout(1, layout)
        dk = gl.arange(0, BD, layout=gl.SliceLayout(0, layout))
        ok = (rows >= 0)[:, None] & (dk < D)[None, :]
        off = gl.maximum(rows, 0).to(gl.int64)[:, None]
        if TWO:
            if T < n1:
                _cp_async(buf, kv1 + off * s_k1_m + dk[None, :], mask=ok)
            else:
                _cp_async(buf, kv2 + off * s_k2_m + dk[None, :], mask=ok)
        else:
            _cp_async(buf, kv1 + off * s_k1_m + dk[None, :], mask=ok)

    @gluon.jit
    def _n_tiles(idx_row, J, BN: gl.constexpr, JC: gl.constexpr, layout: gl.constexpr):
        # BN-key tiles up to this query's last valid pick (trailing -1s cost nothing); JC picks per load (>= J on
        # the V4 shapes: one load, not a chain of dependent loads before the first tile)
        last = gl.max(gl.full([JC], 0, gl.int32, layout), axis=0)
        for t0 in range(0, J, JC):
            jj = t0 + gl.arange(0, JC, layout=layout)
            picks = gl.load(idx_row + jj, mask=jj < J, other=-1).to(gl.int32)
            last = gl.maximum(last, gl.max(gl.where(picks >= 0, jj + 1, 0), axis=0))
        return gl.cdiv(last, BN)

    @gluon.jit(do_not_specialize=["S", "H", "J1", "J2"])
    def _sparse_core_gluon(q_ptr, o_ptr, sink_ptr, kv1_ptr, idx1_ptr, kv2_ptr, idx2_ptr, S, H, J1, J2, qk_scale,
                           s_q_b, s_q_s, s_q_h, s_o_b, s_o_s, s_o_h, s_k1_b, s_k1_m, s_i1_b, s_i1_s,
                           s_k2_b, s_k2_m, s_i2_b, s_i2_s,
                           D: gl.constexpr, BD: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr,
                           NBUF: gl.constexpr, TWO: gl.constexpr, PROBE: gl.constexpr, JC: gl.constexpr,
                           num_warps: gl.constexpr):
        gl.static_assert(num_warps == 8, "two warpgroups")
        dt: gl.constexpr = q_ptr.dtype.element_ty
        # QK: [BH, BN] split along the keys; PV: [BH, BD] split along the value channels
        qk_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BN // 2, 16])
        pv_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BD // 2, 16])
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=pv_l, k_width=2)
        # gathers: 16-byte vectors along d, a warp per row
        ld_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[1, 32],
                                              warps_per_cta=[8, 1], order=[1, 0])
        sm_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        one_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[8],
                                               order=[0])

        bs = gl.program_id(0)
        b = (bs // S).to(gl.int64)
        s = (bs % S).to(gl.int64)
        h0 = gl.program_id(1) * BH

        q_smem = gl.allocate_shared_memory(dt, [BH, BD], sm_l)
        k_smem = gl.allocate_shared_memory(dt, [NBUF, BN, BD], sm_l)

        # q [BH, d] by cp.async (the first commit group)
        hq = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, ld_l))
        dq = gl.arange(0, BD, layout=gl.SliceLayout(0, ld_l))
        _cp_async(
            q_smem, q_ptr + b * s_q_b + s * s_q_s + hq.to(gl.int64)[:, None] * s_q_h + dq[None, :],
            mask=(hq < H)[:, None] & (dq < D)[None, :])
        cp.commit_group()

        idx1 = idx1_ptr + b * s_i1_b + s * s_i1_s
        idx2 = idx2_ptr + b * s_i2_b + s * s_i2_s
        kv1 = kv1_ptr + b * s_k1_b
        kv2 = kv2_ptr + b * s_k2_b
        n1 = _n_tiles(idx1, J1, BN, JC, one_l)
        n2 = n1 * 0
        if TWO:
            n2 = _n_tiles(idx2, J2, BN, JC, one_l)
        nt = n1 + n2

        rows_l: gl.constexpr = gl.SliceLayout(1, ld_l)
        cols_l: gl.constexpr = gl.SliceLayout(0, qk_l)
        for i in gl.static_range(NBUF - 1):                             # the ring's first tiles
            r = _picks(i, n1, idx1, J1, idx2, J2, BN, rows_l, TWO)
            _gather(i, n1, kv1, s_k1_m, kv2, s_k2_m, r, k_smem.index(i), D, BD, ld_l, TWO)
            cp.commit_group()
        rows_n = _picks(NBUF - 1, n1, idx1, J1, idx2, J2, BN, rows_l, TWO)   # the next tile to gather
        ok_n = _picks(0, n1, idx1, J1, idx2, J2, BN, cols_l, TWO) >= 0       # tile 0's score mask

        hm = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, qk_l))
        m_i = gl.load(sink_ptr + hm, mask=hm < H, other=0.0).to(gl.float32) * 1.4426950408889634
        l_i = gl.full([BH], 1.0, gl.float32, gl.SliceLayout(1, qk_l))
        acc = warpgroup_mma_init(gl.zeros([BH, BD], gl.float32, pv_l))      # an async wgmma's token type
        s_zero = gl.zeros([BH, BN], gl.float32, qk_l)
        for t in range(0, nt):
            buf = k_smem.index(t % NBUF)
            cp.wait_group(NBUF - 2)                                     # tile t (and q) landed, for this thread
            fence_async_shared()                                        # its writes visible to the async proxy
            _cta_barrier()                                         # ... and every thread's
            sc = warpgroup_mma(q_smem, buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc, sc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, sc))   # PV(t-1) and QK(t) done
            _cta_barrier()                                         # both warpgroups: buffer (t-1) is free
            nxt = t + NBUF - 1
            if (nxt < nt) and (PROBE != 1):                             # (PROBE: profiling, see _probe)
                _gather(nxt, n1, kv1, s_k1_m, kv2, s_k2_m, rows_n, k_smem.index(nxt % NBUF), D, BD, ld_l, TWO)
            cp.commit_group()                                           # (an empty group past the end)
            rows_n = _picks(nxt + 1, n1, idx1, J1, idx2, J2, BN, rows_l, TWO)
            ok = ok_n
            ok_n = _picks(t + 1, n1, idx1, J1, idx2, J2, BN, cols_l, TWO) >= 0

            sc = gl.where(ok[None, :], sc * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(sc, axis=1))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(sc - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            a_pv = gl.convert_layout(alpha, gl.SliceLayout(1, pv_l))
            p_op = gl.convert_layout(p.to(dt), p_l)
            if PROBE == 2:
                acc = warpgroup_mma_init(acc * a_pv[:, None])
            else:
                acc = warpgroup_mma(p_op, buf, acc * a_pv[:, None], is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        cp.wait_group(0)

        l_pv = gl.convert_layout(l_i, gl.SliceLayout(1, pv_l))
        o = (acc / l_pv[:, None]).to(o_ptr.dtype.element_ty)
        ho = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, pv_l))
        do = gl.arange(0, BD, layout=gl.SliceLayout(0, pv_l))
        gl.store(o_ptr + b * s_o_b + s * s_o_s + ho.to(gl.int64)[:, None] * s_o_h + do[None, :], o,
                 mask=(ho < H)[:, None] & (do < D)[None, :])


def sparse_attention_gluon(q: torch.Tensor, out: torch.Tensor, sinks: torch.Tensor, kv1: torch.Tensor,
                           i1: torch.Tensor, kv2: torch.Tensor, i2: torch.Tensor, scale: float, two: bool, *,
                           bn: int = BN, nbuf: int = NBUF, probe: int = 0) -> None:
    """Launch on checked, last-dim-contiguous tensors (``core_kernel.sparse_attention_fused`` prepares them):
    q / out [B, S, H, d], kv [B, M, d] in q's dtype, idx [B, S, J] (integers), sinks fp32 [H]. bn / nbuf: keys
    per tile and tiles in the ring (benchmarks; q and the ring must fit in shared memory). probe (profiling
    only, wrong results): 1 skips the gathers after the first tiles, 2 the PV products."""
    B, S, H, D = q.shape
    J1, J2 = i1.shape[-1], (i2.shape[-1] if two else 0)
    _sparse_core_gluon[(B * S, H // BH)](
        q, out, sinks, kv1, i1, kv2, i2, S, H, J1, J2, float(scale) * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        kv1.stride(0), kv1.stride(1), i1.stride(0), i1.stride(1), kv2.stride(0), kv2.stride(1), i2.stride(0),
        i2.stride(1), D=D, BD=D, BH=BH, BN=bn, NBUF=nbuf, TWO=two, PROBE=probe,
        JC=picks_chunk(J1, J2, bn), num_warps=8)

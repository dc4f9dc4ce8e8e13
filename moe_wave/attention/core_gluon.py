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
on every run. It takes prefill's grids (no key splits). ``supported`` says when it applies; the Triton kernel runs
everywhere else (and on CPU, under the interpreter, which Gluon does not have).

Two kernels share that math and give the same bits:

- ``_sparse_core_gluon``: one program per (query, head block). Each pays the fixed cost of an item: the picks'
  count, q's load, the ring's first tiles, the output's store (about 9 us a program on an H200, against about
  2.2-2.75 us a 64-key tile).
- ``_sparse_core_ws`` (the default): warp-specialized and persistent, see the comment above it. A loader
  partition prepares the next item while the math warpgroups finish this one. The output leaves through shared
  memory in 16-byte stores, and the epilogue can run the layer's steps after the core (the output's inverse
  RoPE, ``act_quant`` for the FP8 wo_a) as ``core_kernel._epilogue`` does. On one H200 it is 1.19-1.32 x faster
  than the one-program kernel (``benchmarks/results/attn.md``). It also takes the step
  before the core, q's per-head RMSNorm and RoPE (``q_rope``): the loader computes each head's 1 / rms from q in
  shared memory and rotates q's RoPE tail in place while the math warpgroups finish the last item, and the
  softmax multiplies the factor into the head's score scale. The layer then skips ``norm_rope``'s pass over q
  (a read and a write of all of it): on one H200, V4-Flash prefill at 4096 tokens, each attention layer 7-9 %
  faster (``benchmarks/results/attn.md``). The loader issues q as one TMA copy, not
  32 ``cp.async`` a thread, and the output's inverse RoPE runs on its staged tail in shared memory, not on every
  channel in registers: the core 8-14 % faster in the layer, same bits (``dev/trace_core.py`` times each
  phase of an item inside the kernel; ``benchmarks/results/attn.md``).
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
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, \
        warpgroup_mma_init, warpgroup_mma_wait
    # cp.async of a pointer tensor: `async_load` from Triton 3.7 on, `async_copy_global_to_shared` before
    _cp_async = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
    # a CTA-wide barrier: `barrier` from Triton 3.7 on, `thread_barrier` before
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    # q's tile in shared memory (the kernels' sm_l), which the TMA descriptor of q (QTMA) must name
    _Q_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
except Exception:  # pragma: no cover - depends on the install
    gluon = gl = None
try:  # TMA for q (QTMA); without it q comes by cp.async
    from triton.experimental.gluon.language.nvidia.hopper import tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except Exception:  # pragma: no cover - depends on the install
    tma = TensorDescriptor = None

__all__ = ["available", "supported", "ws_supported", "mark_broken", "mark_ws_broken", "picks_chunk",
           "sparse_attention_gluon", "WSUnavailable", "COMPILE_ERRORS", "BH", "BN", "NBUF"]

BH = 64     # heads per program (the GEMM's M: one wgmma row block per warpgroup)
BN = 64     # picked keys per tile
NBUF = 2    # tiles in the shared-memory ring (with d = 512: q 64 KB + 2 x 64 KB of keys)
LOAD_REGS = 56      # the warp-specialized kernel's loader partition: registers a thread
WS_MAXNREG = 168    # ... and the launch's: 12 warps x 32 x 168 fit the SM's 64 K registers; the math partition
                    # gets the rest, (12 x 168 - 4 x LOAD_REGS) / 8 rounded down to 8: 224 at LOAD_REGS = 56 (ptxas
                    # allocates each partition within its share, but needs every instruction's registers within the
                    # launch's: PV's wgmma takes 158, so 16 warps at 128 cannot compile; LOAD_REGS 48-168 all spill
                    # more than 56: benchmarks/results/attn.md)
_LOG2E = 1.4426950408889634


_BROKEN: str | None = None   # why this install cannot compile the kernel (see mark_broken), once it failed
_WS_BROKEN: str | None = None   # ... the warp-specialized kernel (see mark_ws_broken)


def _reason(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"


def mark_broken(err: BaseException) -> None:
    """The kernel failed to compile or launch here (Gluon is experimental: its API moves between Triton releases):
    warn once and leave every later call to the Triton kernel (``available`` is False from now on)."""
    global _BROKEN
    if _BROKEN is None:
        _BROKEN = _reason(err)
        warnings.warn(f"moe_wave: the Gluon sparse-attention kernel does not compile with Triton "
                      f"{getattr(triton, '__version__', '?')} ({_BROKEN}); the Triton kernel runs instead",
                      stacklevel=3)


def mark_ws_broken(err: BaseException) -> None:
    """The warp-specialized kernel failed to compile here (``warp_specialize`` and mbarriers are the newest, most
    moving part of Gluon): warn once and leave every later call to the one-program-per-item Gluon kernel
    (``ws_supported`` is False from now on), with the output's steps as separate passes."""
    global _WS_BROKEN
    if _WS_BROKEN is None:
        _WS_BROKEN = _reason(err)
        warnings.warn(f"moe_wave: the warp-specialized Gluon sparse-attention kernel does not compile with Triton "
                      f"{getattr(triton, '__version__', '?')} ({_WS_BROKEN}); the one-program-per-item Gluon "
                      f"kernel runs instead", stacklevel=3)


def picks_chunk(J1: int, J2: int, block_n: int) -> int:
    """Picks per load when a program of either core kernel counts its tiles: every pick of the longer part in one
    load (a power of two), up to 2048."""
    return min(2048, 1 << (max(J1, J2, block_n) - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def ws_supported(J1: int = 0, J2: int = 0, bn: int = BN) -> bool:
    """The warp-specialized kernel compiles here (see ``mark_ws_broken``), and it gathers a tile as four chunks of
    bn / 4 rows, each a whole number of the shared layout's 8-row swizzle atoms."""
    return _WS_BROKEN is None and bn % 32 == 0


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
    def _row_halves(x):
        # x [BH, BN] in the QK layout (each warpgroup BN / 2 of the keys) summed over each warpgroup's keys: [BH, 2],
        # with no exchange between the warpgroups
        BH: gl.constexpr = x.shape[0]
        BN: gl.constexpr = x.shape[1]
        return gl.sum(gl.reshape(x, [BH, 2, BN // 2]), axis=2)

    @gluon.jit
    def _l_start(s_zero, LSPLIT: gl.constexpr):
        # the running sums at an item's start, the sink's 1: LSPLIT, [BH, 2] (a column for each warpgroup's keys, the
        # sink's 1 in column 0); else [BH]
        if LSPLIT:
            l_i = _row_halves(s_zero)
            c = gl.arange(0, 2, layout=gl.SliceLayout(0, l_i.type.layout))
            l_i = l_i + gl.where(c == 0, 1.0, 0.0)[None, :]
        else:
            l_i = gl.full([s_zero.shape[0]], 1.0, gl.float32, gl.SliceLayout(1, s_zero.type.layout))
        return l_i

    @gluon.jit
    def _l_total(l_i, pv_l: gl.constexpr, LSPLIT: gl.constexpr):
        # the sums at an item's end, in PV's row layout (LSPLIT: the warpgroups' columns meet here, once)
        if LSPLIT:
            l_i = gl.sum(l_i, axis=1)
        return gl.convert_layout(l_i, gl.SliceLayout(1, pv_l))

    @gluon.jit
    def _softmax_step(sc, ok, m_i, l_i, qk_scale, dt: gl.constexpr, pv_l: gl.constexpr, p_l: gl.constexpr,
                      LSPLIT: gl.constexpr):
        # one tile of the online softmax (exp2 domain): the tile's scores sc [BH, BN] (QK, fp32), its valid keys ok
        # [BN]; returns P as PV's A operand, alpha (the accumulator's rescale) in PV's row layout, and the new
        # running max and sum
        sc = gl.where(ok[None, :], sc * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(sc - m_new[:, None])
        if LSPLIT:      # each warpgroup's keys in its own column of l: one exchange between the warpgroups less a tile
            l_i = l_i * gl.convert_layout(alpha, gl.SliceLayout(1, l_i.type.layout))[:, None] + _row_halves(p)
        else:
            l_i = l_i * alpha + gl.sum(p, axis=1)
        return gl.convert_layout(p.to(dt), p_l), gl.convert_layout(alpha, gl.SliceLayout(1, pv_l)), m_new, l_i

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
                           LSPLIT: gl.constexpr, num_warps: gl.constexpr):
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
        s_zero = gl.zeros([BH, BN], gl.float32, qk_l)
        l_i = _l_start(s_zero, LSPLIT)
        acc = warpgroup_mma_init(gl.zeros([BH, BD], gl.float32, pv_l))      # an async wgmma's token type
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

            p_op, a_pv, m_i, l_i = _softmax_step(sc, ok, m_i, l_i, qk_scale, dt, pv_l, p_l, LSPLIT)
            if PROBE == 2:
                acc = warpgroup_mma_init(acc * a_pv[:, None])
            else:
                acc = warpgroup_mma(p_op, buf, acc * a_pv[:, None], is_async=True)
        l_pv = _l_total(l_i, pv_l, LSPLIT)                              # (while the last PV runs)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        cp.wait_group(0)

        o = (acc / l_pv[:, None]).to(o_ptr.dtype.element_ty)
        ho = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, pv_l))
        do = gl.arange(0, BD, layout=gl.SliceLayout(0, pv_l))
        gl.store(o_ptr + b * s_o_b + s * s_o_s + ho.to(gl.int64)[:, None] * s_o_h + do[None, :], o,
                 mask=(ho < H)[:, None] & (do < D)[None, :])


    # ---- the warp-specialized, persistent variant ------------------------------------------------------------
    # One program per SM walks the (query, 64-head block) items pid, pid + G, ... A loader partition (4 warps)
    # computes each item's tile counts, gathers its tiles into the ring and loads its q; the math partition (the
    # two warpgroups above, same math, same bits) consumes them. mbarriers hand the buffers over:
    #   kv_full[i] / q_full: 128 arrivals, one per loader thread, each when that thread's cp.async copies landed
    #   (with a q prologue, QROPE: q_full's 128 at once, after the loader's _ws_q_prep on the landed q);
    #   kv_empty[i]: the math partition, once PV of the tile in buffer i is done; q_empty: once the item's last QK is;
    #   q_tma (QTMA): the TMA copy of q, its bytes; the loader waits for it, then gives q_full its 128 at once.
    # So the next item's q and first tiles travel while this item's last tiles, its softmax and its output store
    # run, which the one-program-per-item kernel pays for at every item (its fixed cost: ~9 us a program).

    @gluon.jit
    def _ws_item(item, HB, S, BH: gl.constexpr):
        bs = item // HB
        return (bs // S).to(gl.int64), (bs % S).to(gl.int64), (item % HB) * BH

    @gluon.jit
    def _ws_stamp(trace_ptr, item, col: gl.constexpr, TRACE: gl.constexpr):
        # TRACE (profiling, same results): the SM's cycle counter (32 bits) at this point of the item's path to
        # trace[item, col] (16 int32 columns an item: 0-7 the math partition's (QK1: warpgroup 0's), 8-14 the
        # loader's, 15 QK1's warpgroup 1's end of the item; column 7 holds the low 32 bits of the global ns timer
        # instead, to line the SMs up)
        if TRACE:
            if col == 7:
                v = gl.inline_asm_elementwise("mov.u32 $0, %globaltimer_lo;", "=r", [], dtype=gl.int32,
                                              is_pure=False, pack=1)
            else:
                v = gl.inline_asm_elementwise("mov.u32 $0, %clock;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            gl.store(trace_ptr + item * 16 + col, v)

    @gluon.jit
    def _ws_counts(idx1, J1, idx2, J2, BN: gl.constexpr, JC: gl.constexpr, layout: gl.constexpr,
                   TWO: gl.constexpr):
        n1 = _n_tiles(idx1, J1, BN, JC, layout)
        n2 = n1 * 0
        if TWO:
            n2 = _n_tiles(idx2, J2, BN, JC, layout)
        return n1, n1 + n2

    @gluon.jit
    def _ws_q(q_smem, q_ptr, b, s, h0, H, s_q_b, s_q_s, s_q_h, D: gl.constexpr, BD: gl.constexpr,
              BH: gl.constexpr, RC: gl.constexpr, ld_l: gl.constexpr):
        dq = gl.arange(0, BD, layout=gl.SliceLayout(0, ld_l))
        for c in gl.static_range(BH // RC):
            hq = h0 + c * RC + gl.arange(0, RC, layout=gl.SliceLayout(1, ld_l))
            _cp_async(q_smem.slice(c * RC, RC),
                      q_ptr + b * s_q_b + s * s_q_s + hq.to(gl.int64)[:, None] * s_q_h + dq[None, :],
                      mask=(hq < H)[:, None] & (dq < D)[None, :])

    @gluon.jit
    def _ws_loader(a, D: gl.constexpr, BD: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr,
                   NBUF: gl.constexpr, TWO: gl.constexpr, JC: gl.constexpr, QFIRST: gl.constexpr,
                   PROBE: gl.constexpr, inv_smem, qpos_ptr, qfreq_ptr, q_eps, QROPE: gl.constexpr,
                   QRF: gl.constexpr, QTW: gl.constexpr, STC: gl.constexpr, TRACE: gl.constexpr,
                   q_desc, q_tma, QTMA: gl.constexpr, QPRO: gl.constexpr):
        (q_ptr, kv1_ptr, idx1_ptr, kv2_ptr, idx2_ptr, S, H, HB, n_items, J1, J2, s_q_b, s_q_s, s_q_h, s_k1_b,
         s_k1_m, s_i1_b, s_i1_s, s_k2_b, s_k2_m, s_i2_b, s_i2_s, q_smem, k_smem, pk_smem, q_full, q_empty,
         kv_full, kv_empty, trace_ptr) = a
        # a chunk of RC rows at a time (8 pointers a thread live, not 32, in the loader's small register budget);
        # the tile's picks go through shared memory (one load of BN picks, each thread then reads its rows)
        RC: gl.constexpr = BN // 4
        ld_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[1, 32],
                                              warps_per_cta=[4, 1], order=[1, 0])
        one_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[4],
                                               order=[0])
        rows_l: gl.constexpr = gl.SliceLayout(1, ld_l)
        g = 0
        qn = 0
        for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
            _ws_stamp(trace_ptr, item, 8, TRACE)
            b, s, h0 = _ws_item(item, HB, S, BH)
            idx1 = idx1_ptr + b * s_i1_b + s * s_i1_s
            idx2 = idx2_ptr + b * s_i2_b + s * s_i2_s
            kv1 = kv1_ptr + b * s_k1_b
            kv2 = kv2_ptr + b * s_k2_b
            n1, nt = _ws_counts(idx1, J1, idx2, J2, BN, JC, one_l, TWO)
            rows = _picks(0, n1, idx1, J1, idx2, J2, BN, one_l, TWO)
            for t in range(0, nt):
                if QFIRST and t == 0:                           # q once the last item's QKs are done with it
                    mbarrier.wait(q_empty, (qn & 1) ^ 1)
                    _ws_stamp(trace_ptr, item, 9, TRACE)
                    if QTMA:                                    # q by TMA: one instruction, not 32 copies a thread
                        mbarrier.expect(q_tma, BH * BD * 2)
                        row0 = (b * S + s).to(gl.int32) * H + h0        # q as [B * S * H, d]
                        tma.async_copy_global_to_shared(q_desc, [row0, 0], q_tma, q_smem)
                    elif PROBE != 4:
                        _ws_q(q_smem, q_ptr, b, s, h0, H, s_q_b, s_q_s, s_q_h, D, BD, BH, RC, ld_l)
                    if QROPE and not QTMA:                      # (QTMA: q_full once it landed, _ws_q_ready)
                        cp.commit_group()                       # waited for after the first tile's gather
                    elif not QTMA:
                        cp.mbarrier_arrive(q_full, increment_count=False)
                        qn += 1
                if QPRO and QFIRST and (QROPE or QTMA) and t == 0:     # q's prologue before the first tile waits
                    _ws_q_ready(q_smem, inv_smem, q_full, qpos_ptr, qfreq_ptr, q_eps, b * S + s, D, BD, BH, QRF,
                                QTW, STC, q_tma, qn & 1, QROPE, QTMA, PROBE)    # for its slot (QK1: held by warpgroup
                    qn += 1                                             # 1's output store)
                    _ws_stamp(trace_ptr, item, 11, TRACE)
                slot = g % NBUF
                pk_smem.store(rows)
                rows = _picks(t + 1, n1, idx1, J1, idx2, J2, BN, one_l, TWO)    # the next tile's, ahead
                if t == 1:
                    _ws_stamp(trace_ptr, item, 14, TRACE)
                mbarrier.wait(kv_empty.index(slot), ((g // NBUF) & 1) ^ 1)
                if t == 1:
                    _ws_stamp(trace_ptr, item, 12, TRACE)
                buf = k_smem.index(slot)
                if PROBE != 5:                                  # (probe 5, profiling: no gathers)
                    for c in gl.static_range(4):
                        r = pk_smem.slice(c * RC, RC).load(rows_l)
                        _gather(t, n1, kv1, s_k1_m, kv2, s_k2_m, r, buf.slice(c * RC, RC), D, BD, ld_l, TWO)
                cp.mbarrier_arrive(kv_full.index(slot), increment_count=False)
                g += 1
                if t == 0:
                    _ws_stamp(trace_ptr, item, 10, TRACE)
                if (not QPRO) and QFIRST and (QROPE or QTMA) and t == 0:   # q's prologue once its copies landed
                    _ws_q_ready(q_smem, inv_smem, q_full, qpos_ptr, qfreq_ptr, q_eps, b * S + s, D, BD, BH, QRF,
                                QTW, STC, q_tma, qn & 1, QROPE, QTMA, PROBE)    # (the tile's copies, not in a group,
                                                                                # travel)
                    qn += 1
                    _ws_stamp(trace_ptr, item, 11, TRACE)
                if (not QFIRST) and t == 0:
                    mbarrier.wait(q_empty, (qn & 1) ^ 1)
                    if PROBE != 4:
                        _ws_q(q_smem, q_ptr, b, s, h0, H, s_q_b, s_q_s, s_q_h, D, BD, BH, RC, ld_l)
                    if QROPE:                                   # q's norm factors and RoPE, here, off the math's
                        cp.commit_group()                       # path
                        _ws_q_ready(q_smem, inv_smem, q_full, qpos_ptr, qfreq_ptr, q_eps, b * S + s, D, BD, BH, QRF,
                                    QTW, STC, q_tma, 0, True, False, PROBE)
                    else:
                        cp.mbarrier_arrive(q_full, increment_count=False)
                    qn += 1
            _ws_stamp(trace_ptr, item, 13, TRACE)

    @gluon.jit
    def _ws_picks_load(idx_row, J, JC: gl.constexpr, layout: gl.constexpr, on):
        # a query's picks, loaded one item ahead (their count is only needed at the next item's start)
        jj = gl.arange(0, JC, layout=layout)
        return gl.load(idx_row + jj, mask=(jj < J) & on, other=-1)

    @gluon.jit
    def _ws_tiles(picks, BN: gl.constexpr, JC: gl.constexpr, layout: gl.constexpr):
        jj = gl.arange(0, JC, layout=layout)
        return gl.cdiv(gl.max(gl.where(picks.to(gl.int32) >= 0, jj + 1, 0), axis=0), BN)

    @gluon.jit
    def _ws_begin(a, item, pf1, pf2, PREF: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, JC: gl.constexpr,
                  TWO: gl.constexpr, one_l: gl.constexpr):
        # (the math partition; QK1: both math warpgroups) an item's coordinates and tile counts (PREF: from the picks
        # loaded one item ahead, and the next item's loaded)
        (q_ptr, kv1_ptr, idx1_ptr, kv2_ptr, idx2_ptr, S, H, HB, n_items, J1, J2, s_q_b, s_q_s, s_q_h, s_k1_b,
         s_k1_m, s_i1_b, s_i1_s, s_k2_b, s_k2_m, s_i2_b, s_i2_s, q_smem, k_smem, pk_smem, q_full, q_empty,
         kv_full, kv_empty, trace_ptr) = a
        G = gl.num_programs(0)
        b, s, h0 = _ws_item(item, HB, S, BH)
        idx1 = idx1_ptr + b * s_i1_b + s * s_i1_s
        idx2 = idx2_ptr + b * s_i2_b + s * s_i2_s
        if PREF:
            n1 = _ws_tiles(pf1, BN, JC, one_l)
            nt = n1
            if TWO:
                nt = n1 + _ws_tiles(pf2, BN, JC, one_l)
            nb, ns, _h = _ws_item(item + G, HB, S, BH)
            on = item + G < n_items
            pf1 = _ws_picks_load(idx1_ptr + nb * s_i1_b + ns * s_i1_s, J1, JC, one_l, on)
            if TWO:
                pf2 = _ws_picks_load(idx2_ptr + nb * s_i2_b + ns * s_i2_s, J2, JC, one_l, on)
        else:
            n1, nt = _ws_counts(idx1, J1, idx2, J2, BN, JC, one_l, TWO)
        return b, s, h0, idx1, idx2, n1, nt, pf1, pf2

    @gluon.jit
    def _ws_picks_start(a, PREF: gl.constexpr, BH: gl.constexpr, JC: gl.constexpr, TWO: gl.constexpr,
                        one_l: gl.constexpr):
        # (PREF) the first item's picks; without PREF, placeholders _ws_begin passes through
        (q_ptr, kv1_ptr, idx1_ptr, kv2_ptr, idx2_ptr, S, H, HB, n_items, J1, J2, s_q_b, s_q_s, s_q_h, s_k1_b,
         s_k1_m, s_i1_b, s_i1_s, s_k2_b, s_k2_m, s_i2_b, s_i2_s, q_smem, k_smem, pk_smem, q_full, q_empty,
         kv_full, kv_empty, trace_ptr) = a
        pf1 = gl.full([JC], -1, gl.int32, one_l)
        pf2 = pf1
        if PREF:
            b, s, h0 = _ws_item(gl.program_id(0), HB, S, BH)
            pf1 = _ws_picks_load(idx1_ptr + b * s_i1_b + s * s_i1_s, J1, JC, one_l, True)
            if TWO:
                pf2 = _ws_picks_load(idx2_ptr + b * s_i2_b + s * s_i2_s, J2, JC, one_l, True)
        return pf1, pf2

    @gluon.jit
    def _ws_math(a, o_ptr, sink_ptr, qk_scale, s_o_b, s_o_s, s_o_h, opos_ptr, ofreq_ptr, sc_ptr, M,
                 D: gl.constexpr, BD: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr,
                 TWO: gl.constexpr, JC: gl.constexpr, PREF: gl.constexpr, EPI: gl.constexpr, QFIRST: gl.constexpr,
                 PROBE: gl.constexpr, RF: gl.constexpr, OROPE: gl.constexpr, FP8: gl.constexpr, STC: gl.constexpr,
                 QROPE: gl.constexpr, inv_smem, TRACE: gl.constexpr, ORS: gl.constexpr, LSPLIT: gl.constexpr,
                 QDZ: gl.constexpr):
        (q_ptr, kv1_ptr, idx1_ptr, kv2_ptr, idx2_ptr, S, H, HB, n_items, J1, J2, s_q_b, s_q_s, s_q_h, s_k1_b,
         s_k1_m, s_i1_b, s_i1_s, s_k2_b, s_k2_m, s_i2_b, s_i2_s, q_smem, k_smem, pk_smem, q_full, q_empty,
         kv_full, kv_empty, trace_ptr) = a
        dt: gl.constexpr = q_ptr.dtype.element_ty
        qk_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BN // 2, 16])
        pv_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BD // 2, 16])
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=pv_l, k_width=2)
        one_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[8],
                                               order=[0])
        # the output's store: 16-byte vectors along d, STC threads of a warp along a row (BD / 8 up to 32: no
        # element held twice, which the epilogue's split / join of channel pairs needs)
        st_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // STC, STC],
                                              warps_per_cta=[8, 1], order=[1, 0])
        cols_l: gl.constexpr = gl.SliceLayout(0, qk_l)
        s_zero = gl.zeros([BH, BN], gl.float32, qk_l)
        G = gl.num_programs(0)
        g = 0
        qn = 0
        pf1, pf2 = _ws_picks_start(a, PREF, BH, JC, TWO, one_l)
        for item in range(gl.program_id(0), n_items, G):
            _ws_stamp(trace_ptr, item, 7, TRACE)
            _ws_stamp(trace_ptr, item, 0, TRACE)
            b, s, h0, idx1, idx2, n1, nt, pf1, pf2 = _ws_begin(a, item, pf1, pf2, PREF, BH, BN, JC, TWO, one_l)
            qs = gl.full([BH], qk_scale, gl.float32, gl.SliceLayout(1, qk_l))   # the heads' score scales
            if QROPE:                                                   # q's norm factors (the loader's _ws_q_prep)
                if nt > 0:
                    mbarrier.wait(q_full, qn & 1)
                    _ws_stamp(trace_ptr, item, 1, TRACE)
                    qs = qk_scale * inv_smem.load(gl.SliceLayout(1, qk_l))
            ok_n = _picks(0, n1, idx1, J1, idx2, J2, BN, cols_l, TWO) >= 0
            hm = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, qk_l))
            m_i = gl.load(sink_ptr + hm, mask=hm < H, other=0.0).to(gl.float32) * 1.4426950408889634
            l_i = _l_start(s_zero, LSPLIT)
            acc = warpgroup_mma_init(gl.zeros([BH, BD], gl.float32, pv_l))
            if (not QROPE) and nt > 0:
                mbarrier.wait(q_full, qn & 1)
                _ws_stamp(trace_ptr, item, 1, TRACE)
            for t in range(0, nt):
                slot = g % NBUF
                buf = k_smem.index(slot)
                mbarrier.wait(kv_full.index(slot), (g // NBUF) & 1)
                fence_async_shared()                                    # the copies' writes, to the async proxy
                q_t = q_smem
                if QDZ:     # q by an index the compiler cannot prove constant (g >> 30 is 0): the QK's descriptors
                    q_t = q_smem._reinterpret(dt, [1, BH, BD], q_smem.type.layout).index(g >> 30)    # not hoisted
                sc = warpgroup_mma(q_t, buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                acc, sc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, sc))   # PV(t-1) and QK(t) done
                if t == 0:
                    _ws_stamp(trace_ptr, item, 2, TRACE)
                if t == nt - 1:
                    _ws_stamp(trace_ptr, item, 6, TRACE)
                _cta_barrier()                                          # ... in both warpgroups
                mbarrier.arrive(kv_empty.index((g + NBUF - 1) % NBUF), pred=t > 0)
                mbarrier.arrive(q_empty, pred=t == nt - 1)
                g += 1
                ok = ok_n
                ok_n = _picks(t + 1, n1, idx1, J1, idx2, J2, BN, cols_l, TWO) >= 0

                if PROBE == 7:                                  # (probe 7, profiling: no softmax, P = the scores)
                    p_op = gl.convert_layout(sc.to(dt), p_l)
                    a_pv = gl.full([BH], 1.0, gl.float32, gl.SliceLayout(1, pv_l))
                elif QROPE:
                    p_op, a_pv, m_i, l_i = _softmax_step(sc, ok, m_i, l_i, qs[:, None], dt, pv_l, p_l, LSPLIT)
                else:
                    p_op, a_pv, m_i, l_i = _softmax_step(sc, ok, m_i, l_i, qk_scale, dt, pv_l, p_l, LSPLIT)
                if PROBE == 6:                                  # (probe 6, profiling: no PV)
                    acc = warpgroup_mma_init(acc * a_pv[:, None])
                else:
                    acc = warpgroup_mma(p_op, buf, acc * a_pv[:, None], is_async=True)
            l_pv = _l_total(l_i, pv_l, LSPLIT)                          # (while the last PV runs)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            o_row = o_ptr + b * s_o_b + s * s_o_s
            if EPI:
                if nt > 0:
                    # through the last tile's buffer (the math partition still holds it), then 16-byte stores
                    # along d: a warp writes 512 contiguous bytes a store, where the accumulator's layout writes 8
                    # rows x 16 bytes
                    last = k_smem.index((g + NBUF - 1) % NBUF)
                    _cta_barrier()
                    last.store((acc / l_pv[:, None]).to(dt))
                    _cta_barrier()
                    _ws_stamp(trace_ptr, item, 3, TRACE)
                    if OROPE and ORS:                                   # the output's inverse RoPE on its tail only,
                        TW: gl.constexpr = (RF + 63) // 64 * 64         # in shared memory (whole swizzle columns)
                        TPC: gl.constexpr = TW // 8 if TW < 256 else 32
                        rt_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8],
                                                              threads_per_warp=[32 // TPC, TPC], warps_per_cta=[8, 1],
                                                              order=[1, 0])
                        c, sn = _rope_cs(opos_ptr + b * S + s, ofreq_ptr, TW, RF - TW, RF, True,
                                         gl.SliceLayout(0, rt_l), 8)
                        _rotate_rows(last.slice(D - TW, TW, dim=1), c, sn, BH, 8 * (32 // TPC), TW, rt_l)
                        _cta_barrier()
                    ov = last.load(st_l)
                    _cta_barrier()
                    mbarrier.arrive(kv_empty.index((g + NBUF - 1) % NBUF))
                    qn += 1
                else:                                                   # no valid pick: the output is 0
                    ov = gl.zeros([BH, BD], dt, st_l)
                _ws_stamp(trace_ptr, item, 4, TRACE)
                if PROBE != 3 and PROBE != 9:
                    # with ORS an item with picks had its RoPE above; an item with none (zeros) still takes the
                    # rotation here, as the chain rounds it (a run-time flag: both paths are compiled)
                    _ws_store(ov, o_row, h0, H, s_o_h, b * S + s, M, opos_ptr, ofreq_ptr, sc_ptr, D, BD, BH, RF,
                              OROPE and not (ORS and nt > 0), FP8, st_l, 0, 8)
                _ws_stamp(trace_ptr, item, 5, TRACE)
            else:
                o = (acc / l_pv[:, None]).to(o_ptr.dtype.element_ty)
                if nt > 0:
                    _cta_barrier()
                    mbarrier.arrive(kv_empty.index((g + NBUF - 1) % NBUF))
                    qn += 1
                ho = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, pv_l))
                do = gl.arange(0, BD, layout=gl.SliceLayout(0, pv_l))
                if PROBE != 3 and PROBE != 9:
                    gl.store(o_row + ho.to(gl.int64)[:, None] * s_o_h + do[None, :], o,
                             mask=(ho < H)[:, None] & (do < D)[None, :])

    @gluon.jit
    def _rope_cs(pos_p, freq_ptr, N: gl.constexpr, CT0: gl.constexpr, RF: gl.constexpr, INVERSE: gl.constexpr,
                 out_l: gl.constexpr, NW: gl.constexpr):
        # cos and signed sin [N] of N consecutive channels whose first is channel CT0 of the rope tail (the last RF
        # channels of d; CT0 < 0: before the tail), in out_l (a row's channels, the heads broadcast along them).
        # Tail channel ct has angle pos * freq[ct // 2]; elsewhere cos 1 and sin 0. The sign: even channels x*cos -
        # x_odd*sin, odd ones x*cos + x_even*sin; INVERSE rotates by -angle. Computed N / 256 channels a thread and
        # then moved to out_l (NW warps): in a row's layout each thread would hold up to 16 of them, and cos / sin
        # cost ~40 instructions each.
        cs_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[NW],
                                              order=[0])
        ct = gl.arange(0, N, layout=cs_l) + CT0
        tail = (ct >= 0) & (ct < RF)
        ang = gl.load(pos_p).to(gl.float32) * gl.load(freq_ptr + gl.maximum(ct, 0) // 2, mask=tail, other=0.0)
        c = gl.where(tail, gl.cos(ang), 1.0)
        sn = gl.where(tail, gl.sin(ang), 0.0)
        if INVERSE:
            sn = -sn
        sn = gl.where((ct % 2) == 0, -sn, sn)
        return gl.convert_layout(c, out_l), gl.convert_layout(sn, out_l)

    @gluon.jit
    def _ws_q_ready(q_smem, inv_smem, q_full, qpos_ptr, qfreq_ptr, eps, row, D: gl.constexpr, BD: gl.constexpr,
                    BH: gl.constexpr, RF: gl.constexpr, TW: gl.constexpr, STC: gl.constexpr, q_tma, q_phase,
                    QROPE: gl.constexpr, QTMA: gl.constexpr, PROBE: gl.constexpr):
        # (loader) once q landed (QTMA: its TMA barrier's phase; else this thread's committed copies, and every
        # loader thread's): the prologue (QROPE), then q_full's 128 arrivals at once (after _ws_q_prep's closing
        # barrier: all of it written). (probes 8 and 9, profiling: no prologue, every head's factor 1)
        if QTMA:
            mbarrier.wait(q_tma, q_phase)
        else:
            cp.wait_group(0)
            _cta_barrier()
        if QROPE and (PROBE == 8 or PROBE == 9):
            inv_smem.store(gl.full([BH], 1.0, gl.float32, gl.BlockedLayout([1], [32], [4], [0])))
            _cta_barrier()
        elif QROPE:
            _ws_q_prep(q_smem, inv_smem, qpos_ptr, qfreq_ptr, eps, row, D, BD, BH, RF, TW, STC)
        mbarrier.arrive(q_full, count=128)

    @gluon.jit
    def _rotate_rows(tail, c, sn, BH: gl.constexpr, RT: gl.constexpr, TW: gl.constexpr, rt_l: gl.constexpr):
        # RoPE in place on a shared-memory tile's last TW channels [BH, TW], RT rows at a time: the pair partner
        # by a split / join within the thread, fma(x_swap, sn, x * c) in fp32 (as norm_rope pins it), rounded once
        # to the tile's dtype; c / sn from _rope_cs (sn signed, INVERSE there for the inverse rotation)
        for k in gl.static_range(BH // RT):
            part = tail.slice(k * RT, RT)
            x = part.load(rt_l)
            ev, od = gl.split(gl.reshape(x, [RT, TW // 2, 2]))
            xs = gl.convert_layout(gl.reshape(gl.join(od, ev), [RT, TW]), rt_l).to(gl.float32)
            part.store(gl.fma(xs, sn[None, :], x.to(gl.float32) * c[None, :]).to(x.dtype))

    @gluon.jit
    def _ws_q_prep(q_smem, inv_smem, qpos_ptr, qfreq_ptr, eps, row, D: gl.constexpr, BD: gl.constexpr,
                   BH: gl.constexpr, RF: gl.constexpr, TW: gl.constexpr, STC: gl.constexpr):
        # In the loader partition (4 warps), on the item's raw q [BH, BD] once it landed in shared memory: each
        # head's 1 / rms over its d channels (fp32) to inv_smem, which the math partition multiplies into the scale
        # of the head's scores, and the last RF channels rotated in place (RoPE by pos * freq, fp32, the multiply-
        # add fma(x_swap, -+sin, x * cos) as norm_rope pins it, rounded once to q's dtype). That is norm_rope(q)'s
        # math with the norm moved past the dot (a per-row factor of q is one of its scores), so ~1/8 of q is
        # rewritten, not all of it. It runs while the math partition finishes the last item, instead of on its
        # path. The sums: 8 channels a thread, STC threads along a row (a warp's shuffles). The rotation: the last
        # TW channels (whole 64-channel columns of the 128-byte swizzle).
        ss_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // STC, STC],
                                              warps_per_cta=[4, 1], order=[1, 0])
        RS: gl.constexpr = 8 * (32 // STC)                             # whole 8-row swizzle atoms
        for k in gl.static_range(BH // RS):
            xf = q_smem.slice(k * RS, RS).load(ss_l).to(gl.float32)
            inv_smem.slice(k * RS, RS).store(1.0 / gl.sqrt(gl.sum(xf * xf, axis=1) / D + eps))
        if RF > 0:
            _cta_barrier()                                              # every sum read q before it is rotated
            TPC: gl.constexpr = TW // 8 if TW < 256 else 32
            rt_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // TPC, TPC],
                                                  warps_per_cta=[4, 1], order=[1, 0])
            RT: gl.constexpr = 4 * (32 // TPC)
            c, sn = _rope_cs(qpos_ptr + row, qfreq_ptr, TW, RF - TW, RF, False, gl.SliceLayout(0, rt_l), 4)
            _rotate_rows(q_smem.slice(D - TW, TW, dim=1), c, sn, BH, RT, TW, rt_l)
            fence_async_shared()                                        # the rotated q, to the wgmma's proxy
        _cta_barrier()                                                  # the factors and the rotated q, written

    @gluon.jit
    def _ws_store(y, o_row, h0, H, s_o_h, row, M, opos_ptr, ofreq_ptr, sc_ptr, D: gl.constexpr, BD: gl.constexpr,
                  BH: gl.constexpr, RF: gl.constexpr, OROPE: gl.constexpr, FP8: gl.constexpr, st_l: gl.constexpr,
                  C0: gl.constexpr, NW: gl.constexpr):
        # The item's output y [BH, BD] (q's dtype, 8 channels a thread) to o_row, through the layer's steps after
        # the core as the unfused chain runs them (``core_kernel._epilogue`` is the same math, the same bits):
        # OROPE: the inverse RoPE of the last RF channels in fp32 (the pair partner by a split / join, within the
        # thread), rounded again; FP8: act_quant of each 128 channels: s = pow2_ceil(max(amax, 1e-4) / 448) by bit
        # ops, e4m3(y * (1 / s)) to o_row, s to sc_ptr[(h * D / 128 + block) * M + row]. y holds channels C0 .. C0 + BD
        # (the QK1 kernel: each warpgroup its half); NW: the warps of st_l.
        hs = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, st_l))
        ds = C0 + gl.arange(0, BD, layout=gl.SliceLayout(0, st_l))
        omask = (hs < H)[:, None] & (ds < D)[None, :]
        optr = o_row + hs.to(gl.int64)[:, None] * s_o_h + ds[None, :]
        if OROPE:
            x = y.to(gl.float32)
            ev, od = gl.split(gl.reshape(y, [BH, BD // 2, 2]))
            xs = gl.convert_layout(gl.reshape(gl.join(od, ev), [BH, BD]), st_l).to(gl.float32)
            tail = (ds >= D - RF) & (ds < D)
            c, sn = _rope_cs(opos_ptr + row, ofreq_ptr, BD, RF - D + C0, RF, True, gl.SliceLayout(0, st_l), NW)
            y = gl.where(tail[None, :], gl.fma(xs, sn[None, :], x * c[None, :]), x).to(y.dtype)
        if FP8:
            sc_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[8, 4],
                                                  warps_per_cta=[NW, 1], order=[1, 0])
            y3 = gl.reshape(y.to(gl.float32), [BH, BD // 128, 128])
            amax = gl.maximum(gl.max(gl.abs(y3), axis=2), 1e-4)
            sbits = (gl.div_rn(amax, 448.0).to(gl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000
            inv = (0x7F000000 - sbits).to(gl.float32, bitcast=True)    # 1 / s, exact (s a power of two)
            z = gl.convert_layout(gl.reshape(y3 * inv[:, :, None], [BH, BD]), st_l)
            gl.store(optr, z.to(gl.float8e4nv, fp_downcast_rounding="rtne"), mask=omask)
            sb = gl.convert_layout(sbits, sc_l)
            hb = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, sc_l))
            blk = C0 // 128 + gl.arange(0, BD // 128, layout=gl.SliceLayout(0, sc_l))
            gl.store(sc_ptr + (hb[:, None] * (D // 128) + blk[None, :]).to(gl.int64) * M + row,
                     sb.to(gl.float32, bitcast=True), mask=(hb < H)[:, None] & (blk < D // 128)[None, :])
        else:
            gl.store(optr, y, mask=omask)

    @gluon.jit(do_not_specialize=["S", "H", "J1", "J2", "n_items", "M"])
    def _sparse_core_ws(q_ptr, o_ptr, sink_ptr, kv1_ptr, idx1_ptr, kv2_ptr, idx2_ptr, opos_ptr, ofreq_ptr, sc_ptr,
                        qpos_ptr, qfreq_ptr, q_eps, trace_ptr,
                        S, H, J1, J2, n_items, M, qk_scale, s_q_b, s_q_s, s_q_h, s_o_b, s_o_s, s_o_h, s_k1_b, s_k1_m,
                        s_i1_b, s_i1_s, s_k2_b, s_k2_m, s_i2_b, s_i2_s,
                        D: gl.constexpr, BD: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr,
                        NBUF: gl.constexpr, TWO: gl.constexpr, JC: gl.constexpr, LOAD_REGS: gl.constexpr,
                        PREF: gl.constexpr, EPI: gl.constexpr, QFIRST: gl.constexpr, PROBE: gl.constexpr,
                        RF: gl.constexpr, OROPE: gl.constexpr, FP8: gl.constexpr, STC: gl.constexpr,
                        QROPE: gl.constexpr, QRF: gl.constexpr, QTW: gl.constexpr, TRACE: gl.constexpr,
                        ORS: gl.constexpr, q_desc, QTMA: gl.constexpr, LSPLIT: gl.constexpr, QDZ: gl.constexpr,
                        QPRO: gl.constexpr, num_warps: gl.constexpr):
        gl.static_assert(num_warps == 8, "two math warpgroups")
        dt: gl.constexpr = q_ptr.dtype.element_ty
        sm_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        q_smem = gl.allocate_shared_memory(dt, [BH, BD], sm_l)
        k_smem = gl.allocate_shared_memory(dt, [NBUF, BN, BD], sm_l)
        pk_smem = gl.allocate_shared_memory(gl.int32, [BN], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        inv_smem = gl.allocate_shared_memory(gl.float32, [BH], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        q_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_tma = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        kv_full = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_full, count=128)                # the loader's threads (4 warps), each arriving once
        mbarrier.init(q_empty, count=1)
        mbarrier.init(q_tma, count=1)                   # (QTMA) the TMA's bytes
        for i in gl.static_range(NBUF):
            mbarrier.init(kv_full.index(i), count=128)
            mbarrier.init(kv_empty.index(i), count=1)
        HB = H // BH
        a = (q_ptr, kv1_ptr, idx1_ptr, kv2_ptr, idx2_ptr, S, H, HB, n_items, J1, J2, s_q_b, s_q_s, s_q_h,
             s_k1_b, s_k1_m, s_i1_b, s_i1_s, s_k2_b, s_k2_m, s_i2_b, s_i2_s, q_smem, k_smem, pk_smem, q_full,
             q_empty, kv_full, kv_empty, trace_ptr)
        gl.warp_specialize([
            (_ws_math, (a, o_ptr, sink_ptr, qk_scale, s_o_b, s_o_s, s_o_h, opos_ptr, ofreq_ptr, sc_ptr, M, D, BD,
                        BH, BN, NBUF, TWO, JC, PREF, EPI, QFIRST, PROBE, RF, OROPE, FP8, STC, QROPE, inv_smem,
                        TRACE, ORS, LSPLIT, QDZ)),
            (_ws_loader, (a, D, BD, BH, BN, NBUF, TWO, JC, QFIRST, PROBE, inv_smem, qpos_ptr, qfreq_ptr, q_eps,
                          QROPE, QRF, QTW, STC, TRACE, q_desc, q_tma, QTMA, QPRO)),
        ], [4], [LOAD_REGS])


    # ---- QK1: one math warpgroup computes every QK and the softmax, the other only its half of PV -------------
    # In the kernel above both math warpgroups compute each tile's QK, each for half of the keys (N = 32): each reads
    # all of q from shared memory (64 KB a tile each), and the row max, the row sum and P cross between them through
    # shared memory (12 barriers from QK to PV in the SASS). Here warpgroup 0 (the default partition) computes the
    # whole QK [64 heads x 64 keys] (N = 64, q read once), the softmax within its own rows (no exchange: a row lives in
    # one warp) and PV for the output's channels 0 .. d/2 with P from its registers; it hands P (bf16) and the rescale
    # alpha to warpgroup 1 through shared memory (a ring of two: p_ready / p_free), which runs PV for d/2 .. d.
    # Warpgroup 1's PV of tile t runs while warpgroup 0 computes QK(t + 1) and its softmax. The loader is the WS
    # kernel's (the same ring; a buffer is free once both warpgroups' PV of it are done: kv_empty counts 2). The sums
    # l stay in warpgroup 0 and reach warpgroup 1 at the item's end (l_ready, a ring of two by item). Each warpgroup
    # stages its half of the output in the last tile's buffer and stores it (the epilogue's steps as in the WS
    # kernel). Same math; the row sums add in another order (the scores, P and PV are the same products), so not
    # the WS kernel's bits, and the same bits on every run. The default for items of QK1_MIN_TILES tiles or more
    # (with W1OUT: V4-Flash's CSA core 795.7 against 874.4 us for the WS kernel, session 18).

    @gluon.jit
    def _q1_out(k_smem, last, kv_empty, nt, W: gl.constexpr, o_row, h0, H, s_o_h, row, M, opos_ptr, ofreq_ptr,
                sc_ptr, D: gl.constexpr, BD: gl.constexpr, BH: gl.constexpr, RF: gl.constexpr, OROPE: gl.constexpr,
                FP8: gl.constexpr, ORS: gl.constexpr, dt: gl.constexpr, FULL: gl.constexpr, PROBE: gl.constexpr):
        # (math warpgroup W) its half of the item's output, staged in the last tile's buffer, to o_row: 32 heads at
        # a time (a thread's 8 rows x 8 channels, not 16 rows: the FP8 epilogue's registers), the buffer released
        # (this warpgroup's part) once read; an item with no valid pick writes zeros (their RoPE is 0 as well).
        # FULL (W1OUT, warpgroup 1): both halves, 16 heads at a time, the buffer released for both warpgroups.
        BDH: gl.constexpr = BD // 2
        st_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[1, 32], warps_per_cta=[4, 1],
                                              order=[1, 0])
        if FULL:
            for r in gl.static_range(4):
                if nt > 0:
                    ov = k_smem.index(last).slice(r * (BH // 4), BH // 4).load(st_l)
                    if r == 3:
                        _cta_barrier()
                        mbarrier.arrive(kv_empty.index(last), count=2)
                else:
                    ov = gl.zeros([BH // 4, BD], dt, st_l)
                if PROBE != 3 and PROBE != 9:                   # (probes 3 and 9, profiling: no output store)
                    _ws_store(ov, o_row, h0 + r * (BH // 4), H, s_o_h, row, M, opos_ptr, ofreq_ptr, sc_ptr, D, BD,
                              BH // 4, RF, OROPE and not ORS, FP8, st_l, 0, 4)
        else:
            for r in gl.static_range(2):
                if nt > 0:
                    ov = k_smem.index(last).slice(W * BDH, BDH, dim=1).slice(r * (BH // 2), BH // 2).load(st_l)
                    if r == 1:
                        _cta_barrier()
                        mbarrier.arrive(kv_empty.index(last))
                else:
                    ov = gl.zeros([BH // 2, BDH], dt, st_l)
                if PROBE != 3 and PROBE != 9:
                    _ws_store(ov, o_row, h0 + r * (BH // 2), H, s_o_h, row, M, opos_ptr, ofreq_ptr, sc_ptr, D, BDH,
                              BH // 2, RF, OROPE and (W == 1) and not ORS, FP8, st_l, W * BDH, 4)

    @gluon.jit
    def _q1_math0(a, x, o_ptr, sink_ptr, qk_scale, s_o_b, s_o_s, s_o_h, opos_ptr, ofreq_ptr, sc_ptr, M,
                  D: gl.constexpr, BD: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr,
                  TWO: gl.constexpr, JC: gl.constexpr, PREF: gl.constexpr, RF: gl.constexpr, OROPE: gl.constexpr,
                  FP8: gl.constexpr, QROPE: gl.constexpr, inv_smem, TRACE: gl.constexpr, ORS: gl.constexpr,
                  W1OUT: gl.constexpr, PROBE: gl.constexpr):
        # math warpgroup 0: QK, the softmax, PV for channels 0 .. d/2. It counts an item's tiles at the item's start
        # (PREF off here: the next item's picks held in registers through an item took 16 of them, and the tile
        # loop spilled 49 values; without them 7)
        (q_ptr, kv1_ptr, idx1_ptr, kv2_ptr, idx2_ptr, S, H, HB, n_items, J1, J2, s_q_b, s_q_s, s_q_h, s_k1_b,
         s_k1_m, s_i1_b, s_i1_s, s_k2_b, s_k2_m, s_i2_b, s_i2_s, q_smem, k_smem, pk_smem, q_full, q_empty,
         kv_full, kv_empty, trace_ptr) = a
        (sP, sA, sL, p_ready, p_free, l_ready) = x
        dt: gl.constexpr = q_ptr.dtype.element_ty
        BDH: gl.constexpr = BD // 2
        qk_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BN, 16])
        pv_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BDH, 16])
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=pv_l, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, qk_l)
        cols_l: gl.constexpr = gl.SliceLayout(0, qk_l)
        one_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[4],
                                               order=[0])
        s_zero = gl.zeros([BH, BN], gl.float32, qk_l)
        pf1, pf2 = _ws_picks_start(a, False, BH, JC, TWO, one_l)
        g = 0
        qn = 0
        for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
            _ws_stamp(trace_ptr, item, 7, TRACE)
            _ws_stamp(trace_ptr, item, 0, TRACE)
            b, s, h0, idx1, idx2, n1, nt, pf1, pf2 = _ws_begin(a, item, pf1, pf2, False, BH, BN, JC, TWO, one_l)
            qs = gl.full([BH], qk_scale, gl.float32, row_l)
            if nt > 0:
                mbarrier.wait(q_full, qn & 1)
                _ws_stamp(trace_ptr, item, 1, TRACE)
                if QROPE:
                    qs = qk_scale * inv_smem.load(row_l)
            ok_n = _picks(0, n1, idx1, J1, idx2, J2, BN, cols_l, TWO) >= 0
            hm = h0 + gl.arange(0, BH, layout=row_l)
            m_i = gl.load(sink_ptr + hm, mask=hm < H, other=0.0).to(gl.float32) * 1.4426950408889634
            l_i = gl.full([BH], 1.0, gl.float32, row_l)
            acc = warpgroup_mma_init(gl.zeros([BH, BDH], gl.float32, pv_l))
            for t in range(0, nt):
                slot = g % NBUF
                buf = k_smem.index(slot)
                mbarrier.wait(kv_full.index(slot), (g // NBUF) & 1)
                fence_async_shared()
                # q by an index the compiler cannot prove constant (g >> 30 is 0): with a constant one it hoists the
                # QK's 32 descriptors (64-bit) out of the loops and spills them
                q_t = q_smem._reinterpret(dt, [1, BH, BD], q_smem.type.layout).index(g >> 30)
                sc = warpgroup_mma(q_t, buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                acc, sc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, sc))   # PV(t-1) of this half, QK(t)
                if t == 0:
                    _ws_stamp(trace_ptr, item, 2, TRACE)
                if t == nt - 1:
                    _ws_stamp(trace_ptr, item, 6, TRACE)
                _cta_barrier()
                mbarrier.arrive(kv_empty.index((g + NBUF - 1) % NBUF), pred=t > 0)   # this half's PV(t-1) is done
                mbarrier.arrive(q_empty, pred=t == nt - 1)
                ok = ok_n
                ok_n = _picks(t + 1, n1, idx1, J1, idx2, J2, BN, cols_l, TWO) >= 0
                sc = gl.where(ok[None, :], sc * qs[:, None], float("-inf"))
                m_new = gl.maximum(m_i, gl.max(sc, axis=1))
                alpha = gl.exp2(m_i - m_new)
                p = gl.exp2(sc - m_new[:, None])
                l_i = l_i * alpha + gl.sum(p, axis=1)
                m_i = m_new
                pb = p.to(dt)
                pr = g % 2                                          # P and alpha to warpgroup 1, in a ring of two
                mbarrier.wait(p_free.index(pr), ((g // 2) & 1) ^ 1)
                sP.index(pr).store(pb)
                if pr == 0:
                    sA[0].store(alpha)
                else:
                    sA[1].store(alpha)
                fence_async_shared()
                _cta_barrier()
                mbarrier.arrive(p_ready.index(pr))
                acc = warpgroup_mma(gl.convert_layout(pb, p_l), buf.slice(0, BDH, dim=1),
                                    acc * gl.convert_layout(alpha, gl.SliceLayout(1, pv_l))[:, None], is_async=True)
                g += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            last = (g + NBUF - 1) % NBUF
            if nt > 0:
                if qn % 2 == 0:                                     # l to warpgroup 1 (a ring of two by item)
                    sL[0].store(l_i)
                else:
                    sL[1].store(l_i)
                if not W1OUT:                                       # (W1OUT: once this half is staged as well)
                    _cta_barrier()
                    mbarrier.arrive(l_ready.index(qn % 2))
                k_smem.index(last).slice(0, BDH, dim=1).store(
                    (acc / gl.convert_layout(l_i, gl.SliceLayout(1, pv_l))[:, None]).to(dt))
                _cta_barrier()
                if W1OUT:
                    mbarrier.arrive(l_ready.index(qn % 2))
                _ws_stamp(trace_ptr, item, 3, TRACE)
                qn += 1
            _ws_stamp(trace_ptr, item, 4, TRACE)
            if not W1OUT:                                           # (W1OUT: warpgroup 1 stores the whole output)
                _q1_out(k_smem, last, kv_empty, nt, 0, o_ptr + b * s_o_b + s * s_o_s, h0, H, s_o_h, b * S + s, M,
                        opos_ptr, ofreq_ptr, sc_ptr, D, BD, BH, RF, OROPE, FP8, ORS, dt, False, PROBE)
            _ws_stamp(trace_ptr, item, 5, TRACE)

    @gluon.jit
    def _q1_math1(a, x, o_ptr, sink_ptr, qk_scale, s_o_b, s_o_s, s_o_h, opos_ptr, ofreq_ptr, sc_ptr, M,
                  D: gl.constexpr, BD: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr,
                  TWO: gl.constexpr, JC: gl.constexpr, PREF: gl.constexpr, RF: gl.constexpr, OROPE: gl.constexpr,
                  FP8: gl.constexpr, QROPE: gl.constexpr, inv_smem, TRACE: gl.constexpr, ORS: gl.constexpr,
                  W1OUT: gl.constexpr, PROBE: gl.constexpr):
        # math warpgroup 1: PV for channels d/2 .. d, with warpgroup 0's P and alpha
        (q_ptr, kv1_ptr, idx1_ptr, kv2_ptr, idx2_ptr, S, H, HB, n_items, J1, J2, s_q_b, s_q_s, s_q_h, s_k1_b,
         s_k1_m, s_i1_b, s_i1_s, s_k2_b, s_k2_m, s_i2_b, s_i2_s, q_smem, k_smem, pk_smem, q_full, q_empty,
         kv_full, kv_empty, trace_ptr) = a
        (sP, sA, sL, p_ready, p_free, l_ready) = x
        dt: gl.constexpr = q_ptr.dtype.element_ty
        BDH: gl.constexpr = BD // 2
        pv_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BDH, 16])
        prow_l: gl.constexpr = gl.SliceLayout(1, pv_l)
        one_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[4],
                                               order=[0])
        pf1, pf2 = _ws_picks_start(a, PREF, BH, JC, TWO, one_l)
        g = 0
        qn = 0
        for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
            b, s, h0, idx1, idx2, n1, nt, pf1, pf2 = _ws_begin(a, item, pf1, pf2, PREF, BH, BN, JC, TWO, one_l)
            acc = gl.zeros([BH, BDH], gl.float32, pv_l)
            for t in range(0, nt):
                slot = g % NBUF
                pr = g % 2
                mbarrier.wait(p_ready.index(pr), (g // 2) & 1)      # (so tile t landed: warpgroup 0 waited for it)
                fence_async_shared()
                if pr == 0:
                    alpha = sA[0].load(prow_l)
                else:
                    alpha = sA[1].load(prow_l)
                acc = warpgroup_mma(sP.index(pr), k_smem.index(slot).slice(BDH, BDH, dim=1), acc * alpha[:, None],
                                    is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                _cta_barrier()
                mbarrier.arrive(p_free.index(pr))
                mbarrier.arrive(kv_empty.index(slot), pred=t < nt - 1)    # (the last tile's: after the staging)
                g += 1
            last = (g + NBUF - 1) % NBUF
            if nt > 0:
                mbarrier.wait(l_ready.index(qn % 2), (qn // 2) & 1)
                if qn % 2 == 0:
                    l_i = sL[0].load(prow_l)
                else:
                    l_i = sL[1].load(prow_l)
                stage = k_smem.index(last).slice(BDH, BDH, dim=1)
                stage.store((acc / l_i[:, None]).to(dt))
                _cta_barrier()
                if OROPE and ORS:                                   # the output's inverse RoPE on its tail
                    TW: gl.constexpr = (RF + 63) // 64 * 64
                    TPC: gl.constexpr = TW // 8 if TW < 256 else 32
                    rt_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // TPC, TPC],
                                                          warps_per_cta=[4, 1], order=[1, 0])
                    c, sn = _rope_cs(opos_ptr + b * S + s, ofreq_ptr, TW, RF - TW, RF, True, gl.SliceLayout(0, rt_l), 4)
                    _rotate_rows(stage.slice(BDH - TW, TW, dim=1), c, sn, BH, 4 * (32 // TPC), TW, rt_l)
                    _cta_barrier()
                qn += 1
            _q1_out(k_smem, last, kv_empty, nt, 1, o_ptr + b * s_o_b + s * s_o_s, h0, H, s_o_h, b * S + s, M,
                    opos_ptr, ofreq_ptr, sc_ptr, D, BD, BH, RF, OROPE, FP8, ORS, dt, W1OUT, PROBE)
            _ws_stamp(trace_ptr, item, 15, TRACE)                   # (warpgroup 1's end of the item)

    @gluon.jit(do_not_specialize=["S", "H", "J1", "J2", "n_items", "M"])
    def _sparse_core_qk1(q_ptr, o_ptr, sink_ptr, kv1_ptr, idx1_ptr, kv2_ptr, idx2_ptr, opos_ptr, ofreq_ptr, sc_ptr,
                         qpos_ptr, qfreq_ptr, q_eps, trace_ptr,
                         S, H, J1, J2, n_items, M, qk_scale, s_q_b, s_q_s, s_q_h, s_o_b, s_o_s, s_o_h, s_k1_b,
                         s_k1_m, s_i1_b, s_i1_s, s_k2_b, s_k2_m, s_i2_b, s_i2_s,
                         D: gl.constexpr, BD: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr,
                         TWO: gl.constexpr, JC: gl.constexpr, LOAD_REGS: gl.constexpr, MATH_REGS: gl.constexpr,
                         PREF: gl.constexpr, RF: gl.constexpr, OROPE: gl.constexpr, FP8: gl.constexpr,
                         STC: gl.constexpr, QROPE: gl.constexpr, QRF: gl.constexpr, QTW: gl.constexpr,
                         TRACE: gl.constexpr, ORS: gl.constexpr, q_desc, QTMA: gl.constexpr, W1OUT: gl.constexpr,
                         QPRO: gl.constexpr, PROBE: gl.constexpr, num_warps: gl.constexpr):
        gl.static_assert(num_warps == 4, "the default partition is math warpgroup 0")
        dt: gl.constexpr = q_ptr.dtype.element_ty
        sm_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        f1_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        q_smem = gl.allocate_shared_memory(dt, [BH, BD], sm_l)
        k_smem = gl.allocate_shared_memory(dt, [NBUF, BN, BD], sm_l)
        pk_smem = gl.allocate_shared_memory(gl.int32, [BN], f1_l)
        inv_smem = gl.allocate_shared_memory(gl.float32, [BH], f1_l)
        sP = gl.allocate_shared_memory(dt, [2, BH, BN], sm_l)
        sA = (gl.allocate_shared_memory(gl.float32, [BH], f1_l), gl.allocate_shared_memory(gl.float32, [BH], f1_l))
        sL = (gl.allocate_shared_memory(gl.float32, [BH], f1_l), gl.allocate_shared_memory(gl.float32, [BH], f1_l))
        q_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_tma = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        kv_full = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        l_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_full, count=128)
        mbarrier.init(q_empty, count=1)                 # warpgroup 0, after its last QK of the item
        mbarrier.init(q_tma, count=1)
        for i in gl.static_range(NBUF):
            mbarrier.init(kv_full.index(i), count=128)
            mbarrier.init(kv_empty.index(i), count=2)   # both math warpgroups' PV of the tile done
        for i in gl.static_range(2):
            mbarrier.init(p_ready.index(i), count=1)
            mbarrier.init(p_free.index(i), count=1)
            mbarrier.init(l_ready.index(i), count=1)
        HB = H // BH
        x = (sP, sA, sL, p_ready, p_free, l_ready)
        a = (q_ptr, kv1_ptr, idx1_ptr, kv2_ptr, idx2_ptr, S, H, HB, n_items, J1, J2, s_q_b, s_q_s, s_q_h,
             s_k1_b, s_k1_m, s_i1_b, s_i1_s, s_k2_b, s_k2_m, s_i2_b, s_i2_s, q_smem, k_smem, pk_smem, q_full,
             q_empty, kv_full, kv_empty, trace_ptr)
        # (the partitions' arguments written out in the call: a tuple of them assigned to a name first would turn
        # the constexprs into tensors)
        gl.warp_specialize([
            (_q1_math0, (a, x, o_ptr, sink_ptr, qk_scale, s_o_b, s_o_s, s_o_h, opos_ptr, ofreq_ptr, sc_ptr, M, D, BD,
                         BH, BN, NBUF, TWO, JC, PREF, RF, OROPE, FP8, QROPE, inv_smem, TRACE, ORS, W1OUT, PROBE)),
            (_q1_math1, (a, x, o_ptr, sink_ptr, qk_scale, s_o_b, s_o_s, s_o_h, opos_ptr, ofreq_ptr, sc_ptr, M, D, BD,
                         BH, BN, NBUF, TWO, JC, PREF, RF, OROPE, FP8, QROPE, inv_smem, TRACE, ORS, W1OUT, PROBE)),
            (_ws_loader, (a, D, BD, BH, BN, NBUF, TWO, JC, True, PROBE, inv_smem, qpos_ptr, qfreq_ptr, q_eps, QROPE,
                          QRF, QTW, STC, TRACE, q_desc, q_tma, QTMA, QPRO)),
        ], [4, 4], [MATH_REGS, LOAD_REGS])


# the warp-specialized kernel's defaults (LSPLIT: the one-program kernel's too)
# (QK1: None picks it by the items' tile count, QK1_MIN_TILES; QDZ and QK1 with W1OUT measured in session 18:
# benchmarks/results/attn.md)
WS_OPTS = dict(PREF=True, EPI=True, QFIRST=True, ORS=True, QTMA=True, LSPLIT=False, QK1=None, QDZ=True,
               W1OUT=True, QPRO=False, MREGS=None)
QK1_MIN_TILES = 3       # the QK1 kernel where an item can have this many key tiles or more (bn keys a tile, every
                        # part): V4-Flash 4096, CSA's 10 tiles 795.7 against 874.4 us, HCA's 3 432.5 / 436.1,
                        # sliding's 2 371.7 / 352.7 (the WS kernel with QDZ; trace_core, layer mode)
QK1_MATH_REGS = 200     # the QK1 kernel's math warpgroup 1 (a worker partition): registers a thread; warpgroup 0 (the
                        # default partition) gets the rest of 12 x 168, (2016 - 4 x 200 - 4 x LOAD_REGS) / 4 = 248
                        # (compile_sm90, Triton 3.6: spill stores 28 at 224, 12 at 192-208; one H200, trace_core
                        # layer mode, session 20: CSA's core 787.2 against 790.4 us at 224, HCA's 423.1 / 427.9)


def _ws_opts(opts: dict | None, J1: int, J2: int, JC: int, q, out, probe: int, fused: bool = False,
             bn: int = BN, nbuf: int = NBUF) -> dict:
    """The warp-specialized kernel's switches (benchmarks compare them): PREF, the math partition loads the next
    item's picks during this item (one load a part: needs J <= JC); EPI, the output goes out through shared memory
    in 16-byte stores (needs out in q's dtype; always on with a fused epilogue, which runs there); QFIRST, the
    loader issues an item's q before its first tile (with a q prologue, the loader runs it once the q copies
    landed, after issuing the first tile's gather); ORS, the output's inverse RoPE runs on its staged tail in
    shared memory (the last RF channels, rounded as before: the same bits), not on every channel in registers;
    QTMA, the loader issues q as one TMA copy (needs QFIRST and a contiguous, 16-byte aligned q; else cp.async,
    32 copies a thread); LSPLIT, the softmax's running sums kept by warpgroup (each over its half of a tile's keys)
    and added once, at the item's end: a tile's exchanges between the warpgroups go from three to two (another
    order of rounding; the one-program kernel takes the switch too, so that the two give the same bits). probe
    (profiling, wrong results): 3, no output store; 4, no q load; 5, no KV gathers
    (the loader only signals the tiles); 6, no PV; 7, no softmax (P is the scores); 8, no q prologue (the
    loader's sums and RoPE of q: every head's factor 1); 9, 3 and 8 together. QDZ: q's tile
    named by an index the compiler cannot prove constant, so that the QK's 32 descriptors are not hoisted out of
    the loops (spill stores 88 to 52 in the SASS; the same bits, 7-9 % faster on the H200). QK1, the QK1 kernel
    (``_sparse_core_qk1``: one math warpgroup computes every QK and the softmax, the other its half of PV; needs
    d = 512, 64-key tiles, a ring of two, EPI, QFIRST and no probe but 3, 8 or 9; the row sums add in another
    order than the kernels above, the same bits on every run); None (the default) takes it where an item can have
    QK1_MIN_TILES key tiles or more, counting every part. W1OUT (with QK1), warpgroup 1 stores the whole output
    (warpgroup 0 stages its half and goes on to the next item; the same bits). QPRO (with QFIRST): the loader runs
    q's prologue (its TMA's wait, the norm and RoPE) before it waits for the item's first tile slot, not after
    issuing that tile's gather (with QK1 and W1OUT the slot is held by warpgroup 1's output store; the same bits;
    measured in session 18: CSA's core -1.3 %, the others within noise, so off). MREGS: the QK1 kernel's registers
    for warpgroup 1 (None: QK1_MATH_REGS). (Q2, a QK1 kernel with two q buffers on 32-key tiles, was built and
    measured in session 20: correct, slower everywhere, removed; git 56eb3dd has it,
    benchmarks/results/attn.md its numbers.)"""
    o = dict(WS_OPTS, **(opts or {}))
    if fused and not o["EPI"]:
        raise ValueError("sparse_attention_gluon: o_rope / out_fp8 run in the EPI epilogue; EPI=False cannot take "
                         "them")
    o["PREF"] = bool(o["PREF"]) and max(J1, J2) <= JC
    o["EPI"] = fused or (bool(o["EPI"]) and out.dtype == q.dtype)
    o["QFIRST"] = bool(o["QFIRST"])
    o["ORS"] = bool(o["ORS"])
    o["LSPLIT"] = bool(o["LSPLIT"])
    o["QDZ"] = bool(o["QDZ"])
    o["W1OUT"] = bool(o["W1OUT"])
    o["QPRO"] = bool(o["QPRO"]) and o["QFIRST"]
    if o["QK1"] is None:
        o["QK1"] = -(-J1 // bn) + -(-J2 // bn) >= QK1_MIN_TILES
    o["QK1"] = (bool(o["QK1"]) and o["EPI"] and o["QFIRST"] and probe in (0, 3, 8, 9) and q.shape[-1] == 512
                and bn == 64 and nbuf == 2)
    o["QTMA"] = (bool(o["QTMA"]) and o["QFIRST"] and probe != 4 and q.is_contiguous() and q.data_ptr() % 16 == 0
                 and TensorDescriptor is not None)
    o["PROBE"] = probe
    return o


class WSUnavailable(RuntimeError):
    """A call with the steps around the core (q_rope / o_rope / scales) and ws=None, where the warp-specialized
    kernel cannot run: the caller runs the plain kernel and the steps as separate passes."""


# what a Gluon launch raises before anything runs, where a kernel does not compile with this Triton
COMPILE_ERRORS = (triton.compiler.errors.CompilationError, triton.runtime.errors.OutOfResources, AttributeError,
                  TypeError, NotImplementedError) if triton is not None else ()


def sparse_attention_gluon(q: torch.Tensor, out: torch.Tensor, sinks: torch.Tensor, kv1: torch.Tensor,
                           i1: torch.Tensor, kv2: torch.Tensor, i2: torch.Tensor, scale: float, two: bool, *,
                           bn: int = BN, nbuf: int = NBUF, probe: int = 0, ws: bool | None = None,
                           load_regs: int = LOAD_REGS, programs: int | None = None, opts: dict | None = None,
                           o_rope: tuple | None = None, scales: torch.Tensor | None = None,
                           q_rope: tuple | None = None, trace: torch.Tensor | None = None) -> None:
    """Launch on checked, last-dim-contiguous tensors (``core_kernel.sparse_attention_fused`` prepares them):
    q / out [B, S, H, d], kv [B, M, d] in q's dtype, idx [B, S, J] (integers), sinks [H] (fp32, bf16 or fp16,
    read widened). bn / nbuf: keys per tile and tiles in the ring (benchmarks; q and the ring must fit in shared
    memory). probe (profiling
    only, wrong results): 1 skips the gathers after the first tiles, 2 the PV products. ws: the
    warp-specialized persistent kernel (default: where ``ws_supported`` says it runs; if it does not compile
    there, ``mark_ws_broken`` warns once and the one-program kernel runs, or with o_rope / scales
    ``WSUnavailable`` tells the caller to run the steps as passes); load_regs: its loader's registers a thread;
    programs: its grid (default: one program per SM); trace (profiling, same results; int32 [items, 16], items =
    B * S * H / 64): the warp-specialized kernel writes each item's timeline there (``_ws_stamp``'s columns,
    ``dev/trace_core.py`` reads them).

    The warp-specialized kernel also runs the layer's steps after the core in its epilogue, with the bits of the
    unfused chain (``core_kernel._epilogue``'s math): o_rope = (pos [B*S], freq fp32 [F]): the inverse RoPE of the
    last 2F channels; scales (fp32 [H*d/128, B*S]): out is e4m3 and gets ``act_quant``'s format. And the step
    before it, as the item's q arrives (``_ws_q_prep``): q_rope = (pos [B*S], freq fp32 [F], eps): q is raw and
    gets ``kernels.norm_rope(q, pos, freq, eps=eps)``'s per-head RMSNorm and RoPE, the norm as a factor of the
    head's scores (not rounded into q: within bf16 rounding of the chain, not its bits)."""
    B, S, H, D = q.shape
    J1, J2 = i1.shape[-1], (i2.shape[-1] if two else 0)
    fused = o_rope is not None or scales is not None or q_rope is not None
    default_ws = ws is None
    if ws is None:
        ws = probe == 0 and ws_supported(J1, J2, bn)
        if fused and not ws:
            raise WSUnavailable(_WS_BROKEN or f"bn={bn}")
    elif ws and probe in (1, 2):
        raise ValueError(f"sparse_attention_gluon: probe={probe} is the one-program-per-item kernel's")
    if fused and not ws:
        raise ValueError("sparse_attention_gluon: q_rope / o_rope / scales need the warp-specialized kernel (ws)")
    if trace is not None and not (ws and trace.dtype == torch.int32 and trace.is_contiguous()
                                  and trace.shape == (B * S * (H // BH), 16)):
        raise ValueError(f"sparse_attention_gluon: trace must be a contiguous int32 [{B * S * (H // BH)}, 16] tensor "
                         f"and needs the warp-specialized kernel (ws), got {tuple(trace.shape)} {trace.dtype}, "
                         f"ws={ws}")
    if scales is not None and D % 128:
        raise ValueError(f"sparse_attention_gluon: an FP8 output needs d={D} a multiple of 128")
    JC = picks_chunk(J1, J2, bn)
    args = (S, H, J1, J2)
    strides = (q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
               kv1.stride(0), kv1.stride(1), i1.stride(0), i1.stride(1), kv2.stride(0), kv2.stride(1), i2.stride(0),
               i2.stride(1))
    if ws:
        n_items = B * S * (H // BH)
        grid = min(n_items, programs or _sm_count(q.device.index))
        opos, ofreq = o_rope if o_rope is not None else (sinks, sinks)     # (unused without o_rope)
        qpos, qfreq, q_eps = q_rope if q_rope is not None else (sinks, sinks, 0.0)
        qrf = 2 * qfreq.numel() if q_rope is not None else 0
        qtw = min(D, -(-max(qrf, 1) // 64) * 64)       # the rotated channels: whole 64-channel swizzle columns
        wo = _ws_opts(opts, J1, J2, JC, q, out, probe, o_rope is not None or scales is not None, bn, nbuf)
        q_desc = TensorDescriptor.from_tensor(q.view(B * S * H, D), [BH, D], _Q_SMEM) if wo["QTMA"] else None
        qk1, mregs = wo.pop("QK1"), wo.pop("MREGS")
        if not qk1:
            wo.pop("W1OUT")
        try:
            if qk1:
                _sparse_core_qk1[(grid,)](
                    q, out, sinks, kv1, i1, kv2, i2, opos, ofreq, scales if scales is not None else sinks,
                    qpos, qfreq if qrf else sinks, float(q_eps), trace if trace is not None else sinks, *args,
                    n_items, B * S, float(scale) * _LOG2E, *strides, D=D, BD=D, BH=BH, BN=bn, NBUF=nbuf, TWO=two,
                    JC=JC, LOAD_REGS=load_regs, MATH_REGS=mregs or QK1_MATH_REGS, PREF=wo["PREF"],
                    RF=2 * ofreq.numel() if o_rope is not None else 0, OROPE=o_rope is not None,
                    FP8=scales is not None, STC=min(32, D // 8), QROPE=q_rope is not None, QRF=qrf, QTW=qtw,
                    TRACE=trace is not None, ORS=wo["ORS"], q_desc=q_desc, QTMA=wo["QTMA"], W1OUT=wo["W1OUT"],
                    QPRO=wo["QPRO"], PROBE=wo["PROBE"],
                    num_warps=4, maxnreg=WS_MAXNREG)
                return
            _sparse_core_ws[(grid,)](
                q, out, sinks, kv1, i1, kv2, i2, opos, ofreq, scales if scales is not None else sinks,
                qpos, qfreq if qrf else sinks, float(q_eps), trace if trace is not None else sinks, *args,
                n_items, B * S, float(scale) * _LOG2E, *strides, D=D, BD=D, BH=BH, BN=bn, NBUF=nbuf, TWO=two, JC=JC,
                LOAD_REGS=load_regs, RF=2 * ofreq.numel() if o_rope is not None else 0, OROPE=o_rope is not None,
                FP8=scales is not None, STC=min(32, D // 8), QROPE=q_rope is not None, QRF=qrf,
                QTW=qtw, TRACE=trace is not None, q_desc=q_desc, num_warps=8, maxnreg=WS_MAXNREG, **wo)
            return
        except COMPILE_ERRORS as e:                                     # raised before anything runs
            if not default_ws:
                raise
            mark_ws_broken(e)
            if fused:                                                   # the caller runs the steps as passes
                raise WSUnavailable(_WS_BROKEN) from e
    _sparse_core_gluon[(B * S, H // BH)](
        q, out, sinks, kv1, i1, kv2, i2, *args, float(scale) * _LOG2E, *strides, D=D, BD=D, BH=BH, BN=bn,
        NBUF=nbuf, TWO=two, PROBE=probe, JC=JC, LSPLIT=bool((opts or {}).get("LSPLIT", WS_OPTS["LSPLIT"])),
        num_warps=8)

"""A persistent, warp-specialized FP8 GEMM for Hopper in Gluon, with V4's 1 x 128 by 128 x 128 block scales.

    out[g] = (x[:, g*K:(g+1)*K] * s_x) @ (w[g*N:(g+1)*N] * s_w)^T        for g < G (G = 1: a plain projection)

Same operands and formats as ``fp8.fp8_matmul`` (whose module docstring has them): x_q [M, G*K] e4m3 (row stride
free, unit column stride), its scales [G*K/128, M] fp32, w_q [G*N, K] e4m3, its scales [G*N/128, >= K/128]; out
[G, M, N] (bf16, fp16 or fp32), group-major, as ``GroupedFP8.forward_q`` returns it.

Why it exists (``benchmarks/2026-12-02-core-floor-1xh200-session27.md``): cuBLAS runs the layer's projections at
0.60-0.95 of its own square rate. wq_b (K = 1024) at 0.79: with so short a K loop each output tile's store is
not hidden behind the next tile's products. wo_a (8 groups) at 0.86: eight launches, each a single wave with its
own ramp and tail. Here one launch covers every group, and each program keeps its SM:

- **loader** (a worker partition, one warp): TMA copies of the next x and w tiles into a ring of STAGES buffers,
  running ahead across tile boundaries, so the next tile's first products never wait for memory.
- **math** (the default partition, two warpgroups: 128 rows x 128 columns, 64 rows each): per 128-channel
  k-block one wgmma into a fresh fp32 register tile, then promoted into the accumulator with the block's scales
  (s_x of the row times s_w of the block) in fp32 FMAs. The wgmma of k-block kb + 1 is issued before block kb
  is promoted, so the tensor cores work while the FMAs run (DeepGEMM's scheme; no fp8 product is ever summed
  across k-blocks in the tensor core's reduced-precision accumulator).
- **epilogue**: the tile is rounded to out's dtype into shared memory and sent by one TMA store that is not
  waited for: it drains while the next tile's products run (the wait comes before that buffer's next use).

Each output element is one fixed sequence of operations (k-blocks in order), so the same inputs give the same
bits on every run. Not cuBLAS's bits: the products within a k-block add in another order.

``supported`` says when it applies (Hopper, Gluon, K and N multiples of 128, 16-byte aligned operands, M a
multiple of 128 when G > 1); ``fp8.fp8_matmul`` and ``fp8.GroupedFP8`` call it as ``fp8.set_gemm_kernel`` says.
"""

from __future__ import annotations

import functools

import torch

from .comm.triton_gate import triton

try:  # Gluon: experimental; anything missing means "not available", never an import error
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, \
        warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except Exception:  # pragma: no cover - depends on the install
    gluon = gl = None

__all__ = ["available", "supported", "fp8_gemm_gluon", "COMPILE_ERRORS", "BM", "BN", "BK", "STAGES"]

BM = 128        # output rows a tile (two warpgroups of 64)
BN = 128        # output columns a tile: one weight block, so one w scale a k-block
BK = 128        # channels a k-block: one scale block of x and of w
STAGES = 5      # ring of (x, w) tiles: 5 x 32 KB, plus 32 KB for the bf16 output tile
GROUP_M = 8     # tiles walked GROUP_M row blocks at a time (L2 reuse of w)
LOAD_REGS = 40  # the loader's registers a thread (its warp and Triton's three padding warps: a warpgroup)
MATH_REGS = 200  # the worker math warpgroup's (the default partition's warpgroup gets 256; 4 x (256 + 200 + 40)
                 # warp-registers fit the launch's 12 x 168)
WIDE = True     # 128 x 256 tiles where N allows (the kernel after _fp8_gemm_kernel)
WIDE_STAGES = 3   # its ring: 3 x 48 KB, plus 64 KB for the output tile
WIDE_MATH_REGS = 216   # its worker warpgroup's; the launch: 8 warps at 255
MAXNREG = 168   # the launch's: 12 warps (Triton pads the partitions to whole warpgroups) x 32 x 168 fit the SM's
                # 64 K registers; ptxas needs every instruction within it (the math fits: 0 spills)

_BROKEN: str | None = None     # why this install cannot compile the kernel, once it failed


def available() -> bool:
    return gluon is not None and _BROKEN is None


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _hopper(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] == 9


def supported(x_q: torch.Tensor, s_x: torch.Tensor, w_q: torch.Tensor, s_w: torch.Tensor, out: torch.Tensor,
              groups: int = 1) -> str | None:
    """None where the kernel runs these operands (shapes as in the module docstring, already checked by the
    caller), else why not."""
    if not available():
        return f"Gluon unavailable ({_BROKEN or 'no triton.experimental.gluon'})"
    if not (x_q.is_cuda and _hopper(x_q.device.index if x_q.device.index is not None else 0)):
        return "needs a Hopper GPU"
    M, GK = x_q.shape
    GN, K = w_q.shape
    N = GN // groups
    if K % BK or N % BN or GK != groups * K:
        return f"needs K={K} and N={N} multiples of {BK}"
    if groups > 1 and M % BM:
        return f"grouped: needs M={M} a multiple of {BM}"
    if x_q.stride(1) != 1 or (x_q.stride(0) % 16) or x_q.data_ptr() % 16 or not w_q.is_contiguous() \
            or w_q.data_ptr() % 16:
        return "needs 16-byte aligned rows with unit channel stride"
    if out.dtype not in (torch.bfloat16, torch.float16, torch.float32) or not out.is_contiguous() \
            or out.data_ptr() % 16 or (N * out.element_size()) % 16:
        return f"needs a contiguous, 16-byte aligned out of bf16, fp16 or fp32 (got {out.dtype})"
    if s_x.dtype != torch.float32 or s_w.dtype != torch.float32 or s_x.stride(1) != 1 or s_w.stride(1) != 1:
        return "needs fp32 scales with unit stride along M / the k-blocks"
    return None


if gluon is not None:

    @gluon.jit
    def _tile(t, MT, NT, GROUP: gl.constexpr):
        # tile t -> (group, row block, column block): within a group, GROUP row blocks at a time, column-major
        per_g = MT * NT
        g = t // per_g
        r = t % per_g
        width = GROUP * NT
        first = (r // width) * GROUP
        rows = gl.minimum(MT - first, GROUP)
        pm = first + (r % width) % rows
        pn = (r % width) // rows
        return g, pm, pn

    @gluon.jit
    def _loader(x_desc, w_desc, x_bufs, w_bufs, ready, empty, M, N, K, n_tiles,
                BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr):
        MT = gl.cdiv(M, BM)
        NT = N // BN
        KB = K // BK
        cnt = 0
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            g, pm, pn = _tile(t, MT, NT, GROUP)
            for kb in range(KB):
                s = cnt % STAGES
                mbarrier.wait(empty.index(s), ((cnt // STAGES) & 1) ^ 1)     # the math released the slot
                mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(x_desc, [pm * BM, g * K + kb * BK], ready.index(s), x_bufs.index(s))
                tma.async_copy_global_to_shared(w_desc, [g * N + pn * BN, kb * BK], ready.index(s), w_bufs.index(s))
                cnt += 1

    @gluon.jit
    def _math(W: gl.constexpr, c_desc, sx_ptr, sw_ptr, x_bufs, w_bufs, ready, empty, c_smem, M, N, K, n_tiles,
              s_sx, s_sw, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
              GROUP: gl.constexpr):
        # warpgroup W: rows W * BM/2 .. of every tile, on its own (no barrier with the other warpgroup: while one
        # promotes a k-block in FMAs, the other's wgmma has the tensor cores)
        HM: gl.constexpr = BM // 2
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BN, 32])
        row_l: gl.constexpr = gl.SliceLayout(1, mma_l)
        MT = gl.cdiv(M, BM)
        NT = N // BN
        KB = K // BK
        zero = gl.zeros([HM, BN], gl.float32, mma_l)
        rows = gl.arange(0, HM, layout=row_l) + W * HM
        c_half = c_smem.slice(W * HM, HM, dim=0)
        cnt = 0
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            g, pm, pn = _tile(t, MT, NT, GROUP)
            m = pm * BM + rows
            ok = m < M
            sx_row = sx_ptr + (g * KB).to(gl.int64) * s_sx + m           # s_x[g*KB + kb, m]
            sw_row = sw_ptr + ((g * N + pn * BN) // BK).to(gl.int64) * s_sw  # s_w[(g*N + n0)/128, kb]
            f = gl.load(sx_row, mask=ok, other=0.0) * gl.load(sw_row)
            acc = gl.zeros([HM, BN], gl.float32, mma_l)
            for kb in range(KB):
                s = cnt % STAGES
                mbarrier.wait(ready.index(s), (cnt // STAGES) & 1)
                tok = warpgroup_mma(x_bufs.index(s).slice(W * HM, HM, dim=0), w_bufs.index(s).permute((1, 0)),
                                    zero, use_acc=False, is_async=True)
                nk = gl.minimum(kb + 1, KB - 1)                            # the next k-block's scales, meanwhile
                f_nxt = gl.load(sx_row + nk * s_sx, mask=ok, other=0.0) * gl.load(sw_row + nk)
                part = warpgroup_mma_wait(num_outstanding=0, deps=(tok,))
                mbarrier.arrive(empty.index(s))
                acc = acc + part * f[:, None]
                f = f_nxt
                cnt += 1
            tma.store_wait(pendings=0)                                     # the last tile's store left c_half
            c_half.store(acc.to(c_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [g * M + pm * BM + W * HM, pn * BN], c_half)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _fp8_gemm_kernel(x_desc, w_desc, c_desc, sx_ptr, sw_ptr, M, N, K, n_tiles, s_sx, s_sw,
                         BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                         GROUP: gl.constexpr, LOAD_REGS: gl.constexpr, MATH_REGS: gl.constexpr,
                         num_warps: gl.constexpr):
        gl.static_assert(num_warps == 4, "one math warpgroup in the default partition, one in a worker")
        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)       # the loader's expect; the TMA's bytes complete it
            mbarrier.init(empty.index(i), count=2)       # each math warpgroup, once its product read the slot
        gl.warp_specialize([
            (_math, (0, c_desc, sx_ptr, sw_ptr, x_bufs, w_bufs, ready, empty, c_smem, M, N, K, n_tiles, s_sx,
                     s_sw, BM, BN, BK, STAGES, GROUP)),
            (_math, (1, c_desc, sx_ptr, sw_ptr, x_bufs, w_bufs, ready, empty, c_smem, M, N, K, n_tiles, s_sx,
                     s_sw, BM, BN, BK, STAGES, GROUP)),
            (_loader, (x_desc, w_desc, x_bufs, w_bufs, ready, empty, M, N, K, n_tiles, BM, BN, BK, STAGES, GROUP)),
        ], [4, 1], [MATH_REGS, LOAD_REGS])


    # ---- WIDE: 128 x 256 tiles, 8 warps ----------------------------------------------------------------------
    # The kernel above reads 32 KB from L2 per 4.2 MFLOP (128 x 128 tiles): at cuBLAS's rate that is ~10 TB/s, more
    # than L2 gives. 128 x 256 tiles read 48 KB per 8.4 MFLOP. Each warpgroup then holds 64 x 256 fp32 (128
    # registers) plus a 64 x 128 product, more than the 168 registers a thread that a launch of 12 warps allows
    # (Triton pads a one-warp loader to a warpgroup). So no loader partition: warpgroup 0 issues the TMA copies
    # itself, STAGES - 1 k-blocks ahead, and the launch is 8 warps (up to 255 registers). A k-block's 256 columns
    # are two weight blocks: two wgmma of 64 x 128 each, each promoted with its own scale.

    @gluon.jit
    def _wide_load(p, n_mine, x_desc, w_desc, x_bufs, w_bufs, ready, empty, M, N, K, MT, NT, KB,
                   BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr):
        # the copies of this program's k-iteration p (its tile p // KB, k-block p % KB), if it has one
        if p < n_mine * KB:
            s = p % STAGES
            g, pm, pn = _tile(gl.program_id(0) + (p // KB) * gl.num_programs(0), MT, NT, GROUP)
            kb = p % KB
            mbarrier.wait(empty.index(s), ((p // STAGES) & 1) ^ 1)         # both warpgroups released the slot
            mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [pm * BM, g * K + kb * BK], ready.index(s), x_bufs.index(s))
            tma.async_copy_global_to_shared(w_desc, [g * N + pn * BN, kb * BK], ready.index(s), w_bufs.index(s))

    @gluon.jit
    def _wide_math(W: gl.constexpr, x_desc, w_desc, c_desc, sx_ptr, sw_ptr, x_bufs, w_bufs, ready, empty, c_smem,
                   M, N, K, n_tiles, s_sx, s_sw, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                   STAGES: gl.constexpr, GROUP: gl.constexpr):
        HM: gl.constexpr = BM // 2
        HN: gl.constexpr = BN // 2
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HN, 32])
        row_l: gl.constexpr = gl.SliceLayout(1, mma_l)
        MT = gl.cdiv(M, BM)
        NT = N // BN
        KB = K // BK
        n_mine = gl.cdiv(n_tiles - gl.program_id(0), gl.num_programs(0))
        zero = gl.zeros([HM, HN], gl.float32, mma_l)
        rows = gl.arange(0, HM, layout=row_l) + W * HM
        c0 = c_smem.index(2 * W)
        c1 = c_smem.index(2 * W + 1)
        if W == 0:
            for p in gl.static_range(STAGES - 1):
                _wide_load(p, n_mine, x_desc, w_desc, x_bufs, w_bufs, ready, empty, M, N, K, MT, NT, KB, BM, BN,
                           BK, STAGES, GROUP)
        cnt = 0
        for i in range(n_mine):
            g, pm, pn = _tile(gl.program_id(0) + i * gl.num_programs(0), MT, NT, GROUP)
            m = pm * BM + rows
            ok = m < M
            sx_row = sx_ptr + (g * KB).to(gl.int64) * s_sx + m           # s_x[g*KB + kb, m]
            sw_row = sw_ptr + ((g * N + pn * BN) // BK).to(gl.int64) * s_sw  # s_w[(g*N + n0)/128 (+1), kb]
            sx = gl.load(sx_row, mask=ok, other=0.0)
            f0 = sx * gl.load(sw_row)
            f1 = sx * gl.load(sw_row + s_sw)
            acc0 = gl.zeros([HM, HN], gl.float32, mma_l)
            acc1 = gl.zeros([HM, HN], gl.float32, mma_l)
            for kb in range(KB):
                if W == 0:                                                 # the copies STAGES - 1 ahead
                    _wide_load(cnt + STAGES - 1, n_mine, x_desc, w_desc, x_bufs, w_bufs, ready, empty, M, N, K,
                               MT, NT, KB, BM, BN, BK, STAGES, GROUP)
                s = cnt % STAGES
                mbarrier.wait(ready.index(s), (cnt // STAGES) & 1)
                xa = x_bufs.index(s).slice(W * HM, HM, dim=0)
                tok = warpgroup_mma(xa, w_bufs.index(s).slice(0, HN, dim=0).permute((1, 0)), zero, use_acc=False,
                                    is_async=True)
                nk = gl.minimum(kb + 1, KB - 1)                            # the next k-block's scales, meanwhile
                sx = gl.load(sx_row + nk * s_sx, mask=ok, other=0.0)
                s0 = gl.load(sw_row + nk)
                s1 = gl.load(sw_row + s_sw + nk)
                part = warpgroup_mma_wait(num_outstanding=0, deps=(tok,))
                acc0 = acc0 + part * f0[:, None]
                tok = warpgroup_mma(xa, w_bufs.index(s).slice(HN, HN, dim=0).permute((1, 0)), zero, use_acc=False,
                                    is_async=True)
                part = warpgroup_mma_wait(num_outstanding=0, deps=(tok,))
                mbarrier.arrive(empty.index(s))
                acc1 = acc1 + part * f1[:, None]
                f0 = sx * s0
                f1 = sx * s1
                cnt += 1
            tma.store_wait(pendings=0)                                     # the last tile's stores left c0, c1
            c0.store(acc0.to(c_desc.dtype))
            c1.store(acc1.to(c_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [g * M + pm * BM + W * HM, pn * BN], c0)
            tma.async_copy_shared_to_global(c_desc, [g * M + pm * BM + W * HM, pn * BN + HN], c1)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _fp8_gemm_wide(x_desc, w_desc, c_desc, sx_ptr, sw_ptr, M, N, K, n_tiles, s_sx, s_sw,
                       BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                       GROUP: gl.constexpr, MATH_REGS: gl.constexpr, num_warps: gl.constexpr):
        gl.static_assert(num_warps == 4, "one math warpgroup in the default partition, one in a worker")
        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [4, BM // 2, BN // 2], c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        gl.warp_specialize([
            (_wide_math, (0, x_desc, w_desc, c_desc, sx_ptr, sw_ptr, x_bufs, w_bufs, ready, empty, c_smem, M, N, K,
                          n_tiles, s_sx, s_sw, BM, BN, BK, STAGES, GROUP)),
            (_wide_math, (1, x_desc, w_desc, c_desc, sx_ptr, sw_ptr, x_bufs, w_bufs, ready, empty, c_smem, M, N, K,
                          n_tiles, s_sx, s_sw, BM, BN, BK, STAGES, GROUP)),
        ], [4], [MATH_REGS])


# what a launch raises before anything runs, where the kernel does not compile with this Triton
COMPILE_ERRORS = (triton.compiler.errors.CompilationError, triton.runtime.errors.OutOfResources, AttributeError,
                  TypeError, NotImplementedError) if triton is not None else ()

_GL_DTYPE = {}
if gluon is not None:
    _GL_DTYPE = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32,
                 torch.float8_e4m3fn: gl.float8e4nv}


def _desc(t: torch.Tensor, block: list[int]):
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPE[t.dtype])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def fp8_gemm_gluon(x_q: torch.Tensor, s_x: torch.Tensor, w_q: torch.Tensor, s_w: torch.Tensor, out: torch.Tensor,
                   groups: int = 1, programs: int | None = None) -> torch.Tensor:
    """out ([M, N] for groups = 1, else [G, M, N]) = the block-scaled product, see the module docstring. The
    caller has checked the shapes and ``supported``. programs: the persistent grid (default: one per SM)."""
    global _BROKEN
    M = x_q.shape[0]
    GN, K = w_q.shape
    N = GN // groups
    wide = WIDE and N % (2 * BN) == 0
    bn = 2 * BN if wide else BN
    n_tiles = groups * triton.cdiv(M, BM) * (N // bn)
    x_desc = _desc(x_q, [BM, BK])
    w_desc = _desc(w_q, [bn, BK])
    c_desc = _desc(out.view(groups * M, N), [BM // 2, BN])     # each warpgroup stores its half (in halves)
    grid = min(n_tiles, programs or _sm_count(x_q.device.index if x_q.device.index is not None else 0))
    try:
        if wide:
            _fp8_gemm_wide[(grid,)](x_desc, w_desc, c_desc, s_x, s_w, M, N, K, n_tiles, s_x.stride(0),
                                    s_w.stride(0), BM=BM, BN=bn, BK=BK, STAGES=WIDE_STAGES, GROUP=GROUP_M,
                                    MATH_REGS=WIDE_MATH_REGS, num_warps=4, maxnreg=255)
        else:
            _fp8_gemm_kernel[(grid,)](x_desc, w_desc, c_desc, s_x, s_w, M, N, K, n_tiles, s_x.stride(0),
                                      s_w.stride(0), BM=BM, BN=BN, BK=BK, STAGES=STAGES, GROUP=GROUP_M,
                                      LOAD_REGS=LOAD_REGS, MATH_REGS=MATH_REGS, num_warps=4, maxnreg=MAXNREG)
    except COMPILE_ERRORS as e:                                         # raised before anything runs
        _BROKEN = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        raise
    return out

"""The sparse attention core's prefill kernel for Hopper in CUDA C++: one CTA an item and an SM, two math warpgroups.

The math is ``core.sparse_attention``'s (one query's 64 heads against 64-key tiles of its picks, the window part
then the compressed part in one online softmax, fp32 in the exp2 domain, the sink as the running max's start,
-1 picks masked). What differs from the Gluon kernels (``core_gluon``) is who holds what:

- **One CTA holds one item** (a query's 64-head block), whole rows of d = 512: q (64 KB), a ring of two 64-key
  tiles (2 x 64 KB), two P tiles; one CTA an SM (227 KB of shared memory, 384 threads: two math warpgroups at 216
  registers, a copy warpgroup at 64). The tiles go in rounds of two: math warpgroup 0 takes the first, 1 the
  second, each QK over all of d. Each warpgroup owns one half of the output's d (a 64 x 256 fp32 accumulator): the
  two share their tiles' row maxima (the same new max on both sides) and their P (bf16, in shared memory), and each
  multiplies both P into its half of both tiles' V; a round with one tile runs only its PV. The row sums add once,
  at the end. (The Gluon kernels hold the whole 64 x 512 accumulator in one warpgroup, whose tensor cores idle
  through each tile's softmax.)
- **Persistent**: each CTA walks items with a stride of the CTAs resident. The copy warpgroup counts the next
  item's tiles and loads its first two tiles' picks, brings its q once the last QK is done and runs q's prologue
  while the math finishes the item (the RoPE angles' cos / sin while q lands, one a lane), then gathers the picked
  rows with ``cp.async`` into the 128-byte swizzle (a -1 pick reads nothing and is zero-filled) with their valid
  flags in shared memory as the slots free, and signals mbarriers. Its chain of work (counts, q's copies, q's
  prologue, the tiles' copies) sets an item's pace at sliding and HCA layers, so it does as little as it can: the
  math warpgroups sum q's squares (session 32: in the copy warpgroup those shared-memory reads took ~4300 of its
  ~15 000 cycles a sliding item). QK and PV are ``wgmma`` from shared-memory descriptors, the own P from registers
  in the accumulator's layout, the other's from shared memory.
- **A sliding window's call** (one part of 128 picks: ``WRING``): each CTA takes a contiguous run of items and its
  two slots hold the window's rows as a ring (pick j of query s at row (s - j) % 128); where an item's picks are the
  last item's (the next head block) or the last item's moved on by one (the next query), only the new row is copied
  (session 33: 128 KB of copies an item became 1 KB, and the copy warpgroup waits for the math). The next item's
  first QK is then issued under this item's output stores (``DEFER``), its rows being there early.
- **The layer's steps**, as the Gluon warp-specialized kernel takes them: q raw (each head's RMSNorm a factor of its
  scores: the math warpgroups sum the squares of the channels before the RoPE tail in round 0 while its tile
  lands, the copy warpgroup those of the tail as it turns it in shared memory; both warpgroups add the three parts
  in one order), the output's inverse RoPE and ``act_quant``'s FP8 with the unfused chain's bits, staged in shared
  memory (the P tiles and 16 KB after them) and stored by two TMA stores a warpgroup (``TMAO``: a contiguous out,
  the tensor map from the driver's ``cuTensorMapEncodeTiled``), else in the threads' 16-byte rows.

It replaced (session 31) a pair kernel, a cluster of two CTAs an item each holding half of d and exchanging 64 x 64
partial scores a tile, two CTAs an SM: slower at all three V4 layer types
(`benchmarks/results/attn.md` restores it beside this one).

It is compiled at run time by NVRTC through torch (``torch.cuda._compile_kernel``, sm_90a; a private torch
API, present in 2.11 and 2.13): no build step (``dev/nvrtc_sm90.py`` runs NVRTC on a machine without a GPU). It
takes d = 512 (V4), whole 64-head blocks, one or two parts, bf16; every output element is written once in a fixed
order, so the bits repeat from run to run. ``supported`` says when it applies; ``core_kernel.sparse_attention_fused``
runs it where a Gluon kernel would (prefill grids) for queries of up to ``MAX_PICKS`` picks
(`benchmarks/results/attn.md`).
"""

from __future__ import annotations

import ctypes
import functools
import warnings

import torch

__all__ = ["available", "supported", "sparse_attention_cuda", "mark_broken", "ctas_resident", "ENABLED", "MAX_PICKS",
           "SMEM_BYTES"]

D_FULL = 512                # head_dim the kernel takes (V4's)
BH = 64                     # heads an item (the GEMMs' M)
THREADS = 384               # two math warpgroups, a copy warpgroup
SMEM_BYTES = 65536 + 2 * 65536 + 32768 + 2576  # q, two whole-row tiles, P tiles + staging, barriers and the rest

# what any sm_90a kernel here starts from (the deleted SM90 probe built on it too; git history): a generic pointer's
# shared-window address, and the 32 fp32 accumulator operands of an m64n64 wgmma in inline PTX
HELPERS = r"""
typedef unsigned long long u64;

__device__ __forceinline__ unsigned smem_u32(const void *p) {
    unsigned a;
    asm("{\n\t.reg .u64 t;\n\tcvta.to.shared.u64 t, %1;\n\tcvt.u32.u64 %0, t;\n}" : "=r"(a) : "l"(p));
    return a;
}
#define D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define D32_OUT(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), \
    "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), \
    "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), \
    "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
"""

# the kernel's device code: barriers, copies, conversions, wgmma, the arguments
DEVICE = HELPERS + r"""
#define NEG_INF (-__int_as_float(0x7f800000))
#ifndef TRACE
#define TRACE 0
#endif
// the layer's steps around the core (compile-time, from the Python side): QROPE q arrives raw, gets each head's
// RMSNorm (as a factor of its scores) and RoPE of its last QRF channels; OROPE the output's last ORF channels get
// the inverse RoPE; FP8 the output leaves as act_quant's e4m3 and scales; POS_T the positions' type
#ifndef QROPE
#define QROPE 0
#endif
#ifndef QRF
#define QRF 0
#endif
#ifndef OROPE
#define OROPE 0
#endif
#ifndef ORF
#define ORF 0
#endif
#ifndef FP8
#define FP8 0
#endif
#ifndef POS_T
#define POS_T long long
#endif
#ifndef PROBE
#define PROBE 0     // profiling only, wrong results: 2 no tile copies, 8 no RoPE turn of q, 16 no output stores
#endif
// WRING (one part of exactly 128 picks: a sliding window): the two slots hold the 128 picked rows as a ring, pick j
// of query s at row (s - j) % 128, and each CTA takes a contiguous run of items; where an item's picks are the last
// item's (the next head block) or the last item's moved on by one (the next query: its window), the rows stay and
// only the new one is copied. The sums' order is a function of s alone: the same bits whether the rows stayed or
// were copied (NOREUSE 1 copies every row, for the tests)
#ifndef WRING
#define WRING 0
#endif
#ifndef NOREUSE
#define NOREUSE 0
#endif
// TMAO (FP8 out, contiguous: rows (b, s, h) of 512 bytes): each warpgroup's staged output leaves by two TMA stores,
// issued by one thread, instead of every thread's 16-byte stores
#ifndef TMAO
#define TMAO 0
#endif
#if defined(NOTMA) && NOTMA                     // (profiling: the threads' stores where TMAO would take them)
#undef TMAO
#define TMAO 0
#endif
// DEFER: the next item's first QK issued under this item's output stores, as the tensor cores idle there (it waits
// for the next item's q and tiles first). 1 with the window ring (whose next rows are there early: its core 1-2 %
// faster on one H200, session 33), else 0 (slower: session 32; under the FP8 steps too, slower still: session 33)
#ifndef DEFER
#define DEFER (WRING ? 1 : 0)
#endif
// QTAIL (q's RoPE tail turned by the copy warpgroup, QROPE with QRF > 0): q's tail chunks are copied first, as
// their own cp.async group, and turned while the rest of q lands (QTAIL 0: all of q landed first). On with the
// window ring only: on one H200 (session 34) the sliding core alone 234.4 against 238.3 us, HCA 325.5 against 328.7,
// CSA 678.1 against 664.2 (slower: its copy warpgroup is the busier)
#ifndef QTAIL
#define QTAIL (QROPE && QRF > 0 && WRING)
#endif
// TRACE (profiling): one math thread and one copy thread of each CTA add the clock cycles of each phase into
// a.trace[CTA][32]; STAMP(k) closes phase k (the cycles since the last stamp)
#define STAMP(k) do { if (TRACE && tr) { long long _n = clock64(); tr[k] += _n - t0; t0 = _n; } } while (0)

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    asm volatile("{\n\t.reg .pred p;\n\tWAIT:\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t"
                 "@!p bra WAIT;\n}" :: "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void cp_async16(unsigned dst, const void *src, unsigned src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_arrive(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ unsigned short pack_e4m3(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}
// act_quant's scale (fp8.pow2_scale_bits's, the Triton kernels' one definition), the power of two at or above
// RN(amax / 448), as bits: amax = m 2^E (1 <= m < 2) gives 2^(E - 8), or 2^(E - 7) when m > 1.75 (amax / 448 =
// m / 1.75 2^(E - 8)). The division's bits for every bf16 amax >= 1e-4 and for 1e-4 itself (the clamp), the only
// inputs (checked for all of them): a quotient that rounds up onto a power of two needs m within 2^-24 below 1.75,
// which neither has
__device__ __forceinline__ unsigned pow2_scale(float amax) {
    const unsigned ab = __float_as_uint(amax);
    return (ab & 0x7F800000u) - (8u << 23) + ((ab & 0x7FFFFFu) > 0x600000u ? (1u << 23) : 0u);
}
__device__ __forceinline__ float bf16_lo(unsigned v) { return __int_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(unsigned v) { return __int_as_float(v & 0xffff0000u); }
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// byte offset of (row r, 16-byte chunk c of a 512-channel row) in a 64-row [8 swizzle columns][rows][128 B] tile
__device__ __forceinline__ unsigned sw_off(int r, int c) {
    return (c >> 3) * (64 * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}
// a wgmma shared-memory descriptor in the 128-byte swizzle: SBO = 1024 (8 rows of 128 bytes: K-major q and keys,
// 8 keys of V, MN-major); LBO: unused by K-major swizzled operands (16), for V the step between 64-channel swizzle
// columns (8192; its N = 64 wgmmas stay in one; LBO does not matter there)
#define LBO_K 16
#define LBO_V 8192
__device__ __forceinline__ u64 desc(unsigned a, unsigned lbo) {
    return (u64)((a >> 4) & 0x3FFF) | ((u64)((lbo >> 4) & 0x3FFF) << 16) | ((u64)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_ss(float *d, u64 da, u64 db, int acc) {      // m64n64k16, both K-major
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %34, 0;\n\t"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " D32 ", %32, %33, p, 1, 1, 0, 0;\n}"
        : D32_OUT(d) : "l"(da), "l"(db), "r"(acc));
}
__device__ __forceinline__ void wgmma_rs(float *d, const unsigned *a, u64 db) {    // A from registers, B MN-major
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %37, 0;\n\t"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " D32 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}"
        : D32_OUT(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
__device__ __forceinline__ void wgmma_sv(float *d, u64 da, u64 db) {             // A K-major, B MN-major, accumulate
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %34, 0;\n\t"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " D32 ", %32, %33, p, 1, 1, 0, 1;\n}"
        : D32_OUT(d) : "l"(da), "l"(db), "r"(1));
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit_wait() {
    asm volatile("wgmma.commit_group.sync.aligned;\n\twgmma.wait_group.sync.aligned 0;" ::: "memory");
}

struct Args {
    const unsigned short *q; unsigned short *out; const float *sinks;
    const unsigned short *kv1; const unsigned short *kv2;
    int S, H, J1, J2, two, n_items;
    float qk_scale;
    long long s_qb, s_qs, s_qh, s_ob, s_os, s_oh, s_k1b, s_k1m, s_i1b, s_i1s, s_k2b, s_k2m, s_i2b, s_i2s;
    long long *trace;
    const POS_T *qpos; const float *qfreq; float eps;      // QROPE
    const POS_T *opos; const float *ofreq;                 // OROPE
    float *scales; int M;                                  // FP8: scales [H * 512 / 128, M], M = B * S
};
// a CUtensorMap (128 bytes), a __grid_constant__ parameter: TMAO's FP8 output as [rows of 512 bytes], 64 x 128-byte
// boxes in the 128-byte swizzle
struct __align__(64) TMap { u64 v[16]; };
__device__ __forceinline__ void tma_store_2d(const TMap *m, unsigned src, int x, int y) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
                 :: "l"((u64)m), "r"(src), "r"(x), "r"(y) : "memory");
}

"""

# the kernel: one CTA an item and an SM, whole rows of d; two math warpgroups, each one half of the output, take
# every other tile (QK over all of d), share their row maxima and P through shared memory
SRC = DEVICE + r"""
#define HALF 256
#define SQ_OFF 0            // q: 64 rows x 512 channels, [8 swizzle columns][64 rows][128 B]
#define SK_OFF 65536        // two slots of a 64-key tile of whole rows (64 KB each)
#define ST_BYTES 65536
#define SP_OFF 196608       // the warpgroups' P tiles (64 x 64 bf16, 8 KB each); with the next 16 KB the output's
                            // staging (warpgroup 0 over the P tiles, 1 after them)
#define SB_OFF 229376       // barriers, counts, flags, q's factors, the warpgroups' row maxima and sums

template <typename I>
__device__ __forceinline__ void core(const Args &a, const I *idx1_ptr, const I *idx2_ptr, const TMap *om) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const int tid = threadIdx.x;
    const int HB = a.H / 64;
#if WRING                                                // a contiguous run of items a CTA
    const int per = a.n_items / gridDim.x, rem = a.n_items % gridDim.x;
    const int first = blockIdx.x * per + min((int)blockIdx.x, rem), stride = 1;
    const int last = first + per + ((int)blockIdx.x < rem ? 1 : 0);
#else                                                   // items with a stride of the CTAs resident
    const int first = blockIdx.x, stride = gridDim.x, last = a.n_items;
#endif
    const unsigned base = smem_u32(smem);
    const unsigned q_full = base + SB_OFF, q_empty = q_full + 8, kv_full = q_full + 16, kv_empty = q_full + 32;
    volatile int *info = (volatile int *)(smem + SB_OFF + 64);       // the item's tile count, producer -> math
    volatile unsigned char *flags = smem + SB_OFF + 144;              // [2 slots][64 rows]: the pick is valid
    volatile float *tsq = (volatile float *)(smem + SB_OFF + 272);    // QROPE: each head's RoPE tail's sum of squares
    volatile float *xm = (volatile float *)(smem + SB_OFF + 528);     // [warpgroup][64 rows]: a tile's row maxima
    volatile float *ls = (volatile float *)(smem + SB_OFF + 1040);    // [item % 2][warpgroup][64 rows]: row sums
    volatile float *qsp = (volatile float *)(smem + SB_OFF + 2064);   // QROPE: [warpgroup][64 rows], q's sums
    if (tid == 0) {
        if (base & 1023) __trap();                      // the swizzle atoms need a 1024-byte aligned base
        mbar_init(q_full, QROPE ? 128 : 129);           // 128 copy threads' cp.async (QROPE: their plain arrives
                                                        // after the prologue), + 1 plain arrive (info)
        mbar_init(q_empty, 256);                        // both math warpgroups
        mbar_init(kv_full, 144); mbar_init(kv_full + 8, 144);    // cp.async of 128 threads + 16 plain (the flags)
        mbar_init(kv_empty, 256); mbar_init(kv_empty + 8, 256);  // both math warpgroups read every slot
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (tid >= 256) {                                   // the copy warpgroup: q, the counts, the tiles, ahead
        asm volatile("setmaxnreg.dec.sync.aligned.u32 64;");
        // thread p copies rows rg + 16 i (i < 4) x 16-byte chunks cg + 8 k (k < 8) of a row: a warp instruction
        // moves 4 rows x 128 contiguous bytes
        const int p = tid - 256, rg = p >> 3, cg = p & 7;
        long long *tr = TRACE && a.trace && p == 0 ? a.trace + blockIdx.x * 32 : nullptr, t0 = TRACE ? clock64() : 0;
        int u0 = 0, u1 = 0, it = 0;                     // each slot's fills so far
#if WRING
        int op = -2, ob = -1, os = -1;                  // the item the slots hold: this thread's pick p, its b and s
#endif
#if QROPE && QRF > 0
        float fq[QRF / 64];                             // lane l's RoPE angles are l + 32 k: their frequencies
#pragma unroll
        for (int k = 0; k < QRF / 64; ++k) fq[k] = a.qfreq[32 * k + (p & 31)];
#endif
        for (int item = first; item < last; item += stride, ++it) {
            const int hb = item % HB, bs = item / HB, b = bs / a.S, s = bs % a.S, h0 = hb * 64;
            const I *idx1 = idx1_ptr + b * a.s_i1b + s * a.s_i1s;
            const I *idx2 = idx2_ptr + b * a.s_i2b + s * a.s_i2s;
            int m1 = -1, m2 = -1;                       // each part's tiles run up to its last valid pick
#if WRING
            // pick p of this item against the held item's pick p (the same query's next head block) or p - 1
            // (the next query): m2 is whether every thread's pick says the rows may stay
            const int nw = (int)idx1[p], nx = p < 127 ? (int)idx1[p + 1] : 0, dl = b == ob ? s - os : -1;
            if (nw >= 0) m1 = p;
            m1 = __reduce_max_sync(0xffffffff, m1);
            m2 = __all_sync(0xffffffff, !NOREUSE && (dl == 0 ? nw == op : dl == 1 && (p == 127 || nx == op)));
#else
            for (int j = p; j < a.J1; j += 128) if (idx1[j] >= 0) m1 = j;
            if (a.two) for (int j = p; j < a.J2; j += 128) if (idx2[j] >= 0) m2 = j;
            m1 = __reduce_max_sync(0xffffffff, m1);
            m2 = __reduce_max_sync(0xffffffff, m2);
#endif
            int *red = (int *)(smem + SB_OFF + 80) + 8 * (it & 1);     // two sets: no barrier before the next write
            if ((p & 31) == 0) { red[p >> 5] = m1; red[4 + (p >> 5)] = m2; }
            asm volatile("bar.sync 1, 128;" ::: "memory");
            m1 = max(max(red[0], red[1]), max(red[2], red[3]));
#if WRING
            // re: the rows that stay (0: all, the same picks; 1: all but the new query's newest, row s % 128), or
            // -1: every row copied. Both tiles whenever a pick is valid (each row's flag masks the others)
            const int re = red[4] && red[5] && red[6] && red[7] ? dl : -1;
            const int n1 = m1 >= 0 ? 2 : 0, nt = n1;
            if (nt) { op = nw; ob = b; os = s; }
            if (TRACE && tr && re >= 0) tr[24] += 1;
#else
            m2 = max(max(red[4], red[5]), max(red[6], red[7]));
            const int n1 = (m1 + 64) >> 6, nt = n1 + ((m2 + 64) >> 6);
#endif
            STAMP(8);
            int pk0[4], pk1[4];                         // the first two tiles' picks (-1: none), loaded under the
#pragma unroll                                          // wait for q's slot
            for (int t = 0; t < 2; ++t) {
                const bool one = t < n1;
                const I *ip = one ? idx1 : idx2;
                const int J = one ? a.J1 : a.J2, j0 = (one ? t : t - n1) * 64;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    // (WRING: row r of tile t holds pick (s - 64 t - r) % 128)
                    const int j = WRING ? (s - j0 - rg - 16 * i) & 127 : j0 + rg + 16 * i;
                    const int v = t < nt && j < J ? (int)ip[j] : -1;
                    if (t) pk1[i] = v; else pk0[i] = v;
                }
            }
#if QROPE && QRF > 0
            const float qpos = (float)a.qpos[bs];       // (loads under the wait below)
#endif
            mbar_wait(q_empty, (it & 1) ^ 1);           // the last item's QKs are done with q
            STAMP(9);
            if (p == 0) info[0] = nt;
            const unsigned short *qs = a.q + b * a.s_qb + s * a.s_qs + (long long)h0 * a.s_qh + cg * 8;
            auto copy_q = [&](int k0, int k1) {         // q's chunks cg + 8 k of rows rg + 16 i, k0 <= k < k1
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int k = k0; k < k1; ++k) {
                        const int r = rg + 16 * i;
                        cp_async16(base + SQ_OFF + sw_off(r, cg + 8 * k), qs + r * a.s_qh + 64 * k, 16);
                    }
            };
            constexpr int KT = QTAIL ? 8 - QRF / 64 : 8;    // QTAIL: the tail's chunks (k >= KT) first, own group
            if (QTAIL) {
                copy_q(KT, 8);
                asm volatile("cp.async.commit_group;" ::: "memory");
            }
            copy_q(0, KT);
            asm volatile("cp.async.commit_group;" ::: "memory");   // (the tiles' copies, below, stay uncommitted)
#if QROPE && QRF > 0
            float ck[QRF / 64], sk[QRF / 64];           // (while q's copies land) cos / sin of lane l's angles
#pragma unroll
            for (int k = 0; k < QRF / 64; ++k) {
                const float ang = qpos * fq[k];
                ck[k] = cosf(ang);
                sk[k] = sinf(ang);
            }
#endif
            auto issue = [&](int t) {                   // tile t's copies into slot t % 2, its flags, kv_full's arrival
                const int slot = t & 1, u = slot ? u1 : u0;
                const bool one = t < n1;
                const I *ip = one ? idx1 : idx2;
                const int J = one ? a.J1 : a.J2, j0 = (one ? t : t - n1) * 64;
                const unsigned short *kv = one ? a.kv1 + b * a.s_k1b : a.kv2 + b * a.s_k2b;
                const long long sm = one ? a.s_k1m : a.s_k2m;
                int id[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int j = j0 + rg + 16 * i;
                    id[i] = t == 0 ? pk0[i] : t == 1 ? pk1[i] : j < J ? (int)ip[j] : -1;
                }
                STAMP(10);
                mbar_wait(kv_empty + 8 * slot, (u & 1) ^ 1);
                STAMP(11);
                const unsigned dst = base + SK_OFF + slot * ST_BYTES;
                const unsigned short *kvc = kv + cg * 8;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const unsigned short *row = kvc + (long long)(id[i] < 0 ? 0 : id[i]) * sm;
                    const unsigned n = id[i] < 0 ? 0 : 16;
#if WRING
                    if (re == 0 || (re == 1 && 64 * t + rg + 16 * i != (s & 127))) continue;   // the row stays
#endif
#pragma unroll
                    for (int k = 0; k < 8; ++k)
                        if (!(PROBE & 2)) cp_async16(dst + sw_off(rg + 16 * i, cg + 8 * k), row + 64 * k, n);
                }
                if (cg == 0) {                          // the rows' valid flags, for the math's mask
#pragma unroll
                    for (int i = 0; i < 4; ++i) flags[64 * slot + rg + 16 * i] = id[i] >= 0;
                    mbar_arrive(kv_full + 8 * slot);    // (release: the flags before the phase completes)
                }
                cp_async_arrive(kv_full + 8 * slot);
                STAMP(12);
                if (slot) ++u1; else ++u0;
            };
#if QROPE
            // q's prologue while the math finishes the last item (its softmax, PV and output), before the tiles
            // (their slots free only after its PV): the RoPE tail turned in place, its sums of squares (the math
            // warpgroups sum the channels before it)
#if QTAIL
            asm volatile("cp.async.wait_group 1;" ::: "memory");  // q's tail's group (the rest may still land)
#else
            asm volatile("cp.async.wait_group 0;" ::: "memory");  // q's group
#endif
            asm volatile("bar.sync 1, 128;" ::: "memory");        // q (its tail) landed, every copy thread's part
            STAMP(22);
#if QRF > 0
            {
                // the tail's QRF / 8 chunks of 8 channels: thread p always the same chunk, its 4 angles g from lane
                // g % 32's set g / 32 (each lane computed one angle's cos / sin a set)
                constexpr int NC = QRF / 8;
                const int pc = p % NC;
                float cs[4], sn[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int g = pc * 4 + j;
                    cs[j] = __shfl_sync(0xffffffff, ck[0], g & 31);
                    sn[j] = __shfl_sync(0xffffffff, sk[0], g & 31);
#pragma unroll
                    for (int k = 1; k < QRF / 64; ++k) {
                        const float c = __shfl_sync(0xffffffff, ck[k], g & 31);
                        const float n = __shfl_sync(0xffffffff, sk[k], g & 31);
                        if (g >> 5 == k) { cs[j] = c; sn[j] = n; }
                    }
                }
                for (int r = p / NC; r < (PROBE & 8 ? 0 : 64); r += 128 / NC) {
                    uint4 *ptr = (uint4 *)(smem + SQ_OFF + sw_off(r, 64 - NC + pc));
                    uint4 v = *ptr;
                    unsigned *w4 = (unsigned *)&v;
                    float t2 = 0.0f;                    // the chunk's sum of squares, before it turns
#pragma unroll
                    for (int j = 0; j < 4; ++j) {       // (even, odd) = (x cos - y sin, y cos + x sin), norm_rope's fma
                        const float x = bf16_lo(w4[j]), y = bf16_hi(w4[j]);
                        t2 = fmaf(y, y, fmaf(x, x, t2));
                        w4[j] = pack_bf16(fmaf(y, -sn[j], x * cs[j]), fmaf(x, sn[j], y * cs[j]));
                    }
                    *ptr = v;
#pragma unroll                                          // the row's NC chunks: NC consecutive lanes
                    for (int o = 1; o < NC; o <<= 1) t2 += __shfl_xor_sync(0xffffffff, t2, o);
                    if (pc == 0) tsq[r] = t2;
                }
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // the turned q, to wgmma's proxy
            }
#endif
#if QTAIL
            asm volatile("cp.async.wait_group 0;" ::: "memory");  // the rest of q, this thread's copies
#endif
            mbar_arrive(q_full);                        // (release: the tail's sums and the turned q)
            STAMP(23);
#else
            cp_async_arrive(q_full);
            if (p == 0) mbar_arrive(q_full);
#endif
            for (int t = 0; t < nt; ++t) issue(t);
        }
    } else {                                            // the math warpgroups: 64 heads x their half of d
        asm volatile("setmaxnreg.inc.sync.aligned.u32 216;");
        // (the warpgroup and the tile count through a shuffle: warp-uniform to the compiler, so the wgmmas under
        // branches on them are not serialized)
        const int wg = __shfl_sync(0xffffffff, tid >> 7, 0), tw = tid & 127, w = tw >> 5, l = tid & 31;
        const int rA = 16 * w + (l >> 2), cq = 2 * (l & 3);
        const float LOG2E = 1.4426950408889634f;
        long long *tr = TRACE && a.trace && tid == 0 ? a.trace + blockIdx.x * 32 : nullptr, t0 = TRACE ? clock64() : 0;
        if (TRACE && tr) {
            unsigned sm;
            asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
            tr[13] = sm;
        }
        int u0 = 0, u1 = 0, it = 0, nt_pre = 0;
        bool pre = false;                               // DEFER: this item's first QK already issued
        float sc[32];                                   // a tile's scores, then its P (fp32)
        unsigned valid = 0;                             // the tile's valid picks, 2 bits a register pair
        // this warpgroup's QK of the tile in its slot (its g-th use): wait, flags, the wgmmas, committed
        auto qk_issue = [&](int g) {
            mbar_wait(kv_full + 8 * wg, g & 1);
            STAMP(1);
            valid = 0;
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
                const unsigned short f = *(volatile unsigned short *)(flags + 64 * wg + 8 * jj + cq);
                valid |= ((f & 1u) | ((f >> 7) & 2u)) << (2 * jj);
            }
            if (TRACE && tr) tr[15] += 1;
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // cp.async's rows, seen by wgmma
            unsigned qb = base + SQ_OFF, kt = base + SK_OFF + wg * ST_BYTES;
            asm volatile("" : "+r"(qb), "+r"(kt));
            wgmma_fence();
#pragma unroll
            for (int k = 0; k < 32; ++k) {
                const unsigned off = (k >> 2) * 8192 + (k & 3) * 32;
                wgmma_ss(sc, desc(qb + off, LBO_K), desc(kt + off, LBO_K), k);
            }
            asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        };
#if QROPE
        // q's norm, each head's RMS a factor of its scores, summed here in round 0 before its QK (under the tile's
        // wait): this thread's part of its rows' (rA, rA + 8) sums of squares over the channels before the tail: chunks
        // 8 m + 4 wg + l % 4 (sw_off's terms: the same swizzled slot for both rows, 1024 bytes apart), a quad's
        float pA = 0.0f, pB = 0.0f;
        auto q_sums = [&]() {
            const unsigned char *qa = smem + SQ_OFF + rA * 128 + (((4 * wg + (l & 3)) ^ (rA & 7)) << 4);
            float a4[4] = {0.0f, 0.0f, 0.0f, 0.0f}, b4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int m = 0; m < 8 - QRF / 64; ++m) {
                const uint4 va = *(const uint4 *)(qa + m * 8192), vb = *(const uint4 *)(qa + 1024 + m * 8192);
                const unsigned wa[4] = {va.x, va.y, va.z, va.w}, wb[4] = {vb.x, vb.y, vb.z, vb.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    a4[e] = fmaf(bf16_hi(wa[e]), bf16_hi(wa[e]), fmaf(bf16_lo(wa[e]), bf16_lo(wa[e]), a4[e]));
                    b4[e] = fmaf(bf16_hi(wb[e]), bf16_hi(wb[e]), fmaf(bf16_lo(wb[e]), bf16_lo(wb[e]), b4[e]));
                }
            }
            pA = (a4[0] + a4[1]) + (a4[2] + a4[3]);
            pB = (b4[0] + b4[1]) + (b4[2] + b4[3]);
            pA += __shfl_xor_sync(0xffffffff, pA, 1); pA += __shfl_xor_sync(0xffffffff, pA, 2);
            pB += __shfl_xor_sync(0xffffffff, pB, 1); pB += __shfl_xor_sync(0xffffffff, pB, 2);
        };
        float msA = 0.0f, msB = 0.0f;                   // the item's q factors (scale x 1 / rms), from round 0
#endif
        for (int item = first; item < last; item += stride, ++it) {
            const int hb = item % HB, bs = item / HB, b = bs / a.S, s = bs % a.S, h0 = hb * 64;
            if (TRACE && tr) tr[14] += 1;
            float mA = a.sinks[h0 + rA] * LOG2E, mB = a.sinks[h0 + rA + 8] * LOG2E;   // the sink starts the max...
            float lA = wg == 0 && (l & 3) == 0 ? 1.0f : 0.0f, lB = lA;               // ... and the sum (one lane)
            float o[4][32];
#pragma unroll
            for (int cb = 0; cb < 4; ++cb)
#pragma unroll
                for (int i = 0; i < 32; ++i) o[cb][i] = 0.0f;
            // FINISH(BODY): the output's last part, and with DEFER the next item's q, its tile count and its first QK
            // under it (issued and waited for in one branch: one wgmma stage, no accumulator across a merge; a macro,
            // as NVRTC takes no generic lambda)
#define FINISH(BODY) do { \
                pre = false; \
                bool done = false; \
                if (DEFER && item + stride < last) { \
                    mbar_wait(q_full, (it + 1) & 1); \
                    nt_pre = __shfl_sync(0xffffffff, info[0], 0); \
                    pre = true; \
                    if (nt_pre > 0 && (wg == 0 || nt_pre > 1)) { \
                        qk_issue(wg ? u1 : u0); \
                        BODY; \
                        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); \
                        _Pragma("unroll") for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(sc[i]) :: "memory"); \
                        done = true; \
                    } \
                } \
                if (!done) { BODY; } \
            } while (0)
            STAMP(6);
            if (!pre) mbar_wait(q_full, it & 1);
            STAMP(0);
            const int nt = pre ? nt_pre : __shfl_sync(0xffffffff, info[0], 0);
            if (nt == 0) mbar_arrive(q_empty);
            // rounds of two tiles: warpgroup 0 takes tile tt (slot 0), warpgroup 1 tile tt + 1 (slot 1)
            for (int tt = 0; tt < nt; tt += 2) {
                const bool two_t = tt + 1 < nt, mine = wg == 0 || two_t, other = wg == 1 || two_t;
                // (the shared addresses opaque each round: the descriptors are made at their wgmmas, not hoisted out
                // of the loops into ~100 live registers). vown / voth are kt / ko wherever the PV cases below use
                // them; the selects (and pa's zeros) stay as measured: without them ptxas schedules otherwise
                unsigned kt = base + SK_OFF + wg * ST_BYTES, ko = base + SK_OFF + (wg ^ 1) * ST_BYTES,
                         pb = base + SP_OFF + 8192 * (wg ^ 1);
                unsigned vown = mine ? kt : ko, voth = other ? ko : kt;
                asm volatile("" : "+r"(pb), "+r"(vown), "+r"(voth));
                STAMP(7);
#if QROPE
                if (tt == 0) q_sums();                  // (under the tile's wait)
#endif
                if (mine && !(pre && tt == 0)) {        // (DEFER: round 0's scores came with the last output)
                    qk_issue(wg ? u1 : u0);
                    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
                    for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(sc[i]) :: "memory");   // (landed here)
                }
                pre = false;
                STAMP(2);
#if QROPE
                // round 0: this warpgroup's part of the sums out, the tail's in (read before q_empty); both
                // warpgroups add the three in one order (the same factors on both sides)
                float tA = 0.0f, tB = 0.0f;
                if (tt == 0) {
                    if ((l & 3) == 0) { qsp[64 * wg + rA] = pA; qsp[64 * wg + rA + 8] = pB; }
                    if (QRF > 0) { tA = tsq[rA]; tB = tsq[rA + 8]; }
                }
#else
                const float scA = a.qk_scale, scB = a.qk_scale;
#endif
                if (tt + 2 >= nt) mbar_arrive(q_empty); // the copy warpgroup may bring the next item's q
                // online softmax (exp2 domain); row A = registers i with i / 2 even, row B the others. The scale
                // (> 0) goes into one FFMA a score: the max runs on the raw scores, masked ones -inf
                float xA = NEG_INF, xB = NEG_INF;
                if (mine) {
#pragma unroll
                    for (int i = 0; i < 32; ++i) {
                        const float v = (valid >> (2 * (i >> 2) + (i & 1))) & 1 ? sc[i] : NEG_INF;
                        sc[i] = v;
                        if ((i >> 1) & 1) xB = fmaxf(xB, v); else xA = fmaxf(xA, v);
                    }
                    xA = fmaxf(xA, __shfl_xor_sync(0xffffffff, xA, 1));
                    xA = fmaxf(xA, __shfl_xor_sync(0xffffffff, xA, 2));
                    xB = fmaxf(xB, __shfl_xor_sync(0xffffffff, xB, 1));
                    xB = fmaxf(xB, __shfl_xor_sync(0xffffffff, xB, 2));
                }
                // the other warpgroup's tile maxima: both sides take the same new max (fmaxf: exact, either order)
                if ((l & 3) == 0) { xm[64 * wg + rA] = xA; xm[64 * wg + rA + 8] = xB; }
                // (TMAO: warpgroup 0's staging, the P tiles, read out by its last item's TMA stores before any P)
                if (TMAO && tt == 0 && tw == 0 && wg == 0)
                    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
                asm volatile("bar.sync 4, 256;" ::: "memory");
                STAMP(3);
#if QROPE
                if (tt == 0) {
                    msA = a.qk_scale * (1.0f / sqrtf(((qsp[rA] + qsp[64 + rA]) + tA) / 512.0f + a.eps));
                    msB = a.qk_scale * (1.0f / sqrtf(((qsp[rA + 8] + qsp[64 + rA + 8]) + tB) / 512.0f + a.eps));
                }
                const float scA = msA, scB = msB;
#endif
                xA = fmaxf(xA, xm[64 * (wg ^ 1) + rA]);
                xB = fmaxf(xB, xm[64 * (wg ^ 1) + rA + 8]);
                const float nA = fmaxf(mA, xA * scA), nB = fmaxf(mB, xB * scB);
                const float aA = ex2(mA - nA), aB = ex2(mB - nB);
                const bool moved = mA != nA || mB != nB;
                mA = nA; mB = nB;
                float sA = 0.0f, sB = 0.0f;
                unsigned pa[16];
#pragma unroll
                for (int j = 0; j < 16; ++j) pa[j] = 0;
                if (mine) {
#pragma unroll
                    for (int i = 0; i < 32; ++i) {
                        const bool rowB = (i >> 1) & 1;
                        const float pv = ex2(fmaf(sc[i], rowB ? scB : scA, rowB ? -nB : -nA));
                        sc[i] = pv;
                        if (rowB) sB += pv; else sA += pv;
                    }
#pragma unroll
                    for (int j = 0; j < 16; ++j) pa[j] = pack_bf16(sc[2 * j], sc[2 * j + 1]);
                }
                if (mine) {
                    // P into this warpgroup's tile (K-major, the 128-byte swizzle) for the other's PV
                    unsigned char *pt = smem + SP_OFF + 8192 * wg;
#pragma unroll
                    for (int jj = 0; jj < 8; ++jj) {
                        *(unsigned *)(pt + rA * 128 + ((jj ^ (rA & 7)) << 4) + 2 * cq) = pa[2 * jj];
                        *(unsigned *)(pt + (rA + 8) * 128 + ((jj ^ (rA & 7)) << 4) + 2 * cq) = pa[2 * jj + 1];
                    }
                    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // P, to wgmma's proxy
                }
                lA = lA * aA + sA; lB = lB * aB + sB;
                // (an unmoved max has a = 1 exactly: the same bits; round 0's accumulator is zeros, times a in [0, 1])
                if (tt > 0 && __any_sync(0xffffffff, moved)) {
#pragma unroll
                    for (int cb = 0; cb < 4; ++cb)
#pragma unroll
                        for (int i = 0; i < 32; ++i) o[cb][i] *= ((i >> 1) & 1) ? aB : aA;
                }
                STAMP(4);
                asm volatile("bar.sync 4, 256;" ::: "memory");           // both P tiles in shared memory
                STAMP(16);
#define PV_OWN _Pragma("unroll") for (int k = 0; k < 4; ++k) \
                    _Pragma("unroll") for (int cb = 0; cb < 4; ++cb) \
                    wgmma_rs(o[cb], pa + 4 * k, desc(vown + (4 * wg + cb) * 8192 + k * 2048, LBO_V));
#define PV_OTHER _Pragma("unroll") for (int k = 0; k < 4; ++k) \
                    _Pragma("unroll") for (int cb = 0; cb < 4; ++cb) \
                    wgmma_sv(o[cb], desc(pb + k * 32, LBO_K), desc(voth + (4 * wg + cb) * 8192 + k * 2048, LBO_V));
                // each case its own wgmma stage (ptxas serialises wgmmas whose accumulators meet at a branch's
                // merge): a round with one tile (an odd last one) runs only its PV, 16 wgmmas a warpgroup
                if (two_t) { wgmma_fence(); PV_OWN PV_OTHER wgmma_commit_wait(); }
                else if (wg == 0) { wgmma_fence(); PV_OWN wgmma_commit_wait(); }
                else { wgmma_fence(); PV_OTHER wgmma_commit_wait(); }
                STAMP(5);
                mbar_arrive(kv_empty);                  // both slots' keys used up by this warpgroup
                ++u0;
                if (two_t) { mbar_arrive(kv_empty + 8); ++u1; }
            }
            lA += __shfl_xor_sync(0xffffffff, lA, 1); lA += __shfl_xor_sync(0xffffffff, lA, 2);
            lB += __shfl_xor_sync(0xffffffff, lB, 1); lB += __shfl_xor_sync(0xffffffff, lB, 2);
            volatile float *lsi = ls + 128 * (it & 1);
            if ((l & 3) == 0) { lsi[64 * wg + rA] = lA; lsi[64 * wg + rA + 8] = lB; }
            // (TMAO: warpgroup 1's staging read out by its last item's TMA stores)
            if (TMAO && tw == 0 && wg == 1) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
            asm volatile("bar.sync 4, 256;" ::: "memory");   // both sums; both PVs done with the P tiles
            STAMP(19);
            const float fA = 1.0f / (lsi[rA] + lsi[64 + rA]), fB = 1.0f / (lsi[rA + 8] + lsi[64 + rA + 8]);
            constexpr int OB = FP8 ? 1 : 2, ROWB = HALF * OB;     // output bytes an element, a row's half
            unsigned char *orow = (unsigned char *)a.out + (b * a.s_ob + s * a.s_os + (long long)h0 * a.s_oh
                                                            + wg * HALF) * OB;
            if (nt == 0) {                              // nothing picked: zeros (the sink took all)
                for (int e = tw; e < 64 * ROWB / 16; e += 128)
                    *(uint4 *)(orow + (e / (ROWB / 16)) * a.s_oh * OB + (e % (ROWB / 16)) * 16) =
                        make_uint4(0, 0, 0, 0);
#if FP8
                const unsigned sb = pow2_scale(1e-4f);
                a.scales[((h0 + (tw >> 1)) * 4 + wg * 2 + (tw & 1)) * (long long)a.M + bs] = __uint_as_float(sb);
#endif
                FINISH((void)0);
            } else {
                // the core's output rounded to q's dtype (bf16), then the steps after it as the unfused chain runs
                // them (core_kernel._epilogue's math, its roundings in its order)
#pragma unroll
                for (int cb = 0; cb < 4; ++cb)
#pragma unroll
                    for (int i = 0; i < 32; i += 2) {
                        // (i, i + 1): one row, two channels, one cvt.rn.bf16x2 (two roundings' bits)
                        const float f = ((i >> 1) & 1) ? fB : fA;
                        const unsigned r = pack_bf16(o[cb][i] * f, o[cb][i + 1] * f);
                        o[cb][i] = bf16_lo(r);
                        o[cb][i + 1] = bf16_hi(r);
                    }
#if OROPE
                if (wg == 1) {                          // the tail (ORF a multiple of 64, <= 256): this warpgroup's
                    // last ORF / 64 swizzle columns, ORF / 2 angles: lane l computes angles l + 32 k (one cos / sin
                    // pair a lane a column, not one a register pair), the others read them by shuffles
                    const float pos = (float)a.opos[bs];
                    float ck[ORF / 64], sk[ORF / 64];
#pragma unroll
                    for (int k = 0; k < ORF / 64; ++k) {
                        const float ang = pos * a.ofreq[32 * k + l];
                        ck[k] = cosf(ang);
                        sk[k] = sinf(ang);
                    }
#pragma unroll
                    for (int cb = 4 - ORF / 64; cb < 4; ++cb)
#pragma unroll
                        for (int jj = 0; jj < 8; ++jj) {
                            // channel 8 jj + cq of column cb: tail channel ct, angle ct / 2 = 32 k + 4 jj + l % 4
                            const int k = cb - (4 - ORF / 64);
                            const float c = __shfl_sync(0xffffffff, ck[k], 4 * jj + (l & 3));
                            const float sn = __shfl_sync(0xffffffff, sk[k], 4 * jj + (l & 3));
#pragma unroll
                            for (int rr = 0; rr < 2; ++rr) {      // the inverse turn: (x cos + y sin, y cos - x sin)
                                const int i0 = 4 * jj + 2 * rr;
                                const float x = o[cb][i0], y = o[cb][i0 + 1];
                                const unsigned r = pack_bf16(fmaf(y, sn, x * c), fmaf(x, -sn, y * c));
                                o[cb][i0] = bf16_lo(r);
                                o[cb][i0 + 1] = bf16_hi(r);
                            }
                        }
                }
#endif
                STAMP(20);
#if FP8
                // staged (warpgroup 0 over the P tiles, both PVs done with them; 1 after them): each 16-byte
                // chunk of a row at chunk ^ row % 8, then 16-byte stores, a warp whole rows (TMAO: [the row's two
                // 128-byte halves][64 rows][128 bytes], the 128-byte swizzle of TMA's boxes, and two TMA stores)
                unsigned char *st = smem + SP_OFF + 16384 * wg;
                float invs[2][2];                       // [row A / B][128-channel block]: 1 / s, exact
#pragma unroll
                for (int k = 0; k < 2; ++k)
#pragma unroll
                    for (int rr = 0; rr < 2; ++rr) {
                        float m = 0.0f;
#pragma unroll
                        for (int cb = 2 * k; cb < 2 * k + 2; ++cb)
#pragma unroll
                            for (int jj = 0; jj < 8; ++jj)
                                m = fmaxf(m, fmaxf(fabsf(o[cb][4 * jj + 2 * rr]),
                                                   fabsf(o[cb][4 * jj + 2 * rr + 1])));
                        m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 1));
                        m = fmaxf(fmaxf(m, __shfl_xor_sync(0xffffffff, m, 2)), 1e-4f);
                        const unsigned sb = pow2_scale(m);
                        invs[rr][k] = __uint_as_float(0x7F000000 - sb);
                        if ((l & 3) == 0)
                            a.scales[((h0 + rA + 8 * rr) * 4 + wg * 2 + k) * (long long)a.M + bs] =
                                __uint_as_float(sb);
                    }
#pragma unroll
                for (int cb = 0; cb < 4; ++cb)
#pragma unroll
                    for (int jj = 0; jj < 8; ++jj) {
                        const int c16 = cb * 4 + (jj >> 1), off = ((c16 & 8) | ((c16 & 7) ^ (rA & 7))) * 16
                                                                  + (jj & 1) * 8 + cq;
                        const float iA = invs[0][cb >> 1], iB = invs[1][cb >> 1];
                        // (TMAO: half c16 / 8 at 8192 c16 / 8, rows 128 bytes apart)
                        const int oA = TMAO ? (c16 >> 3) * 8192 + rA * 128 + (off & 127) : rA * 256 + off;
                        *(unsigned short *)(st + oA) = pack_e4m3(o[cb][4 * jj] * iA, o[cb][4 * jj + 1] * iA);
                        *(unsigned short *)(st + oA + (TMAO ? 8 * 128 : 8 * 256)) =
                            pack_e4m3(o[cb][4 * jj + 2] * iB, o[cb][4 * jj + 3] * iB);
                    }
                STAMP(21);
                auto stores = [&]() {
                    if (TMAO) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // staging, to TMA
                    if (wg) asm volatile("bar.sync 3, 128;" ::: "memory");   // (this warpgroup's staging)
                    else asm volatile("bar.sync 2, 128;" ::: "memory");
                    if (PROBE & 16) return;
                    if (TMAO) {
                        if (tw == 0) {                  // rows (b, s, h0 ..), bytes 256 wg + 128 k
                            const int y = bs * a.H + h0;
                            tma_store_2d(om, smem_u32(st), 256 * wg, y);
                            tma_store_2d(om, smem_u32(st + 8192), 256 * wg + 128, y);
                            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
                        }
                        return;
                    }
                    const int c = tw & 15;
#pragma unroll 4
                    for (int i = 0; i < 8; ++i) {
                        const int r = (tw >> 4) + 8 * i;
                        const uint4 v = *(const uint4 *)(st + r * 256 + ((c & 8) | ((c & 7) ^ (r & 7))) * 16);
                        *(uint4 *)(orow + r * a.s_oh + c * 16) = v;
                    }
                };
                FINISH(stores());
#else
                // bf16 out (no room to stage 2 x 32 KB): each thread's pairs straight to global memory
                auto stores = [&]() {
#pragma unroll
                    for (int cb = 0; cb < 4; ++cb)
#pragma unroll
                        for (int jj = 0; jj < 8; ++jj) {
                            const int ch = cb * 64 + 8 * jj + cq;
                            *(unsigned *)(orow + (rA * a.s_oh + ch) * 2) =
                                pack_bf16(o[cb][4 * jj], o[cb][4 * jj + 1]);
                            *(unsigned *)(orow + ((rA + 8) * a.s_oh + ch) * 2) =
                                pack_bf16(o[cb][4 * jj + 2], o[cb][4 * jj + 3]);
                        }
                };
                FINISH(stores());
#endif
            }
        }
        if (TMAO && tw == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");   // (the last TMA stores)
    }
}

#define KERNEL(name, I) \
extern "C" __global__ void __launch_bounds__(384, 1) name(Args a, const I *i1, const I *i2, \
                                                          const __grid_constant__ TMap om) { core<I>(a, i1, i2, &om); }
KERNEL(sparse_core_i32, int)
KERNEL(sparse_core_i64, long long)
"""


class _Args(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_void_p) for n in ("q", "out", "sinks", "kv1", "kv2")]
                + [(n, ctypes.c_int) for n in ("S", "H", "J1", "J2", "two", "n_items")] + [("qk_scale", ctypes.c_float)]
                + [(n, ctypes.c_longlong) for n in ("s_qb", "s_qs", "s_qh", "s_ob", "s_os", "s_oh", "s_k1b", "s_k1m",
                                                    "s_i1b", "s_i1s", "s_k2b", "s_k2m", "s_i2b", "s_i2s")]
                + [("trace", ctypes.c_void_p),
                   ("qpos", ctypes.c_void_p), ("qfreq", ctypes.c_void_p), ("eps", ctypes.c_float),
                   ("opos", ctypes.c_void_p), ("ofreq", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                   ("M", ctypes.c_int)])


_BROKEN: str | None = None
# where a Gluon kernel would run a prefill core (``core_kernel.sparse_attention_fused``), this kernel runs instead;
# False keeps the Gluon kernels (``benchmarks/bench_attn.py --core-cuda on,off`` measures both)
ENABLED = True
# ... for queries of at most this many picks (window + compressed). On one H200, prefill at 4096 tokens, it is
# faster than the Gluon kernels at V4-Flash's sliding (128 picks), HCA (160) and CSA (640) layers and at V4-Pro's
# CSA (1152) (benchmarks/results/attn.md)
MAX_PICKS = 2048
# profiling: compile switches (``;``-separated NAME VALUE pairs, e.g. "PROBE 2") added to every launch's, so that a
# benchmark times the whole layer with them (``benchmarks/bench_attn.py --core-cuda-defines``) and the GPU tests run a
# variant (MOE_WAVE_CORE_CUDA_DEFINES, which tests/conftest.py reads)
DEFINES = ""


@functools.lru_cache(maxsize=None)
def _kernel(device_index: int, idx_bits: int, defines: str = ""):
    with torch.cuda.device(device_index):
        k = torch.cuda._compile_kernel(defines + SRC, f"sparse_core_i{idx_bits}", compute_capability="90a")
        k.set_shared_memory_config(SMEM_BYTES)
    return k


def available() -> bool:
    """A Hopper GPU is current, torch can compile CUDA C++ at run time, and the kernel has not failed here."""
    if _BROKEN is not None or not torch.cuda.is_available() or torch.version.hip is not None:
        return False
    if not hasattr(torch.cuda, "_compile_kernel"):
        return False
    return torch.cuda.get_device_capability()[0] == 9


def supported(q: torch.Tensor, n_parts: int, qrf: int = 0, orf: int = 0, picks: int = 0) -> bool:
    """True when this kernel runs the call: Hopper, bf16, d = 512, whole 64-head blocks, one or two parts; with the
    layer's steps, q's RoPE tail qrf (channels) 0, 64, 128 or 256 and the output's orf a multiple of 64 up to 256
    (V4: 64), both inside the second half of d; picks (J of both parts; 0: not asked) at most ``MAX_PICKS``."""
    if not 1 <= n_parts <= 2 or not q.is_cuda or q.dtype != torch.bfloat16 or picks > MAX_PICKS:
        return False
    if qrf not in (0, 64, 128, 256) or orf % 64 or not 0 <= orf <= 256:
        return False
    return q.shape[-1] == D_FULL and q.shape[-2] % BH == 0 and available()


def mark_broken(err: BaseException) -> None:
    """The kernel failed to compile or launch here: warn once; ``available`` is False from now on."""
    global _BROKEN
    if _BROKEN is None:
        _BROKEN = f"{type(err).__name__}: {err}"
        warnings.warn(f"moe_wave: the CUDA C++ sparse-attention kernel does not run here ({_BROKEN}); the Gluon "
                      f"kernels run instead", stacklevel=3)


def sparse_attention_cuda(q: torch.Tensor, out: torch.Tensor, sinks: torch.Tensor, kv1: torch.Tensor,
                          i1: torch.Tensor, kv2: torch.Tensor, i2: torch.Tensor, scale: float, two: bool, *,
                          trace: torch.Tensor | None = None,
                          probe: int = 0, defines: str = "", q_rope: tuple | None = None,
                          o_rope: tuple | None = None, scales: torch.Tensor | None = None) -> None:
    """Launch on checked tensors (``sparse_attention_gluon``'s contract): q / out [B, S, H, 512] bf16 with the
    last dim contiguous, kv [B, M, 512] bf16 rows contiguous, idx [B, S, J] int32 or int64 with the last dim
    contiguous, sinks fp32 [H].
    trace (profiling, same results): a zeroed int64 [CTAs, 32] tensor (CTAs = ``ctas_resident``); a kernel
    compiled with TRACE adds into it, per CTA, the clock cycles of math warpgroup 0's phases (0 q wait, 1 tile
    wait, 2 QK, 3 the wait for the other warpgroup's row maxima, 4 softmax, 16 the wait for its P, 5 PV, 7 a round's
    top; per item 19 the wait for its row sums, 20 the output's scaling and RoPE, 21 FP8 and staging, 6 the stores
    and the next item's start) and the copy warpgroup's (8 counts, 9 q slot wait and the first picks' loads, per
    item 22 q's copies landing and 23 its prologue; 10 a tile's picks, 11 slot wait, 12 copies issued), 13 the SM,
    14 items, 15 rounds, 24 items whose rows stayed in the window ring. probe (profiling, wrong results): 2 skips the
    tiles' copies, 8 q's RoPE turn, 16 the output's stores. defines (profiling): more ``#define`` lines for the
    compile (``;``-separated NAME VALUE pairs; ``DEFINES`` is added to them; NOREUSE 1 copies every row of the
    window ring, NOTMA 1 stores with the threads where TMA would, DEFER 0 / 1 the next QK's place).

    One part of exactly 128 picks (a sliding window's) runs the window ring (WRING): the two tile slots hold the
    picked rows, pick j of query s at row (s - j) % 128, each CTA takes a contiguous run of items, and an item whose
    picks are the last item's (the next head block) or the last item's moved on by one, newest first (the next
    query's window, ``kernels.picks``) copies only its new row. Its sums run in an order set by s alone, so the bits
    do not depend on which rows stayed.

    The layer's steps around the core, as ``sparse_attention_gluon``'s warp-specialized kernel takes them (its
    contract and math): q_rope = (pos [B*S], freq fp32 [F], eps): q is raw and gets ``kernels.norm_rope``'s per-head
    RMSNorm (a factor of the head's scores: within bf16 rounding of the chain) and RoPE of its last 2F channels (in
    shared memory as it arrives); o_rope = (pos [B*S], freq fp32 [F]): the inverse RoPE of the output's last 2F
    channels; scales (fp32 [H*d/128, B*S]): out is e4m3 [B, S, H, d] and gets ``fp8.act_quant``'s format. The
    output's steps have the unfused chain's bits (``core_kernel._epilogue``'s roundings in its order)."""
    B, S, H, D = q.shape
    if D != D_FULL or H % BH or q.dtype != torch.bfloat16:
        raise ValueError(f"sparse_attention_cuda: q must be bf16 [B, S, H, {D_FULL}] with H a multiple of {BH}, "
                         f"got {q.dtype} {tuple(q.shape)}")
    for name, t in (("q", q), ("out", out), ("kv1", kv1), ("kv2", kv2), ("i1", i1), ("i2", i2)):
        if t.stride(-1) != 1:
            raise ValueError(f"sparse_attention_cuda: {name}'s last dim must be contiguous, strides {t.stride()}")
    for name, t in (("q", q), ("out", out), ("kv1", kv1), ("kv2", kv2)):     # 16-byte copies and stores
        if t.data_ptr() % 16 or any(st % 8 for st in t.stride()[:-1]):
            raise ValueError(f"sparse_attention_cuda: {name} must be 16-byte aligned with strides that are multiples "
                             f"of 8 elements, got strides {t.stride()} at address {t.data_ptr():#x}")
    odt = torch.float8_e4m3fn if scales is not None else torch.bfloat16
    if out.dtype != odt or out.shape != q.shape or kv1.dtype != q.dtype or kv2.dtype != q.dtype:
        raise ValueError(f"sparse_attention_cuda: out must be q's shape in {odt} (scales given: FP8) and kv bf16, got "
                         f"out {out.dtype} {tuple(out.shape)}, kv {kv1.dtype} / {kv2.dtype}")
    if scales is not None and not (scales.dtype == torch.float32 and scales.is_contiguous()
                                   and tuple(scales.shape) == (H * D // 128, B * S)):
        raise ValueError(f"sparse_attention_cuda: scales must be contiguous fp32 [{H * D // 128}, {B * S}], got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    qrf = 2 * q_rope[1].numel() if q_rope is not None else 0
    orf = 2 * o_rope[1].numel() if o_rope is not None else 0
    if qrf not in (0, 64, 128, 256) or orf % 64 or orf > 256:
        raise ValueError(f"sparse_attention_cuda: RoPE tails of q ({qrf} channels) / the output ({orf}) must be 0, 64, "
                         f"128 or 256 / a multiple of 64 up to 256")
    pos = [t[0] for t in (q_rope, o_rope) if t is not None]
    if any(p.numel() != B * S or not p.is_contiguous() or p.dtype not in (torch.int32, torch.int64) for p in pos) \
            or len({p.dtype for p in pos}) > 1:
        raise ValueError(f"sparse_attention_cuda: positions must be contiguous int32 / int64 [{B * S}] of one dtype, "
                         f"got {[(p.dtype, tuple(p.shape)) for p in pos]}")
    for name, t in (("q_rope", q_rope), ("o_rope", o_rope)):
        if t is not None and not (t[1].dtype == torch.float32 and t[1].is_contiguous()):
            raise ValueError(f"sparse_attention_cuda: {name}'s frequencies must be contiguous fp32")
    if i1.dtype != i2.dtype or i1.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sparse_attention_cuda: the picks must both be int32 or int64, got {i1.dtype} / {i2.dtype}")
    if sinks.dtype != torch.float32 or not sinks.is_contiguous():
        sinks = sinks.float().contiguous()
    J1, J2 = i1.shape[-1], (i2.shape[-1] if two else 0)
    n_items = B * S * (H // BH)
    a = _Args(q.data_ptr(), out.data_ptr(), sinks.data_ptr(), kv1.data_ptr(), kv2.data_ptr(), S, H, J1, J2, int(two),
              n_items, float(scale) * 1.4426950408889634, q.stride(0), q.stride(1), q.stride(2), out.stride(0),
              out.stride(1), out.stride(2), kv1.stride(0), kv1.stride(1), i1.stride(0), i1.stride(1),
              kv2.stride(0), kv2.stride(1), i2.stride(0), i2.stride(1),
              trace.data_ptr() if trace is not None else None,
              q_rope[0].data_ptr() if q_rope else None, q_rope[1].data_ptr() if q_rope else None,
              float(q_rope[2]) if q_rope else 0.0, o_rope[0].data_ptr() if o_rope else None,
              o_rope[1].data_ptr() if o_rope else None, scales.data_ptr() if scales is not None else None, B * S)
    n_ctas = min(n_items, ctas_resident(q.device.index))
    if trace is not None and not (trace.dtype == torch.int64 and trace.is_contiguous()
                                  and trace.numel() >= 32 * n_ctas):
        raise ValueError(f"sparse_attention_cuda: trace must be a contiguous int64 tensor of >= {32 * n_ctas} elements")
    defines = ";".join(d for d in (DEFINES, defines) if d)
    defines = ("#define TRACE 1\n" if trace is not None else "") + (f"#define PROBE {probe}\n" if probe else "") \
        + "".join(f"#define {d.strip()}\n" for d in defines.split(";") if d.strip())
    if q_rope is not None:
        defines += f"#define QROPE 1\n#define QRF {qrf}\n"
    if o_rope is not None:
        defines += f"#define OROPE 1\n#define ORF {orf}\n"
    if scales is not None:
        defines += "#define FP8 1\n"
    if not two and J1 == 2 * 64:                   # one part of two whole tiles: a sliding window's ring
        defines += "#define WRING 1\n"
    tmap = _tmap_rows(out, B * S * H) if scales is not None and out.is_contiguous() else None
    if tmap is not None:                           # FP8 rows of 512 bytes: TMA stores
        defines += "#define TMAO 1\n"
    if pos and pos[0].dtype == torch.int32:
        defines += "#define POS_T int\n"
    k = _kernel(q.device.index, 32 if i1.dtype == torch.int32 else 64, defines)
    _launch(k, n_ctas, a, i1, i2, tmap)


@functools.lru_cache(maxsize=None)
def ctas_resident(device_index: int) -> int:
    """CTAs the GPU holds at once (the persistent grid): SMs x CTAs an SM (the driver's occupancy for THREADS and
    SMEM_BYTES: 1 on an H200)."""
    k = _kernel(device_index, 32)
    lib = torch.cuda._utils._get_gpu_runtime_library()
    n = ctypes.c_int(0)
    rc = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), k.func, THREADS, ctypes.c_size_t(SMEM_BYTES))
    per_sm = n.value if rc == 0 and n.value > 0 else 1
    return max(1, torch.cuda.get_device_properties(device_index).multi_processor_count * per_sm)


TMAP_BYTES = 128            # sizeof(CUtensorMap)
_NO_TMAP = (ctypes.c_uint8 * TMAP_BYTES)()      # the tensor map argument of a kernel that has none (TMAO 0)


def _tmap_rows(out: torch.Tensor, rows: int):
    """A CUtensorMap of ``out`` (FP8, contiguous) as ``rows`` rows of 512 bytes, boxes of 64 rows x 128 bytes in the
    128-byte swizzle (the kernel's TMAO staging), by the driver's cuTensorMapEncodeTiled; None where the driver
    refuses it (the kernel then stores with its threads)."""
    lib = torch.cuda._utils._get_gpu_runtime_library()
    enc = getattr(lib, "cuTensorMapEncodeTiled", None)
    if enc is None:
        return None
    buf = (ctypes.c_uint8 * (TMAP_BYTES + 64))()       # the map 64-byte aligned inside
    addr = ctypes.addressof(buf) + (-ctypes.addressof(buf)) % 64
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    rc = enc(ctypes.c_void_p(addr), ctypes.c_int(0), u32(2), ctypes.c_void_p(out.data_ptr()),   # UINT8, rank 2
             (u64 * 2)(D_FULL, rows), (u64 * 1)(D_FULL), (u32 * 2)(128, BH), (u32 * 2)(1, 1),
             ctypes.c_int(0), ctypes.c_int(3), ctypes.c_int(0), ctypes.c_int(0))  # no interleave, 128B swizzle
    return (buf, addr) if rc == 0 else None


def _launch(k, n_ctas: int, a: _Args, i1: torch.Tensor, i2: torch.Tensor, tmap=None) -> None:
    """cuLaunchKernel with the argument struct and the output's tensor map (zeros where the kernel has none) by value
    (torch's launcher passes ints and doubles only)."""
    lib = torch.cuda._utils._get_gpu_runtime_library()
    p1, p2 = ctypes.c_void_p(i1.data_ptr()), ctypes.c_void_p(i2.data_ptr())
    buf, addr = tmap if tmap is not None else (_NO_TMAP, ctypes.addressof(_NO_TMAP))   # (buf: alive till the launch)
    params = (ctypes.c_void_p * 4)(ctypes.cast(ctypes.byref(a), ctypes.c_void_p),
                                   ctypes.cast(ctypes.byref(p1), ctypes.c_void_p),
                                   ctypes.cast(ctypes.byref(p2), ctypes.c_void_p), ctypes.c_void_p(addr))
    stream = torch.cuda.current_stream()
    rc = lib.cuLaunchKernel(k.func, n_ctas, 1, 1, THREADS, 1, 1, SMEM_BYTES, stream._as_parameter_, params, None)
    if rc != 0:
        raise RuntimeError(f"sparse_attention_cuda: cuLaunchKernel returned CUresult {rc}")

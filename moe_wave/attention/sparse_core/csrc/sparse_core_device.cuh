// The sparse core's device helpers: shared-memory addresses, mbarriers, cp.async, wgmma, conversions, the
// kernel's argument struct. Included by sparse_core.cu; the Python side prepends the variant's #defines.
#pragma once

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

#define NEG_INF (-__int_as_float(0x7f800000))
// Profiling hooks, defined only by dev/'s instrumented builds (dev/trace_core_cuda.py), never by the library:
// TRACE (same results) adds each phase's clock cycles into a.trace; PROBE, NOREUSE and NOTMA (below) change the work
#ifndef TRACE
#define TRACE 0
#endif
// the layer's steps around the core (compile-time, sparse_core.cuda_build.Variant): QROPE q arrives raw, gets each head's
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
// were copied (NOREUSE 1, profiling: copies every row)
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
// DEFER (with the window ring, whose next rows are there early): the next item's first QK issued under this item's
// output stores, as the tensor cores idle there (it waits for the next item's q and tiles first)
#define DEFER WRING
// QTAIL (with the window ring, QROPE with QRF > 0): q's RoPE tail chunks are copied first, as their own cp.async
// group, and turned by the copy warpgroup while the rest of q lands (elsewhere all of q lands first)
#define QTAIL (QROPE && QRF > 0 && WRING)
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


// The routed experts' first grouped FP8 GEMM with SwiGLU + requant in its epilogue, for Hopper (sm_90a):
// fp8_expert_kernels.gate_up_swiglu's math and output on warp-specialised wgmma (moe_wave/gate_up_cuda.py has the
// design and the launch). Compiled by NVRTC at run time with the variant's #defines in front; the PTX helpers
// (mbarriers, cp.async, wgmma descriptors, conversions, the tensor-map parameter) are the sparse core's header.
#include "sparse_core_device.cuh"

#ifndef STAGES
#define STAGES 4            // the software pipeline's depth (a stage: 128 rows, 128 gate + 128 up weight rows)
#endif
#ifndef SRC
#define SRC 0               // 1: the layout's row j is received row src[j] (read where it arrived), else row j
#endif
#ifndef CLUSTER
#define CLUSTER 2           // CTAs a cluster (1 or 2): a pair takes two row blocks' tiles of the same channels and
#endif                      // shares each weight block by TMA multicast where both blocks are one expert's rows
#define B_BYTES 32768       // a stage's weight rows: gate 128 x 128 B, then up 128 x 128 B, 128-byte swizzle
#define A_BYTES 16384       // a stage's rows: 128 x 128 B, 128-byte swizzle
#define SA_BYTES 512        // a stage's row scales (128 fp32)
#define OFF_A (STAGES * B_BYTES)
#define OFF_SA (OFF_A + STAGES * A_BYTES)
#define OFF_TBL (OFF_SA + STAGES * SA_BYTES)
#define OFF_BAR (OFF_TBL + 128 * 8)
#define LOG2E 1.4426950408889634f

struct GArgs {
    const unsigned char *a; long long a_row;                    // rows (e4m3), SRC: received rows
    const float *sa; long long sa_r, sa_k;                      // row j's scale of step kb: j * sa_r + kb * sa_k
                                                                // (SRC: j = src[j])
    const long long *src;                                       // SRC: [JA] the layout's received rows
    const unsigned char *la; long long la_row; const float *lsa; long long lsa_row; int row0, L;  // SRC: local rows
    const float *ws; const int *starts; const int *bend; const int *n;
    unsigned char *hq; float *hs;
    int E, D, I, G; float limit;                               // G: hs [I/128, G] (G = JA)
};

#define D64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
    "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, " \
    "%43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define F8(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
    "+f"(d[i + 6]), "+f"(d[i + 7])
#define D64_OUT(d) F8(d, 0), F8(d, 8), F8(d, 16), F8(d, 24), F8(d, 32), F8(d, 40), F8(d, 48), F8(d, 56)

// m64n128k32, e4m3 x e4m3 -> fp32, both operands K-major in shared memory; acc 0 overwrites d
__device__ __forceinline__ void wgmma_e4m3(float *d, u64 da, u64 db, int acc) {
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %66, 0;\n\t"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " D64 ", %64, %65, p, 1, 1;\n}"
        : D64_OUT(d) : "l"(da), "l"(db), "r"(acc));
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TMap *m, unsigned bar, int x, int y) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], "
                 "[%2];" :: "r"(dst), "l"((u64)m), "r"(bar), "r"(x), "r"(y) : "memory");
}
__device__ __forceinline__ void tma_load_2d_mc(unsigned dst, const TMap *m, unsigned bar, int x, int y,
                                               unsigned short mask) {      // to the same offsets in mask's CTAs
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
                 "[%0], [%1, {%3, %4}], [%2], %5;" :: "r"(dst), "l"((u64)m), "r"(bar), "r"(x), "r"(y), "h"(mask)
                 : "memory");
}
// bar's twin in CTA cta of the cluster, the arrive's default (CTA-scope) release as CUTLASS's ClusterBarrier: the
// arriving warp has only read the stage (wgmma, waited for), so nothing of its needs ordering at cluster scope
__device__ __forceinline__ void mbar_arrive_cta(unsigned bar, unsigned cta) {
    asm volatile("{\n\t.reg .b32 ra;\n\tmapa.shared::cluster.u32 ra, %0, %1;\n\t"
                 "mbarrier.arrive.shared::cluster.b64 _, [ra];\n}" :: "r"(bar), "r"(cta) : "memory");
}
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void cp_async4(unsigned dst, const void *src, unsigned src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ float div_full(float a, float b) {      // Triton's fp32 `/`
    float r;
    asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float ex2_approx(float x) {              // Triton's tl.exp: ex2.approx of x log2(e)
    float y;
    asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float bf16_round(float v) { return bf16_lo(pack_bf16(v, 0.f)); }

// fp8_expert_kernels._swiglu: silu(min(g, limit)) * clamp(u, -limit, limit) (limit > 0), else silu(g) * u, in fp32
__device__ __forceinline__ float swiglu(float g, float u, float limit) {
    if (limit > 0.f) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
    }
    return div_full(g, 1.f + ex2_approx(-g * LOG2E)) * u;
}

// the tile's expert: the last group starting at or before row m0 (groups start at 128-row multiples, in order)
__device__ __forceinline__ int expert_of(const int *starts, int E, int m0) {
    int lo = 0, hi = E;                 // the first group starting after m0
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (__ldg(starts + mid) <= m0) lo = mid + 1; else hi = mid;
    }
    return max(lo - 1, 0);
}

// h of rows g0 and g1 (this thread's 2 x 32 values: h[4i], h[4i + 1] of g0 at channels col + 8i, + 1; h[4i + 2],
// h[4i + 3] of g1), quantised per row and 128 channels (the quad of lanes holds a row's 128), stored where ok0 / ok1;
// the scales of tile t by the quad's first lane (first)
__device__ __forceinline__ void store_h(const GArgs &a, const float *h, long long g0, long long g1, bool ok0,
                                        bool ok1, int col, int t, bool first) {
    float m0a = 0.f, m1a = 0.f;                         // |h| maxima over the quad's 128 channels
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        m0a = fmaxf(m0a, fmaxf(fabsf(h[4 * i]), fabsf(h[4 * i + 1])));
        m1a = fmaxf(m1a, fmaxf(fabsf(h[4 * i + 2]), fabsf(h[4 * i + 3])));
    }
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
        m0a = fmaxf(m0a, __shfl_xor_sync(0xffffffffu, m0a, o));
        m1a = fmaxf(m1a, __shfl_xor_sync(0xffffffffu, m1a, o));
    }
    // pow2_scale_bits: the scale s = pow2_ceil(RN(amax / 448)) and 1 / s, exact powers of two
    const unsigned sb0 = (__float_as_uint(__fdiv_rn(fmaxf(m0a, 1e-4f), 448.f)) + 0x7FFFFFu) & 0x7F800000u;
    const unsigned sb1 = (__float_as_uint(__fdiv_rn(fmaxf(m1a, 1e-4f), 448.f)) + 0x7FFFFFu) & 0x7F800000u;
    const float i0 = __uint_as_float(0x7F000000u - sb0), i1 = __uint_as_float(0x7F000000u - sb1);
    if (ok0) {
        unsigned short *q = (unsigned short *)(a.hq + g0 * a.I + col);
#pragma unroll
        for (int i = 0; i < 16; ++i) q[4 * i] = pack_e4m3(h[4 * i] * i0, h[4 * i + 1] * i0);
        if (first) a.hs[(long long)t * a.G + g0] = __uint_as_float(sb0);
    }
    if (ok1) {
        unsigned short *q = (unsigned short *)(a.hq + g1 * a.I + col);
#pragma unroll
        for (int i = 0; i < 16; ++i) q[4 * i] = pack_e4m3(h[4 * i + 2] * i1, h[4 * i + 3] * i1);
        if (first) a.hs[(long long)t * a.G + g1] = __uint_as_float(sb1);
    }
}

// a 128-channel step's wgmma sums (acc) added to the promoted ones (f), times s0 (rows r0) and s1 (rows r1)
__device__ __forceinline__ void promote(float *f, const float *acc, float s0, float s1) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        f[4 * i] += s0 * acc[4 * i];
        f[4 * i + 1] += s0 * acc[4 * i + 1];
        f[4 * i + 2] += s1 * acc[4 * i + 2];
        f[4 * i + 3] += s1 * acc[4 * i + 3];
    }
}

// a row block's rows in use (up to its group's end) and its expert (-1: none, past the layout's rows in use)
__device__ __forceinline__ int block_rows(const GArgs &a, int mb, int nblocks, int &ex) {
    const int nrows = mb < nblocks ? min(__ldg(a.bend + mb) - mb * 128, 128) : 0;
    ex = nrows > 0 ? expert_of(a.starts, a.E, mb * 128) : -1;
    return nrows;
}

// Tile (b, t): rows b * 128 .. of the layout (those in use: up to their group's end, bend) by h's channels
// t * 128 ..; a cluster of CLUSTER CTAs takes the row blocks CLUSTER u' .. of unit u = u' * NT + t (t fastest), the
// units with a stride of the clusters (one CTA an SM), up to the rows in use (n). Warpgroup 2 loads: each stage's
// 128 rows and their scales by cp.async (gathered through src where SRC, through a per-tile table of the rows'
// addresses in shared memory: a warp instruction moves 4 rows x 128 bytes), the expert's gate and up weight blocks
// (128 x 128 each) by TMA, each CTA of a pair one of them to both where both row blocks are one expert's. Math
// warpgroup w takes rows 64 w .. against the gate block and then the up block (m64n128k32 wgmmas, 4 a 128-channel
// step, one accumulator), promoting each step by the row's and the weight block's scales in fp32 (DeepGEMM's
// promotion); at the tile's end gu, rounded to bf16 as the GEMM would write it, goes through SwiGLU and the requant
// in registers (store_h). A stage is free again when the math warps of every CTA of the cluster are done with it.
extern "C" __global__ void __launch_bounds__(384, 1) gate_up_sm90(const GArgs a, const __grid_constant__ TMap wmap) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const unsigned base = smem_u32(smem);
    const unsigned full = base + OFF_BAR, empty = full + 8 * STAGES;
    const int NT = a.I / 128, DB = a.D / 128;
    const int nblocks = (__ldg(a.n) + 127) / 128;
    const int units = (nblocks + CLUSTER - 1) / CLUSTER * NT;
    const unsigned rank = CLUSTER > 1 ? cluster_rank() : 0;
    const int cl = blockIdx.x / CLUSTER, clusters = gridDim.x / CLUSTER;
    if (threadIdx.x == 0) {
        if (base & 1023) __trap();                      // the swizzle atoms need a 1024-byte aligned base
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full + 8 * s, 129);               // 128 loader threads' cp.async + the TMA's expect_tx
            mbar_init(empty + 8 * s, 8 * CLUSTER);      // the math warps of every CTA of the cluster
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    if (CLUSTER > 1) cluster_sync(); else __syncthreads();
    int stage = 0, phase = 0;

    if (threadIdx.x >= 256) {                           // the loader warpgroup
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        const int p = threadIdx.x - 256, rg = p >> 3, cg = p & 7;
        const unsigned char **tbl = (const unsigned char **)(smem + OFF_TBL);
        for (int u = cl; u < units; u += clusters) {
            const int mb = u / NT * CLUSTER + rank, t = u % NT, m0 = mb * 128;
            int ex, ex2 = -1;
            const int nrows = block_rows(a, mb, nblocks, ex);
            if (CLUSTER > 1) block_rows(a, mb ^ 1, nblocks, ex2);
            const bool shared = CLUSTER > 1 && ex >= 0 && ex == ex2;    // both blocks' weights: one multicast
            if (CLUSTER == 1 && nrows <= 0) continue;
            const bool ok = p < nrows;                  // row p: its address to the table, its scales here
            const unsigned char *arow = nullptr;
            const float *srow = a.sa;
#if SRC
            if (ok) {
                const long long r = __ldg(a.src + m0 + p);
                const bool here = r >= a.row0 && r < a.row0 + a.L;
                arow = here ? a.la + (r - a.row0) * a.la_row : a.a + r * a.a_row;
                srow = here ? a.lsa + (r - a.row0) * a.lsa_row : a.sa + r * a.sa_r;
            }
#else
            if (ok) {
                const long long j = m0 + p;
                arow = a.a + j * a.a_row;
                srow = a.sa + j * a.sa_r;
            }
#endif
            asm volatile("bar.sync 3, 128;" ::: "memory");    // the last tile's table is read
            tbl[p] = arow;
            asm volatile("bar.sync 3, 128;" ::: "memory");
            const int wrow = max(ex, 0) * 2 * a.I + t * 128;  // (a block without rows: any expert's weights)
            for (int kb = 0; kb < DB; ++kb) {
                mbar_wait(empty + 8 * stage, phase ^ 1);
                const unsigned bar = full + 8 * stage, sb = base + stage * B_BYTES;
                if (p == 0) {
                    mbar_expect_tx(bar, B_BYTES);
                    if (shared) {
                        tma_load_2d_mc(sb + rank * (B_BYTES / 2), &wmap, bar, kb * 128, wrow + rank * a.I,
                                       (unsigned short)((1u << CLUSTER) - 1));
                    } else {
                        tma_load_2d(sb, &wmap, bar, kb * 128, wrow);
                        tma_load_2d(sb + B_BYTES / 2, &wmap, bar, kb * 128, wrow + a.I);
                    }
                }
                const unsigned sa_dst = base + OFF_A + stage * A_BYTES;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const int row = rg + 16 * i;
                    const unsigned char *src = tbl[row];
                    cp_async16(sa_dst + row * 128 + ((cg ^ (row & 7)) << 4), src ? src + kb * 128 + cg * 16 : a.a,
                               src ? 16 : 0);
                }
                cp_async4(base + OFF_SA + stage * SA_BYTES + 4 * p, srow + kb * a.sa_k, ok ? 4 : 0);
                cp_async_arrive(bar);
                if (++stage == STAGES) { stage = 0; phase ^= 1; }
            }
        }
        asm volatile("cp.async.wait_all;" ::: "memory");    // (the last copies land before the thread leaves)
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31;
        const int r0 = 64 * wg + warp * 16 + (lane >> 2), r1 = r0 + 8, c0 = 2 * (lane & 3);
        for (int u = cl; u < units; u += clusters) {
            const int mb = u / NT * CLUSTER + rank, t = u % NT, m0 = mb * 128;
            int ex;
            const int nrows = block_rows(a, mb, nblocks, ex);
            if (CLUSTER == 1 && nrows <= 0) continue;
            const float *wsg = a.ws + ((long long)max(ex, 0) * 2 * NT + t) * DB, *wsu = wsg + (long long)NT * DB;
            float fg[64], fu[64], acc[64];
#pragma unroll
            for (int i = 0; i < 64; ++i) fg[i] = fu[i] = 0.f;
            for (int kb = 0; kb < DB; ++kb) {
                const float sg = __ldg(wsg + kb), su = __ldg(wsu + kb);
                mbar_wait(full + 8 * stage, phase);
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // cp.async's rows, seen by wgmma
                const float *sas = (const float *)(smem + OFF_SA + stage * SA_BYTES);
                const float sa0 = sas[r0], sa1 = sas[r1];
                const unsigned pa = base + OFF_A + stage * A_BYTES + wg * 8192, pb = base + stage * B_BYTES;
                wgmma_fence();
#pragma unroll
                for (int k = 0; k < 4; ++k) wgmma_e4m3(acc, desc(pa + 32 * k, LBO_K), desc(pb + 32 * k, LBO_K), k);
                wgmma_commit_wait();
                promote(fg, acc, sa0 * sg, sa1 * sg);
                wgmma_fence();
#pragma unroll
                for (int k = 0; k < 4; ++k)
                    wgmma_e4m3(acc, desc(pa + 32 * k, LBO_K), desc(pb + B_BYTES / 2 + 32 * k, LBO_K), k);
                wgmma_commit_wait();
                if (CLUSTER > 1) {
                    if (lane < CLUSTER) mbar_arrive_cta(empty + 8 * stage, lane);   // lane c: CTA c's barrier
                } else if (lane == 0) {
                    mbar_arrive(empty + 8 * stage);
                }
                promote(fu, acc, sa0 * su, sa1 * su);
                if (++stage == STAGES) { stage = 0; phase ^= 1; }
            }
#pragma unroll
            for (int i = 0; i < 64; ++i) fg[i] = swiglu(bf16_round(fg[i]), bf16_round(fu[i]), a.limit);
            store_h(a, fg, m0 + r0, m0 + r1, r0 < nrows, r1 < nrows, t * 128 + c0, t, c0 == 0);
        }
    }
    if (CLUSTER > 1) cluster_sync();        // no CTA leaves while its pair may still arrive on its barriers
}

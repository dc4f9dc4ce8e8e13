// The sparse attention core's prefill kernel for Hopper (sm_90a): one CTA an item and an SM, two math
// warpgroups and a copy warpgroup (sparse_core/cuda_impl.py has the design). Compiled by NVRTC at run time
// (sparse_core/cuda_build.py) with the variant's #defines in front.
#include "sparse_core_device.cuh"

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

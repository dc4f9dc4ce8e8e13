// The routed experts' first grouped FP8 GEMM with SwiGLU + requant in its epilogue, for Hopper (sm_90a).
//
// DeepGEMM's SM90 1D2D FP8 GEMM (deep_gemm/include/deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh, DeepGEMM 54e2261,
// MIT licence, (c) DeepSeek) with its pipeline, scheduler and promotion kept as they are, on BLOCK_M = BLOCK_N =
// BLOCK_K = 128 (with GU_CLUSTER = 2, clusters of two CTAs that run m-blocks m and m + 1 of one expert at the same
// n-block, as DeepGEMM's scheduler pairs them for its multicast on B: CTA r loads weight tile r, gate or up, for
// both by TMA multicast), and three changes:
//  - a scheduled block (m, n) is the pair of 128-channel tiles n of gate and n of up (weight rows n * 128 and
//    I + n * 128 of the expert): a stage holds the rows' 128 x 128 tile and both weight tiles, and each k-block runs
//    the gate tile's WGMMAs, promotes them into the gate's sums, then the up tile's into the up's (one set of
//    accumulators, reused), so the rows' tile is read once for both;
//  - the epilogue: h = silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32 (limit <= 0: no clamp) with the
//    same instructions as fp8_expert_kernels._swiglu, quantised per (row, 128 channels) to e4m3 with a
//    power-of-two scale (moe_wave.fp8's activation format, fp8_quant.pow2_scale_bits): the quad of lanes holding a
//    row's 128 channels shares the row's amax by shuffles;
//  - h is staged in shared memory in the 128-byte swizzle and written by one TMA store; its scales go to
//    hs[(row / G) * (I / 128) * G + n * G + row % G] (G: the masked layout's group rows, or all rows);
//  - with GU_SRC (the contiguous layout), the rows are read where they arrived: row j of the layout is source row
//    r = src[j] of the received FP8 rows (or of the local rows where row0 <= r < row0 + L). The TMA warp's 32
//    lanes each take 4 of a block's rows: per k-block one TMA box of one row (128 bytes, the map's 128-byte
//    swizzle, which follows the shared memory address, so the rows land as the 128-row box lands them) and the
//    row's scale by a load and a shared store; each lane arrives on the stage's full barrier.
// moe_wave/gate_up_dg.py compiles it (nvcc, DeepGEMM's include directory) with the #defines below and launches it.
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>

#include <deep_gemm/comm/barrier.cuh>
#include <deep_gemm/common/math.cuh>
#include <deep_gemm/common/utils.cuh>
#include <deep_gemm/common/tma_copy.cuh>
#include <deep_gemm/common/types.cuh>
#include <deep_gemm/mma/sm90.cuh>
#include <deep_gemm/ptx/ld_st.cuh>
#include <deep_gemm/ptx/utils.cuh>
#include <deep_gemm/ptx/wgmma.cuh>
#include <deep_gemm/scheduler/gemm.cuh>

#ifndef GU_MASKED
#define GU_MASKED 0         // 1: DeepGEMM's masked layout (group x at rows x * G), else the contiguous psum layout
#endif
#ifndef GU_GROUPS
#define GU_GROUPS 1         // experts (groups)
#endif
#ifndef GU_I
#define GU_I 2048           // h's channels (the weights hold 2 * GU_I rows an expert: gate, then up)
#endif
#ifndef GU_K
#define GU_K 4096           // the rows' channels
#endif
#ifndef GU_STAGES
#define GU_STAGES 4
#endif
#ifndef GU_SMS
#define GU_SMS 132          // CTAs (one an SM, persistent)
#endif
#ifndef GU_CLUSTER
#define GU_CLUSTER 1        // 2: the weight tiles multicast to a cluster of two CTAs (GU_I / 128 even)
#endif
#ifndef GU_SRC
#define GU_SRC 0            // 1: the layout's row j is source row src[j], read where it arrived (contiguous layout)
#endif

namespace gate_up_dg {

using namespace deep_gemm;

constexpr uint32_t BLOCK_M = 128, BLOCK_N = 128, BLOCK_K = 128;
constexpr uint32_t kNumStages = GU_STAGES, kNumTMAThreads = 128, kNumMathThreads = 256;
constexpr uint32_t kNumTMAMulticast = GU_CLUSTER;
constexpr GemmType kGemmType = GU_MASKED ? GemmType::MGroupedMasked : GemmType::MGroupedContiguousWithPsumLayout;
constexpr float kLog2e = 1.4426950408889634f;

// the shared memory: h's staging tile, the stages' rows, weights and row scales, the weights' scales, barriers
constexpr uint32_t SMEM_H_SIZE = BLOCK_M * BLOCK_N;
constexpr uint32_t SMEM_A_SIZE_PER_STAGE = BLOCK_M * BLOCK_K;
constexpr uint32_t SMEM_B_TILE = BLOCK_N * BLOCK_K;                 // one weight tile (gate or up)
constexpr uint32_t SMEM_B_SIZE_PER_STAGE = 2 * SMEM_B_TILE;
constexpr uint32_t SMEM_SFA_SIZE_PER_STAGE = BLOCK_M * sizeof(float);
constexpr uint32_t SMEM_SF_OFFSET = SMEM_H_SIZE + kNumStages * (SMEM_A_SIZE_PER_STAGE + SMEM_B_SIZE_PER_STAGE);
constexpr uint32_t SHAPE_K_SCALES = GU_K / BLOCK_K;
constexpr uint32_t SMEM_SFB_SIZE = math::constexpr_align(2 * SHAPE_K_SCALES * (uint32_t) sizeof(float), 8u);
constexpr uint32_t SMEM_SIZE = SMEM_SF_OFFSET + kNumStages * SMEM_SFA_SIZE_PER_STAGE + SMEM_SFB_SIZE
                               + 2 * kNumStages * 8;

// Triton's fp32 `/` and tl.exp (fp8_expert_kernels._swiglu compiles to these)
__device__ __forceinline__ float div_full(float a, float b) {
    float r;
    asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float swiglu(float g, float u, float limit) {
    if (limit > 0.f) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
    }
    return div_full(g, 1.f + ex2_approx(-g * kLog2e)) * u;
}
__device__ __forceinline__ uint16_t pack_e4m3(float lo, float hi) {     // round to nearest even, |v| <= 448
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

}  // namespace gate_up_dg

using namespace gate_up_dg;

extern "C" __global__ void __launch_bounds__(kNumTMAThreads + kNumMathThreads, 1)
gate_up_dg_kernel(const float* sfb, int* grouped_layout, uint32_t shape_m, float* hs, uint32_t hs_group,
                  float limit, const int64_t* src, const float* sa, uint64_t sa_row, uint32_t num_rows,
                  const float* lsa, uint64_t lsa_row, uint32_t row0, uint32_t num_local,
                  const __grid_constant__ cute::TmaDescriptor tensor_map_a,
                  const __grid_constant__ cute::TmaDescriptor tensor_map_b,
                  const __grid_constant__ cute::TmaDescriptor tensor_map_sfa,
                  const __grid_constant__ cute::TmaDescriptor tensor_map_h,
                  const __grid_constant__ cute::TmaDescriptor tensor_map_la) {
#if (defined(__CUDA_ARCH__) and (__CUDA_ARCH__ >= 900))
    using WGMMA = typename mma::sm90::FP8MMASelector<BLOCK_N>::type;
    using Barrier = cutlass::arch::ClusterTransactionBarrier;
    constexpr uint32_t shape_n = GU_I, shape_k = GU_K;
    constexpr uint32_t num_total_k_blocks = SHAPE_K_SCALES;
    constexpr uint32_t shape_n_sfb = 2 * GU_I / BLOCK_K;
    DG_STATIC_ASSERT(BLOCK_M == 2 * WGMMA::M, "one 64-row WGMMA a math warpgroup");
    DG_STATIC_ASSERT(WGMMA::kNumAccum == 64, "m64n128 accumulators");
    DG_STATIC_ASSERT(GU_I % BLOCK_N == 0 and GU_K % BLOCK_K == 0, "whole 128-channel blocks");
    DG_STATIC_ASSERT(SMEM_SIZE <= 232448, "more shared memory than an SM has (fewer GU_STAGES)");
    DG_STATIC_ASSERT(not GU_SRC or not GU_MASKED, "rows where they arrived: the contiguous layout only");
    DG_STATIC_ASSERT(kNumTMAMulticast == 1 or (kNumTMAMulticast == 2 and (GU_I / BLOCK_N) % 2 == 0
                                               and GU_SMS % 2 == 0),
                     "a cluster of two pairs the m-blocks of one n-block: I / 128 and the CTAs even");

    const uint32_t warp_idx = __shfl_sync(0xffffffff, threadIdx.x / 32, 0);
    const uint32_t lane_idx = ptx::get_lane_idx();

    if (warp_idx == kNumMathThreads / 32 and cute::elect_one_sync()) {
        cute::prefetch_tma_descriptor(&tensor_map_a);
        cute::prefetch_tma_descriptor(&tensor_map_b);
        cute::prefetch_tma_descriptor(&tensor_map_sfa);
        cute::prefetch_tma_descriptor(&tensor_map_h);
        if constexpr (GU_SRC)
            cute::prefetch_tma_descriptor(&tensor_map_la);
    }
    __syncwarp();

    extern __shared__ __align__(1024) uint8_t smem_buffer[];
    auto smem_h = smem_buffer;
    auto smem_a = utils::PatternVisitor([&](const uint32_t& i) {
        return reinterpret_cast<__nv_fp8_e4m3*>(smem_buffer + SMEM_H_SIZE + i * SMEM_A_SIZE_PER_STAGE);
    });
    auto smem_b = utils::PatternVisitor([&](const uint32_t& i) {
        return reinterpret_cast<__nv_fp8_e4m3*>(smem_buffer + SMEM_H_SIZE + kNumStages * SMEM_A_SIZE_PER_STAGE
                                                + i * SMEM_B_SIZE_PER_STAGE);
    });
    auto smem_sfa = utils::PatternVisitor([&](const uint32_t& i) {
        return reinterpret_cast<float*>(smem_buffer + SMEM_SF_OFFSET + i * SMEM_SFA_SIZE_PER_STAGE);
    });
    auto smem_sfb = reinterpret_cast<float*>(smem_buffer + SMEM_SF_OFFSET + kNumStages * SMEM_SFA_SIZE_PER_STAGE);

    auto barrier_start_ptr = reinterpret_cast<Barrier*>(reinterpret_cast<uint8_t*>(smem_sfb) + SMEM_SFB_SIZE);
    auto full_barriers  = utils::PatternVisitor([&](const uint32_t& i) { return barrier_start_ptr + i; });
    auto empty_barriers = utils::PatternVisitor([&](const uint32_t& i) { return barrier_start_ptr + kNumStages + i; });

    if (warp_idx == kNumMathThreads / 32 + 1 and cute::elect_one_sync()) {
        #pragma unroll
        for (uint32_t i = 0; i < kNumStages; ++ i) {
            full_barriers[i]->init(GU_SRC ? 32 : 1);         // GU_SRC: each lane of the TMA warp
            // lane c of each math warp arrives on CTA c's barrier (DeepGEMM's way, with or without a cluster)
            empty_barriers[i]->init(kNumTMAMulticast * kNumMathThreads / 32);
        }
        cutlass::arch::fence_barrier_init();
    }
    (kNumTMAMulticast > 1) ? comm::cluster_sync_with_relaxed_arrive() : __syncthreads();

    constexpr uint32_t kNumTMARegisters = GU_SRC ? 48 : 40;   // 128 x 48 + 256 x 232: all 65536 registers
    constexpr uint32_t kNumMathRegisters = 232;

    uint32_t m_block_idx, n_block_idx;
    auto scheduler = sched::Scheduler<kGemmType, BLOCK_M, BLOCK_N, GU_GROUPS, kNumTMAMulticast, false, GU_SMS>(
        shape_m, shape_n, shape_k, grouped_layout);

    uint32_t stage_idx = 0, phase = 0;
    auto advance_pipeline = [&](uint32_t& k_block_idx) {
        ++ k_block_idx;
        stage_idx = stage_idx == kNumStages - 1 ? 0 : stage_idx + 1;
        phase ^= stage_idx == 0;
    };
    constexpr bool kMasked = kGemmType == GemmType::MGroupedMasked;

    if (warp_idx >= kNumMathThreads / 32) {
        // the TMA warpgroup: one thread issues the loads (GU_SRC: the 32 lanes of one warp)
        cutlass::arch::warpgroup_reg_dealloc<kNumTMARegisters>();
        if (warp_idx == kNumMathThreads / 32 + 2 and (GU_SRC or cute::elect_one_sync())) {
            while (scheduler.get_next_block(m_block_idx, n_block_idx)) {
                const uint32_t m_idx = scheduler.template get_global_idx<kMasked>(shape_m, BLOCK_M, m_block_idx);
                // gate rows n * 128 of the expert, up rows I + n * 128; where the scheduler pairs the block with its
                // peer's (the same n-block), CTA r loads tile r for both by multicast
                const uint32_t n_idx = scheduler.current_group_idx * (2 * shape_n) + n_block_idx * BLOCK_N;
                const bool multicast = kNumTMAMulticast > 1 and scheduler.is_tma_multicast_valid(m_block_idx);
                const uint32_t rank = kNumTMAMulticast > 1 ? cute::block_rank_in_cluster() : 0;
                // GU_SRC: this lane's rows lane + 32 t of the block: the source row (bit 31: a local row) and its
                // scales; a source index outside the rows (a position that no pair fills) reads row 0
                uint32_t src_row[4];
                const float* src_sa[4];
                if constexpr (GU_SRC) {
                    #pragma unroll
                    for (uint32_t t = 0; t < 4; ++ t) {
                        const int64_t r = __ldg(src + m_idx + lane_idx + 32 * t);
                        const bool here = r >= row0 and r < static_cast<int64_t>(row0) + num_local;
                        const uint32_t row = here ? static_cast<uint32_t>(r - row0)
                                                  : (r >= 0 and r < num_rows ? static_cast<uint32_t>(r) : 0u);
                        src_row[t] = row | (here ? 0x80000000u : 0u);
                        src_sa[t] = here ? lsa + row * lsa_row : sa + row * sa_row;
                    }
                }
                // (GU_SRC: each k-block's scales are loaded one k-block ahead)
                float scale_a[4], scale_next[4];
                if constexpr (GU_SRC) {
                    #pragma unroll
                    for (uint32_t t = 0; t < 4; ++ t)
                        scale_next[t] = __ldg(src_sa[t]);
                }
                for (uint32_t k_block_idx = 0; k_block_idx < num_total_k_blocks; advance_pipeline(k_block_idx)) {
                    if constexpr (GU_SRC) {
                        #pragma unroll
                        for (uint32_t t = 0; t < 4; ++ t) {
                            scale_a[t] = scale_next[t];
                            if (k_block_idx + 1 < num_total_k_blocks)
                                scale_next[t] = __ldg(src_sa[t] + k_block_idx + 1);
                        }
                    }
                    empty_barriers[stage_idx]->wait(phase ^ 1);
                    auto& full_barrier = *full_barriers[stage_idx];
                    const uint32_t k_idx = k_block_idx * BLOCK_K;
                    if constexpr (GU_SRC) {
                        #pragma unroll
                        for (uint32_t t = 0; t < 4; ++ t) {
                            const uint32_t j = lane_idx + 32 * t;
                            cute::SM90_TMA_LOAD_2D::copy(src_row[t] >> 31 ? &tensor_map_la : &tensor_map_a,
                                     reinterpret_cast<uint64_t*>(&full_barrier),
                                     static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL),
                                     smem_a[stage_idx] + j * BLOCK_K, k_idx, src_row[t] & 0x7FFFFFFFu);
                            ptx::st_shared(smem_sfa[stage_idx] + j, scale_a[t]);
                        }
                        if (lane_idx != 0) {
                            full_barrier.arrive();
                            continue;
                        }
                    } else {
                        tma::copy<BLOCK_K, BLOCK_M, 128, __nv_fp8_e4m3>(&tensor_map_a, &full_barrier,
                                 smem_a[stage_idx], k_idx, m_idx, 1);
                        tma::copy<BLOCK_M, BLOCK_K, 0>(&tensor_map_sfa, &full_barrier,
                                 smem_sfa[stage_idx], m_block_idx * BLOCK_M,
                                 scheduler.template get_global_idx<kMasked, sched::IndexType::SF_K>(
                                     SHAPE_K_SCALES, 1, k_block_idx), 1);
                    }
                    if (multicast) {
                        cute::SM90_TMA_LOAD_MULTICAST_2D::copy(&tensor_map_b,
                                 reinterpret_cast<uint64_t*>(&full_barrier), (1 << kNumTMAMulticast) - 1,
                                 static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL),
                                 smem_b[stage_idx] + rank * SMEM_B_TILE, k_idx, n_idx + rank * shape_n);
                    } else {
                        tma::copy<BLOCK_K, BLOCK_N, 128, __nv_fp8_e4m3>(&tensor_map_b, &full_barrier,
                                 smem_b[stage_idx], k_idx, n_idx, 1);
                        tma::copy<BLOCK_K, BLOCK_N, 128, __nv_fp8_e4m3>(&tensor_map_b, &full_barrier,
                                 smem_b[stage_idx] + SMEM_B_TILE, k_idx, n_idx + shape_n, 1);
                    }
                    // (GU_SRC: the scales came by shared stores, which each lane's arrival releases)
                    full_barrier.arrive_and_expect_tx(SMEM_A_SIZE_PER_STAGE + SMEM_B_SIZE_PER_STAGE
                                                      + (GU_SRC ? 0 : SMEM_SFA_SIZE_PER_STAGE));
                }
            }
            // the peer CTA's last arrivals land before this CTA exits (DeepGEMM's last round of empty waits)
            if constexpr (kNumTMAMulticast > 1) {
                for (uint32_t i = 0; i < kNumStages; advance_pipeline(i))
                    empty_barriers[stage_idx]->wait(phase ^ 1);
            }
        }
    } else {
        // the math warpgroups: 64 rows each
        cutlass::arch::warpgroup_reg_alloc<kNumMathRegisters>();
        const auto math_wg_idx = __shfl_sync(0xffffffff, threadIdx.x / 128, 0);
        const auto r_0 = warp_idx * 16 + lane_idx / 4, r_1 = r_0 + 8;

        auto a_desc = mma::sm90::make_smem_desc(smem_a[0] + math_wg_idx * WGMMA::M * BLOCK_K, 1);
        auto b_desc = mma::sm90::make_smem_desc(smem_b[0], 1);
        const uint32_t a_desc_lo = __shfl_sync(0xffffffff, a_desc.reg32_[0], 0);
        const uint32_t b_desc_lo = __shfl_sync(0xffffffff, b_desc.reg32_[0], 0);

        while (scheduler.get_next_block(m_block_idx, n_block_idx)) {
            // the weights' scales of the gate tile (first SHAPE_K_SCALES) and the up tile
            if (threadIdx.x >= 32) {
                const float* local_sfb = sfb + scheduler.current_group_idx * (shape_n_sfb * SHAPE_K_SCALES)
                                         + n_block_idx * SHAPE_K_SCALES;
                #pragma unroll
                for (uint32_t i = threadIdx.x - 32; i < 2 * SHAPE_K_SCALES; i += kNumMathThreads - 32) {
                    const uint32_t sub = i / SHAPE_K_SCALES, k = i % SHAPE_K_SCALES;
                    ptx::st_shared(smem_sfb + i, __ldg(local_sfb + sub * (shape_n / BLOCK_K) * SHAPE_K_SCALES + k));
                }
            }
            cutlass::arch::NamedBarrier::sync(kNumMathThreads, 0);

            auto empty_barrier_arrive = [&]() {
                if constexpr (kNumTMAMulticast == 1) {
                    lane_idx == 0 ? empty_barriers[stage_idx]->arrive() : void();
                } else {
                    auto target_cta = scheduler.is_peer_cta_alive ? lane_idx : cute::block_rank_in_cluster();
                    lane_idx < kNumTMAMulticast ? empty_barriers[stage_idx]->arrive(target_cta) : void();
                }
            };
            const bool valid = scheduler.is_computation_valid(m_block_idx, math_wg_idx * WGMMA::M);

            // one k-block: the WGMMAs of the rows' tile (a_lo) by a weight tile (b_lo), promoted into `sums`
            float accum[WGMMA::kNumAccum], gate[WGMMA::kNumAccum], up[WGMMA::kNumAccum];
            auto k_block = [&](const uint32_t a_lo, const uint32_t b_lo, const float scale_0, const float scale_1,
                               float* sums) {
                #pragma unroll
                for (uint32_t i = 0; i < WGMMA::kNumAccum; ++ i)
                    ptx::warpgroup_fence_operand(accum[i]);
                ptx::warpgroup_arrive();
                #pragma unroll
                for (uint32_t k = 0; k < BLOCK_K / WGMMA::K; ++ k) {
                    a_desc.reg32_[0] = a_lo + (k * WGMMA::K) / 16;
                    b_desc.reg32_[0] = b_lo + k * WGMMA::K / 16;
                    WGMMA::wgmma(a_desc, b_desc, accum, k);
                }
                ptx::warpgroup_commit_batch();
                #pragma unroll
                for (uint32_t i = 0; i < WGMMA::kNumAccum; ++ i)
                    ptx::warpgroup_fence_operand(accum[i]);
                ptx::warpgroup_wait<0>();
                #pragma unroll
                for (uint32_t i = 0; i < WGMMA::kNumAccum / 4; ++ i) {
                    sums[i * 4 + 0] += scale_0 * accum[i * 4 + 0];
                    sums[i * 4 + 1] += scale_0 * accum[i * 4 + 1];
                    sums[i * 4 + 2] += scale_1 * accum[i * 4 + 2];
                    sums[i * 4 + 3] += scale_1 * accum[i * 4 + 3];
                }
            };
            #pragma unroll
            for (uint32_t i = 0; i < WGMMA::kNumAccum; ++ i)
                gate[i] = up[i] = 0;
            if (valid) {
                #pragma unroll 4
                for (uint32_t k_block_idx = 0; k_block_idx < num_total_k_blocks; advance_pipeline(k_block_idx)) {
                    const auto a_desc_base_lo = a_desc_lo + stage_idx * (SMEM_A_SIZE_PER_STAGE / 16);
                    const auto b_desc_base_lo = b_desc_lo + stage_idx * (SMEM_B_SIZE_PER_STAGE / 16);
                    const float scale_g = ptx::ld_shared(smem_sfb + k_block_idx);
                    const float scale_u = ptx::ld_shared(smem_sfb + SHAPE_K_SCALES + k_block_idx);

                    full_barriers[stage_idx]->wait(phase);
                    const auto scale_a_0 = ptx::ld_shared(smem_sfa[stage_idx] + r_0);
                    const auto scale_a_1 = ptx::ld_shared(smem_sfa[stage_idx] + r_1);
                    k_block(a_desc_base_lo, b_desc_base_lo, scale_a_0 * scale_g, scale_a_1 * scale_g, gate);
                    k_block(a_desc_base_lo, b_desc_base_lo + SMEM_B_TILE / 16, scale_a_0 * scale_u,
                            scale_a_1 * scale_u, up);
                    empty_barrier_arrive();
                }
            } else {
                #pragma unroll
                for (uint32_t k_block_idx = 0; k_block_idx < num_total_k_blocks; advance_pipeline(k_block_idx)) {
                    full_barriers[stage_idx]->wait(phase);
                    empty_barrier_arrive();
                }
            }

            // SwiGLU in fp32 from gate and up rounded to bf16 (as the GEMM writes them), this thread's 2 x 32
            // values: h[4i], h[4i + 1] of row r_0 at channels 8i + 2 (lane % 4) + {0, 1}; h[4i + 2], h[4i + 3] of
            // row r_1 (h is kept in gate's registers)
            float* h = gate;
            #pragma unroll
            for (uint32_t i = 0; i < WGMMA::kNumAccum; ++ i)
                h[i] = swiglu(bf16_round(gate[i]), bf16_round(up[i]), limit);
            float amax_0 = 0.f, amax_1 = 0.f;
            #pragma unroll
            for (uint32_t i = 0; i < WGMMA::kNumAccum / 4; ++ i) {
                amax_0 = fmaxf(amax_0, fmaxf(fabsf(h[4 * i]), fabsf(h[4 * i + 1])));
                amax_1 = fmaxf(amax_1, fmaxf(fabsf(h[4 * i + 2]), fabsf(h[4 * i + 3])));
            }
            #pragma unroll
            for (uint32_t o = 1; o < 4; o <<= 1) {
                amax_0 = fmaxf(amax_0, __shfl_xor_sync(0xffffffffu, amax_0, o));
                amax_1 = fmaxf(amax_1, __shfl_xor_sync(0xffffffffu, amax_1, o));
            }
            // pow2_scale_bits: s = pow2_ceil(RN(amax / 448)) and 1 / s, exact powers of two
            const uint32_t sb_0 = (__float_as_uint(__fdiv_rn(fmaxf(amax_0, 1e-4f), 448.f)) + 0x7FFFFFu) & 0x7F800000u;
            const uint32_t sb_1 = (__float_as_uint(__fdiv_rn(fmaxf(amax_1, 1e-4f), 448.f)) + 0x7FFFFFu) & 0x7F800000u;
            const float inv_0 = __uint_as_float(0x7F000000u - sb_0), inv_1 = __uint_as_float(0x7F000000u - sb_1);

            // the last block's TMA store has read the staging tile
            if (threadIdx.x == 0)
                cute::tma_store_wait<0>();
            cutlass::arch::NamedBarrier::sync(kNumMathThreads, 1);

            // rows of 128 bytes, 16-byte chunk c of row r at chunk c ^ (r % 8) (the 128-byte swizzle)
            #pragma unroll
            for (uint32_t i = 0; i < WGMMA::kNumAccum / 4; ++ i) {
                const uint32_t in_chunk = (i % 2) * 8 + (lane_idx % 4) * 2;
                const uint32_t c_0 = (i / 2) ^ (r_0 % 8), c_1 = (i / 2) ^ (r_1 % 8);
                *reinterpret_cast<uint16_t*>(smem_h + r_0 * BLOCK_N + c_0 * 16 + in_chunk) =
                    pack_e4m3(h[4 * i] * inv_0, h[4 * i + 1] * inv_0);
                *reinterpret_cast<uint16_t*>(smem_h + r_1 * BLOCK_N + c_1 * 16 + in_chunk) =
                    pack_e4m3(h[4 * i + 2] * inv_1, h[4 * i + 3] * inv_1);
            }
            const uint32_t m_idx = scheduler.template get_global_idx<kMasked>(shape_m, BLOCK_M, m_block_idx);
            if (lane_idx % 4 == 0) {
                const uint32_t row_0 = m_idx + r_0, row_1 = m_idx + r_1;
                if (row_0 < shape_m * (kMasked ? GU_GROUPS : 1))
                    hs[(row_0 / hs_group) * (shape_n / BLOCK_K) * hs_group + n_block_idx * hs_group
                       + row_0 % hs_group] = __uint_as_float(sb_0);
                if (row_1 < shape_m * (kMasked ? GU_GROUPS : 1))
                    hs[(row_1 / hs_group) * (shape_n / BLOCK_K) * hs_group + n_block_idx * hs_group
                       + row_1 % hs_group] = __uint_as_float(sb_1);
            }
            cute::tma_store_fence();
            cutlass::arch::NamedBarrier::sync(kNumMathThreads, 1);
            if (threadIdx.x == 0) {
                cute::SM90_TMA_STORE_2D::copy(&tensor_map_h, smem_h, n_block_idx * BLOCK_N, m_idx);
                cute::tma_store_arrive();
            }
            __syncwarp();
        }
        if (threadIdx.x == 0)               // the staging tile stays until the last store has read it
            cute::tma_store_wait<0>();
    }
#endif
}

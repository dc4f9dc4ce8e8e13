"""Can the sparse core's next frame be CUDA C++ here? A probe of the Hopper features it needs, compiled at run time
by NVRTC through torch (``torch.cuda._compile_kernel``: no nvcc, no build step, nothing carried to the GPU host).

    python launch/probe_sm90_cuda.py [--out PATH]            # on a Hopper GPU: runs every check, prints a table
    python launch/probe_sm90_cuda.py --dump-source FILE.cu   # anywhere: the CUDA source, for launch/nvcc_sm90.sh

Each check runs a small kernel and compares its result with torch:

- **cluster**: a cluster of two CTAs (``__cluster_dims__``), each reading its peer's shared memory through
  ``mapa`` / ``ld.shared::cluster`` between two cluster barriers (a pair of CTAs splitting d exchanges partial
  scores this way).
- **wgmma**: one ``wgmma.mma_async`` m64n64k16 (bf16 in, fp32 out) from shared-memory descriptors without swizzle,
  with the operands placed in 8 x 16-byte core matrices. Three placements / descriptor encodings are tried; the
  table says which give torch's product (the descriptor's leading and stride byte offsets are the easiest thing
  to get wrong) and that the accumulator fragment is laid out as assumed (row = 16 warp + lane / 4 + 8 (i / 2 % 2),
  column = 8 (i / 4) + 2 (lane % 4) + i % 2).
- **QK / PV as a core runs them**: q and a key tile K-major in the 128-byte swizzle (what TMA writes), K = 64 in
  four k-steps; P from registers in the accumulator's own fragment layout (no shuffle from S to P) against V
  stored as it comes (channels contiguous: MN-major, trans-b), with four descriptor encodings tried.
- **smem**: 200 KB of dynamic shared memory in one CTA (the attribute set through the driver).
- **graph**: the cluster and wgmma kernels captured in a CUDA graph and replayed.

Prints one line per check and writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_wave.attention.core_cuda import HELPERS  # noqa: E402  (smem_u32 and the wgmma accumulator operands)

SRC = HELPERS + r"""
typedef unsigned short bf16_t;

extern "C" __global__ void __cluster_dims__(2, 1, 1) cluster_probe(float *out) {
    __shared__ float x[32];
    unsigned rank, peer_addr;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    if (threadIdx.x < 32) x[threadIdx.x] = 1000.0f * rank + threadIdx.x;
    asm volatile("barrier.cluster.arrive.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
    float v = 0.0f;
    if (threadIdx.x < 32) {
        unsigned local = smem_u32(&x[threadIdx.x]);
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(peer_addr) : "r"(local), "r"(rank ^ 1u));
        asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(peer_addr) : "memory");
    }
    asm volatile("barrier.cluster.arrive.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
    if (threadIdx.x < 32) out[blockIdx.x * 32 + threadIdx.x] = v;
}

__device__ __forceinline__ u64 smem_desc(const void *p, unsigned lbo, unsigned sbo) {
    unsigned a = smem_u32(p);
    return (u64)((a >> 4) & 0x3FFF) | ((u64)((lbo >> 4) & 0x3FFF) << 16) | ((u64)((sbo >> 4) & 0x3FFF) << 32);
}


// the m64n64 fp32 accumulator fragment to D [64, 64]: register i of thread (warp w, lane l) is row
// 16 w + l / 4 + 8 (i / 2 % 2), column 8 (i / 4) + 2 (l % 4) + i % 2
__device__ __forceinline__ void store_d64(float *D, const float *d) {
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
#pragma unroll
    for (int i = 0; i < 32; ++i)
        D[(16 * w + l / 4 + 8 * ((i / 2) % 2)) * 64 + 8 * (i / 4) + 2 * (l % 4) + i % 2] = d[i];
}

// A [64, 16] and B [64, 16] (N x K), both K-major, row-major in global memory; D [64, 64] = A @ B^T in fp32.
// mode 0: core matrices along K 128 bytes apart, along M/N 256 apart; descriptor LBO = 128, SBO = 256.
// mode 1: along K 1024 apart, along M/N 128 apart; descriptor LBO = 1024, SBO = 128.
// mode 2: mode 0's placement with the two offsets swapped in the descriptor (LBO = 256, SBO = 128).
extern "C" __global__ void __launch_bounds__(128) wgmma_probe(const bf16_t *A, const bf16_t *B, float *D, int mode) {
    __shared__ __align__(1024) bf16_t sa[64 * 16];
    __shared__ __align__(1024) bf16_t sb[64 * 16];
    unsigned k_off = mode == 1 ? 1024u : 128u, r_off = mode == 1 ? 128u : 256u;
    for (int e = threadIdx.x; e < 64 * 16; e += 128) {
        int r = e / 16, k = e % 16;
        unsigned byte = (r / 8) * r_off + (k / 8) * k_off + (r % 8) * 16 + (k % 8) * 2;
        sa[byte / 2] = A[e];
        sb[byte / 2] = B[e];
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    unsigned lbo = mode == 2 ? r_off : k_off, sbo = mode == 2 ? k_off : r_off;
    u64 da = smem_desc(sa, lbo, sbo), db = smem_desc(sb, lbo, sbo);
    float d[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.0f;
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %34, 0;\n\t"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " D32 ", %32, %33, p, 1, 1, 0, 0;\n}"
        : D32_OUT(d)
        : "l"(da), "l"(db), "r"(0));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    store_d64(D, d);
}

// byte offset of element (r, c) of a [rows, 64] bf16 tile in the 128-byte swizzle: 128-byte rows, the 16-byte
// chunks of row r permuted by r % 8 (what TMA's SWIZZLE_128B writes; the tile 1024-byte aligned)
__device__ __forceinline__ unsigned sw128(int r, int c) {
    return r * 128 + ((((c * 2) >> 4) ^ (r & 7)) << 4) + ((c * 2) & 15);
}

// 128-byte swizzle descriptors: layout type 1 in bits 62-63, SBO = 1024 (8 rows of 128 bytes), LBO unused (1)
__device__ __forceinline__ u64 sw128_desc(const void *p) {
    return smem_desc(p, 16, 1024) | (1ull << 62);
}

// QK as the core runs it: A [64, 64] (q: heads x channels) and B [64, 64] (keys x channels), both K-major in the
// 128-byte swizzle; D = A @ B^T over K = 64 in four k-steps of 16, each advancing both descriptors by 32 bytes.
extern "C" __global__ void __launch_bounds__(128) qk_sw128_probe(const bf16_t *A, const bf16_t *B, float *D) {
    __shared__ __align__(1024) bf16_t sa[64 * 64];
    __shared__ __align__(1024) bf16_t sb[64 * 64];
    for (int e = threadIdx.x; e < 64 * 64; e += 128) {
        int r = e / 64, c = e % 64;
        sa[sw128(r, c) / 2] = A[e];
        sb[sw128(r, c) / 2] = B[e];
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    float d[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.0f;
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u64 da = sw128_desc(sa) + 2 * k, db = sw128_desc(sb) + 2 * k;     // + 32 bytes (the address is >> 4)
        asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %34, 0;\n\t"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " D32 ", %32, %33, p, 1, 1, 0, 0;\n}"
            : D32_OUT(d) : "l"(da), "l"(db), "r"(k));
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    store_d64(D, d);
}

// PV as the core runs it: P [64, 64] (heads x keys) from registers, in the accumulator's fragment layout (k-step s
// takes the fragment's registers 8 s .. 8 s + 7, two bf16 to a register), and V [64, 64] (keys x channels) as
// stored: channels contiguous, so B is MN-major (trans-b = 1) in the 128-byte swizzle, SBO = 1024 (8 keys), each
// k-step 16 keys = 2048 bytes further. D = P @ V. (lbo, sbo): the descriptor's offsets, tried both ways.
extern "C" __global__ void __launch_bounds__(128) pv_sw128_probe(const float *P, const bf16_t *V, float *D, int lbo,
                                                                  int sbo) {
    __shared__ __align__(1024) bf16_t sv[64 * 64];
    for (int e = threadIdx.x; e < 64 * 64; e += 128) sv[sw128(e / 64, e % 64) / 2] = V[e];
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    float p[32];
#pragma unroll
    for (int i = 0; i < 32; ++i)
        p[i] = P[(16 * w + l / 4 + 8 * ((i / 2) % 2)) * 64 + 8 * (i / 4) + 2 * (l % 4) + i % 2];
    unsigned a[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) {                                      // two fp32 -> one bf16x2 (round to nearest)
        unsigned r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(p[2 * j + 1]), "f"(p[2 * j]));
        a[j] = r;
    }
    float d[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.0f;
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u64 db = (smem_desc(sv, lbo, sbo) | (1ull << 62)) + 128 * k;     // + 2048 bytes
        asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %37, 0;\n\t"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " D32 ", {%32, %33, %34, %35}, %36, p, "
            "1, 1, 1;\n}"
            : D32_OUT(d)
            : "r"(a[4 * k]), "r"(a[4 * k + 1]), "r"(a[4 * k + 2]), "r"(a[4 * k + 3]), "l"(db), "r"(k));
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    store_d64(D, d);
}

extern "C" __global__ void smem_probe(float *out, int n) {
    extern __shared__ float buf[];
    for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = (float)i;
    __syncthreads();
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += buf[n - 1 - i];
    out[threadIdx.x] = s;
}
"""

SMEM_BYTES = 200 * 1024
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def _compile(name: str):
    return torch.cuda._compile_kernel(SRC, name, compute_capability="90a")


def _allow_smem(kernel, nbytes: int) -> None:
    """Dynamic shared memory above 48 KB: torch's helper where this torch has it, else the driver's attribute."""
    if hasattr(kernel, "set_shared_memory_config"):
        kernel.set_shared_memory_config(nbytes)
        return
    lib = torch.cuda._utils._get_gpu_runtime_library()
    rc = lib.cuFuncSetAttribute(kernel.func, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_int(nbytes))
    if rc != 0:
        raise RuntimeError(f"cuFuncSetAttribute: CUresult {rc}")


def launch_cluster(k, out):
    k(grid=(8, 1, 1), block=(128, 1, 1), args=[out])


def want_cluster() -> torch.Tensor:
    b = torch.arange(8).repeat_interleave(32)
    i = torch.arange(32).repeat(8)
    return (1000.0 * ((b % 2) ^ 1) + i).float()


def run() -> list[dict]:
    rows = []
    dev = torch.device("cuda")
    kc, kw, ks = _compile("cluster_probe"), _compile("wgmma_probe"), _compile("smem_probe")

    out = torch.zeros(8 * 32, device=dev)
    launch_cluster(kc, out)
    torch.cuda.synchronize()
    ok = torch.equal(out.cpu(), want_cluster())
    rows.append(dict(check="cluster: each CTA reads its peer's shared memory", ok=ok))

    torch.manual_seed(0)
    a16 = torch.randn(64, 16, device=dev).to(torch.bfloat16)
    b16 = torch.randn(64, 16, device=dev).to(torch.bfloat16)
    want16 = a16.float() @ b16.float().t()
    modes = {}
    for mode, what in ((0, "K 128 B apart, rows 256: LBO 128, SBO 256"), (1, "K 1024 B apart, rows 128: LBO 1024, "
                                                                               "SBO 128"),
                       (2, "K 128 B apart, rows 256: LBO 256, SBO 128 (swapped)")):
        D = torch.full((64, 64), float("nan"), device=dev)
        kw(grid=(1, 1, 1), block=(128, 1, 1), args=[a16, b16, D, mode])
        torch.cuda.synchronize()
        err = (D - want16).abs().max().item()
        modes[mode] = bool(err < 1e-3)
        rows.append(dict(check=f"wgmma m64n64k16 mode {mode} ({what})", ok=modes[mode], max_err=err))

    kq, kp = _compile("qk_sw128_probe"), _compile("pv_sw128_probe")
    A = torch.randn(64, 64, device=dev).to(torch.bfloat16)
    B = torch.randn(64, 64, device=dev).to(torch.bfloat16)
    D = torch.full((64, 64), float("nan"), device=dev)
    kq(grid=(1, 1, 1), block=(128, 1, 1), args=[A, B, D])
    torch.cuda.synchronize()
    err = (D - A.float() @ B.float().t()).abs().max().item()
    rows.append(dict(check="QK: wgmma K = 64 in 4 k-steps, q and keys K-major in the 128-byte swizzle (SBO 1024)",
                     ok=bool(err < 1e-3), max_err=err))
    P = torch.randn(64, 64, device=dev)
    want = P.to(torch.bfloat16).float() @ B.float()
    for lbo, sbo in ((16, 1024), (1024, 16), (1024, 1024), (2048, 1024)):
        D = torch.full((64, 64), float("nan"), device=dev)
        kp(grid=(1, 1, 1), block=(128, 1, 1), args=[P, B, D, lbo, sbo])
        torch.cuda.synchronize()
        err = (D - want).abs().max().item()
        rows.append(dict(check=f"PV: P from registers, V MN-major in the 128-byte swizzle, LBO {lbo}, SBO {sbo}",
                         ok=bool(err < 1e-3), max_err=err))

    n = SMEM_BYTES // 4
    _allow_smem(ks, SMEM_BYTES)
    o = torch.zeros(256, device=dev)
    ks(grid=(1, 1, 1), block=(256, 1, 1), args=[o, n], shared_mem=SMEM_BYTES)
    torch.cuda.synchronize()
    rows.append(dict(check=f"smem: {SMEM_BYTES // 1024} KB of dynamic shared memory", ok=bool(
        abs(o.sum().item() - n * (n - 1) / 2) <= 1e-6 * n * n)))

    good = min((m for m, g in modes.items() if g), default=0)
    out.zero_()
    D = torch.zeros(64, 64, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_cluster(kc, out)
        kw(grid=(1, 1, 1), block=(128, 1, 1), args=[a16, b16, D, good])
    graph.replay()
    torch.cuda.synchronize()
    rows.append(dict(check="graph: both kernels captured and replayed", ok=bool(
        torch.equal(out.cpu(), want_cluster()) and (D - want16).abs().max().item() < 1e-3) if modes[good] else False))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--dump-source", default=None, help="write the CUDA source here and exit (no GPU needed)")
    args = ap.parse_args()
    if args.dump_source:
        with open(args.dump_source, "w") as f:
            f.write(SRC)
        return
    if not (torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability()[0] == 9):
        sys.exit("probe_sm90_cuda: needs a Hopper GPU (sm_90)")
    rows = run()
    for r in rows:
        print(f"{'ok  ' if r['ok'] else 'FAIL'}  {r['check']}" + (f"  (max err {r['max_err']:.2g})" if 'max_err' in r
                                                                    else ""))
    if args.out:
        from launch_common import git_sha
        with open(args.out, "w") as f:
            json.dump({"meta": dict(git_sha=git_sha(), torch=torch.__version__, cuda=torch.version.cuda,
                                    gpu=torch.cuda.get_device_name(0)), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""The tensor-core steps of one sparse-core key tile alone, one program an SM (one H200): what a tile's QK and PV
cost with nothing else in the kernel (no gathers, no softmax, no barriers between warpgroups).

    python dev/bench_wgmma.py [--tiles 4000] [--iters 5] [--out PATH]

The sparse core's item is 64 heads (M) of one query against 64-key tiles, d = 512 (K = V). Its QK1 kernel's
warpgroup 0 computes each tile's QK as 32 wgmma steps of m64n64k16 with q and the keys both in shared memory
(SS), then PV for half of d from P in registers (m64n256k16, 4 steps). These kernels repeat one step over the
same shared-memory tiles (two buffers, alternating; one of 128 keys), one warpgroup a program and one program an
SM, so that the time a tile is what the tensor cores and shared memory give that step:

- qk_ss64: QK as the core runs it (SS, N = 64); qk_ss128: a 128-key tile (N = 128); qk_rs64: q from registers
  (RS, N = 64: only the keys stream from shared memory);
- pv_rs256: PV for half of d (P from registers, N = 256, K = 64);
- qk_pv: qk_ss64 then pv_rs256 on its result, dependent, as warpgroup 0 runs them (softmax left out);
- qk_ss64x2: two warpgroups, each qk_ss64 on its own 64 rows of q against the same key tile (M = 128: two
  queries' heads sharing a tile, or two wgmma streams in one SM).

Each row gives us a tile and TFLOP/s over all SMs (median of --iters CUDA-graph replays,
``attn_kit.time_alone``), against the dense bf16 GEMM timed in the same run (``attn_kit.gemm_tflops``,
8192^3). A JSON of the rows goes to --out (default $OUT/wgmma.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from attn_kit import gemm_tflops, time_alone  # noqa: E402
from bench_common import out_path  # noqa: E402
try:  # Gluon: Triton's experimental dialect (absent or moved in some Triton releases: this probe then refuses)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except Exception:  # noqa: BLE001
    gluon = gl = None

# name: MODE, keys a tile (N of the QK), FLOP a tile
MODES = {"qk_ss64": (0, 64, 2 * 64 * 64 * 512), "qk_ss128": (0, 128, 2 * 64 * 128 * 512),
         "qk_rs64": (1, 64, 2 * 64 * 64 * 512), "pv_rs256": (2, 64, 2 * 64 * 64 * 256),
         "qk_pv": (3, 64, 2 * 64 * 64 * 512 + 2 * 64 * 64 * 256), "qk_ss64x2": (4, 64, 2 * 128 * 64 * 512)}

if gluon is not None:
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, \
        warpgroup_mma_wait

    @gluon.jit
    def _tile_steps(q_ptr, k_ptr, out_ptr, T, MODE: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                    num_warps: gl.constexpr):
        # one warpgroup: q [64, D] and two key tiles [BN, D] (one of 128 keys: shared memory) loaded once into
        # shared memory, then T tiles of the step; the results summed into registers (kept live) and their total
        # written, so nothing is dropped
        DH: gl.constexpr = D // 2
        NB: gl.constexpr = 2 if BN == 64 else 1
        sm_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        ld_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[1, 32],
                                              warps_per_cta=[4, 1], order=[1, 0])
        qk_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BN, 16])
        pv_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DH, 16])
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [64, D], sm_l)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [NB, BN, D], sm_l)
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, ld_l))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, ld_l))
        q_smem.store(gl.load(q_ptr + rows[:, None] * D + cols[None, :]))
        for b in gl.static_range(NB):
            for c in gl.static_range(BN // 64):
                k_smem.index(b).slice(c * 64, 64).store(
                    gl.load(k_ptr + ((b * BN + c * 64) + rows)[:, None] * D + cols[None, :]))
        fence_async_shared()
        gl.thread_barrier()
        s_zero = gl.zeros([64, BN], gl.float32, qk_l)
        tot = gl.zeros([64, BN], gl.float32, qk_l)
        acc = gl.zeros([64, DH], gl.float32, pv_l)
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=pv_l, k_width=2)
        qa = q_smem                                         # QK's A: q in shared memory, or (MODE 1) registers
        if MODE == 1:
            qa = q_smem.load(gl.DotOperandLayout(operand_index=0, parent=qk_l, k_width=2))
        if MODE == 2:
            pa = q_smem.slice(0, 64, dim=1).load(p_l)
        for t in range(T):
            buf = k_smem.index(t % NB)
            if MODE != 2:                                   # QK (modes 0, 1, 3)
                sc = warpgroup_mma(qa, buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
                if MODE == 3:                               # its result as PV's P (qk_pv)
                    pa = gl.convert_layout((sc * 0.001).to(gl.bfloat16), p_l)
                else:
                    tot += sc
            if MODE >= 2:                                   # PV on half of d (modes 2, 3)
                acc = warpgroup_mma(pa, buf.slice(0, DH, dim=1), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        total = gl.sum(gl.sum(tot, axis=1), axis=0) + gl.sum(gl.sum(acc, axis=1), axis=0)
        gl.store(out_ptr + gl.program_id(0), total)

    @gluon.jit
    def _tile_steps_m128(q_ptr, k_ptr, out_ptr, T, BN: gl.constexpr, D: gl.constexpr, num_warps: gl.constexpr):
        # two warpgroups (8 warps): q [128, D] (two 64-row halves) against one key tile [BN, D], T tiles
        sm_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        ld_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[1, 32],
                                              warps_per_cta=[8, 1], order=[1, 0])
        qk_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                       instr_shape=[16, BN, 16])
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [128, D], sm_l)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, D], sm_l)
        rows = gl.arange(0, 128, layout=gl.SliceLayout(1, ld_l))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, ld_l))
        q_smem.store(gl.load(q_ptr + (rows % 64)[:, None] * D + cols[None, :]))
        krows = gl.arange(0, BN, layout=gl.SliceLayout(1, ld_l))
        k_smem.store(gl.load(k_ptr + krows[:, None] * D + cols[None, :]))
        fence_async_shared()
        gl.thread_barrier()
        s_zero = gl.zeros([128, BN], gl.float32, qk_l)
        tot = gl.zeros([128, BN], gl.float32, qk_l)
        for t in range(T):
            sc = warpgroup_mma(q_smem, k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
            tot += sc
        gl.store(out_ptr + gl.program_id(0), gl.sum(gl.sum(tot, axis=1), axis=0))


def run_mode(name: str, tiles: int, iters: int, dev: torch.device) -> dict:
    mode, bn, flop = MODES[name]
    n_sm = torch.cuda.get_device_properties(dev).multi_processor_count
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(64, 512, device=dev, generator=g).to(torch.bfloat16)
    k = torch.randn(2 * bn, 512, device=dev, generator=g).to(torch.bfloat16)
    out = torch.empty(n_sm, device=dev)
    if mode == 4:
        launch = lambda: _tile_steps_m128[(n_sm,)](q, k, out, tiles, BN=bn, D=512, num_warps=8)  # noqa: E731
    else:
        launch = lambda: _tile_steps[(n_sm,)](q, k, out, tiles, MODE=mode, BN=bn, D=512, num_warps=4)  # noqa: E731
    us = time_alone(launch, iters)
    return dict(name=name, us_a_tile=us / tiles, tflops=n_sm * tiles * flop / (us * 1e-6) / 1e12, sms=n_sm,
                tiles=tiles, flop_a_tile=flop, finite=bool(out.isfinite().all()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", type=int, default=4000)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if gluon is None or not torch.cuda.is_available():
        raise SystemExit("bench_wgmma: needs a Hopper GPU and Triton's Gluon")
    dev = torch.device("cuda")
    dense = gemm_tflops(dev)
    rows = [run_mode(m, args.tiles, args.iters, dev) for m in args.modes.split(",")]
    print(f"dense bf16 GEMM 8192^3: {dense:.0f} TFLOP/s")
    print(f"{'step':<10} {'us a tile':>10} {'TFLOP/s':>9} {'of GEMM':>8}")
    for r in rows:
        r["of_dense"] = r["tflops"] / dense
        print(f"{r['name']:<10} {r['us_a_tile']:>10.3f} {r['tflops']:>9.0f} {r['of_dense']:>8.2f}")
    path = args.out or out_path("wgmma.json", "wgmma.json")
    with open(path, "w") as f:
        json.dump(dict(dense_tflops=dense, rows=rows, argv=sys.argv,
                       git=os.environ.get("MOE_WAVE_GIT_SHA"), torch=torch.__version__), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

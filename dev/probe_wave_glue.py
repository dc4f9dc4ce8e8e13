"""The FP8 stage's glue kernels on one wave's inputs: W = 1 against one wave of W = 4 (rows once per wave), at the
shapes where W = 4 / W = 1 misses its goal. Kernel variants side by side:

- ``swiglu_quant`` (DeepGEMM's gate_up output -> FP8 h): NB 128-channel blocks a step, each 128-row block split
  over RS programs;
- the weighted sum (down's pair rows -> the wave's rows): the library's grid, a program per row with the
  row's slots loaded at once (``SPLIT`` body on the row grid), and a program per row slot by slot at other
  channel steps, warps and programs an SM (``WSUM_VARIANTS``);
- ``gather_pairs`` (the FP8 rows into the layout) at channel blocks a step, warps and programs an SM
  (``PAIRS_VARIANTS``, those whose blocks divide the row).

    python dev/probe_wave_glue.py [--shapes v4-flash:32,v4-flash:128,v4-pro:48] [--tokens 2048,8192] [--iters 50]

Inputs: uniform top-k routing of T tokens over e experts; wave 0 of W holds experts 0 .. e / W - 1 and the rows
with one of them (as ``sends="wave"`` delivers them, 1.25 x those rows of capacity). Each variant is captured in
a CUDA graph and timed alone (median, L2 flushed); "x W" is the per-wave time times W, against W = 1's. One GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe_wave import MoEConfig  # noqa: E402
from moe_wave.expert_kernels import (BLOCK_D, _rows_grid, _row_blocks, _wsum_kernel, expert_order,  # noqa: E402
                                     weighted_sum)
from moe_wave.fp8_expert_kernels import (ALIGN, FP8, _pairs_kernel, _swiglu_quant_kernel,  # noqa: E402
                                         aligned_capacity, gather_pairs, layout_groups, swiglu_quant)
from moe_wave.fp8_rows import pack_rows, unpack_rows  # noqa: E402
from moe_wave.timing import as_graph, iteration_us, l2_flush_buffer  # noqa: E402

import triton  # noqa: E402


# the weighted sum a program per row (slot by slot): (channels a step, warps, programs an SM)
WSUM_VARIANTS = [(1024, 4, 16), (2048, 4, 8), (2048, 8, 8), (4096, 8, 8), (4096, 8, 4)]


# the FP8 rows into the layout (gather_pairs' _pairs_kernel): (128-channel blocks a step, warps, programs an SM)
PAIRS_VARIANTS = [(8, 8, 8), (8, 4, 16), (4, 4, 16), (16, 8, 8), (32, 8, 8), (32, 8, 4)]


def wave_inputs(T: int, K: int, e: int, W: int, dev):
    """(expert_RK int32 of wave 0's rows with the other waves' slots -1, weights, counts [e], R)."""
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.rand(T, e, generator=g, device=dev).topk(K, dim=1).indices
    mine = ids < e // W
    rows = mine.any(1)
    ids = torch.where(mine, ids, -1)[rows].to(torch.int32)
    R_in = ids.shape[0]
    R = max(128, -(-int(R_in * (1.25 if W > 1 else 1.0)) // 128) * 128)
    ex = torch.full((R, K), -1, dtype=torch.int32, device=dev)
    ex[:R_in] = ids
    w = torch.rand(R, K, generator=g, device=dev)
    counts = torch.bincount(ex[ex >= 0].long(), minlength=e)
    return ex, w, counts, R


def timed(fn, dev, iters, flush) -> float:
    replay = as_graph(lambda i: fn(), dev)[0]
    return statistics.median(iteration_us(replay, iters, 3, device=dev, flush=flush))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="v4-flash:32,v4-flash:128,v4-pro:48")
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--waves", default="1,4")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_wave_glue: needs a GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    flush = l2_flush_buffer(dev)
    sw = [(2, 1), (1, 1), (2, 2), (1, 2), (2, 4), (1, 4)]
    print("swiglu_quant (NB, RS), weighted sum (lib, row grid + slots at once, WSUM_VARIANTS), gather_pairs "
          "(PAIRS_VARIANTS): us per wave and x W")
    head = " ".join(f"{'sw' + str(nb) + '/' + str(rs):>9}" for nb, rs in sw)
    more = " ".join(f"{'ws' + str(b) + '/' + str(n) + '/' + str(p):>9}" for b, n, p in WSUM_VARIANTS)
    more += " " + " ".join(f"{'pr' + str(b) + '/' + str(n) + '/' + str(p):>9}" for b, n, p in PAIRS_VARIANTS)
    print(f"{'shape':>14} {'T':>5} {'W':>2} {'pairs':>6} {'JA':>6} {head} {'ws lib':>8} {'ws rowvec':>9} {more}")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for spec in args.shapes.split(","):
        name, e = spec.split(":")
        e = int(e)
        cfg = MoEConfig.preset(name, num_experts=e)
        I, D, K = cfg.intermediate_size, cfg.hidden_size, cfg.top_k
        for T in (int(t) for t in args.tokens.split(",")):
            for W in (int(v) for v in args.waves.split(",")):
                ex, w, counts, R = wave_inputs(T, K, e, W, dev)
                pairs = R * K
                JA = aligned_capacity(pairs, e)
                grp = layout_groups(counts, pairs, JA)
                gu = torch.randn(JA, 2 * I, device=dev).to(torch.bfloat16)
                hq = torch.empty(JA, I, dtype=FP8, device=dev)
                hs = torch.empty(I // 128, JA, dtype=torch.float32, device=dev)

                def sw_fn(nb, rs):
                    return lambda: _swiglu_quant_kernel[(JA // ALIGN * rs, I // (nb * 128))](
                        gu, grp.bend, JA, hq, hs, I, JA, 10.0, BR=16, NB=nb, BEND=True, CLAMP=True, INTERP=False,
                        RS=rs, num_warps=4)
                ref = swiglu_quant(gu, None, None, 10.0, bend=grp.bend)[0].view(torch.uint8)
                r_ = torch.arange(JA, device=dev)[:, None]
                used = ((r_ >= grp.starts[None]) & (r_ < grp.ends[None])).any(1)      # the groups' rows
                got = []
                for nb, rs in sw:
                    if (I // 128) % nb:
                        got.append(float("nan"))
                        continue
                    hq.zero_()
                    sw_fn(nb, rs)()
                    assert torch.equal(hq.view(torch.uint8)[used], ref[used]), (nb, rs)
                    got.append(timed(sw_fn(nb, rs), dev, args.iters, flush))
                _, pos = expert_order(ex, e, grp.offs, starts_e=grp.starts, capacity=JA)
                out = torch.randn(JA, D, device=dev).to(torch.bfloat16)
                y = torch.empty(R, D, dtype=torch.bfloat16, device=dev)
                cnt, rb = _row_blocks(None, R, grp.n)
                bd = min(BLOCK_D, triton.next_power_of_2(D))

                def ws_vec():
                    _wsum_kernel[(_rows_grid(R, dev), 1)](out, pos, w, grp.n, y, cnt, rb, R, K, D, HAS_ROWS=False,
                                                          SPLIT=True, KP=triton.next_power_of_2(K), BLOCK=bd)
                ws_lib = timed(lambda: weighted_sum(out, pos, w, grp.n, torch.bfloat16, out=y), dev, args.iters,
                               flush)
                yl = y.clone()
                ws_vec()
                torch.testing.assert_close(y.float(), yl.float(), rtol=1e-2, atol=1e-2)   # fma contraction may differ
                ws_v = timed(ws_vec, dev, args.iters, flush)
                ws_more = []
                for blk, nw, per_sm in WSUM_VARIANTS:
                    def ws_var():
                        _wsum_kernel[(min(R, per_sm * sms), 1)](out, pos, w, grp.n, y, cnt, rb, R, K, D,
                                                                HAS_ROWS=False, SPLIT=False,
                                                                KP=triton.next_power_of_2(K), BLOCK=blk,
                                                                num_warps=nw)
                    ws_var()
                    torch.testing.assert_close(y.float(), yl.float(), rtol=1e-2, atol=1e-2)
                    ws_more.append(timed(ws_var, dev, args.iters, flush))
                cells = " ".join(f"{t:9.1f}" for t in got)
                xp = pack_rows(torch.randn(R, D, device=dev).to(torch.bfloat16))
                qr, sr = unpack_rows(xp, D)
                q0, s0 = gather_pairs(xp, D, pos, JA)
                pr = []
                for nb, nw, per_sm in PAIRS_VARIANTS:
                    if (D // 128) % nb:
                        pr.append(float("nan"))
                        continue
                    qv = q0.clone()
                    sv = s0.clone()

                    def pairs_var():
                        _pairs_kernel[(min(R, per_sm * sms),)](
                            qr, sr, qr.stride(0), sr.stride(0), qr, sr, qr.stride(0), sr.stride(0), 0, 0, pos, qv, sv,
                            R, K, D, JA, JA, KP=triton.next_power_of_2(K), NB=nb, PACKED=True, INTERP=False,
                            num_warps=nw)
                    qv.zero_()
                    pairs_var()
                    assert torch.equal(qv.view(torch.uint8)[used], q0.view(torch.uint8)[used]), (nb, nw, per_sm)
                    pr.append(timed(pairs_var, dev, args.iters, flush))
                ws_more += pr
                more = " ".join(f"{t:9.1f}" for t in ws_more)
                print(f"{spec:>14} {T:5d} {W:2d} {int(counts.sum()):6d} {JA:6d} {cells} {ws_lib:8.1f} {ws_v:9.1f} "
                      f"{more}")
                if W > 1:
                    cells = " ".join(f"{t * W:9.1f}" for t in got)
                    more = " ".join(f"{t * W:9.1f}" for t in ws_more)
                    print(f"{'x W':>14} {'':5} {'':2} {'':6} {'':6} {cells} {ws_lib * W:8.1f} {ws_v * W:9.1f} "
                          f"{more}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

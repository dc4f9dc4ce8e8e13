"""Where the paired-CTA ``gate_up_sm90``'s time goes against CTAs alone: the launch's grid, the weight multicast,
the pairs' lock-step and the scope of the stage releases, each varied alone, timed side by side.

    python dev/probe_gate_up_cluster.py [--shapes v4-flash:32,v4-flash:128,v4-pro:48] [--tokens 2048,8192]

Inputs as ``dev/probe_gate_up_sm90.py``'s (wave 0 of 1). Columns (us per call, graph, L2 flushed): ``c1``: CTAs
alone, one an SM; ``c2``: pairs at the grid cuOccupancyMaxActiveClusters gives; ``c2 sms``: pairs, one CTA an SM;
``c2 nomc``: pairs without the multicast (each CTA loads its own weights); ``c2 free``: pairs without the multicast
and not in lock-step (each CTA's stages released by its own math warps alone); ``c2 rel``: pairs releasing the
stages at cluster scope (``mbarrier.arrive.release.cluster``); ``g<N>``: pairs at a grid of N CTAs; ``c1 half``:
CTAs alone on half the SMs. One GPU (Hopper, with deep_gemm).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from probe_wave_glue import timed, wave_inputs  # noqa: E402

from moe_wave import MoEConfig, gate_up_cuda  # noqa: E402
from moe_wave.expert_kernels import expert_order  # noqa: E402
from moe_wave.fp8_expert_kernels import aligned_capacity, layout_groups  # noqa: E402
from moe_wave.fp8_experts import quant_experts  # noqa: E402
from moe_wave.fp8_rows import pack_rows, unpack_rows  # noqa: E402
from moe_wave.timing import l2_flush_buffer  # noqa: E402

SHARED = "const bool shared = CLUSTER > 1 && ex >= 0 && ex == ex2;"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="v4-flash:32,v4-flash:128,v4-pro:48")
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--grids", default="128,66")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    real = gate_up_cuda._function
    f1, f2, most2 = real(0, True, 1)[0], *real(0, True, 2)
    print(f"SMs {sms}; CTAs a launch: cluster 1 {real(0, True, 1)[1]}, cluster 2 {most2}")
    assert SHARED in gate_up_cuda.SOURCE
    nomc_src = gate_up_cuda.SOURCE.replace(SHARED, "const bool shared = false; (void)ex2;")
    free_src = nomc_src.replace("mbar_init(empty + 8 * s, 8 * CLUSTER);", "mbar_init(empty + 8 * s, 8);").replace(
        "if (lane < CLUSTER) mbar_arrive_cta(empty + 8 * stage, lane);",
        "if (lane == 0) mbar_arrive(empty + 8 * stage);")
    assert free_src.count("mbar_arrive(empty + 8 * stage);") == 2
    rel_src = gate_up_cuda.SOURCE.replace("mbarrier.arrive.shared::cluster.b64", "mbarrier.arrive.release.cluster"
                                          ".shared::cluster.b64")
    assert rel_src != gate_up_cuda.SOURCE

    def build(source, what):
        cb = gate_up_cuda.cuda_build
        return gate_up_cuda.load_function(0, cb.nvrtc_compile(gate_up_cuda.MAIN, gate_up_cuda._defines(True, 2)
                                                               + source, {cb.HEADER: cb.SOURCES[cb.HEADER]}, what),
                                          b"gate_up_sm90", gate_up_cuda.SMEM_BYTES)
    nomc, free, rel = build(nomc_src, "nomc"), build(free_src, "free"), build(rel_src, "rel")
    grids = [int(x) for x in args.grids.split(",")]
    flush = l2_flush_buffer(dev)
    print(f"{'shape':>14} {'T':>5} {'c1':>8} {'c2':>8} {'c2 sms':>8} {'c2 nomc':>8} {'c2 free':>8} {'c2 rel':>8} "
          + " ".join(f"{'g' + str(x):>8}" for x in grids) + f" {'c1 half':>8} {'same':>5}")
    for spec in args.shapes.split(","):
        name, e = spec.split(":")
        e = int(e)
        cfg = MoEConfig.preset(name, num_experts=e)
        I, D, K, lim = cfg.intermediate_size, cfg.hidden_size, cfg.top_k, cfg.swiglu_limit
        g = torch.Generator(device=dev).manual_seed(1)
        wq, ws = quant_experts(torch.randn(e, 2 * I, D, generator=g, device=dev, dtype=torch.bfloat16) * 0.02)
        for T in (int(t) for t in args.tokens.split(",")):
            ex, _, counts, R = wave_inputs(T, K, e, 1, dev)
            pairs = R * K
            JA = aligned_capacity(pairs, e)
            grp = layout_groups(counts, pairs, JA)
            src, pos = expert_order(ex, e, grp.offs, starts_e=grp.starts, capacity=JA)
            r_ = torch.arange(JA, device=dev)[:, None]
            used = ((r_ >= grp.starts[None]) & (r_ < grp.ends[None])).any(1)
            qr, sr = unpack_rows(pack_rows(torch.randn(R, D, generator=g, device=dev).to(torch.bfloat16)), D)

            def way(cluster, fn=None):
                def run():
                    if fn is not None:
                        gate_up_cuda._function = fn
                    try:
                        return gate_up_cuda.gate_up_sm90(qr, sr, wq, ws, grp.starts, grp.bend, lim, grp.n,
                                                         src_J=src, cluster=cluster)
                    finally:
                        gate_up_cuda._function = real
                return run

            ways = [way(1), way(2), way(2, lambda d, s, c: (f2, sms)), way(2, lambda d, s, c: (nomc, most2)),
                    way(2, lambda d, s, c: (free, most2)), way(2, lambda d, s, c: (rel, most2))]
            ways += [way(2, lambda d, s, c, n=n: (f2, n)) for n in grids]
            ways.append(way(1, lambda d, s, c: (f1, sms // 2)))
            outs = [w() for w in ways]
            torch.cuda.synchronize()
            same = all(torch.equal(o[0].view(torch.uint8)[used], outs[0][0].view(torch.uint8)[used]) for o in outs)
            t = [timed(w, dev, args.iters, flush) for w in ways]
            print(f"{spec:>14} {T:5d} " + " ".join(f"{x:8.1f}" for x in t) + f" {int(same):5d}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where one V4 decoder layer's time goes, part by part, under CUDA graphs (one GPU, every expert on it).

    python dev/profile_layer.py [--preset v4-flash] [--tokens 2048] [--layer 0] [--iters 20] [--precision fp8]

The layer is built as the demo builds it (``tools.stack``, layer ``--layer`` of the preset) in one process,
and each of its parts is captured alone in a CUDA graph and timed (median of CUDA-event spans, L2 flushed):
the mHC collapse at each site (``hc_pre``), the norms, the attention sublayer, the MoE block, the mHC expansion
(``hc_post``), and the whole layer, in bf16 or in FP8 (``--precision``: the demo's "auto" is FP8 where DeepGEMM
runs). The parts' sum against the whole says what a fused or overlapped layer
could save; the table goes to $OUT/profile_layer_<precision>.txt when OUT is set.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from bench_common import report  # noqa: E402
from moe_wave.attention.compressor import rms_norm  # noqa: E402
from moe_wave import WaveConfig  # noqa: E402
from moe_wave.comm import EPGroup  # noqa: E402
from moe_wave.fp8 import PRECISIONS, resolve_precision  # noqa: E402
from moe_wave.mhc import hc_post  # noqa: E402
from moe_wave.timing import as_graph, iteration_us, l2_flush_buffer  # noqa: E402
from moe_wave.tools.stack import build_layer_stack, layer_kind, stack_inputs  # noqa: E402


@torch.no_grad()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="v4-flash", choices=("tiny", "v4-flash", "v4-pro"))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layer", type=int, default=0, help="which layer of the preset (its type and routing)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--precision", default="auto", choices=PRECISIONS)
    ap.add_argument("--waves", type=int, default=1, help="the MoE block's waves (default 1: the demo's on one rank)")
    ap.add_argument("--kernels", type=int, default=20,
                    help="also list the MoE block's N longest kernels (device time of one eager call; 0: none)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("profile_layer: needs a GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    prec = resolve_precision(args.precision, dev)
    layers = build_layer_stack(args.preset, args.layer + 1, ep=EPGroup.single(dev), device=dev,
                               wave=WaveConfig(num_waves=args.waves), dtype=torch.bfloat16, fp8=prec == "fp8")
    layer = layers[args.layer]
    X, pos, ids = stack_inputs(layers, args.tokens, seed=1)
    k = layer.attn.schedule.kernels
    h, post, comb = layer.attn_hc.hc_pre(X)
    a_in = rms_norm(h, layer.attn_norm, layer.eps, k)
    o = layer.attn(a_in, positions=pos, validate=False)
    X1 = hc_post(o, X, post, comb)
    h2, post2, comb2 = layer.ffn_hc.hc_pre(X1)
    m_in = rms_norm(h2, layer.ffn_norm, layer.eps, k).reshape(-1, h2.shape[-1])
    y = layer.moe(m_in, input_ids=ids.reshape(-1)).view_as(h2)
    parts = {
        "hc_pre (attention site)": lambda i: layer.attn_hc.hc_pre(X),
        "rms_norm": lambda i: rms_norm(h, layer.attn_norm, layer.eps, k),
        "attention sublayer": lambda i: layer.attn(a_in, positions=pos, validate=False),
        "hc_post (attention site)": lambda i: hc_post(o, X, post, comb),
        "hc_pre (MoE site)": lambda i: layer.ffn_hc.hc_pre(X1),
        "MoE block": lambda i: layer.moe(m_in, input_ids=ids.reshape(-1)),
        "hc_post (MoE site)": lambda i: hc_post(y, X1, post2, comb2),
        "whole layer": lambda i: layer(X, pos, ids, validate=False),
    }
    flush = l2_flush_buffer(dev)
    rows = []
    for name, fn in parts.items():
        replay = as_graph(fn, dev)[0]
        rows.append((name, statistics.median(iteration_us(replay, args.iters, 3, device=dev, flush=flush))))
    # the mHC kernels alone (the attention site's input), the mix at several tiles
    from moe_wave.mhc_kernels import hc_collapse, hc_expand, hc_mix

    hc, B, S, N, D = layer.attn_hc, *X.shape
    Xc = X.contiguous()
    mix = hc_mix(Xc.view(B * S, N * D), hc.fn)
    micro = {f"hc_mix tile {bt}x{bk}": (lambda i, bt=bt, bk=bk: hc_mix(Xc.view(B * S, N * D), hc.fn, bt, bk))
             for bt, bk in ((16, 128), (32, 64), (64, 64), (128, 32))}
    micro["hc_collapse"] = lambda i: hc_collapse(Xc.view(B * S, N, D), mix, hc.base, hc.scale, hc.cfg.norm_eps,
                                                 hc.cfg.hc_eps, hc.cfg.sinkhorn_iters)
    micro["hc_expand"] = lambda i: hc_expand(o.contiguous().view(B * S, D), Xc.view(B * S, N, D),
                                             post.reshape(B * S, N), comb.reshape(B * S, N, N))
    micro_rows = [(name, statistics.median(iteration_us(as_graph(fn, dev)[0], args.iters, 3, device=dev,
                                                        flush=flush))) for name, fn in micro.items()]
    whole = rows[-1][1]
    summed = sum(t for _, t in rows[:-1]) + rows[1][1]     # rms_norm runs at both sites: counted twice
    lines = [f"profile_layer: {args.preset} layer {args.layer} ({layer_kind(layer)}), {args.tokens} tokens, {prec}, "
             f"W={args.waves}, "
             f"one GPU, CUDA graphs, median of {args.iters}",
             f"{'part':<28} {'us':>9} {'of whole':>9}"]
    lines += [f"{name:<28} {t:9.1f} {t / whole:9.2%}" for name, t in rows]
    lines.append(f"{'sum of parts (2 norms)':<28} {summed:9.1f} {summed / whole:9.2%}")
    lines.append("mHC kernels alone (attention site):")
    lines += [f"  {name:<26} {t:9.1f}" for name, t in micro_rows]
    if args.kernels:
        from profile_experts import kernels
        from torch.profiler import ProfilerActivity, profile

        layer.moe(m_in, input_ids=ids.reshape(-1))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            layer.moe(m_in, input_ids=ids.reshape(-1))
            torch.cuda.synchronize()
        table = sorted(kernels(prof).items(), key=lambda kv: -kv[1][0])
        total = sum(us for us, _ in dict(table).values())
        lines.append(f"MoE block, one eager call: {total:.1f} us of kernels (both streams summed); the longest:")
        lines += [f"  {us:9.1f} {n:4d}x  {name[:100]}" for name, (us, n) in table[:args.kernels]]
    report("\n".join(lines), f"profile_layer_{prec}.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the attention front-end's time goes: a kernel table per branch (torch.profiler, one GPU).

    python launch/profile_attn.py [--shape v4-flash] [--types csa,hca,sliding] [--tokens 4096] [--rows 12]

For each layer type it runs each front-end branch alone (the chains ``bench_attn.py`` times:
q, window kv, compressor, indexer incl. q_lora) under torch.profiler after warm-up, and prints the
kernels sorted by total device time, with the branch's total and the count of kernels. The same
tables go to $OUT/profile_attn.txt when OUT is set.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attn import CTX, branches, make_attn, time_eager  # noqa: E402
from launch_common import out_path  # noqa: E402


def kernel_table(prof, rows: int) -> tuple[str, float, int]:
    evs = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    evs.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in evs)
    count = sum(e.count for e in evs)
    lines = [f"    {'us/iter':>9} {'calls':>6}  kernel"]
    for e in evs[:rows]:
        lines.append(f"    {e.self_device_time_total:9.1f} {e.count:6d}  {e.key[:110]}")
    return "\n".join(lines), total, count


def micro(dev) -> str:
    """Each fused kernel alone on the V4-Flash prefill shapes (CUDA events, median of 20)."""
    from moe_wave.attention.kernels import index_scores, norm_rope

    def t(fn):
        return time_eager(fn, lambda i: (), 20, 3)

    S = 4096
    pos = torch.arange(S, device=dev)[None]
    freq = torch.rand(32, device=dev)
    q = torch.randn(1, S, 64, 512, device=dev, dtype=torch.bfloat16)
    qi = torch.randn(1, S, 64, 128, device=dev, dtype=torch.bfloat16)
    ql = torch.randn(1, S, 1024, device=dev, dtype=torch.bfloat16)
    w = torch.rand(1, S, 64, device=dev)
    k = torch.randn(1, S // 4, 128, device=dev, dtype=torch.bfloat16)
    rows = [("q heads norm+rope in place [4096,64,512]", lambda: norm_rope(q, pos, freq, out=q), 2 * q.nbytes),
            ("indexer q rope, new tensor [4096,64,128]", lambda: norm_rope(qi, pos, freq, norm=False), 2 * qi.nbytes),
            ("indexer q rope in place", lambda: norm_rope(qi, pos, freq, norm=False, out=qi), qi.nbytes // 2),
            ("q_lora rms_norm [4096,1024]", lambda: norm_rope(ql, weight=torch.ones(1024, device=dev)), 2 * ql.nbytes),
            ("index_scores [4096 x 1024 x 64h x 128]", lambda: index_scores(qi, w, k, pos, 4), 0),
            ("topk 512 of 1024 (unsorted)", lambda: torch.randn(1, S, 1024, device=dev).topk(512, dim=-1, sorted=False),
             0)]
    lines = ["== kernels alone (V4-Flash prefill 4096)"]
    for name, fn, nbytes in rows:
        us = t(fn)
        lines.append(f"    {us:8.1f} us  {name}" + (f"  ({nbytes / us / 1e3:.0f} GB/s)" if nbytes else ""))
    return "\n".join(lines)


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="v4-flash")
    ap.add_argument("--types", default="csa,hca,sliding")
    ap.add_argument("--tokens", type=int, default=CTX)
    ap.add_argument("--rows", type=int, default=12)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    out = []
    for kind in args.types.split(","):
        attn = make_attn(args.shape, kind, dev)
        S = args.tokens
        x = torch.randn(1, S, attn.cfg.hidden, device=dev, dtype=torch.bfloat16)
        pos = torch.arange(S, device=dev)[None]
        for name, fn in branches(attn).items():
            cache = attn.new_cache(1, S + 8)
            for _ in range(3):
                fn(x, pos, cache)
            torch.cuda.synchronize()   # HOST SYNC: the warm-up stays out of the profile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn(x, pos, cache)
                torch.cuda.synchronize()   # HOST SYNC: the profile ends with the kernels it launched
            table, total, count = kernel_table(prof, args.rows)
            out.append(f"== {args.shape} {kind} prefill {S}: branch {name}: {total:.0f} us of kernels, "
                       f"{count} launches\n{table}")
            print(out[-1], flush=True)
        del attn
        torch.cuda.empty_cache()
    out.append(micro(dev))
    print(out[-1], flush=True)
    if out_path("profile_attn.txt"):
        with open(out_path("profile_attn.txt"), "w") as f:
            f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()

"""Where the attention front-end's time goes: a kernel table per branch (torch.profiler, one GPU).

    python launch/profile_attn.py [--shape v4-flash] [--types csa,hca,sliding] [--tokens 4096] [--rows 12]

For each layer type it runs each front-end branch alone (the chains ``bench_attn.py`` times:
q, window kv, compressor, indexer incl. q_lora) under torch.profiler after warm-up, and prints the
kernels sorted by total device time, with the branch's total and the count of kernels. The same
tables go to $OUT/profile_attn.txt when OUT is set.
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_attn import CTX, branches, make_attn


def kernel_table(prof, rows: int) -> tuple[str, float, int]:
    evs = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    evs.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in evs)
    count = sum(e.count for e in evs)
    lines = [f"    {'us/iter':>9} {'calls':>6}  kernel"]
    for e in evs[:rows]:
        lines.append(f"    {e.self_device_time_total:9.1f} {e.count:6d}  {e.key[:110]}")
    return "\n".join(lines), total, count


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
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn(x, pos, cache)
                torch.cuda.synchronize()
            table, total, count = kernel_table(prof, args.rows)
            out.append(f"== {args.shape} {kind} prefill {S}: branch {name}: {total:.0f} us of kernels, "
                       f"{count} launches\n{table}")
            print(out[-1], flush=True)
        del attn
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "profile_attn.txt"), "w") as f:
            f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()

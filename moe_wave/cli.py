"""Command line: ``python -m moe_wave info`` and ``python -m moe_wave demo``.

``demo`` runs a small MoE layer through the expert-parallel path and checks it against the
single-process reference. Without a launcher it spawns its own ranks (CPU: gloo, ``--ranks``;
GPU host: every local GPU with NCCL); under torchrun or mpirun it joins the launcher's ranks.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import time

import torch

import moe_wave
from moe_wave.comm import detect_launcher, init_from_env, spawn

__all__ = ["main", "build_parser", "run_demo_rank"]


# ----------------------------------------------------------------------------- info

def _version(module: str) -> str | None:
    try:
        mod = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return None
    return str(getattr(mod, "__version__", "installed"))


def comm_backends() -> list[str]:
    """The comm backends usable in this environment (``torch`` always)."""
    found = ["torch"]
    if torch.cuda.is_available() and _version("torch.distributed._symmetric_memory") is not None:
        found.append("symm")
    if _version("deep_ep") is not None:
        found.append("deepep")
    return found


def _devices() -> list[str]:
    if not torch.cuda.is_available():
        return [f"cpu ({os.cpu_count()} cores)"]
    return [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]


def info_lines() -> list[tuple[str, str]]:
    accel = "none"
    if torch.version.hip:
        accel = f"HIP {torch.version.hip}"
    elif torch.version.cuda:
        accel = f"CUDA {torch.version.cuda}"
    nccl = None
    if torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - a torch built without NCCL
            nccl = None
    rows = [("moe-wave", moe_wave.__version__), ("python", platform.python_version()),
            ("torch", torch.__version__), ("accelerator", accel), ("nccl/rccl", nccl or "n/a")]
    for name, mod in (("transformers", "transformers"), ("mpi4py", "mpi4py"), ("triton", "triton"),
                      ("deep_ep", "deep_ep")):
        rows.append((name, _version(mod) or "not installed"))
    launch = detect_launcher()
    rows += [("devices", ", ".join(_devices())), ("comm backends", ", ".join(comm_backends())),
             ("launcher", f"{launch.kind} (rank {launch.rank}/{launch.world_size}, "
                          f"local {launch.local_rank}/{launch.local_world_size})")]
    return rows


def cmd_info(args) -> int:
    rows = info_lines()
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


# ----------------------------------------------------------------------------- demo

_TOL = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}  # relative to max |reference|


def run_demo_rank(ep, args) -> dict:
    """One rank of the demo: build WaveMoE from shared random weights, run it, compare with the
    single-process reference on this rank's tokens. Returns the aggregated row (same on all ranks)."""
    import torch.distributed as dist

    from moe_wave import MoEConfig, WaveConfig, WaveMoE
    from moe_wave.comm.layout import compute_layout
    from moe_wave.reference import random_full_weights, reference_moe

    cfg = MoEConfig.preset(args.preset)
    if cfg.num_experts % ep.size:  # experts split evenly: round up to a multiple of the EP size
        cfg = MoEConfig.preset(args.preset, num_experts=-(-cfg.num_experts // ep.size) * ep.size)
    dtype = getattr(torch, args.dtype)
    wave = WaveConfig(num_waves=args.waves, partition=args.partition, backend=args.backend, overlap=args.overlap)
    full = random_full_weights(cfg, seed=args.seed, dtype=dtype, device=ep.device)
    moe = WaveMoE(cfg, ep=ep, wave=wave, device=ep.device, dtype=dtype)
    moe.load_full(full)
    g = torch.Generator().manual_seed(args.seed + 1 + ep.rank)  # different tokens on every rank
    x_TD = torch.randn(args.tokens, cfg.hidden_size, generator=g).to(ep.device, dtype)

    sync = torch.cuda.synchronize if ep.device.type == "cuda" else (lambda: None)
    barrier = (lambda: dist.barrier(group=ep.pg)) if ep.pg is not None else (lambda: None)
    y_TD = moe(x_TD)  # warm-up (and the checked output)
    sync()
    barrier()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        moe(x_TD)
    sync()  # host waits for the device: the timing needs it
    ms = (time.perf_counter() - t0) * 1e3 / args.iters

    ref_TD = reference_moe({k: v.float() if v.is_floating_point() else v for k, v in full.items()}, cfg, x_TD.float())
    err = (y_TD.float() - ref_TD).abs().max().item() if args.tokens else 0.0
    scale = ref_TD.abs().max().item() if args.tokens else 1.0
    # Rows that leave this rank: once per (token, peer, wave), there and back again.
    layout = compute_layout(*moe.route(x_TD), moe.plan)
    sent_WP = layout.send_counts_WP
    remote_rows = int(sent_WP.sum() - sent_WP[:, ep.rank].sum())
    bytes_moved = 2 * remote_rows * cfg.hidden_size * x_TD.element_size()
    mine = {"rank": ep.rank, "ms": ms, "err": err, "scale": scale, "bytes": bytes_moved}
    rows = [mine]
    if ep.pg is not None:
        rows = [None] * ep.size
        dist.all_gather_object(rows, mine, group=ep.pg)
    return {"ranks": ep.size, "experts": cfg.num_experts, "backend_pg": ep.backend, "device": str(ep.device),
            "tokens": args.tokens, "ms": max(r["ms"] for r in rows), "err": max(r["err"] for r in rows),
            "scale": max(r["scale"] for r in rows), "bytes": sum(r["bytes"] for r in rows)}


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def format_table(headers: list[str], rows: list[list]) -> str:
    """A plain aligned table (no dependencies)."""
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def print_demo(row: dict, args) -> bool:
    """Print the result table; True when the error is within the dtype's tolerance."""
    tol = _TOL[args.dtype] * max(row["scale"], 1e-6)
    ok = row["err"] <= tol
    print(f"moe-wave demo: preset {args.preset} ({row['experts']} experts), {row['backend_pg']} on {row['device']}, "
          f"waves {args.waves} ({args.partition}), backend {args.backend}, "
          f"overlap {'on' if args.overlap else 'off'}, {args.dtype}, seed {args.seed}")
    headers = ["ranks", "tokens/rank", "bytes moved", "time/iter", "max err", "check"]
    print(format_table(headers, [[row["ranks"], row["tokens"], _fmt_bytes(row["bytes"]), f"{row['ms']:.2f} ms",
                                  f"{row['err']:.2e}", "ok" if ok else f"FAIL (tol {tol:.1e})"]]))
    return ok


def cmd_demo(args) -> int:
    launch = detect_launcher()
    if launch.kind == "none":
        row = spawn(run_demo_rank, None if args.ranks is None else args.ranks, args=(args,),
                    timeout_s=args.timeout)[0]
    else:
        import torch.distributed as dist

        ep = init_from_env(timeout_s=args.timeout)
        try:
            row = run_demo_rank(ep, args)
        finally:
            # Exiting with a live group can abort in its threads' destructors ("terminate called").
            if ep.pg is not None:
                dist.destroy_process_group()
        if launch.rank != 0:
            return 0
    return 0 if print_demo(row, args) else 1


# ----------------------------------------------------------------------------- parser

def _waves(text: str) -> int | str:
    return text if text == "auto" else int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-wave", description="Expert-parallel MoE engine for DeepSeek-V4.")
    p.add_argument("--version", action="version", version=f"moe-wave {moe_wave.__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="versions, devices, comm backends, launcher").set_defaults(func=cmd_info)

    d = sub.add_parser("demo", help="run a small MoE layer over EP ranks and check it against the reference",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d.add_argument("--ranks", type=int, default=None,
                   help="ranks to spawn without a launcher (default: every GPU, or 2 on CPU)")
    d.add_argument("--preset", default="tiny", help="MoEConfig preset: tiny, balanced, v4-flash, v4-pro")
    d.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    d.add_argument("--waves", type=_waves, default=2, help="number of waves W, or 'auto'")
    d.add_argument("--partition", choices=("experts", "tokens"), default="experts")
    d.add_argument("--backend", choices=("torch", "symm", "deepep"), default="torch", help="comm backend")
    d.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="wave pipeline with overlap (--no-overlap: the serial schedule)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--dtype", choices=tuple(_TOL), default="float32")
    d.add_argument("--iters", type=int, default=3, help="timed iterations after one warm-up")
    d.add_argument("--timeout", type=float, default=60, help="collective timeout in seconds")
    d.set_defaults(func=cmd_demo)

    from moe_wave import sweep  # sweep + plot (owned by the benchmark side)

    sweep.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "tokens", 0) < 0:
        raise SystemExit(f"--tokens={args.tokens}: must be >= 0")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

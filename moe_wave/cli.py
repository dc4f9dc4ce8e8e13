"""Command line: ``python -m moe_wave info`` and ``python -m moe_wave demo``.

``demo`` runs a stack of V4 decoder layers (attention + mHC + expert-parallel MoE) serial vs
overlapped and checks the results (``moe_wave.demo``). Without a launcher it spawns its own ranks
(CPU: gloo, ``--ranks``; GPU host: every local GPU with NCCL); under torchrun or mpirun it joins the
launcher's ranks.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys

import torch

import moe_wave
from moe_wave.comm import detect_launcher, init_from_env, spawn
from moe_wave.demo import format_table, print_demo, resolve_defaults, run_demo_rank

__all__ = ["main", "build_parser", "run_demo_rank", "format_table"]


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

# --symm-* flags -> the symm backend's environment (read by every rank's SymmBackend, spawned ranks inherit it)
SYMM_FLAGS = (("symm_mode", "MOE_WAVE_SYMM_MODE", {"auto": "auto", "kernel": "kernel", "copy": "copy"}),
              ("symm_dense", "MOE_WAVE_SYMM_DENSE", {"auto": "auto", "on": "1", "off": "0"}),
              ("symm_signal", "MOE_WAVE_SYMM_SIGNAL", {"barrier": "barrier", "flags": "flags", "memops": "memops"}))


def apply_symm_flags(args, env=None) -> None:
    """Set the symm backend's environment from the demo's --symm-* flags (those given)."""
    env = os.environ if env is None else env
    given = [f"--{name.replace('_', '-')}" for name, _, _ in SYMM_FLAGS if getattr(args, name, None) is not None]
    if given and args.backend != "symm":
        raise ValueError(f"{', '.join(given)}: only with --backend symm (--backend is {args.backend!r})")
    for name, var, values in SYMM_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            env[var] = values[value]


def cmd_demo(args) -> int:
    try:
        resolve_defaults(args)
        apply_symm_flags(args)
    except ValueError as e:
        raise SystemExit(f"moe-wave demo: {e}") from None
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


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the None of preset-dependent flags (their help says what they become)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-wave", description="Expert-parallel MoE engine for DeepSeek-V4.")
    p.add_argument("--version", action="version", version=f"moe-wave {moe_wave.__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="versions, devices, comm backends, launcher").set_defaults(func=cmd_info)

    d = sub.add_parser("demo", help="run a stack of V4 decoder layers over EP ranks, serial vs overlapped, "
                       "and check the results", formatter_class=_HelpFormatter)
    d.add_argument("--ranks", type=int, default=None,
                   help="ranks to spawn without a launcher (default: every GPU, or 2 on CPU)")
    d.add_argument("--preset", choices=("tiny", "v4-flash", "v4-pro"), default=None,
                   help="layer sizes (default: tiny on CPU, v4-flash on a GPU host); tiny is also checked "
                        "against a single-process stack")
    d.add_argument("--layers", type=int, default=None,
                   help="decoder layers, with the preset's layer types (tiny: sliding, csa, hca; v4-flash: "
                        "sliding, sliding, csa, hca, ...). Default: 3 (tiny), 4 (v4-flash), 2 (v4-pro)")
    d.add_argument("--tokens", type=int, default=None, help="tokens per rank (default: 32 tiny, else 2048)")
    d.add_argument("--waves", type=_waves, default=2, help="number of waves W, or 'auto'")
    d.add_argument("--partition", choices=("experts", "tokens"), default="experts")
    d.add_argument("--backend", choices=("torch", "symm", "deepep"), default="torch", help="comm backend")
    d.add_argument("--symm-mode", choices=("auto", "kernel", "copy"), default=None,
                   help="symm backend: SM copies (kernel), copy engines (copy), or auto: dense copy mode where its "
                        "blocks fill and the capacity is >= 1024 tokens, kernel mode below (env MOE_WAVE_SYMM_MODE)")
    d.add_argument("--symm-dense", choices=("auto", "on", "off"), default=None,
                   help="symm copy mode: send each wave's tokens whole, with no pack kernel; auto where a block is "
                        "expected to be >= 80%% useful (env MOE_WAVE_SYMM_DENSE)")
    d.add_argument("--symm-signal", choices=("barrier", "flags", "memops"), default=None,
                   help="symm: what closes an exchange: the barrier kernel, copy-engine completion flags, or stream "
                        "memory operations (no SM; a watchdog bounds the wait) (env MOE_WAVE_SYMM_SIGNAL)")
    d.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="MoE wave pipeline with overlap in the overlapped run (--no-overlap: the serial "
                        "schedule there too); env MOE_WAVE_OVERLAP=0 overrides")
    d.add_argument("--attn-overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="attention branches on side streams in the overlapped run (--no-attn-overlap: one "
                        "stream). Default: env MOE_WAVE_ATTN_OVERLAP, else on")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="default: float32 (tiny), bfloat16 (v4-flash, v4-pro)")
    d.add_argument("--iters", type=int, default=None, help="timed iterations per mode (default: 3 tiny, else 10)")
    d.add_argument("--warmup", type=int, default=None, help="warm-up iterations per mode (default: 1 tiny, else 3)")
    d.add_argument("--timeout", type=float, default=60, help="collective timeout in seconds")
    d.set_defaults(func=cmd_demo)

    from moe_wave import sweep  # sweep + plot (owned by the benchmark side)

    sweep.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (getattr(args, "tokens", 0) or 0) < 0:
        raise SystemExit(f"--tokens={args.tokens}: must be >= 0")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

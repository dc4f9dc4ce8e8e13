"""Command line: ``python -m moe_wave info | demo | sweep | plot | plan``.

``demo`` runs a stack of V4 decoder layers (attention + mHC + expert-parallel MoE) serial vs
overlapped and checks the results (``moe_wave.tools.demo``). Without a launcher it spawns its own ranks
(CPU: gloo, ``--ranks``; GPU host: every local GPU with NCCL); under torchrun or mpirun it joins the
launcher's ranks. ``sweep`` and ``plot``: ``moe_wave.tools.sweep``. ``plan``: ``moe_wave.tools.plan``.

The environment is read here, once per command (``moe_wave.env.read_env``), and merged with the flags under
one rule: a flag given > its ``MOE_WAVE_*`` variable > the default. The ranks get the result as arguments
(the ``WaveConfig`` / ``SymmOptions`` their function builds), never through the environment.

torch and the tools are imported when a command runs, not at import: ``python -m moe_wave --help`` and
``--version`` print from ``COMMANDS`` alone. Ctrl-C ends any command with one line, exit 130.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys

import moe_wave

__all__ = ["main", "build_parser", "run_demo_rank", "format_table", "COMMANDS"]

DESCRIPTION = "Expert-parallel MoE engine for DeepSeek-V4."
# Every command and its one-line help, in the order ``--help`` lists them (sweep, plot and plan register their
# own parsers with the same help: tests/test_one_line.py compares the two).
COMMANDS = {
    "info": "versions, devices, comm backends, launcher",
    "deep-ep-path": "print the folder to prepend to PYTHONPATH so that `import deep_ep` gives moe-wave's DeepEP V1 "
                    "API (export PYTHONPATH=$(python -m moe_wave deep-ep-path):$PYTHONPATH)",
    "demo": "run a stack of V4 decoder layers over EP ranks, serial vs overlapped, and check the results",
    "sweep": "benchmark grid: serial/pipelined/comm/compute per point, CSV + plots",
    "plot": "redraw the sweep plots from a sweep CSV",
    "plan": "project the MoE layer to larger EP sizes and several hosts (a cost model fitted on the measured "
            "benchmarks)",
}


def __getattr__(name: str):
    """``run_demo_rank`` and ``format_table`` (moe_wave.tools.demo), imported on first use."""
    if name in ("run_demo_rank", "format_table"):
        from moe_wave.tools import demo

        return getattr(demo, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------- info

def _version(module: str) -> str | None:
    try:
        mod = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return None
    return str(getattr(mod, "__version__", "installed"))


def comm_backends() -> list[str]:
    """The comm backends usable in this environment (``torch`` always)."""
    import torch

    found = ["torch"]
    if torch.cuda.is_available() and _version("torch.distributed._symmetric_memory") is not None:
        found.append("symm")
    if _version("deep_ep") is not None:
        found.append("deepep")
    return found


def _devices() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return [f"cpu ({os.cpu_count()} cores)"]
    return [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]


def info_lines(environ=None) -> list[tuple[str, str]]:
    """The rows of ``info``; ``environ`` (default: the process environment, ``moe_wave.comm.environ.view()``) is
    read once, through ``read_env``."""
    import torch

    from moe_wave.comm import detect_launcher
    from moe_wave.comm.environ import view
    from moe_wave.env import VARIABLES, read_env

    environ = view() if environ is None else environ
    read_env(environ)   # a malformed MOE_WAVE_* value is an error here too
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
                      ("deep_ep", "deep_ep"), ("deep_gemm", "deep_gemm")):
        rows.append((name, _version(mod) or "not installed"))
    rows.append(("precision", _precision_line(torch)))
    launch = detect_launcher()
    rows += [("devices", ", ".join(_devices())), ("comm backends", ", ".join(comm_backends())),
             ("launcher", f"{launch.kind} (rank {launch.rank}/{launch.world_size}, "
                          f"local {launch.local_rank}/{launch.local_world_size})"),
             ("environment", ", ".join(f"{v}={environ[v]}" for v in VARIABLES if v in environ) or "no MOE_WAVE_*")]
    return rows


def _precision_line(torch) -> str:
    """What --precision auto means here and what runs the FP8 GEMMs (the FP8 projections; the FP8 experts)."""
    from moe_wave.fp8 import fp8_gemm_library, resolve_precision
    from moe_wave.fp8_experts import (AUTO_LAYOUT, FUSED_GATE_UP_ROWS_PER_EXPERT, FUSED_SMALL_TILE_ROWS_PER_EXPERT,
                                      GATE_UP_DG, fp8_gemm_grouped_library)

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    lib = fp8_gemm_grouped_library(dev)
    if lib == "deepgemm":
        cards = "every Hopper GPU" if GATE_UP_DG is True else " / ".join(GATE_UP_DG or ())
        dg = (f"; in the aligned layout above {FUSED_SMALL_TILE_ROWS_PER_EXPERT} rows an expert, on {cards} where "
              f"nvcc builds it, DeepGEMM's own GEMM with the epilogue changed (gate_up_dg)" if GATE_UP_DG else "")
        lib += (f" ({AUTO_LAYOUT}; the first GEMM with SwiGLU as one kernel at <= {FUSED_GATE_UP_ROWS_PER_EXPERT} rows "
                f"an expert: Triton's{dg})")
    return f"auto = {resolve_precision('auto', dev)}; FP8 projections on {fp8_gemm_library(dev)}, FP8 experts on {lib}"


def _bad_input(cmd: str, e: ValueError) -> int:
    """A value the user passed (flag or environment) is wrong: one line, exit 2 (as argparse's own errors)."""
    print(f"moe-wave {cmd}: error: {e}", file=sys.stderr)
    return 2


def cmd_deep_ep_path(args) -> int:
    """The folder whose ``deep_ep`` package is moe-wave's DeepEP V1 API: prepend it to PYTHONPATH."""
    from moe_wave.deepep_compat.__main__ import main as deep_ep_path

    return deep_ep_path()


def cmd_info(args) -> int:
    try:
        rows = info_lines()
    except ValueError as e:
        return _bad_input("info", e)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


# ----------------------------------------------------------------------------- demo

def demo_args(args, environ=None):
    """``args`` completed (``resolve_defaults``) with the environment (default: the process environment), read
    once."""
    from moe_wave.env import read_env
    from moe_wave.tools.demo import resolve_defaults

    env = read_env(environ)
    resolve_defaults(args, env)
    args.high_priority = env.pick("nccl_high_priority", None, True)
    return args


def cmd_demo(args) -> int:
    from moe_wave.comm import detect_launcher, init_from_env, spawn
    from moe_wave.comm.bootstrap import spawn_plan
    from moe_wave.profiling import set_nvtx
    from moe_wave.tools.demo import check_waves, print_demo, run_demo_rank

    try:
        launch = detect_launcher()      # a half-set launcher environment is a ValueError naming the variables
        demo_args(args)
        world_size = spawn_plan(args.ranks, None)[0] if launch.kind == "none" else launch.world_size
        check_waves(args, world_size)
    except ValueError as e:
        return _bad_input("demo", e)
    set_nvtx(args.nvtx)
    if launch.kind == "none":
        row = spawn(run_demo_rank, None if args.ranks is None else args.ranks, args=(args,),
                    timeout_s=args.timeout)[0]
    else:
        import torch.distributed as dist

        try:        # a launcher environment with no launch behind it (no agent, no peers) is named in one line
            ep = init_from_env(timeout_s=args.timeout, high_priority=args.high_priority)
        except ValueError as e:
            return _bad_input("demo", e)
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

def _top_parser(parser_class) -> tuple[argparse.ArgumentParser, object]:
    p = parser_class(prog="moe-wave", description=DESCRIPTION)
    p.add_argument("--version", action="version", version=f"moe-wave {moe_wave.__version__}")
    return p, p.add_subparsers(dest="cmd", required=True)


def light_parser() -> argparse.ArgumentParser:
    """The top level alone (every command with its help, none of their flags): ``--help`` and ``--version`` with
    no import of torch or the tools."""
    p, sub = _top_parser(argparse.ArgumentParser)
    for name, help_ in COMMANDS.items():
        sub.add_parser(name, help=help_)
    return p


def build_parser() -> argparse.ArgumentParser:
    from moe_wave.tools import plan, sweep
    from moe_wave.tools.flags import HelpFormatter, Parser, add_symm_args, at_least, seconds, waves

    p, sub = _top_parser(Parser)
    sub.add_parser("info", help=COMMANDS["info"]).set_defaults(func=cmd_info)
    sub.add_parser("deep-ep-path", help=COMMANDS["deep-ep-path"]).set_defaults(func=cmd_deep_ep_path)

    d = sub.add_parser("demo", help=COMMANDS["demo"], formatter_class=HelpFormatter)
    d.add_argument("--ranks", type=at_least(1), default=None,
                   help="ranks to spawn without a launcher (default: every GPU, or 2 on CPU)")
    d.add_argument("--preset", choices=("tiny", "v4-flash", "v4-pro"), default=None,
                   help="layer sizes (default: tiny on CPU, v4-flash on a GPU host); tiny is also checked "
                        "against a single-process stack")
    d.add_argument("--layers", type=at_least(1), default=None,
                   help="decoder layers, with the preset's layer types (tiny: sliding, csa, hca; v4-flash: "
                        "sliding, sliding, csa, hca, ...). Default: 3 (tiny), 4 (v4-flash), 2 (v4-pro)")
    d.add_argument("--tokens", type=at_least(1, "tokens per rank: attention runs on each rank's own sequence"),
                   default=None, help="tokens per rank (default: 32 tiny, else 2048)")
    d.add_argument("--waves", type=waves, default=None,
                   help="number of waves W, or 'auto'; with --partition experts at most the local experts per rank. "
                        "Default: 2, or 1 on one rank (nothing crosses there, so waves would only split the experts' "
                        "work)")
    d.add_argument("--partition", choices=("experts", "tokens"), default="experts")
    d.add_argument("--sends", choices=("wave", "once"), default="wave",
                   help="how often a (token, peer) row crosses with --partition experts: once per wave with one of "
                        "its experts there, or once per layer each way (the peer keeps it for later waves and sends "
                        "its sum home after the last; symm backend)")
    d.add_argument("--backend", choices=("auto", "torch", "symm", "deepep"), default="auto",
                   help="comm backend; auto: symm on the GPUs of one host (and with --sends once), torch elsewhere")
    d.add_argument("--graph", action=argparse.BooleanOptionalAction, default=None,
                   help="replay every layer from CUDA graphs (captured per mode at --tokens). Default: env "
                        "MOE_WAVE_GRAPH, else on wherever capture is possible (a GPU and the symm backend)")
    d.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="MoE wave pipeline with overlap in the overlapped run (--no-overlap: the serial "
                        "schedule there too). Default: env MOE_WAVE_OVERLAP, else on")
    d.add_argument("--attn-overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="attention branches on side streams in the overlapped run (--no-attn-overlap: one "
                        "stream). Default: env MOE_WAVE_ATTN_OVERLAP, else on")
    d.add_argument("--attn-kernels", choices=("auto", "on", "off"), default=None,
                   help="the attention's fused Triton kernels: auto (on a GPU), on (also on CPU under "
                        "TRITON_INTERPRET=1), off. Default: env MOE_WAVE_ATTN_KERNELS, else auto")
    d.add_argument("--precision", choices=("auto", "bf16", "fp8"), default=None,
                   help="fp8: DeepSeek-V4's own precision, the attention projections and the routed and shared "
                        "experts in FP8 (e4m3, 128 x 128 block scales; V4Attention.quantize_fp8, "
                        "WaveMoE.quantize_fp8), DeepGEMM's FP8 GEMMs on Hopper; bf16: the model dtype (--dtype). "
                        "auto: fp8 on a Hopper GPU with deep_gemm, else bf16. Default: env MOE_WAVE_PRECISION, "
                        "else auto")
    d.add_argument("--autowave-cache", default=None, metavar="PATH",
                   help="--waves auto: where the wave choices persist, a .json file or a folder. Default: env "
                        "MOE_WAVE_CACHE, else this run only")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="default: float32 (tiny), bfloat16 (v4-flash, v4-pro)")
    d.add_argument("--iters", type=at_least(1), default=None,
                   help="timed iterations per mode (default: 3 tiny, else 10)")
    d.add_argument("--warmup", type=at_least(0), default=None,
                   help="warm-up iterations per mode (default: 1 tiny, else 3)")
    d.add_argument("--timeout", type=seconds, default=60, help="collective timeout in seconds (> 0)")
    add_symm_args(d)
    d.set_defaults(func=cmd_demo)
    sweep.register(sub)
    plan.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cmd = next((a for a in argv if a in COMMANDS), None)
    try:
        if argv in (["-h"], ["--help"], ["--version"]):
            light_parser().parse_args(argv)        # prints and exits
        args = build_parser().parse_args(argv)
        return args.func(args)
    except KeyboardInterrupt:
        print(f"moe-wave{' ' + cmd if cmd else ''}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

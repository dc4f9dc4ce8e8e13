"""``python -m moe_wave sweep``: a grid of MoE benchmark points; ``python -m moe_wave plot CSV``.

Grid axes: model shape (presets, and/or one custom --hidden/--intermediate/--experts/--topk), tokens
per rank, waves, partition, comm backend, shared-expert placement. (Attention overlap is not an axis:
this sweep times the MoE block alone; ``benchmarks/bench_attn.py`` covers the attention front-end.)

Per point: the ``moe_wave.tools.bench.measure`` numbers and the pipelined-vs-serial check, plus the
``auto`` wave count of that (shape, tokens, partition, backend, placement) group and its pipelined
time. Output: a CSV (one row per point, each with the command that reproduces it), a JSON sidecar
in the benchmark-file format (``{"meta", "rows"}``: versions, git SHA, devices, settings), a markdown
summary (both ``moe_wave.tools.sweep_report``), and the plots (``moe_wave.tools.plots``; without matplotlib a note
up front, and no plots). Points already in the CSV are skipped (resume); ``moe_wave.tools.sweep_csv`` writes each
row durably and drops a torn or malformed row on resume, whose point is then measured again.
Without ``--out`` the files go to ``$OUT/sweep.csv``, else ``results/sweep/<date>-sweep-<kind>.csv``
(``results/`` is not committed; copy a run worth keeping into ``benchmarks/`` by hand).
Without a launcher the ranks are spawned here (CPU: 2 gloo ranks; GPU host: one per GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_wave.comm import detect_launcher, environ, init_from_env, spawn
from moe_wave.comm.bootstrap import spawn_plan
from moe_wave.comm.layout import PARTITION_SPECS, split_partition
from moe_wave.config import BACKENDS, PRESETS, SHARED_PLACEMENTS, MoEConfig, WaveConfig
from moe_wave.env import EnvSettings, read_env
from moe_wave.fp8 import resolve_precision
from moe_wave.graphs import graph_capable
from moe_wave.moe import WaveMoE
from moe_wave.profiling import set_nvtx

from . import plots, sweep_csv
from .bench import BenchConfig, init_random_, measure
from .flags import HelpFormatter, add_symm_args, at_least, seconds, symm_argv, symm_options
from .sweep_csv import COLUMNS, KEY, read_rows
from .sweep_report import print_table, run_meta, write_sidecar
from .trace import Tracer

__all__ = ["register", "run", "run_rank", "build_spec", "read_rows", "run_meta", "COLUMNS", "KEY"]


# ----------------------------------------------------------------------------- grid

def _int_list(flag: str, text: str, minimum: int, what: str) -> list[int]:
    out = []
    for tok in str(text).split(","):
        tok = tok.strip()
        try:
            v = int(tok)
        except ValueError:
            raise ValueError(f"{flag}={text!r}: {tok!r} is not an integer ({what})") from None
        if v < minimum:
            raise ValueError(f"{flag}={text!r}: {v} is invalid ({what})")
        out.append(v)
    if not out:
        raise ValueError(f"{flag}={text!r}: needs at least one value ({what})")
    return list(dict.fromkeys(out))


def _choice_list(flag: str, text: str, choices) -> list[str]:
    out = [t.strip() for t in str(text).split(",") if t.strip()]
    bad = [t for t in out if t not in choices]
    if bad or not out:
        raise ValueError(f"{flag}={text!r}: {bad[0] if bad else 'empty'!r} is not one of {', '.join(choices)}")
    return list(dict.fromkeys(out))


def _shapes(args, world_size: int) -> list[dict]:
    custom = [args.hidden, args.intermediate, args.experts, args.topk]
    shapes = []
    if any(v is not None for v in custom):
        names = ("--hidden", "--intermediate", "--experts", "--topk")
        missing = [n for n, v in zip(names, custom) if v is None]
        if missing:
            raise ValueError(f"custom shape: {', '.join(missing)} missing (give all of --hidden, --intermediate, "
                             "--experts and --topk)")
        if args.topk > args.experts:
            raise ValueError(f"--topk={args.topk}: must be <= --experts={args.experts}")
        D, I, E, K = custom
        shapes.append(dict(shape=f"custom-D{D}-I{I}-E{E}-K{K}", hidden=D, intermediate=I, experts=E, topk=K,
                           flags=f"--hidden {D} --intermediate {I} --experts {E} --topk {K}"))
    presets = args.preset
    if presets is None:
        presets = "" if shapes else ("v4-flash,v4-pro,balanced" if torch.cuda.is_available() else "tiny")
    for name in (_choice_list("--preset", presets, sorted(PRESETS)) if presets else []):
        c = PRESETS[name]
        shapes.append(dict(shape=name, hidden=c.hidden_size, intermediate=c.intermediate_size,
                           experts=c.num_experts, topk=c.top_k, flags=f"--preset {name}"))
    for s in shapes:
        if s["experts"] % world_size:
            flag = "--experts" if s["shape"].startswith("custom") else f"--preset {s['shape']}"
            raise ValueError(f"{flag}: num_experts={s['experts']} must be divisible by the {world_size} ranks")
    return shapes


def build_spec(args, world_size: int, launcher: str, env: EnvSettings | None = None,
               out_root: str | None = None) -> dict:
    """Validate the grid (ValueError naming the flag, the value and the rule) into a picklable spec.

    ``env`` (``moe_wave.env.read_env()``; None: no environment) gives what the flags leave unset (flag >
    environment > default); ``out_root`` is the folder of the default ``--out`` (the CLI passes ``$OUT``)."""
    env = env or EnvSettings()
    if world_size < 1:
        raise ValueError(f"--ranks={world_size}: must be >= 1")
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype={dtype!r}: must be one of auto, float32, bfloat16, float16")
    precision = resolve_precision(env.pick("precision", getattr(args, "precision", None), "auto"),
                                  "cuda" if torch.cuda.is_available() else "cpu")
    grid = dict(
        shapes=_shapes(args, world_size),
        tokens=_int_list("--tokens", args.tokens_grid, 1, "tokens per rank must be >= 1"),
        waves=_int_list("--waves", args.waves, 1, "wave counts must be >= 1"),
        partitions=_choice_list("--partition", args.partition, PARTITION_SPECS),
        backends=_choice_list("--backend", args.backend, BACKENDS),
        shared=_choice_list("--shared", args.shared, SHARED_PLACEMENTS))
    backends = grid["backends"]
    symm = symm_options(args, env, backends)
    graph = env.pick("graph", getattr(args, "graph", None), None)
    if graph and not torch.cuda.is_available():
        raise ValueError("--graph (or MOE_WAVE_GRAPH=1): CUDA graphs need a GPU, and none is visible")
    out = Path(args.out) if args.out else default_out(world_size, out_root)
    if out.is_dir() or not out.suffix:  # a folder: the CSV goes inside it
        out = out / "sweep.csv"
    if out.suffix != ".csv":
        raise ValueError(f"--out={str(out)!r}: must be a folder or end in .csv")
    if launcher == "none":
        prefix = f"python -m moe_wave sweep --ranks {world_size}"
    else:
        prefix = f"torchrun --nproc-per-node={world_size} -m moe_wave sweep"
    graph_flag = [] if graph is None else ["--graph" if graph else "--no-graph"]
    return dict(grid=grid, dtype=dtype, precision=precision, out=str(out), trace=args.trace, auto=args.auto, plots=args.plots, graph=graph,
                bench=dict(warmup=args.warmup, iters=args.iters, pool=args.pool, seed=args.seed), symm=symm,
                autowave_cache=env.pick("autowave_cache", args.autowave_cache, None),
                nvtx=env.pick("nvtx", None, False),
                git_sha=env.pick("git_sha", None, None),
                prefix=prefix, common=" ".join([f"--dtype {dtype} --precision {precision} --iters {args.iters} "
                                                f"--warmup {args.warmup}",
                                                f"--out {out}", *graph_flag, *symm_argv(symm)]),
                argv=command_line())


def command_line() -> str:
    """This process's command as a user would type it (``python -m moe_wave ...`` for the CLI)."""
    head = Path(sys.argv[0]).name
    head = "python -m moe_wave" if head in ("__main__.py", "cli.py") else head
    return " ".join([head] + sys.argv[1:])


def default_out(world_size: int, out_root: str | None = None) -> Path:
    """``<out_root>/sweep.csv``, else ``results/sweep/<date>-sweep-<kind>.csv``: never the committed
    ``benchmarks/`` folder, which holds only runs someone chose to keep."""
    if out_root:
        return Path(out_root) / "sweep.csv"
    day = datetime.date.today().isoformat()
    kind = f"{world_size}gpu" if torch.cuda.is_available() else f"cpu{world_size}"
    return Path("results") / "sweep" / f"{day}-sweep-{kind}.csv"


@dataclass(frozen=True)
class Point:
    shape: dict
    tokens: int
    waves: int
    partition: str
    backend: str
    shared: str

    def key(self, dtype: str, world_size: int) -> tuple:
        s = self.shape
        return tuple(str(v) for v in (s["shape"], s["hidden"], s["intermediate"], s["experts"], s["topk"],
                                      self.tokens, self.waves, self.partition, self.backend, self.shared,
                                      dtype, world_size))

    def group(self) -> tuple:
        return (self.shape["shape"], self.tokens, self.partition, self.backend, self.shared)

    def command(self, spec: dict) -> str:
        return (f"{spec['prefix']} {self.shape['flags']} --tokens {self.tokens} --waves {self.waves} "
                f"--partition {self.partition} --backend {self.backend} --shared {self.shared} {spec['common']}")


def points(spec: dict) -> list[Point]:
    g = spec["grid"]
    return [Point(s, t, w, p, b, sh) for s in g["shapes"] for t in g["tokens"] for p in g["partitions"]
            for b in g["backends"] for sh in g["shared"] for w in g["waves"]]


# ----------------------------------------------------------------------------- one rank

def run_rank(ep, spec: dict) -> list[tuple]:
    """The sweep on one rank (all ranks together). Rank 0 appends each row to the CSV as soon as it is
    measured (``sweep_csv``: a crash loses at most that row). Returns the keys of the points measured in
    this call."""
    set_nvtx(spec["nvtx"])   # a spawned rank is a fresh process
    out, dtype, P = Path(spec["out"]), spec["dtype"], ep.size
    fp8 = spec.get("precision") == "fp8"
    dtype_col = "fp8" if fp8 else dtype     # the CSV's dtype column: the experts' format
    todo = None
    if ep.rank == 0:
        rows, writer = sweep_csv.resume(out)
        done = {tuple(r[k] for k in KEY) for r in rows}
        todo = [p for p in points(spec) if p.key(dtype_col, P) not in done]
    todo = ep.broadcast_object(todo)
    bar = _progress(len(todo), ep.rank == 0)
    bench = BenchConfig(**spec["bench"])
    tracer = Tracer(spec["trace"], ep.rank)
    device = str(torch.cuda.get_device_name(ep.device)) if ep.device.type == "cuda" else "cpu"
    measured, m, moe_shape, auto = [], None, None, {}
    try:
        for pt in todo:
            s = pt.shape
            if moe_shape != s["shape"]:
                m = None  # free the previous shape's weights first
                if ep.device.type == "cuda":
                    torch.cuda.empty_cache()
                cfg = MoEConfig(hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                                num_experts=s["experts"], top_k=s["topk"])
                moe_shape = s["shape"]
                m = init_random_(WaveMoE(cfg, ep=ep, device=ep.device, dtype=getattr(torch, dtype)),
                                 seed=spec["bench"]["seed"])
                if fp8:
                    m.quantize_fp8()
            # each point is a view of the last one: it keeps the comm backend while backend and symm options do
            partition, sends = split_partition(pt.partition)
            sched = dict(partition=partition, sends=sends, backend=pt.backend, shared_placement=pt.shared,
                         symm=spec["symm"], autowave_cache=spec["autowave_cache"])
            if spec["auto"] and pt.group() not in auto:
                m = m.rescheduled(WaveConfig(num_waves="auto", **sched))
                r = measure(m, pt.tokens, bench, kinds=("pipelined",))
                auto[pt.group()] = (m.plan.num_waves, r["pipelined_us"])
            m = m.rescheduled(WaveConfig(num_waves=pt.waves, **sched))
            label = f"{s['shape']} T={pt.tokens} W={pt.waves} {pt.partition} {pt.backend} shared={pt.shared}"
            row = measure(m, pt.tokens, _graphed(bench, spec.get("graph"), m, label), tracer=tracer, label=label)
            key = pt.key(dtype_col, P)
            if ep.rank == 0:
                a_w, a_us = auto.get(pt.group(), ("", ""))
                writer.write({**dict(zip(KEY, key)), **{k: row.get(k, "") for k in COLUMNS if k in row},
                              "effective_waves": m.plan.num_waves, "auto_num_waves": a_w, "auto_us": a_us,
                              "device": device, "command": pt.command(spec)})
            measured.append(key)
            bar.update(1)
    finally:
        bar.close()
        tracer.write()
        if ep.rank == 0:
            writer.close()
    if ep.rank == 0:
        write_sidecar(spec, ep)
    return measured


def _graphed(bench: BenchConfig, graph, moe, label: str) -> BenchConfig:
    """``bench`` with CUDA graphs on where ``graph`` asks (None: wherever the point's backend can be captured)."""
    why = graph_capable(moe.backend, moe.gate.weight.device)
    if graph and why is not None:
        raise ValueError(f"--graph: {why} ({label})")
    return dataclasses.replace(bench, graph=why is None if graph is None else graph)


def _progress(total: int, show: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is in the [bench] extra; without it, no bar
        tqdm = None
    if tqdm is None or not show:
        class _Null:
            def update(self, n):
                pass

            def close(self):
                pass
        return _Null()
    return tqdm(total=total, desc="sweep", unit="pt", dynamic_ncols=True)


# ----------------------------------------------------------------------------- entry points

def run(args, env: EnvSettings | None = None, out_root: str | None = None) -> int:
    """``sweep``: validate, then run on the launcher's ranks or on self-spawned ones (``env``, ``out_root``: see
    ``build_spec``)."""
    env = env or EnvSettings()
    launch = detect_launcher()
    if launch.kind == "none":
        nprocs, _ = spawn_plan(args.ranks, None)
        spec = build_spec(args, nprocs, "none", env, out_root)
        with sweep_csv.locked(spec["out"]):     # one sweep per --out: a second one names the first
            _preflight(spec, show=True)
            spawn(run_rank, nprocs, args=(spec,), timeout_s=args.timeout, deadline_s=args.deadline)
    else:
        spec = build_spec(args, launch.world_size, launch.kind, env, out_root)
        with sweep_csv.locked(spec["out"], take=launch.rank == 0):
            _preflight(spec, show=launch.rank == 0)
            import torch.distributed as dist

            ep = init_from_env(timeout_s=args.timeout, high_priority=env.pick("nccl_high_priority", None, True))
            run_rank(ep, spec)
            dist.destroy_process_group()
        if ep.rank != 0:
            return 0
    rows = read_rows(spec["out"])
    if spec["plots"]:
        for p in plots.draw(rows, Path(spec["out"]).with_suffix("")):
            print(f"plot: {p}")
    elif args.plots:
        print(f"plots: none ({plots.INSTALL_HINT})")
    traces = f", traces in {spec['trace']}" if spec["trace"] else ""
    print(f"csv: {spec['out']}  (+ .json sidecar, .md summary{traces})")
    print_table(rows)
    return 0 if all(r.get("check") == "ok" for r in rows) else 1


def _preflight(spec: dict, show: bool) -> None:
    """What can be said before any point is measured: ValueError for an --out file of other columns; without
    matplotlib, a note (``show``) and no plots (the CSV, sidecar and summary are written all the same)."""
    sweep_csv.load(spec["out"])
    if spec["plots"] and not plots.available():
        spec["plots"] = False
        if show:
            print(f"moe-wave sweep: note: {plots.INSTALL_HINT}; this run writes the CSV, its .json sidecar and .md "
                  "summary, and no plots (--no-plots: no note)", file=sys.stderr)


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=None,
                   help=f"comma list of MoEConfig presets ({', '.join(sorted(PRESETS))}); default: v4-flash,v4-pro,"
                        "balanced on a GPU host, tiny on CPU (none when a custom shape is given)")
    for flag, what in (("--hidden", "D"), ("--intermediate", "I"), ("--experts", "E"), ("--topk", "K")):
        p.add_argument(flag, type=at_least(1), default=None, help=f"custom shape: {what} (give all four)")
    p.add_argument("--tokens", dest="tokens_grid", metavar="LIST", default="128,512,2048,8192",
                   help="comma list of tokens per rank (>= 1)")
    p.add_argument("--waves", default="1,2,4,8", help="comma list of wave counts W (>= 1)")
    p.add_argument("--partition", default="experts", help=f"comma list of {', '.join(PARTITION_SPECS)} (experts-once: "
                   "the experts partition with WaveConfig.sends='once', a row once per layer)")
    p.add_argument("--backend", default="auto", help=f"comma list of comm backends: {', '.join(BACKENDS)} (auto: "
                   "symm on the GPUs of one host, torch elsewhere)")
    p.add_argument("--graph", action=argparse.BooleanOptionalAction, default=None,
                   help="time every kind replayed from a CUDA graph. Default: env MOE_WAVE_GRAPH, else on for the "
                        "points whose backend can be captured (symm on a GPU)")
    p.add_argument("--shared", default="bubbles,serial",
                   help=f"comma list of shared-expert placements: {', '.join(SHARED_PLACEMENTS)}")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16")
    p.add_argument("--precision", choices=("auto", "bf16", "fp8"), default=None,
                   help="fp8: the experts in DeepSeek-V4's FP8 format (WaveMoE.quantize_fp8; the CSV's dtype column "
                        "reads fp8); bf16: --dtype. auto: fp8 on a Hopper GPU with deep_gemm, else bf16. Default: env "
                        "MOE_WAVE_PRECISION, else auto")
    p.add_argument("--iters", type=at_least(1), default=20, help="timed iterations per kind (median)")
    p.add_argument("--warmup", type=at_least(0), default=3, help="untimed iterations per kind")
    p.add_argument("--pool", type=at_least(1), default=4, help="distinct random inputs rotated through")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--auto", action=argparse.BooleanOptionalAction, default=True,
                   help="also time num_waves='auto' per group (auto_num_waves, auto_us)")
    p.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True, help="draw PNGs beside the CSV")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="write DIR/trace_rank{r}.json.gz (torch.profiler, Perfetto) with one iteration per kind "
                        "and point; MOE_WAVE_NVTX=1 adds NVTX ranges for Nsight")
    p.add_argument("--out", default=None,
                   help="CSV path or folder (default $OUT/sweep.csv, else results/sweep/<date>-sweep-<kind>.csv; "
                        "never benchmarks/); resumed if present")
    p.add_argument("--autowave-cache", default=None, metavar="PATH",
                   help="where --auto's wave choices persist: a .json file or a folder (env MOE_WAVE_CACHE; default: "
                        "this run only)")
    p.add_argument("--ranks", type=at_least(1), default=None,
                   help="ranks to spawn without a launcher (default: every GPU, or 2)")
    p.add_argument("--timeout", type=seconds, default=120, help="collective timeout in seconds")
    p.add_argument("--deadline", type=seconds, default=6 * 3600, help="bound on a self-spawned sweep, in seconds")
    add_symm_args(p)


def _plot_cmd(args) -> int:
    def say(msg: str) -> None:
        print(f"moe-wave plot: {msg}", file=sys.stderr)

    path = Path(args.csv)
    if not path.is_file():
        say(f"error: {args.csv}: no such file")
        return 2
    try:
        drawn = plots.draw(read_rows(path, report=say), path.with_suffix(""))
    except ValueError as e:   # not a sweep's CSV
        say(f"error: {e}")
        return 2
    except ImportError as e:
        say(f"error: {e}")
        return 1
    if not drawn:
        say(f"{path}: no row with check ok: nothing to draw")
        return 1
    for p in drawn:
        print(f"plot: {p}")
    return 0


def _sweep_cmd(args) -> int:
    try:
        env = read_env()
        set_nvtx(env.pick("nvtx", None, False))
        # $OUT: the folder the GPU scripts hand every tool for its results
        return run(args, env, environ.get("OUT") or None)
    except ValueError as e:
        print(f"moe-wave sweep: error: {e}", file=sys.stderr)
        return 2


def register(subparsers) -> None:
    """Add ``sweep`` and ``plot`` to the CLI's subparsers."""
    s = subparsers.add_parser("sweep", help="benchmark grid: serial/pipelined/comm/compute per point, CSV + plots",
                              formatter_class=HelpFormatter)
    add_sweep_args(s)
    s.set_defaults(func=_sweep_cmd)
    p = subparsers.add_parser("plot", help="redraw the sweep plots from a sweep CSV")
    p.add_argument("csv", help="a CSV written by `moe-wave sweep`")
    p.set_defaults(func=_plot_cmd)

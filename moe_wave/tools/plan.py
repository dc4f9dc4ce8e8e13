"""``python -m moe_wave plan``: fit the cost model (``moe_wave.tools.costmodel``) on committed benchmark results and
print its projection of one MoE layer to larger EP sizes and to several hosts.

    python -m moe_wave plan --ep 8,16,64 --preset v4-flash --tokens 128,4096 --rdma-GBps 50

The points come from the JSON result files of ``benchmarks/bench_comm.py`` (the tokens and graph sections: one-wave
dispatch, combine and prepare per layout and token count) and ``benchmarks/bench_moe.py`` (comm_only, compute_only,
pipelined per wave count). ``--backend`` picks which rows of those files describe the backend to project. The
default files are the points committed in ``benchmarks/results/points/``: ``comm-ep<N>.json`` and ``moe-ep<N>.json``
per EP size measured (the committed ones cover EP2; ``launch/gpu_ep.sh``'s comm.json and moe_graph.json go there for EP4 / EP8).

Every flag is checked when it is parsed (one line naming the flag, the value and the rule; exit 2).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from pathlib import Path

from moe_wave.config import PRESETS, MoEConfig
from moe_wave.tools.costmodel import (CommSample, LayerCostModel, MoESample, Topology, fit, held_out, leave_one_out,
                                summarize)
from moe_wave.tools.demo import format_table
from moe_wave.tools.flags import HelpFormatter, at_least, number

__all__ = ["register", "load_points", "BACKENDS", "default_data", "int_list", "positive", "non_negative"]

REPO = Path(__file__).resolve().parent.parent.parent
DEFAULT_DATA = ("benchmarks/results/points/comm-ep*.json", "benchmarks/results/points/moe-ep*.json")

# which rows of the comm and MoE benchmarks describe each backend
BACKENDS = {
    "symm": (lambda r: r.get("backend") == "symm-kernel" and bool(r.get("graph")),
             lambda r: r.get("backend") == "symm" and bool(r.get("cuda_graph"))),
    "symm-copy": (lambda r: r.get("backend") == "symm-copy+dense" and bool(r.get("graph")),
                  lambda r: r.get("backend") == "symm" and bool(r.get("cuda_graph"))),
    "torch": (lambda r: r.get("backend") == "torch" and not r.get("graph"),
              lambda r: r.get("backend") == "torch" and not r.get("cuda_graph")),
    "deepep": (lambda r: r.get("backend") == "deepep",
               lambda r: r.get("backend") == "deepep"),
}
BACKEND_HELP = ("symm: the symm backend's kernel mode replayed from CUDA graphs; symm-copy: its dense copy mode "
                "under graphs; torch: NCCL, eager; deepep: DeepEP V1 normal mode")


def default_data(root: Path = REPO) -> list[str]:
    """The default result files that exist under ``root``, sorted, without duplicates."""
    found = set()
    for pattern in DEFAULT_DATA:
        found.update(glob.glob(str(root / pattern)))
    return sorted(found)


def _float(r: dict, key: str) -> float | None:
    v = r.get(key)
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


def load_points(paths, backend: str) -> tuple[list[CommSample], list[MoESample]]:
    """The comm and MoE points of ``backend`` in the result files ``paths`` (a file of another kind adds none).

    Raises:
        ValueError: a file is missing, is not JSON, or has no ``meta.world_size`` / ``rows``.
    """
    comm_ok, moe_ok = BACKENDS[backend]
    comm, moe = [], []
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"--data {path}: no such file") from None
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--data {path}: not a readable JSON result file ({e})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list) or \
                not isinstance(doc.get("meta", {}).get("world_size"), int):
            raise ValueError(f"--data {path}: must be a benchmark result ({{'meta': {{'world_size': ...}}, "
                             f"'rows': [...]}})")
        P, name = doc["meta"]["world_size"], os.path.basename(path)
        for r in doc["rows"]:
            if not isinstance(r, dict) or r.get("skipped"):
                continue
            layout = r.get("layout") or r.get("shape")
            if layout not in PRESETS or not isinstance(r.get("tokens_per_rank"), int):
                continue
            cfg, T = MoEConfig.preset(layout), r["tokens_per_rank"]
            if "dispatch_us" in r and comm_ok(r):
                d, c = _float(r, "dispatch_us"), _float(r, "combine_us")
                if d or c:
                    comm.append(CommSample(cfg=cfg, ranks=P, tokens=T, dispatch_us=d, combine_us=c,
                                           prepare_us=_float(r, "prepare_us"), source=name))
            elif "compute_only_us" in r and moe_ok(r) and r.get("check", "ok") == "ok":
                times = [_float(r, k) for k in ("comm_only_us", "compute_only_us", "pipelined_us")]
                if all(times):
                    moe.append(MoESample(cfg=cfg, ranks=P, tokens=T, waves=int(r.get("effective_waves")
                                                                                or r.get("num_waves") or 1),
                                         comm_only_us=times[0], compute_only_us=times[1], pipelined_us=times[2],
                                         serial_us=_float(r, "serial_us"), source=name))
    return comm, moe


# ----------------------------------------------------------------------------- flag types

def int_list(lo: int):
    """``type=`` for a comma list of integers, each >= ``lo``."""
    def parse(text: str) -> list[int]:
        try:
            vals = [int(x) for x in text.split(",")]
        except ValueError:
            vals = []
        if not vals or min(vals) < lo:
            raise argparse.ArgumentTypeError(f"{text!r}: must be a comma list of integers >= {lo}")
        return sorted(set(vals))
    return parse


positive = number("a number > 0")
non_negative = number("a number >= 0", zero=True)


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ep", type=int_list(1), default="2,4,8,16,32,64",
                   help="EP sizes to project, a comma list; beyond --gpus-per-host whole hosts")
    p.add_argument("--preset", choices=tuple(k for k in PRESETS if k != "tiny"), default="v4-flash",
                   help="the MoE layer's shape")
    p.add_argument("--tokens", type=int_list(1), default="128,4096", help="tokens per rank, a comma list")
    p.add_argument("--waves", type=int_list(1), default="1,2,4,8",
                   help="wave counts to try; each point shows the best (clamped to the local experts)")
    p.add_argument("--backend", choices=tuple(BACKENDS), default="symm", help=BACKEND_HELP)
    p.add_argument("--gpus-per-host", type=at_least(1), default=8, help="GPUs per NVLink domain (host)")
    p.add_argument("--nvlink-GBps", type=positive, default=None,
                   help="per-GPU NVLink bandwidth, one direction (default: the one fitted on the measured points)")
    p.add_argument("--rdma-GBps", type=positive, default=50.0,
                   help="per-GPU RDMA bandwidth between hosts, one direction (400 Gb/s NIC: 50)")
    p.add_argument("--rdma-latency-us", type=non_negative, default=5.0,
                   help="latency added to every exchange that crosses hosts")
    p.add_argument("--data", action="append", default=None, metavar="FILE",
                   help="a bench_comm / bench_moe result JSON (repeatable; default: the EP2 results in benchmarks/ "
                        "and any committed EP4 / EP8 ones)")
    p.add_argument("--holdout-ep", type=at_least(1), default=None,
                   help="also fit without the points at this EP size and report the error on them (default: the "
                        "largest measured EP size, when there are two or more)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the fit, the errors and the projection")


def check_args(args) -> str | None:
    """What is wrong with a combination of flags (one line), or None."""
    cfg = MoEConfig.preset(args.preset)
    for P in args.ep:
        if cfg.num_experts % P:
            return f"argument --ep: {P}: must divide the {cfg.num_experts} experts of {args.preset}"
        if P > args.gpus_per_host and P % args.gpus_per_host:
            return (f"argument --ep: {P}: beyond one host it must be a multiple of --gpus-per-host "
                    f"{args.gpus_per_host} (whole hosts)")
    return None


# ----------------------------------------------------------------------------- report

def _fit_rows(model: LayerCostModel) -> list[list]:
    rows = []
    for what, f in (("dispatch", model.dispatch), ("combine", model.combine), ("prepare", model.prepare),
                    ("layer comm", model.layer_comm), ("compute", model.compute)):
        for name, v, st in zip(f.names, f.values, f.status):
            shown = f"{v:.4g}"
            if name == "us_per_MB" and v > 0:
                shown += f" ({1e3 / v:.0f} GB/s)"
            elif name == "us_per_TFLOP" and v > 0:
                shown += f" ({1e6 / v:.0f} TFLOP/s)"
            elif name == "us_per_GB" and v > 0:
                shown += f" ({1e6 / v:.0f} GB/s)"
            rows.append([what, name, shown, st, f.points])
    rows.append(["layer", "unhidden", f"{model.unhidden:.3g}", model.unhidden_status, ""])
    return rows


def _err_rows(label: str, errors) -> list[list]:
    return [[label, q, s["points"], f"{100 * s['median']:.1f}%", f"{100 * s['max']:.1f}%"]
            for q, s in summarize(errors).items()]


def run(args) -> int:
    paths = args.data if args.data else default_data()
    comm, moe = load_points(paths, args.backend)
    model = fit(comm, moe)
    cfg = MoEConfig.preset(args.preset)
    print(f"moe-wave plan: {args.preset} (D {cfg.hidden_size}, I {cfg.intermediate_size}, E {cfg.num_experts}, "
          f"K {cfg.top_k}), backend {args.backend}; fitted on {len(comm)} comm and {len(moe)} MoE points at EP "
          f"{sorted({s.ranks for s in comm} | {s.ranks for s in moe}) or 'none'}")
    for p in paths:
        print(f"  data: {os.path.relpath(p)}")
    if not comm and not moe:
        print("  no measured point for this backend: every term is its prior")
    for n in model.notes:
        print(f"  note: {n}")
    print()
    print(format_table(["term", "parameter", "value", "status", "points"], _fit_rows(model)))

    loo = leave_one_out(comm, moe)
    measured_eps = sorted({s.ranks for s in comm} | {s.ranks for s in moe})
    hold = args.holdout_ep or (measured_eps[-1] if len(measured_eps) > 1 else None)
    if hold and not [s for s in comm + moe if s.ranks != hold]:
        print(f"  note: no point at an EP size other than {hold} to fit on: nothing held out")
        hold = None
    held = held_out(comm, moe, hold) if hold else []
    err_rows = _err_rows("leave-one-out", loo)
    if hold:
        err_rows += _err_rows(f"EP{hold} held out", held)
    print("\nerror on points the fit did not see, |predicted / measured - 1| (comm_only: layout, count exchange "
          "and every wave's exchanges in the MoE benchmark)")
    print(format_table(["how", "quantity", "points", "median", "max"], err_rows) if err_rows else "  (too few points)")

    proj = []
    for P in args.ep:
        topo = Topology(ranks=P, gpus_per_host=args.gpus_per_host, rdma_GBps=args.rdma_GBps,
                        rdma_latency_us=args.rdma_latency_us, nvlink_GBps=args.nvlink_GBps)
        for T in args.tokens:
            proj.append(model.best(cfg, topo, T, args.waves))
    cols = ["EP", "hosts", "tokens", "W", "NVLink MB", "RDMA MB", "prepare", "dispatch", "combine", "layer comm",
            "compute", "serial", "pipelined", "comm share"]
    rows = [[p.ranks, p.hosts, p.tokens, p.waves, f"{p.nvlink_MB:.1f}", f"{p.rdma_MB:.1f}", f"{p.prepare_us:.0f}",
             f"{p.dispatch_us:.0f}", f"{p.combine_us:.0f}", f"{p.comm_us:.0f}", f"{p.compute_us:.0f}",
             f"{p.serial_us:.0f}",
             f"{p.pipelined_us:.0f}", f"{p.comm_us / p.serial_us:.0%}" if p.serial_us else "-"] for p in proj]
    print(f"\nprojection, us per layer and rank (MB each rank sends per layer; prepare, dispatch, combine as the comm "
          f"benchmark times them, layer comm all of them inside the layer; best W of {args.waves}; "
          f"{args.gpus_per_host} GPUs per host, RDMA {args.rdma_GBps:g} GB/s + {args.rdma_latency_us:g} us)")
    print(format_table(cols, rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "args": {k: v for k, v in vars(args).items() if k not in ("func", "parser")}, "data": paths,
            "fit": [dict(zip(["term", "parameter", "value", "status", "points"], r)) for r in _fit_rows(model)],
            "errors": [dict(zip(["how", "quantity", "points", "median", "max"], r)) for r in err_rows],
            "projection": [dict(zip(cols, r)) for r in rows]}, indent=1))
        print(f"\nwrote {args.json}")
    return 0


def _plan_cmd(args) -> int:
    why = check_args(args)
    if why:
        args.parser.error(why)
    try:
        return run(args)
    except ValueError as e:
        print(f"moe-wave plan: error: {e}", file=sys.stderr)
        return 2


def register(subparsers) -> None:
    """Add ``plan`` to the CLI's subparsers."""
    p = subparsers.add_parser("plan", help="project the MoE layer to larger EP sizes and several hosts (a cost "
                              "model fitted on the measured benchmarks)", formatter_class=HelpFormatter)
    add_plan_args(p)
    p.set_defaults(func=_plan_cmd, parser=p)

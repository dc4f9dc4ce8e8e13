"""The sweep's results beyond its CSV: the JSON sidecar (``{"meta", "rows"}``, the benchmark-file format of
``benchmarks/``: versions, git SHA, devices, settings), the markdown summary (the best wave count per group) and the
table ``python -m moe_wave sweep`` prints last. ``run_meta`` and ``git_sha`` also serve the scripts in
``benchmarks/``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from dataclasses import asdict
from pathlib import Path

import torch

from moe_wave.comm import environ

from .demo import CPU_NOTE, format_table, without_columns
from .sweep_csv import read_rows

__all__ = ["git_sha", "run_meta", "write_sidecar", "best_by_group", "summary_md", "print_table"]


# recorded in the sidecar as they were (moe-wave's own settings are recorded as resolved: ``settings``)
_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "NCCL_ALGO", "NCCL_PROTO",
        "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")


def git_sha(given: str | None = None) -> str:
    """``given`` when set (``MOE_WAVE_GIT_SHA`` through read_env: a copied tree, whose .git may be missing or
    stale), else HEAD of the checkout, else "unknown"."""
    if given:
        return given
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL,
                                       cwd=Path(__file__).resolve().parent).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_meta(world_size: int, command: str, sha: str | None = None, settings: dict | None = None) -> dict:
    """The ``meta`` block of a benchmark result file (``{"meta", "rows"}``, as in benchmarks/)."""
    nccl = "n/a"
    if torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - torch built without NCCL
            pass
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        gpus = f"{world_size} x {names[0]}" if names else "none"
    else:
        names, gpus = [f"cpu ({os.cpu_count()} cores)"], f"none (cpu, {world_size} gloo ranks)"
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "command": command, "git_sha": git_sha(sha),
            "gpus": gpus, "torch": torch.__version__, "nccl": nccl, "world_size": world_size,
            "devices": names, "python": platform.python_version(), "host": platform.node(),
            "env": {k: environ.get(k) for k in _ENV if environ.present(k)}, "settings": settings or {}}


def write_sidecar(spec: dict, ep) -> Path:
    out = Path(spec["out"])
    rows = read_rows(out)
    settings = {"symm": asdict(spec["symm"]), "autowave_cache": spec["autowave_cache"], "nvtx": spec["nvtx"],
                "graph": spec.get("graph")}
    meta = run_meta(ep.size, spec["argv"], spec["git_sha"], settings)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(summary_md(rows, meta))
    return out.with_suffix(".json")


def best_by_group(rows: list[dict]) -> dict:
    """(shape, tokens, partition, backend, shared) -> the row with the lowest pipelined_us (check ok)."""
    best = {}
    for r in rows:
        if r.get("check") != "ok" or not r.get("pipelined_us"):
            continue
        g = (r["shape"], int(r["tokens_per_rank"]), r["partition"], r["backend"], r["shared_placement"])
        if g not in best or float(r["pipelined_us"]) < float(best[g]["pipelined_us"]):
            best[g] = r
    return best


def summary_md(rows: list[dict], meta: dict) -> str:
    lines = [f"# moe-wave sweep, {meta['date']}", "",
             f"{meta['gpus']}, torch {meta['torch']}, NCCL {meta['nccl']}, git {meta['git_sha'][:10]}", "",
             f"`{meta['command']}`", "", "Best wave count per group (lowest pipelined time; auto = autowave):", "",
             "| shape | tokens/rank | partition | backend | shared | best W | pipelined us | serial us | speedup "
             "| overlap | auto W | auto us | auto vs best |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for g, r in sorted(best_by_group(rows).items()):
        gap = ""
        if r.get("auto_us"):
            gap = f"{float(r['auto_us']) / float(r['pipelined_us']) - 1:+.1%}"
        lines.append(f"| {' | '.join(map(str, g))} | {r['num_waves']} | {r['pipelined_us']} | {r['serial_us']} | "
                     f"{r['speedup']} | {r['overlap_ratio']} | {r.get('auto_num_waves', '')} | "
                     f"{r.get('auto_us', '')} | {gap} |")
    fails = sum(r.get("check") != "ok" for r in rows)
    lines += ["", f"{len(rows)} points, {fails} failed checks."]
    return "\n".join(lines) + "\n"


def print_table(rows: list[dict]) -> None:
    head = ["shape", "T", "W", "part", "shared", "serial", "pipelined", "comm", "compute", "speedup", "overlap",
            "check", "autoW"]
    keys = ["shape", "tokens_per_rank", "num_waves", "partition", "shared_placement", "serial_us", "pipelined_us",
            "comm_only_us", "compute_only_us", "speedup", "overlap_ratio", "check", "auto_num_waves"]
    table = [[r.get(k, "") for k in keys] for r in rows]
    cpu = bool(rows) and all(r.get("device") == "cpu" for r in rows)
    if cpu:
        head, table = without_columns(head, table, ("speedup", "overlap"))
    print(format_table(head, table))
    if cpu:
        print(f"{CPU_NOTE} (the CSV keeps every column)")

"""Timelines: one gzip-compressed chrome trace per rank (``trace_rank{r}.json.gz``), for Perfetto.

    with Tracer(out_dir, rank) as tr:          # Tracer(None, rank) records nothing
        ...timed work, not recorded...
        with tr.capture("point v4-flash T=512 W=4"):
            moe(x)                             # recorded, with the named ranges below

Each ``capture`` is its own short torch.profiler session (CPU, plus CUDA kernels on a GPU); their
events share one clock and are merged into a single file, so a whole sweep gives one trace per
rank without profiling the timed iterations. The named ranges are the ones the code already
emits through ``moe_wave.profiling.annotate``: ``router``, ``layout``, ``prepare``,
``wave{w}.dispatch`` / ``.experts`` / ``.combine``, ``shared.*``, ``bench.<kind>`` and the
attention branches. For Nsight Systems, ``moe_wave.profiling.set_nvtx(True)`` (the CLI: ``MOE_WAVE_NVTX=1``)
turns the same names into NVTX ranges.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["Tracer", "load_trace", "range_names"]


class Tracer:
    """Collects ``capture`` blocks of one rank and writes ``<out_dir>/trace_rank{rank}.json.gz``.

    Args:
        out_dir: folder for the trace (created), or None to record nothing.
        rank: this process's rank (names the file).
    """

    def __init__(self, out_dir: str | os.PathLike | None, rank: int = 0):
        self.path = None if out_dir is None else Path(out_dir) / f"trace_rank{rank}.json.gz"
        self.rank = rank
        self._events: list[dict] = []
        self._meta: dict = {}
        self._seen_meta: set = set()

    @property
    def enabled(self) -> bool:
        return self.path is not None

    @contextlib.contextmanager
    def capture(self, label: str):
        """Record the enclosed block (a no-op when disabled)."""
        if not self.enabled:
            yield
            return
        acts = [ProfilerActivity.CPU]
        cuda = torch.cuda.is_available()
        if cuda:
            acts.append(ProfilerActivity.CUDA)
        with profile(activities=acts) as prof:
            with record_function(label):
                yield
            if cuda:
                torch.cuda.synchronize()  # HOST SYNC: the block's kernels must land inside the session
        self._merge(prof)

    def _merge(self, prof) -> None:
        with tempfile.TemporaryDirectory(prefix="moe_wave_trace_") as tmp:
            p = os.path.join(tmp, "t.json")
            prof.export_chrome_trace(p)
            with open(p) as f:
                data = json.load(f)
        for ev in data.pop("traceEvents", []):
            if ev.get("ph") == "M":  # process/thread names: once per (pid, tid, name)
                key = (ev.get("pid"), ev.get("tid"), ev.get("name"), json.dumps(ev.get("args"), sort_keys=True))
                if key in self._seen_meta:
                    continue
                self._seen_meta.add(key)
            self._events.append(ev)
        if not self._meta:
            data.pop("traceName", None)
            self._meta = data

    def write(self) -> Path | None:
        """Write the merged trace (valid JSON after gunzip); returns its path."""
        if not self.enabled:
            return None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        doc = {**self._meta, "traceEvents": self._events, "traceName": f"moe-wave rank {self.rank}"}
        tmp = self.path.with_suffix(".tmp")
        with gzip.open(tmp, "wt") as f:
            json.dump(doc, f)
        os.replace(tmp, self.path)
        return self.path

    def __enter__(self) -> "Tracer":
        return self

    def __exit__(self, *exc) -> None:
        self.write()


def load_trace(path: str | os.PathLike) -> dict:
    """Read a ``trace_rank{r}.json.gz``."""
    with gzip.open(path, "rt") as f:
        return json.load(f)


def range_names(path: str | os.PathLike) -> set[str]:
    """Names of the complete ("X") events of a trace: ranges, ops and kernels."""
    return {ev["name"] for ev in load_trace(path).get("traceEvents", []) if ev.get("ph") == "X"}

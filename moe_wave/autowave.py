"""``WaveConfig(num_waves="auto")``: pick W from a small cost model, calibrated once per shape.

Legend: T local tokens, W waves, X one-way transfer time of all rows, C expert time of all rows.

Model (times in microseconds), per wave w of W:

    dispatch_w = combine_w = a + X / W       a: per-op overhead (launch, sync, latency); X: bytes / bandwidth
    experts_w  = o + C / W                   o: per-wave compute overhead = launches + the GEMM efficiency
                                             lost on W-times-fewer rows (with eff(n) = n / (n + n_half),
                                             time(n/W) = f * (n/W + n_half): a constant per wave)
    total(W)   = F + schedule(W)             F: layout + count exchange (independent of W)

``schedule`` replays the issue order of ``moe_wave.pipeline.run_waves`` on two resources (the comm
stream runs d0 d1 b0 d2 b1 ... in order; wave w's experts start once d_w has landed and wave w-1's
experts are done; b_w starts once experts_w are done). The shared expert sits in the bubbles and is
left out. Calibration (``calibrate``) times F, comm-only and routed-compute-only at W=1 and at W=Wc
(4, or fewer local experts) on the first real batch and fits a, X, o, C from the two points.

The choice is cached per shape key (device, ranks, D, I, E, K, dtype, backend, partition, T rounded up
to a power of two) in this process and in a JSON file: ``$MOE_WAVE_CACHE`` (a file, or a folder that
gets ``autowave.json``; ``off`` disables the file), else ``~/.cache/moe_wave/autowave.json``. Every
rank takes the same decision: times are maxed over ranks, and a cache hit counts only if every rank hit.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from moe_wave.comm.layout import WavePlan, compute_layout

__all__ = ["CostModel", "calibrate", "choose_waves", "resolve", "shape_key", "cache_path", "clear_memory_cache"]

_MEMORY: dict[str, dict] = {}
TIE_TOL = 0.02  # prefer the smaller W when its predicted time is within 2% of the best


@dataclass(frozen=True)
class CostModel:
    """The fitted model; see the module docstring. All fields in microseconds, all >= 0."""

    fixed_us: float
    comm_us: float
    comm_op_us: float
    compute_us: float
    compute_wave_us: float

    def predict(self, W: int) -> float:
        d = self.comm_op_us + self.comm_us / W
        c = self.compute_wave_us + self.compute_us / W
        comm, comp, landed = 0.0, 0.0, {}
        for w in range(min(W, 2)):
            comm += d
            landed[w] = comm
        for w in range(W):
            comp = max(comp, landed.pop(w)) + c
            comm = max(comm, comp) + d          # combine w
            if w + 2 < W:
                comm += d                       # dispatch w + 2
                landed[w + 2] = comm
        return self.fixed_us + comm

    @classmethod
    def fit(cls, W: int, fixed_us: float, comm1_us: float, commW_us: float, comp1_us: float,
            compW_us: float) -> "CostModel":
        """From comm-only and compute-only times at W=1 and W (> 1); comm-only includes ``fixed_us``."""
        if W < 2:
            raise ValueError(f"CostModel.fit: W={W}: needs a second wave count >= 2")
        a = max(0.0, (commW_us - comm1_us) / (2 * (W - 1)))
        X = max(0.0, (comm1_us - fixed_us) / 2 - a)
        o = max(0.0, (compW_us - comp1_us) / (W - 1))
        C = max(0.0, comp1_us - o)
        return cls(fixed_us=max(0.0, fixed_us), comm_us=X, comm_op_us=a, compute_us=C, compute_wave_us=o)


def candidates(max_waves: int) -> list[int]:
    """1, 2, 4, ... up to ``max_waves`` (and ``max_waves`` itself)."""
    out, w = [], 1
    while w < max_waves:
        out.append(w)
        w *= 2
    return out + [max_waves]


def choose_waves(model: CostModel, max_waves: int = 8) -> int:
    """The W in ``candidates(max_waves)`` with the lowest predicted time (ties go to the smaller W)."""
    preds = {W: model.predict(W) for W in candidates(max_waves)}
    best = min(preds.values())
    return min(W for W, t in preds.items() if t <= best * (1 + TIE_TOL))


# ----------------------------------------------------------------------------- cache

def cache_path() -> Path | None:
    env = os.environ.get("MOE_WAVE_CACHE")
    if env is not None and env.strip().lower() in ("", "0", "off", "none"):
        return None
    p = Path(env) if env else Path.home() / ".cache" / "moe_wave"
    return p / "autowave.json" if p.suffix != ".json" else p


def _read_file() -> dict:
    p = cache_path()
    try:
        return json.loads(p.read_text()) if p is not None and p.exists() else {}
    except (OSError, ValueError):
        return {}  # a corrupt or unreadable cache is a miss, never an error


def _write_file(key: str, entry: dict) -> None:
    p = cache_path()
    if p is None:
        return
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        data = _read_file()
        data[key] = entry
        tmp = p.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, p)
    except OSError:
        pass  # a read-only home must not break the forward pass


def clear_memory_cache() -> None:
    _MEMORY.clear()


def shape_key(moe, tokens: int) -> str:
    dev = moe.gate.weight.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    cfg, wave = moe.cfg, moe.wave
    bucket = 1 << max(0, int(tokens) - 1).bit_length()
    return (f"{name}|P{moe.ep.size}|D{cfg.hidden_size}|I{cfg.intermediate_size}|E{cfg.num_experts}|K{cfg.top_k}|"
            f"{str(moe.gate.weight.dtype).removeprefix('torch.')}|{wave.backend}|{wave.partition}|T{bucket}")


def _lookup(key: str) -> tuple[dict | None, str]:
    if key in _MEMORY:
        return _MEMORY[key], "memory"
    entry = _read_file().get(key)
    return (entry, "file") if entry is not None else (None, "")


# ----------------------------------------------------------------------------- calibration

@torch.no_grad()
def calibrate(moe, x_TD, ids_TK, w_TK, iters: int = 5, warmup: int = 1) -> tuple[CostModel, int]:
    """Fit the cost model on this batch (every rank together). Returns (model, max_waves)."""
    from .bench import Timer, comm_only, compute_only, pre_receive  # bench imports moe, moe imports us lazily

    e, P = moe.num_local, moe.ep.size
    max_waves = min(8, e) if moe.wave.partition == "experts" else 8
    Wc = min(4, max_waves)
    plans = {W: WavePlan.make(num_ranks=P, num_local_experts=e, num_waves=W, partition=moe.wave.partition)
             for W in (1, Wc)}
    timer = Timer(moe.ep, flush_l2=False)

    def med(fn) -> float:
        return statistics.median(timer.run(lambda i: fn(), iters, warmup))

    fixed = med(lambda: moe.backend.prepare(compute_layout(ids_TK, w_TK, plans[1])))
    comm = {W: med(lambda W=W: comm_only(moe, x_TD, ids_TK, w_TK, plans[W])) for W in plans}
    got = {W: pre_receive(moe, x_TD, ids_TK, w_TK, plans[W]) for W in plans}
    comp = {W: med(lambda W=W: compute_only(moe, x_TD, got[W], shared=False)) for W in plans}
    fixed, c1, cW, k1, kW = timer.max_over_ranks([fixed, comm[1], comm[Wc], comp[1], comp[Wc]])
    if Wc == 1:
        return CostModel(fixed_us=fixed, comm_us=max(0.0, (c1 - fixed) / 2), comm_op_us=0.0,
                         compute_us=k1, compute_wave_us=0.0), 1
    return CostModel.fit(Wc, fixed, c1, cW, k1, kW), max_waves


def _gather(moe, value) -> list:
    if moe.ep.pg is None:
        return [value]
    vals = [None] * moe.ep.size
    dist.all_gather_object(vals, value, group=moe.ep.pg)
    return vals


def resolve(moe, x_TD, ids_TK, w_TK) -> int:
    """Give an ``auto`` WaveMoE its wave plan (once, at its first forward); returns W.

    Every rank must call it together (it is called from ``WaveMoE.forward_routed``). Sets
    ``moe.plan``, ``moe.auto_source`` ("memory", "file", "measured" or "empty") and
    ``moe.auto_model`` (the CostModel, or None on a cache hit)."""
    if moe.wave.num_waves != "auto" or moe.wave.experts_per_wave is not None or moe.__dict__.get("_auto_done"):
        return moe.plan.num_waves
    T = max(_gather(moe, int(x_TD.shape[0])))  # the key (and so W) must be the same on every rank
    key = shape_key(moe, T)
    entry, source = _lookup(key)
    hits = _gather(moe, None if entry is None else entry["num_waves"])
    model = None
    if T == 0:
        W, source = 1, "empty"
    elif all(h is not None and h == hits[0] for h in hits):
        W = int(hits[0])
    else:
        model, max_waves = calibrate(moe, x_TD, ids_TK, w_TK)
        W, source = choose_waves(model, max_waves), "measured"
        entry = {"num_waves": W, "model": asdict(model),
                 "predicted_us": {str(w): round(model.predict(w), 2) for w in candidates(max_waves)}}
        _MEMORY[key] = entry
        if moe.ep.rank == 0:
            _write_file(key, entry)
    if source == "file":
        _MEMORY[key] = entry
    moe.plan = WavePlan.make(num_ranks=moe.ep.size, num_local_experts=moe.num_local, num_waves=W,
                             partition=moe.wave.partition)
    moe.auto_source, moe.auto_model = source, model
    moe._auto_done = True
    return moe.plan.num_waves

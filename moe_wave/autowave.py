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
to a power of two) in this process, and in a JSON file only where ``WaveConfig.autowave_cache`` names one
(a ``.json`` path, or a folder that gets ``autowave.json``). A malformed file or entry is a miss, with one
warning naming the file. Every rank takes the same decision: times are maxed over ranks, and a cache hit
counts only if every rank hit.

``resolve`` returns the choice (``AutoChoice``: the plan and where it came from); ``WaveMoE`` assigns it.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moe_wave.comm.layout import WavePlan

from .probe import probe_times

__all__ = ["AutoChoice", "WaveTimeModel", "calibrate", "choose_waves", "resolve", "shape_key", "cache_path",
           "clear_memory_cache"]

_MEMORY: dict[str, dict] = {}
TIE_TOL = 0.02  # prefer the smaller W when its predicted time is within 2% of the best


@dataclass(frozen=True)
class WaveTimeModel:
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
            compW_us: float) -> "WaveTimeModel":
        """From comm-only and compute-only times at W=1 and W (> 1); comm-only includes ``fixed_us``."""
        if W < 2:
            raise ValueError(f"WaveTimeModel.fit: W={W}: needs a second wave count >= 2")
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


def choose_waves(model: WaveTimeModel, max_waves: int = 8) -> int:
    """The W in ``candidates(max_waves)`` with the lowest predicted time (ties go to the smaller W)."""
    preds = {W: model.predict(W) for W in candidates(max_waves)}
    best = min(preds.values())
    return min(W for W, t in preds.items() if t <= best * (1 + TIE_TOL))


# ----------------------------------------------------------------------------- cache

_WARNED: set[str] = set()


def cache_path(setting: str | os.PathLike | None) -> Path | None:
    """The cache file of a ``WaveConfig.autowave_cache`` setting: None (this process only), a ``.json``
    path, or a folder that gets ``autowave.json``."""
    if setting is None:
        return None
    p = Path(setting).expanduser()
    return p if p.suffix == ".json" else p / "autowave.json"


def _miss(path: Path, why: str) -> None:
    """A malformed cache must not fail the forward: one warning per file, then it counts as a miss."""
    if str(path) not in _WARNED:
        _WARNED.add(str(path))
        warnings.warn(f"autowave cache {path}: {why}; ignored (the wave count is measured again)", RuntimeWarning,
                      stacklevel=3)


def _read_file(path: Path | None) -> dict:
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        _miss(path, f"unreadable ({type(e).__name__}: {e})")
        return {}
    if not isinstance(data, dict):
        _miss(path, f"holds a {type(data).__name__}, not an object of entries")
        return {}
    return data


def _valid(entry, max_waves: int) -> bool:
    W = entry.get("num_waves") if isinstance(entry, dict) else None
    return isinstance(W, int) and not isinstance(W, bool) and 1 <= W <= max_waves


def _write_file(path: Path | None, key: str, entry: dict) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_file(path)
        data[key] = entry
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:
        _miss(path, f"not writable ({e})")   # a read-only folder must not break the forward pass


def clear_memory_cache() -> None:
    """Forget this process's choices (and which cache files were already warned about)."""
    _MEMORY.clear()
    _WARNED.clear()


def shape_key(moe, tokens: int) -> str:
    dev = moe.gate.weight.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    cfg, wave = moe.cfg, moe.wave
    bucket = 1 << max(0, int(tokens) - 1).bit_length()
    return (f"{name}|P{moe.ep.size}|D{cfg.hidden_size}|I{cfg.intermediate_size}|E{cfg.num_experts}|K{cfg.top_k}|"
            f"{str(moe.gate.weight.dtype).removeprefix('torch.')}|{moe.backend.name}|{wave.partition}|{wave.sends}|"
            f"T{bucket}")


def _lookup(path: Path | None, key: str, max_waves: int) -> tuple[dict | None, str]:
    if key in _MEMORY:
        return _MEMORY[key], "memory"
    entry = _read_file(path).get(key)
    if entry is None:
        return None, ""
    if not _valid(entry, max_waves):
        _miss(path, f"entry {key!r} is {entry!r}: needs num_waves, an int in [1, {max_waves}]")
        return None, ""
    return entry, "file"


# ----------------------------------------------------------------------------- calibration

def max_waves_of(moe) -> int:
    """The largest W the model considers: 8, or the local expert count when waves are blocks of experts."""
    return min(8, moe.num_local) if moe.wave.partition == "experts" else 8


def _plan(moe, W: int) -> WavePlan:
    return WavePlan.make(num_ranks=moe.ep.size, num_local_experts=moe.num_local, num_waves=W,
                         partition=moe.wave.partition, sends=moe.wave.sends)


@torch.no_grad()
def calibrate(moe, x_TD, ids_TK, w_TK, iters: int = 5, warmup: int = 1) -> tuple[WaveTimeModel, int]:
    """Fit the cost model on this batch (every rank together). Returns (model, max_waves)."""
    max_waves = max_waves_of(moe)
    Wc = min(4, max_waves)
    x_send, width = moe.wire(x_TD)      # the rows as the layer sends them (FP8 rows included)
    t = probe_times(moe.backend, moe.routed_rows, x_send, ids_TK, w_TK,
                    [_plan(moe, W) for W in dict.fromkeys((1, Wc))], ep=moe.ep, iters=iters, warmup=warmup,
                    combine_width=width)
    if Wc == 1:
        return WaveTimeModel(fixed_us=t.fixed_us, comm_us=max(0.0, (t.comm_us[1] - t.fixed_us) / 2), comm_op_us=0.0,
                         compute_us=t.compute_us[1], compute_wave_us=0.0), 1
    return WaveTimeModel.fit(Wc, t.fixed_us, t.comm_us[1], t.comm_us[Wc], t.compute_us[1], t.compute_us[Wc]), max_waves


@dataclass(frozen=True)
class AutoChoice:
    """What ``resolve`` chose.

    Attributes:
        plan: the wave plan to run.
        source: "memory", "file" (a cache hit), "measured" (calibrated now) or "empty" (no tokens anywhere).
        model: the fitted WaveTimeModel when measured, else None.
    """

    plan: WavePlan
    source: str
    model: WaveTimeModel | None = None


def resolve(moe, x_TD, ids_TK, w_TK) -> AutoChoice:
    """The wave plan of a ``num_waves="auto"`` WaveMoE for this batch's shape (see the module docstring).

    Every rank must call it together (``WaveMoE.forward_routed`` does, at its first forward); every rank
    gets the same choice. Reads ``moe`` (its shapes, backend, expert function, group), never changes it."""
    T = max(moe.ep.gather_objects(int(x_TD.shape[0])))  # the key (and so W) must be the same on every rank
    key = shape_key(moe, T)
    path = cache_path(moe.wave.autowave_cache)
    max_waves = max_waves_of(moe)
    entry, source = _lookup(path, key, max_waves)
    hits = moe.ep.gather_objects(None if entry is None else entry["num_waves"])
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
            _write_file(path, key, entry)
    if source == "file":
        _MEMORY[key] = entry
    return AutoChoice(plan=_plan(moe, W), source=source, model=model)

"""Section "moe": WaveMoE (V4-Flash shape, two waves) serial against pipelined on each backend, eager.

The symm backend runs each of ``MOE_VARIANTS``; a backend that cannot run the shape gets a row with
``skipped`` saying why.
"""

from __future__ import annotations

import torch

from moe_wave import MoEConfig, WaveConfig, WaveMoE
from moe_wave.comm.options import SymmOptions

from .common import Run, deepep_skip

__all__ = ["MOE_VARIANTS", "moe_rows"]

MOE_VARIANTS = ("kernel", "copy", "copy+memops", "kernel+memops")   # "copy": blocks by the fill (2 waves, 2 ranks: dense)


def _names(backends) -> list[str]:
    return [b for b in backends if b != "symm"] + ([f"symm-{v}" for v in MOE_VARIANTS] if "symm" in backends else [])


def _row(run: Run, cfg: MoEConfig, name: str, T: int, iters: int) -> dict:
    bname, _, var = name.partition("-")
    symm = SymmOptions.variant(var, capacity=T) if bname == "symm" else SymmOptions(capacity=T)
    m = WaveMoE(cfg, ep=run.ep, wave=WaveConfig(num_waves=2, backend=bname, symm=symm), device=run.ep.device,
                dtype=torch.bfloat16)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.02)
    x = torch.randn(T, cfg.hidden_size, device=run.ep.device, dtype=torch.bfloat16)
    serial = run.timed(lambda: m(x, overlap=False), iters)
    piped = run.timed(lambda: m(x, overlap=True), iters)
    return dict(backend=name, layout="moe:v4-flash", tokens_per_rank=T, num_waves=2, serial_us=serial,
                pipelined_us=piped)


def moe_rows(run: Run) -> list:
    rows, cfg = [], MoEConfig.preset("v4-flash")
    T, iters = 512 if run.s.quick else 4096, max(3, run.s.iters // 2)
    for name in _names(run.s.backends):
        why = deepep_skip(cfg.num_experts, run.ep) if name == "deepep" else None
        if why:
            run.log(f"moe {name}: skipped: {why}")
            rows.append(dict(backend=name, layout="moe:v4-flash", tokens_per_rank=T, skipped=why))
            continue
        run.log(f"moe {name} T={T}")
        rows.append(_row(run, cfg, name, T, iters))
        torch.cuda.empty_cache()
    return rows

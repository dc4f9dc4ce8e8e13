"""Section "tune": the row-copy kernels' launch shape (``SymmOptions.copy``: ``CopyTuning``) per symm variant.

V4-Flash layout, 4096 tokens per rank, every call replayed from a CUDA graph; beside the GEMM with the
given SMs carved out. ``hidden_vs_best`` counts the exposed time against the fastest round trip alone so
far (the first row), so that a slower capped copy that hides well is not flattered.
"""

from __future__ import annotations

import torch

from moe_wave.comm.options import CopyTuning, SymmOptions

from .common import LAYOUTS, Run, backend, beside_gemm, token_case
from .graph import graph_case

__all__ = ["TUNE", "tune_rows"]

# (symm variant, elements per step, warps, rows in flight per program, grid cap, SMs carved out of the GEMM
# beside it: None = not beside the GEMM, 0 = beside the whole GEMM); grid 0 is the full grid (one program
# a tile). Variants as in graph.GRAPH_VARIANTS.
TUNE = (("kernel", 2048, 4, 1, 0, None), ("kernel", 4096, 8, 1, 0, None), ("kernel", 4096, 16, 1, 0, None),
        ("kernel", 2048, 8, 4, 0, None), ("kernel", 2048, 4, 1, 0, 32), ("kernel", 4096, 16, 16, 32, 32),
        ("kernel", 2048, 4, 1, 0, 0), ("copy+sparse", 2048, 4, 1, 0, 0),
        ("copy+sparse", 2048, 4, 1, 0, 16), ("copy+sparse", 2048, 4, 1, 0, 24),
        ("copy+sparse+flags", 2048, 4, 1, 0, 16), ("copy+sparse+memops", 2048, 4, 1, 0, 24),
        ("kernel+memops", 2048, 4, 1, 0, 0), ("kernel+memops", 2048, 4, 1, 0, 32),
        ("copy+dense", 2048, 4, 1, 0, 0), ("copy+dense", 2048, 4, 1, 0, 8), ("copy+dense", 2048, 4, 1, 0, 16),
        ("copy+dense+memops", 2048, 4, 1, 0, 0), ("copy+dense+memops", 2048, 4, 1, 0, 8),
        ("copy+dense+memops", 2048, 4, 1, 0, 16), ("copy+dense+memops", 2048, 4, 1, 0, 24),
        ("copy+dense+memops", 2048, 4, 1, 0, 32))


def tune_rows(run: Run) -> list:
    ep, (D, E, K), T = run.ep, LAYOUTS["v4-flash"], 4096
    g = torch.Generator(device=ep.device).manual_seed(200 + ep.rank)
    x, layout, sent, cfg = token_case(ep, g, D, E, K, T)
    rows, best = [], None
    for name, block, warps, nrows, grid, carve in TUNE:
        run.log(f"tune {name} block {block} warps {warps} rows {nrows} grid {grid} carve {carve}")
        copy = CopyTuning(rows_block=block, warps=warps, rows=nrows, grid=grid)
        be = backend(ep, "symm", cfg, SymmOptions.variant(name, capacity=T, copy=copy))
        t, rt, _ = graph_case(run, be, x, layout)
        best = min(best or t["alone_us"], t["alone_us"])
        row = dict(backend=f"symm-{name}-tune", graph=True, layout="v4-flash", tokens_per_rank=T,
                   copy_block=block, copy_warps=warps, copy_rows=nrows, copy_grid=grid,
                   bytes_per_rank=sent * D * 2, **t, p2p_limit_GBps=run.p2p,
                   dispatch_GBps=sent * D * 2 / t["dispatch_us"] / 1e3)
        if carve is not None:
            row.update(beside_gemm(run, rt, carveout=carve))
            beside_us = row.get("beside_gemm_carveout_us", row["beside_gemm_us"])
            row["hidden_vs_best"] = 1 - (beside_us - run.gemm_us) / best
        rows.append(row)
        del be, rt
        run.save(rows)
    return rows

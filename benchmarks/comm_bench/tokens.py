"""Section "tokens": the V4-Flash and V4-Pro dispatch and combine layouts, eager, for every backend.

Legend: T tokens per rank, D hidden, E experts, K top-k.

Per (layout, T, backend): prepare, dispatch, combine into a fresh fp32 output (``accumulate=False``: WaveMoE's
first wave, and what DeepEP's combine does), combine adding into it (``combine_accumulate_us``: later
waves), the round trip, and the round trip beside the GEMM. A layout DeepEP cannot run gets a row with
``skipped`` saying why.
"""

from __future__ import annotations

import torch

from moe_wave.comm.backend import CombineOut
from moe_wave.comm.options import SymmOptions

from .common import LAYOUTS, Run, backend, beside_gemm, deepep_skip, token_cases

__all__ = ["token_rows"]


def _row(run: Run, bname: str, lname: str, D: int, T: int, x, layout, sent: int, cfg) -> dict:
    be = backend(run.ep, bname, cfg, SymmOptions(capacity=T))
    xplan = be.prepare(layout)
    got = be.dispatch(x, xplan, 0).wait()
    y = torch.randn_like(got.x_RD)
    out = torch.zeros(T, D, device=run.ep.device)
    acc, fresh = CombineOut(out), CombineOut(out, accumulate=False)
    prep = run.timed(lambda: be.prepare(layout))
    disp = run.timed(lambda: be.dispatch(x, xplan, 0).wait())
    comb_acc = run.timed(lambda: be.combine(y, got.handle, acc).wait())
    comb = run.timed(lambda: be.combine(y, got.handle, fresh).wait())

    def round_trip():   # as WaveMoE runs one wave: the combine writes a fresh output
        r = be.dispatch(x, xplan, 0).wait()
        be.combine(y, r.handle, fresh).wait()   # the plan is fixed: same shapes
    alone = run.timed(round_trip)
    row = dict(backend=bname, layout=lname, tokens_per_rank=T, bytes_per_rank=sent * D * 2,
               prepare_us=prep, dispatch_us=disp, combine_us=comb, combine_accumulate_us=comb_acc,
               p2p_limit_GBps=run.p2p, alone_us=alone, dispatch_GBps=sent * D * 2 / disp / 1e3,
               **beside_gemm(run, round_trip, carveout=0))
    if hasattr(be, "check"):
        be.check()
    return row


def token_rows(run: Run) -> list:
    rows = []
    for lname, D, T, x, layout, sent, cfg in token_cases(run.ep, list(LAYOUTS), run.s.tokens, 0):
        for bname in run.s.backends:
            why = deepep_skip(cfg.num_experts, run.ep) if bname == "deepep" else None
            if why:
                run.log(f"{bname} {lname} T={T}: skipped: {why}")
                rows.append(dict(backend=bname, layout=lname, tokens_per_rank=T, skipped=why))
                continue
            run.log(f"{bname} {lname} T={T}")
            rows.append(_row(run, bname, lname, D, T, x, layout, sent, cfg))
            run.save(rows)
    return rows

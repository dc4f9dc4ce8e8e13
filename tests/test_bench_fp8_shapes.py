"""``dev/bench_fp8_shapes.py``: each way it cuts a projection computes the whole product (the same bits), and
each case counts the FLOP of the product it times (its TFLOP/s rest on them). On CPU, with ``fp8_matmul``'s
reference path and small shapes."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dev"))
import bench_fp8_shapes as bench  # noqa: E402


def _flat(r):
    return torch.cat(r, dim=1) if isinstance(r, list) else r


def test_every_cut_is_the_whole_product():
    torch.manual_seed(0)
    M, hidden, heads, d, q_lora, groups, o_rank = 256, 256, 4, 128, 256, 2, 128
    cases = bench.cases(M, hidden, heads, d, q_lora, groups, o_rank, torch.device("cpu"))
    names = [c[0] for c in cases]
    assert len(set(names)) == len(names)
    flop = {"wq_a": 2 * M * hidden * q_lora, "wkv": 2 * M * hidden * d, "wq_b": 2 * M * q_lora * heads * d,
            "wo_a": 2 * M * heads * d * o_rank, "wo_b": 2 * M * groups * o_rank * hidden}
    whole = {}
    for name, f, fn in cases:
        fam = name.split(" ")[0].rstrip(",")
        assert f == flop[fam], name
        if fam not in whole:                        # the layer's own call comes first in its family
            whole[fam] = _flat(fn()).clone()
            assert whole[fam].isfinite().all() and whole[fam].abs().sum() > 0, name
            continue
        got = fn()                                  # a cut: into the same output (stale values must not pass)
        for t in (got if isinstance(got, list) else [got]):
            t.fill_(float("nan"))
        got = _flat(fn())
        assert torch.equal(got, whole[fam]), name
    assert {n.split(" ")[0].rstrip(",") for n in names} == set(flop)
    assert sum(1 for n in names if n.startswith("wq_b")) == 5 and sum(1 for n in names if n.startswith("wo_")) == 4

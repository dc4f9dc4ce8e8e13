"""``dev/bench_wgmma.py``: its steps' FLOP counts (the TFLOP/s it reports rest on them) and its refusal off
Hopper."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dev"))
import bench_wgmma  # noqa: E402


def test_each_step_counts_the_flop_of_its_dots():
    """2 M N K a dot, with the core's item: 64 heads, d = 512, PV on half of d; qk_pv is QK and that PV, qk_ss64x2
    two warpgroups' QK (M = 128); each step names a distinct kernel (mode, keys a tile)."""
    qk = lambda m, n: 2 * m * n * 512  # noqa: E731
    want = {"qk_ss64": qk(64, 64), "qk_ss128": qk(64, 128), "qk_rs64": qk(64, 64), "pv_rs256": 2 * 64 * 64 * 256,
            "qk_pv": qk(64, 64) + 2 * 64 * 64 * 256, "qk_ss64x2": qk(128, 64)}
    assert {name: flop for name, (_, _, flop) in bench_wgmma.MODES.items()} == want
    assert len({(mode, bn) for mode, bn, _ in bench_wgmma.MODES.values()}) == len(bench_wgmma.MODES)
    assert bench_wgmma.MODES["qk_ss128"][1] == 128 and all(
        bn == 64 for name, (_, bn, _) in bench_wgmma.MODES.items() if name != "qk_ss128")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_it_refuses_a_machine_without_a_hopper_gpu(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_wgmma.py"])
    with pytest.raises(SystemExit, match="bench_wgmma: needs a Hopper GPU and Triton's Gluon"):
        bench_wgmma.main()

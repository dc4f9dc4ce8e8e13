"""``benchmarks/bench_attn.py --core-opts / --layer-opts``: the sparse core's ``CoreTuning`` and the layer's
``ScheduleConfig`` fields for one benchmark run, read strictly."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_attn  # noqa: E402

from moe_wave.attention import ScheduleConfig  # noqa: E402
from moe_wave.attention.sparse_core import CoreTuning  # noqa: E402


def test_core_opts_are_the_core_tunings_fields():
    """Names are CoreTuning's fields (any case), values integers (0 / 1 for its switches); an unknown name, a missing
    value or a non-integer is refused with the item and the names it may take; the result builds a CoreTuning."""
    assert bench_attn.parse_core_opts("") == {}
    opts = bench_attn.parse_core_opts("CUDA=0,cuda_max_picks=4096")
    assert opts == {"cuda": False, "cuda_max_picks": 4096}
    assert CoreTuning(**opts).cuda is False
    for bad in ("cuda", "NOPE=1", "cuda=yes"):
        with pytest.raises(ValueError, match=f"--core-opts '{bad}': must be NAME=INTEGER with NAME one of .*cuda"):
            bench_attn.parse_core_opts(bad)


def test_layer_opts_are_schedule_fields():
    assert bench_attn.parse_layer_opts("default") == {}
    opts = bench_attn.parse_layer_opts("wo_a_overlap=0,wo_a_overlap_min_tokens=64")
    assert ScheduleConfig(**opts).wo_a_overlap is False
    with pytest.raises(ValueError, match="--layer-opts 'WO_A_OVERLAP=3x'"):
        bench_attn.parse_layer_opts("WO_A_OVERLAP=3x")

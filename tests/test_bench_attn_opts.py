"""``benchmarks/bench_attn.py --core-opts``: the sparse core's switches for one benchmark run, read strictly."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_attn  # noqa: E402


def test_core_opts_are_the_cores_switches():
    """Names are core_gluon.WS_OPTS' (any case), values integers; an unknown name, a missing value or a non-integer
    is refused with the item and the names it may take."""
    assert bench_attn.parse_core_opts("") == {}
    assert bench_attn.parse_core_opts("qpro=1,W1OUT=0") == {"QPRO": 1, "W1OUT": 0}
    for bad in ("QPRO", "NOPE=1", "QPRO=yes"):
        with pytest.raises(ValueError, match=f"--core-opts '{bad}': must be NAME=INTEGER with NAME one of .*QPRO"):
            bench_attn.parse_core_opts(bad)

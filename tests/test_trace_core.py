"""``dev/trace_core.py``'s reading of the sparse core's in-kernel stamps (the kernel runs on Hopper only; the
analysis is plain numpy and is checked here on stamps made up with known phases)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dev"))
import trace_core  # noqa: E402


def _stamps(n: int, G: int, period: int, at: dict, base: int) -> np.ndarray:
    """int32 [n, 16] stamps of n items on G programs, an item every `period` cycles of a 2 GHz clock starting at
    `base` (cycles, so that the 32-bit counter wraps), each column c at start + at[c]; column 7 the ns timer."""
    tr = np.zeros((n, 16), dtype=np.int64)
    for i in range(n):
        start = base + (i // G) * period + (i % G) * 7
        for c, off in at.items():
            tr[i, c] = start + off
        tr[i, 7] = start // 2
    return (tr % (1 << 32)).astype(np.uint32).view(np.int32)


def test_phases_across_the_counters_wrap_and_a_negative_phase():
    """Each phase is the median difference of its two stamps in us at the clock rate found from the ns timer,
    across the 32-bit counter's wrap; a phase whose second stamp comes first (the loader's q ready before its
    tile 0 issue, QPRO) reads negative, not as a wrapped 2**32."""
    at = {0: 0, 1: 200, 2: 600, 6: 4600, 3: 5600, 4: 6000, 5: 7000,        # math: q wait 0.1 us, tile 0 0.2, ...
          8: 100, 9: 300, 10: 900, 11: 700, 14: 1000, 12: 1200, 13: 7500, 15: 9000}
    tr = _stamps(40, 4, 10000, at, base=(1 << 32) - 25000)
    res = trace_core.analyse(tr, 4)
    assert res["clock_ghz"] == pytest.approx(2.0, rel=1e-3)
    assert res["item"] == pytest.approx(5.0) and res["q wait"] == pytest.approx(0.1)
    assert res["tiles"] == pytest.approx(2.0) and res["store"] == pytest.approx(0.5)
    assert res["to next"] == pytest.approx(1.5) and res["w1 end"] == pytest.approx(4.5)
    assert res["q ready"] == pytest.approx(-0.1)
    assert res["q load+prep"] == pytest.approx(0.2)

"""autowave: the cost model's choices on synthetic calibrations, the fit, and the per-shape cache."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from moe_wave import autowave
from moe_wave.autowave import WaveTimeModel, candidates, choose_waves


def _model(comm, compute, comm_op=0.0, wave=0.0, fixed=0.0):
    return WaveTimeModel(fixed_us=fixed, comm_us=comm, comm_op_us=comm_op, compute_us=compute, compute_wave_us=wave)


def test_candidates():
    assert candidates(8) == [1, 2, 4, 8]
    assert candidates(6) == [1, 2, 4, 6]
    assert candidates(1) == [1]


def test_tiny_comm_picks_one_wave():
    # Comm is negligible: waves only add per-wave overhead.
    assert choose_waves(_model(comm=1.0, compute=1000.0, comm_op=5.0, wave=5.0)) == 1


def test_comm_like_compute_with_small_overhead_picks_several_waves():
    W = choose_waves(_model(comm=500.0, compute=1000.0, comm_op=2.0, wave=2.0))
    assert W > 1
    # Larger per-wave overhead pulls W back down.
    assert choose_waves(_model(comm=500.0, compute=1000.0, comm_op=200.0, wave=200.0)) < W


def test_predict_matches_serial_at_one_wave():
    m = _model(comm=100.0, compute=300.0, comm_op=10.0, wave=5.0, fixed=7.0)
    assert m.predict(1) == pytest.approx(7.0 + 110.0 + 305.0 + 110.0)
    # Two waves: d0 d1 | c0 after d0, b0 after c0, c1 after max(d1, c0), b1 after c1.
    d, c = 10.0 + 50.0, 5.0 + 150.0
    assert m.predict(2) == pytest.approx(7.0 + d + c + c + d)


def test_fit_recovers_parameters():
    truth = _model(comm=400.0, compute=900.0, comm_op=15.0, wave=20.0, fixed=30.0)
    W = 4
    comm1 = truth.fixed_us + 2 * (truth.comm_op_us + truth.comm_us)
    commW = truth.fixed_us + 2 * (W * truth.comm_op_us + truth.comm_us)
    comp1 = truth.compute_wave_us + truth.compute_us
    compW = W * truth.compute_wave_us + truth.compute_us
    fit = WaveTimeModel.fit(W, truth.fixed_us, comm1, commW, comp1, compW)
    for f in ("fixed_us", "comm_us", "comm_op_us", "compute_us", "compute_wave_us"):
        assert getattr(fit, f) == pytest.approx(getattr(truth, f))
    with pytest.raises(ValueError, match="W=1"):
        WaveTimeModel.fit(1, 0, 1, 1, 1, 1)


def test_cache_path():
    assert autowave.cache_path(None) is None
    assert autowave.cache_path("/x/y") == Path("/x/y/autowave.json")
    assert autowave.cache_path("/x/c.json") == Path("/x/c.json")


def _auto_rank(ep, cache_file):
    from moe_wave import MoEConfig, WaveConfig, WaveMoE
    from moe_wave.tools.bench import init_random_, random_inputs

    autowave.clear_memory_cache()
    auto = WaveConfig(num_waves="auto", autowave_cache=cache_file)
    moe = init_random_(WaveMoE(MoEConfig.preset("tiny"), ep=ep, wave=auto))
    x, ids, w = random_inputs(moe, 16 + 8 * ep.rank, 1)[0]  # uneven tokens: the ranks must still agree
    y_auto = moe.forward_routed(x, ids, w)
    first = (moe.auto_source, moe.plan.num_waves)
    again = moe.rescheduled(auto)
    again.forward_routed(x, ids, w)
    second = again.auto_source
    autowave.clear_memory_cache()
    third_moe = moe.rescheduled(auto)
    third_moe.forward_routed(x, ids, w)
    fixed = moe.rescheduled(WaveConfig(num_waves=first[1]))
    same = bool((fixed.forward_routed(x, ids, w) == y_auto).all())
    return first, second, third_moe.auto_source, same


def test_auto_resolves_once_and_uses_the_cache(ranks, tmp_path):
    out = ranks(2).run(_auto_rank, str(tmp_path / "autowave.json"))
    (src, W), second, third, same = out[0]
    assert out[0][0] == out[1][0], "every rank must choose the same W"
    assert src == "measured" and 1 <= W <= 4
    assert second == "memory" and third == "file"
    assert same, "auto must give the result of its chosen W"
    assert (tmp_path / "autowave.json").exists()


def _single_auto(cache):
    from moe_wave import MoEConfig, WaveConfig, WaveMoE
    from moe_wave.tools.bench import init_random_, random_inputs

    moe = init_random_(WaveMoE(MoEConfig.preset("tiny"), wave=WaveConfig(num_waves="auto", autowave_cache=cache)))
    x, ids, w = random_inputs(moe, 12, 1)[0]
    y = moe.forward_routed(x, ids, w)
    return moe, y, autowave.shape_key(moe, 12)


def test_no_cache_file_unless_asked(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MOE_WAVE_CACHE", str(tmp_path / "env.json"))   # the library does not read it
    autowave.clear_memory_cache()
    moe, y, _ = _single_auto(None)
    assert moe.auto_source == "measured" and torch.isfinite(y).all()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", "ENTRY"])
def test_malformed_cache_is_a_miss_with_one_warning(tmp_path, content):
    path = tmp_path / "aw.json"
    autowave.clear_memory_cache()
    if content == "ENTRY":   # a well-formed file with a bad entry for this very shape
        _, _, key = _single_auto(None)
        autowave.clear_memory_cache()
        content = json.dumps({key: {"num_waves": "four"}})
    path.write_text(content)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        moe, y, _ = _single_auto(str(path))
        entry = next(iter(json.loads(path.read_text()).values()))
        assert entry["num_waves"] == moe.plan.num_waves, "the measured choice replaces the malformed cache"
        path.write_text(content)          # malformed again, and forgotten in memory: read again, no new warning
        autowave._MEMORY.clear()
        again = moe.rescheduled(moe.wave)
        again.forward_routed(*_inputs(again))
    named = [w for w in caught if str(path) in str(w.message)]
    assert len(named) == 1 and issubclass(named[0].category, RuntimeWarning), [str(w.message) for w in caught]
    assert moe.auto_source == "measured" and again.auto_source == "measured" and torch.isfinite(y).all()


def _inputs(moe):
    from moe_wave.tools.bench import random_inputs

    return random_inputs(moe, 12, 1)[0]

"""Settings that must agree between ranks are cross-checked when a WaveMoE is built: a mismatch raises the same
ValueError on every rank, naming the setting and each rank's value (instead of a gloo abort, or one rank
computing on its peer's shorter payload)."""

from __future__ import annotations

import pytest
import torch

from moe_wave import MoEConfig, WaveConfig, WaveMoE
from moe_wave.comm.options import SymmOptions

CFG = MoEConfig.preset("tiny", num_experts=4, top_k=2)


def _build(ep, which: str) -> str:
    r = ep.rank
    kw = {"overlap": dict(wave=WaveConfig(overlap=r == 0)),
          "capacity": dict(wave=WaveConfig(backend="symm", symm=SymmOptions(capacity=16 * (r + 1)))),
          "signal": dict(wave=WaveConfig(backend="symm", symm=SymmOptions(signal=("barrier", "memops")[r]))),
          "waves": dict(wave=WaveConfig(num_waves=r + 1)),
          "sends": dict(wave=WaveConfig(backend="symm", sends=("wave", "once")[r])),
          "dtype": dict(dtype=(torch.float32, torch.bfloat16)[r]),
          "hidden": dict(cfg=MoEConfig.preset("tiny", num_experts=4, top_k=2, hidden_size=64 + 16 * r)),
          "none": {}}[which]
    try:
        WaveMoE(kw.pop("cfg", CFG), ep=ep, **kw)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("which, names", [
    ("overlap", "rank 0 (2, None, 'experts', 'wave', 'auto', True, 'bubbles'), "
                "rank 1 (2, None, 'experts', 'wave', 'auto', False"),
    ("sends", "rank 0 (2, None, 'experts', 'wave', 'symm', True, 'bubbles'), rank 1 (2, None, 'experts', 'once'"),
    ("capacity", "capacity=16"), ("signal", "signal='memops'"), ("waves", "rank 0 (1, None"),
    ("dtype", "dtype: rank 0 'torch.float32', rank 1 'torch.bfloat16'"), ("hidden", "rank 0 (64, 128, 4, 2)")])
def test_mismatched_settings_raise_the_same_error_on_every_rank(ranks, which, names):
    msgs = ranks(2).run(_build, which)
    assert msgs[0] == msgs[1], msgs
    assert "differs between ranks" in msgs[0] and names in msgs[0], msgs[0]
    assert ranks(2).run(_build, "none") == ["no error", "no error"]

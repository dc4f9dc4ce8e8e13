"""V4DecoderLayer (mHC + V4Attention + WaveMoE) against transformers 5.23's DeepseekV4DecoderLayer:
single process, with a cache, and under EP on 2 gloo ranks (each rank its own batch row)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from moe_wave import V4DecoderLayer  # noqa: E402
from moe_wave.comm import EPGroup  # noqa: E402
from moe_wave.config import WaveConfig  # noqa: E402
from moe_wave.mhc import HCConfig  # noqa: E402
from moe_wave.attention import ScheduleConfig  # noqa: E402
from tests.test_attention import KERNELS, hf_kwargs, rel, tiny_hf  # noqa: E402

LAYERS = [0, 1, 2]  # sliding + hash MoE, CSA + top-k MoE, HCA + top-k MoE
B, S = 2, 24


def _inputs(cfg):
    g = torch.Generator().manual_seed(7)
    X = torch.randn(B, S, cfg.hc_mult, cfg.hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    return X, ids


@pytest.fixture(scope="module")
def hf():
    cfg, model = tiny_hf()
    X, ids = _inputs(cfg)
    kw = hf_kwargs(model, cfg, X[:, :, 0], S)
    with torch.no_grad():
        refs = [model.layers[i](X, input_ids=ids, **kw) for i in LAYERS]
    return dict(cfg=cfg, model=model, X=X, ids=ids, pos=kw["position_ids"], refs=refs)


def _layer(hf, i, ep=None, **kw):
    return V4DecoderLayer.from_hf(hf["model"].layers[i], hf["cfg"], layer_idx=i, ep=ep or EPGroup.single(),
                                  wave=WaveConfig(num_waves=2), **kw)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("i", LAYERS)
def test_layer_matches_hf(hf, i, kernels):
    layer = _layer(hf, i, schedule=ScheduleConfig(kernels=kernels))
    assert layer.attn.schedule.kernels == kernels
    with torch.no_grad():
        out = layer(hf["X"], positions=hf["pos"], input_ids=hf["ids"])
    assert out.shape == hf["X"].shape
    assert rel(out, hf["refs"][i]) < 2e-6


@pytest.mark.parametrize("i", LAYERS)
def test_layer_prefill_decode_matches_full(hf, i):
    layer, X, ids, pos = _layer(hf, i), hf["X"], hf["ids"], hf["pos"]
    cache = layer.new_cache(B, S)
    with torch.no_grad():
        outs = [layer(X[:, :9], positions=pos[:, :9], input_ids=ids[:, :9], cache=cache)]
        outs += [layer(X[:, t:t + 1], positions=pos[:, t:t + 1], input_ids=ids[:, t:t + 1], cache=cache)
                 for t in range(9, S)]
    assert rel(torch.cat(outs, 1), hf["refs"][i]) < 2e-6


def test_layer_bad_input(hf):
    layer = _layer(hf, 0)
    with pytest.raises(ValueError, match=r"X.shape=\(2, 24, 3, 64\).*hc_mult=2"):
        layer(torch.randn(B, S, 3, 64), positions=hf["pos"], input_ids=hf["ids"])
    with pytest.raises(ValueError, match="HCConfig.sinkhorn_iters=0"):
        HCConfig(hidden=64, mult=2, sinkhorn_iters=0)


def _ep_layers(ep: EPGroup, X, ids, pos):
    """Rank r runs batch row r through all three layers; its WaveMoE keeps only its experts."""
    cfg, model = tiny_hf()
    r = ep.rank
    outs = []
    for i in LAYERS:
        layer = V4DecoderLayer.from_hf(model.layers[i], cfg, layer_idx=i, ep=ep, wave=WaveConfig(num_waves=2))
        assert layer.moe.num_local == cfg.n_routed_experts // ep.size
        with torch.no_grad():
            outs.append(layer(X[r:r + 1], positions=pos[r:r + 1], input_ids=ids[r:r + 1]))
    return outs


def test_layer_under_ep_two_ranks(hf, ranks):
    res = ranks(2).run(_ep_layers, hf["X"], hf["ids"], hf["pos"])
    for i in LAYERS:
        got = torch.cat([res[0][i], res[1][i]], dim=0)
        assert rel(got, hf["refs"][i]) < 2e-6

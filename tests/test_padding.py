"""Token-bucket padding (the CUDA-graph path's semantics, checked on CPU): the pad is sent nowhere and no valid
row depends on it, for the MoE block and for the whole decoder layer; the shared backend; the graph API's errors.

The replays themselves need a GPU (tests/test_gpu_moe.py); what they replay is the padded eager call tested here.
"""

from __future__ import annotations

import pytest
import torch

from moe_wave import MoEConfig, WaveConfig, WaveMoE
from moe_wave.comm import EPGroup
from moe_wave.comm.layout import compute_layout
from moe_wave.graphs import BucketGraphs, check_buckets
from moe_wave.reference import random_full_weights

CFG = MoEConfig.preset("tiny", num_experts=12, top_k=3)


def _moe(ep, **wave):
    moe = WaveMoE(CFG, ep=ep, wave=WaveConfig(**wave), dtype=torch.float32)
    moe.load_full(random_full_weights(CFG, seed=1))
    return moe


def _pad(x, b, dim=0, fill=7.0):
    shape = list(x.shape)
    shape[dim] = b - x.shape[dim]
    return torch.cat([x, torch.full(shape, fill, dtype=x.dtype)], dim)


def _padded_moe(ep: EPGroup, backend: str, W: int, partition: str):
    """Per rank: the padded call's valid rows vs the unpadded call, and the rows sent per (wave, peer)."""
    moe = _moe(ep, backend=backend, num_waves=W, partition=partition)
    out = []
    for T, b in ((13, 16), (5, 16), (0, 4), (16, 16)):
        g = torch.Generator().manual_seed(T * 10 + ep.rank)
        x = torch.randn(T, CFG.hidden_size, generator=g)
        n = torch.tensor(T)
        xp = _pad(x, b)
        y = moe(x)
        yp = moe(xp, num_valid=n)
        lay = compute_layout(*moe.route(x), moe.plan)
        layp = compute_layout(*moe.route(xp), moe.plan, n)
        same_rows = torch.equal(lay.send_counts_WP, layp.send_counts_WP)
        same_pairs = torch.equal(lay.pair_counts_WPe, layp.pair_counts_WPe)
        err = float((yp[:T] - y).abs().max() / y.abs().max()) if T else 0.0     # relative: fp32 rounding
        out.append((T, b, same_rows, same_pairs, err, bool(torch.isfinite(yp).all())))
    return out


@pytest.mark.parametrize("P,backend,W,partition", [(1, "torch", 2, "experts"), (2, "torch", 3, "experts"),
                                                   (2, "symm", 2, "experts"), (3, "symm", 4, "experts"),
                                                   (2, "torch", 2, "tokens")])
def test_pad_is_sent_nowhere_and_changes_no_valid_row(ranks, P, backend, W, partition):
    res = [_padded_moe(EPGroup.single(), backend, W, partition)] if P == 1 else ranks(P).run(
        _padded_moe, backend, W, partition)
    for rank, rows in enumerate(res):
        for T, b, same_rows, same_pairs, err, finite in rows:
            if partition == "experts":      # the tokens partition cuts waves by T: the rows move between waves
                assert same_rows and same_pairs, (rank, T, b, "padding changed the rows or pairs sent")
            assert err <= 1e-6, (rank, T, b, err)
            assert finite, (rank, T, b)


@torch.no_grad()
def test_decoder_layer_pad_changes_no_valid_row():
    """The whole layer on a sequence padded at the end (as a graph bucket replays it): the valid rows equal the
    unpadded layer's (attention is causal; the MoE sends the pad nowhere)."""
    from moe_wave.tools.stack import build_layer_stack, stack_inputs

    layers = build_layer_stack("tiny", 3, dtype=torch.float32, seed=3)
    for S, b in ((20, 32), (9, 16), (16, 16)):
        X, pos, ids = stack_inputs(layers, S, seed=S)
        n = torch.tensor(S)
        Xp, pp, ip = _pad(X, b, 1), torch.arange(b)[None], _pad(ids, b, 1, fill=3)
        for layer in layers:
            y = layer(X, pos, ids)
            yp = layer._forward_eager(Xp, pp, ip, None, validate=False, overlap=None, moe_overlap=None,
                                      num_valid=n)
            assert float((yp[:, :S] - y).abs().max()) <= 1e-5 * float(y.abs().max()), (S, b)
            X, Xp = y, yp


def test_backend_is_shared_and_auto_is_torch_on_cpu():
    ep = EPGroup.single()
    a, b = _moe(ep), _moe(ep, num_waves=3)
    assert a.backend is b.backend and a.backend.name == "torch"
    s1, s2 = _moe(ep, backend="symm"), _moe(ep, backend="symm")
    assert s1.backend is s2.backend and s1.backend is not a.backend
    assert a.rescheduled(WaveConfig(num_waves=1)).backend is a.backend


def test_graph_api_errors():
    with pytest.raises(ValueError, match="buckets=\\[\\]: must be one or more token counts >= 1"):
        check_buckets([])
    with pytest.raises(ValueError, match="buckets=\\[0, 4\\]"):
        check_buckets([0, 4])
    with pytest.raises(ValueError, match="must be token counts"):
        check_buckets(["x"])
    assert check_buckets([64, 16, 64]) == (16, 64)
    g = BucketGraphs([16, 64], "cpu")
    assert (g.bucket_for(1), g.bucket_for(16), g.bucket_for(17), g.bucket_for(65)) == (16, 16, 64, None)
    moe = _moe(EPGroup.single())
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        moe.capture_graphs([16])

"""The fused mHC kernels (``moe_wave.mhc_kernels``) against the torch ops of ``moe_wave.mhc``: CPU under Triton's
interpreter (the test session turns it on where no GPU is visible) and CUDA (``gpu``-marked)."""

from __future__ import annotations

import pytest
import torch

from moe_wave.comm.triton_gate import interpreting, triton
from moe_wave.mhc import HCConfig, HyperConnection, hc_post

DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(triton is None or not interpreting(),
                                                        reason="needs triton and TRITON_INTERPRET=1 on CPU")),
           pytest.param("cuda", marks=pytest.mark.gpu)]
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}


def _site(N, D, dev, seed):
    g = torch.Generator().manual_seed(seed)
    hc = HyperConnection(HCConfig(hidden=D, mult=N, sinkhorn_iters=20))
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=g) * (N * D) ** -0.5)
        hc.base.copy_(torch.randn(hc.base.shape, generator=g) * 0.5)
        hc.scale.copy_(torch.rand(3, generator=g) + 0.5)
    return hc.to(dev)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("B,S,N,D,dtype", [(1, 37, 4, 96, torch.float32), (2, 9, 4, 64, torch.bfloat16),
                                           (1, 20, 2, 160, torch.float32), (1, 1, 4, 512, torch.bfloat16),
                                           (1, 0, 4, 64, torch.float32)])
@torch.no_grad()
def test_fused_mhc_site_matches_torch(dev, B, S, N, D, dtype):
    """hc_pre (norm, mixing, Sinkhorn, collapse) and hc_post (expand) fused equal the torch ops within the dtype's
    rounding; post and comb (fp32) tightly; comb's columns sum to 1 (Sinkhorn's last step)."""
    hc = _site(N, D, dev, seed=S + D)
    g = torch.Generator().manual_seed(7)
    X = (torch.randn(B, S, N, D, generator=g) * 3).to(dev, dtype)
    out = torch.randn(B, S, D, generator=g).to(dev, dtype)
    h, post, comb = hc.hc_pre(X, kernels="on")
    h_ref, post_ref, comb_ref = hc.hc_pre(X, kernels="off")
    assert h.shape == h_ref.shape and h.dtype == dtype and post.dtype == comb.dtype == torch.float32
    y = hc_post(out, X, post_ref, comb_ref, kernels="on")
    y_ref = hc_post(out, X, post_ref, comb_ref, kernels="off")
    assert y.shape == X.shape and y.dtype == dtype
    if S == 0:
        return
    assert _rel(post, post_ref) < 1e-5 and _rel(comb, comb_ref) < 1e-5, (_rel(post, post_ref), _rel(comb, comb_ref))
    assert torch.allclose(comb.sum(-2), torch.ones_like(comb.sum(-2)), atol=1e-4)
    assert _rel(h, h_ref) < TOL[dtype], _rel(h, h_ref)
    assert _rel(y, y_ref) < TOL[dtype], _rel(y, y_ref)
    again = hc.hc_pre(X, kernels="on")
    assert all(torch.equal(a, b) for a, b in zip(again, (h, post, comb))), "bit-stable from run to run"


@pytest.mark.parametrize("dev", DEVICES)
@torch.no_grad()
def test_mix_tiles_agree(dev):
    """Every tile of the split-K mix gives the same sums (the slices differ, their totals do not)."""
    from moe_wave.mhc_kernels import hc_mix

    g = torch.Generator().manual_seed(3)
    X = torch.randn(70, 4 * 80, generator=g).to(dev)
    fn = torch.randn(24, 4 * 80, generator=g).to(dev)
    ref = X @ fn.t()
    for bt, bk in ((16, 128), (32, 64), (64, 64), (128, 32)):
        mix, sq = hc_mix(X, fn, bt, bk)
        assert torch.allclose(mix.sum(0)[:, :24], ref, rtol=1e-4, atol=1e-3), (bt, bk)
        assert torch.allclose(sq.sum(0), X.square().sum(1), rtol=1e-5), (bt, bk)

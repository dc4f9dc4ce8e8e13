"""The experts' first GEMM + SwiGLU + requant as a CUDA kernel for Hopper (``gate_up_cuda.gate_up_sm90``): its h
against the Triton kernel's and the torch reference's on the same rows (the layout's, and rows read where they
arrived, local rows included), CUDA-graph replay against eager, and the FP8 stage on it against the per-expert
reference (skips without a Hopper GPU; the stage test without deep_gemm). The CPU side (NVRTC builds both
variants) is in test_gate_up_cuda_build.py."""

from __future__ import annotations

import pytest
import torch

from moe_wave.expert_kernels import expert_order
from moe_wave.fp8_expert_kernels import (aligned_capacity, gate_up_swiglu, gate_up_swiglu_torch, gather_pairs,
                                         layout_groups)
from moe_wave.fp8_experts import quant_experts
from moe_wave.fp8_rows import pack_rows, unpack_rows

pytestmark = pytest.mark.gpu


def _hopper() -> bool:
    if not torch.cuda.is_available():
        return False
    from moe_wave.gate_up_cuda import available

    return available(0)


needs_sm90 = pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU where NVRTC builds the kernel")


def _inputs(R=700, K=4, e=6, D=512, I=384, seed=0, skew=False):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    logits = torch.rand(R, e, generator=g, device=dev)
    if skew:                                        # some experts empty, one large
        logits[:, 0] += 2.0
        logits[:, 3:5] -= 5.0
    ids = logits.topk(K, dim=1).indices.to(torch.int32)
    ids[::7, 1] = -1                                # slots of no local expert
    counts = torch.bincount(ids[ids >= 0].long(), minlength=e)
    JA = aligned_capacity(R * K, e)
    grp = layout_groups(counts, R * K, JA)
    src, pos = expert_order(ids, e, grp.offs, starts_e=grp.starts, capacity=JA)
    wq, ws = quant_experts(torch.randn(e, 2 * I, D, generator=g, device=dev) * 0.05)
    xp = pack_rows((torch.randn(R, D, generator=g, device=dev) * 2).to(torch.bfloat16))
    return grp, src, pos, wq, ws, xp, JA


def _used(grp, JA):
    r = torch.arange(JA, device=grp.starts.device)[:, None]
    return ((r >= grp.starts[None]) & (r < grp.ends[None])).any(1)


def _dequant(hq, hs, used):
    return hq[used].float() * hs[:, used].t().repeat_interleave(128, 1)


@needs_sm90
@pytest.mark.parametrize("cluster", [1, 2])
@pytest.mark.parametrize("skew", [False, True])
@pytest.mark.parametrize("limit", [0.0, 0.7])
def test_kernel_equals_the_triton_kernel_and_the_reference(skew, limit, cluster):
    from moe_wave.gate_up_cuda import gate_up_sm90

    grp, src, pos, wq, ws, xp, JA = _inputs(skew=skew)
    D = wq.shape[2]
    q, s = gather_pairs(xp, D, pos, JA)
    used = _used(grp, JA)
    lay = gate_up_sm90(q, s, wq, ws, grp.starts, grp.bend, limit, grp.n, cluster=cluster)
    frm = gate_up_sm90(*unpack_rows(xp, D), wq, ws, grp.starts, grp.bend, limit, grp.n, src_J=src, cluster=cluster)
    tri = gate_up_swiglu(q, s, wq, ws, grp.starts, grp.bend, limit, n=grp.n, bm=128)
    ref = gate_up_swiglu_torch(q, s, wq, ws, grp.starts, grp.ends, limit)
    # the two ways into the kernel: the same bits
    assert torch.equal(lay[0].view(torch.uint8)[used], frm[0].view(torch.uint8)[used])
    assert torch.equal(lay[1][:, used], frm[1][:, used])
    # against Triton's tiles (the same promotion and wgmma steps: the same bits on the probe's shapes; here at least
    # all but a few codes) and the fp32 reference (one e4m3 step, or two where a row's scale lands on the other
    # side of a power of two)
    h, ht, hr = _dequant(*lay, used), _dequant(*tri, used), _dequant(*ref, used)
    assert torch.isfinite(h).all() and h.abs().max() > 0
    same = (lay[0].view(torch.uint8)[used] == tri[0].view(torch.uint8)[used]).float().mean()
    assert same > 0.999, same
    for other in (ht, hr):
        assert (h - other).abs().max() / other.abs().max() < 0.15
        assert (h - other).norm() / other.norm() < 0.02


@needs_sm90
@pytest.mark.parametrize("cluster", [1, 2])
def test_local_rows_and_graph_replay(cluster):
    from moe_wave.gate_up_cuda import gate_up_sm90

    grp, src, pos, wq, ws, xp, JA = _inputs(seed=3)
    D = wq.shape[2]
    qr, sr = unpack_rows(xp, D)
    row0, L = 100, 250                                  # rows 100 .. 349 read from a local copy
    lq, ls = unpack_rows(xp[row0:row0 + L].clone(), D)
    garbage = xp.clone()
    garbage[row0:row0 + L] = 0                         # what the received buffer holds there must not be read
    gq, gs = unpack_rows(garbage, D)
    want = gate_up_sm90(qr, sr, wq, ws, grp.starts, grp.bend, 0.7, grp.n, src_J=src, cluster=cluster)
    got = gate_up_sm90(gq, gs, wq, ws, grp.starts, grp.bend, 0.7, grp.n, src_J=src, local=(row0, lq, ls),
                       cluster=cluster)
    used = _used(grp, JA)
    assert torch.equal(want[0].view(torch.uint8)[used], got[0].view(torch.uint8)[used])
    assert torch.equal(want[1][:, used], got[1][:, used])
    out = {}
    gr = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(gr):
        out["h"] = gate_up_sm90(qr, sr, wq, ws, grp.starts, grp.bend, 0.7, grp.n, src_J=src, cluster=cluster)
    for _ in range(2):
        out["h"][0].zero_()
        gr.replay()
        torch.cuda.synchronize()
        assert torch.equal(out["h"][0].view(torch.uint8)[used], want[0].view(torch.uint8)[used])
        assert torch.equal(out["h"][1][:, used], want[1][:, used])


@needs_sm90
def test_bad_rows_name_the_rule():
    from moe_wave.gate_up_cuda import gate_up_sm90

    grp, src, pos, wq, ws, xp, JA = _inputs()
    qr, sr = unpack_rows(xp, wq.shape[2])
    with pytest.raises(ValueError, match="src_J"):
        gate_up_sm90(qr, sr, wq, ws, grp.starts, grp.bend, 0.7, grp.n, src_J=src.to(torch.int32))
    q, s = gather_pairs(xp, wq.shape[2], pos, JA)
    with pytest.raises(ValueError, match="layout scales"):
        gate_up_sm90(q, s.t(), wq, ws, grp.starts, grp.bend, 0.7, grp.n)


@needs_sm90
@pytest.mark.parametrize("fp8_rows", [True, False])
def test_stage_on_the_kernel_matches_deepgemm_and_replays(monkeypatch, fp8_rows):
    """The FP8 stage above the fused Triton kernel's rows an expert, aligned layout: the CUDA kernel (rows that
    arrived as FP8 read where they are; bf16 rows quantised into the layout) against DeepGEMM's GEMM and
    ``swiglu_quant``, within DeepGEMM's FP8 GEMM bound; the same bits on a second call and from a CUDA graph."""
    import moe_wave.fp8_experts as fx
    import moe_wave.gate_up_cuda as gc
    from tests.test_gpu_fp8_experts import _dg_ok, _moe, _x, calc_diff

    if not _dg_ok():
        pytest.skip("needs deep_gemm (launch/deepgemm.sh)")
    calls = []
    real = gc.gate_up_sm90
    monkeypatch.setattr(gc, "gate_up_sm90", lambda *a, **k: calls.append(k.get("src_J") is not None) or real(*a, **k))
    monkeypatch.setattr(fx, "FUSED_GATE_UP_ROWS_PER_EXPERT", 0)
    moe = _moe(2, fp8_rows=fp8_rows)
    moe.experts.gemm_layout = "contiguous"
    x = _x(300, 5)
    monkeypatch.setattr(fx, "GATE_UP_SM90", False)
    ref = moe(x)
    assert not calls
    monkeypatch.setattr(fx, "GATE_UP_SM90", True)
    y = moe(x)
    assert calls == [fp8_rows] * 2, calls           # one a wave; FP8 rows read where they arrived
    assert torch.isfinite(y).all() and calc_diff(y.float(), ref.float()) < 1e-4
    assert torch.equal(moe(x), y)
    moe.capture_graphs([300])
    assert torch.equal(moe(x), y)

"""The first grouped FP8 GEMM with SwiGLU + requant on DeepGEMM's own Hopper kernel (``gate_up_dg``) on one GPU:
the same h and scales as DeepGEMM's GEMM followed by ``swiglu_quant``, bit for bit, in both layouts (empty groups,
groups that end inside a block, V4's clamp and none), without a cluster and in clusters of two (the weight tiles
multicast; one CTA where I / 128 is odd), and the stage on it equal to the stage on DeepGEMM's GEMM,
eager and replayed from a CUDA graph (skips without a Hopper GPU, deep_gemm and nvcc)."""

from __future__ import annotations

import pytest
import torch

from moe_wave.fp8 import BLOCK, FP8

pytestmark = pytest.mark.gpu


def _ok() -> bool:
    if not torch.cuda.is_available():
        return False
    from moe_wave.fp8_experts import fp8_gemm_grouped_library
    from moe_wave.gate_up_dg import available

    # the kernel builds and loads here, on whichever card (the stage's choice of cards is fp8_experts.GATE_UP_DG)
    return fp8_gemm_grouped_library("cuda") == "deepgemm" and available(0, 4, 256, 512, False)


needs = pytest.mark.skipif(not _ok(), reason="needs a Hopper GPU with deep_gemm and nvcc (launch/deepgemm.sh)")


def _weights(e: int, I: int, D: int, seed: int):
    from moe_wave.fp8_experts import quant_experts

    g = torch.Generator().manual_seed(seed)
    return quant_experts((torch.randn(e, 2 * I, D, generator=g) * 0.05).cuda())


def _rows(JA: int, D: int, seed: int):
    from moe_wave.fp8 import act_quant

    g = torch.Generator().manual_seed(seed)
    return act_quant((torch.randn(JA, D, generator=g) * 2).to("cuda", torch.bfloat16))


@needs
@pytest.mark.parametrize("cluster", [1, 2])
@pytest.mark.parametrize("counts,I,D,limit", [([130, 0, 5, 256], 256, 512, 7.0), ([0, 0, 40, 0], 256, 512, 0.0),
                                              ([130, 0, 5, 256], 384, 512, 7.0),
                                              ([300, 129, 128, 1, 77, 0, 512, 3], 2048, 4096, 10.0)])
def test_contiguous_equals_deepgemm_then_swiglu_quant(counts, I, D, limit, cluster, monkeypatch):
    """Psum layout: each group starts at the next 128-row boundary; hq and hs of every row in use equal DeepGEMM's
    m_grouped_fp8_gemm_nt_contiguous (use_psum_layout) + swiglu_quant bit for bit."""
    import deep_gemm

    import moe_wave.gate_up_dg as gd
    from moe_wave.fp8_expert_kernels import ALIGN, aligned_groups, swiglu_quant
    from moe_wave.gate_up_dg import gate_up_dg

    monkeypatch.setattr(gd, "CLUSTER", cluster)
    assert gd.cluster_size(I) == (cluster if (I // BLOCK) % 2 == 0 else 1)

    e = len(counts)
    w, ws = _weights(e, I, D, 1)
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    starts, ends = aligned_groups(offs)
    JA = max(ALIGN, -(-int(ends[-1]) // ALIGN) * ALIGN)
    q, s = _rows(JA, D, 2)
    gu = torch.empty(JA, 2 * I, dtype=torch.bfloat16, device="cuda")
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((q, s.t()), (w, ws), gu, ends.to(torch.int32), use_psum_layout=True)
    ref_q, ref_s = swiglu_quant(gu, starts, ends, limit)
    hq, hs = gate_up_dg(q, s, w, ws, ends.to(torch.int32).contiguous(), limit)
    rows = torch.cat([torch.arange(a, b, device="cuda") for a, b in zip(starts.tolist(), ends.tolist())])
    assert rows.numel() == sum(counts)
    assert torch.equal(hq[rows].view(torch.uint8), ref_q[rows].view(torch.uint8))
    assert torch.equal(hs[:, rows], ref_s[:, rows])
    assert hq.dtype == FP8 and hs.shape == (I // BLOCK, JA)


@needs
@pytest.mark.parametrize("cluster", [1, 2])
@pytest.mark.parametrize("counts,G", [([130, 0, 5, 256], 256), ([1, 128, 0, 127], 128)])
def test_masked_equals_deepgemm_then_swiglu_quant(counts, G, cluster, monkeypatch):
    """Masked layout (expert x at rows x * G, the counts on the device): the same bits as DeepGEMM's
    m_grouped_fp8_gemm_nt_masked + swiglu_quant (group_rows=G) on every row in use."""
    import deep_gemm

    import moe_wave.gate_up_dg as gd
    from moe_wave.fp8_expert_kernels import swiglu_quant
    from moe_wave.gate_up_dg import gate_up_dg

    monkeypatch.setattr(gd, "CLUSTER", cluster)

    e, I, D, limit = len(counts), 256, 512, 7.0
    w, ws = _weights(e, I, D, 3)
    JA = e * G
    q, s2 = _rows(JA, D, 4)                           # s2 [D/128, JA]
    s = s2.view(D // BLOCK, e, G).permute(1, 0, 2).contiguous()     # [e, D/128, G]
    m = torch.tensor(counts, dtype=torch.int32, device="cuda")
    gu = torch.empty(JA, 2 * I, dtype=torch.bfloat16, device="cuda")
    deep_gemm.m_grouped_fp8_gemm_nt_masked((q.view(e, G, D), s.transpose(1, 2)), (w, ws), gu.view(e, G, 2 * I), m,
                                           max(counts))
    starts = torch.arange(e, device="cuda", dtype=torch.int32) * G
    ref_q, ref_s = swiglu_quant(gu, starts, starts + m, limit, group_rows=G)
    hq, hs = gate_up_dg(q, s, w, ws, m, limit, group_rows=G)
    rows = torch.cat([torch.arange(x * G, x * G + c, device="cuda") for x, c in enumerate(counts)])
    assert torch.equal(hq[rows].view(torch.uint8), ref_q[rows].view(torch.uint8))
    hs_rows, ref_rows = hs.permute(0, 2, 1).reshape(JA, -1), ref_s.permute(0, 2, 1).reshape(JA, -1)
    assert torch.equal(hs_rows[rows], ref_rows[rows])


@needs
def test_rejects_bad_operands():
    from moe_wave.gate_up_dg import gate_up_dg

    w, ws = _weights(2, 256, 512, 5)
    q, s = _rows(256, 512, 6)
    with pytest.raises(ValueError, match="gate_up_dg: rows"):
        gate_up_dg(q[:200], s[:, :200], w, ws, torch.tensor([100, 200], dtype=torch.int32, device="cuda"), 7.0)
    with pytest.raises(ValueError, match="int32"):
        gate_up_dg(q, s, w, ws, torch.tensor([100, 200], device="cuda"), 7.0)


@needs
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
@pytest.mark.parametrize("fp8_rows", [True, False])
def test_stage_on_it_equals_the_deepgemm_way_and_replays(layout, fp8_rows, monkeypatch):
    """The FP8 block with the first GEMM on gate_up_dg (the library's choice in the aligned layout above
    FUSED_SMALL_TILE_ROWS_PER_EXPERT; rows that arrived as FP8 copied into the layout, or bf16 rows quantised into
    it) equals the block on DeepGEMM's GEMM + swiglu_quant bit for bit, at W=1 and W=2, eager and replayed from a
    CUDA graph; the masked layout keeps the Triton kernel (no gate_up_dg call) and its output stays finite."""
    import moe_wave.fp8_experts as fx
    import moe_wave.gate_up_dg as gd
    from tests.test_gpu_fp8_experts import _moe, _x

    monkeypatch.setattr(fx, "FUSED_SMALL_TILE_ROWS_PER_EXPERT", 0)
    calls = []
    real = gd.gate_up_dg
    monkeypatch.setattr(gd, "gate_up_dg", lambda *a, **k: calls.append(1) or real(*a, **k))
    for W in (1, 2):
        moe = _moe(W, fp8_rows=fp8_rows)
        moe.experts.gemm_layout = layout
        x = _x(300, 21)
        monkeypatch.setattr(fx, "FUSED_GATE_UP_ROWS_PER_EXPERT", 0)      # the DeepGEMM way
        monkeypatch.setattr(fx, "GATE_UP_DG", False)
        ref = moe(x)
        assert not calls
        monkeypatch.setattr(fx, "GATE_UP_DG", True)
        y = moe(x)
        if layout == "masked":
            assert not calls and torch.isfinite(y).all()
            continue
        assert len(calls) == W, calls
        assert torch.isfinite(y).all() and torch.equal(y, ref), (layout, fp8_rows, W)
        moe.capture_graphs([300])
        assert torch.equal(moe(x), ref), (layout, fp8_rows, W)
        calls.clear()

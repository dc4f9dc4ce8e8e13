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
@pytest.mark.parametrize("cluster", [1, 2])
@pytest.mark.parametrize("R,L,e,I,D", [(300, 0, 4, 256, 512), (300, 70, 4, 384, 512), (700, 200, 8, 2048, 4096)])
def test_rows_where_they_arrived_equal_the_layout(R, L, e, I, D, cluster, monkeypatch):
    """src_J: the kernel reading the received FP8 rows where they arrived (one TMA box a row and k-block; local rows
    row0 .. row0 + L - 1 from their own buffer, the main buffer's rows there filled with other values) gives the
    same hq and hs on every row in use as the kernel on the rows gather_pairs copied into the layout."""
    import moe_wave.gate_up_dg as gd
    from moe_wave.expert_kernels import expert_order
    from moe_wave.fp8_expert_kernels import aligned_capacity, gather_pairs, layout_groups
    from moe_wave.fp8_rows import pack_rows, unpack_rows
    from moe_wave.gate_up_dg import gate_up_dg

    monkeypatch.setattr(gd, "CLUSTER", cluster)
    K = 6
    w, ws = _weights(e, I, D, 7)
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(R, D, generator=g) * 2).to("cuda", torch.bfloat16)
    ids = torch.randint(-1, e, (R, K), generator=g)
    ids = torch.where(torch.rand(R, K, generator=g) < 0.5, ids, torch.arange(K) % e)      # some experts crowded
    ids = ids.cuda()
    rows = pack_rows(x)
    row0 = 37 if L else 0
    loc = None
    if L:
        loc = (row0, rows[row0:row0 + L].clone())
        rows[row0:row0 + L] = pack_rows(torch.randn(L, D, generator=g).to("cuda", torch.bfloat16))
    valid = (ids >= 0) & (ids < e)
    counts = torch.bincount(ids[valid], minlength=e).to(torch.int32)
    JA = aligned_capacity(R * K, e)
    grp = layout_groups(counts, R * K, JA)
    src, pos = expert_order(ids, e, grp.offs, starts_e=grp.starts, capacity=JA)
    q, s = gather_pairs(rows, D, pos, JA, loc)
    ref_q, ref_s = gate_up_dg(q, s, w, ws, grp.ends, 7.0)
    lq = None if loc is None else (row0, *unpack_rows(loc[1], D))
    hq, hs = gate_up_dg(*unpack_rows(rows, D), w, ws, grp.ends, 7.0, src_J=src, local=lq)
    use = pos[pos >= 0]
    assert use.numel() == int(valid.sum())
    assert torch.equal(hq[use].view(torch.uint8), ref_q[use].view(torch.uint8))
    assert torch.equal(hs[:, use], ref_s[:, use])


@needs
def test_rejects_bad_operands():
    from moe_wave.gate_up_dg import gate_up_dg

    w, ws = _weights(2, 256, 512, 5)
    q, s = _rows(256, 512, 6)
    with pytest.raises(ValueError, match="gate_up_dg: rows"):
        gate_up_dg(q[:200], s[:, :200], w, ws, torch.tensor([100, 200], dtype=torch.int32, device="cuda"), 7.0)
    with pytest.raises(ValueError, match="int32"):
        gate_up_dg(q, s, w, ws, torch.tensor([100, 200], device="cuda"), 7.0)
    src = torch.zeros(256, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="src_J .* int64"):
        gate_up_dg(q, s.t(), w, ws, torch.tensor([100, 200], dtype=torch.int32, device="cuda"), 7.0,
                   src_J=src.int())
    with pytest.raises(ValueError, match="contiguous layout, not group_rows"):
        gate_up_dg(q, s.t(), w, ws, torch.tensor([100, 200], dtype=torch.int32, device="cuda"), 7.0,
                   group_rows=128, src_J=src)
    with pytest.raises(ValueError, match="gate_up_dg: rows .* with src_J"):       # scales [D/128, rows]: transposed
        gate_up_dg(q, s, w, ws, torch.tensor([100, 200], dtype=torch.int32, device="cuda"), 7.0, src_J=src)


@needs
@pytest.mark.parametrize("layout,fp8_rows,src", [("contiguous", True, False), ("contiguous", True, True),
                                                 ("contiguous", False, False), ("masked", True, True),
                                                 ("masked", False, False)])
def test_stage_on_it_equals_the_deepgemm_way_and_replays(layout, fp8_rows, src, monkeypatch):
    """The FP8 block with the first GEMM on gate_up_dg (the library's choice in the aligned layout above
    FUSED_SMALL_TILE_ROWS_PER_EXPERT; rows that arrived as FP8 copied into the layout or, with GATE_UP_DG_SRC, read
    where they arrived, or bf16 rows quantised into the layout) equals the block on DeepGEMM's GEMM + swiglu_quant
    bit for bit, at W=1 and W=2, eager and replayed from a CUDA graph; the masked layout keeps the Triton kernel
    (no gate_up_dg call) and its output stays finite."""
    import moe_wave.fp8_experts as fx
    import moe_wave.gate_up_dg as gd
    from tests.test_gpu_fp8_experts import _moe, _x

    monkeypatch.setattr(fx, "FUSED_SMALL_TILE_ROWS_PER_EXPERT", 0)
    monkeypatch.setattr(fx, "GATE_UP_DG_SRC", src)
    calls = []
    real = gd.gate_up_dg
    monkeypatch.setattr(gd, "gate_up_dg", lambda *a, **k: calls.append("src_J" in k) or real(*a, **k))
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
        assert calls == [src] * W, calls
        assert torch.isfinite(y).all() and torch.equal(y, ref), (layout, fp8_rows, W)
        moe.capture_graphs([300])
        assert torch.equal(moe(x), ref), (layout, fp8_rows, W)
        calls.clear()

"""FP8 experts (``moe_wave.fp8_experts``): the glue kernels against their torch twins, the aligned expert-major
layout, FP4 -> FP8 re-encoding, the FP8 block against an fp32 dequantised reference on 1-3 gloo ranks, the fused
DeepGEMM stage's logic on CPU (DeepGEMM replaced by its psum-layout semantics in torch), and pipelined == serial.
On CPU the Triton kernels run under ``TRITON_INTERPRET=1`` (tests/conftest.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from moe_wave import MoEConfig, WaveConfig, WaveMoE
from moe_wave.comm.backend import Received
from moe_wave.comm.triton_gate import triton_ok
from moe_wave.fp8 import BLOCK, FP8, act_quant_torch, dequant_act, fp8_matmul_ref
from moe_wave.fp8_expert_kernels import (ALIGN, aligned_capacity, aligned_groups, block_ends, gate_up_swiglu,
                                         gate_up_swiglu_torch, gather_pairs, layout_groups, layout_groups_torch,
                                         masked_groups, quant_pairs, quant_pairs_torch, swiglu_quant,
                                         swiglu_quant_torch, swiglu_quant_rows, swiglu_quant_rows_torch)
from moe_wave.fp8_experts import (FP8RoutedExperts, dequant_experts, dequant_fp4, fp4_to_fp8, quant_experts)
from moe_wave.tools.bench import init_random_

# the glue kernels' twin tests run where Triton does: on the GPU when there is one, else the CPU interpreter
KDEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not triton_ok(KDEV, want=True),
                                   reason="Triton cannot run here (not installed, or CPU without TRITON_INTERPRET=1)")
CFG = MoEConfig(hidden_size=256, intermediate_size=128, num_experts=6, top_k=3)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's accuracy measure of its FP8 GEMM tests (deep_gemm.testing.calc_diff): 1 - 2<x,y>/(|x|^2+|y|^2);
    its tests hold FP8 x FP8 products below 0.001."""
    x, y = x.double(), y.double()
    den = (x * x + y * y).sum()
    return 0.0 if den == 0 else float(1 - 2 * (x * y).sum() / den)


def _pos(R: int, K: int, e: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(ids [R, K] int32 with -1 slots, pos [R, K] in the aligned layout, offs, JA) through ``expert_order``."""
    from moe_wave.expert_kernels import expert_order

    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e + 2, generator=g)[:K] for _ in range(R)]).to(torch.int32)
    ids = torch.where(ids < e, ids, -1).to(torch.int32)       # distinct experts a row, some slots elsewhere
    counts = torch.bincount(ids.reshape(-1).long() + 1, minlength=e + 1)[1:]
    offs = counts.cumsum(0).to(torch.int32)
    JA = aligned_capacity(R * K, e)
    starts, _ = aligned_groups(offs)
    _, pos = expert_order(ids.to(KDEV), e, offs.to(KDEV), starts_e=starts.to(KDEV), capacity=JA)
    return ids, pos.cpu(), offs, JA


@needs_kernels
@pytest.mark.parametrize("R,K,e", [(37, 3, 5), (1, 1, 1), (64, 6, 16)])
def test_aligned_layout_places_each_pair_once_in_its_aligned_group(R, K, e):
    ids, pos, offs, JA = _pos(R, K, e, seed=R + K)
    starts, ends = aligned_groups(offs)
    assert (starts % ALIGN == 0).all() and (starts[1:] >= ends[:-1]).all() and int(ends[-1]) <= JA
    ok = ids >= 0
    assert torch.equal(ok, pos >= 0)
    p = pos[ok]
    assert p.unique().numel() == p.numel()                      # one row of the layout per pair
    x = ids[ok].long()
    assert ((p >= starts[x]) & (p < ends[x])).all()             # inside its expert's group
    # flat order within a group (the stable argsort's): pairs of expert x take starts[x], starts[x] + 1, ...
    for xe in range(e):
        got = pos[ids == xe]
        assert torch.equal(got, starts[xe] + torch.arange(got.numel()))


@needs_kernels
@pytest.mark.parametrize("seed", [0, 1])
def test_quant_pairs_kernel_equals_its_twin_bit_for_bit(seed):
    R, K, e, D = 29, 3, 4, 256
    ids, pos, offs, JA = _pos(R, K, e, seed)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(R, D, generator=g) * torch.logspace(-3, 3, D)).to(torch.bfloat16)
    x[3] = 0                                                    # an all-zero row: the amax floor
    q, s = (t.cpu() for t in quant_pairs(x.to(KDEV), pos.to(KDEV), JA))
    qt, st_ = quant_pairs_torch(x, pos, JA)
    used = pos[pos >= 0]
    assert torch.equal(q[used].view(torch.uint8), qt[used].view(torch.uint8))
    assert torch.equal(s[:, used], st_[:, used])
    # the format is fp8.act_quant's: each pair's row is its source row quantised
    r = torch.arange(R)[:, None].expand(R, K)[pos >= 0]
    q_ref, s_ref = act_quant_torch(x[r])
    assert torch.equal(q[used].view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s[:, used], s_ref)


@needs_kernels
def test_quant_pairs_reads_local_rows_where_they_are():
    R, K, e, D = 12, 2, 3, 128
    ids, pos, offs, JA = _pos(R, K, e, 5)
    x = torch.randn(R, D).to(torch.bfloat16)
    own = torch.randn(4, D).to(torch.bfloat16)                  # rows 6..9 live in own, not in x
    full = x.clone()
    full[6:10] = own
    q, s = (t.cpu() for t in quant_pairs(x.to(KDEV), pos.to(KDEV), JA, local=(6, own.to(KDEV))))
    qt, st_ = quant_pairs_torch(full, pos, JA)
    used = pos[pos >= 0]
    assert torch.equal(q[used].view(torch.uint8), qt[used].view(torch.uint8)) and torch.equal(s[:, used], st_[:, used])


def test_block_ends_cover_every_group_row_and_no_padding():
    """swiglu_quant's blocks: each 128-row block of the aligned layout covers the rows of its group up to the
    group's end, and nothing else (empty groups, a group over one block, a last block past every group)."""
    cnt = torch.tensor([0, 5, 130, 0, 128, 1, 0], dtype=torch.int32)
    starts, ends = aligned_groups(cnt.cumsum(0).to(torch.int32))
    JA = aligned_capacity(int(cnt.sum()), cnt.numel())
    bend = block_ends(starts, ends, JA)
    assert bend.shape == (JA // ALIGN,)
    covered = {r for b, end in enumerate(bend.tolist()) for r in range(b * ALIGN, min(b * ALIGN + ALIGN, end))}
    assert covered == {r for s, e in zip(starts.tolist(), ends.tolist()) for r in range(s, e)}


@needs_kernels
@pytest.mark.parametrize("counts,cap,max_m", [
    ([0, 5, 130, 0, 128, 1, 0], 10 ** 6, 0),            # empty groups, one over a block, a last block past all
    ([0, 5, 130, 0, 128, 1, 0], 200, 0),                # the running sum clamped at cap: later groups shrink to 0
    ([3, 300, 0, 128, 129], 10 ** 6, 128),              # masked: counts past max_m cut there and flagged
    ([3, 300, 0, 128, 129], 250, 256),
    ([7], 7, 0), ([7], 7, 128),                         # one expert
    (list(range(40)), 700, 0), (list(range(0, 200, 5)), 10 ** 6, 256)])   # more experts than one block of BB
def test_layout_groups_kernel_equals_its_twin(counts, cap, max_m):
    """``layout_groups`` (one launch) gives what ``aligned_groups`` / ``masked_groups`` and ``block_ends`` give
    from the clamped running sum: offsets, starts, ends, sizes, the flags of groups cut at max_m, n and the block
    ends, every entry."""
    c = torch.tensor(counts, dtype=torch.long)
    e = c.numel()
    JA = max_m * e if max_m else aligned_capacity(max(int(c.sum()), 1), e)
    want = layout_groups_torch(c, cap, JA, max_m)
    got = layout_groups(c.to(KDEV), cap, JA, max_m)
    for name, w, g in zip(want._fields, want, got):
        assert torch.equal(g.cpu(), w), (name, g.cpu().tolist(), w.tolist())
    if max_m:
        sizes = c.cumsum(0).clamp(max=cap).diff(prepend=torch.zeros(1, dtype=torch.long))
        assert want.over.tolist() == (sizes > max_m).int().tolist() and int(want.n) == JA
    else:
        assert int(want.n) == int(want.ends[-1]) and not want.over.any()
    with pytest.raises(ValueError, match=r"layout_groups: JA=100, max_m=0, 7 experts: JA and max_m must be "):
        layout_groups(torch.zeros(7, dtype=torch.long, device=KDEV), cap, 100)


def grouped_scales(s_CJ: torch.Tensor, G: int) -> torch.Tensor:
    """Scales [C/128, JA] laid out per group of G rows, [JA / G, C/128, G] (the kernels' ``group_rows`` form)."""
    C, JA = s_CJ.shape
    return s_CJ.view(C, JA // G, G).permute(1, 0, 2).contiguous()


@needs_kernels
def test_masked_layout_kernels_write_each_groups_scales_mn_major():
    """The masked layout (expert x at rows x * max_m ..): ``quant_pairs`` and ``swiglu_quant`` with group_rows =
    max_m write the values the aligned layout's twins give, and the scales as [e, C/128, max_m] (DeepGEMM's
    masked A scales, MN-major per group); ``block_ends`` covers each group's rows there and nothing else."""
    from moe_wave.expert_kernels import expert_order

    R, K, e, D, I = 29, 3, 4, 256, 384
    ids, _, offs, _ = _pos(R, K, e, 3)
    G = 128
    JA = e * G
    starts, ends = masked_groups(offs, G)
    assert torch.equal(starts, torch.arange(e, dtype=torch.int32) * G) and torch.equal(ends - starts, torch.diff(
        offs, prepend=offs.new_zeros(1)))
    _, pos = expert_order(ids.to(KDEV), e, offs.to(KDEV), starts_e=starts.to(KDEV), capacity=JA)
    pos = pos.cpu()
    used = pos[pos >= 0]
    assert ((used // G) == ids[ids >= 0].long()).all()          # each pair in its expert's group
    x = (torch.randn(R, D) * 3).to(torch.bfloat16)
    q, s = (t.cpu() for t in quant_pairs(x.to(KDEV), pos.to(KDEV), JA, group_rows=G))
    qt, st_ = quant_pairs_torch(x, pos, JA)
    assert s.shape == (e, D // 128, G)
    assert torch.equal(q[used].view(torch.uint8), qt[used].view(torch.uint8))
    sg = grouped_scales(st_, G)
    assert torch.equal(s[used // G, :, used % G], sg[used // G, :, used % G])
    assert torch.equal(s.permute(1, 0, 2).reshape(D // 128, JA)[:, used], st_[:, used])
    bend = block_ends(starts, ends, JA)
    covered = {r for b, end in enumerate(bend.tolist()) for r in range(b * ALIGN, min(b * ALIGN + ALIGN, end))}
    assert covered == {r for a, b in zip(starts.tolist(), ends.tolist()) for r in range(a, b)}
    gu = (torch.randn(JA, 2 * I) * 6).to(torch.bfloat16)
    hq, hs = (t.cpu() for t in swiglu_quant(gu.to(KDEV), starts.to(KDEV), ends.to(KDEV), 10.0, group_rows=G))
    hqt, hst = swiglu_quant_torch(gu, starts, ends, 10.0)
    assert hs.shape == (e, I // 128, G)
    assert torch.equal(hs.permute(1, 0, 2).reshape(I // 128, JA)[:, used], hst[:, used])
    for bad in (100, 64):       # not a divisor; a divisor whose 128-row blocks would straddle two groups
        with pytest.raises(ValueError, match=rf"swiglu_quant: group_rows={bad}: must be a multiple of 128 that "
                                             rf"divides the layout's rows 512"):
            swiglu_quant(gu.to(KDEV), starts.to(KDEV), ends.to(KDEV), 10.0, group_rows=bad)


def test_fp8_gemm_layout_sizes_each_layout_and_names_the_choices():
    """The aligned layout sized for the pairs; the masked one e * max_m rows, max_m the received rows (or the
    pairs, if fewer) rounded up to 128; "auto" (the default) masked where that is no more rows than the aligned
    layout's, the ids are distinct and deep_gemm has the masked GEMMs; another name is an error naming the
    choices."""
    from moe_wave.fp8_experts import fp8_gemm_layout

    aligned = aligned_capacity(128 * 6, 128)
    assert fp8_gemm_layout(128, 128 * 6, 128, "contiguous") == ("contiguous", aligned, 0)
    assert fp8_gemm_layout(128, 128 * 6, 128, "masked") == ("masked", 128 * 128, 128)
    assert fp8_gemm_layout(2048, 2048 * 6, 128, "masked") == ("masked", 128 * 2048, 2048)
    assert fp8_gemm_layout(300, 40, 8, "masked")[2] == 128                                # max_m bound by pairs
    # auto: decode (128 * 128 = 16384 rows <= 17024 aligned) masked; prefill (262144 > 28544) aligned
    assert 128 * 128 <= aligned and fp8_gemm_layout(128, 128 * 6, 128) == ("masked", 128 * 128, 128)
    assert fp8_gemm_layout(2048, 2048 * 6, 128)[0] == "contiguous"
    assert fp8_gemm_layout(128, 128 * 6, 32)[0] == "masked"
    assert fp8_gemm_layout(128, 128 * 6, 128, distinct=False) == ("contiguous", aligned, 0)     # hash routing
    assert fp8_gemm_layout(128, 128 * 6, 128, masked_ok=False) == ("contiguous", aligned, 0)
    with pytest.raises(ValueError, match=r"gemm_layout='any': must be one of \('auto', 'contiguous', 'masked'\)"):
        fp8_gemm_layout(1, 1, 1, "any")


@needs_kernels
def test_masked_stage_with_a_group_past_max_m_is_nan_not_another_experts_rows(monkeypatch):
    """A row naming one expert in several slots (a hash table that repeats it) can give an expert more pairs than
    the masked layout's max_m: those pairs are not written into the next group's rows, and the rows that lost a
    pair come out NaN (loud, as a capacity overflow's) while the others stay right; the aligned layout, sized for
    every pair, computes them all."""
    import moe_wave.fp8_experts as fx
    from moe_wave.experts import expert_rows

    ex = FP8RoutedExperts.from_dense(CFG, torch.randn(4, 256, 256) / 16, torch.randn(4, 256, 128) / 11)
    ex.num_local = 4
    R, K = 50, 3
    ids = torch.zeros(R, K, dtype=torch.int32)              # every slot on expert 0: 150 pairs, max_m 128
    ids[::7, 2] = 3
    counts = torch.bincount(ids.reshape(-1).long(), minlength=4)
    x = torch.randn(R, 256).to(torch.bfloat16)
    w = torch.rand(R, K)
    want = expert_rows(Received(x, ids, w, None, counts, None), ex)
    monkeypatch.setattr(fx, "_deep_gemm_grouped", lambda dev: _TorchDeepGEMM)
    monkeypatch.setattr(fx, "fp8_fused_ok", lambda x, e: True)
    d = (lambda t: t.to(KDEV))
    ex = ex.to(KDEV)
    got = {}
    for layout in ("contiguous", "masked"):
        ex.gemm_layout = layout
        got[layout] = expert_rows(Received(d(x), d(ids), d(w), None, d(counts), None), ex).cpu()
    assert calc_diff(got["contiguous"].float(), want.float()) < 1e-5
    # "auto" on a hash-routed layer (whose table may repeat an expert in a row) keeps the aligned layout: all right
    ex.gemm_layout, ex.cfg = "auto", dataclasses.replace(ex.cfg, hash_routing=True, vocab_size=8)
    auto = expert_rows(Received(d(x), d(ids), d(w), None, d(counts), None), ex).cpu()
    assert torch.equal(auto, got["contiguous"])
    # expert 0's first 128 pairs (flat order) fit; the rows holding one of the others are NaN, the rest right
    flat0 = (ids == 0).reshape(-1).cumsum(0).view(R, K)
    lost = ((ids == 0) & (flat0 > 128)).any(1)
    assert lost.any() and not lost.all()
    assert torch.isnan(got["masked"][lost]).all()
    assert not torch.isnan(got["masked"][~lost]).any()
    assert calc_diff(got["masked"][~lost].float(), want[~lost].float()) < 1e-5


@needs_kernels
@pytest.mark.parametrize("M,limit", [(200, 10.0), (200, 0.0), (5, 10.0), (256, 10.0), (0, 10.0), (1000, 10.0)])
def test_swiglu_quant_rows_kernel_equals_its_twin(M, limit):
    """The shared expert's SwiGLU + requant over every row of a dense gu (any M: the last block partial; one or,
    at 1000 rows on CPU, two channel blocks a step): the kernel's scales are the torch ops', its values within
    one e4m3 step where silu's exp differs in the last fp32 bit; h dequantised is the clamped SwiGLU within
    e4m3's rounding."""
    I = 256
    gu = (torch.randn(M, 2 * I, generator=torch.Generator().manual_seed(M)) * 6).to(torch.bfloat16)
    hq, hs = (t.cpu() for t in swiglu_quant_rows(gu.to(KDEV), limit, kernels=True))
    hqt, hst = swiglu_quant_rows_torch(gu, limit)
    assert hq.shape == (M, I) and hs.shape == (I // BLOCK, M) and hq.dtype == FP8
    assert torch.equal(hs, hst)
    a, b = dequant_act(hq, hs), dequant_act(hqt, hst)
    assert M == 0 or ((a != b).float().mean() < 1e-3 and ((a - b).abs() <= b.abs() / 8 + 1e-30).all())
    gate, up = gu[:, :I].float(), gu[:, I:].float()
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    h = F.silu(gate) * up
    assert ((a - h).abs() <= h.abs() / 8 + hs.t().repeat_interleave(BLOCK, 1) / 2 ** 9).all()
    with pytest.raises(ValueError, match=r"swiglu_quant_rows: gu \(4, 300\): must be \[M, 2 \* I\]"):
        swiglu_quant_rows(torch.zeros(4, 300, dtype=torch.bfloat16, device=KDEV), limit, kernels=True)


@needs_kernels
@pytest.mark.parametrize("limit,I", [(10.0, 256), (0.0, 256), (10.0, 384), (10.0, 768)])
def test_swiglu_quant_kernel_equals_its_twin(limit, I):
    R, K, e = 23, 3, 4
    ids, pos, offs, JA = _pos(R, K, e, 7)
    gu = (torch.randn(JA, 2 * I) * 6).to(torch.bfloat16)
    starts, ends = aligned_groups(offs)
    hq, hs = (t.cpu() for t in swiglu_quant(gu.to(KDEV), starts.to(KDEV), ends.to(KDEV), limit))
    hqt, hst = swiglu_quant_torch(gu, starts, ends, limit)
    used = pos[pos >= 0]
    assert torch.equal(hs[:, used], hst[:, used])
    # the block ends given (as the stage passes layout_groups' own) in place of the groups: the same bits
    bend = block_ends(starts, ends, JA).to(KDEV)
    hq2, hs2 = (t.cpu() for t in swiglu_quant(gu.to(KDEV), None, None, limit, bend=bend))
    assert torch.equal(hq2[used].view(torch.uint8), hq[used].view(torch.uint8))
    assert torch.equal(hs2[:, used], hs[:, used])
    with pytest.raises(ValueError, match="swiglu_quant: starts_e and ends_e are needed where bend"):
        swiglu_quant(gu.to(KDEV), None, None, limit)
    a, b = dequant_act(hq[used], hs[:, used]), dequant_act(hqt[used], hst[:, used])
    # silu's exp may differ in its last fp32 bit between Triton and torch: at most one e4m3 step, rarely
    assert (a != b).float().mean() < 1e-3 and ((a - b).abs() <= b.abs() / 8 + 1e-30).all()
    gate, up = gu[used, :I].float(), gu[used, I:].float()
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    assert calc_diff(a, F.silu(gate) * up) < 1e-3


@needs_kernels
@pytest.mark.parametrize("bm", [128, 64])
@pytest.mark.parametrize("masked", [False, True])
def test_gate_up_swiglu_kernel_equals_its_twin(bm, masked):
    """The first GEMM with SwiGLU + requant in one kernel against its twin (the dequantised fp32 GEMM, gu rounded
    to bf16, then swiglu_quant_torch): bit for bit on values whose products and sums are exact
    in fp32 (small integers, power-of-two scales), on the aligned layout and the masked one (scales grouped by
    max_m), with groups of 0, 1, 70 and 130 rows; and within rounding of the two-step path (the GEMM's bf16 rows
    through swiglu_quant) on random values, where the dot's order of additions may differ."""
    e, D, I = 4, 256, 256
    cnt = torch.tensor([70, 0, 130, 1])
    offs = cnt.cumsum(0).to(torch.int32)
    if masked:
        G = 256
        JA = e * G
        starts, ends = masked_groups(offs, G)
    else:
        G = None
        JA = aligned_capacity(int(cnt.sum()), e)
        starts, ends = aligned_groups(offs)
    used = torch.cat([torch.arange(a, b) for a, b in zip(starts.tolist(), ends.tolist())])
    gen = torch.Generator().manual_seed(5)

    def run(q, s_DJ, w, ws, lim):
        s = s_DJ if G is None else s_DJ.view(D // BLOCK, JA // G, G).permute(1, 0, 2).contiguous()
        d = (lambda t: t.to(KDEV))
        hq, hs = gate_up_swiglu(d(q), d(s), d(w), d(ws), d(starts), d(block_ends(starts, ends, JA)), lim, G, bm=bm)
        hq, hs = hq.cpu(), hs.cpu()
        if G is not None:
            assert hs.shape == (JA // G, I // BLOCK, G)
            hs = hs.permute(1, 0, 2).reshape(I // BLOCK, JA)
        return hq[used], hs[:, used]

    q = torch.randint(-4, 5, (JA, D), generator=gen).float().to(FP8)
    s = 2.0 ** torch.randint(-3, 3, (D // BLOCK, JA), generator=gen).float()
    w = torch.randint(-4, 5, (e, 2 * I, D), generator=gen).float().to(FP8)
    ws = 2.0 ** torch.randint(-8, -4, (e, 2 * I // BLOCK, D // BLOCK), generator=gen).float()
    for lim in (10.0, 0.0):
        hq, hs = run(q, s, w, ws, lim)
        hqt, hst = gate_up_swiglu_torch(q, s, w, ws, starts, ends, lim)
        assert torch.equal(hq.view(torch.uint8), hqt[used].view(torch.uint8)) and torch.equal(hs, hst[:, used])
    # random values: the two-step path's h (fp32 GEMM of the dequantised operands, bf16 rows, swiglu_quant: the
    # twin)
    q, s = act_quant_torch(torch.randn(JA, D, generator=gen) * 2)
    w, ws = quant_experts(torch.randn(e, 2 * I, D, generator=gen) / 16)
    hq, hs = run(q, s, w, ws, 10.0)
    hqt, hst = gate_up_swiglu_torch(q, s, w, ws, starts, ends, 10.0)
    got, want = dequant_act(hq, hs), dequant_act(hqt[used], hst[:, used])
    assert calc_diff(got, want) < 1e-4 and (got != want).float().mean() < 0.05
    with pytest.raises(ValueError, match=r"gate_up_swiglu: rows \(512, 256\), weights \(4, 512, 128\)"):
        gate_up_swiglu(q[:512].to(KDEV), s[:, :512].to(KDEV), w[:, :, :128].to(KDEV), ws.to(KDEV), starts.to(KDEV),
                       block_ends(starts, ends, 512).to(KDEV), 10.0)
    with pytest.raises(ValueError, match=r"gate_up_swiglu: bm=96: must be 64 or 128"):
        gate_up_swiglu(q.to(KDEV), s.to(KDEV), w.to(KDEV), ws.to(KDEV), starts.to(KDEV),
                       block_ends(starts, ends, JA).to(KDEV), 10.0, bm=96)


@needs_kernels
@pytest.mark.parametrize("masked", [False, True])
def test_gate_up_swiglu_reads_received_rows_where_they_arrived(masked):
    """With src_J (expert_order's), gate_up_swiglu reads each pair's FP8 row and scales from the received packed
    rows (and the rows of ``local`` from there) instead of the layout's copy: the same bits as gather_pairs into
    the layout followed by the layout form, on both layouts; a received row's own bytes poisoned where ``local``
    holds it are never read."""
    from moe_wave.expert_kernels import expert_order
    from moe_wave.fp8_rows import pack_rows, unpack_rows

    R, K, e, D, I = 41, 3, 4, 256, 256
    ids, _, offs, JA = _pos(R, K, e, 9)
    if masked:
        G, JA = 128, 4 * 128
        starts, ends = masked_groups(offs, G)
    else:
        G = None
        starts, ends = aligned_groups(offs)
    d = (lambda t: t.to(KDEV))
    src, pos = expert_order(d(ids), e, d(offs), starts_e=d(starts), capacity=JA)
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(R, D, generator=gen) * 3).to(torch.bfloat16)
    w, ws = quant_experts(torch.randn(e, 2 * I, D, generator=gen) / 16)
    p = pack_rows(x)
    own = p[10:17].clone()                            # rows 10..16 live in own; their bytes in p are poison
    recv = p.clone()
    recv[10:17] = torch.full_like(own, float("nan"))
    bend = d(block_ends(starts, ends, JA))
    args = (d(w), d(ws), d(starts), bend, 10.0, G)
    q, s_ = gather_pairs(d(p), D, pos, JA, group_rows=G)
    want = gate_up_swiglu(q, s_, *args)
    got = gate_up_swiglu(*unpack_rows(d(recv), D), *args, src_J=src, local=(10, *unpack_rows(d(own), D)))
    used = pos[pos >= 0].cpu()
    hs_w, hs_g = (t.cpu() if G is None else t.cpu().permute(1, 0, 2).reshape(I // BLOCK, JA) for t in (want[1], got[1]))
    assert torch.equal(got[0].cpu()[used].view(torch.uint8), want[0].cpu()[used].view(torch.uint8))
    assert torch.equal(hs_g[:, used], hs_w[:, used]) and torch.isfinite(hs_g[:, used]).all()
    with pytest.raises(ValueError, match=r"gate_up_swiglu: row scales \(41, 1\) stride \(\d+, 1\): must be \[41, 2\]"):
        gate_up_swiglu(unpack_rows(d(p), D)[0], unpack_rows(d(p), D)[1][:, :1], *args, src_J=src)


def test_quant_experts_is_weight_quant_per_expert_and_refuses_partial_blocks():
    from moe_wave.fp8 import weight_quant

    w = torch.randn(3, 256, 128) * torch.tensor([1e-3, 1.0, 50.0])[:, None, None]
    q, s = quant_experts(w)
    for j in range(3):
        qj, sj = weight_quant(w[j])
        assert torch.equal(q[j].view(torch.uint8), qj.view(torch.uint8)) and torch.equal(s[j], sj)
    assert calc_diff(dequant_experts(q, s), w) < 1e-3
    with pytest.raises(ValueError, match=r"N and K must be multiples of 128"):
        quant_experts(torch.randn(1, 100, 128))


def _fp4(e: int, N: int, K: int, spread: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random FP4 experts: codes in every byte, 1 x 32 scales 2^a with a spread over ``spread`` octaves."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (e, N, K // 2), generator=g, dtype=torch.uint8)
    a = torch.randint(-spread, 1, (e, N, K // 32), generator=g).float() - 4
    return packed, torch.exp2(a)


def test_fp4_decodes_the_e2m1_table():
    packed = torch.zeros(1, 16, dtype=torch.uint8)                                 # K = 32: one scale
    packed[0, :4] = torch.tensor([0x10, 0x72, 0xF8, 0x9B], dtype=torch.uint8)      # element 2i in the low nibble
    vals = dequant_fp4(packed, torch.full((1, 1), 2.0))[0, :8]
    assert vals.tolist() == [0.0, 1.0, 2.0, 12.0, -0.0, -12.0, -3.0, -1.0]
    with pytest.raises(ValueError, match="scales .* must be"):
        dequant_fp4(packed, torch.ones(1, 3))


def test_fp4_to_fp8_is_exact_where_the_scales_spread_little_and_close_elsewhere():
    packed, scales = _fp4(2, 256, 256, spread=6, seed=0)
    q, s, exact = fp4_to_fp8(packed, scales)
    w = dequant_fp4(packed, scales)
    assert exact.all() and torch.equal(dequant_experts(q, s), w)     # every block exact: spread 2^6
    packed, scales = _fp4(1, 128, 512, spread=30, seed=1)            # spreads up to 2^30: small values round
    q, s, exact = fp4_to_fp8(packed, scales)
    w = dequant_fp4(packed, scales)
    d = dequant_experts(q, s)
    assert not exact.all()
    blocks = (d == w).view(1, 1, 128, 4, 128).all(dim=4).all(dim=2)
    assert torch.equal(blocks, exact)                                # the mask names the inexact blocks
    assert calc_diff(d, w) < 1e-6 and (d - w).abs().max() <= w.abs().max() * 2.0 ** -15


def test_load_fp4_fills_the_experts_and_reports_the_exact_share():
    cfg = MoEConfig(hidden_size=128, intermediate_size=128, num_experts=2, top_k=1)
    ex = FP8RoutedExperts(cfg, 2)
    gu, dn = _fp4(2, 256, 128, 4, 2), _fp4(2, 128, 128, 4, 3)
    share = ex.load_fp4(gu, dn)
    assert float(share) == 1.0
    assert torch.equal(ex.dense()[0], dequant_fp4(*gu)) and torch.equal(ex.dense()[1], dequant_fp4(*dn))
    with pytest.raises(ValueError, match="re-encodes to"):
        ex.load_fp4(_fp4(1, 256, 128, 4, 4), dn)


def fp8_reference(moe: WaveMoE, x: torch.Tensor) -> torch.Tensor:
    """The FP8 block from the dequantised weights (a model holding every expert), written here token by token:
    rows quantised per 128 channels, each GEMM's output rounded to bf16 (DeepGEMM writes bf16), SwiGLU with V4's
    clamps in fp32, the routed sum in fp32, plus the shared expert in the same format."""
    cfg, ex = moe.cfg, moe.experts
    I, lim = cfg.intermediate_size, cfg.swiglu_limit
    w13, w2 = ex.dense()
    ids, w = moe.route(x)

    def q(v):
        return dequant_act(*act_quant_torch(v))

    def ffn(v, gate_up, down, clamp):
        gu = (q(v) @ gate_up.t()).to(torch.bfloat16).float()
        g, u = gu[:, :I], gu[:, I:]
        if clamp and lim > 0:
            g, u = g.clamp(max=lim), u.clamp(-lim, lim)
        return (q(F.silu(g) * u) @ down.t()).to(torch.bfloat16).float()

    out = torch.zeros(x.shape[0], cfg.hidden_size)
    for t in range(x.shape[0]):
        for k in range(cfg.top_k):
            j = int(ids[t, k])
            out[t] += w[t, k] * ffn(x[t:t + 1], w13[j], w2[j], True)[0]
    if moe.shared is not None:
        sh = moe.shared
        out += ffn(x, dequant_experts(sh.gate_up, sh.gate_up_scale), dequant_experts(sh.down, sh.down_scale),
                   cfg.clamp_shared)
    return out.to(x.dtype)


def _gap(y: torch.Tensor, ref: torch.Tensor) -> float:
    """How far the block is from the reference: calc_diff, which one bf16 rounding of a GEMM output that flips
    (BLAS may sum a row's products in another order for another number of rows) moves by ~1e-9, where a wrong row
    or scale moves it by 1e-3 or more."""
    return calc_diff(y.float(), ref.float())


def _block(ep, W: int, full: dict | None = None) -> WaveMoE:
    from moe_wave.reference import random_full_weights

    moe = WaveMoE(CFG_SH, ep=ep, wave=WaveConfig(num_waves=W), dtype=torch.float32).quantize_fp8()
    moe.load_full(full if full is not None else random_full_weights(CFG_SH, seed=3, scale=0.2))
    return moe


CFG_SH = MoEConfig(hidden_size=256, intermediate_size=128, num_experts=6, top_k=3)


def _fp8_block_ranks(ep, T: int):
    """Per W: (relative error against the fp32 reference of the whole block, pipelined == serial); ranks with no
    token included (T = 0 on the last rank)."""
    from moe_wave.reference import random_full_weights

    full = random_full_weights(CFG_SH, seed=3, scale=0.2)
    g = torch.Generator().manual_seed(100 + ep.rank)
    x = torch.randn(T if ep.rank < ep.size - 1 or ep.size == 1 else 0, 256, generator=g)
    ref = fp8_reference(_block(None, 1, full), x)
    out = []
    for W in (1, 2, 3):
        moe = _block(ep, W, full)
        y = moe(x)
        err = _gap(y, ref) if x.shape[0] else float(y.numel())
        out.append((W, err, torch.equal(y, moe(x, overlap=False))))
    return out


def test_fp8_block_single_process_matches_the_fp32_reference_and_serial():
    from moe_wave.reference import random_full_weights

    full = random_full_weights(CFG_SH, seed=3, scale=0.2)
    moe = _block(None, 2, full)
    x = torch.randn(21, 256, generator=torch.Generator().manual_seed(21))
    y = moe(x)
    with torch.no_grad():
        assert _gap(y, fp8_reference(moe, x)) < 1e-6
    assert torch.equal(y, moe(x, overlap=False))
    dense = WaveMoE(CFG_SH, wave=WaveConfig(num_waves=2), dtype=torch.float32)
    dense.load_full(full)
    # DeepGEMM's tests hold one FP8 x FP8 GEMM within calc_diff 1e-3 of its bf16 product; each of the block's
    # GEMMs is within it, and the block (GEMM, SwiGLU, requant, GEMM in series, plus the shared expert) within 3e-3
    w13 = full["gate_up"][0]
    gu8 = dequant_act(*act_quant_torch(x)) @ dequant_experts(*quant_experts(w13[None]))[0].t()
    assert calc_diff(gu8, x @ w13.t()) < 1e-3
    with torch.no_grad():
        d = calc_diff(y, dense(x))
    assert 1e-8 < d < 3e-3, d                     # FP8, not the fp32 block itself, and within the bound


@pytest.mark.parametrize("n", [2, 3])
def test_fp8_block_on_ranks_matches_the_reference_at_every_wave_count(ranks, n):
    for rank_rows in ranks(n).run(_fp8_block_ranks, 9):
        for W, err, same in rank_rows:
            assert err < 1e-6, (W, err)
            assert same, f"W={W}: pipelined != serial"


class _TorchDeepGEMM:
    """DeepGEMM's ``m_grouped_fp8_gemm_nt_contiguous`` with the psum layout, in torch: group g is rows
    align_up(ends[g - 1], 128) .. ends[g] - 1 of a, times expert g's weight; other rows untouched. And its
    ``m_grouped_fp8_gemm_nt_masked``."""

    calls = masked = 0

    @staticmethod
    def get_mk_alignment_for_contiguous_layout():
        return 128

    @classmethod
    def m_grouped_fp8_gemm_nt_contiguous(cls, a, b, d, ends, use_psum_layout=False):
        assert use_psum_layout and ends.dtype == torch.int32 and a[1].shape == (a[0].shape[0], a[0].shape[1] // 128)
        cls.calls += 1
        start = 0
        for g, end in enumerate(ends.tolist()):
            if end > start:
                d[start:end] = fp8_matmul_ref(a[0][start:end], a[1][start:end].t(), b[0][g], b[1][g], d.dtype)
            start = -(-end // 128) * 128

    @classmethod
    def m_grouped_fp8_gemm_nt_masked(cls, a, b, d, masked_m, expected_m):
        """Group g: rows 0 .. masked_m[g] - 1 of a[0][g] (scales a[1][g], [max_m, K/128] MN-major) times expert g's
        weight into d[g]; other rows untouched."""
        e, max_m, Kd = a[0].shape
        assert a[1].shape == (e, max_m, Kd // 128) and a[1].stride(1) == 1, (a[1].shape, a[1].stride())
        assert masked_m.dtype == torch.int32 and masked_m.shape == (e,) and expected_m >= 1
        assert d.shape[:2] == (e, max_m)
        cls.calls += 1
        cls.masked += 1
        for g, m in enumerate(masked_m.tolist()):
            assert m <= max_m
            if m:
                d[g, :m] = fp8_matmul_ref(a[0][g, :m], a[1][g, :m].t(), b[0][g], b[1][g], d.dtype)


def _torch_gate_up_dg(q, s, w, ws, layout, limit, group_rows=None, src_J=None, local=None):
    """``gate_up_dg`` by _TorchDeepGEMM's GEMM and ``swiglu_quant_torch`` (its definition: DeepGEMM's GEMM, then
    swiglu_quant): the rows of the groups, others zeros."""
    from moe_wave.fp8_expert_kernels import swiglu_quant_torch

    e, I2, D = w.shape
    JA, G = q.shape[0] if src_J is None else src_J.shape[0], group_rows
    gu = torch.zeros(JA, I2, dtype=torch.bfloat16, device=q.device)
    if G:
        _TorchDeepGEMM.m_grouped_fp8_gemm_nt_masked((q.view(e, G, D), s.transpose(1, 2)), (w, ws),
                                                    gu.view(e, G, I2), layout, 1)
        starts = torch.arange(e, device=q.device) * G
        hq, hs = swiglu_quant_torch(gu, starts, starts + layout, limit)
        return hq, hs.view(I2 // 256, e, G).permute(1, 0, 2).contiguous()
    if src_J is not None:               # the rows where they arrived: copied into the layout here (index outside: 0)
        assert local is None, "the CPU stage has no local rows"
        r = torch.where((src_J >= 0) & (src_J < q.shape[0]), src_J, 0)
        q, s = q[r].contiguous(), s[r].t().contiguous()
    _TorchDeepGEMM.m_grouped_fp8_gemm_nt_contiguous((q, s.t()), (w, ws), gu, layout, use_psum_layout=True)
    ends = layout.long()
    starts = torch.cat([ends.new_zeros(1), -(-ends[:-1] // 128) * 128])
    return swiglu_quant_torch(gu, starts, ends, limit)


@needs_kernels
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("fused_gate_up", ["none", "triton", "gate_up_dg", "gate_up_dg_src"])
@pytest.mark.parametrize("rows_bound", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_fused_stage_logic_on_cpu_equals_the_per_expert_path(monkeypatch, rows_bound, layout, fused_gate_up,
                                                            packed):
    """The fused stage (ordering into the aligned or the masked layout, quant_pairs or, for rows that arrived as
    FP8, gather_pairs, two grouped GEMMs, swiglu_quant, weighted sum; or the first GEMM and swiglu_quant as one
    kernel: gate_up_swiglu, which reads arrived FP8 rows where they are, or gate_up_dg, here its torch twin, on the
    layout's rows or, with GATE_UP_DG_SRC, on arrived FP8 rows through src_J) with DeepGEMM replaced by its
    contiguous psum or masked semantics gives the per-expert path's output; rows past rows_P are not read."""
    from moe_wave.fp8_rows import pack_rows

    import moe_wave.fp8_expert_kernels as fk
    import moe_wave.fp8_experts as fx
    import moe_wave.gate_up_dg as gd

    fused = []
    # gate_up_dg where it runs takes every aligned size above the small tiles' (here past the Triton kernel's range)
    monkeypatch.setattr(fx, "FUSED_GATE_UP_ROWS_PER_EXPERT", 10 ** 9 if fused_gate_up == "triton" else 0)
    if fused_gate_up != "gate_up_dg":
        monkeypatch.setattr(fx, "gate_up_dg_ok", lambda *a: False)
    if fused_gate_up == "triton":
        real = fk.gate_up_swiglu
        monkeypatch.setattr(fk, "gate_up_swiglu", lambda *a, **k: fused.append(1) or real(*a, **k))
    elif fused_gate_up.startswith("gate_up_dg"):
        if layout == "masked":
            pytest.skip("the stage takes gate_up_dg in the aligned layout only")
        monkeypatch.setattr(fx, "FUSED_SMALL_TILE_ROWS_PER_EXPERT", 0)
        monkeypatch.setattr(fx, "gate_up_dg_ok", lambda *a: True)
        monkeypatch.setattr(fx, "GATE_UP_DG_SRC", fused_gate_up == "gate_up_dg_src")
        monkeypatch.setattr(gd, "gate_up_dg",
                            lambda *a, **k: fused.append("src_J" in k) or _torch_gate_up_dg(*a, **k))
    from moe_wave.experts import expert_rows

    ex = FP8RoutedExperts.from_dense(CFG, torch.randn(4, 256, 256) / 16, torch.randn(4, 256, 128) / 11)
    ex.num_local = 4
    R, K = 40, 3
    ids, _, offs, _ = _pos(R, K, 4, 11)
    x = torch.randn(R, 256).to(torch.bfloat16)
    w = torch.rand(R, K)
    rows_P = torch.tensor([15, 20]) if rows_bound else None
    if rows_bound:          # the rows past each block's count carry no pair the combine reads
        keep = (torch.arange(R) % 20) < rows_P.repeat_interleave(20)
        ids = torch.where(keep[:, None], ids, -1).to(torch.int32)
        counts = torch.bincount(ids.reshape(-1).long() + 1, minlength=5)[1:]
        offs = counts.cumsum(0).to(torch.int32)
    counts = torch.diff(offs, prepend=offs.new_zeros(1)).long()
    want = expert_rows(Received(x, ids, w, None, counts, None), ex)
    monkeypatch.setattr(fx, "_deep_gemm_grouped", lambda dev: _TorchDeepGEMM)
    monkeypatch.setattr(fx, "fp8_fused_ok", lambda x, e: True)
    _TorchDeepGEMM.calls = _TorchDeepGEMM.masked = 0
    ex.gemm_layout = layout
    d = (lambda t: None if t is None else t.to(KDEV))      # the kernels where they run (a GPU, or interpreted)
    xin = pack_rows(x) if packed else x
    got = expert_rows(Received(d(xin), d(ids), d(w), None, d(counts), None, rows_P=d(rows_P)), ex.to(KDEV),
                      packed=packed).cpu()
    dg_calls = 1 if fused_gate_up == "triton" else 2         # (the twin of gate_up_dg counts its GEMM)
    assert _TorchDeepGEMM.calls == dg_calls and _TorchDeepGEMM.masked == (dg_calls if layout == "masked" else 0)
    assert len(fused) == (fused_gate_up != "none")
    if fused_gate_up.startswith("gate_up_dg"):        # arrived FP8 rows where GATE_UP_DG_SRC says so, else the layout
        assert fused == [packed and fused_gate_up == "gate_up_dg_src"]
    read = slice(None) if rows_P is None else keep
    # the same math; silu's exp in Triton and in torch may differ in the last fp32 bit, which can move an element
    # of h to the next e4m3 step (on a GPU the fused kernel's dot also adds in the hardware's order): the rows
    # agree to that rounding, where a wrong layout would be off by O(1)
    bound = 1e-4 if fused_gate_up == "triton" and KDEV == "cuda" else 1e-5
    assert calc_diff(got[read].float(), want[read].float()) < bound
    assert ((got[read].float() - want[read].float()).abs() <= 0.02 * want[read].float().abs().max()).all()


def test_gate_up_dg_taken_on_the_named_cards_only(monkeypatch):
    """gate_up_dg_ok: the stage takes gate_up_dg on a CUDA GPU whose name holds one of GATE_UP_DG's strings (True:
    any, False or (): none) and where the kernel is available; never on CPU."""
    import moe_wave.fp8_experts as fx
    import moe_wave.gate_up_dg as gd

    built = []
    monkeypatch.setattr(gd, "available", lambda *a: built.append(a) or True)
    cuda = torch.device("cuda", 0)
    for setting, name, want in [(("H200",), "NVIDIA H200", True), (("H200",), "NVIDIA H100 80GB HBM3", False),
                                (True, "NVIDIA H100 80GB HBM3", True), (False, "NVIDIA H200", False),
                                ((), "NVIDIA H200", False), (("H100", "H200"), "NVIDIA H100 80GB HBM3", True)]:
        monkeypatch.setattr(fx, "GATE_UP_DG", setting)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None, n=name: n)
        assert fx.gate_up_dg_ok(cuda, 32, 2048, 4096, False) is want, (setting, name)
    assert built[-1] == (0, 32, 2048, 4096, False, False)
    monkeypatch.setattr(fx, "GATE_UP_DG", True)
    assert fx.gate_up_dg_ok(torch.device("cpu"), 32, 2048, 4096, False) is False
    monkeypatch.setattr(gd, "available", lambda *a: False)          # it does not build here
    assert fx.gate_up_dg_ok(cuda, 32, 2048, 4096, False) is False


def test_fp8_needs_128_channel_multiples():
    with pytest.raises(ValueError, match=r"hidden_size=64, intermediate_size=32: both must be multiples of 128"):
        WaveMoE(MoEConfig(hidden_size=64, intermediate_size=32, num_experts=2, top_k=1)).quantize_fp8()
    assert FP8 == torch.float8_e4m3fn and BLOCK == 128

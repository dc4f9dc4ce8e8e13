"""FP8 rows on the wire (``moe_wave.fp8_rows``; issue 51 items 2 and 5): rows quantised once before dispatch travel
as e4m3 + scales through the torch and symm backends (1-3 gloo ranks) and arrive equal to the local quantisation
of the rows a bf16 dispatch delivers; the FP8 block gives the same output bit for bit whether its rows travel as
FP8 or as bf16, pipelined == serial; the bytes a layer moves, counted, are 0.52 x bf16's at V4's width, and with
sends "once" the same at W = 4 as at W = 1. The pack and gather kernels run under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import pytest
import torch

from moe_wave import MoEConfig, WaveConfig, WaveMoE
from moe_wave.comm.factory import make_backend
from moe_wave.comm.layout import WavePlan, compute_layout
from moe_wave.comm.options import SymmOptions
from moe_wave.comm.triton_gate import triton_ok
from moe_wave.fp8 import act_quant_torch, dequant_act
from moe_wave.fp8_expert_kernels import gather_pairs, gather_pairs_torch, quant_pairs_torch
from moe_wave.fp8_rows import dequant_rows, pack_rows, packed_width, unpack_rows
from tests.test_fp8_experts import _pos

needs_kernels = pytest.mark.skipif(not triton_ok("cpu", want=True),
                                   reason="Triton cannot run here (not installed, or CPU without TRITON_INTERPRET=1)")
CFG = MoEConfig(hidden_size=256, intermediate_size=128, num_experts=6, top_k=3)


def _rows(T: int, D: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, D, generator=g) * torch.logspace(-3, 3, D)).to(torch.bfloat16)
    if T > 3:
        x[3] = 0                                                # the amax floor
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_packed_width_holds_values_and_scales_in_16_byte_rows():
    assert 2 * packed_width(4096) / (2 * 4096) == pytest.approx(0.5156, abs=1e-4)       # V4-Flash, no padding
    assert 2 * packed_width(7168) == 7168 + 7168 // 32                                  # V4-Pro
    for D in (128, 256, 384, 4096, 7168):
        assert (2 * packed_width(D)) % 16 == 0 and 2 * packed_width(D) >= D + D // 32
    with pytest.raises(ValueError, match="hidden size D=100 must be a multiple of 128"):
        packed_width(100)


def test_pack_rows_is_act_quant_per_row_and_dequantises_exactly():
    x = _rows(37, 384, seed=1)
    p = pack_rows(x)
    assert p.shape == (37, packed_width(384)) and p.dtype == torch.bfloat16
    q, s = unpack_rows(p, 384)
    q_ref, s_ref = act_quant_torch(x)
    assert _same(q, q_ref) and torch.equal(s, s_ref.t())
    assert torch.equal(dequant_rows(p, 384).float(), dequant_act(q_ref, s_ref))        # exact in bf16
    # re-quantising the dequantised rows gives the same values (the expert paths that read them so)
    q2, s2 = act_quant_torch(dequant_rows(p, 384))
    assert torch.equal(dequant_act(q2, s2), dequant_act(q_ref, s_ref))
    with pytest.raises(ValueError, match=r"must be packed rows of D=384"):
        unpack_rows(x, 384)


@needs_kernels
def test_gather_pairs_copies_what_quant_pairs_computes():
    R, K, e, D = 31, 3, 4, 256
    ids, pos, offs, JA = _pos(R, K, e, seed=4)
    x = _rows(R, D, seed=2)
    own = _rows(5, D, seed=3)                                   # rows 8..12 live in own
    full = x.clone()
    full[8:13] = own
    local = (8, pack_rows(own, kernels=False))
    q, s = gather_pairs(pack_rows(x, kernels=False), D, pos, JA, local)
    qt, st_ = gather_pairs_torch(pack_rows(x, kernels=False), D, pos, JA, local)
    qr, sr = quant_pairs_torch(full, pos, JA)
    used = pos[pos >= 0]
    assert _same(q[used], qt[used]) and torch.equal(s[:, used], st_[:, used])
    assert _same(q[used], qr[used]) and torch.equal(s[:, used], sr[:, used])


def _through_backend(ep, backend: str, W: int):
    """Rows dispatched as bf16, then as FP8, through the same routing: (rows checked, whether every received FP8
    row and its scales equal the local quantisation of the bf16 row received in its place)."""
    from moe_wave.comm.backend import CombineOut

    e, K, D, T = 4, 3, 256, 19 + 5 * ep.rank
    g = torch.Generator().manual_seed(40 + ep.rank)
    ids = torch.rand(T, ep.size * e, generator=g).topk(K, dim=1).indices
    w = torch.rand(T, K, generator=g)
    x = _rows(T, D, seed=50 + ep.rank)
    be = make_backend(backend, ep, symm=SymmOptions(capacity=64))
    plan = WavePlan.make(num_ranks=ep.size, num_local_experts=e, num_waves=W)
    bf16_rows, ok, checked = [], True, 0
    for packed in (False, True):
        xplan = be.prepare(compute_layout(ids, w, plan))
        for wave in range(W):
            got = be.dispatch(pack_rows(x) if packed else x, xplan, wave, combine_width=D if packed else None).wait()
            rows = (got.expert_RK >= 0).any(1)
            if not packed:
                bf16_rows.append((rows, act_quant_torch(got.x_RD[rows].contiguous())))
            else:
                want_rows, (q_ref, s_ref) = bf16_rows[wave]
                q, s = unpack_rows(got.x_RD, D)
                ok &= torch.equal(rows, want_rows) and _same(q[rows], q_ref) and torch.equal(s[rows], s_ref.t())
                checked += int(rows.sum())
            y = torch.zeros(got.x_RD.shape[0], D, dtype=torch.bfloat16)      # results come home D wide
            be.combine(y, got.handle, CombineOut(torch.zeros(T, D))).wait()
    return checked, ok


@pytest.mark.parametrize("backend", ["torch", "symm"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_fp8_rows_through_backends_equal_local_quantisation(ranks, backend, n):
    for W in (1, 2):
        res = ranks(n).run(_through_backend, backend, W)
        assert sum(u for u, _ in res) > 0
        assert all(ok for _, ok in res), (backend, n, W)


def _block_rows(ep, backend: str, sends: str):
    """Per W: the FP8 block (bf16 activations) with rows as FP8 equals it with bf16 rows, bit for bit, and
    pipelined equals serial; plus the counted traffic of each."""
    from moe_wave.reference import random_full_weights

    full = random_full_weights(CFG, seed=3, scale=0.2)
    x = _rows(9 + 4 * ep.rank, 256, seed=60 + ep.rank) / 64
    out = []
    for W in (1, 2, 3):
        ys, traffic = [], []
        for fp8_rows in (True, False):
            moe = WaveMoE(CFG, ep=ep, wave=WaveConfig(num_waves=W, backend=backend, sends=sends, fp8_rows=fp8_rows),
                          dtype=torch.bfloat16).quantize_fp8()
            moe.load_full(full)
            ys.append(moe(x))
            ys.append(moe(x, overlap=False))
            traffic.append(moe.traffic(x))
        out.append((W, all(torch.equal(ys[0], y) for y in ys[1:]), traffic))
    return out


@pytest.mark.parametrize("backend,sends", [("torch", "wave"), ("symm", "wave"), ("symm", "once")])
@pytest.mark.parametrize("n", [1, 3])
def test_block_with_fp8_rows_equals_bf16_rows_bit_for_bit(ranks, backend, sends, n):
    for rank_rows in ranks(n).run(_block_rows, backend, sends):
        for W, same, (t8, t16) in rank_rows:
            assert same, (backend, sends, n, W)
            assert t8["rows"] == t16["rows"] and t8["row_bytes"] < t16["row_bytes"]


def _counted(ep, W: int, sends: str, fp8_rows: bool):
    """(the layer's counted traffic, the bytes the torch backend's all-to-alls sent to other ranks)."""
    import moe_wave.comm.torch_backend as tb
    from moe_wave.reference import random_full_weights

    sent = [0]
    a2a = tb._a2a

    def counting(out, inp, out_splits, in_splits, pg):
        rows = sum(c for p, c in enumerate(in_splits) if p != ep.rank)
        sent[0] += rows * inp.shape[1] * inp.element_size()
        return a2a(out, inp, out_splits, in_splits, pg)

    tb._a2a = counting
    try:
        cfg = MoEConfig(hidden_size=4096 // 16, intermediate_size=128, num_experts=8 * ep.size, top_k=6)
        moe = WaveMoE(cfg, ep=ep, wave=WaveConfig(num_waves=W, backend="torch" if sends == "wave" else "symm",
                                                 sends=sends, fp8_rows=fp8_rows), dtype=torch.bfloat16)
        moe.load_full(random_full_weights(cfg, seed=5, scale=0.2))
        if fp8_rows:
            moe.quantize_fp8()
        x = _rows(64, cfg.hidden_size, seed=70 + ep.rank) / 64
        moe(x)
        return moe.traffic(x), sent[0]
    finally:
        tb._a2a = a2a


def test_counted_bytes_are_what_the_torch_backend_sends(ranks):
    """Over the ranks, the bytes the all-to-alls send to other ranks are the counted ones (a rank's count holds its
    rows out and their results back; what it sends holds its rows out and the results of the rows it received)."""
    for fp8_rows in (False, True):
        for W in (1, 4):
            res = ranks(2).run(_counted, W, "wave", fp8_rows)
            assert all(t["rows"] > 0 for t, _ in res)
            assert sum(sent for _, sent in res) == sum(t["bytes"] for t, _ in res), (fp8_rows, W, res)


def test_fp8_rows_halve_the_bytes_and_once_keeps_them_at_every_wave_count(ranks):
    tr = {(W, sends, f): ranks(3).run(_counted, W, sends, f)[0][0] for W in (1, 4) for sends in ("wave", "once")
          for f in (False, True)}
    # FP8 rows: values + scales + the 6 slots' (id, weight) against bf16 values + slots (D = 256 here; at V4's
    # 4096 the values alone are 0.516 x)
    r = tr[1, "wave", True]["dispatch_bytes"] / tr[1, "wave", False]["dispatch_bytes"]
    assert r == pytest.approx((2 * packed_width(256) + 48) / (2 * 256 + 48))
    for f in (False, True):
        assert tr[4, "once", f]["bytes"] <= 1.05 * tr[1, "once", f]["bytes"]
        assert tr[4, "wave", f]["bytes"] > 1.05 * tr[1, "wave", f]["bytes"]      # a row per wave: the count sees it


@needs_kernels
@pytest.mark.parametrize("fused_gate_up", [False, True])
def test_fused_stage_takes_fp8_rows_as_they_are(monkeypatch, fused_gate_up):
    """The fused stage's logic on CPU (DeepGEMM replaced by its psum semantics): packed rows go through
    gather_pairs (or, with the fused first GEMM, straight into it: no gather) and give the output of bf16 rows
    through quant_pairs, bit for bit; local rows included."""
    import moe_wave.fp8_expert_kernels as fk
    import moe_wave.fp8_experts as fx
    from moe_wave.comm.backend import Received
    from moe_wave.experts import expert_rows
    from moe_wave.fp8_experts import FP8RoutedExperts
    from tests.test_fp8_experts import _TorchDeepGEMM

    cfg = MoEConfig(hidden_size=256, intermediate_size=128, num_experts=4, top_k=3)
    ex = FP8RoutedExperts.from_dense(cfg, torch.randn(4, 256, 256) / 16, torch.randn(4, 256, 128) / 11)
    R, K = 40, 3
    ids, _, offs, _ = _pos(R, K, 4, 11)
    x, own = _rows(R, 256, seed=8), _rows(6, 256, seed=9)       # rows 20..25 live in own
    w = torch.rand(R, K)
    counts = torch.diff(offs, prepend=offs.new_zeros(1)).long()
    monkeypatch.setattr(fx, "_deep_gemm_grouped", lambda dev: _TorchDeepGEMM)
    monkeypatch.setattr(fx, "fp8_fused_ok", lambda x, e: True)
    monkeypatch.setattr(fx, "FUSED_GATE_UP_ROWS_PER_EXPERT", 10 ** 9 if fused_gate_up else 0)
    gathered = []
    real = fk.gather_pairs
    monkeypatch.setattr(fk, "gather_pairs", lambda *a, **k: gathered.append(1) or real(*a, **k))
    plain = expert_rows(Received(x, ids, w, None, counts, None, local=(20, own)), ex)
    got = expert_rows(Received(pack_rows(x), ids, w, None, counts, None, local=(20, pack_rows(own))), ex,
                      packed=True)
    assert bool(gathered) != fused_gate_up and got.dtype == torch.bfloat16
    assert torch.equal(got, plain)


@needs_kernels
@pytest.mark.parametrize("fused_gate_up", [False, True])
@pytest.mark.parametrize("sends", ["wave", "once"])
def test_fp8_block_on_its_own_stage_equals_the_per_expert_path(monkeypatch, sends, fused_gate_up):
    """A whole FP8 block (bf16 activations, FP8 rows, symm backend, W = 3) on the fused stage's logic (DeepGEMM
    replaced by its psum semantics, the Triton kernels interpreted; the first GEMM DeepGEMM's or the fused
    kernel's) against the per-expert path, with rows that cross once per layer (each wave's pairs summed into the
    rows' running sums: weighted_sum_once) and per wave."""
    import moe_wave.fp8_experts as fx
    from moe_wave.reference import random_full_weights
    from tests.test_fp8_experts import _TorchDeepGEMM, calc_diff

    wave = WaveConfig(num_waves=3, backend="symm", sends=sends, symm=SymmOptions(capacity=24))    # 23 tokens
    moe = WaveMoE(CFG, wave=wave, dtype=torch.bfloat16).quantize_fp8()
    moe.load_full(random_full_weights(CFG, seed=3, scale=0.2))
    x = _rows(23, 256, seed=12) / 64
    want = moe(x)
    monkeypatch.setattr(fx, "_deep_gemm_grouped", lambda dev: _TorchDeepGEMM)
    monkeypatch.setattr(fx, "fp8_fused_ok", lambda x, e: True)
    monkeypatch.setattr(fx, "FUSED_GATE_UP_ROWS_PER_EXPERT", 10 ** 9 if fused_gate_up else 0)
    _TorchDeepGEMM.calls = 0
    got = moe(x)
    assert _TorchDeepGEMM.calls == (1 if fused_gate_up else 2) * 3 and moe.plan.once == (sends == "once")
    # the same products; a row's partial sums round to bf16 between waves in either path, in another order with
    # rows once per layer: within rounding, where a wrong layout is off by 1e-3 or more
    assert calc_diff(got.float(), want.float()) < 5e-5
    assert torch.equal(got, moe(x, overlap=False))

"""FP8 experts on one GPU: DeepGEMM's fused stage against the per-expert reference, CUDA-graph replay against
eager, the same output at every wave count, and rows that travel as FP8 (``fp8_rows``: the pack kernel against
its twin, the block equal to bf16 rows bit for bit) (skips without a GPU; the DeepGEMM tests skip without
deep_gemm)."""

from __future__ import annotations

import pytest
import torch

from moe_wave import MoEConfig, WaveConfig, WaveMoE
from moe_wave.comm import EPGroup
from moe_wave.comm.options import SymmOptions
from moe_wave.reference import random_full_weights

pytestmark = pytest.mark.gpu

CFG = MoEConfig(hidden_size=512, intermediate_size=256, num_experts=16, top_k=4)


def _dg_ok() -> bool:
    from moe_wave.fp8_experts import fp8_gemm_grouped_library

    return torch.cuda.is_available() and fp8_gemm_grouped_library("cuda") == "deepgemm"


needs_dg = pytest.mark.skipif(not torch.cuda.is_available() or not _dg_ok(),
                              reason="needs a Hopper GPU with deep_gemm (launch/deepgemm.sh)")


def calc_diff(x, y) -> float:
    x, y = x.double(), y.double()
    den = (x * x + y * y).sum()
    return 0.0 if den == 0 else float(1 - 2 * (x * y).sum() / den)


def _moe(W: int, backend: str = "symm", seed: int = 4, fp8_rows: bool = True) -> WaveMoE:
    dev = torch.device("cuda")
    wave = WaveConfig(num_waves=W, backend=backend, symm=SymmOptions(capacity=512), fp8_rows=fp8_rows)
    moe = WaveMoE(CFG, ep=EPGroup.single(dev), wave=wave, device=dev, dtype=torch.bfloat16).quantize_fp8()
    moe.load_full({k: v.to(dev) for k, v in random_full_weights(CFG, seed=seed, scale=0.1).items()})
    return moe


def _x(T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, CFG.hidden_size, generator=g).to("cuda", torch.bfloat16)


@needs_dg
@pytest.mark.parametrize("T", [1, 5, 100, 300])
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_deepgemm_stage_matches_the_per_expert_reference(T, layout, monkeypatch):
    """The fused stage (aligned layout and psum GEMMs, or the masked layout and masked GEMMs; empty experts
    included at small T) against the same block with the per-expert FP8 path (fp8_matmul per expert), within
    DeepGEMM's FP8 GEMM bound."""
    import moe_wave.fp8_experts as fx

    moe = _moe(2)
    moe.experts.gemm_layout = layout
    x = _x(T, T)
    calls = []
    real = fx.fp8_fused_pairs
    monkeypatch.setattr(fx, "fp8_fused_pairs", lambda *a, **k: calls.append(1) or real(*a, **k))
    y = moe(x)
    assert calls, "the fused stage did not run"
    monkeypatch.setattr(fx, "fp8_fused_ok", lambda x, e: False)
    ref = moe(x)
    assert torch.isfinite(y).all()
    assert calc_diff(y.float(), ref.float()) < 1e-4, calc_diff(y.float(), ref.float())


@needs_dg
@pytest.mark.parametrize("small", [False, True])
def test_fused_gate_up_stage_matches_the_two_kernel_stage_and_replays(monkeypatch, small):
    """The first GEMM with SwiGLU + requant as one Triton kernel (gate_up_swiglu) in the stage, both layouts, on
    rows that arrived as FP8 (read where they are) and on bf16 rows (quantised into the layout): within
    DeepGEMM's FP8 GEMM bound of the stage with DeepGEMM's GEMM and swiglu_quant, the same bits on a second
    call, and replayed from a CUDA graph; with 128-row tiles and 64-row ones (``small``)."""
    import moe_wave.fp8_expert_kernels as fk
    import moe_wave.fp8_experts as fx

    monkeypatch.setattr(fx, "FUSED_SMALL_TILE_ROWS_PER_EXPERT", 10 ** 9 if small else 0)
    monkeypatch.setattr(fx, "GATE_UP_DG", False)     # the Triton kernel at 128-row tiles too (not gate_up_dg)
    calls = []
    real = fk.gate_up_swiglu
    monkeypatch.setattr(fk, "gate_up_swiglu", lambda *a, **k: calls.append(1) or real(*a, **k))
    for layout, fp8_rows in (("masked", True), ("contiguous", True), ("masked", False), ("contiguous", False)):
        moe = _moe(2, fp8_rows=fp8_rows)
        moe.experts.gemm_layout = layout
        x = _x(128, 12)
        monkeypatch.setattr(fx, "FUSED_GATE_UP_ROWS_PER_EXPERT", 0)
        ref = moe(x)
        assert not calls
        monkeypatch.setattr(fx, "FUSED_GATE_UP_ROWS_PER_EXPERT", 10 ** 9)
        y = moe(x)
        case = (layout, fp8_rows)
        assert len(calls) == 2, (case, calls)        # one a wave
        assert torch.isfinite(y).all() and calc_diff(y.float(), ref.float()) < 1e-4, case
        assert torch.equal(moe(x), y), case
        moe.capture_graphs([128])
        assert torch.equal(moe(x), y), case
        calls.clear()


@needs_dg
def test_graph_replay_equals_eager_and_waves_agree():
    """Replayed from a CUDA graph (changing tokens and routing) == eager, bit for bit; W = 1..4 and pipelined vs
    serial give the same output (a row's expert products do not depend on the other rows)."""
    outs = {}
    x = _x(200, 7)
    for W in (1, 2, 3, 4):
        moe = _moe(W)
        y = moe(x)
        assert torch.equal(y, moe(x, overlap=False)), f"W={W}: pipelined != serial"
        outs[W] = y
    for W in (2, 3, 4):   # DeepGEMM picks its tiles by the rows of a call: a row's sums may round differently
        d = calc_diff(outs[W].float(), outs[1].float())
        assert d < 1e-5, f"W={W} differs from W=1 beyond rounding (calc_diff {d})"
    moe = _moe(2)
    moe.capture_graphs([64, 256])
    for T, seed in ((200, 7), (40, 8), (256, 9), (3, 10)):
        xs = _x(T, seed)
        got = moe(xs).clone()
        g, moe.graphs = moe.graphs, None
        b = 64 if T <= 64 else 256            # eager on the bucket's padded input: the same GEMM shapes as the replay
        xp = torch.zeros(b, CFG.hidden_size, device=xs.device, dtype=xs.dtype)
        xp[:T] = xs
        want = moe(xp, num_valid=torch.full((), T, dtype=torch.int64, device=xs.device))[:T]
        moe.graphs = g
        assert torch.equal(got, want), f"T={T}: replay != eager"


def test_fp8_block_runs_on_any_gpu_against_bf16():
    """Wherever it runs (DeepGEMM or the per-expert products), the FP8 block stays within the bound of its bf16
    twin's output that the CPU tests state (three times DeepGEMM's one-GEMM 1e-3)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    dev = torch.device("cuda")
    full = {k: v.to(dev) for k, v in random_full_weights(CFG, seed=4, scale=0.1).items()}
    dense = WaveMoE(CFG, ep=EPGroup.single(dev), wave=WaveConfig(num_waves=2, backend="torch"), device=dev,
                    dtype=torch.bfloat16)
    dense.load_full(full)
    fp8 = _moe(2, backend="torch")
    x = _x(150, 3)
    d = calc_diff(fp8(x).float(), dense(x).float())
    assert 1e-8 < d < 3e-3, d


def test_pack_kernel_equals_its_twin_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from moe_wave.fp8_rows import pack_rows, unpack_rows

    x = (torch.randn(333, 4096, device="cuda") * torch.logspace(-3, 3, 4096, device="cuda")).to(torch.bfloat16)
    x[5] = 0
    (q, s), (qt, st) = unpack_rows(pack_rows(x), 4096), unpack_rows(pack_rows(x, kernels=False), 4096)
    assert torch.equal(q.view(torch.uint8), qt.view(torch.uint8)) and torch.equal(s, st)


@needs_dg
def test_rows_once_per_layer_on_deepgemm_match_rows_per_wave():
    """sends="once" (a row crosses once, each wave adds its pairs to the row's running sum) on DeepGEMM's stage
    against sends="wave", W = 3: the same products, summed over the waves in another order (bf16 partial sums)."""
    x = _x(200, 12)
    ys = []
    for sends in ("wave", "once"):
        dev = torch.device("cuda")
        wave = WaveConfig(num_waves=3, backend="symm", sends=sends, symm=SymmOptions(capacity=512))
        moe = WaveMoE(CFG, ep=EPGroup.single(dev), wave=wave, device=dev, dtype=torch.bfloat16).quantize_fp8()
        moe.load_full({k: v.to(dev) for k, v in random_full_weights(CFG, seed=4, scale=0.1).items()})
        ys.append(moe(x))
        assert torch.equal(ys[-1], moe(x, overlap=False))
    assert calc_diff(ys[1].float(), ys[0].float()) < 1e-4


@needs_dg
@pytest.mark.parametrize("backend", ["symm", "torch"])
@pytest.mark.parametrize("fused_gate_up", [True, False])
def test_fp8_rows_equal_bf16_rows_bit_for_bit(backend, fused_gate_up, monkeypatch):
    """The block whose rows travel as FP8 (packed before dispatch; read where they arrived by the fused first GEMM,
    or copied into the layout by gather_pairs before DeepGEMM's) gives the output of the block that quantises bf16
    rows at the expert stage, bit for bit (the same q and scales into the same GEMMs); graph replay too."""
    import moe_wave.fp8_expert_kernels as fk
    import moe_wave.fp8_experts as fx

    monkeypatch.setattr(fx, "FUSED_GATE_UP_ROWS_PER_EXPERT", 10 ** 9 if fused_gate_up else 0)
    monkeypatch.setattr(fx, "GATE_UP_DG", False)     # the Triton kernel or the DeepGEMM way (gate_up_dg: its tests)
    x = _x(300, 11)
    packed, plain = _moe(2, backend), _moe(2, backend, fp8_rows=False)
    gathered = []
    real = fk.gather_pairs
    monkeypatch.setattr(fk, "gather_pairs", lambda *a, **k: gathered.append(1) or real(*a, **k))
    y = packed(x)
    assert bool(gathered) != fused_gate_up, "the packed rows took the wrong way into the first GEMM"
    assert torch.equal(y, plain(x))
    if backend == "symm":
        packed.capture_graphs([512])
        plain.capture_graphs([512])
        assert torch.equal(packed(x), plain(x))

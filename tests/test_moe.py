"""WaveMoE against transformers 5.23's DeepseekV4SparseMoeBlock.

Tiny config, fp32, the zero-initialised parameters randomised. Every rank builds the same HF
model from the same seed, runs the oracle on its own tokens, and compares WaveMoE built with
``from_hf`` (its own experts only) over every schedule variant.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from moe_wave import MoEConfig, WaveConfig, WaveMoE
from moe_wave.comm import EPGroup
from moe_wave.comm.triton_gate import triton_ok

E = 12          # divisible by 1, 2 and 3 ranks
TOKENS = [19, 7, 11]


def hf_model(seed: int = 0):
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    torch.manual_seed(seed)
    cfg = DeepseekV4Config(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=1, head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_groups=2,
                           o_lora_rank=16, n_routed_experts=E, num_experts_per_tok=3, n_shared_experts=1,
                           moe_intermediate_size=32, num_hash_layers=1, routed_scaling_factor=1.5,
                           swiglu_limit=10.0, compress_ratios=[0, 4], experts_implementation="eager")
    blocks = []
    for layer in range(2):
        b = DeepseekV4SparseMoeBlock(cfg, layer).eval()
        with torch.no_grad():
            for p in b.parameters():
                p.normal_(0, 0.3)
            g = b.gate
            if hasattr(g, "tid2eid"):
                g.tid2eid.copy_(torch.stack([torch.randperm(E)[:3] for _ in range(cfg.vocab_size)]))
            else:
                g.e_score_correction_bias.normal_(0, 0.1)
        blocks.append(b)
    return cfg, blocks


def _tokens(rank: int, T: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed + rank)
    return torch.randn(T, 64, generator=g) * 2, torch.randint(0, 64, (T,), generator=g)


VARIANTS = list(itertools.product([1, 2, 3, 7], ["experts", "tokens"], [True, False], ["bubbles", "serial"]))


def _parity(ep: EPGroup, tokens: list, variants=VARIANTS, bias_boost: dict | None = None, wave_kw: dict | None = None,
            vs_serial: bool = False):
    """Per layer and variant (W, partition, overlap, placement): (..., the error against HF's block) and, with
    ``vs_serial``, whether the output equals the serial schedule's bit for bit. ``wave_kw``: more WaveConfig
    fields."""
    cfg, blocks = hf_model()
    x, ids = _tokens(ep.rank, tokens[ep.rank])
    out = []
    for layer, hf in enumerate(blocks):
        if bias_boost and not hasattr(hf.gate, "tid2eid"):
            with torch.no_grad():
                for ex, v in bias_boost.items():
                    hf.gate.e_score_correction_bias[ex] += v
        with torch.no_grad():
            ref = hf(x[None], input_ids=ids[None])[0] if x.shape[0] else x.clone()
        for W, part, ov, placement in variants:
            wave = WaveConfig(num_waves=W, partition=part, overlap=ov, shared_placement=placement,
                              shared_tail_chunks=1 if placement == "bubbles" else 0, **(wave_kw or {}))
            moe = WaveMoE.from_hf(hf, cfg, ep=ep, wave=wave, layer_idx=layer)
            y = moe(x, input_ids=ids)
            err = float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-6)) if x.shape[0] else float(y.numel())
            row = (layer, W, part, ov, placement, err)
            out.append(row + (torch.equal(y, moe(x, input_ids=ids, overlap=False)),) if vs_serial else row)
    return out


def _assert_close(results, n_variants):
    for rank, rows in enumerate(results):
        assert len(rows) == 2 * n_variants
        bad = [r for r in rows if not r[-1] <= 2e-6]
        assert not bad, f"rank {rank}: {bad[:5]}"


@pytest.mark.parametrize("P", [1, 2, 3])
def test_wavemoe_matches_hf(ranks, P):
    if P == 1:
        _assert_close([_parity(EPGroup.single(), TOKENS)], len(VARIANTS))
    else:
        _assert_close(ranks(P).run(_parity, TOKENS), len(VARIANTS))


FEW = [(2, "experts", True, "bubbles"), (3, "tokens", False, "serial")]


def test_imbalanced_all_to_one_rank(ranks):
    """Top-k layer: a huge bias on rank 0's experts sends every token there."""
    _assert_close(ranks(2).run(_parity, TOKENS, FEW, {ex: 50.0 for ex in range(6)}), len(FEW))


def test_imbalanced_one_hot_expert(ranks):
    _assert_close(ranks(3).run(_parity, TOKENS, FEW, {7: 50.0}), len(FEW))


def test_rank_with_zero_tokens(ranks):
    _assert_close(ranks(2).run(_parity, [13, 0], FEW), len(FEW))


def test_grouped_mm_path_matches_loop():
    cfg, blocks = hf_model()
    x, ids = _tokens(0, 23)
    a = WaveMoE.from_hf(blocks[1], cfg, wave=WaveConfig(num_waves=2, grouped_mm="on"), layer_idx=1)
    b = WaveMoE.from_hf(blocks[1], cfg, wave=WaveConfig(num_waves=2, grouped_mm="off"), layer_idx=1)
    try:
        ya = a(x)
    except (RuntimeError, NotImplementedError) as e:   # torch builds without a CPU grouped GEMM
        pytest.skip(f"torch._grouped_mm unavailable on CPU here: {e}")
    torch.testing.assert_close(ya, b(x), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ bad input
@pytest.fixture(scope="module")
def hf():
    return hf_model()


def test_bad_hidden_size_and_dtype(hf):
    cfg, blocks = hf
    moe = WaveMoE.from_hf(blocks[1], cfg, layer_idx=1)
    with pytest.raises(ValueError, match=r"x.shape\[-1\]=32: must equal hidden_size=64"):
        moe(torch.randn(4, 32))
    with pytest.raises(ValueError, match=r"x.dtype=torch.float64: must equal the parameter dtype torch.float32"):
        moe(torch.randn(4, 64, dtype=torch.float64))


def test_hash_layer_needs_input_ids(hf):
    cfg, blocks = hf
    moe = WaveMoE.from_hf(blocks[0], cfg, layer_idx=0)
    with pytest.raises(ValueError, match=r"input_ids=None: this is a hash-routed layer"):
        moe(torch.randn(4, 64))


def test_num_waves_below_one():
    with pytest.raises(ValueError, match=r"WaveConfig.num_waves=0: must be an int >= 1 or 'auto'"):
        WaveConfig(num_waves=0)
    with pytest.raises(ValueError, match=r"WaveConfig.partition='rows'"):
        WaveConfig(partition="rows")
    with pytest.raises(ValueError, match=r"WaveConfig.expert_streams=0: must be an int in \[1, 4\]"):
        WaveConfig(expert_streams=0)


def _nan_rows(ep: EPGroup):
    cfg, blocks = hf_model()
    x, ids = _tokens(ep.rank, 10)
    moe = WaveMoE.from_hf(blocks[1], cfg, ep=ep, wave=WaveConfig(num_waves=2), layer_idx=1)
    clean = moe(x, input_ids=ids)
    x = x.clone()
    x[3] = float("nan")
    y = moe(x, input_ids=ids)
    others = [i for i in range(10) if i != 3]
    # other rows: no NaN, and the same values up to GEMM batching (the NaN row changes the batches)
    return (bool(torch.isnan(y[3]).all()), bool(not torch.isnan(y[others]).any()
            and torch.allclose(y[others], clean[others], rtol=1e-5, atol=1e-5)))


def test_nan_rows_stay_in_their_rows(ranks):
    for row_nan, others_equal in ranks(2).run(_nan_rows):
        assert row_nan and others_equal


def _mismatched_experts(ep: EPGroup):
    cfg = MoEConfig.preset("tiny", num_experts=8 if ep.rank == 0 else 12)
    try:
        WaveMoE(cfg, ep=ep)
    except ValueError as e:
        return str(e)
    return "no error"


def test_expert_count_mismatch_detected_at_setup(ranks):
    for msg in ranks(2).run(_mismatched_experts):
        assert "MoE shape (hidden, intermediate, num_experts, top_k): rank 0 (128, 128, 8, 2), rank 1 (128, 128, 12, 2)" \
            in msg, msg


# ------------------------------------------------------------------------------------------ expert kernels
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not triton_ok(DEVICE, want=True),
                                   reason="Triton cannot run here (not installed, or CPU without TRITON_INTERPRET=1)")
KERNEL_CASES = [(7, 3, 37, 20, 11), (5, 2, 1030, 6, 10), (4, 2, 8, 4, 0), (3, 2, 5, 3, 6),
                (70, 3, 1030, 6, 150)]   # R, K, D, I, n (70 rows x 2 channel blocks: past the CPU grid cap of 64)


def _gen(case) -> torch.Generator:
    return torch.Generator().manual_seed(sum(case))


@needs_kernels
@pytest.mark.parametrize("R, K, D, I, n", KERNEL_CASES)
def test_gather_rows_matches_torch(R, K, D, I, n):
    """Rows past n are skipped; rows that ``local`` holds are read there, never from x (poisoned here)."""
    from moe_wave.expert_kernels import gather_rows, gather_rows_torch

    g, J = _gen((R, K, D, n)), R * K
    nt = torch.tensor([n], dtype=torch.int32)
    x = torch.randn(R, D, generator=g)
    src = torch.randint(0, R, (J,), generator=g)
    dev = lambda *ts: [t.to(DEVICE) for t in ts]  # noqa: E731
    a = gather_rows(*dev(x, src, nt)).cpu()
    b = gather_rows_torch(x, src, nt, torch.full((J, D), 7.0))
    assert torch.equal(a[:n], b[:n])
    loc = torch.randn(3, D, generator=g)
    xp = x.clone()
    xp[1:4] = float("nan")
    a = gather_rows(*dev(xp, src, nt), (1, loc.to(DEVICE))).cpu()
    b = gather_rows_torch(xp, src, nt, torch.full((J, D), 7.0), (1, loc))
    want = torch.where(((src >= 1) & (src < 4))[:, None], loc[(src - 1).clamp(0, 2)], x[src])
    assert torch.equal(a[:n], b[:n]) and torch.equal(a[:n], want[:n]) and not a[:n].isnan().any()


@needs_kernels
@pytest.mark.parametrize("R, K, D, I, n", KERNEL_CASES)
@pytest.mark.parametrize("limit", [0.0, 1.5])
def test_swiglu_rows_matches_torch(R, K, D, I, n, limit):
    from moe_wave.expert_kernels import swiglu_rows, swiglu_rows_torch

    g, J = _gen((R, K, I, n)), R * K
    nt = torch.tensor([n], dtype=torch.int32)
    gu = torch.randn(J, 2 * I, generator=g) * 3
    a = swiglu_rows(gu.to(DEVICE), limit, nt.to(DEVICE), torch.float32).cpu()
    b = swiglu_rows_torch(gu, limit, nt, torch.empty(J, I))
    torch.testing.assert_close(a[:n], b[:n], rtol=1e-5, atol=1e-6)
    if limit and n:
        assert float(b[:n].abs().max()) <= limit * limit, "gate and up are clamped"


@needs_kernels
def test_weighted_sum_grid_splits_channels_only_where_the_rows_are_few():
    """The weighted sums take a program per (row, block of channels) where that fits the row programs' cap (64 on
    CPU) and a program per row, capped, elsewhere: the cases of KERNEL_CASES run both forms."""
    from moe_wave.expert_kernels import _wsum_grid

    cpu = torch.device("cpu")
    assert _wsum_grid(5, 1030, 1024, cpu) == ((5, 2), True)
    assert _wsum_grid(32, 1030, 1024, cpu) == ((32, 2), True)
    assert _wsum_grid(33, 1030, 1024, cpu) == ((33, 1), False)
    assert _wsum_grid(70, 1030, 1024, cpu) == ((64, 1), False)


@needs_kernels
@pytest.mark.parametrize("R, K, D, I, n", KERNEL_CASES)
def test_weighted_sum_matches_torch(R, K, D, I, n):
    """Pairs at positions >= n do not count; a row with none sums to 0, a row with one does not; a row with a
    pair at LOST (no room in its group) is NaN, whatever its other pairs."""
    from moe_wave.expert_kernels import LOST, weighted_sum, weighted_sum_torch

    g, J = _gen((R, K, D, n)), R * K
    nt = torch.tensor([n], dtype=torch.int32)
    out = torch.randn(J, D, generator=g)
    pos = torch.randperm(J, generator=g).view(R, K)
    pos[R // 2, K - 1] = LOST
    w = torch.rand(R, K, generator=g)
    a = weighted_sum(out.to(DEVICE), pos.to(DEVICE), w.to(DEVICE), nt.to(DEVICE), torch.float32).cpu()
    b = weighted_sum_torch(out, pos, w, nt, torch.float32)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, equal_nan=True)
    lost = (pos == LOST).any(1)
    assert a[lost].isnan().all() and not a[~lost].isnan().any()
    none = (pos >= n).all(1)
    assert torch.equal(a[none], torch.zeros_like(a[none]))
    real = ((pos >= 0) & (pos < n)).any(1) & ~lost
    if real.any():
        assert not torch.equal(a[int(real.nonzero()[0])], torch.zeros(D))

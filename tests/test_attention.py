"""V4Attention against transformers 5.23's DeepseekV4Attention (fp32, CPU, tiny config of spec 7.1).

Also: cache paths (prefill + decode, chunked prefill) equal the full pass, the overlap switch, the
sparse core against a dense reference, and bad input.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4Config, DeepseekV4Model  # noqa: E402
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402

from moe_wave import attention as A  # noqa: E402
from moe_wave.attention.sparse_core import sparse_attention  # noqa: E402
from moe_wave.attention.rope import inv_freq, rope_config_from_hf  # noqa: E402
from moe_wave.comm.triton_gate import triton_ok  # noqa: E402

LAYERS = [0, 1, 2]  # sliding, CSA (c4 + indexer), HCA (ratio 8 here)
B, S = 2, 24


def tiny_hf(seed: int = 0, std: float = 0.15):
    """The spec 7.1 tiny config with the zero-initialised parameters randomised."""
    torch.manual_seed(seed)
    cfg = DeepseekV4Config(
        vocab_size=64, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
        compress_ratios=[0, 4, 128],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        index_n_heads=8, index_head_dim=16, index_topk=3,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        num_hash_layers=1, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0,
        hc_mult=2, hc_sinkhorn_iters=3,
        rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 64, "beta_fast": 32,
                      "beta_slow": 1},
        max_position_embeddings=256, attn_implementation="eager", experts_implementation="eager")
    model = DeepseekV4Model(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("sinks", "position_bias", "attn_hc.base", "ffn_hc.base")):
                p.normal_(0, 0.5)
            elif p.dim() >= 2:
                p.normal_(0, std)
        for layer in model.layers:
            g = layer.mlp.gate
            if hasattr(g, "e_score_correction_bias"):
                g.e_score_correction_bias.normal_(0, 0.1)
            if hasattr(g, "tid2eid"):
                g.tid2eid.copy_(torch.stack([torch.randperm(8)[:2] for _ in range(cfg.vocab_size)]))
    return cfg, model


def hf_kwargs(model, cfg, x_BS, S_):
    """position_embeddings / position_ids / attention_mask for HF's layer forwards (no cache)."""
    pos = torch.arange(S_).unsqueeze(0).expand(x_BS.shape[0], -1)
    pe = {k: model.rotary_emb(x_BS, position_ids=pos, layer_type=k) for k in ("main", "compress")}
    mask = create_sliding_window_causal_mask(config=cfg, inputs_embeds=x_BS, attention_mask=None,
                                             past_key_values=None, position_ids=pos)
    return dict(position_embeddings=pe, position_ids=pos, attention_mask=mask)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def hf():
    cfg, model = tiny_hf()
    x = torch.randn(B, S, cfg.hidden_size)
    kw = hf_kwargs(model, cfg, x, S)
    refs = []
    with torch.no_grad():
        for i in LAYERS:
            refs.append(model.layers[i].self_attn(hidden_states=x, past_key_values=None, **kw)[0])
    attns = [A.V4Attention.from_hf(model.layers[i].self_attn, cfg, layer_idx=i) for i in LAYERS]
    return dict(cfg=cfg, model=model, x=x, pos=kw["position_ids"], refs=refs, attns=attns)


def test_inv_freq_matches_hf(hf):
    rot = hf["model"].rotary_emb
    for lt, key in (("sliding_attention", "main"), ("heavily_compressed_attention", "compress")):
        torch.testing.assert_close(inv_freq(rope_config_from_hf(hf["cfg"], lt)), getattr(rot, f"{key}_inv_freq"),
                                   rtol=0, atol=0)


def test_rope_frequencies_stay_fp32_through_casts(hf):
    """``.to(bf16)`` casts the layer's parameters and buffers, but its RoPE frequencies stay the fp32 values (as the
    official code keeps them; in bf16 a frequency is off by up to 2^-9 of itself, which at position 4096 moves an
    angle by radians), and ``.double()`` / ``.half()`` keep them fp32 too."""
    attn = A.V4Attention.from_hf(hf["model"].layers[1].self_attn, hf["cfg"], layer_idx=1)
    want = inv_freq(attn.cfg.rope)
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.double(), lambda m: m.half(), lambda m: m.float()):
        attn = cast(attn)
        assert attn.freq_F.dtype == torch.float32 and torch.equal(attn.freq_F, want)
    assert attn.sinks.dtype == torch.float32 and attn.q_a_norm.dtype == torch.float32      # the rest was cast
    bf = attn.to(torch.bfloat16)
    assert bf.sinks.dtype == torch.bfloat16 and torch.equal(bf.freq_F, want)
    # why: with V4's 64 rotated channels (theta 1e4), bf16 frequencies put some pair's angle more than a radian off
    # at position 4096
    from moe_wave.attention.rope import RopeConfig
    v4 = inv_freq(RopeConfig(dim=64, theta=10000.0))
    assert (4096 * (v4 - v4.bfloat16().float())).abs().max() > 1.0


# "on": the fused Triton kernels, on CPU under the interpreter that tests/conftest.py turns on
KERNELS = ["off", pytest.param("on", marks=pytest.mark.skipif(
    not triton_ok("cuda" if torch.cuda.is_available() else "cpu", want=True),
    reason="Triton cannot run here (not installed, or CPU without TRITON_INTERPRET=1)"))]


def _attn(hf, i, kernels):
    if kernels == "off":
        return hf["attns"][i]
    return A.V4Attention.from_hf(hf["model"].layers[i].self_attn, hf["cfg"], layer_idx=i,
                                 schedule=A.ScheduleConfig(kernels=kernels))


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("i", LAYERS)
def test_attention_matches_hf(hf, i, kernels):
    attn = _attn(hf, i, kernels)
    assert attn.cfg.layer_type == hf["cfg"].layer_types[i]
    assert attn.cfg.ratio == [0, 4, 8][i]  # read from the HF module, not hard-coded
    with torch.no_grad():
        out = attn(hf["x"], positions=hf["pos"])
    assert out.shape == (B, S, hf["cfg"].hidden_size)
    assert rel(out, hf["refs"][i]) < 2e-6


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("i", LAYERS)
def test_prefill_then_decode_matches_full(hf, i, kernels):
    attn, x, pos = _attn(hf, i, kernels), hf["x"], hf["pos"]
    cache = attn.new_cache(B, 32)
    with torch.no_grad():
        outs = [attn(x[:, :10], positions=pos[:, :10], cache=cache)]
        outs += [attn(x[:, t:t + 1], positions=pos[:, t:t + 1], cache=cache) for t in range(10, S)]
    assert cache.length_B.tolist() == [S, S]
    assert rel(torch.cat(outs, 1), hf["refs"][i]) < 2e-6


@pytest.mark.parametrize("i", LAYERS)
@pytest.mark.parametrize("chunks", [(10, 7, 7), (3, 1, 12, 8)])
def test_chunked_prefill_matches_full(hf, i, chunks):
    attn, x, pos = hf["attns"][i], hf["x"], hf["pos"]
    cache = attn.new_cache(B, S)  # exactly full at the end
    outs, s0 = [], 0
    with torch.no_grad():
        for n in chunks:
            outs.append(attn(x[:, s0:s0 + n], positions=pos[:, s0:s0 + n], cache=cache))
            s0 += n
    assert rel(torch.cat(outs, 1), hf["refs"][i]) < 2e-6


@pytest.mark.parametrize("i", LAYERS)
def test_overlap_on_off_identical(hf, i):
    attn, x, pos = hf["attns"][i], hf["x"], hf["pos"]
    with torch.no_grad():
        on = attn(x, positions=pos, overlap=True)
        off = attn(x, positions=pos, overlap=False)
    assert torch.equal(on, off)


def test_overlap_switches(monkeypatch):
    monkeypatch.setenv("MOE_WAVE_ATTN_OVERLAP", "0")   # read by the CLI only (moe_wave.env), never here
    assert A.ScheduleConfig().overlap is True and A.ScheduleConfig().kernels == "auto"
    assert A.ScheduleConfig(overlap=False).overlap is False
    cfg = A.ScheduleConfig(decode_overlap_min_batch=8)
    assert cfg.overlap is True
    assert cfg.use_overlap(batch=4, seq=1) is False      # small decode batch: serial
    assert cfg.use_overlap(batch=8, seq=1) is True
    assert cfg.use_overlap(batch=1, seq=512) is True     # prefill keeps overlap
    with pytest.raises(ValueError, match="decode_overlap_min_batch"):
        A.ScheduleConfig(decode_overlap_min_batch=-1)
    with pytest.raises(ValueError, match=r"ScheduleConfig.kernels='1': must be one of \('auto', 'on', 'off'\)"):
        A.ScheduleConfig(kernels="1")
    with pytest.raises(ValueError, match=r"ScheduleConfig.overlap='0': must be True or False"):
        A.ScheduleConfig(overlap="0")


@pytest.mark.parametrize("i", LAYERS)
def test_core_takes_a_raw_q(hf, i, monkeypatch):
    """Where the core's kernel normalises q itself (Hopper prefill) the front-end hands it q raw
    (``FrontEnd.q_raw``). Every other path must then do the norm and RoPE before the core: the torch core here gives
    the bits of the layer's own q branch, and the layer with the front-end forced raw still matches HF."""
    from moe_wave.attention import schedule
    attn, x, pos = hf["attns"][i], hf["x"], hf["pos"]
    with torch.no_grad():
        fe = schedule.run_frontend(attn, x, pos, attn.new_cache(B, S), False)
        assert not fe.q_raw and not attn.core_norms_q(fe.q_BSHd)            # CPU: on the q branch
        raw = attn.q_heads(attn.q_lora(x), pos, raw=True)
        assert not torch.equal(raw, fe.q_BSHd)
        got = attn.core(schedule.FrontEnd(q_BSHd=raw, parts=fe.parts, q_raw=True), pos)
        assert torch.equal(got, attn.core(fe, pos))
        monkeypatch.setattr(A.V4Attention, "core_norms_q", lambda self, q: True)
        assert rel(attn(x, positions=pos), hf["refs"][i]) < 2e-6


def test_query_blocks_match_one_block(hf):
    """q_block bounds prefill memory; blocking must not change the result."""
    a = A.V4Attention.from_hf(hf["model"].layers[1].self_attn, hf["cfg"], layer_idx=1,
                              schedule=A.ScheduleConfig(q_block=5))
    with torch.no_grad():
        out = a(hf["x"], positions=hf["pos"])
    assert rel(out, hf["refs"][1]) < 2e-6


def test_sparse_core_matches_dense():
    torch.manual_seed(1)
    Bc, Sc, H, d, M = 2, 5, 3, 8, 7
    q, kv, sinks = torch.randn(Bc, Sc, H, d), torch.randn(Bc, M, d), torch.randn(H)
    idx = torch.randint(-1, M, (Bc, Sc, 4))
    idx[0, 0] = -1                                        # a query with nothing to attend to
    out = sparse_attention(q, [(kv, idx[..., :2]), (kv, idx[..., 2:])], sinks, d ** -0.5)
    for b in range(Bc):
        for s in range(Sc):
            keep = idx[b, s][idx[b, s] >= 0]
            logit = torch.cat([(q[b, s] @ kv[b, keep].T) * d ** -0.5, sinks[:, None]], dim=-1)
            ref = logit.softmax(-1)[:, :-1] @ kv[b, keep]
            torch.testing.assert_close(out[b, s], ref, rtol=1e-5, atol=1e-6)
    assert out[0, 0].abs().max() == 0


def test_indexer_marks_invisible_with_minus_one(hf):
    attn = hf["attns"][1]
    cache = attn.new_cache(B, S)
    with torch.no_grad():
        attn(hf["x"], positions=hf["pos"], cache=cache)
        ix = attn.indexer
        qr = attn.q_lora(hf["x"])
        idx = ix.select(ix.query(qr, hf["pos"], attn.freq_F), ix.weights(hf["x"]), cache.index.entries_BNd,
                        hf["pos"], cache.index.num_slots)
    assert idx.shape == (B, S, 3)
    assert (idx[:, :3] == -1).all()                       # no window of 4 complete before position 3
    vis = (hf["pos"] + 1) // 4
    assert ((idx < vis[..., None]) | (idx == -1)).all()
    assert ((idx >= 0).sum(-1) == vis.clamp(max=3)).all()


def test_bad_input(hf):
    attn, x, pos = hf["attns"][0], hf["x"], hf["pos"]
    with pytest.raises(ValueError, match=r"x.shape=.*hidden=64"):
        attn(torch.randn(B, S, 48), positions=pos)
    with pytest.raises(ValueError, match=r"positions.shape"):
        attn(x, positions=pos[:, :5])
    with pytest.raises(ValueError, match=r"positions\[0\]=.*must be cache.length\[0\]"):
        attn(x, positions=pos + 1)                        # no cache: rows start at 0
    cache = attn.new_cache(B, 16)
    with torch.no_grad():
        attn(x[:, :4], positions=pos[:, :4], cache=cache)
        with pytest.raises(ValueError, match=r"positions\[1\]=.*4..5"):
            attn(x[:, :2], positions=torch.tensor([[4, 5], [5, 6]]), cache=cache)
        with pytest.raises(ValueError, match=r"sequence length 24 .*max_len=16"):
            attn(x[:, 4:], positions=pos[:, 4:], cache=cache)
        with pytest.raises(ValueError, match=r"batch=1: must equal the cache batch 2"):
            attn(x[:1, 4:5], positions=pos[:1, 4:5], cache=cache)
    with pytest.raises(ValueError, match=r"AttnCache max_len=0"):
        attn.new_cache(B, 0)
    with pytest.raises(ValueError, match=r"ScheduleConfig.q_block=0"):
        A.ScheduleConfig(q_block=0)

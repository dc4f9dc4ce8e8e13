"""The sparse core's optional fusions (``sparse_core.sparse_attention`` q_rope / o_rope / out_fp8) against the
unfused chain they replace: ``norm_rope(q)`` then the core, and the core then ``rope_tail(o, inverse)`` then
``fp8.act_quant_torch``. On a GPU, or on CPU under Triton's interpreter (tests/conftest.py turns it on for GPU-less
runs; tiny shapes: the interpreter is slow).

The epilogue must give the unfused chain's bits exactly: it rounds where the chain rounds (output to q's dtype, the
inverse rope in fp32 from those values and rounded again, then the 1 x 128 quantisation with exact power-of-two
scales). The chain's rope is ``norm_rope``'s Triton kernel wherever Triton runs (as in the attention layer), so both
sides round their bf16 the same way (the interpreter truncates fp32 -> bf16, a GPU rounds to nearest even) and take
cos / sin from the same implementation. The prologue is compared with a tolerance: its per-head sum of squares is one
reduction over the whole q tile (or the kernel's chunks), ``norm_rope``'s is the head channels plus the tail, so the
1/rms may differ in the last fp32 bit and a q element by one bf16 ulp.
"""

from __future__ import annotations

import zlib
from dataclasses import replace

import pytest
import torch

from moe_wave.attention.sparse_core import sparse_attention
from moe_wave.attention.sparse_core import FALLBACKS, CoreConfig, sparse_attention_fused
from moe_wave.attention.kernels import norm_rope, norm_rope_torch
from moe_wave.comm.triton_gate import triton_ok
from moe_wave.fp8 import act_quant_torch, dequant_act

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not triton_ok(DEVICE, want=True),
                                   reason="Triton cannot run here (not installed, or CPU without TRITON_INTERPRET=1)")
EPS = 1e-6


def rel(a, b):
    return ((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm()).item()


def _case(B, S, H, D, F, parts_spec, dtype, key):
    """Raw queries (q_b-like scale), sources, picks ("random": -1 scattered; "tail": valid then -1), query (0, 0)
    with every pick masked, positions and frequencies of a 2F-channel rope tail; on DEVICE."""
    g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    q = (torch.randn(B, S, H, D, generator=g) * 3 + 0.5).to(dtype)
    parts = []
    for M, J, how in parts_spec:
        kv = torch.randn(B, M, D, generator=g).to(dtype)
        idx = torch.randint(-1 if how == "random" else 0, M, (B, S, J), generator=g)
        if how == "tail":
            keep = torch.randint(0, J + 1, (B, S, 1), generator=g)
            idx = torch.where(torch.arange(J) < keep, idx, torch.full_like(idx, -1))
        idx[0, 0] = -1
        parts.append((kv.to(DEVICE), idx.to(DEVICE)))
    sinks = torch.randn(H, generator=g).to(DEVICE)
    pos = torch.randint(0, 40000, (B, S), generator=g).to(DEVICE)
    freq = (10000.0 ** -(torch.arange(F) / F)).to(DEVICE)
    return q.to(DEVICE), parts, sinks, pos, freq


# name: B, S, H, D, F, parts, dtype, config (None: default_config). S = 3 or 5: not a multiple of any tile.
CASES = {
    "bf16 q in one dot, two parts": (2, 3, 8, 128, 32, [(40, 24, "tail"), (9, 7, "random")], torch.bfloat16, None),
    "bf16 one part, 12 heads": (2, 3, 12, 128, 32, [(30, 20, "random")], torch.bfloat16, None),
    "bf16 QK in chunks, 2 value blocks": (2, 3, 4, 256, 32, [(40, 24, "random"), (9, 7, "tail")], torch.bfloat16,
                                          CoreConfig(block_h=16, block_n=16, block_dk=64, block_dv=128)),
    "fp32 QK in chunks, 2 value blocks": (2, 5, 4, 256, 32, [(30, 20, "random"), (9, 6, "random")], torch.float32,
                                          None),
    "bf16 split keys (combine)": (2, 3, 8, 128, 32, [(40, 40, "random"), (9, 7, "random")], torch.bfloat16,
                                  CoreConfig(split_k=2)),
    "fp32 split keys, 2 value blocks": (2, 3, 4, 256, 32, [(40, 40, "tail")], torch.float32,
                                        replace(FALLBACKS[3], split_k=2)),
}


@needs_kernels
@pytest.mark.parametrize("name", list(CASES))
def test_prologue_is_norm_rope_then_core(name):
    """q_rope: the raw q normalised and rotated on load equals norm_rope's q through the same core (q in one dot;
    in chunks with the 1/rms before the loop; split keys), to the reduction-order tolerance of the module
    docstring; and the torch reference with q_rope agrees to the dtype's rounding."""
    B, S, H, D, F, spec, dtype, cfg = CASES[name]
    q, parts, sinks, pos, freq = _case(B, S, H, D, F, spec, dtype, ("pro", name))
    scale = D ** -0.5
    want = sparse_attention_fused(norm_rope(q, pos, freq, eps=EPS), parts, sinks, scale, config=cfg)
    got = sparse_attention_fused(q, parts, sinks, scale, config=cfg, q_rope=(pos, freq, EPS), fuse=True)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert rel(got, want) < (1e-6 if dtype == torch.float32 else 2e-3)
    assert torch.equal(got[0, 0].float().cpu(), torch.zeros(H, D))                  # every pick masked: 0
    ref = sparse_attention(q.float(), [(kv.float(), i) for kv, i in parts], sinks, scale, kernels="off",
                           q_rope=(pos, freq, EPS))
    assert rel(got, ref) < (1e-5 if dtype == torch.float32 else 1.5e-2)


@needs_kernels
@pytest.mark.parametrize("name", list(CASES))
def test_epilogue_has_the_unfused_chains_bits(name):
    """o_rope / out_fp8: the inverse rope equals norm_rope(o, inverse) of the same core's output bit for bit, and
    out_fp8 equals act_quant_torch of that (e4m3 bytes and scales), in the core kernel and in the split-K combine,
    with whole and partial value blocks; with the prologue on as well (the attention layer's call)."""
    B, S, H, D, F, spec, dtype, cfg = CASES[name]
    q, parts, sinks, pos, freq = _case(B, S, H, D, F, spec, dtype, ("epi", name))
    scale = D ** -0.5
    plain = sparse_attention_fused(q, parts, sinks, scale, config=cfg)
    unrot = norm_rope(plain, pos, freq, norm=False, inverse=True)                   # the unfused chain
    got = sparse_attention_fused(q, parts, sinks, scale, config=cfg, o_rope=(pos, freq), fuse=True)
    assert got.dtype == q.dtype and torch.equal(got, unrot)
    o_q, s = sparse_attention_fused(q, parts, sinks, scale, config=cfg, o_rope=(pos, freq), out_fp8=True,
                                    fuse=True)
    want_q, want_s = act_quant_torch(unrot.reshape(B * S, H * D))
    assert o_q.dtype == torch.float8_e4m3fn and tuple(o_q.shape) == (B * S, H * D)
    assert s.dtype == torch.float32 and tuple(s.shape) == (H * D // 128, B * S) and s.is_contiguous()
    assert torch.equal(o_q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s, want_s)
    o_q, s = sparse_attention_fused(q, parts, sinks, scale, config=cfg, out_fp8=True, fuse=True)  # no rope
    want_q, want_s = act_quant_torch(plain.reshape(B * S, H * D))
    assert torch.equal(o_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    if name.startswith("bf16 q in one dot") or "split" in name:                     # all three at once
        qn = norm_rope(q, pos, freq, eps=EPS)
        chain = norm_rope(sparse_attention_fused(qn, parts, sinks, scale, config=cfg), pos, freq, norm=False,
                          inverse=True)
        o_q, s = sparse_attention_fused(q, parts, sinks, scale, config=cfg, q_rope=(pos, freq, EPS),
                                        o_rope=(pos, freq), out_fp8=True, fuse=True)
        want = dequant_act(*act_quant_torch(chain.reshape(B * S, H * D)))      # equal up to the prologue's ulps
        assert rel(dequant_act(o_q, s), want) < 1e-2                       # a flipped e4m3 ulp: 6% of one element


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_keys_agree_with_one_program(dtype):
    """The epilogue in _combine_kernel (keys split over 3 programs) against the core kernel's (no split): the same
    outputs to the softmax's reassociation (a key split merges the running sums in another order)."""
    B, S, H, D, F = 2, 3, 8, 128, 32
    q, parts, sinks, pos, freq = _case(B, S, H, D, F, [(70, 70, "random"), (9, 9, "tail")], dtype, ("split", dtype))
    kw = dict(q_rope=(pos, freq, EPS), o_rope=(pos, freq), fuse=True)
    base = FALLBACKS[3] if dtype == torch.float32 else FALLBACKS[0]
    one = sparse_attention_fused(q, parts, sinks, D ** -0.5, config=replace(base, split_k=1), **kw)
    three = sparse_attention_fused(q, parts, sinks, D ** -0.5, config=replace(base, split_k=3), **kw)
    assert rel(three, one) < (1e-6 if dtype == torch.float32 else 1e-2)
    q1, s1 = sparse_attention_fused(q, parts, sinks, D ** -0.5, config=replace(base, split_k=1), out_fp8=True, **kw)
    q3, s3 = sparse_attention_fused(q, parts, sinks, D ** -0.5, config=replace(base, split_k=3), out_fp8=True, **kw)
    assert rel(dequant_act(q3, s3), dequant_act(q1, s1)) < 7e-2             # two e4m3 roundings of close values
    assert rel(dequant_act(q1, s1), one.reshape(B * S, H * D)) < 7e-2      # e4m3: 3 mantissa bits


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_fallback_agrees_with_the_kernel(dtype):
    """core.sparse_attention with the fusions: the Triton path (kernels="on") and the torch ops (kernels="off":
    norm_rope_torch, the reference core, norm_rope_torch inverse, act_quant_torch) agree, o and the fp8 pair."""
    B, S, H, D, F = 2, 3, 4, 128, 32
    q, parts, sinks, pos, freq = _case(B, S, H, D, F, [(30, 20, "random"), (9, 7, "tail")], dtype, ("fb", dtype))
    kw = dict(q_rope=(pos, freq, EPS), o_rope=(pos, freq))
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    on = sparse_attention(q, parts, sinks, D ** -0.5, "on", **kw)
    off = sparse_attention(q, parts, sinks, D ** -0.5, "off", **kw)
    assert on.dtype == off.dtype == dtype and rel(on, off) < tol
    q_on, s_on = sparse_attention(q, parts, sinks, D ** -0.5, "on", out_fp8=True, **kw)
    q_off, s_off = sparse_attention(q, parts, sinks, D ** -0.5, "off", out_fp8=True, **kw)
    assert q_off.dtype == torch.float8_e4m3fn and s_off.shape == s_on.shape == (H * D // 128, B * S)
    assert rel(dequant_act(q_on, s_on), dequant_act(q_off, s_off)) < 7e-2


def test_torch_fallback_is_the_unfused_chain():
    """kernels="off" (no Triton involved): norm_rope_torch, the reference core, the inverse rope, act_quant_torch,
    exactly; freq None means the norm alone."""
    B, S, H, D, F = 2, 3, 2, 128, 8
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, S, H, D, generator=g)
    parts = [(torch.randn(B, 10, D, generator=g), torch.randint(-1, 10, (B, S, 6), generator=g))]
    sinks, pos, freq = torch.randn(H, generator=g), torch.randint(0, 99, (B, S), generator=g), torch.rand(F)
    o = sparse_attention(norm_rope_torch(q, pos, freq, eps=EPS), parts, sinks, 0.1, "off")
    o = norm_rope_torch(o, pos, freq, norm=False, inverse=True)
    got_q, got_s = sparse_attention(q, parts, sinks, 0.1, "off", q_rope=(pos, freq, EPS), o_rope=(pos, freq),
                                    out_fp8=True)
    want_q, want_s = act_quant_torch(o.reshape(B * S, H * D))
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(got_s, want_s)
    norm_only = sparse_attention(q, parts, sinks, 0.1, "off", q_rope=(pos, None, EPS))
    assert torch.equal(norm_only, sparse_attention(norm_rope_torch(q, eps=EPS), parts, sinks, 0.1, "off"))


@pytest.mark.parametrize("kernels", ["off", "on"])
def test_fusion_errors(kernels):
    """Clear errors, the same from the kernel path and the torch one."""
    if kernels == "on" and not triton_ok(DEVICE, want=True):
        pytest.skip("Triton cannot run here")
    dev = DEVICE if kernels == "on" else "cpu"
    q = torch.randn(1, 2, 2, 64, device=dev)
    parts = [(torch.randn(1, 4, 64, device=dev), torch.zeros(1, 2, 3, dtype=torch.long, device=dev))]
    sinks, pos, freq = torch.zeros(2, device=dev), torch.zeros(1, 2, dtype=torch.long, device=dev), torch.ones(8)
    call = lambda q, **kw: sparse_attention(q, parts, sinks, 0.1, kernels, **kw)  # noqa: E731
    with pytest.raises(ValueError, match=r"out_fp8 needs head_dim d=64 to be a multiple of 128"):
        call(q, out_fp8=True)
    with pytest.raises(ValueError, match=r"q_rope positions \(1, 3\) must be \[B=1, S=2\]"):
        call(q, q_rope=(torch.zeros(1, 3, dtype=torch.long), freq, EPS))
    with pytest.raises(ValueError, match=r"o_rope has 40 frequencies, 2 \* 40 > d=64"):
        call(q, o_rope=(pos, torch.ones(40)))
    with pytest.raises(ValueError, match=r"q_rope must be \(pos_BS, freq_F, eps\), got 2 items"):
        call(q, q_rope=(pos, freq))


@needs_kernels
def test_fp8_needs_whole_scale_blocks_per_program():
    q = torch.randn(1, 1, 2, 128, device=DEVICE)
    parts = [(torch.randn(1, 4, 128, device=DEVICE), torch.zeros(1, 1, 3, dtype=torch.long, device=DEVICE))]
    with pytest.raises(ValueError, match=r"out_fp8 needs CoreConfig.block_dv >= 128 .* got block_dv=64"):
        sparse_attention_fused(q, parts, torch.zeros(2, device=DEVICE), 0.1, config=CoreConfig(block_dv=64),
                               out_fp8=True, fuse=True)


@needs_kernels
@pytest.mark.parametrize("split", [1, 2])
def test_fused_or_chained_by_the_grid(split):
    """fuse=None runs the steps inside the kernels on a grid of at most ``CoreTuning.fuse_max_waves`` waves of
    programs and as the unfused chain around the plain kernel beyond; both give the epilogue's bits (the prologue's
    to its rounding), in the core kernel and in the split-K combine."""
    from moe_wave.attention.sparse_core import CoreTuning

    B, S, H, D, F = 2, 3, 4, 128, 32
    q, parts, sinks, pos, freq = _case(B, S, H, D, F, [(40, 30, "random")], torch.bfloat16, ("regime", split))
    cfg = CoreConfig(split_k=split)
    kw = dict(config=cfg, q_rope=(pos, freq, EPS), o_rope=(pos, freq), out_fp8=True)
    (fq, fs), (cq, cs) = (sparse_attention_fused(q, parts, sinks, 0.1, fuse=f, **kw) for f in (True, False))
    assert rel(dequant_act(fq, fs), dequant_act(cq, cs)) < 1e-2
    for waves, want_q, want_s in ((CoreTuning().fuse_max_waves, fq, fs), (0, cq, cs)):   # 6 programs: fused; 0: chain
        auto_q, auto_s = sparse_attention_fused(q, parts, sinks, 0.1, tuning=CoreTuning(fuse_max_waves=waves), **kw)
        assert torch.equal(auto_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(auto_s, want_s)
    qn = norm_rope(q, pos, freq, eps=EPS)                        # the same q: the epilogues agree bit for bit
    ep = dict(config=cfg, o_rope=(pos, freq), out_fp8=True)
    (fq, fs), (cq, cs) = (sparse_attention_fused(qn, parts, sinks, 0.1, fuse=f, **ep) for f in (True, False))
    assert torch.equal(fq.view(torch.uint8), cq.view(torch.uint8)) and torch.equal(fs, cs)

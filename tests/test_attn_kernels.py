"""The attention front-end's Triton kernels (``moe_wave.attention.kernels``) on CPU, under the Triton
interpreter: each kernel against its torch twin on fresh random inputs, then the whole attention
and decoder-layer parity suites (HF oracle) with the kernels switched on.

The interpreter is chosen when Triton is imported, so every check runs in a subprocess with
TRITON_INTERPRET=1 and MOE_WAVE_ATTN_KERNELS=1."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_wave.attention.kernels import norm_rope, norm_rope_torch

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
ENV = dict(os.environ, TRITON_INTERPRET="1", MOE_WAVE_ATTN_KERNELS="1")

_KERNEL_SCRIPT = r"""
import itertools
import os
import torch
from moe_wave.attention.kernels import (index_scores, index_scores_torch, norm_rope, norm_rope_torch,
                                        use_kernels)

def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()

g = torch.Generator().manual_seed(0)
assert use_kernels(torch.zeros(1))
# norm_rope: every flag, d not a power of two, rope over part or all of d, one or many rows per position
for (B, S, H, d, F), norm, wt, inv in itertools.product([(2, 5, 3, 24, 4), (1, 7, 1, 10, 5), (3, 2, 2, 64, 0)],
                                                       [True, False], [True, False], [True, False]):
    if wt and not norm:
        continue
    x = torch.randn(B, S, H, d, generator=g) * 3
    pos = torch.randint(0, 5000, (B, S), generator=g)
    freq = torch.rand(F, generator=g)
    w = torch.randn(d, generator=g) if wt else None
    want = norm_rope_torch(x, pos, freq, norm=norm, weight=w, inverse=inv)
    got = norm_rope(x, pos, freq, norm=norm, weight=w, inverse=inv)
    assert rel(got, want) < 1e-5, ((B, S, H, d, F), norm, wt, inv, rel(got, want))
    same = x.clone()
    assert norm_rope(same, pos, freq, norm=norm, weight=w, inverse=inv, out=same) is same
    assert torch.equal(same, got)
# forward then inverse RoPE is the identity
x = torch.randn(2, 3, 4, 16, generator=g)
pos = torch.randint(0, 100, (2, 3), generator=g)
freq = torch.rand(4, generator=g)
back = norm_rope(norm_rope(x, pos, freq, norm=False), pos, freq, norm=False, inverse=True)
assert rel(back, x) < 1e-5
# index_scores: masked causal scores, tiles partly and fully invisible, rows at different offsets
for B, S, Hh, E, N, ratio in [(2, 70, 4, 16, 80, 4), (1, 130, 3, 32, 40, 4), (1, 9, 2, 16, 3, 128)]:
    q = torch.randn(B, S, Hh, E, generator=g)
    w = torch.rand(B, S, Hh, generator=g)
    k = torch.randn(B, N + 1, E, generator=g)[:, :N]          # a strided view, as the cache slices it
    pos = torch.arange(S).expand(B, -1) + torch.randint(0, 4 * N, (B, 1), generator=g)
    want = index_scores_torch(q, w, k, pos, ratio)
    got = index_scores(q, w, k, pos, ratio)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin), (B, S, N)
    assert torch.equal(got[~fin], want[~fin])
    if fin.any():
        assert rel(got[fin], want[fin]) < 1e-5, (B, S, N, rel(got[fin], want[fin]))
# sparse_attention_fused against the torch core: one or two parts, masked picks, a query with none
from moe_wave.attention.core import sparse_attention
from moe_wave.attention.kernels import sparse_attention_fused
for B, S, H, D, M1, J1, M2, J2 in [(2, 5, 4, 32, 20, 8, 9, 6), (1, 3, 3, 24, 7, 5, 0, 0), (1, 4, 20, 64, 40, 40, 12, 12)]:
    q = torch.randn(B, S, H, D, generator=g)
    parts = [(torch.randn(B, M1, D, generator=g), torch.randint(-1, M1, (B, S, J1), generator=g))]
    if J2:
        parts.append((torch.randn(B, M2, D, generator=g), torch.randint(-1, M2, (B, S, J2), generator=g)))
    for _, idx in parts:
        idx[0, 0] = -1                                   # query (0, 0) sees nothing: output 0
    sinks = torch.randn(H, generator=g)
    os.environ["MOE_WAVE_ATTN_KERNELS"] = "0"
    want = sparse_attention(q, parts, sinks, D ** -0.5)
    os.environ["MOE_WAVE_ATTN_KERNELS"] = "1"
    got = sparse_attention_fused(q, parts, sinks, D ** -0.5)
    assert rel(got, want) < 1e-5, (B, S, H, D, rel(got, want))
    assert torch.equal(got[0, 0], torch.zeros_like(got[0, 0]))
# pool_entries through Compressor.emit: kernels on vs the torch ops, chunks at any offset, the ring in use
from moe_wave.attention.compressor import Compressor, CompressorConfig, CompressorState
for ratio, overlap, d, S, p0 in [(4, True, 16, 13, 6), (4, False, 8, 5, 3), (8, False, 16, 19, 0), (4, True, 16, 1, 9)]:
    comp = Compressor(CompressorConfig(hidden=12, dim=d, ratio=ratio, overlap=overlap))
    with torch.no_grad():
        for prm in comp.parameters():
            prm.normal_(0, 0.5, generator=g)
    B, max_len = 2, 48
    st = CompressorState.empty(comp.cfg, B, max_len, "cpu", torch.float32)
    st.kv_BRC.normal_(generator=g)
    st.score_BRC.normal_(generator=g)
    st.entries_BNd.normal_(generator=g)
    x = torch.randn(B, S, 12, generator=g)
    pos = (p0 + torch.arange(S)).expand(B, -1).contiguous()
    freq = torch.rand(2, generator=g)
    kv, gate = comp.project(x, pos)
    want = CompressorState(st.kv_BRC.clone(), st.score_BRC.clone(), st.entries_BNd.clone())
    os.environ["MOE_WAVE_ATTN_KERNELS"] = "0"
    comp.emit(kv, gate, pos, want, freq)
    os.environ["MOE_WAVE_ATTN_KERNELS"] = "1"
    comp.emit(kv, gate, pos, st, freq)
    N = st.num_slots
    assert rel(st.entries_BNd[:, :N], want.entries_BNd[:, :N]) < 1e-5, (ratio, overlap, S, p0)
print("ok")
"""


@needs_triton
def test_kernels_match_torch_under_interpreter():
    r = subprocess.run([sys.executable, "-c", _KERNEL_SCRIPT], env=ENV, cwd=ROOT, capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


@needs_triton
def test_attention_parity_with_kernels_under_interpreter():
    """The HF parity and decode/chunked-prefill tests again, with every kernel on (the overlap and EP
    tests are left out: on CPU overlap runs the same code, and EP does not touch the kernels)."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_attention.py",
                        "tests/test_decoder_layer.py", "-k", "not ep and not overlap"], env=ENV, cwd=ROOT,
                       capture_output=True,
                       text=True, timeout=600, check=False)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-2000:])


def test_norm_rope_torch_is_rmsnorm_then_rope():
    """The fallback itself, against the two separate reference ops (no Triton involved)."""
    from moe_wave.attention.compressor import rms_norm
    from moe_wave.attention.rope import rope_tail

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 32, generator=g)
    w = torch.randn(32, generator=g)
    pos = torch.randint(0, 999, (2, 6), generator=g)
    freq = torch.rand(8, generator=g)
    want = rope_tail(rms_norm(x, w, 1e-6), pos, freq)
    torch.testing.assert_close(norm_rope_torch(x, pos, freq, weight=w), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(norm_rope(x, pos, freq, weight=w), want, rtol=1e-6, atol=1e-6)


def test_norm_rope_bad_input():
    x = torch.randn(2, 3, 9)
    with pytest.raises(ValueError, match="last dim 9 must be even"):
        norm_rope(x)
    with pytest.raises(ValueError, match="weight has 4 elements"):
        norm_rope(torch.randn(2, 8), weight=torch.ones(4))

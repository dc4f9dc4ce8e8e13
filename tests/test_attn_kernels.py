"""The attention front-end's Triton kernels (``moe_wave.attention.kernels``), each against its torch twin on
fresh random inputs: on a GPU, or on CPU under Triton's interpreter (tests/conftest.py turns it on for GPU-less
runs). The HF parity suites with every kernel on are in tests/test_attention.py and test_decoder_layer.py
(``ScheduleConfig(kernels="on")``)."""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from moe_wave.attention.compressor import Compressor, CompressorConfig, CompressorState
from moe_wave.attention.core import sparse_attention
from moe_wave.attention.core_kernel import sparse_attention_fused
from moe_wave.attention.kernels import index_scores, index_scores_torch, norm_rope, norm_rope_torch, use_kernels
from moe_wave.comm.triton_gate import triton, triton_ok

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not triton_ok(DEVICE, want=True),
                                   reason="Triton cannot run here (not installed, or CPU without TRITON_INTERPRET=1)")


def rel(a, b):
    return ((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm()).item()


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))   # hash() of a str varies per process


def _dev(*ts):
    return [t.to(DEVICE) for t in ts]


def test_use_kernels_follows_the_mode():
    cpu, here = torch.zeros(1), torch.zeros(1, device=DEVICE)
    assert not use_kernels(cpu, "off") and not use_kernels(here, "off")
    assert use_kernels(cpu, "auto") is False, "auto never runs the interpreter on CPU"
    assert use_kernels(here, "on") == triton_ok(DEVICE, want=True)
    assert use_kernels(here, "auto") == (DEVICE == "cuda" and triton is not None)
    with pytest.raises(ValueError, match=r"kernels='1': must be one of \('auto', 'on', 'off'\)"):
        use_kernels(cpu, "1")


NORM_ROPE = [(shape, norm, wt, inv) for shape, norm, wt, inv in itertools.product(
    [(2, 5, 3, 24, 4), (1, 7, 1, 10, 5), (3, 2, 2, 64, 0)], [True, False], [True, False], [True, False])
    if norm or not wt]


@needs_kernels
@pytest.mark.parametrize("shape, norm, wt, inv", NORM_ROPE)
def test_norm_rope_matches_torch(shape, norm, wt, inv):
    """Every flag, d not a power of two, RoPE over part or all of d, one or many rows per position; in place."""
    B, S, H, d, F = shape
    g = _gen(shape, norm, wt, inv)
    x = torch.randn(B, S, H, d, generator=g) * 3
    pos = torch.randint(0, 5000, (B, S), generator=g)
    freq = torch.rand(F, generator=g)
    w = torch.randn(d, generator=g) if wt else None
    want = norm_rope_torch(x, pos, freq, norm=norm, weight=w, inverse=inv)
    xd, pd, fd = _dev(x, pos, freq)
    wd = None if w is None else w.to(DEVICE)
    got = norm_rope(xd, pd, fd, norm=norm, weight=wd, inverse=inv)
    assert rel(got, want) < 1e-5
    same = xd.clone()
    assert norm_rope(same, pd, fd, norm=norm, weight=wd, inverse=inv, out=same) is same
    assert torch.equal(same, got)


@needs_kernels
def test_rope_forward_then_inverse_is_identity():
    g = _gen("inverse")
    x, pos, freq = _dev(torch.randn(2, 3, 4, 16, generator=g), torch.randint(0, 100, (2, 3), generator=g),
                        torch.rand(4, generator=g))
    back = norm_rope(norm_rope(x, pos, freq, norm=False), pos, freq, norm=False, inverse=True)
    assert rel(back, x) < 1e-5


@needs_kernels
@pytest.mark.parametrize("B, S, Hh, E, N, ratio",
                         [(2, 70, 4, 16, 80, 4), (1, 130, 3, 32, 40, 4), (1, 9, 2, 16, 3, 128)])
def test_index_scores_matches_torch(B, S, Hh, E, N, ratio):
    """Masked causal scores: tiles partly and fully invisible, rows at different offsets, a strided key view."""
    g = _gen(B, S, Hh, E, N, ratio)
    q = torch.randn(B, S, Hh, E, generator=g)
    w = torch.rand(B, S, Hh, generator=g)
    k = torch.randn(B, N + 1, E, generator=g)
    pos = torch.arange(S).expand(B, -1) + torch.randint(0, 4 * N, (B, 1), generator=g)
    want = index_scores_torch(q, w, k[:, :N], pos, ratio)
    qd, wd, kd, pd = _dev(q, w, k, pos)
    got = index_scores(qd, wd, kd[:, :N], pd, ratio).cpu()    # a strided view, as the cache slices it
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin)
    assert torch.equal(got[~fin], want[~fin])
    if fin.any():
        assert rel(got[fin], want[fin]) < 1e-5


@needs_kernels
@pytest.mark.parametrize("B, S, H, D, M1, J1, M2, J2", [(2, 5, 4, 32, 20, 8, 9, 6), (1, 3, 3, 24, 7, 5, 0, 0),
                                                        (1, 4, 20, 64, 40, 40, 12, 12)])
def test_sparse_attention_fused_matches_torch(B, S, H, D, M1, J1, M2, J2):
    """One or two parts, masked picks, and a query that sees nothing (output 0)."""
    g = _gen(B, S, H, D, M1, J1, M2, J2)
    q = torch.randn(B, S, H, D, generator=g)
    parts = [(torch.randn(B, M1, D, generator=g), torch.randint(-1, M1, (B, S, J1), generator=g))]
    if J2:
        parts.append((torch.randn(B, M2, D, generator=g), torch.randint(-1, M2, (B, S, J2), generator=g)))
    for _, idx in parts:
        idx[0, 0] = -1
    sinks = torch.randn(H, generator=g)
    want = sparse_attention(q, parts, sinks, D ** -0.5, kernels="off")
    got = sparse_attention_fused(q.to(DEVICE), [tuple(_dev(*p)) for p in parts], sinks.to(DEVICE), D ** -0.5)
    assert rel(got, want) < 1e-5
    assert torch.equal(got[0, 0].cpu(), torch.zeros_like(want[0, 0]))


@needs_kernels
@pytest.mark.parametrize("ratio, overlap, d, S, p0", [(4, True, 16, 13, 6), (4, False, 8, 5, 3), (8, False, 16, 19, 0),
                                                      (4, True, 16, 1, 9)])
def test_pool_entries_matches_torch(ratio, overlap, d, S, p0):
    """Compressor.emit with the kernels on vs off: chunks at any offset, the ring in use."""
    g = _gen(ratio, overlap, d, S, p0)
    comp = Compressor(CompressorConfig(hidden=12, dim=d, ratio=ratio, overlap=overlap))
    with torch.no_grad():
        for prm in comp.parameters():
            prm.normal_(0, 0.5, generator=g)
    B, max_len = 2, 48
    st = CompressorState.empty(comp.cfg, B, max_len, "cpu", torch.float32)
    for t in (st.kv_BRC, st.score_BRC, st.entries_BNd):
        t.normal_(generator=g)
    x = torch.randn(B, S, 12, generator=g)
    pos = (p0 + torch.arange(S)).expand(B, -1).contiguous()
    freq = torch.rand(2, generator=g)
    want = CompressorState(st.kv_BRC.clone(), st.score_BRC.clone(), st.entries_BNd.clone())
    with torch.no_grad():
        kv, gate = comp.project(x, pos)
        comp.emit(kv, gate, pos, want, freq, kernels="off")
        comp_d = comp.to(DEVICE)
        got = CompressorState(*_dev(st.kv_BRC, st.score_BRC, st.entries_BNd))
        kv_d, gate_d = comp_d.project(x.to(DEVICE), pos.to(DEVICE))
        comp_d.emit(kv_d, gate_d, pos.to(DEVICE), got, freq.to(DEVICE), kernels="on")
    N = st.num_slots
    assert rel(got.entries_BNd[:, :N], want.entries_BNd[:, :N]) < 1e-5


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


def test_norm_rope_bad_input():
    x = torch.randn(2, 3, 9)
    with pytest.raises(ValueError, match="last dim 9 must be even"):
        norm_rope(x)
    with pytest.raises(ValueError, match="weight has 4 elements"):
        norm_rope(torch.randn(2, 8), weight=torch.ones(4))

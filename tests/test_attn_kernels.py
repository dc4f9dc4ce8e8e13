"""The attention front-end's Triton kernels (``moe_wave.attention.kernels``), each against its torch twin on
fresh random inputs: on a GPU, or on CPU under Triton's interpreter (tests/conftest.py turns it on for GPU-less
runs). The HF parity suites with every kernel on are in tests/test_attention.py and test_decoder_layer.py
(``ScheduleConfig(kernels="on")``)."""

from __future__ import annotations

import itertools
import zlib
from dataclasses import replace

import pytest
import torch

from moe_wave.attention.compressor import Compressor, CompressorConfig, CompressorState
from moe_wave.attention.sparse_core import sparse_attention
from moe_wave.attention.sparse_core import FALLBACKS, CoreConfig, default_config, sparse_attention_fused
from moe_wave.attention.sparse_core.triton_impl import splits as _splits
from moe_wave.attention.topk import topk_select, topk_select_torch
from moe_wave.attention.kernels import (index_scores, index_scores_torch, norm_rope, norm_rope_torch, picks,
                                       prefix_picks_torch, rms_norm_quant, use_kernels, window_picks_torch)
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
    [(2, 5, 3, 24, 4), (1, 7, 1, 10, 5), (2, 13, 1, 24, 4), (3, 2, 2, 64, 0)], [True, False], [True, False],
    [True, False])
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
@pytest.mark.parametrize("H", [1, 3])
def test_norm_rope_rows_do_not_depend_on_the_chunk(H):
    """A row's bits do not depend on how many positions the call has (one row a position: programs of several
    positions, their count fixed by the shape): the window's kv of a chunked prefill is that of the whole one."""
    g = _gen("chunk", H)
    x, pos, freq, w = _dev(torch.randn(2, 21, H, 40, generator=g).bfloat16(),
                           torch.randint(0, 9000, (2, 21), generator=g), torch.rand(8, generator=g),
                           torch.randn(40, generator=g))
    whole = norm_rope(x, pos, freq, weight=w)
    for a, b in ((0, 5), (5, 6), (6, 21)):
        part = norm_rope(x[:, a:b].contiguous(), pos[:, a:b].contiguous(), freq, weight=w)
        assert torch.equal(part, whole[:, a:b])


@needs_kernels
def test_rope_forward_then_inverse_is_identity():
    g = _gen("inverse")
    x, pos, freq = _dev(torch.randn(2, 3, 4, 16, generator=g), torch.randint(0, 100, (2, 3), generator=g),
                        torch.rand(4, generator=g))
    back = norm_rope(norm_rope(x, pos, freq, norm=False), pos, freq, norm=False, inverse=True)
    assert rel(back, x) < 1e-5


@needs_kernels
@pytest.mark.parametrize("kernel", ["heads", "queries"])
@pytest.mark.parametrize("B, S, Hh, E, N, ratio",
                         [(2, 70, 4, 16, 80, 4), (1, 130, 3, 32, 40, 4), (1, 9, 2, 16, 3, 128), (3, 1, 70, 16, 70, 4)])
def test_index_scores_matches_torch(B, S, Hh, E, N, ratio, kernel):
    """Masked causal scores: tiles partly and fully invisible, rows at different offsets, a strided key view; a
    decode step (S = 1) with more heads than one head block; both kernels."""
    g = _gen(B, S, Hh, E, N, ratio)
    q = torch.randn(B, S, Hh, E, generator=g)
    w = torch.rand(B, S, Hh, generator=g)
    k = torch.randn(B, N + 1, E, generator=g)
    pos = torch.arange(S).expand(B, -1) + torch.randint(0, 4 * N, (B, 1), generator=g)
    want = index_scores_torch(q, w, k[:, :N], pos, ratio)
    qd, wd, kd, pd = _dev(q, w, k, pos)
    got = index_scores(qd, wd, kd[:, :N], pd, ratio, kernel=kernel).cpu()   # a strided key view, as the cache
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin)
    assert torch.equal(got[~fin], want[~fin])
    if fin.any():
        assert rel(got[fin], want[fin]) < 1e-5


def _core_case(B, S, H, D, parts_spec, dtype, key):
    """Random queries, sources and picks; ``parts_spec`` is [(M, J, how)], how: "random" (-1 scattered),
    "tail" (valid picks then -1s, as the window, HCA and topk_select give them) or "none" (all -1)."""
    g = _gen(*key)
    q = torch.randn(B, S, H, D, generator=g).to(dtype)
    parts = []
    for M, J, how in parts_spec:
        kv = torch.randn(B, M, D, generator=g).to(dtype)
        idx = torch.randint(-1 if how == "random" else 0, M, (B, S, J), generator=g)
        if how == "tail":
            keep = torch.randint(0, J + 1, (B, S, 1), generator=g)
            idx = torch.where(torch.arange(J) < keep, idx, torch.full_like(idx, -1))
        elif how == "none":
            idx.fill_(-1)
        parts.append((kv, idx))
    for _, idx in parts:
        idx[0, 0] = -1                                        # (0, 0) sees nothing: output 0
    sinks = torch.randn(H, generator=g)
    return q, parts, sinks


def _core_check(q, parts, sinks, config=None, tol=None):
    D = q.shape[-1]
    want = sparse_attention(q.float(), [(kv.float(), idx) for kv, idx in parts], sinks, D ** -0.5, kernels="off")
    got = sparse_attention_fused(q.to(DEVICE), [tuple(_dev(*p)) for p in parts], sinks.to(DEVICE), D ** -0.5,
                                 config=config)
    assert got.dtype == q.dtype and got.shape == q.shape
    tol = tol if tol is not None else (1e-5 if q.dtype == torch.float32 else 1.5e-2)
    assert rel(got, want) < tol
    assert torch.equal(got[0, 0].cpu().float(), torch.zeros_like(want[0, 0]))
    return got


CORE_CASES = {   # name: B, S, H, D, parts, dtype
    "fp32 two parts random picks": (2, 5, 4, 32, [(20, 8, "random"), (9, 6, "random")], torch.float32),
    "fp32 one part, d not a power of two": (1, 3, 3, 24, [(7, 5, "random")], torch.float32),
    "fp32 20 heads, 40 + 12 picks": (1, 4, 20, 64, [(40, 40, "random"), (12, 12, "random")], torch.float32),
    "bf16 batch 3, S=7, trailing -1": (3, 7, 16, 64, [(90, 70, "tail"), (33, 20, "tail")], torch.bfloat16),
    "bf16 a part with no valid pick": (2, 3, 8, 32, [(40, 16, "random"), (5, 9, "none")], torch.bfloat16),
    "V4-Flash heads, window + top-k": (2, 3, 64, 512, [(160, 128, "tail"), (300, 100, "random")], torch.bfloat16),
    "V4-Pro heads, window + HCA": (1, 3, 128, 512, [(140, 128, "tail"), (40, 37, "tail")], torch.bfloat16),
}


@needs_kernels
@pytest.mark.parametrize("name", list(CORE_CASES))
def test_sparse_core_matches_torch(name):
    """The tensor-core kernel against the torch reference (fp32 on the same inputs): random and -1 picks, a
    query with every pick masked (output 0), pick counts not a multiple of the 64-key tile, heads not a multiple
    of the head block, batch > 1, the V4-Flash (64) and V4-Pro (128) head counts at d = 512."""
    B, S, H, D, spec, dtype = CORE_CASES[name]
    _core_check(*_core_case(B, S, H, D, spec, dtype, ("core", name)))


CONFIGS = [*FALLBACKS, *(replace(c, split_k=1) for c in FALLBACKS), replace(FALLBACKS[0], split_k=3),
           replace(FALLBACKS[2], split_k=2)]


@needs_kernels
@pytest.mark.parametrize("config", range(len(CONFIGS)))
def test_sparse_core_every_config(config):
    """Every tiling of the fallback ladder (d in one dot with the tile reused as V, QK in chunks with the values
    split across programs, small tiles), with the keys split across programs (auto, 2, 3) and not (1), gives
    the reference's answer at d = 512, bf16, 80 heads (a full and a partial head block); a key split may cut
    either part (window 3 tiles, then 2)."""
    q, parts, sinks = _core_case(2, 1, 80, 512, [(150, 130, "tail"), (90, 70, "random")], torch.bfloat16,
                                 ("config", config))
    _core_check(q, parts, sinks, config=CONFIGS[config])


@needs_kernels
def test_sparse_core_is_deterministic():
    """Bit-stable from run to run, split or not; the value blocks (128 / 512 channels per program) and the key
    splits agree with each other."""
    q, parts, sinks = _core_case(2, 2, 64, 512, [(150, 128, "tail"), (90, 64, "random")], torch.bfloat16,
                                 ("determinism",))
    one = replace(FALLBACKS[0], split_k=1)
    three = replace(FALLBACKS[0], split_k=3)
    a = _core_check(q, parts, sinks, config=one)
    assert torch.equal(a, _core_check(q, parts, sinks, config=one))
    assert torch.equal(_core_check(q, parts, sinks, config=three), _core_check(q, parts, sinks, config=three))
    for other in (replace(one, block_dv=128), three):
        assert rel(_core_check(q, parts, sinks, config=other), a) < 1e-2


def test_default_config_and_splits_follow_the_shape():
    """64 heads x 64 keys with d in one dot for bf16, small exact tiles for fp32, blocks clipped to the heads
    and d of small problems; the keys split only where the grid leaves SMs idle, at most one split per tile."""
    big = default_config(64, 512, torch.bfloat16)
    assert (big.block_h, big.block_n, big.block_dk, big.block_dv, big.split_k) == (64, 64, 512, 512, 0)
    assert default_config(64, 512, torch.float32).block_dk == 64
    tiny = default_config(4, 24, torch.bfloat16)
    assert (tiny.block_h, tiny.block_dk, tiny.block_dv) == (16, 32, 32)
    cpu = torch.device("cpu")                                  # 132 SMs assumed off the GPU
    assert _splits(big, 1, 4096, 64, 640, cpu) == 1            # prefill: no split
    assert _splits(big, 64, 1, 64, 640, cpu) == 2              # decode batch 64: 64 programs -> 2 splits (one wave)
    assert _splits(big, 20, 1, 64, 640, cpu) == 6              # 20 programs: 132 // 20
    assert _splits(big, 1, 1, 64, 640, cpu) == 10              # batch 1: one split per key tile
    assert _splits(big, 128, 1, 128, 640, cpu) == 1            # 256 programs fill the GPU
    assert _splits(replace(big, split_k=2), 1, 4096, 64, 640, cpu) == 2
    with pytest.raises(ValueError, match="CoreConfig.block_n=48: must be a power of two >= 16"):
        CoreConfig(block_n=48)
    with pytest.raises(ValueError, match="CoreConfig.split_k=-1: must be >= 0"):
        CoreConfig(split_k=-1)


def _topk_rows(kind: str, R: int, N: int, g: torch.Generator) -> torch.Tensor:
    s = torch.randn(R, N, generator=g)
    if kind == "ties":                                        # few distinct values: ties at the k-th score
        s = (s * 2).round() / 2
        s[:, ::5] = 0.0
        s[:, 1::7] = -0.0
    elif kind == "masked":                                    # causal rows: a growing visible prefix
        vis = torch.randint(0, N + 1, (R, 1), generator=g)
        s = s.masked_fill(torch.arange(N) >= vis, float("-inf"))
        s[0] = float("-inf")
    return s


@needs_kernels
@pytest.mark.parametrize("kind", ["random", "ties", "masked"])
@pytest.mark.parametrize("R, N, k", [(6, 37, 8), (5, 100, 100), (4, 1024, 512), (3, 300, 1)])
def test_topk_select_matches_torch_topk(kind, R, N, k):
    """The selection kernel equals its reference exactly (same ids, same order, same -1 padding) and picks the
    same values as torch.topk; without ties, the same set of ids."""
    g = _gen("topk", kind, R, N, k)
    s = _topk_rows(kind, R, N, g)
    got = topk_select(s.to(DEVICE)[None], k)[0].cpu()
    assert got.shape == (R, k) and got.dtype == torch.int64
    assert torch.equal(got, topk_select_torch(s, k))
    got32 = topk_select(s.to(DEVICE)[None], k, torch.int32)[0].cpu()    # the layer's picks: the same ids, int32
    assert got32.dtype == torch.int32 and torch.equal(got32.long(), got)
    tv, ti = s.topk(k, dim=-1)
    for r in range(R):
        ids = got[r][got[r] >= 0]
        fin = tv[r] > float("-inf")
        assert (got[r][len(ids):] == -1).all() and (ids.diff() > 0).all()        # ascending, then the -1s
        assert torch.equal(s[r, ids].sort().values, tv[r][fin].sort().values)     # the same scores
        if kind != "ties":
            assert set(ids.tolist()) == set(ti[r][fin].tolist())


def test_topk_select_tie_rule():
    """Ties at the k-th score go to the lowest ids; -0.0 ties with 0.0; -inf is never picked."""
    s = torch.tensor([[1.0, 0.5, 0.5, 2.0, 0.5, float("-inf")],
                      [0.0, -0.0, 0.0, -1.0, float("-inf"), -0.0],
                      [float("-inf")] * 6])
    want = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 5], [-1, -1, -1, -1]])
    assert torch.equal(topk_select_torch(s, 4), want)
    if triton_ok(DEVICE, want=True):
        assert torch.equal(topk_select(s.to(DEVICE), 4).cpu(), want)
    assert topk_select(s, 0).shape == (3, 0)
    assert topk_select(s, 0, torch.int32).dtype == torch.int32
    assert torch.equal(topk_select(s, 4, torch.int32), want.int())         # the torch path casts as well
    with pytest.raises(ValueError, match=r"topk_select: dtype=torch.float32: must be torch.int32 or torch.int64"):
        topk_select(s, 4, torch.float32)


def _window_rows_by_hand(pos, W):
    """The window's rows one query at a time, as ``V4Attention.window_source`` lays out its key source: ring rows
    0 .. W-1 (position p at p mod W), then the chunk from row W (its first position p0 at row W)."""
    out = torch.full((*pos.shape, W), -1, dtype=torch.int64)
    for b in range(pos.shape[0]):
        p0 = int(pos[b, 0])
        for s in range(pos.shape[1]):
            for w in range(W):
                k = int(pos[b, s]) - w
                if k >= 0:
                    out[b, s, w] = W + k - p0 if k >= p0 else k % W
    return out


@pytest.mark.parametrize("starts, S, W", [((0, 0), 7, 4), ((5, 130), 9, 8), ((3,), 1, 128), ((0, 1, 40), 33, 16)])
def test_window_and_prefix_picks_match_their_definitions(starts, S, W):
    """The picks kernel (and its torch twin) against the window's rows worked out query by query, for fresh rows
    (p0 = 0), continued ones (p0 > 0: older keys in the ring), decode (S = 1), W a power of two or not; and HCA's
    prefix picks (entry n once its window of m tokens is complete), int32 and int64."""
    pos = torch.stack([torch.arange(p0, p0 + S) for p0 in starts])
    want = _window_rows_by_hand(pos, W)
    assert torch.equal(window_picks_torch(pos, W), want)
    N, m = 11, 3
    want_hca = torch.tensor([[[n if n < (int(t) + 1) // m else -1 for n in range(N)] for t in row] for row in pos])
    assert torch.equal(prefix_picks_torch(pos, N, m), want_hca)
    for dtype in (torch.int32, torch.int64):
        got = picks(pos.to(DEVICE), window=W, dtype=dtype)
        assert got.dtype == dtype and torch.equal(got.cpu().long(), want)
        got = picks(pos.to(DEVICE), slots=N, ratio=m, dtype=dtype)
        assert got.dtype == dtype and torch.equal(got.cpu().long(), want_hca)
    odd = picks(pos.to(DEVICE), window=W + 3)                               # W not a power of two
    assert torch.equal(odd.cpu().long(), _window_rows_by_hand(pos, W + 3))


def test_picks_bad_input():
    pos = torch.arange(4)[None]
    for kw, msg in [(dict(), r"window=0, slots=0: give exactly one of them > 0"),
                    (dict(window=4, slots=3), r"window=4, slots=3: give exactly one"),
                    (dict(slots=3, ratio=0), r"ratio=0 must be > 0")]:
        with pytest.raises(ValueError, match=msg):
            picks(pos, **kw)
    with pytest.raises(ValueError, match=r"picks: pos_BS \(4,\) must be \[B, S\]"):
        picks(pos[0], window=4)


def _compressor_case(ratio, overlap, d, S, p0, B=2, max_len=96):
    """A compressor with random weights (model dtype fp32), a state whose rings and entries hold random values
    (untouched rows must keep them), a chunk of S tokens from position p0 in batch row 0 and from p0 + b * (ratio +
    1) in row b (each row its own offset), and random rope frequencies."""
    g = _gen(ratio, overlap, d, S, p0)
    comp = Compressor(CompressorConfig(hidden=12, dim=d, ratio=ratio, overlap=overlap))
    with torch.no_grad():
        for prm in comp.parameters():
            prm.normal_(0, 0.5, generator=g)
    st = CompressorState.empty(comp.cfg, B, max_len, "cpu", torch.float32)
    for t in (st.kv_BRC, st.score_BRC, st.entries_BNd):
        t.normal_(generator=g)
    x = torch.randn(B, S, 12, generator=g)
    pos = p0 + torch.arange(B)[:, None] * (ratio + 1) + torch.arange(S)
    return comp, st, x, pos, torch.rand(2, generator=g)


@needs_kernels
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("ratio, overlap, d, S, p0", [(4, True, 16, 13, 6), (4, False, 8, 5, 3), (8, False, 16, 19, 0),
                                                      (4, True, 16, 1, 9), (16, False, 16, 21, 5)])
def test_pool_entries_matches_torch(ratio, overlap, d, S, p0, split, monkeypatch):
    """Compressor.emit with the kernels on vs off: chunks at any offset, the ring in use; each entry pooled by one
    program, or (split) its channels over several programs (2 pairs each here: 2-4 of them) and then normalised
    by the second kernel; the cache rows the chunk does not touch keep their values."""
    from moe_wave.attention import compressor_kernels as K
    monkeypatch.setattr(K, "POOL_SPLIT_PAIRS", 2)
    monkeypatch.setattr(K, "POOL_SPLIT_MIN_SLOTS", 1 if split else 10 ** 9)
    comp, st, x, pos, freq = _compressor_case(ratio, overlap, d, S, p0)
    before = st.entries_BNd.clone()                     # (on CPU the kernels' state below is st itself)
    want = CompressorState(st.kv_BRC.clone(), st.score_BRC.clone(), st.entries_BNd.clone())
    with torch.no_grad():
        kv, gate = comp.project(x, pos)
        comp.emit(kv, gate, pos, want, freq, kernels="off")
        comp_d = comp.to(DEVICE)
        got = CompressorState(*_dev(st.kv_BRC, st.score_BRC, st.entries_BNd))
        kv_d, gate_d = comp_d.project(x.to(DEVICE), pos.to(DEVICE))
        comp_d.emit(kv_d, gate_d, pos.to(DEVICE), got, freq.to(DEVICE), kernels="on")
    N = st.num_slots
    touched = torch.zeros(pos.shape[0], N + 1, dtype=torch.bool)        # [B, N + 1]
    for b, row in enumerate(pos):
        touched[b, int(row[0]) // ratio:min(N, int(row[-1]) // ratio + 1)] = True
    live = touched.clone()
    touched[:, N] = True                                # the trash row: the torch ops write it, the kernels not
    assert live.any() and not touched.all()
    assert rel(got.entries_BNd[live], want.entries_BNd[live]) < 1e-5
    assert torch.equal(got.entries_BNd[~touched].cpu(), before[~touched])
    assert torch.equal(want.entries_BNd[~touched], before[~touched])


@needs_kernels
@pytest.mark.parametrize("ratio, overlap, S, p0", [(4, True, 13, 6), (4, True, 3, 9), (8, False, 5, 0),
                                                   (4, False, 1, 17)])
def test_ring_write_equals_torch(ratio, overlap, S, p0):
    """Compressor.write_state with the kernel (``kernels.ring_write``) against the torch ops: the same fp32 bits in
    the rows of the chunk's last min(S, R) tokens (S above and below R, any offset, decode), the other rows as
    they were."""
    comp, st, x, pos, _ = _compressor_case(ratio, overlap, 16, S, p0)
    before = st.kv_BRC.clone()                          # (on CPU the kernel's state below is st itself)
    want = CompressorState(st.kv_BRC.clone(), st.score_BRC.clone(), st.entries_BNd.clone())
    with torch.no_grad():
        kv, gate = comp.project(x, pos)
        comp.write_state(kv, gate, pos, want, kernels="off")
        got = CompressorState(*_dev(st.kv_BRC, st.score_BRC, st.entries_BNd))
        comp.to(DEVICE).write_state(*_dev(kv, gate, pos), got, kernels="on")
    R = comp.cfg.state_rows
    written = torch.zeros(pos.shape[0], R, dtype=torch.bool)            # [B, R]
    for b, row in enumerate(pos):
        written[b, row[-min(S, R):] % R] = True
    assert not torch.equal(want.kv_BRC[written], before[written])        # the chunk did write
    assert torch.equal(want.kv_BRC[~written], before[~written])
    for g_, w_ in ((got.kv_BRC, want.kv_BRC), (got.score_BRC, want.score_BRC)):
        assert torch.equal(g_.cpu(), w_)


def test_ring_write_bad_rings():
    from moe_wave.attention.compressor_kernels import ring_write
    kv = torch.zeros(1, 3, 8)
    ring = torch.zeros(1, 4, 8)
    with pytest.raises(ValueError, match=r"ring strides \(32, 8, 1\) \(kv\) and \(32, 1, 4\) \(score\): the two rings "
                                         r"must have the same strides"):
        ring_write(kv, kv, torch.zeros(4, 8), torch.arange(3)[None], ring, torch.zeros(1, 8, 4).transpose(1, 2), 4)


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


@needs_kernels
@pytest.mark.parametrize("shape, wt", [((2, 5, 1024), True), ((3, 384), True), ((7, 256), False), ((1, 1, 128), True)])
def test_rms_norm_quant_equals_norm_then_act_quant(shape, wt):
    """The fused norm + quantisation (V4's q_lora, read by two FP8 projections) gives the chain's bits: the e4m3
    codes and the scales of ``act_quant(norm_rope(x, weight))`` (its rows a program, its sums), for K not a power
    of two (a 128-block of the tile masked), one row, rows spanning 32 x in magnitude."""
    from moe_wave.fp8 import FP8, act_quant
    g = _gen("rms_norm_quant", shape, wt)
    K = shape[-1]
    x = (torch.randn(*shape, generator=g) * torch.logspace(-1.5, 1.5, K)).to(torch.bfloat16)
    w = torch.randn(K, generator=g) if wt else None
    xd, = _dev(x)
    wd = None if w is None else w.to(DEVICE)
    got = rms_norm_quant(xd, wd, 1e-6)
    want_q, want_s = act_quant(norm_rope(xd, weight=wd, eps=1e-6).reshape(-1, K))
    assert got.q.dtype == FP8 and got.shape == x.shape and got.dtype == torch.bfloat16
    assert torch.equal(got.q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got.s, want_s) and got.s.shape == (K // 128, x.numel() // K)
    # and the chain is the norm (not a no-op): its dequantised rows are the torch RMSNorm's to e4m3's rounding
    deq = got.q.float() * got.s.t().repeat_interleave(128, 1)
    assert rel(deq, norm_rope_torch(x.float(), weight=w).reshape(-1, K)) < 0.05


def test_rms_norm_quant_bad_input():
    with pytest.raises(ValueError, match="last dim 200 must be a positive multiple of 128"):
        rms_norm_quant(torch.randn(2, 200), None)
    with pytest.raises(ValueError, match="last dim 0 must be a positive multiple of 128"):
        rms_norm_quant(torch.randn(2, 0), None)
    with pytest.raises(ValueError, match="weight has 4 elements, must equal the last dim 256"):
        rms_norm_quant(torch.randn(2, 256), torch.ones(4))


def test_norm_rope_bad_input():
    x = torch.randn(2, 3, 9)
    with pytest.raises(ValueError, match="last dim 9 must be even"):
        norm_rope(x)
    with pytest.raises(ValueError, match="weight has 4 elements"):
        norm_rope(torch.randn(2, 8), weight=torch.ones(4))

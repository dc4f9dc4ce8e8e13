"""GPU checks of the attention layer: real side streams (overlap on == off == CPU), the decode step captured
in a CUDA graph and replayed against eager decode, the Triton kernels against the torch ops, and the sparse core
and the top-k selection at the V4 shapes. Random weights, no HF needed. (tests/test_attn_kernels.py checks each
kernel on small shapes, on CUDA here too.)"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from moe_wave.attention import AttnConfig, ScheduleConfig, V4Attention
from moe_wave.attention.sparse_core import FALLBACKS, sparse_attention, sparse_attention_fused
from moe_wave.attention.rope import RopeConfig
from moe_wave.attention.topk import topk_select, topk_select_torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]

TYPES = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 16}
B, S, MAXLEN = 3, 80, 96


def make_attn(layer_type: str, seed: int = 0, kernels: str = "auto") -> V4Attention:
    torch.manual_seed(seed)
    csa = layer_type == "compressed_sparse_attention"
    cfg = AttnConfig(layer_type=layer_type, hidden=256, heads=8, head_dim=64, q_lora_rank=96, o_groups=2,
                     o_lora_rank=64, window=16, ratio=TYPES[layer_type],
                     rope=RopeConfig(dim=16, theta=10000.0 if layer_type == "sliding_attention" else 160000.0,
                                     yarn_orig=0 if layer_type == "sliding_attention" else 64, yarn_factor=4.0),
                     index_heads=8 if csa else 0, index_dim=32 if csa else 0, index_topk=5 if csa else 0)
    attn = V4Attention(cfg, ScheduleConfig(overlap=True, kernels=kernels))
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name.endswith(("sinks", "ape")):
                p.normal_(0, 0.5)
            elif p.dim() >= 2:
                p.normal_(0, 0.1)
    return attn.eval()


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("layer_type", list(TYPES))
def test_streams_match_serial_and_cpu(layer_type):
    attn = make_attn(layer_type)
    x = torch.randn(B, S, 256)
    pos = torch.arange(S).expand(B, -1)
    with torch.no_grad():
        ref = attn(x, positions=pos)
        g = attn.cuda()
        xg, pg = x.cuda(), pos.cuda()
        on = g(xg, positions=pg, overlap=True)
        off = g(xg, positions=pg, overlap=False)
        # chunked prefill with overlap: the ring/state writes before the next chunk
        cache = g.new_cache(B, MAXLEN)
        chunks = torch.cat([g(xg[:, a:b], positions=pg[:, a:b], cache=cache) for a, b in ((0, 37), (37, 38), (38, S))], 1)
    torch.cuda.synchronize()
    torch.testing.assert_close(on, off, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(on.cpu(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chunks, on, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("layer_type", list(TYPES))
def test_decode_cuda_graph_matches_eager(layer_type, overlap):
    attn = make_attn(layer_type).cuda()
    dev = torch.device("cuda")
    prefill = 40
    x = torch.randn(B, MAXLEN, 256, device=dev)
    pos = torch.arange(MAXLEN, device=dev).expand(B, -1).contiguous()
    with torch.no_grad():
        cache = attn.new_cache(B, MAXLEN)
        attn(x[:, :prefill], positions=pos[:, :prefill], cache=cache, overlap=overlap)
        cache.join()
        eager_cache = copy.deepcopy(cache)
        static_x = x[:, prefill:prefill + 1].clone()
        static_pos = pos[:, prefill:prefill + 1].clone()
        # warm up on a throwaway copy, on a side stream, as CUDA graphs require
        warm = copy.deepcopy(cache)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                attn(static_x, positions=static_pos, cache=warm, overlap=overlap, validate=False)
            warm.join()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = attn(static_x, positions=static_pos, cache=cache, overlap=overlap)
        assert not cache.has_pending
        for t in range(prefill, prefill + 12):
            static_x.copy_(x[:, t:t + 1])
            static_pos.copy_(pos[:, t:t + 1])
            graph.replay()
            want = attn(x[:, t:t + 1], positions=pos[:, t:t + 1], cache=eager_cache, overlap=overlap)
            torch.testing.assert_close(static_out, want, rtol=1e-5, atol=1e-5)
    torch.cuda.synchronize()
    assert cache.length_B.tolist() == eager_cache.length_B.tolist() == [prefill + 12] * B


@pytest.mark.parametrize("layer_type", list(TYPES))
def test_fused_kernels_match_torch_ops_bf16(layer_type):
    """The Triton kernels (moe_wave.attention.kernels) against the torch ops they replace, bf16 on the
    GPU, prefill then decode steps through the cache (fp32 parity with the CPU is checked above): the same
    weights with ScheduleConfig(kernels="on") and kernels="off"."""
    dev = torch.device("cuda")
    x = torch.randn(B, S, 256, device=dev, dtype=torch.bfloat16)
    pos = torch.arange(S, device=dev).expand(B, -1).contiguous()

    def run(kernels: str):
        attn = make_attn(layer_type, kernels=kernels).cuda().to(torch.bfloat16)
        cache = attn.new_cache(B, MAXLEN)
        with torch.no_grad():
            outs = [attn(x[:, :64], positions=pos[:, :64], cache=cache)]
            outs += [attn(x[:, t:t + 1], positions=pos[:, t:t + 1], cache=cache) for t in range(64, S)]
        return torch.cat(outs, 1).float()

    on, off = run("on"), run("off")
    assert torch.isfinite(on).all()
    rel = ((on - off).norm() / off.norm()).item()
    assert rel < 3e-2, rel


def _real_core_inputs(H: int, B: int = 2, S: int = 100, W: int = 128, N: int = 300, k: int = 192):
    """bf16 core inputs at the real head_dim, as the layer builds them: a window part over [ring | chunk]
    (trailing -1 for the first tokens) and a top-k part from topk_select on causal random scores (valid ids
    ascending, then -1); query (1, 0) sees nothing."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(H)
    q = torch.randn(B, S, H, 512, device=dev, generator=g).bfloat16()
    win_src = torch.randn(B, W + S, 512, device=dev, generator=g).bfloat16()
    t = torch.arange(S, device=dev)[:, None] - torch.arange(W, device=dev)   # key positions t, t-1, ..
    win = torch.where(t >= 0, W + t, -1).expand(B, -1, -1).contiguous()
    comp = torch.randn(B, N + 1, 512, device=dev, generator=g).bfloat16()
    score = torch.randn(B, S, N, device=dev, generator=g)
    vis = (torch.arange(S, device=dev) * 3 + 1)[:, None]                       # a visible prefix per query
    score = score.masked_fill(torch.arange(N, device=dev) >= vis, float("-inf"))
    top = topk_select(score, k)
    win[1, 0] = -1
    top[1, 0] = -1
    sinks = torch.randn(H, device=dev, generator=g)
    return q, [(win_src, win), (comp, top)], sinks


@pytest.mark.parametrize("H", [64, 128])
def test_core_kernel_at_v4_shapes(H):
    """The tensor-core sparse core at the V4-Flash (64) and V4-Pro (128) head counts, d = 512, bf16, batch 2,
    100 queries (not a multiple of the tile), window + top-k parts with -1 picks and an all-masked query,
    against the torch reference in fp32 on the same inputs; bit-stable from run to run; every tiling, the keys
    split across programs (forced, and automatic for a single query)."""
    q, parts, sinks = _real_core_inputs(H)
    want = sparse_attention(q.float(), [(kv.float(), idx) for kv, idx in parts], sinks, 512 ** -0.5, kernels="off")
    got = sparse_attention_fused(q, parts, sinks, 512 ** -0.5)
    again = sparse_attention_fused(q, parts, sinks, 512 ** -0.5)
    torch.cuda.synchronize()
    assert torch.equal(got, again)
    assert torch.equal(got[1, 0], torch.zeros_like(got[1, 0]))
    rel = ((got.float() - want).norm() / want.norm()).item()
    assert rel < 1.5e-2, rel
    for cfg in (*FALLBACKS, replace(FALLBACKS[0], split_k=3)):   # every tiling of the ladder; keys split
        other = sparse_attention_fused(q, parts, sinks, 512 ** -0.5, config=cfg)
        assert ((other.float() - want).norm() / want.norm()).item() < 1.5e-2, cfg
    one = sparse_attention_fused(q[:1, :1], [(kv[:1], idx[:1, :1]) for kv, idx in parts], sinks, 512 ** -0.5)
    assert ((one.float() - want[:1, :1]).norm() / want[:1, :1].norm()).item() < 1.5e-2   # decode: auto split


@pytest.mark.parametrize("rows, k, causal", [(4096, 512, True), (64, 512, False), (300, 1024, True)])
def test_topk_select_at_v4_shapes(rows, k, causal):
    """topk_select on 1024 entries per row (the indexer at a 4096-token context): the reference's ids exactly,
    and torch.topk's set (random scores: no ties)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(rows + k)
    s = torch.randn(1, rows, 1024, device=dev, generator=g)
    if causal:
        s = s.masked_fill(torch.arange(1024, device=dev) >= ((torch.arange(rows, device=dev) + 1) // 4)[:, None],
                          float("-inf"))
    got = topk_select(s, k)
    assert torch.equal(got, topk_select_torch(s, k))
    v, i = s.topk(k, dim=-1)
    ref = torch.where(v == float("-inf"), torch.full_like(i, -1), i)
    assert torch.equal(got.sort(-1).values, ref.sort(-1).values)


def _prefill_layer(layer_type: str, seed: int, head_dim: int, window: int, topk: int, rope_dim: int):
    """A bf16 layer with 64 heads on the GPU and a 1100-token prefill input (a grid large enough for Hopper's
    CUDA core): (attn, x [1, 1100, 512], positions [1, 1100]). topk: CSA's index_topk."""
    torch.manual_seed(seed)
    csa = layer_type == "compressed_sparse_attention"
    cfg = AttnConfig(layer_type=layer_type, hidden=512, heads=64, head_dim=head_dim, q_lora_rank=128, o_groups=2,
                     o_lora_rank=64, window=window, ratio=TYPES[layer_type],
                     rope=RopeConfig(dim=rope_dim, theta=10000.0), index_heads=8 if csa else 0,
                     index_dim=64 if csa else 0, index_topk=topk if csa else 0)
    attn = V4Attention(cfg, ScheduleConfig(overlap=True)).cuda().to(torch.bfloat16).eval()
    dev, S = torch.device("cuda"), 1100
    x = torch.randn(1, S, 512, device=dev, dtype=torch.bfloat16)
    return attn, x, torch.arange(S, device=dev)[None]


@pytest.mark.parametrize("layer_type", list(TYPES))
def test_prefill_leaves_q_norm_to_the_core_where_it_does_it(layer_type):
    """A prefill grid large enough for Hopper's CUDA core (64 heads, d = 512, 1100 queries): the front-end leaves q
    raw and the core applies its norm and RoPE as it loads q (``sparse_core.q_norm_inside``); the layer's output
    equals the one with the norm on the q branch (``CoreTuning(q_norm_inside=False)``) within bf16 rounding (the sums
    of squares round in another order), overlapped equals serial bit for bit, and both are bit-stable. Elsewhere (no
    Hopper, decode) q arrives normalised."""
    from moe_wave.attention.schedule import run_frontend
    from moe_wave.attention.sparse_core import CoreTuning, q_norm_inside
    attn, x, pos = _prefill_layer(layer_type, 3, head_dim=512, window=128, topk=128, rope_dim=64)
    S = x.shape[1]
    with torch.no_grad():
        fe = run_frontend(attn, x, pos, attn.new_cache(1, S), False)
        assert fe.q_raw == q_norm_inside(fe.q_BSHd, len(fe.parts))
        assert not run_frontend(attn, x[:, :1], pos[:, :1], attn.new_cache(1, S), False).q_raw   # decode
        on = attn(x, positions=pos, overlap=True)
        assert torch.equal(on, attn(x, positions=pos, overlap=False))
        assert torch.equal(on, attn(x, positions=pos, overlap=True))
        attn.schedule = replace(attn.schedule, core=CoreTuning(q_norm_inside=False))
        assert not run_frontend(attn, x, pos, attn.new_cache(1, S), False).q_raw
        off = attn(x, positions=pos)
    if not fe.q_raw:
        pytest.skip("the CUDA core does not run here (needs a Hopper GPU)")
    rel = ((on.float() - off.float()).norm() / off.float().norm()).item()
    assert rel < 1e-2, rel


@pytest.mark.parametrize("layer_type", list(TYPES))
def test_prefill_at_head_dim_512_takes_the_cuda_core(layer_type, monkeypatch):
    """At V4's head_dim (512), 64 heads and a 64-channel RoPE tail, the layer's prefill runs the CUDA C++ core
    (``sparse_core.cuda_impl``) with q's norm and RoPE in and the output's inverse RoPE out: overlapped equals serial
    bit for bit, repeats its bits, and is within bf16 rounding of the same layer on the Triton kernel
    (``CoreTuning(cuda=False)``)."""
    from moe_wave.attention.sparse_core import CoreTuning, cuda_impl
    if not cuda_impl.available():
        pytest.skip("needs a Hopper GPU")
    attn, x, pos = _prefill_layer(layer_type, 4, head_dim=512, window=128, topk=128, rope_dim=64)
    calls = []
    launch = cuda_impl.sparse_attention_cuda

    def spy(*a, **kw):
        calls.append((kw.get("q_rope") is not None, kw.get("o_rope") is not None))
        return launch(*a, **kw)

    monkeypatch.setattr(cuda_impl, "sparse_attention_cuda", spy)
    with torch.no_grad():
        on = attn(x, positions=pos, overlap=True)
        assert calls and all(q and o for q, o in calls), calls
        assert torch.equal(on, attn(x, positions=pos, overlap=False))
        assert torch.equal(on, attn(x, positions=pos, overlap=True))
        attn.schedule = replace(attn.schedule, core=CoreTuning(cuda=False))
        calls.clear()
        tri = attn(x, positions=pos, overlap=True)
        assert not calls
    rel = ((on.float() - tri.float()).norm() / tri.float().norm()).item()
    assert rel < 1e-2, rel


def _replayed(attn, x, pos):
    """attn(x) captured in a CUDA graph (warmed up on a side stream) and replayed once: its output."""
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            attn(static_x, positions=pos, validate=False)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn(static_x, positions=pos, validate=False)
    static_x.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


@pytest.mark.parametrize("layer_type", list(TYPES))
def test_prefill_fp8_wo_a_overlap_keeps_the_bits(layer_type, monkeypatch):
    """An FP8 layer with the grouped FP8 wo_a at V4's head_dim, 64 heads, a 1100-token prefill: wo_a's GEMMs on a
    priority -1 stream and its output quantised group by group on a side stream (``ScheduleConfig.wo_a_overlap``)
    give the serial chain's bits (``wo_a_overlap=False``), eager and replayed from a CUDA graph; calls below
    ``wo_a_overlap_min_tokens`` keep the serial chain."""
    torch.manual_seed(5)
    csa = layer_type == "compressed_sparse_attention"
    cfg = AttnConfig(layer_type=layer_type, hidden=512, heads=64, head_dim=512, q_lora_rank=128, o_groups=4,
                     o_lora_rank=128, window=128, ratio=TYPES[layer_type], rope=RopeConfig(dim=64, theta=10000.0),
                     index_heads=8 if csa else 0, index_dim=64 if csa else 0, index_topk=128 if csa else 0)
    attn = V4Attention(cfg, ScheduleConfig(overlap=True)).cuda().to(torch.bfloat16).eval().quantize_fp8(wo_a_fp8=True)
    dev, S = torch.device("cuda"), 1100
    x = torch.randn(1, S, 512, device=dev, dtype=torch.bfloat16)
    pos = torch.arange(S, device=dev)[None]
    with torch.no_grad():
        attn.schedule = replace(attn.schedule, wo_a_overlap=False)
        base = attn(x, positions=pos)
        assert torch.equal(base, _replayed(attn, x, pos))
        seen = []
        real = attn._wo_a_overlapped
        monkeypatch.setattr(attn, "_wo_a_overlapped", lambda *a: seen.append(1) or real(*a))
        attn.schedule = replace(attn.schedule, wo_a_overlap=True)
        assert torch.equal(attn(x, positions=pos), base) and not seen     # (1100 tokens: below the minimum)
        attn.schedule = replace(attn.schedule, wo_a_overlap_min_tokens=S)
        assert torch.equal(attn(x, positions=pos), base)
        assert torch.equal(_replayed(attn, x, pos), base)
        assert seen

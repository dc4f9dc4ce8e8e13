"""GPU checks of the attention front-end: real side streams (overlap on == off == CPU), and the decode
step captured in a CUDA graph and replayed against eager decode. Random weights, no HF needed."""

from __future__ import annotations

import copy

import pytest
import torch

from moe_wave.attention import AttnConfig, ScheduleConfig, V4Attention
from moe_wave.attention.rope import RopeConfig

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
        # chunked prefill with overlap: deferred ring/state writes must be joined before the next chunk
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

"""GPU checks of ``moe_wave.deepep_compat`` beyond DeepEP's own tests (``launch/deepep_api.sh`` runs those): the
normal-mode dispatch with ``num_worst_tokens`` and its combine captured in a CUDA graph and replayed with new
routing, the low-latency dispatch and combine (bf16 and FP8, with and without the receive hook) the same way, and
a Buffer over a gloo group (vLLM's CPU group) giving the NCCL group's results.

Run on a GPU host with plain pytest (2 spawned ranks) or under ``torchrun --nproc-per-node N -m pytest``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_wave.comm import EPGroup
from tests.test_gpu_comm import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]

H, E, K, T = 1024, 16, 4, 96


def _route(seed: int, rank: int, T_: int = T, drop: float = 0.1):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(T_, H, generator=g, dtype=torch.float32).to(torch.bfloat16)
    ids = torch.rand(T_, E, generator=g, dtype=torch.float32).topk(K, dim=1).indices
    ids[torch.rand(T_, K, generator=g, dtype=torch.float32) < drop] = -1
    w = torch.rand(T_, K, generator=g, dtype=torch.float32)
    return x.cuda(), ids.cuda(), w.cuda()


def _normal_step(buf, x, ids, w, worst: int):
    n_rank, _, n_exp, in_rank, _ = buf.get_dispatch_layout(ids, E)
    recv_x, r_idx, r_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                                                    num_tokens_per_expert=n_exp, topk_idx=ids, topk_weights=w,
                                                    num_worst_tokens=worst)
    y = (recv_x.float() * (r_idx >= 0).sum(1, keepdim=True)).to(torch.bfloat16)    # "experts": x * local slots
    combined, cw, _ = buf.combine(y, handle, topk_weights=r_w)
    return recv_x, r_idx, combined, cw


def _graph_normal(ep: EPGroup) -> None:
    from moe_wave.deepep_compat import Buffer

    buf = Buffer(ep.pg, int(1e8), 0)
    worst = T * ep.size
    x, ids, w = _route(1, ep.rank)
    sx, sids, sw = x.clone(), ids.clone(), w.clone()
    for _ in range(2):                                  # the buffers are made eagerly
        eager = _normal_step(buf, sx, sids, sw, worst)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _normal_step(buf, sx, sids, sw, worst)
    for seed in (2, 3):
        x, ids, w = _route(seed, ep.rank)
        sx.copy_(x), sids.copy_(ids), sw.copy_(w)
        graph.replay()
        ref = _normal_step(buf, sx, sids, sw, worst)
        torch.cuda.synchronize()
        for a, b in zip(out, ref):
            assert torch.equal(a, b), f"rank {ep.rank} seed {seed}: the replay differs from the eager call"
        # and the sum is right: each token's x times the number of its valid slots
        assert torch.allclose(out[2].float(), (x.float() * (ids >= 0).sum(1, keepdim=True)), rtol=1e-2, atol=1e-2)
    del eager


def _ll_step(buf, x, ids, w, fp8: bool, hook: bool):
    recv, count, handle, ev, hk = buf.low_latency_dispatch(x, ids, T, E, use_fp8=fp8, round_scale=fp8,
                                                           use_ue8m0=False, return_recv_hook=hook)
    if hook:
        hk()
    y = (recv[0].float() * recv[1].repeat_interleave(128, dim=2)).to(torch.bfloat16) if fp8 else recv
    out = torch.empty(x.shape[0], H, dtype=torch.bfloat16, device=x.device)
    combined, ev, hk = buf.low_latency_combine(y, ids, w, handle, return_recv_hook=hook, out=out)
    if hook:
        hk()
    return count, combined


def _graph_ll(ep: EPGroup) -> None:
    from moe_wave.deepep_compat import Buffer

    buf = Buffer(ep.pg, 0, Buffer.get_low_latency_rdma_size_hint(T, H, ep.size, E), low_latency_mode=True)
    for fp8 in (False, True):
        for hook in (False, True):
            x, ids, w = _route(4, ep.rank)
            sx, sids, sw = x.clone(), ids.clone(), w.clone()
            for _ in range(2):                      # both buffer sets made eagerly
                _ll_step(buf, sx, sids, sw, fp8, hook)
            buf.clean_low_latency_buffer(T, H, E)   # the graph starts from the first set, as the replays do
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                count, combined = _ll_step(buf, sx, sids, sw, fp8, hook)
            for seed in (5, 6):
                x, ids, w = _route(seed, ep.rank)
                sx.copy_(x), sids.copy_(ids), sw.copy_(w)
                graph.replay()
                torch.cuda.synchronize()
                ref = (x.float() * torch.where(ids >= 0, w, 0.0).sum(1, keepdim=True))
                tol = (0.08, 0.3) if fp8 else (2e-2, 2e-2)
                assert torch.allclose(combined.float(), ref, rtol=tol[0], atol=tol[1]), \
                    f"rank {ep.rank} fp8={fp8} hook={hook} seed {seed}: the replayed combine is off"
                want = torch.zeros(E, dtype=torch.long, device=x.device)
                all_ids = [torch.empty_like(ids) for _ in range(ep.size)]
                dist.all_gather(all_ids, ids)
                for a in all_ids:
                    want.scatter_add_(0, a[a >= 0], torch.ones_like(a[a >= 0]))
                e = E // ep.size
                assert torch.equal(count.long(), want[ep.rank * e:(ep.rank + 1) * e])


def _gloo_group(ep: EPGroup) -> None:
    from moe_wave.deepep_compat import Buffer

    gloo = dist.new_group(list(range(ep.size)), backend="gloo")
    results = []
    for group in (ep.pg, gloo):
        buf = Buffer(group, int(1e8), 0, explicitly_destroy=True)
        x, ids, w = _route(7, ep.rank)
        results.append(_normal_step(buf, x, ids, w, 0))
        buf.destroy()
    for a, b in zip(*results):
        assert torch.equal(a, b), "a Buffer over a gloo group must give the NCCL group's results"


def test_normal_mode_worst_tokens_in_a_cuda_graph():
    run_ranks(_graph_normal)


def test_low_latency_in_a_cuda_graph():
    run_ranks(_graph_ll)


def test_buffer_over_a_gloo_group():
    run_ranks(_gloo_group)

"""GPU checks of normal mode's direct kernels (``moe_wave.deepep_compat.normal_kernels``) against the engine path
(``Buffer(normal="engine")``, the symm backend's exchange): the same rows bit for bit (bf16, fp8 with scales, with
and without top-k, worst-case padding), the same handle, the same per-expert lists, combines that agree; uneven
and empty ranks; many cached calls in a row (call numbers, flags and acks advancing); DeepEP's test shape once.

Run on a GPU host with plain pytest (2 spawned ranks) or under ``torchrun --nproc-per-node N -m pytest``.
"""

from __future__ import annotations

import pytest
import torch

from moe_wave.comm import EPGroup
from tests.test_gpu_comm import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]


def _route(seed: int, rank: int, T: int, H: int, E: int, K: int, drop: float = 0.1):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(T, H, generator=g, dtype=torch.float32).to(torch.bfloat16)
    ids = torch.rand(T, E, generator=g, dtype=torch.float32).topk(K, dim=1).indices
    ids[torch.rand(T, K, generator=g, dtype=torch.float32) < drop] = -1
    w = torch.rand(T, K, generator=g, dtype=torch.float32)
    return x.cuda(), ids.cuda(), w.cuda()


def _fp8(x: torch.Tensor):
    T, H = x.shape
    amax = x.float().view(T, H // 128, 128).abs().amax(2).clamp(min=1e-4)
    x8 = (x.float().view(T, H // 128, 128) * (448.0 / amax[:, :, None])).view(T, H).to(torch.float8_e4m3fn)
    return x8, (amax / 448.0).t().contiguous().t()          # column-major scales, as DeepEP's tests make them


def _bits(t):
    return t.view(torch.uint8) if t.dtype != torch.bool else t


def _same(a, b, what: str) -> None:
    if isinstance(a, tuple):
        for i, (u, v) in enumerate(zip(a, b)):
            _same(u, v, f"{what}[{i}]")
        return
    if a is None or b is None or isinstance(a, list):
        assert a == b, what
        return
    assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b)), what


def _compare(ep: EPGroup, T_list, H: int, E: int, K: int, seeds=(1, 2), cached_calls: int = 3) -> None:
    from moe_wave.deepep_compat import Buffer

    bufs = {p: Buffer(ep.pg, int(1e8), 0, explicitly_destroy=True, normal=p) for p in ("direct", "engine")}
    from moe_wave.deepep_compat.normal_direct import DirectNormal

    assert isinstance(bufs["direct"]._normal, DirectNormal) and not isinstance(bufs["engine"]._normal, DirectNormal)
    T = T_list[ep.rank]
    for seed in seeds:
        x, ids, w = _route(seed, ep.rank, T, H, E, K)
        for fp8 in (False, True):
            cur = _fp8(x) if fp8 else x
            for topk in (False, True):
                for worst in (0, sum(T_list) + 5):
                    out = {}
                    for p, buf in bufs.items():
                        layout = buf.get_dispatch_layout(ids, E)
                        n_rank, _, n_exp, in_rank, _ = layout
                        kw = dict(topk_idx=ids, topk_weights=w) if topk else {}
                        r = buf.dispatch(cur, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                                         num_tokens_per_expert=n_exp, num_worst_tokens=worst, **kw)
                        recv_x, r_idx, r_w, counts, handle, _ = r
                        cached = [buf.dispatch(cur, handle=handle)[0] for _ in range(cached_calls)]
                        rows = recv_x[0].float() if fp8 else recv_x.float()
                        y = (rows * (ep.rank + 1)).to(torch.bfloat16)
                        comb = buf.combine(y, handle, topk_weights=r_w if topk else None,
                                           bias=torch.ones(T, H, dtype=torch.bfloat16, device=x.device))
                        out[p] = (layout[:4], recv_x, r_idx, r_w, counts, tuple(handle), cached, comb[:2])
                    d, e = out["direct"], out["engine"]
                    tag = f"rank {ep.rank} seed {seed} fp8 {fp8} topk {topk} worst {worst}"
                    _same(d[0][0], e[0][0], f"{tag}: tokens per rank")
                    _same(d[0][2], e[0][2], f"{tag}: tokens per expert")
                    _same(d[0][3], e[0][3], f"{tag}: is_token_in_rank")
                    for i, name in ((1, "recv_x"), (2, "topk_idx"), (3, "topk_weights"), (4, "per-expert list"),
                                    (5, "handle")):
                        _same(d[i], e[i], f"{tag}: {name}")
                    for c in d[6]:
                        _same(c, d[1], f"{tag}: cached dispatch")
                    assert torch.allclose(d[7][0].float(), e[7][0].float(), rtol=1e-2, atol=1e-2), f"{tag}: combine"
                    if topk:
                        assert torch.allclose(d[7][1], e[7][1], atol=1e-6), f"{tag}: combined weights"
    torch.cuda.synchronize()
    bufs["direct"]._normal.state.check("test")
    print(f"rank {ep.rank}: programs per phase {Buffer.last_sms()}")
    for buf in bufs.values():
        buf.destroy()


def test_direct_matches_engine():
    run_ranks(_compare, [96, 61], 1024, 16, 4)


def test_direct_matches_engine_with_an_empty_rank():
    run_ranks(_compare, [0, 40], 512, 8, 3)


def test_direct_matches_engine_at_deepeps_shape():
    run_ranks(_compare, [4096, 4096], 7168, 256, 8, (1,), 2)


def _many_calls(ep: EPGroup) -> None:
    """Many cached dispatch / combine pairs in a row, new x each time (flags, acks and call numbers advance)."""
    from moe_wave.deepep_compat import Buffer

    T, H, E, K = 300, 2048, 32, 6
    buf = Buffer(ep.pg, int(1e8), 0, normal="direct", normal_channels=5, normal_rows=4)
    x, ids, w = _route(9, ep.rank, T, H, E, K)
    n_rank, _, n_exp, in_rank, _ = buf.get_dispatch_layout(ids, E)
    recv_x, r_idx, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                                                  num_tokens_per_expert=n_exp, topk_idx=ids, topk_weights=w)
    for i in range(50):
        xi = (x.float() + i).to(torch.bfloat16)
        got = buf.dispatch(xi, handle=handle)[0]
        assert got.shape == recv_x.shape
        combined = buf.combine(got, handle)[0]
        ref = (xi.float() * in_rank.sum(1, keepdim=True)).to(torch.bfloat16)
        assert torch.allclose(combined.float(), ref.float(), rtol=1e-2, atol=1e-1), f"rank {ep.rank} call {i}"
    torch.cuda.synchronize()
    buf._normal.state.check("test")


def test_many_cached_calls():
    run_ranks(_many_calls)

"""GPU checks of the low-latency mode's direct kernels (``moe_wave.deepep_compat.ll_direct``) through
``deep_ep.Buffer``: the same results as the exchange-engine path (``Buffer(ll="engine")``), a masked rank
skipped rather than awaited, and a rank that never calls: the other gives up after the timeout, masks it, and
raises at its next call (or, with ``enable_shrink``, keeps it masked). ``tests/test_gpu_deepep_compat.py`` replays
both modes from CUDA graphs; ``launch/deepep_api.sh`` runs DeepEP's own tests.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from moe_wave.comm import EPGroup
from moe_wave.comm.options import SymmOptions
from tests.test_gpu_comm import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]

H, E, K, T = 2048, 32, 8, 128


def _inputs(seed: int, rank: int, N: int):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(N, H, generator=g, dtype=torch.float32).to(torch.bfloat16)
    ids = torch.rand(N, E, generator=g, dtype=torch.float32).topk(K, dim=1).indices
    ids[torch.rand(N, K, generator=g, dtype=torch.float32) < 0.1] = -1
    w = torch.rand(N, K, generator=g, dtype=torch.float32)
    return x.cuda(), ids.cuda(), w.cuda()


def _buffer(path: str, **kw):
    from moe_wave.deepep_compat import Buffer

    return Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(T, H, dist.get_world_size(), E),
                  low_latency_mode=True, explicitly_destroy=True, ll=path, **kw)


def _step(buf, x, ids, w, fp8: bool, ue: bool, hook: bool):
    stats = torch.zeros(E // dist.get_world_size(), dtype=torch.int32, device="cuda")
    recv, count, handle, _, hk = buf.low_latency_dispatch(x, ids, T, E, cumulative_local_expert_recv_stats=stats,
                                                          use_fp8=fp8, round_scale=ue, use_ue8m0=ue,
                                                          return_recv_hook=hook)
    if hook:
        hk()
    if fp8 and not ue:
        y = (recv[0].float() * recv[1].repeat_interleave(128, dim=2)).to(torch.bfloat16)
    else:
        y = (recv[0].float() if fp8 else recv.float()).to(torch.bfloat16)
    combined, _, hk = buf.low_latency_combine(y, ids, w, handle, return_recv_hook=hook)
    if hook:
        hk()
    torch.cuda.synchronize()
    return recv, count, handle, stats, combined


def _same_as_engine(ep: EPGroup) -> None:
    direct, engine = _buffer("auto"), _buffer("engine")
    assert hasattr(direct._ll, "direct") and not hasattr(engine._ll, "direct")
    for N in (T, 77, 0):
        for fp8, ue in ((False, False), (True, False), (True, True)):
            for hook in (False, True):
                x, ids, w = _inputs(N + fp8 + ue, ep.rank, N)
                a = _step(direct, x, ids, w, fp8, ue, hook)
                b = _step(engine, x, ids, w, fp8, ue, hook)
                tag = f"rank {ep.rank} N={N} fp8={fp8} ue8m0={ue} hook={hook}"
                assert torch.equal(a[1], b[1]) and torch.equal(a[3], b[3]), f"{tag}: counts differ"
                assert torch.equal(a[2][1], b[2][1]), f"{tag}: layout_range differs"
                for i, n in enumerate(a[1].tolist()):
                    assert torch.equal(a[2][0][i, :n], b[2][0][i, :n]), f"{tag}: source indices of expert {i}"
                    if fp8:
                        assert torch.equal(a[0][0][i, :n].view(torch.uint8), b[0][0][i, :n].view(torch.uint8)), tag
                        assert torch.equal(a[0][1][i, :n], b[0][1][i, :n]), f"{tag}: scales of expert {i}"
                    else:
                        assert torch.equal(a[0][i, :n], b[0][i, :n]), f"{tag}: rows of expert {i}"
                assert torch.allclose(a[4].float(), b[4].float(), rtol=1e-2, atol=1e-2), f"{tag}: combine"
    direct.destroy(), engine.destroy()


def _masked(ep: EPGroup) -> None:
    P, me = ep.size, ep.rank
    buf = _buffer("auto")
    x, ids, w = _inputs(3, me, T)
    for p in range(P):
        if p != me:
            buf.low_latency_update_mask_buffer(p, True)       # every rank alone
    status = torch.zeros(P, dtype=torch.int32, device="cuda")
    buf.low_latency_query_mask_buffer(status)
    assert status.tolist() == [int(p != me) for p in range(P)]
    recv, count, handle, stats, combined = _step(buf, x, ids, w, False, False, False)
    e = E // P
    mine = ids[(ids >= me * e) & (ids < (me + 1) * e)]
    want = torch.bincount(mine - me * e, minlength=e).to(torch.int32)
    assert torch.equal(count, want), f"rank {me}: a masked rank's tokens must not arrive"
    # the combine holds this rank's experts only
    local = (ids >= me * e) & (ids < (me + 1) * e)
    ref = x.float() * torch.where(local, w, 0.0).sum(1, keepdim=True)
    assert torch.allclose(combined.float(), ref, rtol=2e-2, atol=2e-2)
    buf.low_latency_clean_mask_buffer()
    buf.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0] * P
    buf.destroy()


def _silent_peer(ep: EPGroup, shrink: bool) -> None:
    from moe_wave.deepep_compat import Buffer

    P, me = ep.size, ep.rank
    buf = Buffer(dist.group.WORLD, 0, 1, low_latency_mode=True, explicitly_destroy=True, enable_shrink=shrink,
                 options=SymmOptions(timeout_ms=300))
    x, ids, w = _inputs(4, me, T)
    # regions made and kernels compiled with every rank present, under a long timeout (the ranks' first calls may
    # be further apart than 300 ms); then the short one
    direct = buf._ll.direct
    direct.timeout_ms = 120_000
    _step(buf, x, ids, w, False, False, False)
    direct.check()                                            # nothing recorded while every rank was there
    direct.timeout_ms = 300
    torch.cuda.synchronize()
    dist.barrier()
    if me == 0:
        t0 = time.monotonic()
        buf.low_latency_dispatch(x, ids, T, E, use_fp8=False)
        torch.cuda.synchronize()
        waited = time.monotonic() - t0
        assert waited < 30, f"the wait must give up after the timeout, took {waited:.1f} s"
        status = torch.zeros(P, dtype=torch.int32, device="cuda")
        buf.low_latency_query_mask_buffer(status)
        assert status.tolist() == [0] + [1] * (P - 1)
        if shrink:
            buf.low_latency_dispatch(x, ids, T, E, use_fp8=False)       # no error: the ranks stay masked
            torch.cuda.synchronize()
        else:
            with pytest.raises(RuntimeError, match=r"gave up waiting for rank 1 .*timeout_ms=300"):
                buf.low_latency_dispatch(x, ids, T, E, use_fp8=False)
    torch.cuda.synchronize()
    dist.barrier()
    buf.destroy()


def test_direct_path_matches_the_engine_path():
    run_ranks(_same_as_engine)


def test_a_masked_rank_is_skipped_not_awaited():
    run_ranks(_masked)


@pytest.mark.parametrize("shrink", [False, True])
def test_a_silent_peer_is_masked_after_the_timeout(shrink):
    run_ranks(_silent_peer, shrink)

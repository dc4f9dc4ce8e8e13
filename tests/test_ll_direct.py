"""The low-latency mode's peer-memory kernels (``moe_wave.deepep_compat.ll_direct``) on one GPU, or on CPU under
Triton's interpreter: P ranks emulated in one process, each rank's symmetric region an ordinary tensor that the others'
kernels address through the same pointer table, phases run rank after rank (all sends, then all receives) so
that no wait blocks. Checked against a reference built from the inputs alone: DeepEP's expert-major layout (sources
in rank order, each source's tokens in order), counts, ``layout_range``, source indices, bf16 rows bit for bit, FP8
bytes and scales in the three scale layouts, the statistics, the combine's weighted sums; repeated calls on both
buffer sets (the call numbers advance); a masked rank (skipped, not awaited); a rank that never sends (the wait
gives up, masks it, records the fault); expert ids out of range on one rank (every rank's outputs NaN, every rank's
guard holds the fault).
"""

from __future__ import annotations

import pytest
import torch

from moe_wave.comm.triton_gate import interpreting, triton
from moe_wave.deepep_compat.guard import IDS, Guard

# On a GPU the emulated ranks' regions are device memory and the kernels run for real (one GPU is enough: the phases
# still run rank after rank); on CPU under Triton's interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(triton is None or (DEVICE == "cpu" and not interpreting()),
                                reason="the kernels run on a GPU, or on CPU under TRITON_INTERPRET=1 (set by conftest)")

H, E, K, T = 512, 6, 3, 7


def _inputs(P: int, N_list, seed: int):
    out = []
    for r in range(P):
        g = torch.Generator().manual_seed(seed * 31 + r)
        N = N_list[r]
        # signed powers of two up to 16, 16 in every 128-channel group: the FP8 cast is exact (the interpreter's
        # fp32 -> fp8 conversion does not round as the GPU does), the scales still differ per group
        sign = torch.randint(0, 2, (N, H), generator=g).float() * 2 - 1
        x = (sign * 2.0 ** torch.randint(0, 5, (N, H), generator=g).float())
        x[:, ::128] = 16.0
        x = (x * 2.0 ** torch.arange(H // 128).repeat_interleave(128)).to(torch.bfloat16)
        ids = torch.rand(N, E, generator=g, dtype=torch.float32).topk(K, dim=1).indices
        ids[torch.rand(N, K, generator=g, dtype=torch.float32) < 0.2] = -1
        w = torch.rand(N, K, generator=g, dtype=torch.float32) + 0.1
        out.append((x, ids, w))
    return out


class Ranks:
    """P emulated ranks: regions (two sets each) in one process, one ``Region`` per rank over every address."""

    def __init__(self, P: int):
        from moe_wave.deepep_compat.ll_direct import make_region, region_layout

        self.P = P
        nbytes = 2 * region_layout(P, T, H, K, E)["bytes"]
        self.mem = [torch.zeros(nbytes, dtype=torch.uint8, device=DEVICE) for _ in range(P)]
        addrs = [m.data_ptr() for m in self.mem]
        self.rg = [make_region(P, T, H, K, E, DEVICE, addrs, keep=(self.mem,)) for _ in range(P)]
        self.mask = [torch.zeros(P, dtype=torch.int32, device=DEVICE) for _ in range(P)]
        # host words the kernels write (pinned: reachable from the GPU)
        self.fault = [torch.zeros(4, dtype=torch.int64, pin_memory=DEVICE == "cuda") for _ in range(P)]
        self.guards = [Guard(r, torch.device(DEVICE)) for r in range(P)]   # each rank's Buffer guard

    def dispatch(self, set_index, inputs, fp8=False, rnd=False, ue=False, send_ranks=None, timeout_ms=1000):
        from moe_wave.deepep_compat.ll_direct import dispatch_launch

        P, e = self.P, E // self.P
        inputs = _on_device(inputs)
        outs = []
        for r in range(P):
            recv = torch.zeros(e, P * T, H, dtype=torch.uint8 if fp8 else torch.bfloat16, device=DEVICE)
            sc = None
            if fp8:
                sc = torch.zeros(e, H // 512, P * T, dtype=torch.int32, device=DEVICE) if ue else \
                    torch.zeros(e, H // 128, P * T, dtype=torch.float32, device=DEVICE)
            outs.append(dict(recv=recv, sc=sc, info=torch.full((e, P * T), -1, dtype=torch.int32, device=DEVICE),
                             count=torch.zeros(e, dtype=torch.int32, device=DEVICE),
                             rng=torch.zeros(e, P, dtype=torch.int64, device=DEVICE),
                             stats=torch.zeros(e, dtype=torch.int32, device=DEVICE)))
        for r in range(P):
            if send_ranks is None or r in send_ranks:
                x, ids, _ = inputs[r]
                o = outs[r]
                dispatch_launch(self.rg[r], set_index, r, x, ids, self.mask[r], self.fault[r].data_ptr(), timeout_ms,
                                o["recv"], o["sc"], o["info"], o["count"], o["rng"], o["stats"], guard=self.guards[r],
                                send=True, recv=False, fp8=fp8, round_scale=rnd, ue8m0=ue, programs=3)
        for r in range(P):
            x, ids, _ = inputs[r]
            o = outs[r]
            dispatch_launch(self.rg[r], set_index, r, x, ids, self.mask[r], self.fault[r].data_ptr(), timeout_ms,
                            o["recv"], o["sc"], o["info"], o["count"], o["rng"], o["stats"], guard=self.guards[r],
                            send=False, recv=True, fp8=fp8, round_scale=rnd, ue8m0=ue, programs=3)
        return [{k: (v.cpu() if v is not None else None) for k, v in o.items()} for o in outs]

    def combine(self, set_index, inputs, ys, part_bf16=True, ranks=None, timeout_ms=1000):
        from moe_wave.deepep_compat.ll_direct import combine_launch

        P = self.P
        inputs, ys = _on_device(inputs), [y.to(DEVICE) for y in ys]
        outs = [torch.full((inputs[r][0].shape[0], H), float("nan"), dtype=torch.bfloat16, device=DEVICE)
                for r in range(P)]
        for step in ("weights", "partials", "recv"):
            for r in range(P) if ranks is None else ranks:
                _, ids, w = inputs[r]
                combine_launch(self.rg[r], set_index, r, ys[r].view(-1, H), ids, w, self.mask[r],
                               self.fault[r].data_ptr(), timeout_ms, outs[r], guard=self.guards[r],
                               weights=step == "weights",
                               partials=step == "partials", recv=step == "recv", part_bf16=part_bf16, programs=3)
        return [o.cpu() for o in outs]


def _on_device(inputs):
    return [tuple(t.to(DEVICE) for t in inp) for inp in inputs]


def _expect(inputs, P, r, live=None):
    """Per local expert of rank r: [(source, token)] in DeepEP's order, over the live sources."""
    e = E // P
    return [[(s, t) for s in range(P) if live is None or s in live for t in range(inputs[s][0].shape[0])
             if bool((inputs[s][1][t] == r * e + i).any())] for i in range(e)]


def _check_dispatch(outs, inputs, P, fp8=False, rnd=False, ue=False, live=None, calls=1):
    from moe_wave.deepep_compat.ll_kernels import pack_fp8_torch

    e = E // P
    for r in range(P):
        if live is not None and r not in live:
            continue
        o = outs[r]
        ref = _expect(inputs, P, r, live)
        for i in range(e):
            n = len(ref[i])
            assert int(o["count"][i]) == n, (r, i)
            assert int(o["stats"][i]) == n * calls
            begin = 0
            for s in range(P):
                got = int(o["rng"][i, s])
                c = sum(1 for q in ref[i] if q[0] == s)
                assert (got >> 32, got & 0xFFFFFFFF) == (begin, c), (r, i, s)
                begin += c
            assert o["info"][i, :n].tolist() == [t for _, t in ref[i]], (r, i)
            for j, (s, t) in enumerate(ref[i]):
                sx = inputs[s][0][t:t + 1]
                if not fp8:
                    assert torch.equal(o["recv"][i, j], sx[0]), (r, i, j)
                    continue
                row = torch.empty(1, H + 4 * (H // 128), dtype=torch.uint8)
                pack_fp8_torch(sx, row, rnd)
                assert torch.equal(o["recv"][i, j], row[0, :H]), (r, i, j)
                sc = row[0, H:].view(torch.float32)
                if ue:
                    got = o["sc"].view(torch.uint8).view(e, H // 512, P * T, 4)[i, :, j].reshape(-1)
                    assert torch.equal(got, (sc.view(torch.int32) >> 23).to(torch.uint8))
                else:
                    assert torch.equal(o["sc"][i, :, j], sc)


@pytest.mark.parametrize("P,N_list", [(2, [7, 5]), (3, [4, 0, 7]), (1, [6])], ids=["2ranks", "3ranks-empty", "1rank"])
def test_dispatch_and_combine_match_the_reference(P, N_list):
    rk = Ranks(P)
    e = E // P
    for call, (fp8, rnd, ue) in enumerate(((False, False, False), (True, False, False), (True, True, True),
                                           (False, False, False))):
        inputs = _inputs(P, N_list, call)
        set_index = call % 2
        outs = rk.dispatch(set_index, inputs, fp8, rnd, ue)
        _check_dispatch(outs, inputs, P, fp8, rnd, ue)
        if fp8:
            continue
        # the combine: expert i of rank r returns its rows times (i + 1); the source gets sum_k w_k (i_k + 1) x
        ys = [(outs[r]["recv"].float() * torch.arange(1, e + 1, dtype=torch.float32)[:, None, None]).to(
            torch.bfloat16) for r in range(P)]
        got = rk.combine(set_index, inputs, ys, part_bf16=call > 0)         # fp32 partials, then bf16
        for r in range(P):
            x, ids, w = inputs[r]
            loc = (ids % e + 1).float()
            ref = torch.zeros(x.shape[0], H)
            for k in range(K):     # the same values as the kernel's: bf16 products of x, summed in fp32
                yk = (x.float() * loc[:, k:k + 1]).to(torch.bfloat16).float()
                ref += torch.where(ids[:, k:k + 1] >= 0, yk * w[:, k:k + 1], 0.0)
            assert torch.allclose(got[r].float(), ref, rtol=1e-2, atol=1e-2), (call, r)
            assert not bool(got[r].isnan().any())
    for r in range(P):
        # two dispatches per set; combines after the bf16 calls 0 and 3 only
        assert rk.rg[r].state[:, 0].tolist() == [2, 2] and rk.rg[r].state[:, 1].tolist() == [1, 1]
        assert int(rk.fault[r][0]) == 0


@pytest.mark.parametrize("fp8,ue", [(False, False), (True, False), (True, True)], ids=["bf16", "fp8", "ue8m0"])
def test_ids_out_of_range_poison_every_rank_and_record_the_fault(fp8, ue):
    """Rank 1 passes ids outside [-1, E) (E, below -1, far above E): they are sent nowhere (the counts, layout and
    source indices are the reference's with them as -1), every rank's fault words reach every rank in the same
    dispatch, so every rank's received rows and scales are NaN bytes and its guard holds [IDS, rank 1, 3 ids, E, the
    first], in the device status and the pinned host words (read without a sync, raised naming the rank, the count,
    the first bad id and the rule); the combine's outputs are NaN while it is held; once raised, a clean round
    matches the reference."""
    P, e = 2, E // 2
    rk = Ranks(P)
    inputs = _inputs(P, [6, 7], 5)
    x1, ids1, w1 = inputs[1]
    ids1 = ids1.clone()
    ids1[0, 0], ids1[2, 1], ids1[4, 2] = E, -3, (1 << 40) + 1       # the last one wraps into range as int32
    inputs[1] = (x1, ids1, w1)
    outs = rk.dispatch(0, inputs, fp8=fp8, rnd=ue, ue=ue)
    clean = [(x, torch.where((i >= 0) & (i < E), i, -1), w) for x, i, w in inputs]
    for r in range(P):
        o, ref = outs[r], _expect(clean, P, r)
        assert [int(c) for c in o["count"]] == [len(q) for q in ref]
        for i in range(e):
            n = len(ref[i])
            assert o["info"][i, :n].tolist() == [t for _, t in ref[i]]
            rows = o["recv"][i, :n].view(torch.uint8)
            assert bool((rows == (0x7F if fp8 else 0xC0)).logical_or(rows == 0x7F).all()), (r, i)
            if fp8:
                sc = o["sc"][i, ..., :n]
                assert bool((sc.view(torch.uint8) == 0xFF).all()) if ue else bool(torch.isnan(sc).all())
        g = rk.guards[r]
        want = [IDS, 1, 3, E, E, 0]
        assert g.status.tolist() == want and g._host.tolist() == want, (r, g.status.tolist(), g._host.tolist())
    ys = [torch.ones(e, P * T, H, dtype=torch.bfloat16) for _ in range(P)]
    got = rk.combine(0, inputs, ys)
    assert all(bool(torch.isnan(o.float()).all()) for o in got)
    for r in range(P):
        with pytest.raises(ValueError) as info:
            rk.guards[r].raise_if_flagged("low_latency_combine")
        msg = str(info.value)
        assert msg.startswith(f"deep_ep.Buffer.low_latency_combine: rank 1 passed 3 topk_idx entries outside [-1, {E}) "
                              f"(the first: {E}; num_experts={E}; an expert id must be -1 or in [0, num_experts))"), msg
    clean_inputs = _inputs(P, [6, 7], 6)
    outs = rk.dispatch(1, clean_inputs)
    _check_dispatch(outs, clean_inputs, P)
    assert all(g.status.tolist() == [0] * 6 for g in rk.guards)


def test_a_masked_rank_is_skipped():
    P = 3
    rk = Ranks(P)
    for r in (0, 2):
        rk.mask[r][1] = 1
    rk.mask[1][:] = torch.tensor([1, 0, 1], dtype=torch.int32)        # rank 1 alone
    inputs = _inputs(P, [5, 6, 4], 9)
    outs = rk.dispatch(0, inputs)
    _check_dispatch(outs, inputs, P, live={0, 2})
    # rank 1 sees only its own tokens
    e = E // P
    ref1 = [[(1, t) for t in range(6) if bool((inputs[1][1][t] == e + i).any())] for i in range(e)]
    assert [int(c) for c in outs[1]["count"]] == [len(q) for q in ref1]
    assert all(int(f[0]) == 0 for f in rk.fault)


def test_a_silent_peer_is_masked_and_recorded():
    P = 2
    rk = Ranks(P)
    inputs = _inputs(P, [5, 4], 3)
    outs = rk.dispatch(0, inputs, send_ranks={0}, timeout_ms=1)        # rank 1 never sends
    assert rk.fault[0].tolist() == [1, 1, 1, 1]                          # [poison, peer, call, site: dispatch]
    assert rk.mask[0].tolist() == [0, 1]
    _check_dispatch(outs[:1], inputs, P, live={0})


def test_a_peer_silent_in_the_combine_is_masked_and_its_share_left_out():
    """Rank 1 dispatches but never combines: rank 0's expert side waits for rank 1's weights only when it reaches
    rank 1's tokens (its own come first), gives up, masks and records rank 1 (site 2: the weights), and still returns
    the sums of its own experts for its own tokens."""
    P = 2
    e = E // P
    rk = Ranks(P)
    inputs = _inputs(P, [6, 5], 4)
    outs = rk.dispatch(0, inputs)
    ys = [(outs[r]["recv"].float() * 2.0).to(torch.bfloat16) for r in range(P)]
    got = rk.combine(0, inputs, ys, ranks=[0], timeout_ms=1)
    assert rk.fault[0].tolist() == [1, 1, 1, 2]                          # [poison, peer, call, site: weights]
    assert rk.mask[0].tolist() == [0, 1]
    x, ids, w = inputs[0]
    own = (ids >= 0) & (ids // e == 0)
    y = (x.float() * 2.0).to(torch.bfloat16).float()
    ref = (y[:, None, :] * torch.where(own, w, 0.0)[:, :, None]).sum(1)
    assert torch.allclose(got[0].float(), ref, rtol=1e-2, atol=1e-2)


def test_direct_ll_check_raises_or_shrinks():
    from types import SimpleNamespace

    from moe_wave.deepep_compat.ll_direct import DirectLL

    ep = SimpleNamespace(rank=0, size=2, device=torch.device("cpu"))
    for shrink in (False, True):
        d = DirectLL(ep, 5, shrink=shrink)
        d.check()                                               # nothing recorded: nothing raised
        d.fault[:] = torch.tensor([1, 1, 3, 2])
        if shrink:
            d.check()
        else:
            with pytest.raises(RuntimeError, match=r"gave up waiting for rank 1 \(call 3\).*timeout_ms=5"):
                d.check()
        assert d.fault.tolist() == [0, 0, 0, 0]


def test_relaunch_keys_tell_regions_apart(monkeypatch):
    """The relaunch cache (``triton_launch.Launcher``) is shared by every region of the process, so the key of a
    launch must name the region's geometry: two regions that differ only in their rank count, called with the same
    options, get different keys (on a GPU the second one ran the first one's constants before this was so)."""
    import moe_wave.deepep_compat.ll_direct as L

    keys = []

    def record(grid, args, consts, opts, key=None, fast=True):
        keys.append((key, consts["P"]))

    monkeypatch.setattr(L, "_DISPATCH", record)
    monkeypatch.setattr(L, "_COMBINE", record)
    for P in (1, 2):
        rk = Ranks(P)
        inputs = _inputs(P, [6] * P, 1)
        rk.dispatch(0, inputs)
        rk.combine(0, inputs, [torch.zeros(E // P, P * T, H, dtype=torch.bfloat16) for _ in range(P)])
    by_key = {}
    for key, P in keys:
        by_key.setdefault(key, set()).add(P)
    assert all(len(ps) == 1 for ps in by_key.values()), "one relaunch key served regions of different rank counts"
    assert {P for _, P in keys} == {1, 2}

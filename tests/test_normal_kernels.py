"""Normal mode's direct kernels (``moe_wave.deepep_compat.normal_kernels``) on one GPU, or under Triton's interpreter
on CPU; P = 1, 2, 3 ranks emulated in one process: every rank's "symmetric" memory is an ordinary tensor (device
memory on a GPU), every rank's senders run (phase 1), then every rank's receivers (phase 2), so that no wait
blocks. Checked against torch references: the
rows and their order (grouped by source rank, each source's tokens in order), bytes of fp8 rows and strided scales,
the combine's sums bit for bit (fp32, rank order, then the biases), the layout, repeated calls (call numbers and
acks advancing, a region that grows) and a missing peer (a fault, not a hang)."""

from __future__ import annotations

import pytest
import torch

from moe_wave.comm.triton_gate import interpreting, triton
from moe_wave.deepep_compat import normal_kernels as nk

# On a GPU the emulated ranks' regions are device memory and the kernels run for real (one GPU is enough: the phases
# run rank after rank); on CPU under Triton's interpreter. Tests build inputs and references on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(triton is None or (DEVICE == "cpu" and not interpreting()),
                                reason="needs triton: a GPU, or TRITON_INTERPRET=1 on CPU (set by conftest)")



class World:
    """P emulated ranks: ``alloc`` of rank r returns the k-th shared allocation on its k-th call (collective)."""

    def __init__(self, P: int, timeout_ms: int = 2000, sms: int | None = None):
        self.P, self.allocs, self.calls = P, [], [0] * P
        self.states = [nk.NormalState(r, P, DEVICE, self._alloc_for(r), timeout_ms, sms=sms) for r in range(P)]

    def _alloc_for(self, r: int):
        def alloc(nbytes: int):
            k = self.calls[r]
            self.calls[r] += 1
            if k == len(self.allocs):
                self.allocs.append([torch.zeros(nbytes + 64, dtype=torch.uint8, device=DEVICE)[:nbytes]
                                    for _ in range(self.P)])
            assert self.allocs[k][0].numel() == nbytes, "ranks allocated different sizes"
            return self.allocs[k]
        return alloc

    def plans(self, in_ranks, nch: int, pad: int = 0):
        in_ranks = [_dev(m) for m in in_ranks]
        G = torch.stack([nk.channel_counts(m, nch) for m in in_ranks])       # [P(src), P(dst), nch]
        counts = G.sum(2)
        recv = counts.sum(0)
        cap = max(int(recv.max()) + pad, 1)
        return [nk.make_plan(r, in_ranks[r], G, int(recv[r]) + pad, cap, None if pad else int(recv[r]))
                for r in range(self.P)]

    def dispatch(self, plans, a, b, rows, skip=()):
        a, b = [_dev(t) for t in a], [_dev(t) for t in b]
        outs = [nk.dispatch(self.states[r], plans[r], a[r], b[r], rows=rows, phase=1) if r not in skip else None
                for r in range(self.P)]
        for r in range(self.P):
            if r not in skip:
                nk.dispatch(self.states[r], plans[r], a[r], b[r], rows=rows, phase=2, out=outs[r])
        return [_host(o) for o in outs]

    def combine(self, plans, y, w, biases, rows, split=2):
        y, w, biases = [_dev(t) for t in y], [_dev(t) for t in w], [_dev(t) for t in biases]
        outs = [nk.combine(self.states[r], plans[r], y[r], w[r], biases[r], rows=rows, split=split, phase=1)
                for r in range(self.P)]
        for r in range(self.P):
            nk.combine(self.states[r], plans[r], y[r], w[r], biases[r], rows=rows, split=split, phase=2, out=outs[r])
        return [_host(o) for o in outs]


def _dev(t):
    """Tensors (or tuples of them, or None) on DEVICE, strides kept."""
    if isinstance(t, (tuple, list)):
        return type(t)(_dev(x) for x in t)
    return t.to(DEVICE) if isinstance(t, torch.Tensor) else t


def _host(t):
    if isinstance(t, (tuple, list)):
        return type(t)(_host(x) for x in t)
    return t.cpu() if isinstance(t, torch.Tensor) else t


def _routing(g, P, T_list, E, K):
    """Per rank: top-k ids (some -1, some tokens sent nowhere), is_token_in_rank."""
    e = E // P
    ids, in_rank = [], []
    for T in T_list:
        i = (torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T
             else torch.zeros(0, K, dtype=torch.long))
        drop = torch.rand(T, K, generator=g) < 0.3
        i = torch.where(drop, -1, i)
        if T > 2:
            i[1] = -1                                           # a token sent nowhere
        m = torch.zeros(T, P, dtype=torch.bool)
        for t in range(T):
            for k in i[t].tolist():
                if k >= 0:
                    m[t, k // e] = True
        ids.append(i)
        in_rank.append(m)
    return ids, in_rank


def _same_bf16(got: torch.Tensor, acc: torch.Tensor) -> bool:
    """``got`` is the fp32 ``acc`` rounded to bf16: to nearest even (the GPU) or toward zero (Triton's interpreter
    casts so), element by element."""
    rtz = (acc.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    return got.dtype == torch.bfloat16 and bool(((got == acc.to(torch.bfloat16)) | (got == rtz)).all())


def _expect_rows(xs, in_rank, d):
    """Rank d's received rows: source 0's rows first, each source's in its token order."""
    return torch.cat([xs[s][in_rank[s][:, d]] for s in range(len(xs))])


@pytest.mark.parametrize("P,T_list", [(1, [7]), (2, [13, 0]), (2, [21, 9]), (3, [10, 17, 5])])
@pytest.mark.parametrize("nch,rows", [(3, 4), (2, 8)])
def test_dispatch_and_combine_match_torch(P, T_list, nch, rows):
    g = torch.Generator().manual_seed(P * 100 + sum(T_list) + nch)
    E, K, H = 6 * P, 3, 40
    world = World(P)
    for call in range(3):                                       # repeated calls: flags and acks advance
        ids, in_rank = _routing(g, P, T_list, E, K)
        plans = world.plans(in_rank, nch)
        xs = [torch.randn(T, H, generator=g).to(torch.bfloat16) for T in T_list]
        meta = [torch.cat([ids[r].to(torch.int32), torch.arange(T_list[r], dtype=torch.int32)[:, None]], 1)
                for r in range(P)]
        outs = world.dispatch(plans, [x.view(torch.int32) for x in xs], meta, rows)
        for d in range(P):
            oa, ob = outs[d]
            assert torch.equal(oa.view(torch.bfloat16), _expect_rows(xs, in_rank, d)), (call, d)
            assert torch.equal(ob, _expect_rows(meta, in_rank, d)), (call, d)
        # combine: rank r's rows times (r + 1) in bf16, weights; each source sums its tokens' rows in rank order
        ys = [(outs[r][0].view(torch.bfloat16).float() * (r + 1)).to(torch.bfloat16) for r in range(P)]
        ws = [torch.randn(ys[r].shape[0], K, generator=g) for r in range(P)]
        biases = [(torch.randn(T, H, generator=g).to(torch.bfloat16), torch.randn(T, H, generator=g))
                  for T in T_list]
        got = world.combine(plans, ys, ws, biases, rows)
        for s in range(P):
            acc = torch.zeros(T_list[s], H)
            accw = torch.zeros(T_list[s], K)
            for p in range(P):
                head = plans[s].head[:, p].long().cpu()
                base = sum(int(in_rank[q][:, p].sum()) for q in range(s))     # s's first row on rank p
                m = head >= 0
                src = (base + head).clamp(min=0)
                if ys[p].shape[0]:
                    acc += torch.where(m[:, None], ys[p][src.clamp(max=ys[p].shape[0] - 1)].float(), 0.0)
                    accw += torch.where(m[:, None], ws[p][src.clamp(max=ys[p].shape[0] - 1)], 0.0)
            acc += biases[s][0].float()
            acc += biases[s][1].float()
            assert _same_bf16(got[s][0], acc), (call, s)
            assert torch.equal(got[s][1], accw), (call, s)
        for st in world.states:
            assert st.fault.tolist() == [0, 0, 0]
            assert st.words[:, 0].tolist() == [call + 1, call + 1]     # the call numbers advanced on the device


def test_fp8_bytes_strided_scales_and_a_growing_region():
    P, E, K, H, S = 3, 9, 2, 64, 4
    g = torch.Generator().manual_seed(7)
    world = World(P)
    for T_list in ([6, 4, 5], [30, 25, 28]):                    # the second call outgrows the first regions
        _, in_rank = _routing(g, P, T_list, E, K)
        plans = world.plans(in_rank, 2)
        x8 = [torch.randn(T, H, generator=g).to(torch.float8_e4m3fn) for T in T_list]
        sc = [torch.randn(S, T, generator=g).t() for T in T_list]   # column-major scales
        outs = world.dispatch(plans, [x.view(torch.uint8).view(torch.int32) for x in x8],
                              [s.view(torch.int32) for s in sc], 4)
        for d in range(P):
            oa, ob = outs[d]
            assert torch.equal(oa.view(torch.uint8), _expect_rows([x.view(torch.uint8) for x in x8], in_rank, d))
            assert torch.equal(ob.view(torch.float32), _expect_rows(sc, in_rank, d))
    assert len(world.allocs) == 3       # the control words, then the dispatch region and its grown successor


def test_worst_case_rows_past_the_count_are_untouched_and_fp32_combine():
    P, E, K, H = 2, 4, 2, 24
    g = torch.Generator().manual_seed(3)
    world = World(P)
    T_list = [9, 6]
    _, in_rank = _routing(g, P, T_list, E, K)
    plans = world.plans(in_rank, 2, pad=5)
    xs = [torch.randn(T, H, generator=g) for T in T_list]
    b = [torch.arange(T, dtype=torch.int32)[:, None] for T in T_list]
    outs = [_dev((torch.full((p.rows, H), 7, dtype=torch.int32), torch.full((p.rows, 1), 7, dtype=torch.int32)))
            for p in plans]
    for phase in (1, 2):
        for r in range(P):
            nk.dispatch(world.states[r], plans[r], _dev(xs[r].view(torch.int32)), _dev(b[r]), rows=4, phase=phase,
                        out=outs[r])
    outs = _host(outs)
    for d in range(P):
        n = _expect_rows(xs, in_rank, d).shape[0]
        assert torch.equal(outs[d][0][:n].view(torch.float32), _expect_rows(xs, in_rank, d))
        assert bool((outs[d][0][n:] == 7).all()) and bool((outs[d][1][n:] == 7).all())
        assert plans[d].recv_pad[:, 0].tolist() == [j >= n for j in range(plans[d].rows)]
    # padding rows are never sent back: huge values there change nothing
    ys = [torch.cat([o[0].view(torch.float32)[:p.rows - 5], torch.full((5, H), 1e30)]) for o, p in zip(outs, plans)]
    got = world.combine(plans, ys, [None] * P, [()] * P, 4, split=3)
    for s in range(P):
        ref = xs[s] * in_rank[s].sum(1, keepdim=True)      # x + x where both ranks got it, fp32 from 0
        ref2 = torch.zeros_like(xs[s])
        for p in range(P):
            ref2 += torch.where(in_rank[s][:, p:p + 1], xs[s], 0.0)
        assert torch.equal(got[s][0], ref2) and torch.allclose(got[s][0], ref)
        assert got[s][1] is None


def test_missing_peer_is_a_fault_not_a_hang():
    P, E, K, H = 2, 4, 2, 16
    g = torch.Generator().manual_seed(5)
    world = World(P, timeout_ms=1)
    T_list = [8, 8]
    ids, in_rank = _routing(g, P, T_list, E, K)
    in_rank[1][0, 0] = True                                     # rank 1 sends rank 0 at least one row
    plans = world.plans(in_rank, 2)
    xs = [torch.randn(T, H, generator=g) for T in T_list]
    world.dispatch(plans, [x.view(torch.int32) for x in xs], [None, None], 4, skip=(1,))
    assert world.states[0].fault.tolist()[:2] == [1, 1]         # rank 0 waited for rank 1, gave up, recorded it
    assert world.states[0].fault.tolist()[2] == 1               # in call 1
    with pytest.raises(RuntimeError, match="waited past 1 ms for rank 1 in call 1"):
        world.states[0].check("dispatch")
    world.states[1].check("dispatch")                           # rank 1 saw nothing wrong


def test_missing_peer_in_a_combine_is_a_fault_and_nan():
    P, E, K, H = 2, 4, 2, 16
    g = torch.Generator().manual_seed(6)
    world = World(P, timeout_ms=1)
    T_list = [8, 8]
    _, in_rank = _routing(g, P, T_list, E, K)
    in_rank[0][0] = True                                        # rank 0's token 0 goes to both ranks
    in_rank[0][4:] = torch.tensor([True, False])                # channel 1 (tokens 4..7) stays on rank 0
    plans = world.plans(in_rank, 2)
    xs = [torch.randn(T, H, generator=g) for T in T_list]
    outs = world.dispatch(plans, [x.view(torch.int32) for x in xs], [None, None], 4)
    ys = [o[0].view(torch.float32) for o in outs]
    # rank 1 (expert side) never sends its rows back; rank 0 sums without them
    got = nk.combine(world.states[0], plans[0], _dev(ys[0]), None, (), rows=4, split=1, phase=2)[0].cpu()
    assert world.states[0].fault.tolist() == [1, 1, 1]
    assert bool(got[0].isnan().all())                           # the block of a token that needed rank 1's row
    assert torch.equal(got[4:], xs[0][4:])                      # the tokens of a block that did not


@pytest.mark.parametrize("P,T", [(1, 5), (2, 0), (3, 37)])
def test_layout_matches_torch(P, T):
    g = torch.Generator().manual_seed(T + P)
    E, K = 8 * P, 5
    ids, _ = _routing(g, P, [T], E, K)
    got = _host(nk.dispatch_layout(_dev(ids[0]), E, P, rows=16))
    ref = nk.layout_torch(ids[0], E, P)
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert nk.last_sms().get("layout", 1) >= 1


def test_a_wrong_prefix_fails():
    """The check can fail: a plan whose send base is off by one row puts rows in the wrong place."""
    P, E, K, H = 2, 4, 2, 8
    g = torch.Generator().manual_seed(11)
    world = World(P)
    T_list = [6, 6]
    _, in_rank = _routing(g, P, T_list, E, K)
    in_rank[0][:, :] = True
    plans = world.plans(in_rank, 2)
    bad = plans[1].tab.clone()
    bad[0] -= 1                                                 # rank 1 writes rank 0's rows one row early
    plans[1] = nk.DirectPlan(**{**plans[1].__dict__, "tab": bad})
    xs = [torch.randn(T, H, generator=g) for T in T_list]
    outs = world.dispatch(plans, [x.view(torch.int32) for x in xs], [None, None], 4)
    assert not torch.equal(outs[0][0][:_expect_rows(xs, in_rank, 0).shape[0]].view(torch.float32),
                           _expect_rows(xs, in_rank, 0))


def test_both_roles_in_one_launch():
    """Phase 0 (the GPU path: senders and receivers in one launch, the last program acks): rank 1's senders run
    first, then rank 0's single launch (its receivers find rank 1's rows landed), then rank 1's receivers."""
    P, E, K, H = 2, 4, 2, 24
    g = torch.Generator().manual_seed(8)
    world = World(P)
    for call in range(3):
        _, in_rank = _routing(g, P, [11, 7], E, K)
        plans = world.plans(in_rank, 3)
        xs = [torch.randn(T, H, generator=g) for T in (11, 7)]
        a = [_dev(x.view(torch.int32)) for x in xs]
        out1 = nk.dispatch(world.states[1], plans[1], a[1], None, rows=4, phase=1)
        out0 = nk.dispatch(world.states[0], plans[0], a[0], None, rows=4, phase=0)
        nk.dispatch(world.states[1], plans[1], a[1], None, rows=4, phase=2, out=out1)
        for d, o in ((0, out0), (1, out1)):
            assert torch.equal(o[0].cpu().view(torch.float32), _expect_rows(xs, in_rank, d)), (call, d)
        ys = [out0[0].view(torch.float32), out1[0].view(torch.float32)]
        c1 = nk.combine(world.states[1], plans[1], ys[1], None, (), rows=4, phase=1)
        c0 = nk.combine(world.states[0], plans[0], ys[0], None, (), rows=4, phase=0)
        nk.combine(world.states[1], plans[1], ys[1], None, (), rows=4, phase=2, out=c1)
        for s, c in ((0, c0), (1, c1)):
            ref = torch.zeros_like(xs[s])
            for p in range(P):
                ref += torch.where(in_rank[s][:, p:p + 1], xs[s], 0.0)
            assert torch.equal(c[0].cpu(), ref), (call, s)
        for st in world.states:
            assert st.fault.tolist() == [0, 0, 0] and st.words[:, 0].tolist() == [call + 1, call + 1]
            assert st.words[:, 1].tolist() == [0, 0]            # the done counters reset by the last program

"""The symm backend's Triton kernels against their torch twins, as ordinary tests on every device that runs them:
CPU under Triton's interpreter (the test session turns it on where no GPU is visible, see conftest.py) and
CUDA (``gpu``-marked, run by launch/gpu_all.sh). Blocks are separate tensors, and views of one tensor at offsets
that do (unit 16) and do not (unit 1) allow 16-element aligned stores."""

from __future__ import annotations

import pytest
import torch

from moe_wave.comm.layout import WavePlan, compute_layout
from moe_wave.comm.options import CopyTuning
from moe_wave.comm.symm_kernels import RowTargets, gather_add, gather_add_torch, scatter_rows, scatter_rows_torch
from moe_wave.comm.symm_plan import wave_token_ranges
from moe_wave.comm.symm_signal import barrier_torch, barrier_wait, wait_flags, wait_flags_torch
from moe_wave.comm.symm_tables import (POISON, STATUS_LEN, build_tables, build_tables_torch, count_rows,
                                       count_rows_torch, densify, densify_torch)
from moe_wave.comm.triton_gate import interpreting, triton

DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(triton is None or not interpreting(),
                                                        reason="needs triton and TRITON_INTERPRET=1 on CPU")),
           pytest.param("cuda", marks=pytest.mark.gpu)]


def _rand(g, dev, *shape, dt=torch.float32):
    return (torch.randn(*shape, generator=g) * 100).to(dt).to(dev)


def test_scatter_rows_torch_never_writes_skipped_rows():
    src = torch.randn(5, 7)
    blocks = [torch.full((4, 7), 3.0), torch.full((4, 7), 4.0)]
    scatter_rows_torch(src, blocks, torch.tensor([[4, 0, 2], [1, 1, 1]]), torch.tensor([[1, -1, 3], [-1, -1, 0]]))
    assert torch.equal(blocks[0][1], src[4]) and torch.equal(blocks[0][3], src[2]) and torch.equal(blocks[1][0], src[1])
    assert torch.equal(blocks[0][[0, 2]], torch.full((2, 7), 3.0)) and torch.equal(blocks[1][1:], torch.full((3, 7), 4.0))


def test_row_targets_reject_mismatched_blocks():
    with pytest.raises(ValueError, match="block 1 is"):
        RowTargets.of([torch.zeros(4, 8), torch.zeros(4, 9)])
    with pytest.raises(ValueError, match="block 1 is"):
        RowTargets.of([torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.float16)])


# grid > 0: a capped grid, each program walks several tiles; rows: the rows a program keeps in flight
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dt,grid,rows", [(torch.float32, 0, 1), (torch.bfloat16, 0, 1), (torch.int32, 0, 4),
                                          (torch.bfloat16, 3, 1), (torch.bfloat16, 2, 2)])
def test_scatter_rows_matches_torch(dev, dt, grid, rows):
    g = torch.Generator().manual_seed(0)
    tune = CopyTuning(grid=grid, rows=rows)

    def rand(*shape, dt=torch.float32):
        return _rand(g, dev, *shape, dt=dt)

    for D in (1, 37, 2500, 4096):
        for P, skip in ((1, None), (3, None), (3, 1), (3, 2)):
            C, N, S = 6, 8, 9
            src, meta = rand(S, D, dt=dt), rand(S + 2, 5, dt=torch.int32)
            for layout in ("separate", "views"):
                if layout == "separate":
                    blocks, mblocks = [rand(C, D, dt=dt) for _ in range(P)], [rand(C, 5, dt=torch.int32) for _ in range(P)]
                else:   # one tensor, blocks C+1 rows apart (unit 1 unless D is a multiple of 16)
                    whole, mwhole = rand(P * (C + 1), D, dt=dt), rand(P * (C + 1), 5, dt=torch.int32)
                    blocks = [whole[p * (C + 1):p * (C + 1) + C] for p in range(P)]
                    mblocks = [mwhole[p * (C + 1):p * (C + 1) + C] for p in range(P)]
                tg, tm = RowTargets.of(blocks), RowTargets.of(mblocks)
                if layout == "views":
                    assert tg.unit == (16 if D % 16 == 0 else 1), (D, tg.unit)
                si = torch.randint(0, S, (P, N), generator=g).to(dev)
                mi = torch.randint(0, S + 2, (P, N), generator=g).to(dev)
                di = torch.stack([torch.tensor([0, 5, -1, 2, -1, 1, 3, -1]).roll(p) for p in range(P)]).to(dev)
                ref, mref = [b.clone() for b in blocks], [b.clone() for b in mblocks]
                spare = whole[C::C + 1].clone() if layout == "views" else None
                scatter_rows(src, tg, si, di, meta, tm, mi, skip=skip, tune=tune)
                scatter_rows_torch(src, ref, si, di, skip=skip)
                scatter_rows_torch(meta, mref, mi, di, skip=skip)
                for p in range(P):
                    assert torch.equal(blocks[p], ref[p]), (dt, D, P, layout, p, grid, rows, skip)
                    assert torch.equal(mblocks[p], mref[p]), (dt, D, P, layout, p, "meta")
                if spare is not None:   # the spare row after each block is never written
                    assert torch.equal(whole[C::C + 1], spare)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dt,grid,rows", [(torch.float32, 0, 1), (torch.bfloat16, 0, 1), (torch.bfloat16, 2, 1),
                                          (torch.bfloat16, 0, 4), (torch.float32, 1, 2)])
def test_gather_add_matches_torch(dev, dt, grid, rows):
    g = torch.Generator().manual_seed(1)
    tune = CopyTuning(grid=grid, rows=rows)

    def rand(*shape, dt=torch.float32):
        return _rand(g, dev, *shape, dt=dt)

    for D in (1, 37, 2500):
        for local in (None, 0, 1):
            out = rand(5, D)
            ref, other = out.clone(), out.clone()
            src, loc = rand(8, D, dt=dt), rand(8, D, dt=dt)
            slot = torch.tensor([[0, 7], [-1, 4], [3, -1], [-1, -1], [1, 6]]).to(dev)
            gather_add(out, src, slot, loc if local is not None else None, local, tune=tune)
            gather_add_torch(ref, src, slot, loc, local)
            assert torch.equal(out, ref), (dt, D, grid, rows, local)
            fresh, fref = torch.full_like(out, float("nan")), torch.zeros_like(out)   # accumulate=False: =, not +=
            gather_add(fresh, src, slot, loc if local is not None else None, local, accumulate=False, tune=tune)
            gather_add_torch(fref, src, slot, loc, local)
            assert torch.equal(fresh, fref), (dt, D, grid, rows, local, "accumulate=False")
            if local is not None:   # block `local` really came from loc: from src, the sums differ
                gather_add_torch(other, src, slot)
                assert not torch.equal(out, other), (dt, D, local)
            # the layer's end: + add after the peers, stored in dst's dtype; out is only read (accumulate)
            for acc in (True, False):
                for ddt in (torch.bfloat16, torch.float32):
                    add = rand(5, D, dt=torch.bfloat16)
                    out2 = rand(5, D)
                    keep, ref2 = out2.clone(), out2.clone()
                    dst, dref = torch.full((5, D), float("nan"), dtype=ddt, device=dev), torch.empty((5, D), dtype=ddt, device=dev)
                    gather_add(out2, src, slot, loc if local is not None else None, local, accumulate=acc,
                               add_TD=add, dst_TD=dst, tune=tune)
                    gather_add_torch(ref2, src, slot, loc, local, accumulate=acc, add_TD=add, dst_TD=dref)
                    if dev == "cpu" and ddt == torch.bfloat16:   # the interpreter truncates to bf16: within 1 ulp
                        assert torch.allclose(dst.float(), dref.float(), rtol=2 ** -7, atol=0), (D, acc, "add/dst")
                    else:    # the GPU rounds to nearest even, as torch does
                        assert torch.equal(dst, dref), (dt, D, grid, rows, local, acc, ddt, "add/dst")
                    assert torch.equal(out2, keep), "with dst, out is read, never written"
                    steps = keep.clone() if acc else torch.zeros_like(keep)   # the unfused operations
                    gather_add_torch(steps, src, slot, loc, local)
                    assert torch.equal(dref, (steps + add.float()).to(ddt)), (D, acc, ddt)


@pytest.mark.parametrize("dev", DEVICES)
def test_count_rows_and_build_tables_match_torch(dev):
    g = torch.Generator().manual_seed(2)
    for P, W, e, T, K, C, A in ((1, 1, 4, 9, 2, 16, 0), (3, 2, 4, 20, 3, 7, 4), (2, 4, 8, 33, 4, 5, 0),
                                (4, 1, 2, 0, 2, 3, 3)):
        E = P * e
        # the extra words a rank adds to its rows (A of them), before the id range that build_tables reads last
        extra = [None if not A else (torch.arange(A) + 100 * src - 7).to(dev) for src in range(P)]
        layouts = []
        for src in range(P):    # every rank's layout; ids out of range on rank P-1 when P > 2
            ids = torch.argsort(torch.rand(T, E, generator=g), 1)[:, :K]
            if P > 2 and src == P - 1 and T:
                ids[0, 0] = E + 3
            layouts.append(compute_layout(ids.to(dev), torch.rand(T, K, generator=g).to(dev),
                                          WavePlan.make(num_ranks=P, num_local_experts=e, num_waves=W)))
        X = W * P + W * e + A + 2
        sent = [count_rows_torch(lay.send_counts_WP, lay.pair_counts_WPe, lay.ids_min, lay.ids_max, extra=extra[src])
                for src, lay in enumerate(layouts)]
        for src, lay in enumerate(layouts):   # count_rows writes row src of every rank's ctrl
            ctrls = [torch.full((P, X), -7, dtype=torch.long, device=dev) for _ in range(P)]
            count_rows(RowTargets.of(c[src:src + 1] for c in ctrls), lay.send_counts_WP, lay.pair_counts_WPe,
                       lay.ids_min, lay.ids_max, extra=extra[src])
            if A:
                assert torch.equal(sent[src][:, W * P + W * e:W * P + W * e + A].cpu(),
                                   extra[src].cpu().view(1, A).expand(P, A))
            for p in range(P):
                assert torch.equal(ctrls[p][src], sent[src][p]), (P, W, src, p)
                assert bool((ctrls[p][torch.arange(P, device=dev) != src] == -7).all()), "only row src is written"
        for me, lay in enumerate(layouts):
            recv_PX = torch.stack([sent[src][me] for src in range(P)])
            got, ref = [], []
            for fn, acc in ((build_tables, got), (build_tables_torch, ref)):
                for status0 in (torch.zeros(STATUS_LEN, dtype=torch.long),
                                 torch.tensor([0, 0, 0, 0, 0, 1, 5, 5, 5, 1, 0, 0])):
                    slot = torch.full((W, T, P), -1, dtype=torch.long, device=dev)
                    status = status0.to(dev)
                    tabs = fn(recv_PX, lay.send_counts_WP, lay.send_token_S, C, T, me, E, slot, status)
                    acc.append((tabs, slot, status))
            for (ta, sa, xa), (tb, sb, xb) in zip(got, ref):
                for k in tb:
                    assert torch.equal(ta[k], tb[k]), (P, W, T, C, me, k)
                assert torch.equal(sa, sb), (P, W, T, C, me, "slot")
                assert xa[POISON] == xb[POISON] == int(bool(xb[0] or xb[5])), (xa.tolist(), xb.tolist())
                if xb[0] or xb[5]:   # flags and the fields they name (the rest is junk when no flag is set)
                    n = [0, 5] + ([1, 2, 3, 4] if xb[0] else []) + ([6, 7, 8] if xb[5] else [])
                    assert torch.equal(xa[n], xb[n]), (P, W, T, C, me, xa.tolist(), xb.tolist())
                else:
                    assert xa[0] == 0 and xa[5] == 0, xa.tolist()
            assert bool(got[0][2][0]) == bool((torch.stack([lay.send_counts_WP for lay in layouts]) > C).any())


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("part", ["experts", "tokens"])
def test_densify_matches_torch(dev, part):
    """Dense blocks: the one-launch densify against its torch twin (C < T: rows past the capacity lose their slot)."""
    g = torch.Generator().manual_seed(3)
    for P, W, e, T, K, C in ((2, 1, 4, 9, 3, 16), (3, 2, 4, 20, 3, 7), (2, 3, 2, 13, 2, 5), (2, 2, 2, 0, 2, 4)):
        E = P * e
        ids = torch.argsort(torch.rand(T, E, generator=g), 1)[:, :K].to(dev)
        lay = compute_layout(ids, torch.rand(T, K, generator=g).to(dev),
                             WavePlan.make(num_ranks=P, num_local_experts=e, num_waves=W, partition=part))
        W = lay.plan.num_waves       # "experts" clamps the waves to e
        recv_PX = count_rows_torch(lay.send_counts_WP, lay.pair_counts_WPe, lay.ids_min, lay.ids_max)
        slot = torch.full((W, T, P), -1, dtype=torch.long, device=dev)
        tabs = build_tables(recv_PX, lay.send_counts_WP, lay.send_token_S, C, T, 0, E, slot,
                            torch.zeros(STATUS_LEN, dtype=torch.long, device=dev))
        meta_SM = torch.cat([lay.send_expert_SK, lay.send_weight_SK.view(torch.int32)], 1)
        ranges = wave_token_ranges(T, W, part)
        s1, s2 = slot.clone(), slot.clone()
        m1 = densify(s1, tabs["row_WPN"], meta_SM, torch.tensor(ranges, dtype=torch.long, device=dev).view(W, 2), C, K,
                     max(n for _, n in ranges))
        m2 = densify_torch(tabs["tok_WPN"], tabs["row_WPN"], tabs["send_dst_WPN"], meta_SM, s2,
                           torch.tensor([a for a, _ in ranges], dtype=torch.long, device=dev), C, K)
        assert torch.equal(m1, m2), (part, P, W, T, C)
        assert torch.equal(s1, s2), (part, P, W, T, C, "slot")
        if C >= T:    # no row lost: every (token, peer) with a slot keeps one, and rows with metadata match
            assert torch.equal(s1 >= 0, slot >= 0), (part, P, W, T)
            assert int((m1[..., :K] >= 0).sum()) == int((lay.send_expert_SK >= 0).sum())
    


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("flags,val0,status0", [([1, 1, 1], 0, [0, 0, 0]), ([5, 4, 6], 3, [0, 0, 0]),
                                                ([1, 0, 1], 0, [0, 0, 0]), ([2, 2, 1], 1, [0, 0, 0]),
                                                ([0, 0], 0, [1, 7, 9]), ([3], 2, [0, 0, 0])])
def test_copy_signal_waiter_matches_torch(dev, flags, val0, status0):
    """The copy-engine completion flags' waiter: epochs advance, a missing peer is a recorded fault [1, peer, call]."""
    got = [torch.tensor(flags, device=dev), torch.tensor([val0, val0 + 1], device=dev), torch.tensor(status0, device=dev)]
    ref = [t.clone().cpu() for t in got]
    wait_flags(*got, timeout_ms=0)       # a missing flag is given up on at once
    wait_flags_torch(*ref)
    assert [t.tolist() for t in got] == [t.tolist() for t in ref], (flags, val0, status0, got, ref)
    assert got[1].tolist() == [val0 + 1, val0 + 2], "the call number advances, timeout or not"
    missing = [p for p, f in enumerate(flags) if f < val0 + 1]
    if status0[0]:
        assert got[2].tolist() == status0, "the first error sticks"
    else:
        assert got[2].tolist() == ([1, missing[0], val0 + 1] if missing else [0, 0, 0]), (flags, got[2])


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("me,own,val0,fault0", [(0, [0, 1, 1], 0, [0, 0, 0]), (1, [4, 0, 4, 4, 4], 3, [0, 0, 0]),
                                                 (2, [1, 0, 0], 0, [0, 0, 0]), (0, [0, 2, 1], 1, [0, 0, 0]),
                                                 (1, [0, 0], 0, [1, 7, 9]), (0, [0], 5, [0, 0, 0]),
                                                 (3, [9, 9, 9, 0, 9, 9, 9, 8, 9], 8, [0, 0, 0])])
def test_barrier_kernel_matches_torch(dev, me, own, val0, fault0):
    """Our barrier kernel over flag rows of one process: it stores the call number into slot ``me`` of every row,
    waits for every slot of row ``me``; a slot still behind is a recorded fault [1, first such rank, call], the
    first fault sticks, and the call number advances either way. The torch twin does the same."""
    P = len(own)
    rows = [torch.full((P,), 100 + p, dtype=torch.int64, device=dev) for p in range(P)]
    rows[me] = torch.tensor(own, dtype=torch.int64, device=dev)
    rows_P = torch.tensor([r.data_ptr() for r in rows], dtype=torch.int64, device=dev)
    val, fault = torch.tensor([val0, val0 + 1], device=dev), torch.tensor(fault0, device=dev)
    ref = ([r.clone().cpu() for r in rows], val.clone().cpu(), fault.clone().cpu())
    barrier_wait(rows_P, me, val, fault, timeout_ms=0)     # a slot behind is given up on at once
    barrier_torch(ref[0], me, ref[1], ref[2])
    assert [r.tolist() for r in rows] == [r.tolist() for r in ref[0]], (rows, ref[0])
    assert all(r[me] == val0 + 1 for r in rows), "every row's slot `me` holds the call number"
    assert val.tolist() == ref[1].tolist() == [val0 + 1, val0 + 2], "the call number advances, timeout or not"
    late = [p for p in range(P) if p != me and own[p] < val0 + 1]
    want = fault0 if fault0[0] else ([1, late[0], val0 + 1] if late else [0, 0, 0])
    assert fault.tolist() == ref[2].tolist() == want, (fault, ref[2], want)


def test_barrier_wait_rejects_bad_words():
    rows_P = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="me=2 in \\[0, 2\\)"):
        barrier_wait(rows_P, 2, torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="fault 3 contiguous words"):
        barrier_wait(rows_P, 0, torch.zeros(2, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), 1)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("word", [0, 1, 7])
def test_gather_add_poison_word(dev, word):
    """A nonzero poison word makes gather_add store NaN in every row it writes (a fault the device detected);
    zero changes nothing. The torch twin does the same."""
    g = torch.Generator().manual_seed(4)
    src, add = _rand(g, dev, 8, 37, dt=torch.bfloat16), _rand(g, dev, 5, 37, dt=torch.bfloat16)
    slot = torch.tensor([[0, 7], [-1, 4], [3, -1], [-1, -1], [1, 6]]).to(dev)
    poison = torch.tensor([word], dtype=torch.int64, device=dev)
    out, ref, plain = (torch.zeros(5, 37, device=dev) for _ in range(3))
    dst = torch.zeros(5, 37, dtype=torch.bfloat16, device=dev)
    gather_add(out, src, slot, add_TD=add, dst_TD=dst, poison=poison)
    gather_add_torch(ref, src, slot, add_TD=add, poison=poison)
    gather_add_torch(plain, src, slot, add_TD=add)
    assert bool(dst.isnan().all()) == bool(ref.isnan().all()) == (word != 0)
    if word == 0:
        assert torch.allclose(dst.float(), plain.to(torch.bfloat16).float(), rtol=2 ** -7, atol=0)

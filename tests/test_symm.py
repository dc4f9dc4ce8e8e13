"""The ``symm`` backend on CPU (issue 6): the backend contract against the single-process reference on
1-3 gloo ranks (static-capacity receive buffers, device-side counts, both data modes), WaveMoE with
backend="symm" against backend="torch", the capacity-overflow error on every rank, and the Triton
row-scatter and gather-add kernels under TRITON_INTERPRET=1 against their torch twins (when Triton is installed).

The symmetric-memory transport itself needs GPUs: tests/test_gpu_comm.py."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch
from moe_wave.comm import EPGroup
from moe_wave.comm.layout import WavePlan, compute_layout
from moe_wave.comm.symm import SymmBackend, parse_variant
from moe_wave.comm.symm_kernels import RowTargets, scatter_rows_torch
from moe_wave.comm.torch_backend import TorchBackend

from moe_wave import MoEConfig, WaveConfig, WaveMoE
from moe_wave.pipeline import run_waves
from moe_wave.reference import reference_dispatch_combine
from tests.ranks import RankPool
from tests.test_dispatch import CASES, E_PER_RANK, _expert_fn, _make_case, slot_by_slot

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _symm_path(ep: EPGroup, x, ids, w, num_waves: int, partition: str, overlap: bool, mode: str,
               capacity: int = 16) -> torch.Tensor:
    e = E_PER_RANK
    plan = WavePlan.make(num_ranks=ep.size, num_local_experts=e, num_waves=num_waves, partition=partition)
    local_view = mode.endswith("+local")        # dispatch(local_view=True): own rows read from x (dense blocks)
    data, dense, _ = parse_variant(mode.removesuffix("+local"))   # "copy+dense", "copy+sparse", "copy", "kernel"
    backend = SymmBackend(ep, wave=WaveConfig(max_tokens_per_rank=capacity), mode=data, dense=dense)
    xplan = backend.prepare(compute_layout(ids, w, plan))

    def experts(got):
        assert got.pairs_e is None and got.x_RD.shape[0] == ep.size * capacity   # static capacity, device counts
        y = slot_by_slot(got, ep.rank * e)
        n_valid = int((got.expert_RK >= 0).sum())
        assert n_valid == int(got.pairs_e_dev.sum()), "pairs_e_dev must count the valid slots"
        return y

    # overlapped: a NaN-filled output that wave 0 must overwrite (fresh); serial: zeros accumulated into
    out = torch.full(x.shape, float("nan")) if overlap else torch.zeros(x.shape, dtype=torch.float32)
    return run_waves(x, xplan, backend, experts, out, overlap=overlap, fresh=overlap, local_view=local_view)


def _check_symm(ep: EPGroup, modes) -> list:
    errs = []
    for case in CASES:
        x, ids, w = _make_case(case, ep.size)[ep.rank]
        ref = reference_dispatch_combine(x, ids, w, _expert_fn)
        for W in (1, 2, 4):
            for part in ("experts", "tokens"):
                for ov in (True, False):
                    for mode in modes:
                        y = _symm_path(ep, x, ids, w, W, part, ov, mode)
                        errs.append((case, W, part, ov, mode, float((y - ref).abs().max()) if y.numel() else 0.0))
    return errs


@pytest.mark.parametrize("P", [1, 2, 3])
def test_symm_dispatch_combine_matches_reference(ranks, P):
    # copy+dense+local: the emulated transport poisons the rows it leaves in x with NaN (consumers use rows_of)
    modes = ["copy+sparse", "copy+dense", "copy+dense+local"]
    results = [_check_symm(EPGroup.single(), modes)] if P == 1 else ranks(P).run(_check_symm, modes)
    for rank, errs in enumerate(results):
        assert len(errs) == len(CASES) * 3 * 2 * 2 * len(modes)
        bad = [e for e in errs if not e[-1] <= 1e-5]
        assert not bad, f"rank {rank}: {bad}"


def _moe_symm_vs_torch(ep: EPGroup, T_per_rank: list, dense: str = "auto") -> list:
    cfg = MoEConfig.preset("tiny", num_experts=12, top_k=3)
    torch.manual_seed(0)
    full = {"gate": torch.randn(12, 64) * 0.3, "bias": torch.randn(12) * 0.1,
            "gate_up": torch.randn(12, 64, 64) * 0.2, "down": torch.randn(12, 64, 32) * 0.2,
            "shared_gate": torch.randn(32, 64) * 0.2, "shared_up": torch.randn(32, 64) * 0.2,
            "shared_down": torch.randn(64, 32) * 0.2}
    g = torch.Generator().manual_seed(10 + ep.rank)
    x = torch.randn(T_per_rank[ep.rank], 64, generator=g)
    outs = {}
    os.environ["MOE_WAVE_SYMM_DENSE"] = dense    # "1": dense blocks, this rank's own rows read from x (local_view)
    try:
        for backend in ("torch", "symm"):
            m = WaveMoE(cfg, ep=ep, wave=WaveConfig(num_waves=2, backend=backend, max_tokens_per_rank=32))
            m.load_full(full)
            outs[backend] = m(x)
    finally:
        del os.environ["MOE_WAVE_SYMM_DENSE"]
    return float((outs["torch"] - outs["symm"]).abs().max()) if x.numel() else 0.0


@pytest.mark.parametrize("dense", ["auto", "1"])
def test_wavemoe_symm_matches_torch_backend(ranks, dense):
    """WaveMoE(wave=WaveConfig(backend="symm")) gives the torch backend's result (2 ranks, one empty). With
    dense blocks WaveMoE dispatches with local_view: this rank's own rows are read from x (the emulated
    transport poisons them in the receive buffer with NaN, so a consumer that read them there would fail)."""
    assert ranks(2).run(_moe_symm_vs_torch, [21, 0], dense) == pytest.approx([0.0, 0.0], abs=1e-5)
    assert ranks(2).run(_moe_symm_vs_torch, [9, 14], dense) == pytest.approx([0.0, 0.0], abs=1e-5)


def _combine_api(ep: EPGroup, backends) -> list:
    """combine's sum options on every backend: ``add_TD`` / ``dst_TD`` equal the unfused operations bit for
    bit, ``reduce=False`` leaves out_TD alone until its sum runs, and a bad ``add_TD`` is refused before
    any communication (every rank raises it)."""
    e, res = E_PER_RANK, []
    for case in ("uneven", "zero_send"):
        x, ids, w = _make_case(case, ep.size)[ep.rank]
        T, D = x.shape
        add = (torch.randn(T, D, generator=torch.Generator().manual_seed(5 + ep.rank)) * 3).to(torch.bfloat16)
        for name in backends:
            if name == "torch":
                be = TorchBackend(ep)
            else:
                data, dense, _ = parse_variant(name)
                be = SymmBackend(ep, wave=WaveConfig(max_tokens_per_rank=16), mode=data, dense=dense)
            plan = WavePlan.make(num_ranks=ep.size, num_local_experts=e, num_waves=1)
            xplan = be.prepare(compute_layout(ids, w, plan))
            got = be.dispatch(x, xplan, 0).wait()
            y = slot_by_slot(got, ep.rank * e)
            base = torch.zeros(T, D)
            be.combine(y, got.handle, base).wait()
            want = (base + add.float()).to(torch.bfloat16)
            acc, dst = torch.full((T, D), float("nan")), torch.full((T, D), float("nan"), dtype=torch.bfloat16)
            be.combine(y, got.handle, acc, accumulate=False, add_TD=add, dst_TD=dst).wait()
            lazy = torch.full((T, D), float("nan"))
            total = be.combine(y, got.handle, lazy, accumulate=False, reduce=False).wait()
            untouched = bool(lazy.isnan().all())
            total()
            try:
                be.combine(y, got.handle, base, add_TD=torch.zeros(T + 1, D))
                err = "no error"
            except ValueError as ex:
                err = str(ex)
            close = torch.allclose(dst.float(), want.float(), rtol=2 ** -7, atol=0)   # within 1 bf16 ulp
            res.append((case, name, torch.equal(dst, want), close, callable(total) and untouched,
                        torch.equal(lazy, base), err))
    return res


def test_combine_add_dst_and_deferred_sum(ranks):
    """combine(add_TD=, dst_TD=) ends the layer in one pass with the unfused result; combine(reduce=False)
    returns the sum for the caller to run (torch and symm backends, 2 ranks, one of them sending nothing)."""
    for rank, res in enumerate(ranks(2).run(_combine_api, ["torch", "copy+sparse", "copy+dense"])):
        assert len(res) == 6
        for case, name, fused_ok, _, deferred_ok, lazy_ok, err in res:
            assert fused_ok, (rank, case, name, "add_TD/dst_TD differ from the unfused sum")
            assert deferred_ok and lazy_ok, (rank, case, name, "reduce=False")
            assert "add_TD" in err and "shaped like out_TD" in err, (rank, case, name, err)


def _overflow(ep: EPGroup, capacity: int, mode: str) -> str:
    x, ids, w = _make_case("one_expert", ep.size)[ep.rank]   # 9 tokens per rank, all to rank P-1
    try:
        _symm_path(ep, x, ids, w, 1, "experts", True, mode, capacity=capacity)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("mode", ["copy+sparse", "copy+dense"])
def test_capacity_overflow_raises_on_every_rank(ranks, mode):
    msgs = ranks(2).run(_overflow, 4, mode)
    assert msgs[0] == msgs[1], msgs      # every rank raises the same error (no rank left hanging)
    found = re.search(r"capacity overflow in wave 0: rank (\d) sent (\d+) rows to rank (\d), capacity is 4 rows", msgs[0])
    assert found, msgs[0]
    count = int(found.group(2))
    assert count > 4 and f"WaveConfig.max_tokens_per_rank >= {count}" in msgs[0]
    assert ranks(2).run(_overflow, 9, mode) == ["no error", "no error"]   # T == C always fits


def test_bad_mode_and_plan_errors(monkeypatch):
    with pytest.raises(ValueError, match=r"mode='fast'"):
        SymmBackend(EPGroup.single(), mode="fast")
    with pytest.raises(ValueError, match=r"dense=True needs mode='copy' \(mode is 'kernel'\)"):
        SymmBackend(EPGroup.single(), mode="kernel", dense=True)
    monkeypatch.setenv("MOE_WAVE_SYMM_DENSE", "yes")
    with pytest.raises(ValueError, match=r"MOE_WAVE_SYMM_DENSE='yes': must be 0, 1 or auto"):
        SymmBackend(EPGroup.single(), mode="copy")
    monkeypatch.delenv("MOE_WAVE_SYMM_DENSE")
    backend = SymmBackend(EPGroup.single())
    plan = WavePlan.make(num_ranks=2, num_local_experts=4, num_waves=1)
    lay = compute_layout(torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2), plan)
    with pytest.raises(ValueError, match=r"WavePlan.num_ranks=2: must equal the EP group size 1"):
        backend.prepare(lay)


def test_out_of_range_ids_raise():
    backend = SymmBackend(EPGroup.single())
    plan = WavePlan.make(num_ranks=1, num_local_experts=4, num_waves=1)
    ids = torch.tensor([[0, 4]])
    with pytest.raises(ValueError, match=r"ids in \[0, 4\].*\[0, 4\)"):
        backend.prepare(compute_layout(ids, torch.ones(1, 2), plan))


@pytest.mark.parametrize("partition", ["experts", "tokens"])
def test_deepep_wave_topk_masks_other_waves(partition):
    """DeepEP's per-wave top-k (rebuilt from the layout on the device) keeps exactly the wave's slots."""
    from moe_wave.comm.deepep import wave_topk

    g = torch.Generator().manual_seed(3)
    P, e, W, T, K = 3, 4, 2, 13, 3
    ids = torch.stack([torch.randperm(P * e, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    plan = WavePlan.make(num_ranks=P, num_local_experts=e, num_waves=W, partition=partition)
    ids_WTK, w_WTK = wave_topk(compute_layout(ids, w, plan))
    if partition == "experts":
        wave_TK = plan.wave_of_local_expert("cpu")[ids % e]
    else:
        wave_TK = ((torch.arange(T) * W) // T)[:, None].expand(T, K)
    for wv in range(W):
        mine = wave_TK == wv
        assert torch.equal(ids_WTK[wv], torch.where(mine, ids, -1))
        assert torch.equal(w_WTK[wv], torch.where(mine, w, 0.0))


def test_deepep_missing_gives_install_hint():
    if importlib.util.find_spec("deep_ep") is not None:
        pytest.skip("deep_ep is installed here")
    from moe_wave.comm.deepep import import_deep_ep

    with pytest.raises(ImportError, match="pip install"):
        import_deep_ep()


# ------------------------------------------------------------------------ Triton kernel (interpreter)
def test_scatter_rows_torch_never_writes_skipped_rows():
    src = torch.randn(5, 7)
    blocks = [torch.full((4, 7), 3.0), torch.full((4, 7), 4.0)]
    scatter_rows_torch(src, blocks, torch.tensor([[4, 0, 2], [1, 1, 1]]), torch.tensor([[1, -1, 3], [-1, -1, 0]]))
    assert torch.equal(blocks[0][1], src[4]) and torch.equal(blocks[0][3], src[2]) and torch.equal(blocks[1][0], src[1])
    assert torch.equal(blocks[0][[0, 2]], torch.full((2, 7), 3.0)) and torch.equal(blocks[1][1:], torch.full((3, 7), 4.0))


# The kernels against their torch twins; run on CPU under the interpreter here, on the GPU by
# tests/test_gpu_comm.py (``dev`` is set by the caller). Blocks are separate tensors, and views of one
# tensor at offsets that do (unit 16) and do not (unit 1) allow 16-element aligned stores.
KERNEL_CHECKS = r"""
import torch
from moe_wave.comm.symm_kernels import (RowTargets, gather_add, gather_add_torch, scatter_rows, scatter_rows_torch,
                                        triton_ok)
assert triton_ok(dev)
g = torch.Generator().manual_seed(0)


def rand(*shape, dt=torch.float32):
    return (torch.randn(*shape, generator=g) * 100).to(dt).to(dev)


import moe_wave.comm.symm_kernels as sk
# grid 3: a capped grid, each program walks several tiles; rows: a tile's rows (3 rounds up to 4)
for dt, grid, rows in ((torch.float32, 0, 1), (torch.bfloat16, 0, 1), (torch.int32, 0, 4), (torch.bfloat16, 3, 1),
                       (torch.bfloat16, 2, 3)):
    sk.COPY_GRID, sk.COPY_ROWS = grid, rows
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
                scatter_rows(src, tg, si, di, meta, tm, mi, skip=skip)
                scatter_rows_torch(src, ref, si, di, skip=skip)
                scatter_rows_torch(meta, mref, mi, di, skip=skip)
                for p in range(P):
                    assert torch.equal(blocks[p], ref[p]), (dt, D, P, layout, p, grid, rows, skip)
                    assert torch.equal(mblocks[p], mref[p]), (dt, D, P, layout, p, "meta")
                if spare is not None:   # the spare row after each block is never written
                    assert torch.equal(whole[C::C + 1], spare)
for dt, grid, rows in ((torch.float32, 0, 1), (torch.bfloat16, 0, 1), (torch.bfloat16, 2, 1), (torch.bfloat16, 0, 4),
                       (torch.float32, 1, 2)):
    sk.COPY_GRID, sk.COPY_ROWS = grid, rows
    for D in (1, 37, 2500):
        for local in (None, 0, 1):
            out = rand(5, D)
            ref, other = out.clone(), out.clone()
            src, loc = rand(8, D, dt=dt), rand(8, D, dt=dt)
            slot = torch.tensor([[0, 7], [-1, 4], [3, -1], [-1, -1], [1, 6]]).to(dev)
            gather_add(out, src, slot, loc if local is not None else None, local)
            gather_add_torch(ref, src, slot, loc, local)
            assert torch.equal(out, ref), (dt, D, grid, rows, local)
            fresh, fref = torch.full_like(out, float("nan")), torch.zeros_like(out)   # accumulate=False: =, not +=
            gather_add(fresh, src, slot, loc if local is not None else None, local, accumulate=False)
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
                               add_TD=add, dst_TD=dst)
                    gather_add_torch(ref2, src, slot, loc, local, accumulate=acc, add_TD=add, dst_TD=dref)
                    if dev == "cpu" and ddt == torch.bfloat16:   # the interpreter truncates to bf16: within 1 ulp
                        assert torch.allclose(dst.float(), dref.float(), rtol=2 ** -7, atol=0), (D, acc, "add/dst")
                    else:    # the GPU rounds to nearest even, as torch does
                        assert torch.equal(dst, dref), (dt, D, grid, rows, local, acc, ddt, "add/dst")
                    assert torch.equal(out2, keep), "with dst, out is read, never written"
                    steps = keep.clone() if acc else torch.zeros_like(keep)   # the unfused operations
                    gather_add_torch(steps, src, slot, loc, local)
                    assert torch.equal(dref, (steps + add.float()).to(ddt)), (D, acc, ddt)
sk.COPY_GRID, sk.COPY_ROWS = 0, 1
from moe_wave.comm.layout import WavePlan, compute_layout
from moe_wave.comm.symm_tables import build_tables, build_tables_torch, count_rows, count_rows_torch
for P, W, e, T, K, C in ((1, 1, 4, 9, 2, 16), (3, 2, 4, 20, 3, 7), (2, 4, 8, 33, 4, 5), (4, 1, 2, 0, 2, 3)):
    E = P * e
    layouts = []
    for src in range(P):    # every rank's layout; ids out of range on rank P-1 when P > 2
        ids = torch.argsort(torch.rand(T, E, generator=g), 1)[:, :K]
        if P > 2 and src == P - 1 and T:
            ids[0, 0] = E + 3
        layouts.append(compute_layout(ids.to(dev), torch.rand(T, K, generator=g).to(dev),
                                      WavePlan.make(num_ranks=P, num_local_experts=e, num_waves=W)))
    X = W * P + W * e + 2
    sent = [count_rows_torch(lay.send_counts_WP, lay.pair_counts_WPe, lay.ids_min, lay.ids_max) for lay in layouts]
    for src, lay in enumerate(layouts):   # count_rows writes row src of every rank's ctrl
        ctrls = [torch.full((P, X), -7, dtype=torch.long, device=dev) for _ in range(P)]
        count_rows(RowTargets.of(c[src:src + 1] for c in ctrls), lay.send_counts_WP, lay.pair_counts_WPe,
                   lay.ids_min, lay.ids_max)
        for p in range(P):
            assert torch.equal(ctrls[p][src], sent[src][p]), (P, W, src, p)
            assert bool((ctrls[p][torch.arange(P, device=dev) != src] == -7).all()), "only row src is written"
    for me, lay in enumerate(layouts):
        recv_PX = torch.stack([sent[src][me] for src in range(P)])
        got, ref = [], []
        for fn, acc in ((build_tables, got), (build_tables_torch, ref)):
            for status0 in (torch.zeros(9, dtype=torch.long), torch.tensor([0, 0, 0, 0, 0, 1, 5, 5, 5])):
                slot = torch.full((W, T, P), -1, dtype=torch.long, device=dev)
                status = status0.to(dev)
                tabs = fn(recv_PX, lay.send_counts_WP, lay.send_token_S, C, T, me, E, slot, status)
                acc.append((tabs, slot, status))
        for (ta, sa, xa), (tb, sb, xb) in zip(got, ref):
            for k in tb:
                assert torch.equal(ta[k], tb[k]), (P, W, T, C, me, k)
            assert torch.equal(sa, sb), (P, W, T, C, me, "slot")
            if xb[0] or xb[5]:   # flags and the fields they name (the rest is junk when no flag is set)
                n = [0, 5] + ([1, 2, 3, 4] if xb[0] else []) + ([6, 7, 8] if xb[5] else [])
                assert torch.equal(xa[n], xb[n]), (P, W, T, C, me, xa.tolist(), xb.tolist())
            else:
                assert xa[0] == 0 and xa[5] == 0, xa.tolist()
        assert bool(got[0][2][0]) == bool((torch.stack([lay.send_counts_WP for lay in layouts]) > C).any())
# dense blocks: the one-launch densify against its torch twin (C < T: rows past the capacity lose their slot)
from moe_wave.comm.symm import wave_token_ranges
from moe_wave.comm.symm_tables import densify, densify_torch
for part in ("experts", "tokens"):
    for P, W, e, T, K, C in ((2, 1, 4, 9, 3, 16), (3, 2, 4, 20, 3, 7), (2, 3, 2, 13, 2, 5), (2, 2, 2, 0, 2, 4)):
        E = P * e
        ids = torch.argsort(torch.rand(T, E, generator=g), 1)[:, :K].to(dev)
        lay = compute_layout(ids, torch.rand(T, K, generator=g).to(dev),
                             WavePlan.make(num_ranks=P, num_local_experts=e, num_waves=W, partition=part))
        W = lay.plan.num_waves       # "experts" clamps the waves to e
        recv_PX = count_rows_torch(lay.send_counts_WP, lay.pair_counts_WPe, lay.ids_min, lay.ids_max)
        slot = torch.full((W, T, P), -1, dtype=torch.long, device=dev)
        tabs = build_tables(recv_PX, lay.send_counts_WP, lay.send_token_S, C, T, 0, E, slot,
                            torch.zeros(9, dtype=torch.long, device=dev))
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
print("ok")
"""


def test_row_targets_reject_mismatched_blocks():
    with pytest.raises(ValueError, match="block 1 is"):
        RowTargets.of([torch.zeros(4, 8), torch.zeros(4, 9)])
    with pytest.raises(ValueError, match="block 1 is"):
        RowTargets.of([torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.float16)])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
def test_symm_kernels_match_torch_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", 'dev = "cpu"\n' + KERNEL_CHECKS], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def _kernel_mode(ep: EPGroup) -> list:
    errs = _check_symm(ep, ["kernel", "copy+dense"])   # copy+dense: gather_add over the dense slots
    # the sum options through the Triton gather_add (add_TD, a bf16 dst_TD: the interpreter truncates to
    # bf16, so within 1 ulp here; tests/test_gpu_comm.py runs the kernel checks bit for bit; reduce=False)
    api = _combine_api(ep, ["kernel", "copy+dense"])
    return errs + [("api", case, name, 0.0 if close and deferred and lazy and "add_TD" in err else 1.0)
                   for case, name, _, close, deferred, lazy, err in api]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
def test_symm_kernel_mode_under_interpreter(monkeypatch):
    """The whole backend with the Triton kernel (interpreted) on 2 ranks: same results as the reference.
    Triton reads TRITON_INTERPRET when the kernel is defined, so the ranks start with it set."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with RankPool(2, deadline_s=240.0) as pool:
        results = pool.run(_kernel_mode)
    for rank, errs in enumerate(results):
        bad = [e for e in errs if not e[-1] <= 1e-5]
        assert errs and not bad, f"rank {rank}: {bad}"


SIGNAL_CHECKS = r"""
import torch
from moe_wave.comm.symm_signal import wait_flags, wait_flags_torch
for flags, val0, status0 in (([1, 1, 1], 0, [0, 0, 0]), ([5, 4, 6], 3, [0, 0, 0]), ([1, 0, 1], 0, [0, 0, 0]),
                             ([2, 2, 1], 1, [0, 0, 0]), ([0, 0], 0, [1, 7, 9]), ([3], 2, [0, 0, 0])):
    got = [torch.tensor(flags, device=dev), torch.tensor([val0, val0 + 1], device=dev), torch.tensor(status0, device=dev)]
    ref = [t.clone().cpu() for t in got]
    wait_flags(*got, timeout_ms=0, trap=False)       # a missing flag times out at once (one spin)
    wait_flags_torch(*ref)
    assert [t.tolist() for t in got] == [t.tolist() for t in ref], (flags, val0, status0, got, ref)
    assert got[1].tolist() == [val0 + 1, val0 + 2], "the call number advances, timeout or not"
    missing = [p for p, f in enumerate(flags) if f < val0 + 1]
    if status0[0]:
        assert got[2].tolist() == status0, "the first error sticks"
    else:
        assert got[2].tolist() == ([1, missing[0], val0 + 1] if missing else [0, 0, 0]), (flags, got[2])
print("ok")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
def test_copy_signal_waiter_under_interpreter():
    """The copy-engine completion flags' waiter: epochs advance, a missing peer is a recorded timeout."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", 'dev = "cpu"\n' + SIGNAL_CHECKS], env=env, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


# ------------------------------------------------------------------------------------ memops watchdog
class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_memops_wait_codes_round_trip():
    from moe_wave.comm.symm_memops import decode, wait_code

    for call, step, peer in ((1, 0, 0), (7, 1, 3), (0x8000 + 5, 1, 0x7FFE), (123456, 0, 17)):
        code = wait_code(call, step, peer)
        assert 0 < code < 2 ** 32
        assert decode(code) == (call % 0x8000, step, peer)
    assert wait_code(1, 1, 2) != wait_code(2, 1, 2), "two eager calls must write different codes"


def test_memops_watchdog_fires_on_a_stuck_wait_then_exits():
    """A word holding the same wait code for the timeout fires once: the message, the release, then the
    exit after the grace period; a changing code or a 0 in between restarts the clock."""
    from moe_wave.comm.symm_memops import Watchdog

    clock, exits, released = _Clock(), [], []
    wd = Watchdog(grace_s=5, exit=exits.append, clock=clock, thread=False)
    words = torch.zeros(3, dtype=torch.int32)
    wd.watch(words, 2.0, lambda i, code, sec: f"word {i} code {code} after {sec:.2f} s",
             lambda i, code: released.append((i, code)))

    def at(t, **set_words):
        clock.t = t
        for k, v in set_words.items():
            words[int(k[1:])] = v
        wd.poll()

    at(0.0, w1=11)
    at(1.9)
    at(1.95, w1=12)            # the stream moved on to another wait: the clock restarts
    at(3.0, w2=13)
    at(3.5, w2=0)              # word 2 finished its wait
    at(3.9)
    assert wd.error is None and not released
    at(3.96)
    assert wd.error == "word 1 code 12 after 2.01 s" and released == [(1, 12)]
    at(4.5, w2=13)
    at(6.4)
    assert released == [(1, 12)], "a stuck wait fires once; word 2 restarted at 4.5"
    at(6.6)
    assert released == [(1, 12), (2, 13)] and wd.error == "word 1 code 12 after 2.01 s", "the first error sticks"
    assert not exits
    at(8.96)                    # 3.96 + grace 5
    assert exits == [1]
    at(20.0)
    assert exits == [1], "the exit is asked for once"


def test_memops_watchdog_error_raised_by_the_caller_cancels_the_exit():
    from moe_wave.comm.symm_memops import Watchdog

    clock, exits = _Clock(), []
    wd = Watchdog(grace_s=1, exit=exits.append, clock=clock, thread=False)
    words = torch.tensor([5], dtype=torch.int32)

    def release(i, code):
        raise RuntimeError("device gone")       # a failed release must not stop the report or the exit

    wd.watch(words, 0.5, lambda i, code, sec: "rank 0 waited for rank 1", release)
    wd.poll()
    wd.raise_if_fired()                          # nothing yet
    clock.t = 0.6
    wd.poll()
    with pytest.raises(RuntimeError, match="rank 0 waited for rank 1"):
        wd.raise_if_fired()
    clock.t = 5.0
    wd.poll()
    assert exits == [], "the caller raised the error: no exit"

    wd2 = Watchdog(grace_s=1, exit=exits.append, clock=clock, thread=False)
    wd2.watch(torch.tensor([5], dtype=torch.int32), 0.5, lambda i, code, sec: "stuck", release)
    for t in (5.0, 5.6, 6.7):
        clock.t = t
        wd2.poll()
    assert exits == [1], "a failed release still ends in the exit"


def test_signal_option_errors(monkeypatch):
    with pytest.raises(ValueError, match=r"signal='bell': must be one of \('barrier', 'flags', 'memops'\)"):
        SymmBackend(EPGroup.single(), signal="bell")
    if not HAS_TRITON:
        with pytest.raises(ValueError, match=r"signal='flags' needs mode='copy' and Triton"):
            SymmBackend(EPGroup.single(), mode="copy", signal="flags")
    monkeypatch.setenv("MOE_WAVE_SYMM_SIGNAL", "memops")
    assert SymmBackend(EPGroup.single(), mode="copy").signal == "memops"   # CPU: the emulated transport ignores it


def test_auto_mode_choice():
    """mode "auto" with Triton: dense copy mode for a large capacity where dense blocks fill, kernel mode for
    a decode-sized capacity and where they would not fill; the fixed settings stay fixed. The choice reads
    only what all ranks share (never the call's token count)."""
    from moe_wave.comm import symm

    def choose(C, P=2, W=1, K=6, partition="experts", **kw):
        be = SymmBackend.__new__(SymmBackend)          # the rule only: no group, no buffers
        be.mode, be.dense, be.capacity = kw.get("mode", "auto"), kw.get("dense"), C
        plan = WavePlan.make(num_ranks=P, num_local_experts=8, num_waves=W, partition=partition)
        return be.choose(plan, K)

    big, small = symm.AUTO_COPY_MIN_TOKENS, symm.AUTO_COPY_MIN_TOKENS - 1
    assert choose(big) == ("copy", True)
    assert choose(small) == ("kernel", False)
    assert choose(big, P=8) == ("kernel", False)                        # fill 0.55
    assert choose(big, W=2) == ("copy", True)                           # 1 - (3/4)^6 = 0.82
    assert choose(big, W=4) == ("kernel", False)                        # 0.55
    assert choose(big, W=4, partition="tokens") == ("copy", True)       # a wave is a token chunk: 0.98
    assert choose(big, dense=False) == ("kernel", False)
    assert choose(small, mode="copy") == ("copy", True)
    assert choose(big, P=8, mode="copy") == ("copy", False)
    assert choose(big, P=8, mode="copy", dense=True) == ("copy", True)
    assert choose(big, mode="kernel") == ("kernel", False)


def test_wave_token_ranges_match_the_layout():
    """Dense blocks of the "tokens" partition copy each wave's token range as one slice: it must be exactly the
    tokens that compute_layout puts in that wave (and all tokens for "experts")."""
    from moe_wave.comm.symm import wave_token_ranges

    for T in (0, 1, 5, 9, 10, 37):
        for W in (1, 2, 3, 4, 7):
            ids = torch.zeros(T, 1, dtype=torch.long)
            lay = compute_layout(ids, torch.ones(T, 1), WavePlan.make(num_ranks=1, num_local_experts=8, num_waves=W,
                                                                      partition="tokens"))
            counts = lay.send_counts_WP[:, 0].tolist()
            ranges = wave_token_ranges(T, W, "tokens")
            assert [n for _, n in ranges] == counts, (T, W, ranges, counts)
            start = 0
            for w, (a, n) in enumerate(ranges):
                assert a == start
                got = lay.send_token_S[sum(counts[:w]):sum(counts[:w]) + n].tolist()
                assert got == list(range(a, a + n)), (T, W, w)
                start += n
            assert start == T
            assert wave_token_ranges(T, W, "experts") == tuple((0, T) for _ in range(W))


def test_parse_variant():
    assert parse_variant("copy+dense+memops") == ("copy", True, "memops")
    assert parse_variant("copy+sparse") == ("copy", False, "barrier")
    assert parse_variant("kernel") == ("kernel", None, "barrier")
    assert parse_variant("auto+flags") == ("auto", None, "flags")
    with pytest.raises(ValueError, match=r"symm variant 'copy\+fast'"):
        parse_variant("copy+fast")

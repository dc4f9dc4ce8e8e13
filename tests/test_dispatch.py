"""Dispatch -> per-expert function -> combine on 1, 2 and 3 gloo ranks against the single-process
reference, with the awkward layouts, and the bad-input paths (issue 2)."""

from __future__ import annotations

import pytest
import torch

from moe_wave.comm import EPGroup
from moe_wave.comm.backend import rows_of
from moe_wave.comm.layout import WavePlan, compute_layout
from moe_wave.comm.torch_backend import TorchBackend
from moe_wave.pipeline import run_waves
from moe_wave.reference import reference_dispatch_combine
from tests.ranks import RankPool, RanksFailed

D = 16
E_PER_RANK = 4


def _expert_weight(ex: int) -> torch.Tensor:
    return torch.randn(D, D, generator=torch.Generator().manual_seed(1000 + ex)) * 0.3


def _expert_fn(ex: int, rows: torch.Tensor) -> torch.Tensor:
    return torch.tanh(rows @ _expert_weight(ex)) + ex


def _make_case(case: str, P: int, seed: int = 0):
    """Per-rank (x_TD, ids_TK, w_TK) for all ranks; every rank builds the same global picture."""
    g = torch.Generator().manual_seed(seed)
    E, K = P * E_PER_RANK, 3
    tokens = {"uneven": [13, 5, 9], "zero_send": [11, 0, 7], "zero_recv": [10, 12, 4], "one_expert": [9, 9, 9],
              "few_tokens": [2, 1, 3]}[case][:P]
    out = []
    for r, T in enumerate(tokens):
        x = torch.randn(T, D, generator=g)
        if case == "one_expert":
            ids = torch.full((T, K), E - 1, dtype=torch.long)
            ids[:, 1:] = torch.stack([torch.randperm(E - 1, generator=g)[:K - 1] for _ in range(T)]) if T else ids[:, 1:]
        elif case == "zero_recv" and P > 1:   # nobody routes to rank P-1's experts
            ids = torch.stack([torch.randperm(E - E_PER_RANK, generator=g)[:K] for _ in range(T)])
        else:  # skewed: low expert ids are far more popular
            ids = torch.stack([torch.multinomial(1.0 / torch.arange(1, E + 1).float(), K, generator=g)
                               for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.long)
        w = torch.rand(T, K, generator=g)
        out.append((x, ids.reshape(T, K).long(), w))
    return out


def _ep_path(ep: EPGroup, x, ids, w, num_waves: int, partition: str, overlap: bool) -> torch.Tensor:
    e = E_PER_RANK
    plan = WavePlan.make(num_ranks=ep.size, num_local_experts=e, num_waves=num_waves, partition=partition)
    backend = TorchBackend(ep)
    xplan = backend.prepare(compute_layout(ids, w, plan))

    # overlapped: a NaN-filled output that wave 0 must overwrite (fresh); serial: zeros accumulated into
    out = torch.full(x.shape, float("nan")) if overlap else torch.zeros(x.shape, dtype=torch.float32)
    return run_waves(x, xplan, backend, lambda got: slot_by_slot(got, ep.rank * e), out, overlap=overlap,
                     fresh=overlap)


def slot_by_slot(got, expert_offset: int) -> torch.Tensor:
    """The per-expert function applied one (row, slot) at a time: y[r] = sum_k w[r,k] f(x[r]) (rows read with
    ``rows_of``: where the dispatch left this rank's own rows in x, ``Received.local``, they are read there)."""
    x_RD = rows_of(got.x_RD, torch.arange(got.x_RD.shape[0]), getattr(got, "local", None))
    y = torch.zeros(got.x_RD.shape, dtype=torch.float32)
    for r in range(x_RD.shape[0]):
        for k in range(got.expert_RK.shape[1]):
            j = int(got.expert_RK[r, k])
            if j >= 0:
                y[r] += got.weight_RK[r, k] * _expert_fn(expert_offset + j, x_RD[r:r + 1])[0]
    return y


def _check_cases(ep: EPGroup, cases, waves, partitions) -> list:
    errs = []
    for case in cases:
        x, ids, w = _make_case(case, ep.size)[ep.rank]
        ref = reference_dispatch_combine(x, ids, w, _expert_fn)
        for W in waves:
            for part in partitions:
                for ov in (True, False):
                    y = _ep_path(ep, x, ids, w, W, part, ov)
                    errs.append((case, W, part, ov, float((y - ref).abs().max()) if y.numel() else 0.0))
    return errs


CASES = ["uneven", "zero_send", "zero_recv", "one_expert", "few_tokens"]


@pytest.mark.parametrize("P", [1, 2, 3])
def test_dispatch_combine_matches_reference(ranks, P):
    results = [_check_cases(EPGroup.single(), CASES, [1, 2, 4], ["experts", "tokens"])] if P == 1 else \
        ranks(P).run(_check_cases, CASES, [1, 2, 4], ["experts", "tokens"])
    for rank, errs in enumerate(results):
        assert len(errs) == len(CASES) * 3 * 2 * 2
        bad = [e for e in errs if not e[-1] <= 1e-5]
        assert not bad, f"rank {rank}: {bad}"


def _layout_counts(ep, case):
    x, ids, w = _make_case(case, ep.size)[ep.rank]
    plan = WavePlan.make(num_ranks=ep.size, num_local_experts=E_PER_RANK, num_waves=2, partition="experts")
    lay = compute_layout(ids, w, plan)
    xplan = TorchBackend(ep).prepare(lay)
    return lay.send_counts_WP.tolist(), xplan.recv_counts, ids.tolist()


def test_layout_dedups_and_counts(ranks):
    """A token goes once per (peer, wave); counts match a brute-force count; zero_recv receives nothing."""
    res = ranks(2).run(_layout_counts, "zero_recv")
    for rank, (send, recv, ids) in enumerate(res):
        plan = WavePlan.make(num_ranks=2, num_local_experts=E_PER_RANK, num_waves=2)
        brute = [[0, 0], [0, 0]]
        for row in ids:
            cells = {(plan.wave_of_local_expert("cpu")[i % E_PER_RANK].item(), i // E_PER_RANK) for i in row}
            for wv, p in cells:
                brute[wv][p] += 1
        assert send == brute
    # rank 1 owns experts nobody picks: it receives no rows in any wave, and the two ranks agree
    assert all(sum(c) == 0 for c in res[1][1])
    assert [[res[0][0][w][1], res[1][0][w][1]] for w in range(2)] == res[1][1]


def test_layout_send_order_and_metadata():
    ids = torch.tensor([[5, 1], [4, 6], [0, 2]])       # 2 ranks x 4 experts, wave = (local // 2)
    w = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]])
    lay = compute_layout(ids, w, WavePlan.make(num_ranks=2, num_local_experts=4, num_waves=2))
    S = int(lay.send_counts_WP.sum())
    # cells (wave, peer): t0 -> (0,1)[5], (0,0)[1]; t1 -> (0,1)[4], (1,1)[6]; t2 -> (0,0)[0], (1,0)[2]
    assert lay.send_counts_WP.tolist() == [[2, 2], [1, 1]]
    assert lay.send_token_S[:S].tolist() == [0, 2, 0, 1, 2, 1]
    assert lay.send_expert_SK[:S].tolist() == [[-1, 1], [0, -1], [1, -1], [0, -1], [-1, 2], [-1, 2]]
    assert lay.send_weight_SK[1].tolist() == pytest.approx([0.5, 0.0])


# ------------------------------------------------------------------------------------------ bad input
def test_topk_dtype_and_shape_errors():
    plan = WavePlan.make(num_ranks=1, num_local_experts=4, num_waves=1)
    with pytest.raises(ValueError, match=r"topk_ids.dtype=torch.float32"):
        compute_layout(torch.zeros(3, 2), torch.zeros(3, 2), plan)
    with pytest.raises(ValueError, match=r"topk_ids: shape \(3,\): must be 2-D"):
        compute_layout(torch.zeros(3, dtype=torch.long), torch.zeros(3), plan)
    with pytest.raises(ValueError, match=r"topk_weights.shape=\(3, 1\)"):
        compute_layout(torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 1), plan)
    with pytest.raises(ValueError, match=r"num_waves=0"):
        WavePlan.make(num_ranks=1, num_local_experts=4, num_waves=0)


def _bad_ids(ep, bad_rank: int, value: int):
    x, ids, w = _make_case("uneven", ep.size)[ep.rank]
    if ep.rank == bad_rank:
        ids[0, 0] = value
    try:
        _ep_path(ep, x, ids, w, 2, "experts", True)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("value", [-1, 8])
def test_out_of_range_ids_raise_on_every_rank(ranks, value):
    msgs = ranks(2).run(_bad_ids, 1, value)
    for m in msgs:   # both ranks raise the same error naming rank 1, its value and the rule
        assert "rank 1" in m and str(value) in m and "[0, 8)" in m, m


def _raise_mid_dispatch(ep):
    x, ids, w = _make_case("uneven", ep.size)[ep.rank]
    plan = WavePlan.make(num_ranks=ep.size, num_local_experts=E_PER_RANK, num_waves=2)
    backend = TorchBackend(ep)
    xplan = backend.prepare(compute_layout(ids, w, plan))
    pend = backend.dispatch(x, xplan, 0)
    if ep.rank == 1:
        raise RuntimeError("boom: rank 1 failed between dispatch(0) and dispatch(1)")
    got = pend.wait()
    backend.dispatch(x, xplan, 1).wait()      # rank 0 waits here for a peer that never comes
    return got.x_RD.shape[0]


def test_rank_failure_mid_dispatch_reports_root_cause():
    with RankPool(2, timeout_s=5.0, deadline_s=60.0) as pool:
        with pytest.raises(RanksFailed) as info:
            pool.run(_raise_mid_dispatch)
    msg = str(info.value)
    first = msg.index("boom: rank 1")
    assert "rank 1" in msg[:first + 20]
    # rank 0's own error (a timeout or a closed connection) is listed, after the root cause
    assert "rank 0" in msg[first:]


@pytest.mark.parametrize("P", [2, 3])
def test_rows_per_peer_across_wave_counts(P):
    """Rows a layer sends each peer, W = 1..8 (V4-Flash-like routing: top-6 over 32 local experts per rank): the
    "tokens" partition sends a (token, peer) row at most once per layer, so its rows per peer equal W=1's at every W;
    the "experts" partition sends a row once per wave that has one of the token's experts on that peer (the extra
    bytes issue 15 names), so it sends at least W=1's rows, and every layout accounts for all K pairs of each token."""
    g = torch.Generator().manual_seed(P)
    T, K, e = 257, 6, 32
    ids = torch.rand(T, P * e, generator=g).topk(K, dim=1).indices
    w = torch.rand(T, K, generator=g)
    once = torch.stack([((ids // e) == p).any(1) for p in range(P)], 1).sum(0)      # tokens with an expert on p
    for W in range(1, 9):
        per_part = {}
        for part in ("tokens", "experts"):
            lay = compute_layout(ids, w, WavePlan.make(num_ranks=P, num_local_experts=e, num_waves=W, partition=part))
            per_part[part] = lay.send_counts_WP.sum(0)
            assert int(lay.pair_counts_WPe.sum()) == T * K
        assert torch.equal(per_part["tokens"], once), (W, per_part["tokens"].tolist(), once.tolist())
        assert bool((per_part["experts"] >= once).all())
        if W == 1:
            assert torch.equal(per_part["experts"], once)

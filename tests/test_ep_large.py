"""EP at 4 and 8 gloo ranks: the multi-rank checks of test_dispatch, test_symm, test_moe and test_bootstrap at the
world sizes V4 is served at (issue 19).

Marked ``large`` and deselected by default (pyproject's ``addopts``): about a minute on 2 shared cores. Run them
with ``bash launch/test.sh -m large``. Shapes are tiny; what grows is the number of peers: 7 of 8 peers remote,
ranks that send nothing, ranks that receive nothing, and a rank that holds every token's experts.
"""

from __future__ import annotations

import re
from unittest import mock

import pytest
import torch

import tests.test_moe as test_moe
from moe_wave import MoEConfig, WaveConfig, WaveMoE
from moe_wave.comm import EPGroup, spawn
from moe_wave.comm.options import SymmOptions
from moe_wave.reference import reference_dispatch_combine
from tests.ranks import RankPool
from tests.test_bootstrap import _sum_ranks
from tests.test_dispatch import D, E_PER_RANK, _ep_path, _expert_fn
from tests.test_symm import _symm_path

pytestmark = [pytest.mark.large, pytest.mark.timeout(900)]

SIZES = [4, 8]
CASES = ("uneven", "zero_send", "zero_recv", "one_expert")


@pytest.fixture(scope="module")
def ranks():
    """conftest's ``ranks`` with a longer bound per call: 8 ranks share a few cores here."""
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size, timeout_s=120.0, deadline_s=600.0)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


def _case(case: str, P: int, seed: int = 0):
    """This test's per-rank (x_TD, ids_TK, w_TK) for P ranks (test_dispatch's cases, token lists as long as P):
    "zero_send": every odd rank sends nothing; "zero_recv": nobody routes to the upper half's experts;
    "one_expert": every token picks the last expert (rank P-1 receives from all)."""
    g = torch.Generator().manual_seed(seed)
    E, K = P * E_PER_RANK, 3
    tokens = [(13, 5, 9, 2)[r % 4] if case != "zero_send" else (0 if r % 2 else 11 - r) for r in range(P)]
    out = []
    for T in tokens:
        x = torch.randn(T, D, generator=g)
        if case == "one_expert":
            rest = [torch.randperm(E - 1, generator=g)[:K - 1] for _ in range(T)]
            ids = torch.cat([torch.full((T, 1), E - 1), torch.stack(rest) if T else torch.zeros(0, K - 1)], 1)
        elif case == "zero_recv":
            ids = torch.stack([torch.randperm(E // 2, generator=g)[:K] for _ in range(T)]) if T else \
                torch.zeros(0, K)
        else:
            ids = torch.stack([torch.multinomial(1.0 / torch.arange(1, E + 1).float(), K, generator=g)
                               for _ in range(T)]) if T else torch.zeros(0, K)
        out.append((x, ids.reshape(T, K).long(), torch.rand(T, K, generator=g)))
    return out


def _errors(ep: EPGroup, path: str, waves, modes=("",)) -> list:
    """max |EP path - single-process reference| for every case, wave count, partition, schedule and mode."""
    errs = []
    for case in CASES:
        x, ids, w = _case(case, ep.size)[ep.rank]
        ref = reference_dispatch_combine(x, ids, w, _expert_fn)
        for W in waves:
            for part in ("experts", "tokens"):
                for ov in (True, False):
                    for mode in modes:
                        y = _ep_path(ep, x, ids, w, W, part, ov) if path == "torch" else \
                            _symm_path(ep, x, ids, w, W, part, ov, mode)
                        errs.append((case, W, part, ov, mode, float((y - ref).abs().max()) if y.numel() else 0.0))
    return errs


def _assert_small(results, expected: int) -> None:
    for rank, errs in enumerate(results):
        assert len(errs) == expected, (rank, len(errs))
        bad = [e for e in errs if not e[-1] <= 1e-5]
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize("P", SIZES)
def test_torch_backend_dispatch_combine_matches_reference(ranks, P):
    _assert_small(ranks(P).run(_errors, "torch", (1, 2, 4)), len(CASES) * 3 * 2 * 2)


@pytest.mark.parametrize("P", SIZES)
def test_symm_dispatch_combine_matches_reference(ranks, P):
    modes = ("copy+sparse", "copy+dense", "copy+dense+local")
    waves = (1, 2, 4) if P == 4 else (1, 3)
    _assert_small(ranks(P).run(_errors, "symm", waves, modes), len(CASES) * len(waves) * 2 * 2 * len(modes))


def _overflow(ep: EPGroup, capacity: int, mode: str) -> str:
    """Every token's first expert is the last one: rank P-1 receives rows from every rank (dense blocks: every
    rank's whole token range goes to every peer, so any cell may be the first to overflow)."""
    x, ids, w = _case("one_expert", ep.size)[ep.rank]
    try:
        _symm_path(ep, x, ids, w, 1, "experts", True, mode, capacity=capacity)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("P", SIZES)
def test_symm_capacity_overflow_raises_on_every_rank(ranks, P):
    msgs = ranks(P).run(_overflow, 4, "copy+dense")
    assert len(set(msgs)) == 1, msgs         # the same error on every rank: none is left waiting
    found = re.search(r"capacity overflow in wave 0: rank (\d+) sent (\d+) rows to rank (\d+), capacity is 4 rows",
                      msgs[0])
    assert found and int(found.group(3)) < P and int(found.group(2)) > 4, msgs[0]
    assert f"SymmOptions.capacity >= {found.group(2)}" in msgs[0], msgs[0]
    assert ranks(P).run(_overflow, 13, "copy+dense") == ["no error"] * P     # the largest T fits


def _moe_symm_vs_torch(ep: EPGroup, T_per_rank: list) -> float:
    """WaveMoE with backend="symm" against backend="torch" (2 experts per rank, 2 waves, dense and sparse)."""
    E = 2 * ep.size
    cfg = MoEConfig.preset("tiny", num_experts=E, top_k=3)
    g = torch.Generator().manual_seed(0)
    full = {"gate": torch.randn(E, 64, generator=g) * 0.3, "bias": torch.randn(E, generator=g) * 0.1,
            "gate_up": torch.randn(E, 64, 64, generator=g) * 0.2, "down": torch.randn(E, 64, 32, generator=g) * 0.2,
            "shared_gate": torch.randn(32, 64, generator=g) * 0.2, "shared_up": torch.randn(32, 64, generator=g) * 0.2,
            "shared_down": torch.randn(64, 32, generator=g) * 0.2}
    x = torch.randn(T_per_rank[ep.rank], 64, generator=torch.Generator().manual_seed(10 + ep.rank))
    worst = 0.0
    for dense in (None, True):
        outs = {}
        for backend in ("torch", "symm"):
            m = WaveMoE(cfg, ep=ep, wave=WaveConfig(num_waves=2, backend=backend,
                                                    symm=SymmOptions(capacity=32, dense=dense)))
            m.load_full(full)
            outs[backend] = m(x)
        if x.numel():
            worst = max(worst, float((outs["torch"] - outs["symm"]).abs().max()))
    return worst


@pytest.mark.parametrize("P", SIZES)
def test_wavemoe_symm_matches_torch_with_empty_ranks(ranks, P):
    tokens = [(21, 0, 9, 14)[r % 4] for r in range(P)]
    assert ranks(P).run(_moe_symm_vs_torch, tokens) == pytest.approx([0.0] * P, abs=1e-5)


def _parity(ep: EPGroup, experts: int, tokens: list, variants, bias_boost=None) -> list:
    """test_moe's parity against transformers' DeepseekV4SparseMoeBlock with ``experts`` routed experts."""
    with mock.patch.object(test_moe, "E", experts):
        return test_moe._parity(ep, tokens, variants, bias_boost)


VARIANTS = [(1, "experts", True, "bubbles"), (2, "experts", True, "bubbles"), (3, "tokens", False, "serial"),
            (7, "experts", False, "bubbles")]


@pytest.mark.parametrize("P", SIZES)
def test_wavemoe_matches_hf(ranks, P):
    """Every rank its own tokens (rank 2 none); 12 experts on 4 ranks (3 each), 16 on 8 (2 each)."""
    tokens = [(19, 7, 0, 11)[r % 4] for r in range(P)]
    test_moe._assert_close(ranks(P).run(_parity, 12 if P == 4 else 16, tokens, VARIANTS), len(VARIANTS))


def test_wavemoe_all_tokens_to_one_rank_at_8(ranks):
    """Top-k layer: a huge bias on rank 0's experts sends every token of all 8 ranks there."""
    tokens = [5 + r for r in range(8)]
    test_moe._assert_close(ranks(8).run(_parity, 16, tokens, VARIANTS[:2], {0: 50.0, 1: 50.0}), 2)


@pytest.mark.parametrize("n", SIZES)
def test_spawn_returns_results_in_rank_order(n):
    out = spawn(_sum_ranks, n, args=(10,), backend="gloo")
    assert out == [(r, n, "gloo", sum(range(n)) + 10 * n) for r in range(n)]

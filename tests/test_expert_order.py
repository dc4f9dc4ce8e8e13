"""``expert_order`` (the expert-major order of the (row, slot) pairs, without a sort) against its torch twin and
against the stable argsort that it replaces; on CPU under ``TRITON_INTERPRET=1`` (tests/conftest.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

from moe_wave.comm.triton_gate import triton_ok
from moe_wave.experts import _order_by_argsort     # what the fused path computed before expert_order

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not triton_ok(DEVICE, want=True),
                                   reason="Triton cannot run here (not installed, or CPU without TRITON_INTERPRET=1)")


def _ids(R: int, K: int, e: int, seed: int, fill: str = "random") -> torch.Tensor:
    """[R, K] int32 expert ids with -1 slots; ``fill``: random, all -1, or only the even experts (the odd ones
    empty)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, e, (R, K), generator=g, dtype=torch.int32)
    if fill == "none":
        ids.fill_(-1)
    elif fill == "even":
        ids = torch.where(ids % 2 == 0, ids, -1).to(torch.int32)
    return ids


def _offs(ids: torch.Tensor, e: int) -> torch.Tensor:
    """The cumulative group ends as ``expert_rows`` builds them (int32, clamped to J)."""
    counts = torch.bincount(ids.reshape(-1).long() + 1, minlength=e + 1)[1:e + 1]
    return counts.cumsum(0).clamp_(max=ids.numel()).to(torch.int32)


def _run(ids: torch.Tensor, e: int, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from moe_wave.expert_kernels import expert_order

    src, pos = expert_order(ids.to(DEVICE), e, offs.to(DEVICE))
    assert src.dtype == pos.dtype == torch.int64 and src.shape == (ids.numel(),) and pos.shape == ids.shape
    return src.cpu(), pos.cpu()


def _check_against_twin_and_argsort(ids: torch.Tensor, e: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The kernel's (src, pos) on ids with their true group ends: pos bit-equal to the twin's and to the argsort
    order's (-1 on the slots of no expert), src equal on the n valid positions; returns (src, pos, n)."""
    from moe_wave.expert_kernels import expert_order_torch

    offs = _offs(ids, e)
    n = int(offs[-1])
    src, pos = _run(ids, e, offs)
    src_t, pos_t = expert_order_torch(ids, e, offs)
    assert torch.equal(pos, pos_t) and torch.equal(src[:n], src_t[:n])
    row, pos_a = _order_by_argsort(ids, e, offs)
    valid = (ids >= 0) & (ids < e)
    assert torch.equal(pos, torch.where(valid, pos_a, -1)) and torch.equal(src[:n], row[:n])
    assert int(valid.sum()) == n
    return src, pos, n


CASES = [(R, K, e, fill) for R, K, e in itertools.product([0, 1, 37, 300], [1, 6, 8], [1, 4, 33])
         for fill in ("random", "none", "even")]


@needs_kernels
@pytest.mark.parametrize("R, K, e, fill", CASES)
def test_expert_order_matches_argsort(R, K, e, fill):
    """Bit-equal pos (-1 on the slots of no expert) and src on the n valid positions, against the twin and
    against the argsort order."""
    _check_against_twin_and_argsort(_ids(R, K, e, seed=R * 100 + K * 10 + e, fill=fill), e)


@needs_kernels
def test_expert_order_strided_ids_and_foreign_ids():
    """ids as a column slice of a wider metadata tensor (the symm backend's ``meta_RM[:, :K]``); ids outside
    [0, e) other than -1 are no local expert either."""
    from moe_wave.expert_kernels import expert_order_torch

    R, K, e = 50, 6, 4
    meta = _ids(R, 2 * K, e + 3, seed=7)
    ids = meta[:, :K]
    offs = _offs(torch.where(ids < e, ids, -1), e)
    src, pos = _run(ids, e, offs)
    src_t, pos_t = expert_order_torch(ids, e, offs)
    n = int(offs[-1])
    assert torch.equal(pos, pos_t) and torch.equal(src[:n], src_t[:n])
    assert torch.equal(pos < 0, (ids < 0) | (ids >= e))


@needs_kernels
@pytest.mark.parametrize("shift", [-3, 3, 1000])
def test_expert_order_mismatched_offs(shift):
    """offs_e that disagrees with the pairs (a capacity overflow): as the twin, no write past J, every position
    below n a row index, pos < J or -1. src_J is exactly J long (the wrapper's own buffer)."""
    from moe_wave.expert_kernels import expert_order_torch

    R, K, e = 37, 6, 4
    ids = _ids(R, K, e, seed=3)
    J = R * K
    counts = torch.bincount(ids.reshape(-1).long() + 1, minlength=e + 1)[1:]
    counts[1] = (counts[1] + shift).clamp(min=0)
    offs = counts.cumsum(0).clamp_(max=J).to(torch.int32)
    src, pos = _run(ids, e, offs)
    src_t, pos_t = expert_order_torch(ids, e, offs)
    n = int(offs[-1])
    assert torch.equal(pos, pos_t) and torch.equal(src[:n], src_t[:n])
    assert bool(((pos == -1) | ((pos >= 0) & (pos < n))).all())
    assert bool(((src[:n] >= 0) & (src[:n] < R)).all())
    hit = pos >= 0
    assert pos[hit].unique().numel() == int(hit.sum()), "one pair per position"


@needs_kernels
def test_expert_order_never_writes_past_j():
    """offs_e past J (not clamped): the kernel writes nothing past the J entries of src_J (poisoned slack
    after them stays)."""
    from moe_wave.expert_kernels import BLOCK_J, _order_into

    R, K, e = 37, 6, 4
    ids = _ids(R, K, e, seed=5).to(DEVICE)
    J = R * K
    offs = torch.tensor([J // 2, J + 5, 2 * J, 3 * J], dtype=torch.int32, device=DEVICE)
    buf = torch.full((J + 2 * BLOCK_J,), -7, dtype=torch.long, device=DEVICE)
    pos = torch.full((R, K), -7, dtype=torch.long, device=DEVICE)
    _order_into(ids, e, offs, buf, pos)
    assert bool((buf[J:] == -7).all()), "a write past J"
    assert bool((buf[:J] >= 0).all()) and bool((buf[:J] < R).all())
    assert bool(((pos == -1) | ((pos >= 0) & (pos < J))).all())


@needs_kernels
@pytest.mark.parametrize("order", ["kernel", "argsort"])
@pytest.mark.parametrize("R", [300, 1, 0])
def test_fused_expert_rows_matches_torch_path(R, order, monkeypatch):
    """``_expert_rows_fused`` (the CUDA path, called directly here: its kernels under the interpreter on CPU)
    against ``expert_rows``' torch path with the same device counts and with host counts; rows with no pair
    are 0."""
    from moe_wave import MoEConfig
    import moe_wave.experts as mex
    from moe_wave.experts import RoutedExperts, _expert_rows_fused, expert_rows

    monkeypatch.setattr(mex, "ORDER", order)
    cfg = MoEConfig(hidden_size=48, intermediate_size=32, num_experts=5, top_k=4, swiglu_limit=7.0)
    g = torch.Generator().manual_seed(R)
    ex = RoutedExperts(cfg, num_local=5, grouped_mm="on", device=DEVICE)
    with torch.no_grad():
        ex.gate_up.copy_(torch.randn(ex.gate_up.shape, generator=g) * 0.1)
        ex.down.copy_(torch.randn(ex.down.shape, generator=g) * 0.1)
    x = torch.randn(R, cfg.hidden_size, generator=g).to(DEVICE)
    ids = _ids(R, 4, 5, seed=R + 1)
    if R > 2:
        ids[:2] = -1                                              # rows with no pair at all
    ids = ids.to(DEVICE)
    w = torch.rand(R, 4, generator=g).to(DEVICE)
    counts = torch.bincount(ids[ids >= 0].long(), minlength=5)
    offs = counts.cumsum(0).to(torch.int32)
    with torch.no_grad():
        y = _expert_rows_fused(x, ids, w, ex, offs)
        y_dev = expert_rows(x, ids, w, ex, None, counts)
        y_host = expert_rows(x, ids, w, ex, counts.tolist(), counts)
    assert y.shape == (R, cfg.hidden_size)
    torch.testing.assert_close(y, y_dev, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y, y_host, rtol=1e-5, atol=1e-6)
    if R > 2:
        assert torch.equal(y[:2], torch.zeros_like(y[:2])), "rows with no pair are 0"


@needs_kernels
@pytest.mark.parametrize("e, fill", [(33, "random"), (128, "random"), (128, "even"), (1, "random")])
def test_expert_order_many_blocks(e, fill):
    """J = 16000 pairs over 125 blocks of BLOCK_J (a partial last one with R = 1999), and more blocks than one step
    of the scan (SCAN_BLOCKS): the earlier blocks' counts and the in-block ranks against the twin and the argsort;
    the same result on a second run."""
    from moe_wave.expert_kernels import BLOCK_J, SCAN_BLOCKS

    for R in (2000, 1999, SCAN_BLOCKS * BLOCK_J // 8 + 40):
        K = 8
        assert R * K > 100 * BLOCK_J
        if R > 2000 and e != 33:
            continue                       # the scan's second step once is enough (the interpreter is slow)
        ids = _ids(R, K, e, seed=R + e, fill=fill)
        src, pos, n = _check_against_twin_and_argsort(ids, e)
        src2, pos2 = _run(ids, e, _offs(ids, e))
        assert torch.equal(pos, pos2) and torch.equal(src[:n], src2[:n])


@needs_kernels
@pytest.mark.parametrize("shift", [-40, 40, 100000])
def test_expert_order_many_blocks_mismatched_offs(shift):
    """offs_e that disagrees with the pairs over many blocks (some groups short, some long, the last end past J,
    unclamped): as the twin on the n positions; through ``_order_into`` with poisoned slack after J, nothing
    written there and every position below min(n, J) a row index."""
    from moe_wave.expert_kernels import _order_into, expert_order_torch

    R, K, e = 2000, 8, 33
    J = R * K
    ids = _ids(R, K, e, seed=11)
    counts = torch.bincount(ids.reshape(-1).long() + 1, minlength=e + 1)[1:]
    counts[::3] = (counts[::3] + shift).clamp(min=0)
    counts[1::3] = (counts[1::3] - 25).clamp(min=0)
    offs = counts.cumsum(0).to(torch.int32)
    n = min(int(offs[-1]), J)
    src_t, pos_t = expert_order_torch(ids, e, offs)
    buf = torch.full((J + 300,), -7, dtype=torch.long, device=DEVICE)
    pos = torch.full((R, K), -7, dtype=torch.long, device=DEVICE)
    _order_into(ids.to(DEVICE), e, offs.to(DEVICE), buf, pos)
    buf, pos = buf.cpu(), pos.cpu()
    assert torch.equal(pos, pos_t) and torch.equal(buf[:n], src_t[:n])
    assert bool((buf[J:] == -7).all()), "a write past J"
    assert bool(((buf[:n] >= 0) & (buf[:n] < R)).all())
    hit = pos >= 0
    assert pos[hit].unique().numel() == int(hit.sum()), "one pair per position"

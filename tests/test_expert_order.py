"""``expert_order`` (the expert-major order of the (row, slot) pairs, without a sort) against its torch twin and
against the stable argsort that it replaces; on CPU under ``TRITON_INTERPRET=1`` (tests/conftest.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

from moe_wave.comm.backend import Received
from moe_wave.comm.triton_gate import triton_ok

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not triton_ok(DEVICE, want=True),
                                   reason="Triton cannot run here (not installed, or CPU without TRITON_INTERPRET=1)")


def _order_by_argsort(expert_RK: torch.Tensor, e: int, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(src_J, pos_RK) from a stable argsort of the ids (-1 last): the order the fused path took before
    ``expert_order`` replaced the sort."""
    K = expert_RK.shape[1]
    order = torch.argsort(torch.remainder(expert_RK.reshape(-1), e + 1), stable=True)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.shape[0], device=order.device)
    return order // K, pos.view(-1, K)


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
@pytest.mark.parametrize("R", [300, 1, 0])
def test_fused_expert_rows_matches_torch_path(R):
    """``_expert_rows_fused`` (the CUDA path, called directly here: its kernels under the interpreter on CPU)
    against ``expert_rows``' torch path with the same device counts and with host counts; rows with no pair
    are 0."""
    from moe_wave import MoEConfig
    from moe_wave.experts import RoutedExperts, _expert_rows_fused, expert_rows

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
        y_dev = expert_rows(Received(x, ids, w, None, counts, None), ex)
        y_host = expert_rows(Received(x, ids, w, counts.tolist(), counts, None), ex)
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


def _bounded_case(P: int, RB: int, K: int, e: int, rows: list, seed: int):
    """[P * RB, K] ids whose rows past each block's bound hold valid-looking ids (junk the kernels must not read),
    the bound as a device tensor, and the same ids with those rows set to -1 (what the twin sees)."""
    ids = _ids(P * RB, K, e, seed=seed)
    i_R = torch.arange(P * RB)
    past = (i_R % RB) >= torch.tensor(rows).clamp(max=RB).repeat_interleave(RB)
    ids[past] = torch.randint(0, e, (int(past.sum()), K), generator=torch.Generator().manual_seed(seed + 1),
                              dtype=torch.int32)
    masked = torch.where(past[:, None], -1, ids).to(torch.int32)
    return ids, torch.tensor(rows, dtype=torch.int64), masked, past


@needs_kernels
@pytest.mark.parametrize("rows", [[13, 0, 50], [50, 50, 50], [0, 0, 0], [7, 90, 1]])
def test_row_bound_order_and_weighted_sum(rows):
    """``Received.rows_P``: the rows past each block's bound are not read (their ids, valid-looking here, count as
    -1: pos -1, the order the twin gives on the ids with those rows masked) and not written by ``weighted_sum``
    (a NaN-filled ``out`` keeps its NaN there), while the rows below it equal the twin's sums; a bound above the
    block's size means the whole block."""
    from moe_wave.expert_kernels import expert_order, expert_order_torch, weighted_sum, weighted_sum_torch

    P, RB, K, e, D = 3, 50, 4, 7, 24
    ids, rows_P, masked, past = _bounded_case(P, RB, K, e, rows, seed=sum(rows) + 3)
    offs = _offs(masked, e)
    n = int(offs[-1])
    src, pos = expert_order(ids.to(DEVICE), e, offs.to(DEVICE), rows_P.to(DEVICE))
    src, pos = src.cpu(), pos.cpu()
    src_t, pos_t = expert_order_torch(masked, e, offs)
    assert torch.equal(pos, pos_t) and torch.equal(src[:n], src_t[:n])
    assert bool((pos[past] == -1).all())
    g = torch.Generator().manual_seed(7)
    out_JD = torch.randn(P * RB * K, D, generator=g)
    w = torch.rand(P * RB, K, generator=g)
    nt = torch.tensor([n], dtype=torch.int32)
    y = torch.full((P * RB, D), float("nan"), device=DEVICE)
    weighted_sum(out_JD.to(DEVICE), pos.to(DEVICE), w.to(DEVICE), nt.to(DEVICE), torch.float32,
                 rows_P.to(DEVICE), out=y)
    y = y.cpu()
    want = weighted_sum_torch(out_JD, pos_t, w, nt, torch.float32)
    assert bool(torch.isnan(y[past]).all()), "a row past the bound was written"
    torch.testing.assert_close(y[~past], want[~past], rtol=1e-6, atol=1e-6)


@needs_kernels
def test_fused_expert_rows_row_bound_equals_masked_rows():
    """The fused expert stage with ``rows_P`` (junk ids past the bound) equals, on the rows below the bound, the
    same stage on ids with those rows masked and no bound, bit for bit.
    A bound that does not split the rows evenly is refused by name."""
    from moe_wave import MoEConfig
    from moe_wave.experts import RoutedExperts, _expert_rows_fused

    cfg = MoEConfig(hidden_size=32, intermediate_size=16, num_experts=5, top_k=3, swiglu_limit=7.0)
    g = torch.Generator().manual_seed(2)
    ex = RoutedExperts(cfg, num_local=5, grouped_mm="on", device=DEVICE)
    with torch.no_grad():
        ex.gate_up.copy_(torch.randn(ex.gate_up.shape, generator=g) * 0.1)
        ex.down.copy_(torch.randn(ex.down.shape, generator=g) * 0.1)
    P, RB = 2, 40
    ids, rows_P, masked, past = _bounded_case(P, RB, 3, 5, [17, 33], seed=9)
    x = torch.randn(P * RB, cfg.hidden_size, generator=g).to(DEVICE)
    w = torch.rand(P * RB, 3, generator=g).to(DEVICE)
    offs = _offs(masked, 5).to(DEVICE)
    with torch.no_grad():
        y = _expert_rows_fused(x, ids.to(DEVICE), w, ex, offs, None, rows_P.to(DEVICE))
        want = _expert_rows_fused(x, masked.to(DEVICE), w, ex, offs)
        assert torch.equal(y.cpu()[~past], want.cpu()[~past])
        with pytest.raises(ValueError, match=r"rows_P has 3 entries.*R=80"):
            _expert_rows_fused(x, ids.to(DEVICE), w, ex, offs, None, torch.tensor([1, 2, 3], device=DEVICE))


@needs_kernels
def test_once_fused_stage_matches_torch_path(monkeypatch):
    """The expert stage of rows that stay over several waves (``OnceRows``), W = 3 waves over P = 2 blocks of 6
    rows per wave: the device-count kernels (``_once_fused``, interpreted on CPU) against the torch path, wave by
    wave, each with its own running sums (y): the rows with a pair of the wave agree after it, and the rows
    without one are not written (NaN-filled here at the start)."""
    import moe_wave.experts as mex
    from moe_wave import MoEConfig
    from moe_wave.comm.backend import OnceRows
    from moe_wave.experts import RoutedExperts, _expert_rows_once, _once_fused

    W, P, C, K, e = 3, 2, 6, 3, 6
    cfg = MoEConfig(hidden_size=32, intermediate_size=16, num_experts=e, top_k=K, swiglu_limit=7.0)
    g = torch.Generator().manual_seed(4)
    ex = RoutedExperts(cfg, num_local=e, grouped_mm="on", device=DEVICE)
    with torch.no_grad():
        ex.gate_up.copy_(torch.randn(ex.gate_up.shape, generator=g) * 0.1)
        ex.down.copy_(torch.randn(ex.down.shape, generator=g) * 0.1)
    R = W * P * C
    rows_WP = torch.tensor([[6, 4], [3, 0], [2, 5]])
    ids = torch.randint(0, e, (R, K), generator=g, dtype=torch.int32)
    ids[torch.rand(R, K, generator=g) < 0.3] = -1
    b_r = torch.arange(R) // (P * C)
    wave_of = torch.where(ids >= 0, ids * W // e, W)
    ids = torch.where((wave_of.amin(1) == b_r)[:, None] | (ids < 0), ids, -1)   # a row's first wave is its block's
    x = torch.randn(R, cfg.hidden_size, generator=g)
    w = torch.rand(R, K, generator=g)
    dev = lambda t: t.to(DEVICE)   # noqa: E731
    states = ({}, {})
    monkeypatch.setattr(mex, "_fused_ok", lambda *a: False)
    y_f = torch.full((R, cfg.hidden_size), float("nan"), device=DEVICE)
    touched = torch.zeros(R, dtype=torch.bool)
    for wave in range(W):
        rows_P = torch.where(torch.arange(W)[:, None] <= wave, rows_WP, 0).reshape(-1)
        r_ = torch.arange(R)
        ok = ((r_ % C) < rows_P[r_ // C])[:, None] & (ids >= 0)
        pairs = torch.bincount(torch.where(ok & (ids * W // e == wave), ids, e).reshape(-1).long(),
                               minlength=e + 1)[:e]
        once = [OnceRows(wave, W, st) for st in states]
        with torch.no_grad():        # both take the wave's device pair counts (Received.pairs_e_dev)
            y_t = _expert_rows_once(dev(x), dev(ids), dev(w), ex, dev(pairs), None, dev(rows_P), once[0])
            _once_fused(dev(x), dev(ids), dev(w), ex, dev(pairs), None, dev(rows_P), once[1], y_f)
        mine = (ok & (ids * W // e == wave)).any(1)
        touched |= mine
        assert mine.any() or wave == 1
        torch.testing.assert_close(y_f.cpu()[touched], y_t.cpu()[touched], rtol=1e-5, atol=1e-6)
        assert bool(torch.isnan(y_f.cpu()[~touched]).all()), "a row with no pair so far was written"


def test_expert_order_names_a_tensor_where_its_kernels_cannot_run(monkeypatch):
    """Tensors its Triton kernels cannot take (a CPU tensor on a host without the interpreter, an argument on another
    device) are a ValueError naming the argument and its device, before any launch."""
    import moe_wave.expert_kernels as ek

    ids = torch.zeros(4, 2, dtype=torch.int32)
    offs = torch.tensor([8], dtype=torch.int32)
    monkeypatch.setattr(ek, "triton_ok", lambda device, want=None: True)     # as under the interpreter
    with pytest.raises(ValueError, match=r"expert_order: offs_e is on meta: must be on expert_RK's device cpu"):
        ek.expert_order(ids, 1, offs.to("meta"))
    monkeypatch.setattr(ek, "triton_ok", lambda device, want=None: False)
    with pytest.raises(ValueError, match=r"expert_order: expert_RK is on cpu, where its Triton kernels cannot run"):
        ek.expert_order(ids, 1, offs)

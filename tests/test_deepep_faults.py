"""What DeepEP leaves unchecked, checked by ``moe_wave.deepep_compat`` with no host sync (``guard``), on gloo
ranks (the exchange engine) and on one CPU rank under Triton's interpreter (the direct kernels):

- rows due past ``num_worst_tokens``: the rows past it are dropped (no kernel writes past a region or an output),
  the outputs are NaN, and the next call raises on every rank naming the rank, the count and the limit;
- expert ids equal to ``num_experts``, above it, or below -1 (in ``get_dispatch_layout``, ``dispatch`` and
  ``low_latency_dispatch``): they count as -1 (no raw index error), the outputs are NaN (bf16, FP8 and UE8M0 in
  low-latency mode), the next call raises on every rank naming the rank, the count, the first bad id and the
  limit; ``Buffer.check()`` raises at once;
- an ``is_token_in_rank`` that contradicts ``topk_idx``: the same, naming the tokens;
- constructor arguments of the wrong kind: one-line ValueErrors naming field, value and rule.

After a fault is raised the status is clear and the next calls run normally.
"""

from __future__ import annotations

import pytest
import torch

from moe_wave.comm import EPGroup
from moe_wave.comm.triton_gate import interpreting

H, E, K, T = 128, 12, 3, 12


def _route(rank: int, T_: int = T):
    g = torch.Generator().manual_seed(31 + rank)
    x = torch.randn(T_, H, generator=g, dtype=torch.float32).to(torch.bfloat16)
    ids = torch.rand(T_, E, generator=g, dtype=torch.float32).topk(K, dim=1).indices
    w = torch.rand(T_, K, generator=g, dtype=torch.float32)
    return x, ids, w


def _cfg():
    from moe_wave.deepep_compat import Config

    return Config(24, 8, 256)       # DeepEP's table has no 3-rank entry


def _received(P: int, me: int) -> int:
    """The rows rank ``me`` receives from every rank's ``_route`` (tokens with an expert on it)."""
    e = E // P
    return sum(int(((_route(src)[1] // e) == me).any(1).sum()) for src in range(P))


def _message(fn, exc) -> str:
    try:
        fn()
    except exc as e:
        return str(e)
    raise AssertionError(f"{fn} did not raise {exc.__name__}")


def _ok_round(buf, ep) -> None:
    """A clean dispatch and combine: finite, and the combine sums what it should."""
    x, ids, w = _route(ep.rank)
    n_rank, _, n_exp, in_rank, _ = buf.get_dispatch_layout(ids, E)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=n_exp, topk_idx=ids, topk_weights=w, config=_cfg())
    out, _, _ = buf.combine(recv_x, handle)
    assert torch.isfinite(out.float()).all()
    ref = x.float() * in_rank.sum(1, keepdim=True)
    assert torch.allclose(out.float(), ref, rtol=1e-2, atol=1e-2)


def _faults(ep: EPGroup, normal: str | None) -> list[str]:
    from moe_wave.deepep_compat import Buffer

    buf = Buffer(ep.pg, 0, 0, device="cpu", normal=normal)
    P, me = ep.size, ep.rank
    msgs = []
    x, ids, w = _route(me)

    # rows due past num_worst_tokens
    worst = 2
    n_rank, _, n_exp, in_rank, _ = buf.get_dispatch_layout(ids, E)
    recv_x, r_idx, r_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                                                    num_tokens_per_expert=n_exp, topk_idx=ids, topk_weights=w,
                                                    num_worst_tokens=worst, config=_cfg())
    assert recv_x.shape[0] == worst and torch.isnan(recv_x.float()).all() and torch.isnan(r_w).all()
    got = [_received(P, r) for r in range(P)]
    first = next(r for r in range(P) if got[r] > worst)
    msg = _message(lambda: buf.combine(recv_x, handle), RuntimeError)
    assert f"rank {first} was due {got[first]} received rows" in msg and f"num_worst_tokens={worst}" in msg, msg
    msgs.append(msg)
    _ok_round(buf, ep)

    # expert ids out of range, on the last rank only: == E, > E and < -1
    for bad in (E, E + 5, -2):
        mine = ids.clone()
        if me == P - 1:
            mine[0, 0] = bad
            mine[3, 1] = bad
        n_rank, _, n_exp, in_rank, _ = buf.get_dispatch_layout(mine, E)
        assert int(n_exp.sum()) == int(((mine >= 0) & (mine < E)).sum())
        recv_x, _, r_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                                                    num_tokens_per_expert=n_exp, topk_idx=mine, topk_weights=w,
                                                    config=_cfg())
        assert torch.isnan(recv_x.float()).all() and torch.isnan(r_w).all()
        msg = _message(buf.check, ValueError)
        assert f"rank {P - 1} passed 2 topk_idx entries outside [-1, {E}) (the first: {bad};" in msg, msg
        msgs.append(msg)
        _ok_round(buf, ep)

    # an is_token_in_rank that contradicts topk_idx (rank 0 drops token 1's first rank)
    n_rank, _, n_exp, in_rank, _ = buf.get_dispatch_layout(ids, E)
    wrong = in_rank.clone()
    if me == 0:
        p = int(wrong[1].nonzero()[0])
        wrong[1, p] = False
        n_rank = wrong.sum(0, dtype=torch.int32)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=n_rank, is_token_in_rank=wrong,
                                              num_tokens_per_expert=n_exp, topk_idx=ids, topk_weights=w, config=_cfg())
    msg = _message(lambda: buf.combine(recv_x, handle), ValueError)
    assert f"rank 0 passed an is_token_in_rank that contradicts topk_idx in 1 of its {T} tokens" in msg, msg
    msgs.append(msg)
    _ok_round(buf, ep)
    return msgs


def test_faults_poison_and_raise_on_every_rank(ranks):
    got = ranks(2).run(_faults, "engine")
    assert got[0] == got[1] and len(got[0]) == 5


def test_faults_on_three_ranks(ranks):
    got = ranks(3).run(_faults, "engine")
    assert got[0] == got[1] == got[2]


LL_H, LL_T = 512, 16


def _ll_ok_round(buf, ep) -> None:
    """A clean low-latency dispatch and combine: finite, and the combine sums what it should (the experts return
    the rows they got: token t comes back as x[t] times the sum of its valid weights)."""
    x, ids, w = _route(ep.rank)
    x = x.repeat(1, LL_H // H)
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, ids, LL_T, E, use_fp8=False)
    out, _, _ = buf.low_latency_combine(recv, ids, w, handle)
    assert torch.isfinite(out.float()).all()
    ref = x.float() * torch.where(ids >= 0, w, 0.0).sum(1, keepdim=True)
    assert torch.allclose(out.float(), ref, rtol=2e-2, atol=2e-2)
    buf.check()


def _ll_faults(ep: EPGroup) -> list[str]:
    """Low-latency mode on the exchange engine (gloo ranks): ids outside [-1, E) on the last rank only are sent
    nowhere, every rank's received rows (and scales) are NaN in that call, and the next call (or check()) raises on
    every rank naming the rank, the count, the first bad id and the rule; then the calls run normally."""
    from moe_wave.deepep_compat import Buffer

    buf = Buffer(ep.pg, 0, 0, low_latency_mode=True, device="cpu")
    P, me = ep.size, ep.rank
    msgs = []
    x, ids, w = _route(me)
    x = x.repeat(1, LL_H // H)

    def sent_ids(src: int, bad: int) -> torch.Tensor:      # rank src's ids in this call
        got = _route(src)[1].clone()
        if src == P - 1:
            got[0, 0] = bad
            got[3, 1] = bad
        return got

    for bad, fp8, ue8m0, raise_at in ((E, False, False, "combine"), (E + 5, True, False, "check"),
                                      (-2, True, True, "dispatch")):
        mine = sent_ids(me, bad)
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, mine, LL_T, E, use_fp8=fp8, round_scale=ue8m0,
                                                             use_ue8m0=ue8m0)
        if fp8:
            rows, scales = recv
            assert bool((rows.view(torch.uint8) == 0x7F).all())                     # FP8 NaN bytes
            assert torch.isnan(scales).all() if not ue8m0 else bool((scales == -1).all())
        else:
            assert torch.isnan(recv.float()).all()
        # the counts leave the bad ids out (they name no expert: the reference counts only ids in [0, E))
        e = E // P
        want = [sum(int((sent_ids(s, bad) == me * e + i).any(1).sum()) for s in range(P)) for i in range(e)]
        assert count.tolist() == want, (count.tolist(), want)
        if raise_at == "combine":
            msg = _message(lambda: buf.low_latency_combine(recv, mine, w, handle), ValueError)
        elif raise_at == "check":
            msg = _message(buf.check, ValueError)
        else:
            msg = _message(lambda: buf.low_latency_dispatch(x, ids, LL_T, E, use_fp8=False), ValueError)
        assert f"rank {P - 1} passed 2 topk_idx entries outside [-1, {E}) (the first: {bad};" in msg, msg
        assert "an expert id must be -1 or in [0, num_experts)" in msg and "\n" not in msg, msg
        msgs.append(msg)
        _ll_ok_round(buf, ep)
    return msgs


def test_low_latency_ids_out_of_range_poison_and_raise_on_every_rank(ranks):
    got = ranks(2).run(_ll_faults)
    assert got[0] == got[1] and len(got[0]) == 3


def _direct_overflow(ep: EPGroup) -> str:
    """One rank on the direct kernels (interpreter): more rows than num_worst_tokens never leave the output's
    bounds, the rows are NaN and the next call raises."""
    from moe_wave.deepep_compat import Buffer
    from moe_wave.deepep_compat.normal_direct import DirectNormal

    buf = Buffer(ep.pg, 0, 0, device="cpu", normal="direct", normal_channels=3, normal_rows=2)
    assert isinstance(buf._normal, DirectNormal)
    x, ids, w = _route(0, 11)
    n_rank, _, n_exp, in_rank, _ = buf.get_dispatch_layout(ids, E)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=n_exp, topk_idx=ids, topk_weights=w,
                                              num_worst_tokens=4, config=_cfg())
    assert recv_x.shape[0] == 4 and torch.isnan(recv_x.float()).all()
    assert (handle[5] < 4).all(), "a token placed past the worst-case rows"
    msg = _message(lambda: buf.combine(recv_x, handle), RuntimeError)
    assert "rank 0 was due 11 received rows, more than num_worst_tokens=4" in msg, msg
    _ok_round(buf, ep)
    return msg


def test_direct_kernels_overflow_stays_in_bounds(ranks):
    if not interpreting():
        pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1 (set by conftest without a GPU)")
    assert "num_worst_tokens=4" in ranks(1).run(_direct_overflow)[0]


def _constructor(ep: EPGroup) -> list[str]:
    from moe_wave.deepep_compat import Buffer

    msgs = []
    for kw, words in [(dict(group=5), ("Buffer(group=5)", "ProcessGroup", "int")),
                      (dict(group="world"), ("Buffer(group='world')", "ProcessGroup")),
                      (dict(group=ep.pg, device="tpu"), ("Buffer(device='tpu')", "CUDA device or 'cpu'")),
                      (dict(group=ep.pg, normal="fast"), ("normal", "'fast'", "auto")),
                      (dict(group=ep.pg, options="fast"), ("Buffer(options='fast')", "SymmOptions"))]:
        msg = _message(lambda: Buffer(**kw), ValueError)
        assert all(w in msg for w in words) and "\n" not in msg, (msg, words)
        msgs.append(msg)
    if not torch.cuda.is_available():
        msg = _message(lambda: Buffer(ep.pg, device="cuda"), ValueError)
        assert "Buffer(device='cuda')" in msg and "CUDA is not available" in msg and "\n" not in msg, msg
        msgs.append(msg)
    return msgs


def test_constructor_errors_are_one_line(ranks):
    assert len(ranks(1).run(_constructor)[0]) >= 5

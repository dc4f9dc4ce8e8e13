"""Calls that go out of step between ranks (issue 53, item 2): a per-call ``overlap`` that differs by rank, an error
caught on one rank only, ranks calling layers of different hidden sizes. The call header in the count exchange
(``moe_wave.comm.header``) turns each into the same ValueError on every rank, naming the field and each rank's value,
before any row moves (without it: gloo's size-mismatch abort, or a silently shifted pairing of calls). Also: a rank
that dies by signal is reported with its last stderr lines, and ``RankFailure.root_rank`` agrees with the message."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist

from moe_wave import MoEConfig, WaveConfig, WaveMoE
from moe_wave.comm import RankFailure, spawn
from moe_wave.comm.header import ORDER_RULE, CallHeader, HeaderMismatch, agreed_call, check_headers

CFG = MoEConfig.preset("tiny", num_experts=4, top_k=2)


def _moe(ep, backend: str, cfg=CFG) -> WaveMoE:
    torch.manual_seed(0)
    m = WaveMoE(cfg, ep=ep, wave=WaveConfig(num_waves=2, backend=backend))
    for p in m.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    return m


def _x(ep, D: int = CFG.hidden_size, T: int = 12) -> torch.Tensor:
    return torch.randn(T, D, generator=torch.Generator().manual_seed(ep.rank))


def _call(fn):
    try:
        return fn()
    except ValueError as e:
        return str(e)


def _overlap_by_rank(ep, backend):
    m = _moe(ep, backend)
    first = _call(lambda: m(_x(ep), overlap=ep.rank == 0))
    again = m(_x(ep), overlap=True)        # in step again: the next call runs
    return first, tuple(again.shape)


def _error_on_one_rank(ep, backend):
    m = _moe(ep, backend)
    if ep.rank == 0:                       # a serving loop catches this error and goes on
        assert "dtype" in _call(lambda: m(_x(ep).double()))
    first = _call(lambda: m(_x(ep)))
    again = m(_x(ep))                      # the call counts agree again after the error
    return first, tuple(again.shape)


def _hidden_by_rank(ep, backend):
    a, b = _moe(ep, backend), _moe(ep, backend, MoEConfig.preset("tiny", num_experts=4, top_k=2,
                                                               hidden_size=CFG.hidden_size + 32))
    m = (a, b)[ep.rank]
    return _call(lambda: m(_x(ep, m.cfg.hidden_size))), None


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["torch", "symm"])     # symm: its emulated count exchange on gloo
@pytest.mark.parametrize("fn, fields", [
    (_overlap_by_rank, "overlap: rank 0 True, rank 1 False"),
    (_error_on_one_rank, "call: rank 0 2, rank 1 1"),
    (_hidden_by_rank, f"hidden: rank 0 {CFG.hidden_size}, rank 1 {CFG.hidden_size + 32}"),
])
def test_a_desync_is_the_same_error_on_every_rank(ranks, fn, fields, backend):
    (msg0, again0), (msg1, again1) = ranks(2).run(fn, backend)
    assert msg0 == msg1, (msg0, msg1)
    assert "WaveMoE.forward out of step between ranks" in msg0 and fields in msg0, msg0
    assert len(msg0.splitlines()) == 1


def test_headers_name_each_field_and_value():
    h = CallHeader(kind="WaveMoE.forward", module=3, call=7, overlap=True, hidden=64, dtype=torch.bfloat16)
    check_headers([h.encode(), h.encode()])
    other = CallHeader(kind="WaveMoE.forward", module=3, call=7, overlap=True, hidden=64, dtype=torch.float32)
    with pytest.raises(HeaderMismatch, match=r"\(dtype: rank 0 bfloat16, rank 1 float32\): every rank must") as e:
        check_headers([h.encode(), other.encode()])
    assert [x["call"] for x in e.value.headers] == [7, 7]
    with pytest.raises(ValueError, match=r"kind: rank 0 WaveMoE.forward, rank 1 none"):
        check_headers([h.encode(), [0] * len(h.encode())])


def test_calls_of_different_kinds_name_the_kinds_and_the_order_rule():
    """Fields past the call number mean different things per kind: a kind mismatch names the kind (and the module
    and call number where they differ too), with the rule of calls in order; ``agreed_call`` realigns a count that
    several kinds share."""
    d = CallHeader(kind="deep_ep.Buffer.dispatch", module=0, call=4, overlap=False, hidden=64, dtype=torch.bfloat16,
                   top_k=2, experts=8)
    c = CallHeader(kind="deep_ep.Buffer.combine", module=0, call=3, overlap=False, hidden=64, dtype=torch.bfloat16)
    with pytest.raises(HeaderMismatch) as e:
        check_headers([d.encode(), c.encode()])
    assert str(e.value) == ("calls out of step between ranks (call kind: rank 0 deep_ep.Buffer.dispatch, rank 1 "
                            "deep_ep.Buffer.combine; call: rank 0 4, rank 1 3): " + ORDER_RULE)
    assert agreed_call(e.value, ("deep_ep.Buffer.dispatch", "deep_ep.Buffer.combine"), 0, 3) == 4
    assert agreed_call(e.value, "deep_ep.Buffer.combine", 0, 3) == 3


# ----------------------------------------------------------------------------- failure reports

def _abort_rank1(ep):
    if ep.rank == 1:
        os.write(2, b"gloo/transport: message size mismatch (the last words before the abort)\n")
        os.kill(os.getpid(), signal.SIGABRT)
    dist.barrier()
    return ep.rank


@pytest.mark.timeout(120)
def test_a_rank_killed_by_a_signal_quotes_its_last_stderr_lines():
    with pytest.raises(RankFailure) as info:
        spawn(_abort_rank1, 2, backend="gloo", timeout_s=10, grace_s=2)
    msg = str(info.value)
    assert info.value.root_rank == 1, msg[-3000:]
    assert "killed by SIGABRT" in msg and "message size mismatch (the last words before the abort)" in msg, msg[-3000:]

"""DeepEP-API ranks out of step (issue 53, item 2): ranks calling ``deep_ep.Buffer.dispatch`` or
``low_latency_dispatch`` with different hidden sizes, dtypes, top-k widths, numbers of experts, receive bounds, or
after an error caught on one rank only. The call header rides the dispatch's count all-gather (normal mode) or the
symm backend's count exchange (low-latency mode on the exchange engine, which sends the header and the count row's
width first), so each is the same ValueError on every rank, naming the field, each rank's value and the rule, before
any row moves (without it: gloo's size-mismatch abort, SIGABRT, or calls paired out of step), and the next call in
step runs. The direct kernels' count all-gather (``CountGather``) has a width every rank agreed on, so another
number of experts is a header mismatch there too, and the direct path gathers before it takes a path, so a rank
whose rows take the engine (not whole 4-byte words) is one as well (without it: gathers of two widths, SIGABRT).
``combine``, a cached ``dispatch``, ``low_latency_dispatch`` and ``low_latency_combine`` gather their headers
first on CPU ranks, in an all-gather of the shape of a dispatch's count all-gather, so calls of different kinds
meeting are the same ValueError naming each rank's call kind (without it: gloo's SIGABRT or its timeout), and
the Buffer's one call count keeps the next calls in step. Also the device-side form (a GPU dispatch with
``num_worst_tokens`` reads nothing on the host): the guard records the first differing field and raises it later.
"""

from __future__ import annotations

import pytest
import torch

from moe_wave.comm import EPGroup

E, K, T = 12, 3, 12
RULE = "every rank must call dispatch the same number of times, each with a handle where the others pass one"
LL_RULE = "every rank must call low_latency_dispatch the same number of times"


def _route(rank: int, H: int = 128, dtype=torch.bfloat16, k: int = K):
    g = torch.Generator().manual_seed(31 + rank)
    x = torch.randn(T, H, generator=g, dtype=torch.float32).to(dtype)
    ids = torch.rand(T, E, generator=g, dtype=torch.float32).topk(k, dim=1).indices
    w = torch.rand(T, k, generator=g, dtype=torch.float32)
    return x, ids, w


def _dispatch(buf, x, ids, w, worst: int = 0):
    from moe_wave.deepep_compat import Config

    n_rank, _, n_exp, in_rank, _ = buf.get_dispatch_layout(ids, E)
    return buf.dispatch(x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_exp,
                        topk_idx=ids, topk_weights=w, num_worst_tokens=worst, config=Config(24, 8, 256))


def _in_step_round(buf, ep) -> None:
    """A dispatch and combine every rank makes alike: it runs, and sums what it should."""
    x, ids, w = _route(ep.rank)
    recv_x, _, _, _, handle, _ = _dispatch(buf, x, ids, w)
    out, _, _ = buf.combine(recv_x, handle)
    n_rank, _, _, in_rank, _ = buf.get_dispatch_layout(ids, E)
    assert torch.allclose(out.float(), x.float() * in_rank.sum(1, keepdim=True), rtol=1e-2, atol=1e-2)


def _assert_same_error(msgs: list, call: str, fields: str, rule: str) -> None:
    """Both ranks' messages: the same one line, ``call`` out of step naming ``fields``, with the kind's rule."""
    msg0, msg1 = msgs
    assert msg0 == msg1, (msg0, msg1)
    assert msg0.startswith(f"deep_ep.Buffer.{call} out of step between ranks " + fields), msg0
    assert rule in msg0 and "\n" not in msg0


def _message(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def _normal_case(ep: EPGroup, case: str) -> str:
    from moe_wave.deepep_compat import Buffer

    buf = Buffer(ep.pg, 0, 0, device="cpu", normal="engine")
    one = ep.rank == 1
    x, ids, w = _route(ep.rank)
    if case == "hidden":
        x, ids, w = _route(ep.rank, H=256 if one else 128)
        msg = _message(lambda: _dispatch(buf, x, ids, w))
    elif case == "hidden_worst":            # num_worst_tokens: on CPU ranks the gather is host memory
        x, ids, w = _route(ep.rank, H=256 if one else 128)
        msg = _message(lambda: _dispatch(buf, x, ids, w, worst=2 * T))
    elif case == "dtype":
        x, ids, w = _route(ep.rank, dtype=torch.float32 if one else torch.bfloat16)
        msg = _message(lambda: _dispatch(buf, x, ids, w))
    elif case == "top_k":
        x, ids, w = _route(ep.rank, k=2 if one else K)
        msg = _message(lambda: _dispatch(buf, x, ids, w))
    elif case == "worst":
        msg = _message(lambda: _dispatch(buf, x, ids, w, worst=2 * T if one else 0))
    elif case == "error_on_one_rank":       # a serving loop catches an argument error on rank 0 and goes on
        if ep.rank == 0:
            assert "num_worst_tokens" in _message(lambda: _dispatch(buf, x, ids, w, worst=-1))
        msg = _message(lambda: _dispatch(buf, x, ids, w))
    else:
        raise AssertionError(case)
    _in_step_round(buf, ep)                 # in step again: the next calls run
    return msg


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case, fields", [
    ("hidden", "(hidden: rank 0 128, rank 1 256)"),
    ("hidden_worst", "(hidden: rank 0 128, rank 1 256)"),
    ("dtype", "(dtype: rank 0 bfloat16, rank 1 float32)"),
    ("top_k", "(top_k: rank 0 3, rank 1 2)"),
    ("worst", "(num_worst_tokens: rank 0 0, rank 1 24)"),
    ("error_on_one_rank", "(call: rank 0 2, rank 1 1)"),
])
def test_normal_dispatch_out_of_step_is_the_same_error_on_every_rank(ranks, case, fields):
    _assert_same_error(ranks(2).run(_normal_case, case), "dispatch", fields, RULE)


def _count_gather_case(ep: EPGroup, case: str) -> str:
    """The direct kernels' count all-gather (``normal_direct.CountGather``: the GPU path, whose rows need peer
    memory, gathers its counts like this) on gloo ranks: rank 1 passes another number of experts, whose per-expert
    counts are part of the gather. Its tail has the width every rank agreed on, so the gather matches and the
    header names the mismatch on every rank; then gathers in step return every rank's counts, also after the
    number of experts changes on every rank."""
    from moe_wave.comm.deepep_normal import CompactExchange
    from moe_wave.comm.header import CallHeader
    from moe_wave.deepep_compat.guard import Guard
    from moe_wave.deepep_compat.normal_direct import CountGather
    from moe_wave.deepep_compat.normal_plan import channel_counts

    P, nch = ep.size, 3
    gather = CountGather(CompactExchange(ep), Guard(ep.rank, ep.device), nch)
    calls = [0]

    def call(experts: int):
        calls[0] += 1
        _, ids, _ = _route(ep.rank)
        ids = ids * (experts // E)                      # ids in [0, experts)
        in_rank = torch.zeros(T, P, dtype=torch.bool).scatter_(1, ids // (experts // P), True)
        per_expert = torch.bincount(ids.reshape(-1), minlength=experts).to(torch.int32)
        head = CallHeader(kind="deep_ep.Buffer.dispatch", module=0, call=calls[0], overlap=False, hidden=128,
                          dtype=torch.bfloat16, top_k=K, experts=experts)
        chan = channel_counts(in_rank, nch)
        chan_G, tokens_P, _, per_expert_PE = gather(chan, per_expert, T, head, 0, True)
        mine = ep.rank
        assert torch.equal(chan_G[mine], chan) and tokens_P.tolist() == [T] * P
        assert torch.equal(per_expert_PE[mine], per_expert.long()), (per_expert_PE, per_expert)
        assert gather.experts == experts

    if case == "later":                     # the tail has the agreed width of an earlier call
        call(E)
    msg = _message(lambda: call(2 * E if ep.rank == 1 else E))
    call(E)                                 # in step again: the counts of every rank
    call(2 * E)                             # every rank changes its number of experts: one more gather
    call(2 * E)
    return msg


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["first", "later"])
def test_direct_count_gather_with_another_num_experts_is_the_same_error_on_every_rank(ranks, case):
    _assert_same_error(ranks(2).run(_count_gather_case, case), "dispatch", f"(num_experts: rank 0 {E}, rank 1 {2 * E})",
                       RULE)


def _cached_case(ep: EPGroup, case: str) -> str:
    """A dispatch in step, then a cached dispatch (its handle) out of step: on CPU ranks the cached dispatch gathers
    its header first, in the shape of a dispatch's count all-gather (without it: gloo's timeout or abort)."""
    from moe_wave.deepep_compat import Buffer

    buf = Buffer(ep.pg, 0, 0, device="cpu", normal="engine")
    x, ids, w = _route(ep.rank)
    recv_x, _, _, _, handle, _ = _dispatch(buf, x, ids, w)
    one = ep.rank == 1
    if case == "fresh_vs_cached":           # rank 1 reuses the handle, rank 0 dispatches afresh
        msg = _message(lambda: buf.dispatch(x, handle=handle) if one else _dispatch(buf, x, ids, w))
    elif case == "hidden":                  # both cached, rank 1 with rows of another width
        y = torch.cat([x, x], 1) if one else x
        msg = _message(lambda: buf.dispatch(y, handle=handle))
    elif case == "error_on_one_rank":       # rank 0 catches an argument error of a cached dispatch and goes on
        if ep.rank == 0:
            assert "tokens" in _message(lambda: buf.dispatch(x[:2], handle=handle))
        msg = _message(lambda: buf.dispatch(x, handle=handle))
    else:
        raise AssertionError(case)
    again, *_ = buf.dispatch(x, handle=handle)        # in step again: a cached dispatch runs and matches
    assert torch.equal(again, recv_x)
    _in_step_round(buf, ep)
    return msg


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case, fields", [
    ("fresh_vs_cached", "(handle given: rank 0 False, rank 1 True)"),
    ("hidden", "(hidden: rank 0 128, rank 1 256)"),
    ("error_on_one_rank", "(call: rank 0 3, rank 1 2)"),
])
def test_cached_dispatch_out_of_step_on_cpu_ranks_is_the_same_error_on_every_rank(ranks, case, fields):
    _assert_same_error(ranks(2).run(_cached_case, case), "dispatch", fields, RULE)


COMBINE_RULE = "every rank must call combine the same number of times"


def _combine_case(ep: EPGroup, case: str) -> str:
    """A dispatch in step, then a combine out of step: on CPU ranks its header is gathered before its rows."""
    from moe_wave.deepep_compat import Buffer

    buf = Buffer(ep.pg, 0, 0, device="cpu", normal="engine")
    x, ids, w = _route(ep.rank)
    recv_x, _, recv_w, _, handle, _ = _dispatch(buf, x, ids, w)
    one = ep.rank == 1
    if case == "hidden":                    # rank 1 sends back rows of another width
        y = torch.cat([recv_x, recv_x], 1) if one else recv_x
        msg = _message(lambda: buf.combine(y, handle))
    elif case == "weights":                 # rank 1 sums topk_weights too, rank 0 does not
        msg = _message(lambda: buf.combine(recv_x, handle, topk_weights=recv_w if one else None))
    elif case == "error_on_one_rank":       # rank 0 catches an argument error and goes on
        if ep.rank == 0:
            assert "rows" in _message(lambda: buf.combine(recv_x[:1], handle))
        msg = _message(lambda: buf.combine(recv_x, handle))
    else:
        raise AssertionError(case)
    _in_step_round(buf, ep)                 # in step again: the next calls run
    return msg


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case, fields", [
    ("hidden", "(hidden: rank 0 128, rank 1 256)"),
    ("weights", "(topk_weights columns: rank 0 0, rank 1 3)"),
    ("error_on_one_rank", "(call: rank 0 3, rank 1 2)"),        # one count: the dispatch was call 1
])
def test_combine_out_of_step_on_cpu_ranks_is_the_same_error_on_every_rank(ranks, case, fields):
    _assert_same_error(ranks(2).run(_combine_case, case), "combine", fields, COMBINE_RULE)


LL_H, LL_T = 256, 16


def _ll_case(ep: EPGroup, case: str) -> str:
    from moe_wave.deepep_compat import Buffer

    buf = Buffer(ep.pg, 0, 0, low_latency_mode=True, device="cpu")
    one = ep.rank == 1
    g = torch.Generator().manual_seed(7 + ep.rank)
    H = 2 * LL_H if case == "hidden" and one else LL_H
    x = torch.randn(T, H, generator=g, dtype=torch.float32).to(torch.bfloat16)
    ids = torch.rand(T, E, generator=g, dtype=torch.float32).topk(K, dim=1).indices
    fp8 = case == "use_fp8" and one
    tokens = 2 * LL_T if case == "tokens" and one else LL_T
    experts = 2 * E if case == "experts" and one else E     # the count row's width follows it
    msg = _message(lambda: buf.low_latency_dispatch(x, ids, tokens, experts, use_fp8=fp8))
    x = x[:, :LL_H].contiguous()
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, ids, LL_T, E, use_fp8=False)   # in step again
    e = E // ep.size
    assert int(count.sum()) == int(handle[1].bitwise_and(0xFFFFFFFF).sum())
    assert recv_x.shape == (e, ep.size * LL_T, LL_H)
    return msg


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case, fields", [
    ("hidden", f"(hidden: rank 0 {LL_H}, rank 1 {2 * LL_H})"),
    ("use_fp8", "(dtype (use_fp8): rank 0 bfloat16, rank 1 float8_e4m3fn)"),
    ("tokens", f"(num_max_dispatch_tokens_per_rank: rank 0 {LL_T}, rank 1 {2 * LL_T})"),
    ("experts", f"(num_experts: rank 0 {E}, rank 1 {2 * E})"),
])
def test_low_latency_dispatch_out_of_step_is_the_same_error_on_every_rank(ranks, case, fields):
    _assert_same_error(ranks(2).run(_ll_case, case), "low_latency_dispatch", fields, LL_RULE)


def test_device_side_header_fault_names_the_field_rank_and_values():
    """The form a GPU dispatch with num_worst_tokens takes (no host read): the guard folds the gathered headers on
    the device, poisons, and the next call raises naming the field, the first differing rank and both values."""
    from moe_wave.comm.header import CallHeader
    from moe_wave.deepep_compat.guard import WORDS, Guard

    def head(hidden, call=1):
        return CallHeader(kind="deep_ep.Buffer.dispatch", module=0, call=call, overlap=False, hidden=hidden,
                          dtype=torch.bfloat16, top_k=K, experts=E, rows=24).encode()

    g = Guard(0, torch.device("cpu"))
    words = torch.zeros(3, WORDS, dtype=torch.int64)
    g.fold(words, None, 24, torch.tensor([head(128)] * 3))       # in step: nothing recorded
    g.snapshot()
    g.raise_if_flagged("dispatch")
    g.fold(words, None, 24, torch.tensor([head(128), head(128), head(256)]))
    out = torch.ones(2, 2)
    g.poison(out)
    assert torch.isnan(out).all()
    g.snapshot()
    with pytest.raises(ValueError) as info:
        g.raise_if_flagged("combine")
    msg = str(info.value)
    assert msg.startswith("deep_ep.Buffer.combine: the ranks' dispatches were out of step (hidden: rank 0 128, "
                          "rank 2 256): " + RULE), msg
    assert "poisoned with NaN" in msg and "\n" not in msg
    g.raise_if_flagged("dispatch")          # raising cleared it


def test_guard_reads_nothing_on_the_host():
    """Every device-side step of the guard (the checks, the words, the fold with and without headers, the header
    on the device, the poisoning) runs on the meta device, where any host read of a value raises: none of them syncs."""
    from moe_wave.comm.header import CallHeader
    from moe_wave.deepep_compat.guard import WORDS, Guard

    meta = torch.device("meta")
    g = Guard(0, meta)
    ids = torch.zeros(T, K, dtype=torch.int64, device=meta)
    g.check_ids(ids, E)
    g.check_in_rank(torch.zeros(T, 2, dtype=torch.bool, device=meta), ids, E)
    words = torch.stack([g.words(), g.words()])
    g.fold(words, None, 0)
    h = CallHeader(kind="deep_ep.Buffer.dispatch", module=0, call=0, overlap=False, hidden=128, dtype=torch.bfloat16)
    head = g.device_header(h)
    g.fold(words, torch.zeros(2, dtype=torch.int64, device=meta), 24, torch.stack([head, head]))
    g.poison(torch.ones(2, 4, device=meta), torch.ones(2, 4, device=meta).to(torch.float8_e4m3fn))
    assert words.shape == (2, WORDS)


ORDER_RULE = "every rank must make the same calls in the same order"
KIND = "deep_ep.Buffer."


def _ll_round(buf, ep, H: int = LL_H):
    """A low-latency dispatch and combine every rank makes alike: the combine sums each token's weighted rows."""
    g = torch.Generator().manual_seed(7 + ep.rank)
    x = torch.randn(T, H, generator=g, dtype=torch.float32).to(torch.bfloat16)
    ids = torch.rand(T, E, generator=g, dtype=torch.float32).topk(K, dim=1).indices
    w = torch.rand(T, K, generator=g, dtype=torch.float32)
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, ids, LL_T, E, use_fp8=False)
    return x, ids, w, recv_x, handle


def _ll_in_step_round(buf, ep) -> None:
    x, ids, w, recv_x, handle = _ll_round(buf, ep)
    out, _, _ = buf.low_latency_combine(recv_x, ids, w, handle)
    assert torch.allclose(out.float(), x.float() * w.sum(1, keepdim=True), rtol=2e-2, atol=2e-2)


def _kinds_case(ep: EPGroup, case: str) -> str:
    """Rank 0 makes one call, rank 1 another kind of call, on one Buffer of gloo ranks (both modes): each call's
    first exchange on CPU ranks has the shape of a dispatch's count all-gather and carries its header, so the two
    meet as a HeaderMismatch naming the call kinds (without it: gloo's SIGABRT or a hang)."""
    from moe_wave.deepep_compat import Buffer

    buf = Buffer(ep.pg, 0, 0, low_latency_mode=True, explicitly_destroy=True, device="cpu", normal="engine")
    x, ids, w = _route(ep.rank)
    recv_x, _, _, _, handle, _ = _dispatch(buf, x, ids, w)                  # in step: a handle for each kind
    lx, lids, lw, lrecv, lhandle = _ll_round(buf, ep)
    calls = {
        "dispatch": lambda: _dispatch(buf, x, ids, w),
        "cached": lambda: buf.dispatch(x, handle=handle),
        "combine": lambda: buf.combine(recv_x, handle),
        "low_latency_dispatch": lambda: buf.low_latency_dispatch(lx, lids, LL_T, E, use_fp8=False),
        "low_latency_combine": lambda: buf.low_latency_combine(lrecv, lids, lw, lhandle),
        "destroy": buf.destroy,
    }
    mine = case.split("/")[ep.rank]
    msg = _message(calls[mine])
    _in_step_round(buf, ep)                 # in step again: the next calls of both modes run
    _ll_in_step_round(buf, ep)
    again, *_ = buf.dispatch(x, handle=handle)
    assert torch.equal(again, recv_x)
    buf.destroy()                           # in step: the buffer's last call, on every rank
    return msg


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["dispatch/combine", "cached/combine", "dispatch/low_latency_dispatch",
                                  "low_latency_dispatch/low_latency_combine", "combine/low_latency_combine",
                                  "low_latency_combine/dispatch", "destroy/dispatch", "combine/destroy"])
def test_calls_of_another_kind_are_the_same_error_on_every_rank(ranks, case):
    a, b = case.split("/")
    msgs = ranks(2).run(_kinds_case, case)
    a, b = ("dispatch" if k == "cached" else k for k in (a, b))
    msg0, msg1 = msgs
    assert msg0 == msg1, (msg0, msg1)
    assert msg0.startswith(f"calls out of step between ranks (call kind: rank 0 {KIND}{a}, rank 1 {KIND}{b}): "
                           + ORDER_RULE), msg0
    assert "\n" not in msg0


LL_COMBINE_RULE = "every rank must call low_latency_combine the same number of times"


def _ll_combine_case(ep: EPGroup, case: str) -> str:
    """A low-latency dispatch in step, then a low-latency combine out of step: on CPU ranks its header is gathered
    before its rows (without it: the retry of rank 0 pairs with rank 1's first call)."""
    from moe_wave.deepep_compat import Buffer

    buf = Buffer(ep.pg, 0, 0, low_latency_mode=True, device="cpu")
    x, ids, w, recv_x, handle = _ll_round(buf, ep)
    if case == "error_on_one_rank":         # rank 0 catches an argument error and goes on
        if ep.rank == 0:
            assert "x is" in _message(lambda: buf.low_latency_combine(recv_x[:, :3], ids, w, handle))
        msg = _message(lambda: buf.low_latency_combine(recv_x, ids, w, handle))
    else:
        raise AssertionError(case)
    _ll_in_step_round(buf, ep)
    _in_step_round(buf, ep)
    return msg


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case, fields", [("error_on_one_rank", "(call: rank 0 3, rank 1 2)")])
def test_low_latency_combine_out_of_step_is_the_same_error_on_every_rank(ranks, case, fields):
    _assert_same_error(ranks(2).run(_ll_combine_case, case), "low_latency_combine", fields, LL_COMBINE_RULE)


def _direct_widths_case(ep: EPGroup) -> str:
    """``DirectNormal`` (the GPU path) on gloo ranks, each rank's regions its own memory (so no row crosses in the
    direct kernels): rank 0's rows are whole 4-byte words (the direct kernels' path), rank 1's are not (the engine
    path). Both paths gather the counts in the direct kernels' shape first, so the two meet as a HeaderMismatch
    naming the hidden size (without it: count gathers of different widths, gloo's SIGABRT; NCCL a hang). Then a
    round in step on the engine path, through the same gather."""
    from moe_wave.comm.options import SymmOptions
    from moe_wave.deepep_compat import Config
    from moe_wave.deepep_compat.guard import Guard
    from moe_wave.deepep_compat.normal import Route
    from moe_wave.deepep_compat.normal_direct import DirectNormal
    from moe_wave.deepep_compat.normal_engine import EngineNormal

    guard = Guard(ep.rank, ep.device)
    engine = EngineNormal(ep, SymmOptions(), None, guard)
    own = lambda nbytes: [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(ep.size)]   # noqa: E731
    normal = DirectNormal(ep, engine, guard, 3, 8, 1000, alloc=own)
    P = ep.size

    def call(H: int, n: int):
        x, ids, w = _route(ep.rank, H=H)
        per_rank, per_expert, in_rank = engine.layout(ids, E)       # the direct layout's values, in torch
        route = Route(per_rank, in_rank, per_expert, ids, w, 1, 0, call=n)
        return x, in_rank, normal.dispatch(x, route, Config(24, 8, 256))

    msg = _message(lambda: call(127 if ep.rank == 1 else 128, 1))
    for n in (2, 3):                        # in step again: odd rows on every rank take the engine path
        x, in_rank, (recv_x, _, _, counts_e, handle) = call(127, n)
        assert recv_x.shape[1] == 127 and len(counts_e) == E // P
        out, _ = normal.combine(recv_x, handle, None, ())
        assert torch.allclose(out.float(), x.float() * in_rank.sum(1, keepdim=True), rtol=1e-2, atol=1e-2)
    return msg


@pytest.mark.timeout(180)
def test_direct_dispatch_with_rows_of_another_path_is_the_same_error_on_every_rank(ranks):
    _assert_same_error(ranks(2).run(_direct_widths_case), "dispatch", "(hidden: rank 0 128, rank 1 127)", RULE)


def _settings_case(ep: EPGroup, case: str) -> str:
    """Ranks constructing their Buffers with different settings: the construction's one object gather compares
    them, so it is the same ValueError on every rank (without it: ``normal_channels`` sizes the direct dispatch's
    count gather, and ranks that differ meet in gathers of two sizes, NCCL's hang or gloo's abort, at the first
    dispatch). Then Buffers made alike run."""
    from moe_wave.comm.options import SymmOptions
    from moe_wave.deepep_compat import Buffer

    one = ep.rank == 1
    if case == "normal_channels":
        msg = _message(lambda: Buffer(ep.pg, 0, 0, device="cpu", normal_channels=16 if one else 32))
    elif case == "normal":
        msg = _message(lambda: Buffer(ep.pg, 0, 0, device="cpu", normal="engine" if one else "auto"))
    elif case == "kernels":
        msg = _message(lambda: Buffer(ep.pg, 0, 0, device="cpu",
                                      options=SymmOptions(kernels="torch" if one else "auto")))
    elif case == "signal":
        msg = _message(lambda: Buffer(ep.pg, 0, 0, device="cpu",
                                      options=SymmOptions(signal="flags" if one else "barrier")))
    elif case == "bytes":                   # a bad argument on one rank: its error, on every rank
        msg = _message(lambda: Buffer(ep.pg, -1 if one else 0, 0, device="cpu"))
    elif case == "device":
        msg = _message(lambda: Buffer(ep.pg, 0, 0, device="tpu" if one else "cpu"))
    elif case == "channels":
        msg = _message(lambda: Buffer(ep.pg, 0, 0, device="cpu", normal_channels=0 if one else 16))
    elif case == "timeout":                 # a timeout may differ: every rank builds its Buffer
        Buffer(ep.pg, 0, 0, device="cpu", options=SymmOptions(timeout_ms=5000 if one else 9000))
        msg = "no error"
    else:
        raise AssertionError(case)
    buf = Buffer(ep.pg, 0, 0, device="cpu", normal_channels=16)
    _in_step_round(buf, ep)
    return msg


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case, values", [
    ("normal_channels", "Buffer(normal_channels): rank 0 32, rank 1 16"),
    ("normal", "Buffer(normal): rank 0 'auto', rank 1 'engine'"),
    ("kernels", "Buffer(options.kernels): rank 0 'auto', rank 1 'torch'"),
    ("signal", "Buffer(options.signal): rank 0 'barrier', rank 1 'flags'"),
    ("timeout", "no error"),
    ("bytes", "rank 1: Buffer(num_nvl_bytes=-1): must be an int >= 0"),
    ("device", "rank 1: Buffer(device='tpu'): must be a CUDA device or 'cpu'"),
    ("channels", "rank 1: Buffer(normal_channels=...)"),
])
def test_buffers_built_with_different_settings_are_the_same_error_on_every_rank(ranks, case, values):
    """Settings that differ, and an argument one rank alone gets wrong (without the gather of each rank's argument
    error: that rank's error, and the other's wait in the gather until its timeout)."""
    msg0, msg1 = ranks(2).run(_settings_case, case)
    assert msg0 == msg1 and msg0.startswith(values), (msg0, msg1)
    if values.startswith("rank 1:"):
        assert msg0.endswith("; every rank stops building its Buffer") and "\n" not in msg0, msg0
    elif values != "no error":
        assert "every rank must construct its Buffer with the same settings" in msg0 and "\n" not in msg0

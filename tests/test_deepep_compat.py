"""``moe_wave.deepep_compat`` (DeepEP V1's API on the symm engine) on gloo ranks: DeepEP's normal-mode contract
against a reference every rank computes from every rank's inputs (they are made from per-rank seeds).

Checked: the layout; dispatch with and without top-k, bf16 and (fp8, scales) tuples (bytes and scales round-trip
bit for bit, float32 and packed int32 scales with column-major strides), -1 top-k entries, a rank with no tokens,
rows grouped by source rank in token order, the handle's rank prefix matrix and source indices, worst-token
padding, cached dispatch, combine (sum over the receiving ranks, top-k weights the same way, bias), the stream
arguments' rules on CPU, the switch (install / shim), and the errors.
"""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch

from moe_wave.comm import EPGroup
from moe_wave.comm.options import SymmOptions
from moe_wave.comm.triton_gate import interpreting

H, E, K = 256, 12, 3


def _inputs(rank: int, P: int, T_of):
    """Rank ``rank``'s tokens: x rows that say (rank, token), top-k with some -1, weights."""
    T = T_of(rank)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g, dtype=torch.float32).to(torch.bfloat16)
    x[:, 0] = rank
    x[:, 1] = torch.arange(T, dtype=torch.float32).to(torch.bfloat16)   # exact up to 256
    scores = torch.rand(T, E, generator=g, dtype=torch.float32)
    ids = scores.topk(K, dim=1).indices
    ids[torch.rand(T, K, generator=g, dtype=torch.float32) < 0.2] = -1
    w = torch.rand(T, K, generator=g, dtype=torch.float32)
    return x, ids, w


def _reference(P: int, me: int, T_of):
    """The rows rank ``me`` receives in DeepEP's order: (source, token) for sources in rank order, tokens in order;
    the global per-expert counts of my experts; the [P, P] count matrix."""
    e = E // P
    order, per_expert, counts = [], torch.zeros(e, dtype=torch.long), torch.zeros(P, P, dtype=torch.long)
    for src in range(P):
        _, ids, _ = _inputs(src, P, T_of)
        valid = ids >= 0
        rank_TK = torch.where(valid, ids // e, -1)
        for t in range(ids.shape[0]):
            ranks = set(rank_TK[t][valid[t]].tolist())
            for p in ranks:
                counts[src, p] += 1
            if me in ranks:
                order.append((src, t))
        for i in range(e):
            per_expert[i] += int((ids == me * e + i).sum())
    return order, per_expert.tolist(), counts


def _fp8(x: torch.Tensor, int_scales: bool):
    """(fp8, scales) with column-major scales (DeepEP's test does x_scales.T.contiguous().T)."""
    T = x.shape[0]
    amax = x.float().view(T, H // 128, 128).abs().amax(-1).clamp(min=1e-4)
    x8 = (x.float().view(T, H // 128, 128) * (448.0 / amax[..., None])).view(T, H).to(torch.float8_e4m3fn)
    sc = (amax / 448.0)
    if int_scales:
        sc = torch.arange(T * sc.shape[1], dtype=torch.int32).view(T, H // 128) * 7 + 3
    return x8, sc.T.contiguous().T


def _normal_contract(ep: EPGroup, T_list, kernels: str, normal: str | None = None) -> dict:
    from moe_wave.deepep_compat import Buffer, Config, topk_idx_t

    P, me = ep.size, ep.rank
    T_of = lambda r: T_list[r]  # noqa: E731
    x, ids, w = _inputs(me, P, T_of)
    ids = ids.to(topk_idx_t)
    order, per_expert_ref, counts = _reference(P, me, T_of)
    buf = Buffer(ep.pg, int(1e8), 0, low_latency_mode=False, num_qps_per_rank=1, explicitly_destroy=True,
                 allow_mnnvl=False, use_fabric=False, options=SymmOptions(kernels=kernels), device="cpu",
                 normal=normal, normal_channels=3, normal_rows=4)
    from moe_wave.deepep_compat.normal_direct import DirectNormal

    assert isinstance(buf._normal, DirectNormal) == (normal == "direct")
    res = {}
    # layout
    n_rank, n_rdma, n_exp, in_rank, ev = buf.get_dispatch_layout(ids, E)
    e = E // P
    ref_in_rank = torch.zeros(x.shape[0], P, dtype=torch.bool)
    for t in range(x.shape[0]):
        for i in ids[t].tolist():
            if i >= 0:
                ref_in_rank[t, i // e] = True
    assert n_rdma is None and ev.event is None
    assert torch.equal(in_rank, ref_in_rank)
    assert n_rank.dtype == torch.int32 and n_rank.tolist() == ref_in_rank.sum(0).tolist()
    assert n_exp.dtype == torch.int32 and n_exp.tolist() == [int((ids == i).sum()) for i in range(E)]

    config = Config(24, 8, 256)
    order_src = torch.tensor([s for s, _ in order], dtype=torch.long)
    order_tok = torch.tensor([t for _, t in order], dtype=torch.long)
    X = len(order)
    base = dict(num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_exp, config=config)
    variants = [("bf16", x), ("fp8", _fp8(x, False)), ("fp8-int", _fp8(x, True))]
    for name, cur in variants:
        for with_topk in (False, True):
            for previous in (False, True):
                async_ = previous
                args = dict(base, x=cur, async_finish=async_)
                if previous:
                    args["previous_event"] = buf.capture()
                if with_topk:
                    args.update(topk_idx=ids, topk_weights=w)
                recv_x, r_idx, r_w, per_expert, handle, event = buf.dispatch(**args)
                if async_:
                    event.current_stream_wait()
                rows = recv_x if name == "bf16" else recv_x[0]
                assert rows.shape[0] == X, (name, rows.shape, X)
                assert per_expert == per_expert_ref, (name, per_expert, per_expert_ref)
                # grouped by source in rank order, each source's tokens in order (column 0 says the source, 1 the token)
                if name == "bf16":
                    assert torch.equal(rows[:, 0].float().long(), order_src) and torch.equal(
                        rows[:, 1].float().long(), order_tok)
                else:   # bytes and scales bit for bit, from the sources' own casts
                    for j, (s, t) in enumerate(order):
                        sx8, ssc = _fp8(_inputs(s, P, T_of)[0], name == "fp8-int")
                        assert torch.equal(rows[j].view(torch.uint8), sx8[t].view(torch.uint8))
                        assert recv_x[1].dtype == ssc.dtype and torch.equal(recv_x[1][j], ssc[t])
                assert torch.equal(handle[0], torch.cumsum(counts, 0).to(torch.int32))
                assert torch.equal(handle[3].long(), order_tok)
                assert torch.equal(handle[4], in_rank)
                if with_topk:
                    assert r_idx.dtype == torch.int64 and r_idx.shape == (X, K)
                    for j, (s, t) in enumerate(order):
                        _, sids, sw = _inputs(s, P, T_of)
                        mine = (sids[t] >= me * e) & (sids[t] < (me + 1) * e)
                        assert torch.equal(r_idx[j], torch.where(mine, sids[t] - me * e, -1)), (j, s, t)
                        assert torch.equal(r_w[j], torch.where(mine, sw[t], 0.0))
                    for i, c in enumerate(per_expert):
                        assert int((r_idx == i).sum()) == c
                    # worst-case buffers: the same rows, then padding with top-k -1
                    W = sum(T_list) + 3
                    wx, widx, ww, empty, _, wev = buf.dispatch(**dict(args, num_worst_tokens=W))
                    if async_:
                        wev.current_stream_wait()
                    wrows = wx if name == "bf16" else wx[0]
                    assert empty == [] and wrows.shape[0] == W and widx.shape == (W, K) and ww.shape == (W, K)
                    assert torch.equal(wrows[:X].view(torch.uint8), rows.view(torch.uint8))
                    assert torch.equal(widx[:X], r_idx) and torch.equal(ww[:X], r_w)
                    assert bool((widx[X:] == -1).all()) and bool((ww[X:] == 0).all())
                    worst_handle = buf.dispatch(**dict(args, num_worst_tokens=W))[4]
                else:
                    # cached dispatch: the same rows again
                    cx, c_idx, c_w, c_list, c_handle, cev = buf.dispatch(x=cur, handle=handle, config=config,
                                                                          async_finish=async_)
                    assert c_idx is None and c_w is None and c_list is None and c_handle is None
                    crows = cx if name == "bf16" else cx[0]
                    assert torch.equal(crows.view(torch.uint8), rows.view(torch.uint8))
                # combine: rank r returns its rows times (r + 1); token t gets x[t] * sum over the ranks it went to
                y = (rows_bf16(recv_x, name).float() * (me + 1)).to(torch.bfloat16)
                bias = (torch.full((x.shape[0], H), 0.5, dtype=torch.bfloat16),
                        torch.ones(x.shape[0], H, dtype=torch.float32))
                cargs = dict(x=y, handle=handle, config=config, bias=bias, async_finish=async_)
                if with_topk:
                    cargs["topk_weights"] = r_w
                if previous:
                    cargs["previous_event"] = buf.capture()
                combined, cw, cev = buf.combine(**cargs)
                if async_:
                    cev.current_stream_wait()
                mult = (in_rank.float() * torch.arange(1, P + 1, dtype=torch.float32)).sum(1, keepdim=True)
                own = rows_bf16((x if name == "bf16" else _fp8(x, name == "fp8-int")), name).float()
                ref = (own * mult + 1.5).to(torch.bfloat16)
                assert combined.dtype == torch.bfloat16 and combined.shape == x.shape
                assert torch.allclose(combined.float(), ref.float(), rtol=1e-2, atol=1e-2), name
                if with_topk:
                    mask = ids >= 0
                    assert torch.allclose(cw, torch.where(mask, w, 0.0), atol=1e-6)
                    # the worst-case rows: the padding rows (huge here) are ignored
                    wy = torch.cat([y, torch.full((W - X, H), 1e4, dtype=torch.bfloat16)])
                    wout, _, _ = buf.combine(wy, worst_handle)
                    assert torch.allclose(wout.float(), (own * mult).to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
                res[(name, with_topk, previous)] = X
    buf.destroy()
    return res


def rows_bf16(recv_x, name: str) -> torch.Tensor:
    """bf16 rows: as they are, or the fp8 rows cast back with their scales (DeepEP's per_token_cast_back)."""
    if name == "bf16":
        return recv_x
    x8, sc = recv_x
    if sc.dtype == torch.int32:     # synthetic scales: just the fp8 values
        return x8.float().to(torch.bfloat16)
    n = x8.shape[0]
    return (x8.float().view(n, H // 128, 128) * sc.view(n, H // 128, 1)).view(n, H).to(torch.bfloat16)


def _with_default_dtype(ep: EPGroup, dtype, fn, *args):
    """``fn`` with torch's default dtype set as DeepEP's tests set it (bf16), restored after."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return fn(ep, *args)
    finally:
        torch.set_default_dtype(old)


@pytest.mark.parametrize("T_list", [[20, 13], [0, 17]], ids=["uneven", "empty-rank"])
def test_normal_mode_contract(ranks, T_list):
    """With bf16 as the default dtype, as DeepEP's tests run (nothing may depend on the default)."""
    out = ranks(2).run(_with_default_dtype, torch.bfloat16, _normal_contract, T_list, "torch")
    assert len(out[0]) == 12 and len(out[1]) == 12


def test_normal_mode_triton_kernels(ranks):
    """The same contract with the engine's Triton kernels (kernel mode) under the interpreter."""
    if not interpreting():
        pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1 (set by conftest without a GPU)")
    out = ranks(2).run(_normal_contract, [9, 6], "triton")
    assert len(out[0]) == 12


def test_normal_mode_direct_kernels_one_rank(ranks):
    """The whole contract on the direct kernels (``normal_kernels``; their P = 2, 3 cases run in one process in
    tests/test_normal_kernels.py): one CPU rank under the interpreter, where they can run outside a GPU."""
    if not interpreting():
        pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1 (set by conftest without a GPU)")
    out = ranks(1).run(_normal_contract, [11], "torch", "direct")
    assert len(out[0]) == 12


def _raises(fn, exc, *words) -> str:
    try:
        fn()
    except exc as e:
        msg = str(e)
        assert all(w in msg for w in words), (msg, words)
        return msg
    raise AssertionError(f"{fn} did not raise {exc.__name__}")


def _errors_and_lifetime(ep: EPGroup) -> int:
    from moe_wave.deepep_compat import Buffer, Config, EventOverlap

    buf = Buffer(ep.pg, 0, 0, device="cpu")
    assert (buf.rank, buf.group_size, buf.group, buf.num_nvl_bytes) == (ep.rank, ep.size, ep.pg, 0)
    ref = weakref.ref(buf)
    ids = torch.tensor([[0, 5, -1], [7, -1, -1]])
    x = torch.ones(2, H, dtype=torch.bfloat16)
    n_rank, _, n_exp, in_rank, _ = buf.get_dispatch_layout(ids, E)
    lay = dict(num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_exp)
    n = 0
    for fn, exc, words in [
        (lambda: buf.get_dispatch_layout(ids, 7), ValueError, ("num_experts=7", "multiple")),
        (lambda: buf.get_dispatch_layout(ids.float(), E), ValueError, ("topk_idx",)),
        (lambda: buf.get_dispatch_layout(ids, E, async_finish=True, allocate_on_comm_stream=True), ValueError,
         ("allocate_on_comm_stream",)),
        (lambda: buf.dispatch(x), ValueError, ("num_tokens_per_rank", "missing")),
        (lambda: buf.dispatch(x.float().to(torch.int32), **lay), ValueError, ("x is",)),
        (lambda: buf.dispatch((x, torch.ones(2, 2)), **lay), ValueError, ("x[0]",)),
        (lambda: buf.dispatch(x[:1], **lay), ValueError, ("is_token_in_rank",)),
        (lambda: buf.dispatch(x, topk_idx=ids, **lay), ValueError, ("topk_idx and topk_weights together",)),
        (lambda: buf.dispatch(x, expert_alignment=0, **lay), ValueError, ("expert_alignment=0",)),
        (lambda: buf.dispatch(x, num_worst_tokens=-1, **lay), ValueError, ("num_worst_tokens=-1",)),
        (lambda: buf.dispatch(x, config="fast", **lay), ValueError, ("config=",)),
        (lambda: buf.dispatch(x, handle=(1, 2), **lay), ValueError, ("handle",)),
        (lambda: buf.dispatch(x, num_tokens_per_rdma_rank=n_rank, **lay), NotImplementedError, ("None",)),
        (lambda: buf.combine(x, (1, 2)), ValueError, ("handle",)),
        (lambda: buf.internode_dispatch(x), NotImplementedError, ("internode_dispatch", "DeepEP")),
        (lambda: buf.internode_combine(x), NotImplementedError, ("internode_combine",)),
        (lambda: buf.get_local_buffer_tensor(torch.int8), NotImplementedError, ("get_local_buffer_tensor",)),
        (lambda: Buffer.set_num_sms(23), ValueError, ("even",)),
        (lambda: Buffer.get_dispatch_config(3), ValueError, ("num_ranks=3",)),
        (lambda: Config(24, 256, 256), ValueError, ("num_max_nvl_chunked_send_tokens=256",)),
        (lambda: Config(24, 8, 256, 100, 100), ValueError, ("num_max_rdma_chunked_send_tokens=100",)),
        (lambda: Config(24, 8, 256).get_rdma_buffer_size_hint(1024, 16), NotImplementedError, ("one node",)),
        (lambda: Buffer(None), ValueError, ("group=None",)),
        (lambda: Buffer(None, comm=object()), NotImplementedError, ("comm=",)),
        (lambda: Buffer(ep.pg, -1), ValueError, ("num_nvl_bytes=-1",)),
        (lambda: Buffer(ep.pg, 0, device="meta"), ValueError, ("device=",)),
        (lambda: EventOverlap().current_stream_wait(), RuntimeError, ("no event",)),
        (buf.destroy, RuntimeError, ("explicitly_destroy=False",)),
    ]:
        try:
            _raises(fn, exc, *words)
        except AssertionError as e:
            raise AssertionError(f"case {n} ({words}): {e}") from None
        n += 1
    # a combine with the wrong row count, after a real dispatch
    got = buf.dispatch(x, **lay)
    _raises(lambda: buf.combine(x[:0] if got[0].shape[0] else x, got[4]), ValueError, "rows")
    _raises(lambda: buf.combine(got[0], got[4], bias=(x, x, x)), ValueError, "bias")
    # the configs, positional and keyword alike; every keyword of DeepEP's constructor
    assert Config(24, 8, 256) == Config(num_sms=24, num_max_nvl_chunked_send_tokens=8,
                                        num_max_nvl_chunked_recv_tokens=256)
    Buffer.set_num_sms(24)
    assert Buffer.get_dispatch_config(2) == Config(24, 24, 256, 6, 128) and Buffer.num_sms == 24
    Buffer.set_num_sms(20)
    other = Buffer(group=ep.pg, num_nvl_bytes=1, num_rdma_bytes=2, low_latency_mode=True, num_qps_per_rank=4,
                   allow_nvlink_for_low_latency_mode=False, allow_mnnvl=True, use_fabric=True, explicitly_destroy=True,
                   enable_shrink=True, comm=None, device="cpu")
    other.destroy()
    _raises(lambda: other.get_dispatch_layout(ids, E), RuntimeError, "destroyed")
    del buf, got, fn
    gc.collect()
    assert ref() is None, "a Buffer must be garbage-collected once unreferenced (vLLM keeps a WeakValueDictionary)"
    return n + 4


def test_errors_and_lifetime(ranks):
    assert ranks(2).run(_errors_and_lifetime) == [32, 32]


def test_options_keyword_over_environment_over_default():
    """``Buffer``'s implementation choices: a keyword wins over its variable, which wins over the default; a bad
    value names the keyword or the variable, the value and the rule (read by moe_wave.env, the one reader)."""
    from moe_wave.deepep_compat import CompatOptions
    from moe_wave.env import deepep_options

    assert deepep_options({}) == CompatOptions()
    env = {"MOE_WAVE_NORMAL_PATH": "engine", "MOE_WAVE_LL_PARTIAL": "fp32", "MOE_WAVE_LL_FAST_LAUNCH": "0"}
    got = deepep_options(env, normal="direct", normal_rows=16)
    assert (got.normal, got.normal_rows, got.ll_partial, got.ll_fast_launch) == ("direct", 16, "fp32", False)
    for env, kw, words in [({"MOE_WAVE_NORMAL_ROWS": "3"}, {}, ("MOE_WAVE_NORMAL_ROWS='3'", "power of two")),
                           ({"MOE_WAVE_LL_PATH": "fast"}, {}, ("MOE_WAVE_LL_PATH='fast'", "auto")),
                           ({}, {"normal": "fast"}, ("normal", "'fast'", "auto")),
                           ({}, {"normal_channels": 65}, ("normal_channels", "65", "[1, 64]"))]:
        _raises(lambda: deepep_options(env, **kw), ValueError, *words)


def test_switch_and_shim(tmp_path, monkeypatch):
    """``install()`` makes ``import deep_ep`` give the shim, refuses to hide a real DeepEP unless forced, and the shim
    exports what the stacks import."""
    import moe_wave.deepep_compat as dc

    saved = {k: v for k, v in sys.modules.items() if k == "deep_ep" or k.startswith("deep_ep.")}
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        for k in saved:
            del sys.modules[k]
        fake = tmp_path / "deep_ep"
        fake.mkdir()
        (fake / "__init__.py").write_text("REAL = True\n")
        sys.path.insert(0, str(tmp_path))
        assert dc.real_deep_ep() == str(fake / "__init__.py")
        _raises(dc.install, RuntimeError, "real DeepEP", "force=True")
        dc.install(force=True)
        import deep_ep
        from deep_ep import Buffer, Config, EventOverlap, topk_idx_t  # noqa: F401
        from deep_ep.utils import EventHandle, EventOverlap as EO  # noqa: F401

        assert deep_ep.MOE_WAVE and Buffer is dc.Buffer and topk_idx_t is torch.int64 and EO is dc.EventOverlap
        assert not hasattr(deep_ep, "ElasticBuffer"), "vLLM picks its V2 path when ElasticBuffer exists"
        sys.path.remove(str(tmp_path))
        assert dc.real_deep_ep() is None
        dc.install()                       # again, with nothing to hide: fine
    finally:
        for k in [m for m in sys.modules if m == "deep_ep" or m.startswith("deep_ep.")]:
            del sys.modules[k]
        sys.modules.update(saved)


# ------------------------------------------------------------------------------------------- low-latency mode
LL_H, LL_E, LL_K, LL_T = 512, 12, 3, 12


def _ll_inputs(rank: int, N: int):
    """DeepEP's test_low_latency inputs, small: rows of (rank - 128) with the token index in the last 128 columns,
    random top-k with some -1, positive weights."""
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.full((N, LL_H), float(rank - 128), dtype=torch.float32).to(torch.bfloat16)
    x[:, -128:] = torch.arange(N, dtype=torch.float32)[:, None].to(torch.bfloat16)
    ids = torch.rand(N, LL_E, generator=g, dtype=torch.float32).topk(LL_K, dim=1).indices
    ids[torch.rand(N, LL_K, generator=g, dtype=torch.float32) < 0.15] = -1
    return x, ids, torch.rand(N, LL_K, generator=g, dtype=torch.float32) + 0.1


def _ll_contract(ep: EPGroup, N_list, kernels: str, hooks=(False, True)) -> int:
    from moe_wave.deepep_compat import Buffer
    from moe_wave.deepep_compat.ll_kernels import pack_fp8_torch

    P, me = ep.size, ep.rank
    e = LL_E // P
    x, ids, w = _ll_inputs(me, N_list[me])
    every = [_ll_inputs(r, N_list[r]) for r in range(P)]
    hint = Buffer.get_low_latency_rdma_size_hint(LL_T, LL_H, P, LL_E)
    buf = Buffer(ep.pg, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=e,
                 allow_nvlink_for_low_latency_mode=True, explicitly_destroy=True, allow_mnnvl=False,
                 enable_shrink=False, options=SymmOptions(kernels=kernels), device="cpu")
    checked = 0
    for hook in hooks:
        for fp8, rnd, ue in ((False, False, False), (True, False, False), (True, True, False), (True, True, True)):
            stats = torch.zeros(e, dtype=torch.int32)
            for _ in range(2):      # twice: both buffer sets
                stats.zero_()
                recv_x, count, handle, event, hook_fn = buf.low_latency_dispatch(
                    x, ids, LL_T, LL_E, cumulative_local_expert_recv_stats=stats, use_fp8=fp8, round_scale=rnd,
                    use_ue8m0=ue, async_finish=not hook, return_recv_hook=hook)
                hook_fn() if hook else event.current_stream_wait()
            src_info, layout_range = handle[0], handle[1]
            assert handle[2:] == (LL_T, LL_H, LL_E)
            for i in range(e):
                expert = me * e + i
                # sources in rank order, each source's tokens in order
                ref = [(s, t) for s in range(P) for t in range(N_list[s]) if bool((every[s][1][t] == expert).any())]
                n = int(count[i])
                assert n == len(ref) == int(stats[i]) == int((layout_range[i] & 0xFFFFFFFF).sum())
                begins = (layout_range[i] >> 32).tolist()
                for s in range(P):
                    c = int(layout_range[i, s] & 0xFFFFFFFF)
                    assert [(s, t) for t in src_info[i, begins[s]:begins[s] + c].tolist()] == \
                        [r for r in ref if r[0] == s]
                for j, (s, t) in enumerate(ref):
                    sx = every[s][0][t:t + 1]
                    if not fp8:
                        assert torch.equal(recv_x[i, j], sx[0])
                        continue
                    row = torch.empty(1, LL_H + 4 * (LL_H // 128), dtype=torch.uint8)
                    pack_fp8_torch(sx, row, rnd)
                    assert torch.equal(recv_x[0][i, j].view(torch.uint8), row[0, :LL_H]), (i, j)
                    sc = row[0, LL_H:].view(torch.float32)
                    if ue:
                        assert recv_x[1].dtype == torch.int32 and recv_x[1].shape == (e, P * LL_T, LL_H // 512)
                        assert torch.equal(torch.tensor(recv_x[1][i, j].tolist(), dtype=torch.int32).view(torch.uint8),
                                           (sc.view(torch.int32) >> 23).to(torch.uint8))
                    else:
                        assert recv_x[1].stride(1) == 1 and torch.equal(recv_x[1][i, j], sc)
                checked += 1
            # combine: the experts' outputs are the received rows themselves (cast back), weighted by the source
            if fp8 and not ue:
                y = (recv_x[0].float() * recv_x[1].repeat_interleave(128, dim=2)).to(torch.bfloat16)
            elif fp8:
                y = recv_x[0].float().to(torch.bfloat16)
            else:
                y = recv_x.clone()
            own = y_rows = None
            for zero_copy in (False, True):
                if zero_copy:
                    buf.get_next_low_latency_combine_buffer(handle)[:] = y
                out = torch.empty(x.shape[0], LL_H, dtype=torch.bfloat16)
                combined, cev, chook = buf.low_latency_combine(
                    y if not zero_copy else torch.zeros_like(y), ids, w, handle, zero_copy=zero_copy,
                    async_finish=not hook, return_recv_hook=hook, out=out)
                chook() if hook else cev.current_stream_wait()
                assert combined is out and not bool(combined.isnan().any())
                # each token's rows: its own x (as the expert saw it), times the sum of its valid weights
                seen = {}
                for i in range(e):
                    for j in range(int(count[i])):
                        seen.setdefault((int(src_info[i, j])), y[i, j].float())
                wsum = torch.where(ids >= 0, w, 0.0).sum(1, keepdim=True)
                if not fp8:
                    ref = (x.float() * wsum).to(torch.bfloat16).float()
                    assert torch.allclose(combined.float(), ref, rtol=2e-2, atol=1e-2), (hook, zero_copy)
                elif not ue:
                    assert torch.allclose(combined.float(), x.float() * wsum, rtol=0.08, atol=0.2)
                checked += 1
    buf.destroy()
    return checked


@pytest.mark.parametrize("kernels,N_list", [("torch", [12, 7]), ("torch", [0, 12]), ("triton", [5, 9])],
                         ids=["torch-uneven", "torch-empty-rank", "triton"])
def test_low_latency_contract(ranks, kernels, N_list):
    if kernels == "triton" and not interpreting():
        pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1 (set by conftest without a GPU)")
    # the interpreter is slow: the Triton kernels once, with the receive hook
    out = ranks(2).run(_with_default_dtype, torch.bfloat16, _ll_contract, N_list, kernels,
                       (True,) if kernels == "triton" else (False, True))
    assert out[0] == out[1] > 0


def _ll_errors(ep: EPGroup) -> int:
    from moe_wave.deepep_compat import Buffer

    P, e = ep.size, LL_E // ep.size
    buf = Buffer(ep.pg, 0, 0, low_latency_mode=True, device="cpu")
    x, ids, w = _ll_inputs(ep.rank, 5)
    n = 0
    for fn, exc, words in [
        (lambda: buf.low_latency_dispatch(x.float(), ids, LL_T, LL_E), ValueError, ("bf16",)),
        (lambda: buf.low_latency_dispatch(x, ids, 4, LL_E), ValueError, ("num_max_dispatch_tokens_per_rank=4",)),
        (lambda: buf.low_latency_dispatch(x, ids, LL_T, 7), ValueError, ("num_experts=7",)),
        (lambda: buf.low_latency_dispatch(x[:, :100], ids, LL_T, LL_E), ValueError, ("hidden=100",)),
        (lambda: buf.low_latency_dispatch(x, ids, LL_T, LL_E, use_ue8m0=True), ValueError, ("round_scale",)),
        (lambda: buf.low_latency_dispatch(x, ids, LL_T, LL_E, async_finish=True, return_recv_hook=True), ValueError,
         ("async_finish",)),
        (lambda: buf.low_latency_dispatch(x, ids[:2], LL_T, LL_E), ValueError, ("topk_idx",)),
        (lambda: buf.low_latency_dispatch(x, ids, LL_T, LL_E, cumulative_local_expert_recv_stats=torch.zeros(3)),
         ValueError, ("cumulative_local_expert_recv_stats",)),
        (lambda: buf.low_latency_combine(x, ids, w, (1, 2)), ValueError, ("handle",)),
        (lambda: buf.low_latency_update_mask_buffer(0, True), NotImplementedError, ("mask=True",)),
        (lambda: buf.low_latency_update_mask_buffer(P, False), ValueError, ("rank_to_mask",)),
        (lambda: buf.clean_low_latency_buffer(0, LL_H, LL_E), ValueError, ("num_max_dispatch_tokens_per_rank=0",)),
    ]:
        try:
            _raises(fn, exc, *words)
        except AssertionError as err:
            raise AssertionError(f"case {n} ({words}): {err}") from None
        n += 1
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, ids, LL_T, LL_E, use_fp8=False)
    y = recv.clone()
    _raises(lambda: buf.low_latency_combine(y, ids, w, handle, use_logfmt=True), NotImplementedError, "use_logfmt")
    _raises(lambda: buf.low_latency_combine(y, ids, w, handle, overlap=True), NotImplementedError, "overlap=True")
    _raises(lambda: buf.low_latency_combine(y, ids, w, handle, colour=1), TypeError, "colour")
    _raises(lambda: buf.low_latency_combine(y[:, :3], ids, w, handle), ValueError, "x is")
    plain = buf.low_latency_combine(y, ids, w, handle)[0]
    # SGLang's single-batch-overlap keywords while the feature is off: the same result
    sbo = buf.low_latency_combine(y, ids, w, handle, overlap=False, packed_recv_count=count, comp_signal=None,
                                  block_m=64, threshold=0, num_sms=3)[0]
    assert torch.equal(plain, sbo)
    mask = torch.ones(P, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(mask)
    buf.low_latency_clean_mask_buffer()
    buf.low_latency_update_mask_buffer(0, False)
    assert mask.tolist() == [0] * P
    return n + 5


def test_low_latency_errors(ranks):
    assert ranks(2).run(_ll_errors) == [17, 17]


@pytest.mark.parametrize("P", [1, 3])
def test_one_and_three_ranks(ranks, P):
    """Both modes on one rank (no peers) and on three (sources interleave in rank order; one rank empty)."""
    T_list = [11] if P == 1 else [5, 0, 9]
    normal = ranks(P).run(_normal_contract, T_list, "torch")
    low = ranks(P).run(_ll_contract, T_list, "torch")
    assert all(len(r) == 12 for r in normal) and len(set(low)) == 1 and low[0] > 0


def test_cli_prints_the_shim_folder(capsys):
    from moe_wave.cli import main
    from moe_wave.deepep_compat import shim_path

    assert main(["deep-ep-path"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == str(shim_path()) and (shim_path() / "deep_ep" / "__init__.py").is_file()

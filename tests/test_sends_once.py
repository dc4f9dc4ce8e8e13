"""``WaveConfig.sends = "once"``: a (token, peer) row crosses once per layer in each direction, whatever the wave
count (issue 15, item 1), on the symm backend (emulated over gloo here; its torch tables and, with
``kernels="triton"``, its Triton kernels under the interpreter).

What is checked: the layout's rows per peer equal W = 1's at every W, with every slot of the peer on the row and
the right last wave; the rows the backend receives per (peer, layer) are the same for W = 1..8; WaveMoE matches
transformers' DeepseekV4SparseMoeBlock (fp32) at 1-3 ranks, pipelined equal to serial bit for bit; empty ranks,
one hot expert, more waves than local experts, padded tokens; and the errors.
"""

from __future__ import annotations

import pytest
import torch

from moe_wave import WaveConfig, WaveMoE
from moe_wave.comm import EPGroup
from moe_wave.comm.layout import WavePlan, compute_layout
from moe_wave.comm.options import SymmOptions
from moe_wave.comm.symm import SymmBackend
from tests.test_moe import TOKENS, _parity, _tokens, hf_model


def _routing(T: int, P: int, e: int, K: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(T, P * e, generator=g).topk(K, dim=1).indices, torch.rand(T, K, generator=g)


@pytest.mark.parametrize("P", [1, 2, 4])
def test_layout_sends_each_token_peer_once(P):
    """W = 1..8 (V4-Flash-like: top-6 over 32 local experts per rank): the rows sent to each peer are W = 1's,
    each (token, peer) at most once, in the wave of its first expert there; the row carries every slot of that
    peer (of every wave) and no other; ``last_TP`` is the last wave of the token's experts on the peer; the pairs
    per (arrival wave, peer, expert) add up to T * K. Padded tokens send nothing and have no last wave."""
    T, K, e = 257, 6, 32
    ids, w = _routing(T, P, e, K, seed=P)
    peer, local = ids // e, ids % e
    base = None
    for W in range(1, 9):
        plan = WavePlan.make(num_ranks=P, num_local_experts=e, num_waves=W, sends="once")
        lay = compute_layout(ids, w, plan)
        per_peer = lay.send_counts_WP.sum(0)
        base = per_peer if base is None else base
        assert torch.equal(per_peer, base), (W, per_peer.tolist(), base.tolist())
        assert int(lay.pair_counts_WPe.sum()) == T * K
        S = int(lay.send_counts_WP.sum())
        wave = local * W // e
        cell = torch.arange(W * P).repeat_interleave(lay.send_counts_WP.reshape(-1))
        seen = set()
        for s in range(S):
            t, b, p = int(lay.send_token_S[s]), int(cell[s]) // P, int(cell[s]) % P
            assert (t, p) not in seen
            seen.add((t, p))
            on_p = peer[t] == p
            assert b == int(wave[t][on_p].min()), "the row goes in the first wave with an expert there"
            want = torch.where(on_p, local[t], -1).to(torch.int32)
            assert torch.equal(lay.send_expert_SK[s], want), "every slot of the peer, of every wave"
            if plan.once:
                assert int(lay.last_TP[t, p]) == int(wave[t][on_p].max()) == int(lay.send_last_S[s])
    lay = compute_layout(ids, w, WavePlan.make(num_ranks=P, num_local_experts=e, num_waves=4, sends="once"),
                         num_valid=torch.tensor(100))
    assert int(lay.send_counts_WP.sum()) == int(torch.stack([(peer[:100] == p).any(1) for p in range(P)]).sum())
    assert bool((lay.last_TP[100:] == -1).all())


def _recv_rows(ep: EPGroup, W: int, seed: int) -> list:
    """Rows this rank receives from each source over one layer (the symm backend's exchanged counts)."""
    e, K, T = 8, 3, 40 + 7 * ep.rank
    ids, w = _routing(T, ep.size, e, K, seed=seed + ep.rank)
    be = SymmBackend(ep, SymmOptions(capacity=64, kernels="torch", dense=False))   # dense: counts = block sizes
    xplan = be.prepare(compute_layout(ids, w, WavePlan.make(num_ranks=ep.size, num_local_experts=e, num_waves=W,
                                                            sends="once")))
    return xplan.recv_counts_WP.sum(0).tolist()


def test_rows_received_per_peer_equal_for_every_wave_count(ranks):
    got = [ranks(2).run(_recv_rows, W, 3) for W in range(1, 9)]
    assert all(g == got[0] for g in got), got


def _once_parity(ep: EPGroup, tokens: list, variants, kernels: str = "torch", bias_boost: dict | None = None):
    """WaveMoE(backend symm, sends once) against HF's block on this rank's tokens (both layers: hash and top-k),
    and pipelined against serial bit for bit (``test_moe._parity``); variants are (W, shared placement)."""
    wave_kw = dict(sends="once", backend="symm", symm=SymmOptions(capacity=32, kernels=kernels))
    return _parity(ep, tokens, [(W, "experts", True, placement) for W, placement in variants], bias_boost, wave_kw,
                   vs_serial=True)


def _check(results, n):
    for rank, rows in enumerate(results):
        assert len(rows) == 2 * n
        bad = [r for r in rows if not (r[-2] <= 2e-6 and r[-1])]
        assert not bad, f"rank {rank}: {bad}"


VARIANTS = [(1, "bubbles"), (2, "bubbles"), (3, "serial"), (7, "bubbles")]


@pytest.mark.parametrize("P", [1, 2, 3])
def test_once_matches_hf_and_serial(ranks, P):
    """E = 12 experts: 12, 6 and 4 per rank, so W = 7 is clamped at 3 ranks (more waves than local experts)."""
    if P == 1:
        _check([_once_parity(EPGroup.single(), TOKENS, VARIANTS)], len(VARIANTS))
    else:
        _check(ranks(P).run(_once_parity, TOKENS, VARIANTS), len(VARIANTS))


def test_once_empty_rank_and_one_hot_expert(ranks):
    few = [(3, "bubbles")]
    _check(ranks(2).run(_once_parity, [13, 0], few), len(few))
    _check(ranks(3).run(_once_parity, TOKENS, few, "torch", {7: 50.0}), len(few))


def test_once_kernels_under_interpreter(ranks):
    """The backend's Triton tables and sum (``gather_add`` over the flat comb) instead of the torch ones; on one
    rank also its combine (``scatter_rows`` of the rows whose last wave it is, as on peer memory)."""
    few = [(3, "bubbles")]
    _check(ranks(2).run(_once_parity, TOKENS, few, "triton"), len(few))
    _check([_once_parity(EPGroup.single(), TOKENS, few, "triton")], len(few))


def _padded(ep: EPGroup) -> float:
    """Padding (num_valid): the valid rows' largest error against the unpadded call, relative to its largest
    output. Not bit for bit: the shared expert's down_proj runs in row chunks cut by the row count, and a CPU GEMM
    need not give a row the same bits at another row count (MKL on an AVX-512 EPYC does not below 12 rows)."""
    cfg, blocks = hf_model()
    x, _ = _tokens(ep.rank, 13)
    wave = WaveConfig(num_waves=3, sends="once", backend="symm", symm=SymmOptions(capacity=32, kernels="torch"))
    moe = WaveMoE.from_hf(blocks[1], cfg, ep=ep, wave=wave, layer_idx=1)
    xp = torch.cat([x, 100 * torch.randn(5, x.shape[1])])    # a pad that would show, should a valid row read it
    y = moe(x)
    yp = moe(xp, num_valid=torch.tensor(13))
    return float((yp[:13] - y).abs().max() / y.abs().max())


def test_once_padding(ranks):
    """The pad changes no valid row beyond fp32 rounding (a few ulps; a row that read the pad would be off by
    orders of magnitude more)."""
    errs = ranks(2).run(_padded)
    assert all(e <= 1e-6 for e in errs), errs


def test_once_errors():
    cfg, blocks = hf_model()
    ep = EPGroup.single()
    x, _ = _tokens(0, 5)
    moe = WaveMoE.from_hf(blocks[1], cfg, ep=ep, wave=WaveConfig(num_waves=2, sends="once", backend="torch"),
                          layer_idx=1)
    with pytest.raises(ValueError, match=r"sends='once'.*backend 'torch'.*backend='symm'"):
        moe(x)
    with pytest.raises(ValueError, match=r"WaveConfig.sends='twice': must be one of \('wave', 'once'\)"):
        WaveConfig(sends="twice")
    dense = WaveMoE.from_hf(blocks[1], cfg, ep=ep, layer_idx=1, wave=WaveConfig(
        num_waves=2, sends="once", backend="symm", symm=SymmOptions(capacity=32, dense=True)))
    with pytest.raises(ValueError, match=r"SymmOptions.dense=True with WaveConfig.sends='once'"):
        dense(x)


def _combine_sets(ep: EPGroup) -> tuple:
    """Per combine c, the rows the receiver would write on peer memory (``combine_dst``) and the rows the source
    takes (``OnceTables.last_WPN``): [c][peer] -> sorted (b, i)."""
    from moe_wave.comm.symm_once import combine_dst

    e, K, W, T = 8, 3, 3, 30 + 5 * ep.rank
    ids, w = _routing(T, ep.size, e, K, seed=11 + ep.rank)
    be = SymmBackend(ep, SymmOptions(capacity=48, kernels="torch"))
    xplan = be.prepare(compute_layout(ids, w, WavePlan.make(num_ranks=ep.size, num_local_experts=e, num_waves=W,
                                                            sends="once")))
    x = torch.randn(T, 16)
    got = [be.dispatch(x, xplan, b).wait() for b in range(W)]
    meta = be.transport.buffers(x.dtype, 16, W, K).recv_meta
    C = xplan.capacity
    send, take = [], []
    from moe_wave.comm.triton_gate import triton_ok

    for c in range(W):
        dst = combine_dst(meta, xplan.recv_rows_WP, c, e).view(ep.size, W, C)
        if triton_ok(meta.device, want=True):     # the one-launch kernel (interpreted here) gives the same table
            assert torch.equal(combine_dst(meta, xplan.recv_rows_WP, c, e, kernel=True).view(ep.size, W, C), dst)
        send.append([sorted((b, i) for b, i in (dst[p] >= 0).nonzero().tolist()) for p in range(ep.size)])
        last = xplan.once.last_WPN
        take.append([sorted((b, i) for b, i in (last[:, p] == c).nonzero().tolist()) for p in range(ep.size)])
        assert all(int(d) == b * ep.size * C + i for p in range(ep.size) for b, i in send[c][p]
                   for d in [dst[p, b, i]])
    rows = [int(xplan.recv_rows_WP[:, p].sum()) for p in range(ep.size)]
    assert got[-1].rows_P.tolist() == xplan.recv_rows_WP.reshape(-1).tolist()
    return send, take, rows


def test_peer_combine_rows_match_what_the_source_takes(ranks):
    """The peer-memory combine (not run on CPU) sends, in combine c, exactly the rows that the source's own tables
    say come home in c: rank r's ``combine_dst`` for peer p equals rank p's rows for source r, and every received
    row goes home in exactly one combine; its Triton kernel gives the torch ops' table."""
    res = ranks(3).run(_combine_sets)
    for r, (send, _, rows) in enumerate(res):
        for p in range(3):
            for c in range(3):
                assert send[c][p] == res[p][1][c][r], (r, p, c)
            assert sum(len(send[c][p]) for c in range(3)) == rows[p]


@pytest.mark.skipif(not __import__("moe_wave.comm.triton_gate", fromlist=["x"]).triton_ok("cpu", want=True),
                    reason="Triton's interpreter is not available")
def test_comb_targets_address_block_b_me():
    """``comb_targets`` + ``scatter_rows`` put row (b, p, i) of y at row (b, me, i) of rank p's comb, and nothing
    else (three ranks' combs as local tensors)."""
    from moe_wave.comm.symm_kernels import scatter_rows
    from moe_wave.comm.symm_once import comb_targets

    W, P, C, D, me = 3, 3, 4, 8, 1
    combs = [torch.full((W, P, C, D), -1.0) for _ in range(P)]
    y = torch.arange(W * P * C * D, dtype=torch.float32).view(W * P * C, D)
    b_, p_, i_ = torch.meshgrid(torch.arange(W), torch.arange(P), torch.arange(C), indexing="ij")
    src = (b_ * P * C + p_ * C + i_).permute(1, 0, 2).reshape(P, W * C)
    pick = (torch.arange(W * C).view(1, W * C) + torch.arange(P).view(P, 1)) % 3 == 0
    dst = torch.where(pick, (b_ * P * C + i_).permute(1, 0, 2).reshape(P, W * C), -1)
    scatter_rows(y, comb_targets(combs, me), src, dst)
    for p in range(P):
        want = torch.full((W, P, C, D), -1.0)
        for b in range(W):
            for i in range(C):
                if pick[p, b * C + i]:
                    want[b, me, i] = y[b * P * C + p * C + i]
        assert torch.equal(combs[p], want), p


def _layer_overflow(ep: EPGroup) -> str:
    """20 tokens per rank, each with one expert on each peer in wave t % 4: 5 rows per (wave, peer) block, which a
    capacity of 8 holds, but 20 over the layer, which one block does not."""
    t = torch.arange(20)
    ids = torch.stack([2 * (t % 4), 8 + 2 * (t % 4)], 1)
    be = SymmBackend(ep, SymmOptions(capacity=8, kernels="torch", dense=False))
    plan = WavePlan.make(num_ranks=2, num_local_experts=8, num_waves=4, sends="once")
    try:
        be.prepare(compute_layout(ids, torch.ones(20, 2), plan))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_layer_overflow_raises_on_every_rank(ranks):
    """sends='once': a source's rows to a peer over the whole layer must fit one block (the expert stage sizes
    its gathered pairs by one wave's blocks): the error names the ranks, the count and the fix, on every rank."""
    for msg in ranks(2).run(_layer_overflow):
        assert "sends='once': rank 0 sent 20 rows to rank 0 over the layer's waves" in msg, msg
        assert "capacity >= 20" in msg, msg

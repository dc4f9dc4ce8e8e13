"""The ``symm`` backend on CPU: the backend contract against the single-process reference on 1-3 gloo ranks
(static-capacity receive buffers, device-side counts, both data modes, over the emulated transport), WaveMoE
with backend="symm" against backend="torch", the capacity-overflow error on every rank, the whole backend with
its Triton kernels under the interpreter, the options' errors, and the memops watchdog's logic.

The kernels alone: tests/test_symm_kernels.py. The symmetric-memory transport itself needs GPUs:
tests/test_gpu_comm.py."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch
from moe_wave.comm import EPGroup
from moe_wave.comm.layout import WavePlan, compute_layout
from moe_wave.comm.backend import CombineOut
from moe_wave.comm.options import SymmOptions, parse_variant
from moe_wave.comm.symm import SymmBackend
from moe_wave.comm.torch_backend import TorchBackend
from moe_wave.comm.triton_gate import interpreting

from moe_wave import MoEConfig, WaveConfig, WaveMoE
from moe_wave.pipeline import run_waves
from moe_wave.reference import reference_dispatch_combine
from tests.ranks import RankPool
from tests.test_dispatch import CASES, E_PER_RANK, _expert_fn, _make_case, slot_by_slot

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _options(variant: str, capacity: int, kernels: str) -> SymmOptions:
    return SymmOptions.variant(variant, capacity=capacity, kernels=kernels)


def _symm_path(ep: EPGroup, x, ids, w, num_waves: int, partition: str, overlap: bool, mode: str,
               capacity: int = 16, kernels: str = "auto") -> torch.Tensor:
    e = E_PER_RANK
    plan = WavePlan.make(num_ranks=ep.size, num_local_experts=e, num_waves=num_waves, partition=partition)
    local_view = mode.endswith("+local")        # dispatch(local_view=True): own rows read from x (dense blocks)
    # "copy+dense", "copy+sparse", "copy", "kernel"
    backend = SymmBackend(ep, _options(mode.removesuffix("+local"), capacity, kernels))
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


def _check_symm(ep: EPGroup, modes, kernels: str = "auto") -> list:
    errs = []
    for case in CASES:
        x, ids, w = _make_case(case, ep.size)[ep.rank]
        ref = reference_dispatch_combine(x, ids, w, _expert_fn)
        for W in (1, 2, 4):
            for part in ("experts", "tokens"):
                for ov in (True, False):
                    for mode in modes:
                        y = _symm_path(ep, x, ids, w, W, part, ov, mode, kernels=kernels)
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
    cfg = MoEConfig.preset("tiny", num_experts=12, top_k=3, hidden_size=64, intermediate_size=32)
    torch.manual_seed(0)
    full = {"gate": torch.randn(12, 64) * 0.3, "bias": torch.randn(12) * 0.1,
            "gate_up": torch.randn(12, 64, 64) * 0.2, "down": torch.randn(12, 64, 32) * 0.2,
            "shared_gate": torch.randn(32, 64) * 0.2, "shared_up": torch.randn(32, 64) * 0.2,
            "shared_down": torch.randn(64, 32) * 0.2}
    g = torch.Generator().manual_seed(10 + ep.rank)
    x = torch.randn(T_per_rank[ep.rank], 64, generator=g)
    outs = {}
    # dense=True: dense blocks, this rank's own rows read from x (local_view)
    opts = SymmOptions(capacity=32, dense={"auto": None, "1": True}[dense])
    for backend in ("torch", "symm"):
        m = WaveMoE(cfg, ep=ep, wave=WaveConfig(num_waves=2, backend=backend, symm=opts))
        m.load_full(full)
        outs[backend] = m(x)
    return float((outs["torch"] - outs["symm"]).abs().max()) if x.numel() else 0.0


@pytest.mark.parametrize("dense", ["auto", "1"])
def test_wavemoe_symm_matches_torch_backend(ranks, dense):
    """WaveMoE(wave=WaveConfig(backend="symm")) gives the torch backend's result (2 ranks, one empty). With
    dense blocks WaveMoE dispatches with local_view: this rank's own rows are read from x (the emulated
    transport poisons them in the receive buffer with NaN, so a consumer that read them there would fail)."""
    assert ranks(2).run(_moe_symm_vs_torch, [21, 0], dense) == pytest.approx([0.0, 0.0], abs=1e-5)
    assert ranks(2).run(_moe_symm_vs_torch, [9, 14], dense) == pytest.approx([0.0, 0.0], abs=1e-5)


def _combine_api(ep: EPGroup, backends, kernels: str = "auto") -> list:
    """combine's sum options on every backend: ``add_TD`` / ``dst_TD`` equal the unfused operations bit for
    bit, the symm backend's ``combine_deferred`` leaves out_TD alone until its sum runs, and a bad ``add_TD``
    is refused before any communication (every rank raises it)."""
    e, res = E_PER_RANK, []
    for case in ("uneven", "zero_send"):
        x, ids, w = _make_case(case, ep.size)[ep.rank]
        T, D = x.shape
        add = (torch.randn(T, D, generator=torch.Generator().manual_seed(5 + ep.rank)) * 3).to(torch.bfloat16)
        for name in backends:
            if name == "torch":
                be = TorchBackend(ep)
            else:
                be = SymmBackend(ep, _options(name, 16, kernels))
            plan = WavePlan.make(num_ranks=ep.size, num_local_experts=e, num_waves=1)
            xplan = be.prepare(compute_layout(ids, w, plan))
            got = be.dispatch(x, xplan, 0).wait()
            y = slot_by_slot(got, ep.rank * e)
            base = torch.zeros(T, D)
            be.combine(y, got.handle, CombineOut(base)).wait()
            want = (base + add.float()).to(torch.bfloat16)
            acc, dst = torch.full((T, D), float("nan")), torch.full((T, D), float("nan"), dtype=torch.bfloat16)
            be.combine(y, got.handle, CombineOut(acc, accumulate=False, add_TD=add, dst_TD=dst)).wait()
            lazy = torch.full((T, D), float("nan"))
            if name == "torch":     # the deferred sum is the symm backend's own
                total, untouched = (lambda: lazy.copy_(base)), True
            else:
                total = be.combine_deferred(y, got.handle, CombineOut(lazy, accumulate=False)).wait()
                untouched = bool(lazy.isnan().all())
            total()
            try:
                be.combine(y, got.handle, CombineOut(base, add_TD=torch.zeros(T + 1, D)))
                err = "no error"
            except ValueError as ex:
                err = str(ex)
            close = torch.allclose(dst.float(), want.float(), rtol=2 ** -7, atol=0)   # within 1 bf16 ulp
            res.append((case, name, torch.equal(dst, want), close, callable(total) and untouched,
                        torch.equal(lazy, base), err))
    return res


def test_combine_add_dst_and_deferred_sum(ranks):
    """CombineOut(add_TD=, dst_TD=) ends the layer in one pass with the unfused result; combine_deferred
    returns the sum for the caller to run (torch and symm backends, 2 ranks, one of them sending nothing)."""
    for rank, res in enumerate(ranks(2).run(_combine_api, ["torch", "copy+sparse", "copy+dense"])):
        assert len(res) == 6
        for case, name, fused_ok, _, deferred_ok, lazy_ok, err in res:
            assert fused_ok, (rank, case, name, "add_TD/dst_TD differ from the unfused sum")
            assert deferred_ok and lazy_ok, (rank, case, name, "combine_deferred")
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
    assert count > 4 and f"SymmOptions.capacity >= {count}" in msgs[0]
    assert ranks(2).run(_overflow, 9, mode) == ["no error", "no error"]   # T == C always fits


def test_bad_options_and_plan_errors():
    with pytest.raises(ValueError, match=r"SymmOptions.mode='fast': must be one of"):
        SymmOptions(mode="fast")
    with pytest.raises(ValueError, match=r"SymmOptions.dense=True with mode='kernel'"):
        SymmOptions(mode="kernel", dense=True)
    with pytest.raises(ValueError, match=r"SymmOptions.timeout_ms=0: must be an int >= 1"):
        SymmOptions(timeout_ms=0)
    with pytest.raises(ValueError, match=r"SymmOptions.capacity=0"):
        SymmOptions(capacity=0)
    with pytest.raises(ValueError, match=r"CopyTuning.rows=3: must be a power of two"):
        SymmOptions().replace(copy={"rows": 3})
    with pytest.raises(ValueError, match=r"options=.*must be a SymmOptions"):
        SymmBackend(EPGroup.single(), {"mode": "copy"})
    if not HAS_TRITON:
        with pytest.raises(ValueError, match=r"kernels='triton': Triton does not run"):
            SymmBackend(EPGroup.single(), SymmOptions(kernels="triton"))
    with pytest.raises(ValueError, match=r"mode='kernel' needs Triton on cpu"):
        SymmBackend(EPGroup.single(), SymmOptions(mode="kernel"))      # auto kernels: never Triton on CPU
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


def _kernel_mode(ep: EPGroup) -> list:
    errs = _check_symm(ep, ["kernel", "copy+dense"], "triton")   # copy+dense: gather_add over the dense slots
    # the sum options through the Triton gather_add (add_TD, a bf16 dst_TD: the interpreter truncates to
    # bf16, so within 1 ulp here; the GPU runs tests/test_symm_kernels.py bit for bit; combine_deferred)
    api = _combine_api(ep, ["kernel", "copy+dense"], "triton")
    return errs + [("api", case, name, 0.0 if close and deferred and lazy and "add_TD" in err else 1.0)
                   for case, name, _, close, deferred, lazy, err in api]


@pytest.mark.skipif(not HAS_TRITON or not interpreting(), reason="needs triton and TRITON_INTERPRET=1 on CPU")
def test_symm_kernel_mode_under_interpreter():
    """The whole backend with its Triton kernels (SymmOptions(kernels="triton"), interpreted) on 2 ranks: same
    results as the reference. The ranks inherit TRITON_INTERPRET=1 from the test session (conftest.py)."""
    with RankPool(2, deadline_s=240.0) as pool:
        results = pool.run(_kernel_mode)
    for rank, errs in enumerate(results):
        bad = [e for e in errs if not e[-1] <= 1e-5]
        assert errs and not bad, f"rank {rank}: {bad}"


def _one_rank_untouched(monkeypatch, W: int) -> tuple:
    """One rank, dense blocks read in place (``local_view``), the Triton sum: the call's result against the
    reference, and whether the receive and combine buffers still hold the sentinel they were filled with
    (the CPU emulation's NaN poisoning of the rows left in x is switched off, so that any write shows)."""
    from moe_wave.comm.symm_transport import EmulatedTransport

    monkeypatch.setattr(EmulatedTransport, "poison_local", lambda self, bufs, wave: None)
    ep = EPGroup.single()
    x, ids, w = _make_case("uneven", 1)[0]
    ref = reference_dispatch_combine(x, ids, w, _expert_fn)
    be = SymmBackend(ep, _options("copy+dense", 32, "triton"))
    plan = WavePlan.make(num_ranks=1, num_local_experts=E_PER_RANK, num_waves=W)
    xplan = be.prepare(compute_layout(ids, w, plan))
    be.dispatch(x, xplan, 0, local_view=True).wait()    # the buffers, made on first use
    (bufs,) = be.transport.heap._data.values()
    bufs.recv_x.fill_(-7.0)
    bufs.comb.fill_(float("nan"))

    def experts(got):
        assert got.local is not None
        return slot_by_slot(got, 0)

    y = run_waves(x, xplan, be, experts, torch.zeros(x.shape), overlap=True, local_view=True)
    return float((y - ref).abs().max()), bool((bufs.recv_x == -7.0).all()), bool(bufs.comb.isnan().all())


@pytest.mark.skipif(not HAS_TRITON or not interpreting(), reason="needs triton and TRITON_INTERPRET=1 on CPU")
@pytest.mark.parametrize("W", [1, 2])
def test_one_rank_moves_no_row(monkeypatch, W):
    """On one rank (a GPU holding every expert) the symm backend copies no row: the dispatch leaves the rows in
    x and the combine's sum reads y, so the receive and combine buffers are never written, and the result is
    the reference's."""
    err, recv_untouched, comb_untouched = _one_rank_untouched(monkeypatch, W)
    assert err <= 1e-5
    assert recv_untouched, "the dispatch copied rows into the receive buffer"
    assert comb_untouched, "the combine copied rows into the combine buffer"


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


def test_signal_option_errors():
    with pytest.raises(ValueError, match=r"SymmOptions.signal='bell': must be one of \('barrier', 'flags', 'memops'\)"):
        SymmOptions(signal="bell")
    with pytest.raises(ValueError, match=r"signal='flags' with mode='kernel'"):
        SymmOptions(mode="kernel", signal="flags")
    with pytest.raises(ValueError, match=r"signal='flags' needs Triton"):
        SymmBackend(EPGroup.single(), SymmOptions(mode="copy", signal="flags"))     # CPU, kernels auto: no Triton
    be = SymmBackend(EPGroup.single(), SymmOptions(mode="copy", signal="memops"))
    assert be.options.signal == "memops" and not be.transport.peer_memory   # CPU: the emulated transport


def test_auto_mode_choice():
    """mode "auto" with Triton: dense copy mode for a large capacity where dense blocks fill, kernel mode for
    a decode-sized capacity and where they would not fill; the fixed settings stay fixed. The choice reads
    only what all ranks share (never the call's token count)."""
    from moe_wave.comm.options import AUTO_COPY_MIN_TOKENS
    from moe_wave.comm.symm_plan import choose as choose_plan

    def choose(C, P=2, W=1, K=6, partition="experts", **kw):
        mode = kw.get("mode", "auto")
        opts = SymmOptions(capacity=C, mode=mode, dense=kw.get("dense"))
        plan = WavePlan.make(num_ranks=P, num_local_experts=8, num_waves=W, partition=partition)
        return choose_plan(opts, mode, plan, K)

    big, small = AUTO_COPY_MIN_TOKENS, AUTO_COPY_MIN_TOKENS - 1
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
    from moe_wave.comm.symm_plan import wave_token_ranges

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
    assert SymmOptions.variant("copy+dense+memops", capacity=8) == SymmOptions(capacity=8, mode="copy", dense=True,
                                                                                signal="memops")


@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not HAS_TRITON or not interpreting(), reason="needs triton and TRITON_INTERPRET=1 on CPU"))])
def test_poison_word_fails_the_forward_then_raises(kernels):
    """A fault a waiter records on the device (the poison word with the peer and call) makes the combine's sum
    NaN in that very call, whatever path sums (Triton gather_add or torch ops), and the next prepare raises the
    error naming the peer; raising clears it."""
    from moe_wave.comm.symm_tables import POISON

    ep = EPGroup.single()
    x, ids, w = _make_case("uneven", 1)[0]
    plan = WavePlan.make(num_ranks=1, num_local_experts=E_PER_RANK, num_waves=1)
    be = SymmBackend(ep, SymmOptions(capacity=16, mode="copy", kernels=kernels))

    def one_call():
        xplan = be.prepare(compute_layout(ids, w, plan))
        got = be.dispatch(x, xplan, 0).wait()
        out, dst = torch.zeros(x.shape), torch.zeros(x.shape, dtype=torch.bfloat16)
        be.combine(slot_by_slot(got, 0), got.handle, CombineOut(out, accumulate=False, dst_TD=dst)).wait()
        return dst

    clean = one_call()
    assert not clean.isnan().any()
    xplan = be.prepare(compute_layout(ids, w, plan))
    be._status_dev[POISON:POISON + 3] = torch.tensor([1, 3, 17])     # as a waiter that gave up on rank 3 writes it
    got = be.dispatch(x, xplan, 0).wait()
    dst = torch.zeros(x.shape, dtype=torch.bfloat16)
    be.combine(slot_by_slot(got, 0), got.handle, CombineOut(torch.zeros(x.shape), dst_TD=dst)).wait()
    assert bool(dst.isnan().all()), "the call that hit the fault must not return a plausible result"
    be._status_host.copy_(be._status_dev)        # what the next prepare's copy brings to the host
    with pytest.raises(RuntimeError, match=r"rank 0 gave up waiting for rank 3 \(exchange call 17\)"):
        be.prepare(compute_layout(ids, w, plan))
    assert torch.equal(one_call(), clean), "raising clears the fault"

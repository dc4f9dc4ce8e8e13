"""WaveMoE on GPUs: NCCL, real streams, bf16 grouped GEMM (run by launch/gpu_all.sh).

Under torchrun every rank runs this module and the tests use the whole world as the EP group;
run plainly it uses one GPU. What it proves: the stream/event schedule gives the serial schedule's
result bit for bit (same kernels, fixed summation order), and the fp32 reference's to bf16 rounding,
for every wave count, partition and shared-expert placement, over many iterations with changing token
counts (a lifetime bug would corrupt rows).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from moe_wave import MoEConfig, WaveConfig, WaveMoE
from moe_wave.comm import EPGroup
from moe_wave.comm.backend import Received
from moe_wave.reference import random_full_weights, reference_moe

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ep():
    if "WORLD_SIZE" in os.environ:
        from moe_wave.comm.bootstrap import init_from_env
        return init_from_env(timeout_s=120)
    return EPGroup.single(torch.device("cuda", 0))


def _agree(ep, err: float, limit: float, what: str) -> None:
    """Assert on every rank at once: a rank that failed alone would leave the others waiting in
    the next test's collectives."""
    errs = ep.gather_objects(err)   # HOST SYNC: a check
    bad = [f"rank {r}: {what} {e:.3g} >= {limit:g}" for r, e in enumerate(errs) if not e < limit]
    assert not bad, "; ".join(bad)


def _agree_equal(ep, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Assert ``torch.equal(got, want)`` on every rank at once; the message gives each failing rank's
    largest difference."""
    same = got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)
    diff = 0.0 if same or got.shape != want.shape else float((got.float() - want.float()).abs().max())
    res = ep.gather_objects((same, diff, tuple(got.shape), tuple(want.shape)))   # HOST SYNC: a check
    bad = [f"rank {r}: {what} not bit-identical (max |diff| {d:.3g}, shapes {a} vs {b})"
           for r, (ok, d, a, b) in enumerate(res) if not ok]
    assert not bad, "; ".join(bad)


def _cfg(**kw):
    return MoEConfig.preset("tiny", hidden_size=256, intermediate_size=128, num_experts=16, top_k=4, **kw)


def _x(ep, T, D, seed, dtype):
    g = torch.Generator().manual_seed(seed * 100 + ep.rank)
    return (torch.randn(T, D, generator=g) * 2).to(ep.device, dtype)


@pytest.mark.parametrize("W,partition,placement", [(1, "experts", "bubbles"), (2, "experts", "bubbles"),
                                                    (4, "experts", "alt"), (3, "tokens", "bubbles"),
                                                    (8, "experts", "serial")])
def test_bf16_pipeline_matches_fp32_reference(ep, W, partition, placement):
    cfg = _cfg()
    full = random_full_weights(cfg, seed=3)
    moe = WaveMoE(cfg, ep=ep, wave=WaveConfig(num_waves=W, partition=partition, shared_placement=placement),
                  dtype=torch.bfloat16)
    moe.load_full({k: v.to(ep.device) for k, v in full.items()})
    # the reference sees the same bf16-rounded weights (else near-tie tokens route differently)
    full_dev = {k: (v.to(torch.bfloat16).float() if v.is_floating_point() else v).to(ep.device)
                for k, v in full.items()}
    for it, T in enumerate([512, 37, 0, 1, 700]):
        x = _x(ep, T, cfg.hidden_size, it, torch.bfloat16)
        ref = reference_moe(full_dev, cfg, x.float())
        y_pipe = moe(x, overlap=True)
        y_serial = moe(x, overlap=False)
        if T == 0:
            _agree(ep, 0.0 if y_pipe.shape == (0, cfg.hidden_size) else 1.0, 0.5, "empty output shape")
            continue
        _agree(ep, float((y_pipe.float() - ref).norm() / ref.norm()), 2e-2, f"T={T} rel err vs fp32")
        # the same kernels on the same data in a fixed summation order: bit for bit
        _agree_equal(ep, y_pipe, y_serial, f"T={T} pipelined vs serial")


def test_fp32_loop_path_tight(ep):
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = _cfg()
    full = {k: v.to(ep.device) for k, v in random_full_weights(cfg, seed=4).items()}
    moe = WaveMoE(cfg, ep=ep, wave=WaveConfig(num_waves=2), dtype=torch.float32)
    moe.load_full(full)
    x = _x(ep, 300, cfg.hidden_size, 9, torch.float32)
    ref = reference_moe(full, cfg, x)
    _agree(ep, float((moe(x) - ref).abs().max() / ref.abs().max()), 1e-5, "fp32 rel err")


def test_many_iterations_no_stream_corruption(ep):
    """Back-to-back forwards without syncs: the allocator must not recycle a buffer a side stream
    still reads (record_stream / held references)."""
    cfg = _cfg()
    full = {k: v.to(ep.device) for k, v in random_full_weights(cfg, seed=5).items()}
    moe = WaveMoE(cfg, ep=ep, wave=WaveConfig(num_waves=4, shared_placement="bubbles", shared_tail_chunks=2),
                  dtype=torch.bfloat16)
    moe.load_full(full)
    xs = [_x(ep, 256 + 64 * (i % 5), cfg.hidden_size, 50 + i, torch.bfloat16) for i in range(20)]
    outs = [moe(x) for x in xs]                       # queued back to back
    torch.cuda.synchronize()
    for i, (x, y) in enumerate(zip(xs, outs)):
        _agree_equal(ep, y, moe(x, overlap=False), f"forward {i} back to back vs serial")


def test_hash_routing_gpu(ep):
    cfg = _cfg(hash_routing=True, vocab_size=100)
    full = {k: v.to(ep.device) for k, v in random_full_weights(cfg, seed=6).items()}
    moe = WaveMoE(cfg, ep=ep, wave=WaveConfig(num_waves=2), dtype=torch.float32)
    moe.load_full(full)
    x = _x(ep, 128, cfg.hidden_size, 7, torch.float32)
    ids = torch.randint(0, 100, (128,), device=ep.device)
    ref = reference_moe(full, cfg, x, ids)
    _agree(ep, float((moe(x, input_ids=ids) - ref).abs().max() / ref.abs().max()), 1e-3, "hash rel err")


def test_device_count_expert_stage_matches_host_counts():
    """expert_rows with device counts only (the fixed-capacity backends, CUDA graphs) takes the kernels that
    skip the pairs past n; it must give what the host-count path gives, slots of -1 and empty rows included."""
    from moe_wave.experts import RoutedExperts, _fused_ok, expert_rows

    cfg = MoEConfig(hidden_size=512, intermediate_size=256, num_experts=8, top_k=4, swiglu_limit=7.0)
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(5)
    ex = RoutedExperts(cfg, num_local=8, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        ex.gate_up.copy_(torch.randn(ex.gate_up.shape, generator=g) * 0.05)
        ex.down.copy_(torch.randn(ex.down.shape, generator=g) * 0.05)
    for R in (300, 1, 0):
        x = (torch.randn(R, cfg.hidden_size, generator=g) * 2).to(dev, torch.bfloat16)
        ids = torch.randint(0, 8, (R, 4), generator=g)
        ids[torch.rand(R, 4, generator=g) < 0.5] = -1                  # slots of other ranks / waves
        if R > 2:
            ids[:2] = -1                                              # rows with no pair at all
        w = torch.rand(R, 4, generator=g).to(dev)
        ids = ids.to(dev, torch.int32)
        counts = torch.bincount(ids[ids >= 0].long(), minlength=8).to(dev)
        assert _fused_ok(x, ex)
        with torch.no_grad():
            y_dev = expert_rows(Received(x, ids, w, None, counts, None), ex)
            y_host = expert_rows(Received(x, ids, w, counts.tolist(), counts, None), ex)
        assert y_dev.shape == y_host.shape == (R, cfg.hidden_size) and y_dev.dtype == torch.bfloat16
        if R:
            err = float((y_dev.float() - y_host.float()).norm() / y_host.float().norm().clamp_min(1e-6))
            assert err < 1e-2, (R, err)
        if R > 2:
            assert torch.equal(y_dev[:2], torch.zeros_like(y_dev[:2])), "rows with no pair are 0"


@pytest.mark.parametrize("W,streams", [(2, 2), (4, 2), (4, 1)])
def test_sends_once_matches_reference_serial_and_graph(ep, W, streams):
    """WaveConfig.sends='once' (a row crosses once per layer; the peer sums a token's results over the waves and
    sends them home after the last): bf16 against the fp32 reference, pipelined equal to serial bit for bit over
    changing token counts, and a graph replay equal to the eager call on the padded input, with the waves' expert
    stages taking turns on two streams (the default) or on one. On 2+ GPUs this is the peer-memory combine (rows
    scattered into the sources' comb at their arrival index)."""
    from moe_wave.comm.options import SymmOptions

    cfg = _cfg()
    full = random_full_weights(cfg, seed=13)
    moe = WaveMoE(cfg, ep=ep, wave=WaveConfig(num_waves=W, sends="once", backend="symm", expert_streams=streams,
                                              symm=SymmOptions(capacity=1024)), dtype=torch.bfloat16)
    moe.load_full({k: v.to(ep.device) for k, v in full.items()})
    full_dev = {k: (v.to(torch.bfloat16).float() if v.is_floating_point() else v).to(ep.device)
                for k, v in full.items()}
    for it, T in enumerate([512, 37, 0, 700]):
        x = _x(ep, T, cfg.hidden_size, 110 + it, torch.bfloat16)
        y = moe(x)
        y_serial = moe(x, overlap=False)
        if T:
            ref = reference_moe(full_dev, cfg, x.float())
            _agree(ep, float((y.float() - ref).norm() / ref.norm()), 2e-2, f"once W={W} T={T} rel err vs fp32")
        _agree_equal(ep, y, y_serial, f"once W={W} T={T} pipelined vs serial")
    moe.capture_graphs([64])
    x = _x(ep, 50, cfg.hidden_size, 120, torch.bfloat16)
    y = moe(x)
    g, moe.graphs = moe.graphs, None
    xp = torch.zeros(64, cfg.hidden_size, device=ep.device, dtype=x.dtype)
    xp[:50] = x
    y_pad = moe(xp, num_valid=torch.full((), 50, dtype=torch.int64, device=ep.device))[:50]
    moe.graphs = g
    _agree_equal(ep, y, y_pad, f"once W={W}: replay vs eager on the padded input")


def _every_row(moe):
    """A routed_rows for ``moe`` that ignores ``Received.rows_P`` (computes every row of the buffer)."""
    from moe_wave.experts import expert_rows

    return lambda got: expert_rows(dataclasses.replace(got, rows_P=None), moe.experts)


@pytest.mark.parametrize("mode", ["kernel", "copy"])
def test_row_bound_skips_the_empty_tail_bit_for_bit(ep, mode, monkeypatch):
    """symm with a capacity far above the rows received (a decode batch in a buffer sized for prefill): the expert
    stage that skips each block's rows past its count (``Received.rows_P``) gives the output of the stage that
    computes every row, bit for bit, at every wave count, partition and token count, eager and under graph replay
    (kernel mode: sparse blocks; copy mode: dense blocks)."""
    from moe_wave.comm.options import SymmOptions

    cfg = _cfg()
    full = {k: v.to(ep.device) for k, v in random_full_weights(cfg, seed=12).items()}
    for W, partition in ((1, "experts"), (4, "experts"), (3, "tokens")):
        wave = WaveConfig(num_waves=W, partition=partition, backend="symm",
                          symm=SymmOptions(capacity=1024, mode=mode, dense=True if mode == "copy" else None))
        moe = WaveMoE(cfg, ep=ep, wave=wave, dtype=torch.bfloat16)
        moe.load_full(full)
        for i, T in enumerate([5, 128, 0, 700]):
            x = _x(ep, T, cfg.hidden_size, 90 + i, torch.bfloat16)
            y = moe(x)
            monkeypatch.setattr(moe, "routed_rows", _every_row(moe))
            _agree_equal(ep, y, moe(x), f"{mode} W={W} {partition} T={T}: row bound vs every row")
            monkeypatch.delattr(moe, "routed_rows")
        moe.capture_graphs([64])
        x = _x(ep, 40, cfg.hidden_size, 99, torch.bfloat16)
        y = moe(x)
        g, moe.graphs = moe.graphs, None
        monkeypatch.setattr(moe, "routed_rows", _every_row(moe))
        xp = torch.zeros(64, cfg.hidden_size, device=ep.device, dtype=x.dtype)
        xp[:40] = x
        y_all = moe(xp, num_valid=torch.full((), 40, dtype=torch.int64, device=ep.device))[:40]
        monkeypatch.delattr(moe, "routed_rows")
        moe.graphs = g
        _agree_equal(ep, y, y_all, f"{mode} W={W} {partition}: replay with the bound vs eager on every row")


@pytest.mark.parametrize("hash_routing", [False, True])
def test_graph_replay_with_changing_tokens_and_routing_equals_eager(ep, hash_routing):
    """WaveMoE captured per token bucket (symm, the default backend on a GPU): replays with changing token counts
    and routing inside each bucket equal the eager call on the same padded input bit for bit, and the valid rows
    equal the unpadded eager call; a T above the largest bucket runs eagerly."""
    cfg = _cfg(hash_routing=hash_routing, vocab_size=100) if hash_routing else _cfg()
    full = {k: v.to(ep.device) for k, v in random_full_weights(cfg, seed=8).items()}
    moe = WaveMoE(cfg, ep=ep, wave=WaveConfig(num_waves=2), dtype=torch.bfloat16)
    moe.load_full(full)
    assert moe.backend.name == "symm", moe.backend.name
    moe.capture_graphs([64, 256], overlaps=(True, False))
    for i, T in enumerate([64, 17, 256, 100, 1, 300, 0, 64]):
        x = _x(ep, T, cfg.hidden_size, 70 + i, torch.bfloat16)
        ids = torch.randint(0, 100, (T,), device=ep.device) if hash_routing else None
        y = moe(x, input_ids=ids)
        b = moe.graphs.bucket_for(T)
        g, moe.graphs = moe.graphs, None                   # the eager references
        if b is not None:
            xp = torch.zeros(b, cfg.hidden_size, device=ep.device, dtype=x.dtype)
            xp[:T] = x
            ip = None
            if hash_routing:
                ip = torch.zeros(b, dtype=torch.long, device=ep.device)
                ip[:T] = ids
            n = torch.full((), T, dtype=torch.int64, device=ep.device)
            y_pad = moe(xp, input_ids=ip, num_valid=n)[:T]
            _agree_equal(ep, y, y_pad, f"T={T} replay of bucket {b} vs eager on the padded input")
        y_eager = moe(x, input_ids=ids)
        moe.graphs = g
        if T:
            _agree(ep, float((y.float() - y_eager.float()).norm() / y_eager.float().norm()), 1e-2,
                   f"T={T} replay vs unpadded eager")
        _agree_equal(ep, moe(x, input_ids=ids, overlap=False), y, f"T={T} serial replay vs pipelined replay")


def test_shared_backend_and_auto_choice(ep):
    """Every WaveMoE of the process with the same group and options shares one backend (one buffer set), and
    backend='auto' is 'symm' on GPUs of one host."""
    cfg = _cfg()
    a = WaveMoE(cfg, ep=ep, dtype=torch.bfloat16)
    b = WaveMoE(cfg, ep=ep, wave=WaveConfig(num_waves=4), dtype=torch.bfloat16)
    assert a.backend is b.backend and a.backend.name == "symm"
    c = WaveMoE(cfg, ep=ep, wave=WaveConfig(backend="torch"), dtype=torch.bfloat16)
    assert c.backend is not a.backend and c.backend.name == "torch"


def test_decoder_layer_graph_replay_equals_eager(ep):
    """The whole V4 decoder layer (attention, mHC, MoE) captured per token bucket: replays with changing token
    counts equal the eager layer on the same padded input bit for bit, in both schedules."""
    from moe_wave.tools.stack import build_layer_stack, stack_inputs

    layers = build_layer_stack("tiny", 3, ep=ep, device=ep.device, dtype=torch.bfloat16, seed=2)
    modes = ((None, None), (False, False))
    for layer in layers:
        layer.capture_graphs([16, 48], modes=modes)
    for S in (48, 16, 33, 7):
        X, pos, ids = stack_inputs(layers, S, seed=40 + S + ep.rank)
        for layer_i, layer in enumerate(layers):
            for ov, mov in modes:
                y = layer(X, pos, ids, overlap=ov, moe_overlap=mov)
                b = layer.graphs.bucket_for(S)
                Xp = torch.zeros(1, b, *X.shape[2:], device=X.device, dtype=X.dtype)
                Xp[:, :S] = X
                pp = torch.arange(b, device=X.device)[None]
                pp[:, :S] = pos
                ip = torch.zeros(1, b, dtype=torch.long, device=X.device)
                ip[:, :S] = ids
                n = torch.full((), S, dtype=torch.int64, device=X.device)
                ref = layer._forward_eager(Xp, pp, ip, None, validate=False, overlap=ov, moe_overlap=mov,
                                           num_valid=n)[:, :S]
                _agree_equal(ep, y, ref, f"layer {layer_i} S={S} mode {(ov, mov)} replay vs padded eager")
            X = y

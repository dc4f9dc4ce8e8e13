"""GPU checks of the comm backends: symm (both data modes, copy mode also with completion flags and dense
blocks, both with stream-memory-operation signals) against the torch backend inside WaveMoE, the decode step
captured in a CUDA graph and replayed while the routing changes, the capacity overflow surfacing through
``check()`` on every rank, the completion-flag waiter giving up on a missing peer, the memops watchdog naming a
peer that never signals, and DeepEP when it is installed. (The Triton kernels against their torch twins, on
CPU and GPU: ``tests/test_symm_kernels.py``.)

Run on a GPU host with plain pytest (the 2-rank tests spawn their ranks over a file store) or under
``torchrun --nproc-per-node N -m pytest tests/test_gpu_comm.py`` with any N >= 2 (then the ranks are the
torchrun processes; ``launch/gpu_ep.sh`` runs them on every GPU of the host). NVLink multicast stays off:
importing ``moe_wave.comm`` sets it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe_wave import MoEConfig, WaveConfig, WaveMoE
from moe_wave.comm import EPGroup
from moe_wave.comm.backend import CombineOut
from moe_wave.comm.layout import WavePlan, compute_layout
from moe_wave.comm.options import SymmOptions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]
NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_DEEPEP = importlib.util.find_spec("deep_ep") is not None
UNDER_TORCHRUN = int(os.environ.get("WORLD_SIZE", "1")) > 1
_EP = None


def _spawned(rank: int, world: int, path: str, fn, args) -> None:
    import faulthandler
    import traceback

    faulthandler.dump_traceback_later(90, exit=True)     # a hung rank prints its stack and exits
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        fn(EPGroup.from_process_group(), *args)
    except BaseException:
        # Report now and leave without the collective teardown, which would wait for the other rank.
        print(f"[rank {rank}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        os._exit(1)
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


def run_ranks(fn, *args, world: int = 2) -> None:
    """fn(ep, *args) on ``world`` GPUs: in this process under torchrun, else in spawned ranks."""
    global _EP
    if UNDER_TORCHRUN:
        if _EP is None:
            local = int(os.environ["LOCAL_RANK"])
            torch.cuda.set_device(local)
            if not dist.is_initialized():     # another GPU test module of this run may have done it
                dist.init_process_group("nccl", device_id=torch.device("cuda", local))
            _EP = EPGroup.from_process_group()
        fn(_EP, *args)
        dist.barrier()
        return
    if NGPU < world:
        pytest.skip(f"needs {world} GPUs, {NGPU} visible")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(world, os.path.join(tmp, "store"), fn, args), nprocs=world, join=True)


def _weights(cfg: MoEConfig) -> dict:
    g = torch.Generator().manual_seed(0)
    E, D, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    r = lambda *s, sc=0.05: torch.randn(*s, generator=g) * sc  # noqa: E731
    return {"gate": r(E, D, sc=0.1), "bias": r(E, sc=0.1), "gate_up": r(E, 2 * I, D), "down": r(E, D, I),
            "shared_gate": r(I, D), "shared_up": r(I, D), "shared_down": r(D, I)}


def _moe(ep, cfg, backend: str, **wave_kw) -> WaveMoE:
    """WaveMoE with the same weights on every rank; ``wave_kw`` are WaveConfig fields (``symm=SymmOptions``)."""
    m = WaveMoE(cfg, ep=ep, wave=WaveConfig(backend=backend, **wave_kw), device=ep.device, dtype=torch.bfloat16)
    m.load_full({k: v.to(ep.device, torch.bfloat16 if v.dim() > 1 else torch.float32) for k, v in _weights(cfg).items()})
    return m


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6))


CFG = MoEConfig(hidden_size=512, intermediate_size=256, num_experts=16, top_k=4)


# ------------------------------------------------------------------------------------ symm vs torch
def _log(ep, msg: str) -> None:
    print(f"[rank {ep.rank}] {msg}", file=sys.stderr, flush=True)


# symm variants (SymmOptions.variant): data mode, then "+flags" / "+memops" (the signal) and "+dense" (dense
# blocks); "copy" alone chooses dense blocks by the fill (here: dense for one wave, sparse for 2 and 4)
SYMM_VARIANTS = (("auto", "kernel", "copy", "copy+flags", "kernel+memops", "copy+memops", "copy+dense+memops")
                 if HAS_TRITON else ("copy", "copy+memops"))


def _symm_vs_torch(ep: EPGroup) -> None:
    g = torch.Generator(device=ep.device).manual_seed(1 + ep.rank)
    # Token counts differ between the ranks from call to call (one rank empty while the other is not, after
    # calls with more rows: stale rows in the receive blocks). Capacity 1024: mode "auto" takes dense copy
    # mode for one wave (AUTO_COPY_MIN_TOKENS) and kernel mode for 2 and 4 (their blocks would not fill).
    sizes = (1024, 256, 37, 0) if ep.rank == 0 else (1024, 0, 37, 256)
    xs = [torch.randn(T, CFG.hidden_size, device=ep.device, generator=g).to(torch.bfloat16) for T in sizes]
    got = {}
    # Phase 1: symm alone (no other collective in between).
    for mode in SYMM_VARIANTS:
        for W in (1, 2, 4):
            m = _moe(ep, CFG, "symm", num_waves=W, symm=SymmOptions.variant(mode, capacity=1024))
            for i, x in enumerate(xs):
                for overlap in (True, False):
                    _log(ep, f"symm mode={mode} W={W} T={x.shape[0]} overlap={overlap}")
                    got[mode, W, i, overlap] = m(x, overlap=overlap)
            m.backend.check()
    torch.cuda.synchronize()
    # Phase 2: the torch backend, compared.
    ref = _moe(ep, CFG, "torch", num_waves=2)
    for (mode, W, i, overlap), y in got.items():
        y_ref = ref(xs[i], overlap=overlap)
        assert torch.isfinite(y).all()
        if xs[i].shape[0]:
            assert _rel(y, y_ref) < 2e-2, (mode, W, xs[i].shape[0], overlap, _rel(y, y_ref))
    # Phase 3: symm and NCCL collectives interleaved, as in a model with other collectives.
    m = _moe(ep, CFG, "symm", num_waves=2, symm=SymmOptions(capacity=256))
    for i in range(3):
        _log(ep, f"interleaved {i}")
        y, y_ref = m(xs[2]), ref(xs[2])
        assert _rel(y, y_ref) < 2e-2, (i, _rel(y, y_ref))
    _log(ep, "done")


@pytest.mark.multigpu
def test_symm_matches_torch_backend():
    run_ranks(_symm_vs_torch)


# ------------------------------------------------------------------------------------ CUDA graph
def _graph_replay(ep: EPGroup) -> None:
    for mode in SYMM_VARIANTS:
        _log(ep, f"graph replay, symm mode={mode}")
        _graph_replay_mode(ep, SymmOptions.variant(mode, capacity=64))


def _graph_replay_mode(ep: EPGroup, symm: SymmOptions) -> None:
    ref = _moe(ep, CFG, "torch", num_waves=2)
    m = _moe(ep, CFG, "symm", num_waves=2, symm=symm)
    g = torch.Generator(device=ep.device).manual_seed(7 + ep.rank)
    x_static = torch.randn(48, CFG.hidden_size, device=ep.device, generator=g).to(torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            m(x_static)                      # warm-up: allocates the symmetric buffers (collective)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = m(x_static)
    prev_ids = None
    _log(ep, "captured")
    for step in range(4):
        x = torch.randn(48, CFG.hidden_size, device=ep.device, generator=g).to(torch.bfloat16)
        x_static.copy_(x)
        graph.replay()
        ids, _ = ref.route(x)
        if prev_ids is not None:
            assert not torch.equal(ids, prev_ids), "the routing must change between replays"
        prev_ids = ids
        y_ref = ref(x)
        err = _rel(y_static, y_ref)
        assert err < 2e-2, (step, err)
    torch.cuda.synchronize()
    m.backend.check()


@pytest.mark.multigpu
def test_symm_decode_cuda_graph_replays_with_changing_routing():
    run_ranks(_graph_replay)


# ------------------------------------------------------------------------------------ overflow
def _overflow(ep: EPGroup) -> None:
    from moe_wave.comm.symm import SymmBackend

    e = 4
    backend = SymmBackend(ep, SymmOptions(capacity=8), comm_stream=torch.cuda.Stream())
    plan = WavePlan.make(num_ranks=ep.size, num_local_experts=e, num_waves=1)
    T = 20
    ids = torch.full((T, 2), e * (ep.size - 1), dtype=torch.long, device=ep.device)   # all to the last rank
    ids[:, 1] += 1
    x = torch.randn(T, 64, device=ep.device).to(torch.bfloat16)
    xplan = backend.prepare(compute_layout(ids, torch.rand(T, 2, device=ep.device), plan))
    got = backend.dispatch(x, xplan, 0).wait()
    assert got.x_RD.shape[0] == ep.size * 8          # static capacity: never more rows than C per peer
    backend.combine(got.x_RD.clone(), got.handle, CombineOut(torch.zeros(T, 64, device=ep.device))).wait()
    last = ep.size - 1                                 # every rank sends its 20 rows to the last rank
    with pytest.raises(RuntimeError, match=rf"capacity overflow in wave 0: rank \d+ sent 20 rows to rank {last}, "
                                           r"capacity is 8 .*SymmOptions.capacity >= 20"):
        backend.check()
    backend.check()                                    # reported once, then cleared


@pytest.mark.multigpu
def test_symm_capacity_overflow_reported_by_check():
    run_ranks(_overflow)


# ------------------------------------------------------------------------------------ missing peers
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_copy_signal_missing_peer_is_recorded_after_the_timeout():
    """A completion flag that never comes: the waiter gives up after its timeout (the GPU's global timer) and
    records [1, peer, call] in the fault words, which poison what follows; it returns, no hang, no trap."""
    from moe_wave.comm.symm_signal import wait_flags

    flags = torch.ones(2, dtype=torch.int64, device="cuda")
    val = torch.tensor([0, 1], dtype=torch.int64, device="cuda")
    fault = torch.zeros(3, dtype=torch.int64, device="cuda")
    wait_flags(flags, val, fault, timeout_ms=50)         # call 1: every flag is there (and the kernel compiles)
    flags[0] = 2                                         # call 2: peer 0 arrives, peer 1 never does
    torch.cuda.synchronize()   # HOST SYNC: time the second call alone
    t0 = time.perf_counter()
    wait_flags(flags, val, fault, timeout_ms=50)
    torch.cuda.synchronize()   # HOST SYNC: the waiter must have given up and returned
    elapsed = time.perf_counter() - t0
    assert fault.tolist() == [1, 1, 2], fault.tolist()
    assert val.tolist() == [2, 3], "the call number advances, timeout or not"
    assert 0.04 <= elapsed < 10, elapsed


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_barrier_kernel_missing_peer_is_recorded_after_the_timeout():
    """Our barrier kernel (the default signal) over three flag rows on one GPU, as rank 0 of 3: rank 2's slot never
    advances. The kernel gives up after its timeout by the global timer, records [1, 2, call], returns."""
    from moe_wave.comm.symm_signal import barrier_wait

    rows = [torch.zeros(3, dtype=torch.int64, device="cuda") for _ in range(3)]
    rows_P = torch.tensor([r.data_ptr() for r in rows], dtype=torch.int64, device="cuda")
    val = torch.tensor([0, 1], dtype=torch.int64, device="cuda")
    fault = torch.zeros(3, dtype=torch.int64, device="cuda")
    rows[0][1:] = 1
    barrier_wait(rows_P, 0, val, fault, timeout_ms=50)     # call 1: everyone is there (and the kernel compiles)
    rows[0][1] = 2                                         # call 2: rank 1 arrives, rank 2 never does
    torch.cuda.synchronize()   # HOST SYNC: time the second call alone
    t0 = time.perf_counter()
    barrier_wait(rows_P, 0, val, fault, timeout_ms=50)
    torch.cuda.synchronize()   # HOST SYNC: the kernel must have given up and returned
    elapsed = time.perf_counter() - t0
    assert fault.tolist() == [1, 2, 2], fault.tolist()
    assert [int(r[0]) for r in rows] == [2, 2, 2], "slot 0 of every row holds the call number"
    assert val.tolist() == [2, 3]
    assert 0.04 <= elapsed < 10, elapsed


def memops_stall_rank(rank: int, path: str, how: str, timeout_ms: int, grace_s: float) -> None:
    """One rank of ``test_memops_missing_peer_is_named_and_the_rank_stops`` (a process of its own, started as
    ``python -m tests.test_gpu_comm``): two whole exchanges, then rank 1 stalls while rank 0 dispatches."""
    from moe_wave.comm import symm_memops
    from moe_wave.comm.symm import SymmBackend

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    ep = EPGroup.from_process_group()
    opts = SymmOptions(capacity=64, mode="copy", signal="memops", timeout_ms=timeout_ms, grace_s=grace_s)
    be = SymmBackend(ep, opts, comm_stream=torch.cuda.Stream())
    plan = WavePlan.make(num_ranks=2, num_local_experts=4, num_waves=1)
    g = torch.Generator(device="cuda").manual_seed(rank)
    ids = torch.randint(0, 8, (32, 2), device="cuda", generator=g)
    lay = compute_layout(ids, torch.rand(32, 2, device="cuda", generator=g), plan)
    x = torch.randn(32, 64, device="cuda", generator=g).to(torch.bfloat16)
    for _ in range(2):                       # both ranks: whole exchanges (the signal words are made here)
        xp = be.prepare(lay)
        got = be.dispatch(x, xp, 0).wait()
        be.combine(got.x_RD.clone(), got.handle, CombineOut(torch.zeros(32, 64, device="cuda"))).wait()
    torch.cuda.synchronize()
    xp = be.prepare(lay)
    if rank == 1:                            # passes prepare, then never dispatches
        torch.cuda.synchronize()
        print("rank 1 stalls", flush=True)
        time.sleep(60)
        os._exit(0)
    t0 = time.time()
    be.dispatch(x, xp, 0).wait()
    if how == "raise":                       # the host runs on (no sync) and calls the backend again
        while symm_memops.watchdog().error is None and time.time() - t0 < 30:
            time.sleep(0.05)
        try:
            be.dispatch(x, xp, 0)
        except RuntimeError as e:
            print(f"raised: {e}", flush=True)
            os._exit(3)
    else:                                    # the host blocks in a sync: released (best effort) or ended
        torch.cuda.synchronize()
        print(f"released after {time.time() - t0:.1f} s", flush=True)
        time.sleep(60)                       # never calls the backend again: the watchdog ends the process
    print("no error", flush=True)
    os._exit(0)


@pytest.mark.multigpu
def test_memops_missing_peer_is_named_and_the_rank_stops():
    """signal="memops": rank 1 never dispatches. Rank 0's watchdog names rank 1 after the timeout; the next
    backend call raises that root cause, and a host blocked in a synchronisation exits after the grace
    period: never a hang. Whether the best-effort release reached the stuck stream is reported as a
    warning."""
    import subprocess
    import warnings

    from moe_wave.comm import symm_memops

    if NGPU < 2:
        pytest.skip(f"needs 2 GPUs, {NGPU} visible")
    if UNDER_TORCHRUN and int(os.environ.get("RANK", "0")) != 0:
        pytest.skip("starts its own two ranks: run once, by rank 0")
    if symm_memops.available():
        pytest.skip(symm_memops.available())
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for how, code in (("raise", 3), ("exit", 1)):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.time()
            # SymmOptions(timeout_ms=1500, grace_s=3) in each rank
            procs = [subprocess.Popen([sys.executable, "-m", "tests.test_gpu_comm", str(r), os.path.join(tmp, "store"),
                                       how, "1500", "3"], cwd=repo, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
                     for r in range(2)]
            try:
                out0, _ = procs[0].communicate(timeout=120)
            finally:
                for p in procs:
                    p.kill()
            elapsed = time.time() - t0
            assert procs[0].returncode == code, (how, procs[0].returncode, out0[-3000:])
            # rank 1 never starts the dispatch: rank 0 waits for its acknowledgement, the first step
            assert re.search(r"\[moe-wave\] symm memops signal: rank 0 waited 1\.\d s for rank 1's acknowledgement "
                             r"\(dispatch wave 0\)", out0), out0[-3000:]
            if how == "raise":
                assert "raised: symm memops signal: rank 0 waited" in out0, out0[-3000:]
            else:
                assert "[moe-wave] exiting: symm memops signal" in out0 and "no error" not in out0, out0[-3000:]
                released = re.search(r"released after [\d.]+ s", out0)
                warnings.warn(f"memops watchdog release: {released.group(0) if released else 'did not reach the stream'}")
            assert elapsed < 100, elapsed


def _deepep_vs_torch(ep: EPGroup) -> None:
    ref = _moe(ep, CFG, "torch", num_waves=2)
    m = _moe(ep, CFG, "deepep", num_waves=2)
    x = torch.randn(128, CFG.hidden_size, device=ep.device).to(torch.bfloat16)
    assert _rel(m(x), ref(x)) < 2e-2


@pytest.mark.multigpu
@pytest.mark.skipif(not HAS_DEEPEP, reason="deep_ep is not installed")
def test_deepep_matches_torch_backend():
    run_ranks(_deepep_vs_torch)


if __name__ == "__main__":     # one rank of the memops stall test (see memops_stall_rank)
    memops_stall_rank(int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))

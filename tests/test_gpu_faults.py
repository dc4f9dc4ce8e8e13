"""GPU failure paths of the symm backend: no silent wrong output, no hang.

- A capacity overflow or an expert id out of range in a CUDA-graph-replayed exchange: that replay's output is
  NaN (the poison word), and ``check()`` raises the error naming it on every rank.
- A peer that never arrives, in each signal mode (barrier, our barrier kernel; flags; memops): rank 0 gets a
  bounded error that names rank 1, and what it computed meanwhile is NaN, never a plausible result.

Each test starts its own two ranks as subprocesses over a file store (under torchrun only rank 0 runs them).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the ranks' script: argv = rank, store path, case, signal
RANK = r"""
import os, sys, time
import torch
import torch.distributed as dist
rank, path, case, signal = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
torch.cuda.set_device(rank)
dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank, world_size=2,
                        device_id=torch.device("cuda", rank))
from moe_wave.comm import EPGroup
from moe_wave.comm.backend import CombineOut
from moe_wave.comm.layout import WavePlan, compute_layout
from moe_wave.comm.options import SymmOptions
from moe_wave.comm.symm import SymmBackend

ep = EPGroup.from_process_group()
T, D, e, C = 20, 64, 4, 10
mode = "copy" if signal == "flags" else "auto"
be = SymmBackend(ep, SymmOptions(capacity=C, mode=mode, signal=signal, timeout_ms=1500, grace_s=10),
                 comm_stream=torch.cuda.Stream())
plan = WavePlan.make(num_ranks=2, num_local_experts=e, num_waves=1)
x = torch.randn(T, D, device="cuda").to(torch.bfloat16)
w = torch.rand(T, 2, device="cuda")
spread = torch.stack([torch.arange(T, device="cuda") % 2 * e, torch.arange(T, device="cuda") % 2 * e + 1], 1)
ids = spread.clone()                    # token t -> two experts of rank t % 2: 10 rows per peer, C = 10 fits
out = torch.empty(T, D, device="cuda")


def layer():
    got = be.dispatch(x, be.prepare(compute_layout(ids, w, plan)), 0).wait()
    be.combine(got.x_RD.clone(), got.handle, CombineOut(out, accumulate=False)).wait()


def say(msg):
    print(f"[rank {rank}] {msg}", flush=True)


for _ in range(2):
    layer()                             # eager: the symmetric buffers and signals are made here (collective)
torch.cuda.synchronize()
if case in ("overflow", "bad_id"):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer()
    graph.replay()
    torch.cuda.synchronize()
    be.check()
    assert torch.isfinite(out).all(), "the clean replay must be finite"
    if case == "overflow":
        ids.copy_(torch.stack([torch.full((T,), e, device="cuda"), torch.full((T,), e + 1, device="cuda")], 1))
    else:
        ids[3, 1] = 2 * e + 5
    graph.replay()
    torch.cuda.synchronize()
    nan = bool(out.isnan().all())
    try:
        be.check()
        say(f"no error, output all NaN: {nan}")
    except (RuntimeError, ValueError) as err:
        say(f"output all NaN: {nan}; raised: {err}")
    ids.copy_(spread)
    graph.replay()
    torch.cuda.synchronize()
    be.check()
    say(f"after the error: finite again: {bool(torch.isfinite(out).all())}")
    dist.barrier()
    os._exit(0)

# case "stall": rank 1 passes prepare, then never dispatches; "stall_counts": rank 1 never reaches prepare
if rank == 1 and case == "stall_counts":
    torch.cuda.synchronize()
    say("stalls")
    time.sleep(90)
    os._exit(0)
t0 = time.time()
xp = be.prepare(compute_layout(ids, w, plan))
if rank == 1:
    torch.cuda.synchronize()
    say("stalls")
    time.sleep(90)
    os._exit(0)
got = be.dispatch(x, xp, 0).wait()
be.combine(got.x_RD.clone(), got.handle, CombineOut(out, accumulate=False)).wait()
torch.cuda.synchronize()                # flags: the waiter gives up; memops: the watchdog releases; barrier: traps
say(f"returned after {time.time() - t0:.1f} s, output all NaN: {bool(out.isnan().all())}")
try:
    be.check()
    say("no error")
except RuntimeError as err:
    say(f"raised: {err}")
    os._exit(3)
os._exit(0)
"""


def _run(case: str, signal: str, timeout: float = 150) -> tuple[list, list, float]:
    if NGPU < 2:
        pytest.skip(f"needs 2 GPUs, {NGPU} visible")
    if int(os.environ.get("RANK", "0")) != 0:
        pytest.skip("starts its own two ranks: run once, by rank 0")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), os.path.join(tmp, "store"), case, signal],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(2)]
        outs = []
        try:
            for p in procs:
                outs.append(p.communicate(timeout=timeout)[0] if not case.startswith("stall") or not outs else "")
        finally:
            for p in procs:
                p.kill()
        elapsed = time.time() - t0
    print(f"{case}/{signal}: {elapsed:.1f} s\n" + "\n".join(o[-2500:] for o in outs))
    return [p.returncode for p in procs], outs, elapsed


@pytest.mark.parametrize("case, message", [
    ("overflow", r"symm backend capacity overflow in wave 0: rank \d sent 20 rows to rank 1, capacity is 10"),
    ("bad_id", r"topk_ids out of range \(rank \d: ids in \[\d+, 13\]\)")])
def test_fault_in_a_graph_replay_poisons_the_output_and_raises(case, message):
    import re

    codes, outs, _ = _run(case, "barrier")
    assert codes == [0, 0], (codes, outs)
    for rank, out in enumerate(outs):
        assert re.search(rf"\[rank {rank}\] output all NaN: True; raised: {message}", out), out[-3000:]
        assert f"[rank {rank}] after the error: finite again: True" in out, out[-3000:]


@pytest.mark.parametrize("signal,case", [("barrier", "stall"), ("flags", "stall"), ("memops", "stall"),
                                         ("barrier", "stall_counts")])
def test_missing_peer_is_named_and_the_output_poisoned(signal, case):
    """stall: rank 1 stops after prepare; stall_counts: before it (the count exchange closes with our barrier
    kernel in every mode)."""
    from moe_wave.comm import symm_memops

    if signal == "memops" and symm_memops.available():
        pytest.skip(symm_memops.available())
    codes, outs, elapsed = _run(case, signal)
    out0 = outs[0]
    if signal == "memops" and codes[0] == 1:   # the release did not reach the stream: the watchdog ended the rank
        assert "[moe-wave] exiting: symm memops signal: rank 0 waited" in out0, out0[-3000:]
    else:
        assert codes[0] == 3, (codes, out0[-3000:])
        assert "[rank 0] returned after" in out0 and "output all NaN: True" in out0, out0[-3000:]
        name = "waited 1.5 s for rank 1's acknowledgement" if signal == "memops" else "gave up waiting for rank 1"
        assert "raised: " in out0 and name in out0, out0[-3000:]
    assert elapsed < 100, elapsed


"""Bootstrap: launcher detection, self-spawn with root-cause failures, the test pool, and the demo
under every launcher (self-spawn, torchrun, mpirun)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe_wave.comm import LaunchInfo, RankFailure, detect_launcher, environ, init_from_env, spawn
from tests.ranks import RanksFailed

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- launcher detection

# every variable bootstrap declares in comm/environ.py's table: unset for a detection from the process environment
LAUNCH_VARS = [k for k, row in environ.TABLE.items() if "comm.bootstrap" in row.users and not k.endswith("*")]


def _detect(env: dict, source: str, monkeypatch) -> LaunchInfo:
    """``detect_launcher`` given ``env`` as a dict, or with ``env`` as the process environment (its default)."""
    if source == "dict":
        return detect_launcher(env)
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return detect_launcher()


SOURCES = pytest.mark.parametrize("source", ["dict", "process"])


@pytest.mark.parametrize("env, expected", [
    ({}, LaunchInfo("none", 0, 1, 0, 1)),
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"},
     LaunchInfo("torchrun", 3, 4, 1, 2)),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     LaunchInfo("torchrun", 1, 2, 1, 2)),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, LaunchInfo("openmpi", 2, 4, 0, 2)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
     LaunchInfo("mpich", 1, 2, 1, 2)),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
      "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}, LaunchInfo("slurm", 5, 8, 1, 4)),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0",
      "SLURM_NTASKS_PER_NODE": "2"}, LaunchInfo("slurm", 2, 4, 0, 2)),
])
@SOURCES
def test_detect_each_launcher(env, expected, source, monkeypatch):
    assert _detect(env, source, monkeypatch) == expected


def test_detect_priority_torchrun_over_mpi_over_slurm():
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"}
    ompi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}
    assert detect_launcher({**slurm, **ompi, **torchrun}).kind == "torchrun"
    assert detect_launcher({**slurm, **ompi}).kind == "openmpi"
    assert detect_launcher({**slurm, "PMI_RANK": "0", "PMI_SIZE": "1"}).kind == "mpich"


def test_detect_slurm_needs_srun_and_stray_vars_are_ignored():
    # An sbatch script (no step) or a lone MASTER_ADDR is not a launcher.
    assert detect_launcher({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}).kind == "none"
    assert detect_launcher({"MASTER_ADDR": "10.0.0.1", "LOCAL_RANK": "0"}).kind == "none"


@pytest.mark.parametrize("env, match", [
    ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2"}, "RANK is not set"),
    # stray variables of a half-set env:// launch: an error at once, never a rendezvous that waits for nobody
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1"}, "MASTER_PORT is not: this looks like a half-set"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR and MASTER_PORT are not"),
    ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE is not set"),
    ({"PMI_RANK": "2", "PMI_SIZE": "2"}, r"PMI_RANK=2: must be in \[0, PMI_SIZE=2\)"),
    ({"PMI_RANK": "x", "PMI_SIZE": "2"}, "PMI_RANK='x': must be a non-negative integer"),
])
@SOURCES
def test_detect_incomplete_env_names_the_variable(env, match, source, monkeypatch):
    with pytest.raises(ValueError, match=match):
        _detect(env, source, monkeypatch)


# ----------------------------------------------------------------------------- spawn

def _sum_ranks(ep, offset):
    t = torch.tensor([ep.rank + offset])
    dist.all_reduce(t)
    return ep.rank, ep.size, ep.backend, int(t.item())


def _rank1_raises(ep):
    if ep.rank == 1:
        time.sleep(0.3)  # the others are already inside the collective
        raise RuntimeError("boom in rank 1")
    dist.all_reduce(torch.ones(1))
    return ep.rank


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_spawn_returns_results_in_rank_order(n):
    out = spawn(_sum_ranks, n, args=(10,), backend="gloo")
    total = sum(range(n)) + 10 * n
    assert out == [(r, n, "gloo", total) for r in range(n)]


@pytest.mark.timeout(120)
def test_spawn_failure_names_the_root_cause_first():
    with pytest.raises(RankFailure) as info:
        spawn(_rank1_raises, 3, backend="gloo", timeout_s=20)
    err = info.value
    assert err.root_rank == 1
    msg = str(err)
    assert "rank 1 (ROOT CAUSE" in msg and "boom in rank 1" in msg
    assert msg.index("rank 1 (ROOT CAUSE") < msg.index("rank 0") and msg.index("rank 1") < msg.index("rank 2")


# ----------------------------------------------------------------------------- failure paths


def _wait_for(cond, timeout_s: float, step: float = 0.1) -> float:
    """Seconds until ``cond()`` held (raises AssertionError after ``timeout_s``)."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"not within {timeout_s} s"
        time.sleep(step)
    return time.monotonic() - t0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"      # a zombie has exited
    except OSError:
        return False


def _sleep_and_report_pid(ep, folder):
    tmp = Path(folder, f"rank{ep.rank}.pid.tmp")       # renamed once written: the test never reads a half-written file
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, Path(folder, f"rank{ep.rank}.pid"))
    time.sleep(300)


_PARENT = """
import sys
from moe_wave.comm import spawn
from tests.test_bootstrap import _sleep_and_report_pid
spawn(_sleep_and_report_pid, 2, args=(sys.argv[1],), backend="gloo", timeout_s=600)
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to see the ranks")
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_spawned_ranks_die_with_their_parent(tmp_path, how):
    """A demo or sweep killed by its user (SIGKILL, or SIGTERM from a job scheduler) leaves no rank running."""
    import signal

    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path)], cwd=ROOT, env=_env())
    try:
        _wait_for(lambda: len(list(tmp_path.glob("rank*.pid"))) == 2, 90)
        pids = [int(p.read_text()) for p in sorted(tmp_path.glob("rank*.pid"))]
        assert all(_alive(p) for p in pids)
        parent.send_signal(getattr(signal, how))
        took = _wait_for(lambda: not any(_alive(p) for p in pids), 15)
        print(f"{how}: both ranks gone {took:.2f} s after the parent was signalled")
    finally:
        parent.kill()
        parent.wait()


def _slow_rank1(ep):
    if ep.rank == 1:
        time.sleep(60)          # still working long after rank 0's collective timed out
    dist.all_reduce(torch.ones(1))
    return ep.rank


@pytest.mark.timeout(120)
def test_slow_rank_is_blamed_not_the_one_that_waited():
    with pytest.raises(RankFailure) as info:
        spawn(_slow_rank1, 2, backend="gloo", timeout_s=3, grace_s=2)
    msg = str(info.value)
    assert "rank 1 (PROBABLE ROOT CAUSE" in msg, msg[-3000:]
    assert msg.index("rank 1 (PROBABLE ROOT CAUSE") < msg.index("===== rank 0"), msg[-3000:]
    assert "rank 0 (ROOT CAUSE" not in msg
    assert info.value.root_rank == 1          # the rank the message blames


def test_visible_gpu_shortfall_is_an_error(monkeypatch):
    """Fewer GPUs visible than local ranks, but more than one: an error, never a silent CPU run; exactly one
    (SLURM --gpus-per-task, Ray): that one."""
    from moe_wave.comm import bootstrap

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"4 local ranks but 2 GPUs visible"):
        bootstrap._pick_backend(4, 3, None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert bootstrap._pick_backend(4, 3, None) == ("gloo", torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    assert bootstrap._pick_backend(4, 3, None) == ("nccl", torch.device("cuda", 0))


@pytest.mark.timeout(60)
def test_half_set_launcher_environment_fails_fast():
    env = {**_env(), "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", "from moe_wave.comm import init_from_env; init_from_env()"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=50)
    assert r.returncode != 0 and "MASTER_PORT is not: this looks like a half-set" in r.stderr, r.stderr[-2000:]
    assert time.monotonic() - t0 < 30


# ----------------------------------------------------------------------------- the test pool

def _pool_ok(ep, scale, *, shift=0):
    t = torch.full((2,), float(ep.rank))
    dist.all_reduce(t)
    return t.tolist(), scale * ep.rank + shift


@pytest.mark.timeout(120)
def test_pool_reports_root_cause_and_recovers(ranks):
    pool = ranks(2)
    assert pool.run(_pool_ok, 3, shift=1) == [([1.0, 1.0], 1), ([1.0, 1.0], 4)]
    with pytest.raises(RanksFailed) as info:
        pool.run(_rank1_raises)
    msg = str(info.value)
    assert msg.index("rank 1 (ROOT CAUSE") < msg.index("rank 0") and "boom in rank 1" in msg
    assert pool.run(_pool_ok, 2) == [([1.0, 1.0], 0), ([1.0, 1.0], 2)]  # respawned


def _init_again(ep):
    again = init_from_env()  # a host application's group: wrapped, never re-initialised
    return again.rank == ep.rank and again.size == ep.size and again.pg is dist.group.WORLD


@pytest.mark.timeout(120)
def test_init_from_env_keeps_an_existing_group(ranks):
    assert ranks(2).run(_init_again) == [True, True]


# ----------------------------------------------------------------------------- the demo under each launcher

def _env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(cmd, timeout=150):
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def _assert_demo_ok(proc, ranks=2):
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "max err" in proc.stdout, out[-4000:]
    row = [ln for ln in proc.stdout.splitlines() if ln.strip().startswith(str(ranks))]
    assert row, proc.stdout


DEMO_ARGS = ["demo", "--tokens", "16"]


@pytest.mark.timeout(180)
def test_demo_self_spawn():
    _assert_demo_ok(_run([sys.executable, "-m", "moe_wave", *DEMO_ARGS, "--ranks", "2"]))


@pytest.mark.timeout(180)
def test_demo_under_torchrun():
    _assert_demo_ok(_run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "moe_wave", *DEMO_ARGS]))


def _mpirun() -> str | None:
    found = shutil.which("mpirun") or shutil.which("mpiexec")
    local = Path(sys.executable).parent / "mpirun"
    return found or (str(local) if local.exists() else None)


@pytest.mark.timeout(180)
def test_demo_under_mpirun(tmp_path):
    pytest.importorskip("mpi4py", reason="mpi4py not installed: pip install 'moe-wave[mpi]'")
    if _mpirun() is None:
        pytest.skip("no mpirun on PATH or beside this python (pip install 'moe-wave[mpi]' ships one)")
    probe = _run(["bash", "launch/mpirun.sh", "--version"], timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"mpirun cannot start in this sandbox: {(probe.stdout + probe.stderr)[-500:]}")
    # the ranks' TMPDIR: the file store's folder must not outlive them
    _assert_demo_ok(subprocess.run(["bash", "launch/mpirun.sh", *DEMO_ARGS], cwd=ROOT, capture_output=True, text=True,
                                   env={**_env(), "TMPDIR": str(tmp_path)}, timeout=150))
    assert not list(tmp_path.glob("moe_wave_mpi_*")), "the mpirun file-store folder is left behind"

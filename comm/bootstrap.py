"""Bootstrap: find the launcher, create the process group, or spawn ranks when there is none.

- ``detect_launcher()`` reads torchrun / Open MPI / MPICH (Hydra) / SLURM variables.
- ``init_from_env()`` creates the world group for the detected launcher and wraps it in an
  ``EPGroup``; it never re-initialises a group that a host application already created.
- ``spawn(fn)`` starts N local ranks itself (no launcher: the CLI demo, scripts), loopback only,
  and turns a failure into one ``RankFailure`` that names the failing rank's traceback first.

The failure supervision (``RankError``, ``collect``, ``stop``, ``format_failures``) lives in
``moe_wave.comm.supervise``, shared with the test harness ``tests/ranks.py``; this module re-exports it.
"""

from __future__ import annotations

import atexit
import datetime
import os
import pickle
import re
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from . import environ
from .group import EPGroup
from .supervise import (RankError, RankFailure, StderrTails, collect, format_failures, install_stack_dump,  # noqa: F401
                        is_secondary, order_errors, rank_error, root_rank, stop)

__all__ = ["LaunchInfo", "RankFailure", "RankError", "detect_launcher", "init_from_env", "spawn",
           "set_safe_env", "format_failures", "die_with_parent", "MULTICAST_OFF"]

# NVLink multicast is off everywhere, set before any process group or symmetric-memory allocation exists: it can
# take a shared host down. These win over the environment (moe-wave never uses multicast). The one definition for
# Python; ``moe_wave.comm`` applies it at import, and launch/env.sh sets the same for the shell launchers.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def set_safe_env(env: dict | None = None) -> None:
    """Set the multicast-off variables in ``env`` (default: the process environment)."""
    if env is None:
        environ.update(MULTICAST_OFF)
    else:
        env.update(MULTICAST_OFF)


# ----------------------------------------------------------------------------- launcher detection

@dataclass(frozen=True)
class LaunchInfo:
    """Who launched this process. ``kind`` is torchrun, openmpi, mpich, slurm or none."""

    kind: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None:
        if default is None:
            raise ValueError(f"{name} is not set: the launcher's environment is incomplete")
        return default
    m = re.match(r"\s*(\d+)", raw)  # SLURM_*TASKS_PER_NODE look like "4(x2)" or "4,2"
    if m is None:
        raise ValueError(f"{name}={raw!r}: must be a non-negative integer")
    return int(m.group(1))


def _info(kind, env, rank, size, local_rank, local_size) -> LaunchInfo:
    r, w = _int(env, rank), _int(env, size)
    lr = _int(env, local_rank, 0) if local_rank else 0
    lw = _int(env, local_size, 1) if local_size else 1
    if w < 1:
        raise ValueError(f"{size}={w}: must be >= 1")
    if not 0 <= r < w:
        raise ValueError(f"{rank}={r}: must be in [0, {size}={w})")
    if not 0 <= lr < max(lw, 1):
        raise ValueError(f"{local_rank}={lr}: must be in [0, local world size {lw})")
    return LaunchInfo(kind, r, w, lr, lw)


def detect_launcher(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """The launcher of this process, by priority torchrun > MPI (Open MPI, MPICH) > SLURM (srun).

    A launcher is recognised by its marker variable; its other variables must then be valid
    (``ValueError`` names the variable otherwise). Without a launcher: ``kind="none"``, one rank.
    ``env`` defaults to the process environment (``environ.view()``).
    """
    env = environ.view() if env is None else env
    if "TORCHELASTIC_RUN_ID" not in env and "RANK" in env and "WORLD_SIZE" in env:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:     # a half-set env:// launch would wait for a rendezvous that never comes
            raise ValueError(f"RANK={env['RANK']} and WORLD_SIZE={env['WORLD_SIZE']} are set but {' and '.join(missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} not: this looks like a half-set torchrun/env:// "
                             f"launch. Set {' and '.join(missing)}, launch with torchrun, or unset RANK and WORLD_SIZE "
                             f"to run without a launcher")
    if "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        # Plain env:// without torchrun's LOCAL_* variables: assume a single host.
        local = {"LOCAL_RANK": env.get("LOCAL_RANK", env.get("RANK", "0")),
                 "LOCAL_WORLD_SIZE": env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1"))}
        return _info("torchrun", {**env, **local}, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    if "OMPI_COMM_WORLD_RANK" in env:
        return _info("openmpi", env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
    if "PMI_RANK" in env:
        return _info("mpich", env, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:  # inside srun, not a bare sbatch script
        local_size = "SLURM_STEP_TASKS_PER_NODE" if "SLURM_STEP_TASKS_PER_NODE" in env else "SLURM_NTASKS_PER_NODE"
        return _info("slurm", env, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", local_size)
    return LaunchInfo("none", 0, 1, 0, 1)


# ----------------------------------------------------------------------------- init from a launcher

def _pick_backend(local_world_size: int, local_rank: int, device) -> tuple[str, torch.device]:
    """NCCL with one GPU per local rank where the GPUs are visible, gloo on CPU where there is none.

    Every local rank sees all the host's GPUs: rank i takes cuda:i. Each sees exactly one (SLURM
    ``--gpus-per-task``, Ray): cuda:0. Any other shortfall is an error, never a silent CPU run."""
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            return "nccl", device
        return "gloo", device
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        return "gloo", torch.device("cpu")
    if gpus >= local_world_size:
        torch.cuda.set_device(local_rank)
        return "nccl", torch.device("cuda", local_rank)
    if gpus == 1:
        torch.cuda.set_device(0)
        return "nccl", torch.device("cuda", 0)
    raise ValueError(f"{local_world_size} local ranks but {gpus} GPUs visible to this process "
                     f"(CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): give every rank all "
                     f"the host's GPUs or exactly one, or pass device='cpu' to run on CPU with gloo")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _rmdir_quietly(path: str) -> None:
    try:
        os.rmdir(path)          # only once empty: another rank may still hold the store file
    except OSError:
        pass


def _mpi_rendezvous(info: LaunchInfo) -> str:
    """Agree on the rendezvous through MPI. On one host: a ``file://`` store in a fresh temp dir that rank 0
    makes (no listening socket at all); across hosts: ``tcp://addr:port``, rank 0 picks a free port (the
    store then listens on every interface: run across hosts only on a trusted network)."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError("launching under mpirun needs mpi4py: pip install 'moe-wave[mpi]'") from e
    comm = MPI.COMM_WORLD
    hosts = comm.allgather(socket.gethostname())
    if len(set(hosts)) == 1 and not environ.present("MASTER_ADDR"):
        path = tempfile.mkdtemp(prefix="moe_wave_mpi_") if info.rank == 0 else None
        path = comm.bcast(path, root=0)
        # the file store deletes its file when its last user is gone; the last rank to exit removes the folder
        atexit.register(_rmdir_quietly, path)
        return f"file://{os.path.join(path, 'store')}"
    default = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
    addr = environ.get("MASTER_ADDR", default)
    port = None
    if info.rank == 0:
        port = int(environ.get("MASTER_PORT")) if environ.present("MASTER_PORT") else _free_port(
            "" if addr == hosts[0] else addr)
    port = comm.bcast(port, root=0)
    return f"tcp://{addr}:{port}"


def _env_names(info: LaunchInfo) -> str:
    return ", ".join(f"{k}={environ.get(k)}" for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _no_launch(info: LaunchInfo, why: str) -> ValueError:
    return ValueError(f"{_env_names(info)} are set but no launch is behind them ({why}): unset them to run without a "
                      f"launcher, or start every rank (torchrun --nproc-per-node {info.world_size} ...)")


def _env_store(info: LaunchInfo, timeout_s: float, join_s: float):
    """The store of a plain env:// launch (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set, no torchrun agent):
    rank 0 listens on MASTER_ADDR only (not on every interface), the others connect; every rank must have joined
    within ``join_s`` seconds, else a ValueError naming the variables (variables left in a shell from an earlier
    run are no launch: nobody else comes)."""
    env = environ.view()
    addr = env["MASTER_ADDR"]
    port = _int(env, "MASTER_PORT")
    deadline = time.monotonic() + join_s
    if info.rank == 0:
        try:
            family, _, _, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as e:
            raise _no_launch(info, f"MASTER_ADDR={addr!r} does not resolve: {e.strerror or e}") from None
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(where)
        except OSError as e:
            sock.close()
            raise _no_launch(info, f"rank 0 cannot listen on {addr}:{port}: {e.strerror or e}") from None
        sock.listen(max(128, info.world_size))
        # detach: the store serves on this descriptor, which Python must not close when ``sock`` is collected
        store = dist.TCPStore(addr, port, info.world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False, master_listen_fd=sock.detach())
    else:
        while True:     # a plain connect first: the store's own client logs every failed try in C++
            try:
                socket.create_connection((addr, port), timeout=1.0).close()
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    why = f"no store at {addr}:{port} within {join_s:g} s: {e.strerror or e}"
                    raise _no_launch(info, why) from None
                time.sleep(0.2)
        store = dist.TCPStore(addr, port, info.world_size, False, timeout=datetime.timedelta(seconds=timeout_s))
    joined = store.add("moe_wave/joined", 1)
    while joined < info.world_size:
        if time.monotonic() > deadline:
            raise _no_launch(info, f"{joined} of {info.world_size} ranks joined within {join_s:g} s and no torchrun "
                             f"agent (TORCHELASTIC_RUN_ID unset)")
        time.sleep(0.1)
        joined = store.add("moe_wave/joined", 0)
    return store


def init_from_env(timeout_s: float = 60, device=None, *, high_priority: bool = True,
                  join_s: float = 15) -> EPGroup:
    """Create the world process group for the detected launcher and return its ``EPGroup``.

    If torch.distributed is already initialised (a host application), its world group is
    wrapped as is. Without a launcher, returns ``EPGroup.single()``.

    Args:
        timeout_s: collective timeout of the new group (short: a dead peer fails fast).
        device: force the device (default: ``cuda:<local_rank>`` when every local rank has a GPU).
        high_priority: NCCL communicators on high-priority streams (``pg_options``).
        join_s: a plain env:// launch (no torchrun agent) whose ranks have not all joined within this many
            seconds is a ValueError naming the variables (see ``_env_store``).
    """
    if dist.is_available() and dist.is_initialized():
        return EPGroup.from_process_group(device=device)
    set_safe_env()
    info = detect_launcher()
    if info.kind == "none":
        return EPGroup.single(device)
    backend, dev = _pick_backend(info.local_world_size, info.local_rank, device)
    store = None
    if info.local_world_size == info.world_size:     # every rank local: gloo's own sockets on loopback only
        environ.set_default("GLOO_SOCKET_IFNAME", "lo")
    if info.kind == "torchrun":
        init_method = "env://"
        if not environ.present("TORCHELASTIC_RUN_ID"):      # no agent: we make the store, and check that peers come
            init_method, store = None, _env_store(info, timeout_s, join_s)
    elif info.kind in ("openmpi", "mpich"):
        init_method = _mpi_rendezvous(info)
    else:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not environ.present(k)]
        if missing:
            raise ValueError(f"under srun {' and '.join(missing)} must be set, e.g. "
                             "export MASTER_ADDR=$(scontrol show hostnames | head -n1) MASTER_PORT=29500")
        init_method = f"tcp://{environ.get('MASTER_ADDR')}:{environ.get('MASTER_PORT')}"
    dist.init_process_group(backend, init_method=init_method, store=store, rank=info.rank, world_size=info.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **pg_options(backend, high_priority))
    if info.rank == 0:
        print(f"[moe-wave] launcher {info.kind}: {info.world_size} ranks, {info.local_world_size} on this host",
              file=sys.stderr, flush=True)
    return EPGroup.from_process_group(device=dev)


def pg_options(backend: str, high_priority: bool = True) -> dict:
    """NCCL on high-priority streams: the block scheduler then places an all-to-all's CTAs ahead of
    the expert GEMM's pending ones, which is what lets a wave's transfer start while the previous
    wave computes. ``high_priority=False`` turns it off."""
    if backend != "nccl" or not high_priority:
        return {}
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = True
    return {"pg_options": opts}


# ----------------------------------------------------------------------------- self-spawn

def child_setup(rank: int, world_size: int, backend: str, store_path: str, timeout_s: float,
                high_priority: bool = True) -> EPGroup:
    """In a self-spawned rank: loopback-only env, thread budget, then the group over a file store."""
    set_safe_env()
    environ.assign("MASTER_ADDR", "127.0.0.1")
    environ.assign("GLOO_SOCKET_IFNAME", "lo")
    if not environ.present("OMP_NUM_THREADS"):  # N ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    device = None
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **pg_options(backend, high_priority))
    return EPGroup.from_process_group(device=device)


def die_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """Child side: end this process when its parent dies, so that a killed demo or sweep leaves no rank running
    (and holding GPUs). Linux: the kernel sends SIGKILL at the parent's death (PR_SET_PDEATHSIG); everywhere: a
    daemon thread that sees the parent gone (a new parent pid) exits the process."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(poll_s)

    if os.getppid() != parent_pid:        # the parent died before the signal was armed
        os._exit(1)
    threading.Thread(target=watch, name="moe_wave-parent-watch", daemon=True).start()


class _StopOnSignals:
    """Parent side: SIGTERM and SIGINT raise in the main thread (SystemExit / KeyboardInterrupt), so that the
    spawning call's cleanup stops the ranks before the process goes; the previous handlers come back after.
    ``start`` starts the ranks with SIGINT ignored (inherited): Ctrl-C, which the terminal sends to the whole
    process group, then reaches only this process, which stops them (no traceback from each rank)."""

    def __enter__(self):
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._raise)
        return self

    def start(self, procs) -> None:
        if signal.SIGINT in self._old:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for p in procs:
                p.start()
        finally:
            if signal.SIGINT in self._old:
                signal.signal(signal.SIGINT, self._raise)

    @staticmethod
    def _raise(signum, frame):
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False


def _stderr_to(path: str) -> None:
    """Child side: fd 2 goes to ``path`` (the parent forwards it, see ``StderrTails``)."""
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)
    os.close(fd)


def _spawn_main(fn, args, rank, world_size, backend, tmp, timeout_s, results_q, parent_pid, high_priority):
    _stderr_to(os.path.join(tmp, f"stderr.{rank}"))
    die_with_parent(parent_pid)
    install_stack_dump(os.path.join(tmp, f"stack.{rank}"))
    try:
        ep = child_setup(rank, world_size, backend, os.path.join(tmp, "store"), timeout_s, high_priority)
        results_q.put(("ok", rank, pickle.dumps(fn(ep, *args))))  # pickled here: errors stay this rank's
    except BaseException as e:  # noqa: BLE001 - every failure goes to the parent
        results_q.put(("err", rank_error(rank, e)))
        results_q.close()
        results_q.join_thread()
        os._exit(1)  # don't tear down a broken group: peers see the closed connection at once
    results_q.close()
    results_q.join_thread()
    dist.destroy_process_group()


def spawn_plan(nprocs: int | None, backend: str | None) -> tuple[int, str]:
    """(ranks, backend): one rank per GPU with NCCL on a GPU host, else 2 gloo ranks on CPU."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = backend or ("nccl" if gpus and (nprocs is None or nprocs <= gpus) else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: must be 'gloo' or 'nccl'")
    nprocs = nprocs if nprocs is not None else (gpus if backend == "nccl" else 2)
    if nprocs < 1:
        raise ValueError(f"nprocs={nprocs}: must be >= 1")
    if backend == "nccl" and nprocs > gpus:
        raise ValueError(f"nprocs={nprocs} with backend='nccl': needs one GPU per rank, {gpus} visible")
    return nprocs, backend


def spawn(fn: Callable, nprocs: int | None = None, args: tuple = (), backend: str | None = None,
          timeout_s: float = 60, grace_s: float = 5.0, deadline_s: float | None = None,
          high_priority: bool = True) -> list:
    """Run ``fn(ep, *args)`` in ``nprocs`` fresh local ranks and return their results in rank order.

    ``fn`` must be importable by name (module level) and its result picklable. Ranks rendezvous
    through a ``file://`` store in a temp dir and bind to loopback only.

    Args:
        timeout_s: collective timeout inside the ranks.
        grace_s: after the first failure, how long the others may take to report before termination.
        deadline_s: bound on the whole job (default ``2 * timeout_s + 60``).
        high_priority: NCCL communicators on high-priority streams (``pg_options``).

    Raises:
        RankFailure: a rank raised or died, or the deadline passed; the root cause comes first.
    """
    import multiprocessing as mp

    nprocs, backend = spawn_plan(nprocs, backend)
    deadline_s = deadline_s if deadline_s is not None else 2 * timeout_s + 60
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="moe_wave_spawn_") as tmp:
        results_q = ctx.Queue()
        procs = [ctx.Process(target=_spawn_main, args=(fn, args, r, nprocs, backend, tmp, timeout_s, results_q,
                                                        os.getpid(), high_priority),
                             daemon=True, name=f"moe_wave-rank{r}") for r in range(nprocs)]
        with _StopOnSignals() as signals:     # SIGTERM / SIGINT to this process stop the ranks first
            try:
                signals.start(procs)
                tails = StderrTails({r: os.path.join(tmp, f"stderr.{r}") for r in range(nprocs)})
                results, errors, silent = collect(procs, results_q, time.monotonic() + deadline_s, grace_s, tails)
                stop(procs, {r: os.path.join(tmp, f"stack.{r}") for r in range(nprocs)}, silent)
                tails.pump()
            finally:
                stop(procs)
    if errors or silent:
        what = f"spawn({getattr(fn, '__qualname__', fn)}, nprocs={nprocs}, backend={backend})"
        if not errors:
            what += f" passed its deadline of {deadline_s:g} s"
        raise RankFailure(format_failures(errors, silent, what), order_errors(errors), root_rank(errors, silent))
    return [pickle.loads(results[r]) for r in range(nprocs)]

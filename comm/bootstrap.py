"""Bootstrap: find the launcher, create the process group, or spawn ranks when there is none.

- ``detect_launcher()`` reads torchrun / Open MPI / MPICH (Hydra) / SLURM variables.
- ``init_from_env()`` creates the world group for the detected launcher and wraps it in an
  ``EPGroup``; it never re-initialises a group that a host application already created.
- ``spawn(fn)`` starts N local ranks itself (no launcher: the CLI demo, scripts), loopback only,
  and turns a failure into one ``RankFailure`` that names the failing rank's traceback first.

The failure supervision (``RankError``, ``collect``, ``stop``, ``format_failures``) is shared with
the test harness ``tests/ranks.py``.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import queue
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from .group import EPGroup

__all__ = ["LaunchInfo", "RankFailure", "RankError", "detect_launcher", "init_from_env", "spawn",
           "set_safe_env", "format_failures", "die_with_parent", "MULTICAST_OFF"]

# NVLink multicast is off everywhere, set before any process group or symmetric-memory allocation exists: it can
# take a shared host down. These win over the environment (moe-wave never uses multicast). The one definition for
# Python; ``moe_wave.comm`` applies it at import, and launch/env.sh sets the same for the shell launchers.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def set_safe_env(env: dict | None = None) -> None:
    """Set the multicast-off variables in ``env`` (default ``os.environ``)."""
    (os.environ if env is None else env).update(MULTICAST_OFF)


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


def detect_launcher(env: Mapping[str, str] = os.environ) -> LaunchInfo:
    """The launcher of this process, by priority torchrun > MPI (Open MPI, MPICH) > SLURM (srun).

    A launcher is recognised by its marker variable; its other variables must then be valid
    (``ValueError`` names the variable otherwise). Without a launcher: ``kind="none"``, one rank.
    """
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
                     f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): give every rank all "
                     f"the host's GPUs or exactly one, or pass device='cpu' to run on CPU with gloo")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
    if len(set(hosts)) == 1 and "MASTER_ADDR" not in os.environ:
        path = tempfile.mkdtemp(prefix="moe_wave_mpi_") if info.rank == 0 else None
        path = comm.bcast(path, root=0)
        return f"file://{os.path.join(path, 'store')}"
    default = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
    addr = os.environ.get("MASTER_ADDR", default)
    port = None
    if info.rank == 0:
        port = int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else _free_port(
            "" if addr == hosts[0] else addr)
    port = comm.bcast(port, root=0)
    return f"tcp://{addr}:{port}"


def init_from_env(timeout_s: float = 60, device=None, *, high_priority: bool = True) -> EPGroup:
    """Create the world process group for the detected launcher and return its ``EPGroup``.

    If torch.distributed is already initialised (a host application), its world group is
    wrapped as is. Without a launcher, returns ``EPGroup.single()``.

    Args:
        timeout_s: collective timeout of the new group (short: a dead peer fails fast).
        device: force the device (default: ``cuda:<local_rank>`` when every local rank has a GPU).
        high_priority: NCCL communicators on high-priority streams (``pg_options``).
    """
    if dist.is_available() and dist.is_initialized():
        return EPGroup.from_process_group(device=device)
    set_safe_env()
    info = detect_launcher()
    if info.kind == "none":
        return EPGroup.single(device)
    if info.rank == 0:
        print(f"[moe-wave] launcher {info.kind}: {info.world_size} ranks, {info.local_world_size} on this host",
              file=sys.stderr, flush=True)
    backend, dev = _pick_backend(info.local_world_size, info.local_rank, device)
    if info.kind == "torchrun":
        init_method = "env://"
        if info.local_world_size == info.world_size:     # one host: gloo's own sockets on loopback only
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    elif info.kind in ("openmpi", "mpich"):
        init_method = _mpi_rendezvous(info)
    else:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(f"under srun {' and '.join(missing)} must be set, e.g. "
                             "export MASTER_ADDR=$(scontrol show hostnames | head -n1) MASTER_PORT=29500")
        init_method = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    dist.init_process_group(backend, init_method=init_method, rank=info.rank, world_size=info.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **pg_options(backend, high_priority))
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


# ----------------------------------------------------------------------------- failure supervision

@dataclass(frozen=True)
class RankError:
    """One rank's failure: wall time, rank, formatted traceback, and whether it looks secondary
    (a consequence of another rank's death: peer closed, collective timeout, backend error)."""

    time: float
    rank: int
    traceback: str
    secondary: bool


_SECONDARY = re.compile(r"closed by peer|reset by peer|broken pipe|timed? ?out|connection refused|"
                        r"ECONNRESET|EPIPE|aborted|peer .*(died|exited|closed)", re.IGNORECASE)


def is_secondary(exc: BaseException) -> bool:
    """True when ``exc`` (or its cause) looks like the echo of another rank's failure."""
    while exc is not None:
        if isinstance(exc, dist.DistError) or _SECONDARY.search(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def rank_error(rank: int, exc: BaseException) -> RankError:
    return RankError(time.time(), rank, traceback.format_exc(), is_secondary(exc))


class RankFailure(RuntimeError):
    """A spawned rank failed. ``errors`` holds every ``RankError``, root cause first; ``root_rank`` is the rank the
    message blames first (a rank that never answered, where every reported failure only echoes it)."""

    def __init__(self, message: str, errors: list[RankError] = (), root_rank: int | None = None):
        super().__init__(message)
        self.errors = list(errors)
        self._root = root_rank if root_rank is not None else (self.errors[0].rank if self.errors else None)

    @property
    def root_rank(self) -> int | None:
        return self._root


def order_errors(errors: list[RankError]) -> list[RankError]:
    """Root cause first: the earliest non-secondary failure (the earliest of all if every one is)."""
    return sorted(errors, key=lambda e: (e.secondary, e.time))


def _blame_silent(errors: list[RankError], silent: Mapping[int, str]) -> bool:
    return bool(silent) and all(e.secondary for e in errors)


def root_rank(errors: list[RankError], silent: Mapping[int, str]) -> int | None:
    """The rank ``format_failures`` names first: the first silent rank where every failure is secondary, else the
    root cause among the errors."""
    if _blame_silent(errors, silent):
        return min(silent)
    return order_errors(errors)[0].rank if errors else None


def format_failures(errors: list[RankError], silent: Mapping[int, str], what: str) -> str:
    """One message: the root cause's traceback, then the other ranks', then ranks that never answered.

    Where every reported failure is secondary (timeouts, closed connections) and some ranks never answered,
    those ranks come first as the probable root cause: they were still working (or hanging) while the others
    gave up waiting for them, and their stacks say where."""
    errors = order_errors(errors)
    lines = [f"{what}: {len(errors)} rank(s) failed, {len(silent)} stopped"]
    t0 = errors[0].time if errors else 0.0
    blame_silent = _blame_silent(errors, silent)
    silent_lines = []
    for r, why in sorted(silent.items()):
        why, _, stack = why.partition("\n")
        tag = "PROBABLE ROOT CAUSE: still running while the others gave up" if blame_silent else "stopped"
        silent_lines += [f"===== rank {r} ({tag}: {why}) =====", *([stack] if stack else [])]
    if blame_silent:
        lines += silent_lines
    for i, e in enumerate(errors):
        tag = "ROOT CAUSE" if i == 0 and not blame_silent else ("secondary" if e.secondary else "also failed")
        lines += [f"===== rank {e.rank} ({tag}, {e.time - t0:+.2f} s) =====", e.traceback.rstrip()]
    if not blame_silent:
        lines += silent_lines
    return "\n".join(lines)


def install_stack_dump(path: str) -> None:
    """Child side: SIGUSR1 writes every thread's stack to ``path`` (read when a rank hangs)."""
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=open(path, "w"), all_threads=True)


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def collect(procs, results_q, deadline: float, grace_s: float, tails: "StderrTails | None" = None
            ) -> tuple[dict, list[RankError], dict]:
    """Parent side: wait for one message per rank (``("ok", rank, pickled)`` or ``("err", RankError)``).

    Stops at the deadline (``time.monotonic()``) or ``grace_s`` after the first failure.
    Returns (results by rank, errors, {rank: why it is silent}) for ranks that did not answer.
    ``tails``: the ranks' stderr files, forwarded while waiting; a rank that dies without reporting (a signal, an
    abort in C++) is reported with its last lines.
    """
    pending, results, errors = set(range(len(procs))), {}, []
    first_fail, dead_since = None, {}
    while pending:
        if tails is not None:
            tails.pump()
        now = time.monotonic()
        if now > deadline or (first_fail is not None and now > first_fail + grace_s):
            break
        try:
            msg = results_q.get(timeout=0.05)
        except queue.Empty:
            for r in list(pending):
                if procs[r].is_alive():
                    continue
                # A message may still sit in the pipe after exit: give it a moment before declaring death.
                if now - dead_since.setdefault(r, now) > 1.0:
                    pending.discard(r)
                    words = tails.last_lines(r) if tails is not None else ""
                    errors.append(RankError(time.time() - (now - dead_since[r]), r,
                                            f"process {_exit_reason(procs[r].exitcode)} without reporting (killed? out "
                                            f"of memory? an abort in a library? os._exit?)"
                                            + (f"; its last stderr lines:\n{words}" if words else ""), False))
                    first_fail = first_fail if first_fail is not None else now
            continue
        if msg[0] == "ok":
            results[msg[1]] = msg[2]
            pending.discard(msg[1])
        else:
            errors.append(msg[1])
            pending.discard(msg[1].rank)
            first_fail = first_fail if first_fail is not None else now
    if tails is not None:
        tails.pump()
    why = "deadline" if first_fail is None else f"no answer {grace_s:g} s after the first failure"
    return results, errors, {r: why for r in pending}


class StderrTails:
    """Parent side: each self-spawned rank writes its stderr (fd 2, C++ libraries included) to a file of its own;
    ``pump`` copies what is new to this process's stderr, ``last_lines`` gives a rank's last lines (what gloo or
    the C++ runtime wrote before an abort, which no Python handler sees)."""

    def __init__(self, paths: Mapping[int, str]):
        self.paths, self.offsets = dict(paths), {r: 0 for r in paths}

    def pump(self) -> None:
        for r, path in self.paths.items():
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[r])
                    chunk = f.read()
            except OSError:
                continue
            if chunk:
                self.offsets[r] += len(chunk)
                sys.stderr.write(chunk.decode(errors="replace"))
                sys.stderr.flush()

    def last_lines(self, rank: int, n: int = 8) -> str:
        try:
            with open(self.paths[rank], "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 8192))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    " + ln for ln in lines[-n:])


def stop(procs, stack_files: Mapping[int, str] | None = None, silent: dict | None = None) -> None:
    """Terminate the still-running ranks; first ask the silent ones for their stacks (why they hang)."""
    if stack_files and silent:
        for r in silent:
            if procs[r].is_alive() and hasattr(signal, "SIGUSR1"):
                os.kill(procs[r].pid, signal.SIGUSR1)
        time.sleep(0.3)
        for r in silent:
            try:
                with open(stack_files[r]) as f:
                    stack = f.read().strip()
            except OSError:
                stack = ""
            if stack:
                silent[r] += ", its stack below\n" + stack
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=3)
        if p.is_alive():
            p.kill()
            p.join(timeout=3)


# ----------------------------------------------------------------------------- self-spawn

def child_setup(rank: int, world_size: int, backend: str, store_path: str, timeout_s: float,
                high_priority: bool = True) -> EPGroup:
    """In a self-spawned rank: loopback-only env, thread budget, then the group over a file store."""
    set_safe_env()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if "OMP_NUM_THREADS" not in os.environ:  # N ranks share the cores
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
    spawning call's cleanup stops the ranks before the process goes; the previous handlers come back after."""

    def __enter__(self):
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._raise)
        return self

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
        with _StopOnSignals():     # SIGTERM / SIGINT to this process stop the ranks first
            try:
                for p in procs:
                    p.start()
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

"""Multi-rank test harness: a pool of gloo ranks spawned once per module and size.

    def _check(ep, n):                      # module level: pickled by qualified name
        ...
        return value

    def test_x(ranks):
        out = ranks(2).run(_check, 5)       # [rank0_value, rank1_value]

The ranks rendezvous over a ``file://`` store in a temp dir and bind to loopback only; collectives
time out after ``timeout_s``. A failing call raises ``RanksFailed`` with every rank's traceback,
root cause first, tears the pool down, and the next ``run()`` respawns it. Every call is bounded
by ``deadline_s``; a rank that hangs past it is reported with its stack.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import shutil
import tempfile
import time

from moe_wave.comm import EPGroup
from moe_wave.comm.bootstrap import (child_setup, collect, format_failures, install_stack_dump, order_errors,
                                     rank_error, stop)

__all__ = ["RankPool", "RanksFailed"]


class RanksFailed(AssertionError):
    """A pooled call failed; the message holds every rank's traceback, root cause first."""

    def __init__(self, message: str, errors=()):
        super().__init__(message)
        self.errors = list(errors)


def _flush_and_exit(results, code: int) -> None:
    results.close()
    results.join_thread()
    os._exit(code)


def _worker(rank: int, world_size: int, tmp: str, timeout_s: float, tasks, results) -> None:
    install_stack_dump(os.path.join(tmp, f"stack.{rank}"))
    try:
        child_setup(rank, world_size, "gloo", os.path.join(tmp, "store"), timeout_s)
    except BaseException as e:  # noqa: BLE001 - reported as this rank's answer to the first call
        results.put(("err", rank_error(rank, e)))
        _flush_and_exit(results, 1)
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # the test process died: don't linger
                _flush_and_exit(results, 0)
            continue
        if task is None:
            break
        try:
            fn, args, kwargs = pickle.loads(task)
            out = fn(EPGroup.from_process_group(), *args, **kwargs)
            results.put(("ok", rank, pickle.dumps(out)))
        except BaseException as e:  # noqa: BLE001 - every failure goes to the parent
            results.put(("err", rank_error(rank, e)))
    import torch.distributed as dist

    dist.destroy_process_group()
    _flush_and_exit(results, 0)


class RankPool:
    """``world_size`` gloo ranks spawned once (lazily) and reused by ``run()``.

    Args:
        world_size: number of ranks P.
        timeout_s: collective timeout inside the ranks.
        deadline_s: bound on each ``run()`` call, spawn included.
        grace_s: after the first failing rank, how long the others may take to report.
    """

    def __init__(self, world_size: int, timeout_s: float = 30.0, deadline_s: float = 120.0, grace_s: float = 5.0):
        if world_size < 1:
            raise ValueError(f"RankPool.world_size={world_size}: must be >= 1")
        self.world_size, self.timeout_s, self.deadline_s, self.grace_s = world_size, timeout_s, deadline_s, grace_s
        self._procs = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.mkdtemp(prefix="moe_wave_ranks_")
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, daemon=True, name=f"moe_wave-test-rank{r}",
                                   args=(r, self.world_size, self._tmp, self.timeout_s, self._tasks[r], self._results))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, **kwargs) -> list:
        """Call ``fn(ep, *args, **kwargs)`` in every rank; return the results in rank order.

        Raises:
            RanksFailed: a rank raised, died, or the call passed ``deadline_s``.
        """
        try:
            task = pickle.dumps((fn, args, kwargs))
        except Exception as e:
            raise ValueError(f"RankPool.run: fn={fn!r} and its arguments must be picklable "
                             "(fn a module-level function of a test module)") from e
        if self._procs is None:
            self._start()
        for q in self._tasks:
            q.put(task)
        results, errors, silent = collect(self._procs, self._results, time.monotonic() + self.deadline_s,
                                          self.grace_s)
        if not errors and not silent:
            return [pickle.loads(results[r]) for r in range(self.world_size)]
        stacks = {r: os.path.join(self._tmp, f"stack.{r}") for r in range(self.world_size)}
        stop(self._procs, stacks, silent)
        self._teardown()
        what = f"{getattr(fn, '__qualname__', fn)} on {self.world_size} rank(s)"
        if not errors:
            what += f" passed the deadline of {self.deadline_s:g} s"
        raise RanksFailed(format_failures(errors, silent, what), order_errors(errors))

    def _teardown(self) -> None:
        stop(self._procs)
        for q in [*self._tasks, self._results]:
            q.close()
            q.cancel_join_thread()
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._procs = None

    def close(self) -> None:
        """Stop the ranks (politely first); the pool respawns if ``run()`` is called again."""
        if self._procs is None:
            return
        for q in self._tasks:
            q.put(None)
        end = time.monotonic() + 5.0
        for p in self._procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
        self._teardown()

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""Failure supervision of spawned ranks, shared by ``moe_wave.comm.bootstrap.spawn`` and the test pool
(``tests/ranks.py``): every rank's failure (``RankError``), root cause first; ranks that died without reporting
(a signal, an abort in a C++ library) with their last stderr lines; ranks that hang, with their stacks.
"""

from __future__ import annotations

import faulthandler
import os
import queue
import re
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Mapping

import torch.distributed as dist

__all__ = ["RankError", "RankFailure", "StderrTails", "collect", "format_failures", "install_stack_dump",
           "is_secondary", "order_errors", "rank_error", "root_rank", "stop"]


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

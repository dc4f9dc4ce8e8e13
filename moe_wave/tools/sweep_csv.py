"""The sweep's CSV: one row per benchmark point, appended as each point is measured, resumable after a crash.

A crash at any moment loses at most the row in flight:

- each row is written whole, then flushed and fsync'ed (``RowWriter.write``);
- on resume (``resume``) every line is parsed with the csv module and checked, field by field, against
  ``COLUMNS`` (count, integers, numbers, choices). A last line without its newline (torn by the crash) and
  a malformed row are reported with the file, the line and why, are not counted as done (their points are
  measured again), and are removed: the file is rewritten with its good rows (a temporary file, fsync'ed,
  then renamed over it), so a crash during the repair loses nothing either;
- a file whose header is not this sweep's is a ValueError naming the file, the expected and the found
  columns: it is never appended to;
- one sweep at a time per file (``locked``): a second sweep on the same ``--out`` is a ValueError naming the
  one that holds it, instead of both appending the same points.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import fcntl
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from moe_wave.comm.layout import PARTITION_SPECS
from moe_wave.config import BACKENDS, SHARED_PLACEMENTS

__all__ = ["COLUMNS", "KEY", "SweepFile", "load", "read_rows", "resume", "RowWriter", "locked"]

KEY = ("shape", "hidden", "intermediate", "experts", "topk", "tokens_per_rank", "num_waves", "partition",
       "backend", "shared_placement", "dtype", "world_size")
COLUMNS = KEY + ("effective_waves", "serial_us", "pipelined_us", "comm_only_us", "compute_only_us", "ideal_us",
                 "exposed_us", "overlap_ratio", "speedup", "link_bytes", "GBps", "check", "max_err",
                 "auto_num_waves", "auto_us", "device", "command")
# "fp8": the experts in DeepSeek-V4's FP8 format (sweep --precision fp8), activations bf16
DTYPES = ("float32", "bfloat16", "float16", "fp8")


def _int(lo: int, optional: bool = False):
    def check(v: str) -> str | None:
        if optional and v == "":
            return None
        try:
            ok = int(v) >= lo
        except ValueError:
            ok = False
        return None if ok else f"not an integer >= {lo}"
    return check


def _number(optional: bool = False):
    def check(v: str) -> str | None:
        if optional and v == "":
            return None
        try:
            float(v)
        except ValueError:
            return "not a number"
        return None
    return check


def _choice(choices):
    return lambda v: None if v in choices else f"not one of {', '.join(choices)}"


def _text(v: str) -> str | None:
    return None if v.strip() else "empty"


# column -> check(value) -> None when good, else why not
_CHECKS = {
    "shape": _text, "hidden": _int(1), "intermediate": _int(1), "experts": _int(1), "topk": _int(1),
    "tokens_per_rank": _int(1), "num_waves": _int(1), "partition": _choice(PARTITION_SPECS),
    "backend": _choice(BACKENDS), "shared_placement": _choice(SHARED_PLACEMENTS), "dtype": _choice(DTYPES),
    "world_size": _int(1), "effective_waves": _int(1), "link_bytes": _int(0), "check": _choice(("ok", "FAIL")),
    "auto_num_waves": _int(1, optional=True), "auto_us": _number(optional=True), "device": _text, "command": _text,
    **{c: _number() for c in ("serial_us", "pipelined_us", "comm_only_us", "compute_only_us", "ideal_us",
                              "exposed_us", "overlap_ratio", "speedup", "GBps", "max_err")},
}
assert set(_CHECKS) == set(COLUMNS), "every column has a check"


@dataclass
class SweepFile:
    """What ``load`` found in a sweep CSV.

    Attributes:
        rows: the good rows, as ``csv.DictReader`` gives them (column -> string), in file order.
        problems: one ``"<file>:<line>: <why>"`` per line left out (torn or malformed).
        clean: the file holds exactly its header and ``rows`` (nothing to repair before appending).
    """

    rows: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    clean: bool = True


def _columns(names) -> str:
    names = list(names)
    shown = names if len(names) <= 6 else names[:4] + ["...", names[-1]]
    return f"{len(names)} column{'s' if len(names) != 1 else ''} ({','.join(shown)})"


def _some(names: list[str]) -> str:
    return ",".join(names[:4]) + (",..." if len(names) > 4 else "")


def _foreign(path: Path, header: list[str]) -> ValueError:
    missing = [c for c in COLUMNS if c not in header]
    extra = [c for c in header if c not in COLUMNS]
    diff = [f"missing {_some(missing)}"] if missing else []
    diff += [f"not sweep columns: {_some(extra)}"] if extra else []
    return ValueError(f"{path}: not a CSV of this sweep: expected {_columns(COLUMNS)}, found "
                      f"{_columns(header)} ({'; '.join(diff) or 'the same columns in another order'}); resume "
                      "appends only to a file `moe-wave sweep` wrote: pass a new --out, or move the file away")


def _parse(line: str) -> list[str] | None:
    """The fields of one line ([] for an empty one), None when it is not one CSV record."""
    try:
        return next(csv.reader([line], strict=True))
    except csv.Error:
        return None


def _why(record: list[str]) -> str | None:
    if len(record) != len(COLUMNS):
        return f"{len(record)} fields, a row has {len(COLUMNS)}"
    for col, value in zip(COLUMNS, record):
        why = _CHECKS[col](value)
        if why is not None:
            return f"{col}={value!r}: {why}"
    return None


def load(path: str | os.PathLike) -> SweepFile:
    """Parse and check the sweep CSV at ``path`` (none, or empty: no rows). ValueError for a foreign header."""
    path = Path(path)
    if not path.exists():
        return SweepFile()
    text = path.read_bytes().decode("utf-8", errors="replace")
    end = text.rfind("\n") + 1       # everything after the last newline was torn by a crash
    # line by line (no field holds a newline): a stray quote cannot swallow the rows after it
    lines, torn = [ln.rstrip("\r") for ln in text[:end].split("\n")[:-1]], text[end:].rstrip("\r")
    found = SweepFile()
    if not lines:                    # empty, or a header torn before its newline
        if torn and not ",".join(COLUMNS).startswith(torn):
            raise _foreign(path, torn.split(","))
        found.clean = not torn
        return found
    header = _parse(lines[0])
    if header is None or tuple(header) != COLUMNS:
        raise _foreign(path, header or lines[0].split(","))
    for n, line in enumerate(lines[1:], start=2):
        record = _parse(line)
        why = "not one CSV record" if record is None else _why(record) if record else "an empty line"
        if why is None:
            found.rows.append(dict(zip(COLUMNS, record)))
        else:
            found.problems.append(f"{path}:{n}: {why}")
    if torn:
        found.problems.append(f"{path}:{len(lines) + 1}: the last row has no newline (torn by a crash)")
    found.clean = not found.problems
    return found


def read_rows(path: str | os.PathLike, report=None) -> list[dict]:
    """The good rows of the sweep CSV at ``path`` ([] when there is none); each line left out goes to ``report``
    (default: stderr). ValueError for a foreign header."""
    found = load(path)
    for p in found.problems:
        (report or _stderr)(f"{p}: left out")
    return found.rows


def _stderr(msg: str) -> None:
    print(f"moe-wave sweep: {msg}", file=sys.stderr)


class RowWriter:
    """Appends rows to a sweep CSV, each one flushed and fsync'ed before ``write`` returns."""

    def __init__(self, path: Path):
        self._f = path.open("a", newline="")
        self._w = csv.DictWriter(self._f, COLUMNS)

    def write(self, row: dict) -> None:
        self._w.writerow(row)
        self._sync()

    def _sync(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def _rewrite(path: Path, rows: list[dict]) -> None:
    """Replace ``path`` by its header and ``rows``: a temporary file, fsync'ed, renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerows(rows)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:   # a folder that cannot be opened (some filesystems): the rename stands unsynced
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resume(path: str | os.PathLike, report=None) -> tuple[list[dict], RowWriter]:
    """Open the sweep CSV at ``path`` for appending: created with its header when missing or empty; else checked
    (``load``), each line left out reported to ``report`` (default: stderr) and removed from the file.

    Returns:
        (rows, writer): the good rows already there (their points are done) and the writer of the next ones.
    Raises:
        ValueError: the file's header is not this sweep's.
    """
    path = Path(path)
    found = load(path)
    for p in found.problems:
        (report or _stderr)(f"{p}: dropped, its point is measured again")
    if not path.exists() or not found.clean or path.stat().st_size == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        _rewrite(path, found.rows)
    return found.rows, RowWriter(path)


@contextlib.contextmanager
def locked(path: str | os.PathLike, take: bool = True):
    """Hold ``<path>.lock`` (an flock, released by the kernel however the process ends) while the block runs; it
    names its holder (pid, host, start time, command). Held elsewhere: a ValueError naming the holder. ``take``
    False: no lock (a rank that does not write)."""
    if not take:
        yield
        return
    lock = Path(f"{path}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process that has not said who"
            os.close(fd)
            raise ValueError(f"--out={str(path)!r} is in use by another sweep ({holder}): wait for it to end, or "
                             f"pick another --out") from None
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:        # not a lock file that its holder removed while we opened it
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        when = datetime.datetime.now().isoformat(timespec="seconds")
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {when}: {' '.join(sys.argv)}\n".encode(), 0)
        yield
    finally:
        os.unlink(lock)
        os.close(fd)

"""Peer signalling by stream memory operations: a copy-engine exchange that uses no SM at all.

Legend: P ranks, me this rank, p a peer.

``cuStreamWriteValue32`` and ``cuStreamWaitValue32`` are executed by the GPU's front end, not by a
kernel: a signal built from them occupies no SM, so a GEMM beside it keeps every SM. CUDA graphs
capture them as memory-operation nodes. Their values are fixed when they are issued, so the
protocol cannot count calls; it resets each word after it has seen it. Every rank owns an int32
``[2, P]`` symmetric buffer, row 0 the data flags and row 1 the acknowledgements, slot p for peer p.
All words start at 0. One exchange, on the stream that issues the data copies:

    1. for every p: write ack[me] = 1 on p       "I am done with what you sent me last time"
    2. for every p: wait my ack[p] == 1, set 0   p is done with my previous data: I may overwrite it
    3. the data copies into the peers' buffers (copy engines, or a kernel's stores)
    4. for every p: write flag[me] = 1 on p      behind the copies (a write carries a memory fence)
    5. for every p: wait my flag[p] == 1, set 0  p's data has landed here

A word is set again only after its owner has reset it: p writes my flag[p] again in its next
exchange only after step 2 there, which needs my step-1 write of that exchange, which my stream
issues after my step-5 reset. The same holds for the acknowledgements. Without steps 1-2 a peer one
exchange ahead could set my flag again before I have reset it, and the second signal would be lost
(a hang: one dispatch graph replayed back to back runs into exactly that).

**Bounded waits.** A memory-operation wait has no deadline of its own. Before each wait the stream
writes a code (peer, step, call) into a word of pinned host memory, and 0 after the last one; a
process-wide ``Watchdog`` thread reads these words (no CUDA call) and, when one has held the same
code for ``timeout_s``, prints the root cause (this rank, the peer that never signalled, the
step, the seconds), records it for the caller (``MemopSignal.error``: the symm backend raises it at
its next call), tries to release the stuck wait (it writes the awaited word from a stream of its
own, so that a host blocked in a synchronisation can return and raise; best effort, since that
stream may share a hardware queue with the stuck one), and exits the process (code 1) ``grace_s``
(``SymmOptions.grace_s``, default 10) later unless the error was raised by then. So no rank hangs:
the one waiting names the peer, the peer's own failure is its root cause, and the launcher stops
the rest.

Streams share the device's hardware queues (CUDA_DEVICE_MAX_CONNECTIONS, default 8): work another
stream queues behind a waiting memory operation on a shared queue waits with it. Loads libcuda
through ctypes; ``available()`` says why it cannot be used where it cannot.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time

import torch

__all__ = ["MemopSignal", "Watchdog", "available", "watchdog"]

_WAIT_EQ = 0x1
_WAIT_FLUSH = 1 << 30
_ATTR_CAN_FLUSH_REMOTE_WRITES = 98
_LIB: dict = {}


def _lib():
    if not _LIB:
        try:
            cu = ctypes.CDLL("libcuda.so.1")
            fns = {}
            for name in ("cuStreamWaitValue32", "cuStreamWriteValue32"):
                f = getattr(cu, name + "_v2", None) or getattr(cu, name)
                f.restype = ctypes.c_int
                f.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint32]
                fns[name] = f
            hp = getattr(cu, "cuMemHostGetDevicePointer_v2", None) or cu.cuMemHostGetDevicePointer
            hp.restype = ctypes.c_int
            hp.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
            fns["host_ptr"] = hp
            attr = cu.cuDeviceGetAttribute
            attr.restype = ctypes.c_int
            attr.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
            _LIB.update(fns, attr=attr, error=None)
        except (OSError, AttributeError) as e:
            _LIB.update(error=f"libcuda stream memory operations are not available: {e}")
    return _LIB


def available() -> str | None:
    """None when stream memory operations can be used here, else the reason."""
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    return _lib()["error"]


# The wait code written before each wait: (call % 2^15) << 16 | step << 15 | (peer + 1). The call part
# tells two eager calls apart (the watchdog needs the same code to persist); a CUDA graph replays the
# codes it captured. step 0: the acknowledgement of peer, step 1: its data flag.
STEPS = ("acknowledgement", "data flag")


def wait_code(call: int, step: int, peer: int) -> int:
    return ((call % 0x8000) << 16) | (step << 15) | (peer + 1)


def decode(code: int) -> tuple[int, int, int]:
    """(call, step, peer) of a nonzero wait code."""
    return code >> 16, (code >> 15) & 1, (code & 0x7FFF) - 1


class Watchdog:
    """A daemon thread that turns a stream stuck in a memory-operation wait into an error (see the module
    docstring). Each watched entry is a pinned host int32 tensor of wait codes (0: not waiting), with its
    own timeout and two callbacks: ``describe(index, code, seconds) -> str`` (the message) and
    ``release(index, code)`` (unblock the stream; best effort). ``exit`` and ``clock`` are for tests."""

    def __init__(self, poll_s: float = 0.01, grace_s: float = 10.0, exit=os._exit, clock=time.monotonic,
                 thread: bool = True):
        self.poll_s, self._use_thread = poll_s, thread
        self.grace_s = float(grace_s)
        self._exit, self._clock = exit, clock
        self._entries: list = []           # [words, timeout_s, describe, release, seen: {index: (code, since)}]
        self._lock = threading.Lock()
        self.error: str | None = None      # the first root cause
        self.delivered = False             # set by the caller that raised ``error``
        self._exit_at: float | None = None
        self._thread: threading.Thread | None = None

    def watch(self, words: torch.Tensor, timeout_s: float, describe, release) -> None:
        with self._lock:
            self._entries.append([words, float(timeout_s), describe, release, {}])
        if self._thread is None and self._use_thread:
            self._thread = threading.Thread(target=self._run, name="moe-wave-memops-watchdog", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(self.poll_s)
            self.poll()

    def poll(self) -> None:
        """One pass over every word (the thread calls it every ``poll_s``)."""
        now = self._clock()
        with self._lock:
            entries = list(self._entries)
        for words, timeout_s, describe, release, seen in entries:
            for i, code in enumerate(words.tolist()):
                if code == 0:
                    seen.pop(i, None)
                    continue
                old = seen.get(i)
                if old is None or old[0] != code:
                    seen[i] = (code, now, False)
                    continue
                if old[2] or now - old[1] < timeout_s:
                    continue
                seen[i] = (code, old[1], True)          # fire once per stuck wait
                self._fire(describe(i, code, now - old[1]), lambda i=i, code=code: release(i, code), now)
        if self._exit_at is not None and now >= self._exit_at and not self.delivered:
            print(f"[moe-wave] exiting: {self.error} (not raised by the caller within {self.grace_s:g} s)",
                  file=sys.stderr, flush=True)
            self._exit_at = None
            self._exit(1)

    def _fire(self, msg: str, release, now: float) -> None:
        if self.error is None:
            self.error = msg
            self._exit_at = now + self.grace_s
        print(f"[moe-wave] {msg}", file=sys.stderr, flush=True)

        def attempt():
            try:
                release()
            except Exception as e:     # noqa: BLE001 - the message above is what matters; the exit still comes
                print(f"[moe-wave] could not release the stuck wait: {e!r}", file=sys.stderr, flush=True)
        # In a thread of its own: the release goes through a stream, which may itself wait behind the stuck
        # one (streams share the device's hardware queues), and the exit must come regardless.
        if self._use_thread:
            threading.Thread(target=attempt, name="moe-wave-memops-release", daemon=True).start()
        else:
            attempt()

    def raise_if_fired(self) -> None:
        """Raise the first root cause as a RuntimeError (and cancel the exit: the caller has it now)."""
        if self.error is not None:
            self.delivered = True
            raise RuntimeError(self.error)


_WATCHDOG: list = []


def watchdog(grace_s: float | None = None) -> Watchdog:
    """The process's watchdog (made on first use, with ``grace_s``: default 10 s; a later caller's
    ``grace_s`` shortens it, never lengthens it)."""
    if not _WATCHDOG:
        _WATCHDOG.append(Watchdog(grace_s=10.0 if grace_s is None else grace_s))
    elif grace_s is not None:
        _WATCHDOG[0].grace_s = min(_WATCHDOG[0].grace_s, float(grace_s))
    return _WATCHDOG[0]


class MemopSignal:
    """One exchange channel's acknowledgements and flags (see the module docstring).

    Args:
        ep: the expert-parallel group (CUDA, NCCL).
        alloc: ``alloc(nbytes) -> (buffer, symmetric-memory handle)``, collective and zeroed.
        timeout_ms: a wait that lasts longer is reported by the ``Watchdog`` (>= 1; the setup barrier is
            bounded by it too).
        grace_s: how long the caller has to raise the watchdog's error before the process exits.
        fault: the backend's [poison, peer, call] int64 device words: the release writes them before it
            unblocks the stream, so that what the stream then computes from the missing rows is poisoned.
        name: what the exchange is, for the message (e.g. "dispatch wave 0").

    Use, per exchange, on the stream that issues the data copies: ``begin()``, the copies, ``end()``.
    """

    def __init__(self, ep, alloc, *, timeout_ms: int, grace_s: float = 10.0, name: str = "exchange",
                 fault: torch.Tensor | None = None):
        if timeout_ms < 1:
            raise ValueError(f"MemopSignal timeout_ms={timeout_ms}: must be >= 1 (every wait is bounded)")
        why = available()
        if why:
            raise RuntimeError(f"MemopSignal: {why}")
        lib = _lib()
        self._write, self._wait = lib["cuStreamWriteValue32"], lib["cuStreamWaitValue32"]
        P, me = ep.size, ep.rank
        self.ep, self.name, self.fault = ep, name, fault
        _, hdl = alloc(2 * P * 4)
        rows = [hdl.get_buffer(p, [2, P], torch.int32, 0) for p in range(P)]
        hdl.barrier(channel=0, timeout_ms=timeout_ms)          # every word is 0 before anyone writes one
        self._hdl, self._rows = hdl, rows
        self._peers = [p for p in range(P) if p != me]
        self._ack_to = [rows[p][1, me].data_ptr() for p in self._peers]
        self._my_ack = [rows[me][1, p].data_ptr() for p in self._peers]
        self._flag_to = [rows[p][0, me].data_ptr() for p in self._peers]
        self._my_flag = [rows[me][0, p].data_ptr() for p in self._peers]
        can = ctypes.c_int(0)
        lib["attr"](ctypes.byref(can), _ATTR_CAN_FLUSH_REMOTE_WRITES, ep.device.index or 0)
        self.flush = bool(can.value)
        self._wait_flags = _WAIT_EQ | (_WAIT_FLUSH if self.flush else 0)
        self.calls = 0
        # the wait codes, in pinned host memory the stream writes and the watchdog reads
        self._state = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        dptr = ctypes.c_uint64(0)
        rc = lib["host_ptr"](ctypes.byref(dptr), ctypes.c_void_p(self._state.data_ptr()), 0)
        if rc != 0:
            raise RuntimeError(f"cuMemHostGetDevicePointer failed with CUresult {rc}: the memops watchdog needs "
                               f"pinned host memory the device can write")
        self._state_dev = dptr.value
        self._release_stream = torch.cuda.Stream(device=ep.device, priority=-1)
        self._wd = watchdog(grace_s)
        self._wd.watch(self._state, timeout_ms / 1000, self._describe, self._release)

    @property
    def error(self) -> str | None:
        return self._wd.error

    def _describe(self, i: int, code: int, seconds: float) -> str:
        _, step, p = decode(code)
        return (f"symm memops signal: rank {self.ep.rank} waited {seconds:.1f} s for rank {p}'s {STEPS[step]} "
                f"({self.name}); rank {p} stopped or never reached this exchange: see its own error. This rank "
                f"stops (SymmOptions.timeout_ms; the wait is released where the device allows, and what the "
                f"stream computes from then on is poisoned with NaN)")

    def _release(self, i: int, code: int) -> None:
        """Write the awaited word ourselves, from a stream made for this at construction (no kernel, no
        allocation, no wait here). Best effort: if that stream shares a hardware queue with the stuck
        one, the write waits behind it and the watchdog's exit ends the process instead."""
        call, step, p = decode(code)
        stream = ctypes.c_void_p(self._release_stream.cuda_stream)
        writes = []
        if self.fault is not None:     # low 32-bit words of the int64 fault words (zero above), poison last
            base = self.fault.data_ptr()
            writes += [(base + 8, p), (base + 16, call), (base, 1)]
        word = self._rows[self.ep.rank][1 - step, p]     # row 0 flags (step 1), row 1 acks (step 0)
        for addr, value in writes + [(word.data_ptr(), 1)]:
            rc = self._write(stream, addr, value, 0)
            if rc != 0:
                raise RuntimeError(f"cuStreamWriteValue32 failed with CUresult {rc}")

    def _call(self, fn, what: str, addr: int, value: int, flags: int) -> None:
        rc = fn(ctypes.c_void_p(torch.cuda.current_stream(self.ep.device).cuda_stream), addr, value, flags)
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUresult {rc} (900-series: not capturable in a CUDA graph "
                               f"on this driver)")

    def _mark(self, value: int) -> None:
        self._call(self._write, "cuStreamWriteValue32", self._state_dev, value, 0)

    def _wait_all(self, step: int, mine: list, flags: int) -> None:
        for p, a in zip(self._peers, mine):
            self._mark(wait_code(self.calls, step, p))
            self._call(self._wait, "cuStreamWaitValue32", a, 1, flags)
            self._call(self._write, "cuStreamWriteValue32", a, 0, 0)

    def begin(self) -> None:
        self.check()
        self.calls += 1
        for a in self._ack_to:
            self._call(self._write, "cuStreamWriteValue32", a, 1, 0)
        self._wait_all(0, self._my_ack, _WAIT_EQ)

    def check(self) -> None:
        """Raise the watchdog's root cause, if it fired."""
        if self.error is not None:
            self._wd.raise_if_fired()

    def end(self) -> None:
        for a in self._flag_to:
            self._call(self._write, "cuStreamWriteValue32", a, 1, 0)
        self._wait_all(1, self._my_flag, self._wait_flags)
        self._mark(0)

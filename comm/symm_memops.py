"""Peer signalling by stream memory operations: a copy-engine exchange that uses no SM at all.

Legend: P ranks, me this rank, p a peer.

``cuStreamWriteValue32`` and ``cuStreamWaitValue32`` are executed by the GPU's front end, not by a
kernel: a barrier built from them occupies no SM, so a GEMM beside it keeps every SM. CUDA graphs
capture them as memory-operation nodes. Their values are fixed when they are issued, so the
protocol cannot count calls; it resets each word after it has seen it. Every rank owns an int32
``[2, P]`` symmetric buffer, row 0 the data flags and row 1 the acknowledgements, slot p for peer p.
All words start at 0. One exchange, on the stream that issues the data copies:

    1. for every p: write ack[me] = 1 on p       "I am done with what you sent me last time"
    2. for every p: wait my ack[p] == 1, set 0   p is done with my previous data: I may overwrite it
    3. the data copies into the peers' buffers (copy engines)
    4. for every p: write flag[me] = 1 on p      behind the copies (a write carries a memory fence)
    5. for every p: wait my flag[p] == 1, set 0  p's data has landed here

A word is set again only after its owner has reset it: p writes my flag[p] again in its next
exchange only after step 2 there, which needs my step-1 write of that exchange, which my stream
issues after my step-5 reset. The same holds for the acknowledgements.

**No timeout.** A memory-operation wait has no deadline: a peer that never signals stops this
stream for good. ``launch/bench_comm.py`` uses this module to measure what a kernel-free barrier
buys (its stage time limit bounds a hang); the backend keeps its timed barriers. Loads libcuda
through ctypes; ``available()`` says why it cannot be used where it cannot.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["MemopSignal", "available"]

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


class MemopSignal:
    """One exchange channel's flags and acknowledgements (see the module docstring).

    Args:
        ep: the expert-parallel group (CUDA, NCCL).
        alloc: ``alloc(nbytes) -> (buffer, symmetric-memory handle)``, collective and zeroed.

    Use, per exchange, on the stream that issues the data copies: ``begin()``, the copies, ``end()``.
    """

    def __init__(self, ep, alloc):
        why = available()
        if why:
            raise RuntimeError(f"MemopSignal: {why}")
        lib = _lib()
        self._write, self._wait = lib["cuStreamWriteValue32"], lib["cuStreamWaitValue32"]
        P, me = ep.size, ep.rank
        self.ep = ep
        _, hdl = alloc(2 * P * 4)
        rows = [hdl.get_buffer(p, [2, P], torch.int32, 0) for p in range(P)]
        hdl.barrier(channel=0)          # every word is 0 before anyone writes one
        self._hdl, self._rows = hdl, rows
        peers = [p for p in range(P) if p != me]
        self._ack_to = [rows[p][1, me].data_ptr() for p in peers]
        self._my_ack = [rows[me][1, p].data_ptr() for p in peers]
        self._flag_to = [rows[p][0, me].data_ptr() for p in peers]
        self._my_flag = [rows[me][0, p].data_ptr() for p in peers]
        can = ctypes.c_int(0)
        lib["attr"](ctypes.byref(can), _ATTR_CAN_FLUSH_REMOTE_WRITES, ep.device.index or 0)
        self.flush = bool(can.value)
        self._wait_flags = _WAIT_EQ | (_WAIT_FLUSH if self.flush else 0)

    def _call(self, fn, what: str, addr: int, value: int, flags: int) -> None:
        rc = fn(ctypes.c_void_p(torch.cuda.current_stream(self.ep.device).cuda_stream), addr, value, flags)
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUresult {rc} (900-series: not capturable in a CUDA graph "
                               f"on this driver)")

    def begin(self) -> None:
        for a in self._ack_to:
            self._call(self._write, "cuStreamWriteValue32", a, 1, 0)
        for a in self._my_ack:
            self._call(self._wait, "cuStreamWaitValue32", a, 1, _WAIT_EQ)
            self._call(self._write, "cuStreamWriteValue32", a, 0, 0)

    def end(self) -> None:
        for a in self._flag_to:
            self._call(self._write, "cuStreamWriteValue32", a, 1, 0)
        for a in self._my_flag:
            self._call(self._wait, "cuStreamWaitValue32", a, 1, self._wait_flags)
            self._call(self._write, "cuStreamWriteValue32", a, 0, 0)

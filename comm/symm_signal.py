"""Completion flags written by the copy engines: a copy-engine exchange with no barrier kernel behind it.

Legend: P ranks, me this rank, k the call number of one ``CopySignal`` (1, 2, ...).

After a rank's data copies into its peers' symmetric buffers, the same stream copies one int64, the
call number k, into slot ``me`` of every peer's flag row and then of its own. A copy on a stream
starts only when the one before it has finished, so a flag lands after the data it follows. A small
waiter kernel, started on a side stream *before* the data copies (it spins beside them on one SM),
returns once every slot of this rank's row holds at least k, and then advances k. The stream that
issued the copies joins the waiter, so what follows sees every peer's data: the same guarantee as
a barrier after the copies, without a kernel launch that waits for the copy engines to drain (about
8 us per exchange on 2 x H200, benchmarks/README.md).

The call number lives on the device (``val = [k - 1, k]``), so the sequence replays unchanged from a
CUDA graph. The waiter only advances it after it has seen its own slot, which the last of this
call's flag copies writes: the copies of call k have read ``val[1]`` by then. Flags only grow, so a
peer one call ahead is seen as arrived, which is right: it could only get there after this rank's
flag of the same call.

A peer that never signals does not hang the stream: the waiter gives up after about ``timeout_ms``
(a bounded spin), records the slot it waited for in ``status`` and traps, as torch's symmetric-memory
barrier does, so that this rank stops with a CUDA error instead of computing on missing rows
(``check()`` reads the status where the trap is off).

The waiter also runs under ``TRITON_INTERPRET=1`` on CPU (the CI tests the epochs and the timeout
there); the torch twin ``wait_flags_torch`` is the same logic on the host.
"""

from __future__ import annotations

import torch

from . import streams as st
from .triton_gate import tl, triton

__all__ = ["CopySignal", "wait_flags", "wait_flags_torch", "SPINS_PER_MS"]

# Spin iterations of the waiter per millisecond of timeout: one volatile load of local memory per
# iteration is well under a microsecond, so the real timeout is at most about the nominal one.
SPINS_PER_MS = 2000


if triton is not None:

    @triton.jit(debug=True)     # debug: device_assert is compiled in (the trap below)
    def _wait_flags_kernel(flags_ptr, val_ptr, status_ptr, P, spin_limit, TRAP: tl.constexpr):
        target = tl.load(val_ptr) + 1
        for p in range(P):
            n = 0
            seen = tl.load(flags_ptr + p, volatile=True)
            while (seen < target) & (n < spin_limit):
                seen = tl.load(flags_ptr + p, volatile=True)
                n += 1
            if seen < target:       # timed out: the first one sticks (rank waited for, call number)
                if tl.load(status_ptr) == 0:
                    tl.store(status_ptr, 1)
                    tl.store(status_ptr + 1, p)
                    tl.store(status_ptr + 2, target)
            if TRAP:   # as torch's symmetric-memory barrier does: the CUDA error stops this rank
                tl.device_assert(seen >= target, "moe_wave CopySignal: a peer's completion flag did not arrive "
                                                 "within SymmOptions.timeout_ms")
        tl.store(val_ptr, target)
        tl.store(val_ptr + 1, target + 1)


def wait_flags(flags_P: torch.Tensor, val: torch.Tensor, status: torch.Tensor, timeout_ms: int,
               trap: bool = True) -> None:
    """Wait (on the current stream) until every ``flags_P[p] >= val[0] + 1``, then advance ``val`` by one.
    Past about ``timeout_ms`` it records ``[1, p, k]`` in ``status`` (if it holds no error), then traps
    (a CUDA error on this rank) with ``trap``, or goes on without it."""
    if flags_P.dtype != torch.int64 or val.dtype != torch.int64 or status.dtype != torch.int64:
        raise ValueError("wait_flags: flags, val and status must be int64")
    if val.numel() != 2 or status.numel() < 3:
        raise ValueError(f"wait_flags: val must hold 2 values (got {val.numel()}), status at least 3 "
                         f"(got {status.numel()})")
    _wait_flags_kernel[(1,)](flags_P, val, status, flags_P.numel(), max(1, int(timeout_ms) * SPINS_PER_MS),
                             TRAP=trap, num_warps=1)


def wait_flags_torch(flags_P: torch.Tensor, val: torch.Tensor, status: torch.Tensor) -> None:
    """The same on the host, without waiting (the reference: a missing flag is a timeout at once).

    HOST SYNC: reads the flags."""
    target = int(val[0]) + 1
    for p, f in enumerate(flags_P.tolist()):
        if f < target and int(status[0]) == 0:
            status[:3] = torch.tensor([1, p, target])
    val.copy_(torch.tensor([target, target + 1]))


class CopySignal:
    """One exchange channel's flags (see the module docstring); GPU ranks of one NCCL group.

    Args:
        ep: the expert-parallel group.
        alloc: ``alloc(nbytes) -> (buffer, symmetric-memory handle)``, collective and zeroed.
        timeout_ms: how long the waiter spins for a peer before it records an error.

    Use, per call, on the stream that issues the data copies::

        sig.begin()      # before the data copies: the waiter starts on the side stream
        ...copies...     # into the peers' symmetric buffers
        sig.end()        # the flag copies; the current stream joins the waiter
    """

    def __init__(self, ep, alloc, timeout_ms: int):
        P, me, dev = ep.size, ep.rank, ep.device
        self.ep, self.timeout_ms = ep, int(timeout_ms)
        _, hdl = alloc(P * 8)
        self.flags = [hdl.get_buffer(p, [P], torch.int64, 0) for p in range(P)]
        hdl.barrier(channel=0, timeout_ms=self.timeout_ms)      # every row zeroed before anyone signals
        self._hdl = hdl
        self.mine = self.flags[me]
        self.val = torch.tensor([0, 1], dtype=torch.int64, device=dev)
        self.status = torch.zeros(3, dtype=torch.int64, device=dev)
        self.side = st.accel_module(dev).Stream(device=dev, priority=-1)
        # destinations in issue order: the peers, then this rank's own slot last (the waiter's cue)
        self._dst = [self.flags[p][me:me + 1] for p in range(P) if p != me] + [self.mine[me:me + 1]]

    def begin(self) -> None:
        cur = st.current_stream(self.ep.device)
        st.wait_stream(self.side, cur)
        with st.on(self.side):
            wait_flags(self.mine, self.val, self.status, self.timeout_ms)

    def end(self) -> None:
        for d in self._dst:
            d.copy_(self.val[1:2], non_blocking=True)      # copy engine: lands after the data copies
        st.wait_stream(st.current_stream(self.ep.device), self.side)

    def check(self) -> None:
        """Raise the first timeout seen so far (HOST SYNC)."""
        s = self.status.tolist()
        if s[0]:
            raise RuntimeError(f"rank {self.ep.rank}: no completion flag from rank {s[1]} for exchange {s[2]} "
                               f"within {self.timeout_ms} ms: that rank stopped or fell behind "
                               f"(SymmOptions.timeout_ms sets the limit)")

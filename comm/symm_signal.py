"""The signals that close an exchange without torch's barrier kernel: completion flags written by the copy
engines (``CopySignal``), and a barrier kernel of our own (``BarrierSignal``) that names a missing peer.

Legend: P ranks, me this rank, k the call number of one ``CopySignal`` (1, 2, ...).

After a rank's data copies into its peers' symmetric buffers, the same stream copies one int64, the
call number k, into slot ``me`` of every peer's flag row and then of its own. A copy on a stream
starts only when the one before it has finished, so a flag lands after the data it follows. A small
waiter kernel, queued on the same stream after the flag copies (one program on one SM), returns once
every slot of this rank's row holds at least k, and then advances k: what follows on that stream sees
every peer's data, the same guarantee as a barrier after the copies. The waiter is queued after this
rank's own copies, never beside them: a spinning kernel on another stream can share a hardware queue
with the copies' stream and hold them back until it gives up.

The call number lives on the device (``val = [k - 1, k]``), so the sequence replays unchanged from a
CUDA graph. The waiter only advances it after it has seen its own slot, which the last of this
call's flag copies writes: the copies of call k have read ``val[1]`` by then. Flags only grow, so a
peer one call ahead is seen as arrived, which is right: it could only get there after this rank's
flag of the same call.

A peer that never signals does not hang the stream: the waiter gives up after ``timeout_ms`` (by the GPU's
global timer on CUDA; a bounded spin elsewhere and under the interpreter) and records the peer and the call in
the backend's fault words (``[poison, peer, call]``, the first one sticks): the combine's sum then writes NaN,
and the backend raises the error naming the peer (``SymmBackend.check`` or a later call). The clock starts when
the waiter does, after this rank's copies: what it measures is the peers' lateness.

``BarrierSignal`` is the same protocol in one kernel (the default signal, "barrier"): one program stores the
call number k into slot ``me`` of every rank's flag row with release semantics at system scope (the data this
stream wrote before it is visible to a peer that sees the flag), then waits, with acquire loads, until every slot
of its own row holds at least k, by the same global-timer clock, and records ``[poison, peer, call]`` instead of
trapping. torch's ``barrier`` kernel traps after its timeout and does not say which peer it waited for. The flag
rows live in the data allocation itself (``symm_heap``), so the barrier needs no signal pad and no extra
rendezvous.

Both waiters also run under ``TRITON_INTERPRET=1`` on CPU (the CI tests the epochs and the timeout there, the
barrier on rows of one process); the torch twins ``wait_flags_torch`` and ``barrier_torch`` are the same logic
on the host.
"""

from __future__ import annotations

import torch

from .triton_gate import interpreting, tl, triton

__all__ = ["CopySignal", "BarrierSignal", "wait_flags", "wait_flags_torch", "barrier_wait", "barrier_torch",
           "SPINS_PER_MS"]

# Without the global timer (ROCm, the interpreter): spin iterations per millisecond of timeout. One volatile
# load of local memory per iteration is well under a microsecond, so the real timeout is at most the nominal one.
SPINS_PER_MS = 2000

globaltimer = None
if triton is not None:
    try:
        from triton.language.extra.cuda import globaltimer
    except ImportError:  # pragma: no cover - depends on the Triton build
        globaltimer = None

    @triton.jit
    def _wait_flags_kernel(flags_ptr, val_ptr, fault_ptr, P, limit, CLOCK: tl.constexpr):
        target = tl.load(val_ptr) + 1
        for p in range(P):
            seen = tl.load(flags_ptr + p, volatile=True)
            n = target * 0                   # int64: nanoseconds waited (CLOCK) or spins
            if CLOCK:
                t0 = globaltimer()
            while (seen < target) & (n < limit):
                seen = tl.load(flags_ptr + p, volatile=True)
                if CLOCK:
                    n = globaltimer() - t0
                else:
                    n += 1
            if seen < target:       # gave up: the first fault sticks (poison, rank waited for, call number)
                if tl.load(fault_ptr) == 0:
                    tl.store(fault_ptr + 1, p)
                    tl.store(fault_ptr + 2, target)
                    tl.store(fault_ptr, 1)
        tl.store(val_ptr, target)
        tl.store(val_ptr + 1, target + 1)

    @triton.jit
    def _barrier_kernel(rows_ptr, me, val_ptr, fault_ptr, P, limit, BLOCK_P: tl.constexpr, CLOCK: tl.constexpr):
        target = tl.load(val_ptr) + 1
        offs = tl.arange(0, BLOCK_P)
        live = offs < P
        # rows_ptr[p]: the address of rank p's flag row (peer memory); my slot in each row gets the call number
        rows = tl.load(rows_ptr + offs, mask=live, other=0).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(rows + me, tl.zeros([BLOCK_P], dtype=tl.int64) + target, mask=live, sem="release",
                       scope="sys")
        mine = tl.load(rows_ptr + me).to(tl.pointer_type(tl.int64))
        seen = tl.atomic_add(mine + offs, 0, mask=live, sem="acquire", scope="sys")
        late = live & (seen < target)
        n = target * 0                       # int64: nanoseconds waited (CLOCK) or spins
        if CLOCK:
            t0 = globaltimer()
        while (tl.max(late.to(tl.int32), 0) > 0) & (n < limit):
            seen = tl.atomic_add(mine + offs, 0, mask=late, sem="acquire", scope="sys")
            late = late & (seen < target)
            if CLOCK:
                n = globaltimer() - t0
            else:
                n += 1
        first = tl.min(tl.where(late, offs, BLOCK_P), 0)
        if first < BLOCK_P:                  # gave up: the first fault sticks (poison, rank waited for, call)
            if tl.load(fault_ptr) == 0:
                tl.store(fault_ptr + 1, first.to(tl.int64))
                tl.store(fault_ptr + 2, target)
                tl.store(fault_ptr, 1)
        tl.store(val_ptr, target)
        tl.store(val_ptr + 1, target + 1)


def _limit(timeout_ms: int, t: torch.Tensor) -> tuple[bool, int]:
    """(use the global timer, the wait's bound in its unit: nanoseconds, or spins without the timer)."""
    clock = globaltimer is not None and t.is_cuda and torch.version.cuda is not None and not interpreting()
    return clock, (int(timeout_ms) * 1_000_000 if clock else max(1, int(timeout_ms) * SPINS_PER_MS))


def _check_words(what: str, val: torch.Tensor, fault: torch.Tensor) -> None:
    if val.dtype != torch.int64 or fault.dtype != torch.int64:
        raise ValueError(f"{what}: val and fault must be int64")
    if val.numel() != 2 or fault.numel() != 3 or not fault.is_contiguous():
        raise ValueError(f"{what}: val must hold 2 values (got {val.numel()}), fault 3 contiguous words "
                         f"(got {fault.numel()})")


def barrier_wait(rows_P: torch.Tensor, me: int, val: torch.Tensor, fault: torch.Tensor, timeout_ms: int) -> None:
    """One barrier on the current stream: store ``val[0] + 1`` into slot ``me`` of every rank's flag row (their
    addresses in ``rows_P``, int64), wait until every slot of row ``me`` holds at least that, advance ``val``.
    Past ``timeout_ms`` it gives up and records ``[1, p, k]`` in ``fault`` (if it holds none), p the first
    rank missing."""
    _check_words("barrier_wait", val, fault)
    if rows_P.dtype != torch.int64 or not 0 <= me < rows_P.numel():
        raise ValueError(f"barrier_wait: rows must be int64 addresses and me={me} in [0, {rows_P.numel()})")
    clock, limit = _limit(timeout_ms, rows_P)
    P = rows_P.numel()
    _barrier_kernel[(1,)](rows_P, me, val, fault, P, limit, BLOCK_P=max(2, triton.next_power_of_2(P)), CLOCK=clock,
                          num_warps=1)


def barrier_torch(rows: list, me: int, val: torch.Tensor, fault: torch.Tensor) -> None:
    """``barrier_wait`` on the host over rows of one process, without waiting (a missing flag is a timeout at once).

    HOST SYNC: reads the flags."""
    target = int(val[0]) + 1
    for r in rows:
        r[me] = target
    for p, f in enumerate(rows[me].tolist()):
        if f < target and int(fault[0]) == 0:
            fault[:3] = torch.tensor([1, p, target])
    val.copy_(torch.tensor([target, target + 1]))


def wait_flags(flags_P: torch.Tensor, val: torch.Tensor, fault: torch.Tensor, timeout_ms: int) -> None:
    """Wait (on the current stream) until every ``flags_P[p] >= val[0] + 1``, then advance ``val`` by one.
    Past ``timeout_ms`` it gives up on that peer and records ``[1, p, k]`` in ``fault`` (if it holds none)."""
    if flags_P.dtype != torch.int64:
        raise ValueError("wait_flags: flags must be int64")
    _check_words("wait_flags", val, fault)
    clock, limit = _limit(timeout_ms, flags_P)
    _wait_flags_kernel[(1,)](flags_P, val, fault, flags_P.numel(), limit, CLOCK=clock, num_warps=1)


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
        timeout_ms: how long the waiter waits for a peer before it gives up and records the fault.
        fault: the backend's [poison, peer, call] int64 words.

    Use, per call, on the stream that issues the data copies::

        sig.begin()      # nothing to do before the copies (the common signal interface)
        ...copies...     # into the peers' symmetric buffers
        sig.end()        # the flag copies, then the waiter, on the same stream
    """

    def __init__(self, ep, alloc, timeout_ms: int, fault: torch.Tensor):
        P, me, dev = ep.size, ep.rank, ep.device
        self.ep, self.timeout_ms, self.fault = ep, int(timeout_ms), fault
        _, hdl = alloc(P * 8)
        self.flags = [hdl.get_buffer(p, [P], torch.int64, 0) for p in range(P)]
        hdl.barrier(channel=0, timeout_ms=self.timeout_ms)      # every row zeroed before anyone signals
        self._hdl = hdl
        self.mine = self.flags[me]
        self.val = torch.tensor([0, 1], dtype=torch.int64, device=dev)
        # destinations in issue order: the peers, then this rank's own slot last
        self._dst = [self.flags[p][me:me + 1] for p in range(P) if p != me] + [self.mine[me:me + 1]]

    def begin(self) -> None:
        """Nothing before the copies: the waiter follows them on their stream (see the module docstring)."""

    def end(self) -> None:
        for d in self._dst:
            d.copy_(self.val[1:2], non_blocking=True)      # lands after the data copies queued before it
        wait_flags(self.mine, self.val, self.fault, self.timeout_ms)


class BarrierSignal:
    """A barrier kernel of our own over one channel's flag rows (see the module docstring); GPU ranks of one
    NCCL group.

    Args:
        ep: the expert-parallel group.
        rows: [P] of [P] int64 views: rank p's flag row for this channel (peer memory, zeroed, every rank past a
            barrier since the zeroing).
        timeout_ms: how long it waits for a peer before it gives up and records the fault.
        fault: the backend's [poison, peer, call] int64 words.

    ``begin()`` does nothing; ``end()`` queues the barrier on the current stream, after the data it closes.
    Made outside any capture (it copies the row addresses to the device); it replays from a CUDA graph.
    """

    def __init__(self, ep, rows: list, timeout_ms: int, fault: torch.Tensor):
        if len(rows) != ep.size or any(r.shape != (ep.size,) or r.dtype != torch.int64 for r in rows):
            raise ValueError(f"BarrierSignal: rows must be {ep.size} int64 rows of {ep.size} words")
        self.ep, self.timeout_ms, self.fault, self.rows = ep, int(timeout_ms), fault, rows
        self.rows_P = torch.tensor([r.data_ptr() for r in rows], dtype=torch.int64, device=ep.device)
        self.val = torch.tensor([0, 1], dtype=torch.int64, device=ep.device)

    def begin(self) -> None:
        """Nothing before the data: the barrier follows it on its stream."""

    def end(self) -> None:
        barrier_wait(self.rows_P, self.ep.rank, self.val, self.fault, self.timeout_ms)

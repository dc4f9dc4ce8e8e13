"""DeepEP's stream rules for normal-mode calls (``comm_scope``), device-generic, synchronous on CPU.

A call queues its work on the buffer's communication stream, which first waits for ``previous_event`` or, without
one, for the caller's current stream. With ``async_finish`` the call returns an ``EventOverlap`` recorded on the
communication stream; without it the caller's stream waits before the call returns (a call with neither runs on
the caller's stream: the same order, less host time). Outputs are made on the communication stream and marked as
used by the caller's stream (and inputs as used by the communication stream), so either may free them early.
"""

from __future__ import annotations

import contextlib

import torch

from .utils import EventHandle, EventOverlap

__all__ = ["Scope", "comm_scope"]


class Scope:
    """What a call made inside ``comm_scope``: its outputs (for stream lifetimes) and the returned event."""

    def __init__(self):
        self.outputs: list = []
        self.event: EventOverlap | None = None

    def out(self, *tensors):
        """Register outputs (tensors and tuples of them); returns them as given."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.outputs.append(t)
            elif isinstance(t, tuple):
                self.outputs.extend(u for u in t if isinstance(u, torch.Tensor))
        return tensors[0] if len(tensors) == 1 else tensors


@contextlib.contextmanager
def comm_scope(comm, device, what: str, previous_event, async_finish: bool, inputs=()):
    """Run the block on ``comm`` (the communication stream; None on CPU) under the module's rules."""
    scope = Scope()
    if comm is None:
        yield scope
        scope.event = EventOverlap(EventHandle() if async_finish else None)
        return
    if previous_event is None and not async_finish:
        # DeepEP's rules here: the comm stream waits for the caller's, runs the call, and the caller's waits for
        # it before the call returns. Running on the caller's stream orders the work the same, without the two
        # waits, the stream switch and the record_stream calls (host time DeepEP's tests count).
        yield scope
        scope.event = EventOverlap(None)
        return
    caller = torch.cuda.current_stream(device)
    if previous_event is not None:
        ev = previous_event.event if isinstance(previous_event, EventOverlap) else previous_event
        if ev is None:
            raise ValueError(f"{what}: previous_event holds no event")
        ev.wait_on(comm)
    else:
        comm.wait_stream(caller)
    with torch.cuda.stream(comm):
        yield scope
    if not torch.cuda.is_current_stream_capturing():
        for t in inputs:
            for u in (t if isinstance(t, tuple) else (t,)):
                if isinstance(u, torch.Tensor) and u.is_cuda:
                    u.record_stream(comm)
        for t in scope.outputs:
            t.record_stream(caller)
    if async_finish:
        scope.event = EventOverlap(EventHandle(comm), tuple(scope.outputs))
    else:
        caller.wait_stream(comm)
        scope.event = EventOverlap(None)

"""DeepEP's event helpers (``deep_ep.utils``): ``EventHandle`` and ``EventOverlap``, device-generic, no-ops on CPU.

An ``EventHandle`` is an event recorded on a stream (the current one by default) when it is made; on a host with
no accelerator it records nothing and waiting on it returns at once (the CPU path is synchronous).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

__all__ = ["EventHandle", "EventOverlap", "check_nvlink_connections"]


class EventHandle:
    """An event recorded on ``stream`` (default: the current CUDA stream) at construction, as DeepEP's C++
    ``EventHandle()`` does. ``current_stream_wait()`` makes the caller's current stream wait for it."""

    def __init__(self, stream=None):
        self.event = None
        if stream is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            stream = torch.cuda.current_stream()
        if stream is not None:
            self.event = torch.cuda.Event()
            self.event.record(stream)

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def wait_on(self, stream) -> None:
        """``stream`` waits for the event (nothing to wait for on CPU)."""
        if self.event is not None and stream is not None:
            stream.wait_event(self.event)


class EventOverlap:
    """DeepEP's event wrapper: ``event`` (an ``EventHandle`` or None) and ``extra_tensors`` kept alive with it (the
    CUDA-graph-friendly replacement for ``record_stream``). As a context manager, leaving the block makes the
    current stream wait for the event."""

    def __init__(self, event: Optional[EventHandle] = None,
                 extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """The current stream waits for the event."""
        if self.event is None:
            raise RuntimeError("EventOverlap.current_stream_wait: this EventOverlap holds no event (the call that "
                               "returned it ran with async_finish=False, and the current stream already waited)")
        self.event.current_stream_wait()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


def check_nvlink_connections(group) -> None:
    """DeepEP checks NVLink between PCIe GPUs here; the symmetric-memory transport needs only peer access, which
    torch's rendezvous checks when the buffers are made."""

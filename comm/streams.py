"""Streams and events, device-generic (CUDA and ROCm through torch's device module), no-ops on CPU.

This module is the only place that touches streams and events. Everything else asks it for a
``Streams`` bundle and uses ``on(stream)``, ``record()``, ``wait()`` and ``keep_alive()``; on a CPU
device every one of those does nothing, so the same schedule code runs (serially) in the CPU tests.

Lifetimes: a tensor produced on one stream and consumed on another must not be recycled by the
caching allocator while the consumer still reads it. ``keep_alive(t, stream)`` marks it
(``Tensor.record_stream``); schedule code also holds references until the consumer's event.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

__all__ = ["Streams", "accel_module", "is_accelerator", "on", "record", "wait", "wait_stream", "keep_alive",
           "current_stream"]


def is_accelerator(device: torch.device | str | None) -> bool:
    """True for a device that has streams (cuda, also ROCm which torch calls cuda, xpu, ...)."""
    if device is None:
        return False
    return torch.device(device).type not in ("cpu", "meta")


def accel_module(device: torch.device | str):
    """The torch device module (``torch.cuda`` on CUDA and ROCm) or None on CPU."""
    if not is_accelerator(device):
        return None
    return torch.get_device_module(torch.device(device).type)


def current_stream(device: torch.device | str):
    mod = accel_module(device)
    return None if mod is None else mod.current_stream(torch.device(device))


@contextlib.contextmanager
def on(stream) -> Iterator[None]:
    """Run the block on ``stream``; a no-op when ``stream`` is None (CPU)."""
    if stream is None:
        yield
        return
    mod = torch.get_device_module(stream.device.type)
    with mod.stream(stream):
        yield


def record(stream=None, device: torch.device | str | None = None):
    """Record an event on ``stream`` (default: the current stream of ``device``); None on CPU."""
    if stream is None:
        stream = current_stream(device) if device is not None else None
    if stream is None:
        return None
    ev = torch.get_device_module(stream.device.type).Event()
    ev.record(stream)
    return ev


def wait(event, stream=None) -> None:
    """Make ``stream`` (default: current) wait for ``event``; a no-op for a None event."""
    if event is None:
        return
    if stream is None:
        event.wait()
    else:
        stream.wait_event(event)


def wait_stream(waiter, waitee) -> None:
    """``waiter`` waits for all work queued so far on ``waitee``; no-op if either is None."""
    if waiter is None or waitee is None or waiter == waitee:
        return
    waiter.wait_stream(waitee)


def keep_alive(tensor: torch.Tensor | None, stream) -> None:
    """Tell the caching allocator that ``stream`` uses ``tensor`` (no-op on CPU or for None)."""
    if tensor is None or stream is None or not is_accelerator(tensor.device):
        return
    tensor.record_stream(stream)


@dataclass(frozen=True)
class Streams:
    """The side streams of one device: ``comm`` and ``alt``; compute is always the caller's current
    stream (``current()``), looked up at call time so that CUDA-graph capture streams are respected.

    ``extra`` holds further side streams on demand (the attention front-end uses several). On CPU all
    are None and every helper above degenerates to plain sequential execution.
    """

    device: torch.device
    comm: object | None
    alt: object | None
    extra: tuple = ()

    @classmethod
    def for_device(cls, device: torch.device | str, num_extra: int = 0, priority: int = 0) -> "Streams":
        device = torch.device(device)
        mod = accel_module(device)
        if mod is None:
            return cls(device, None, None, tuple(None for _ in range(num_extra)))
        mk = lambda prio: mod.Stream(device=device, priority=prio)  # noqa: E731
        # comm gets the high priority: its copies/kernels should start the moment SMs free up
        return cls(device, mk(-1), mk(priority), tuple(mk(priority) for _ in range(num_extra)))

    def current(self):
        return current_stream(self.device)

    @property
    def enabled(self) -> bool:
        return self.comm is not None

"""How moe-wave measures time: one module for the benchmarks, the sweep, the demo and the launch scripts.

Every function runs on CPU and on a GPU. On CUDA, CUDA events on the current stream time the device; on
CPU ``time.perf_counter`` times the host (ops there are synchronous). Times are microseconds unless a
name says otherwise. Where an ``EPGroup`` is given, every rank of it must call together: the ranks are
aligned by a barrier before each sample and reductions take the slowest rank (a collective finishes with
its slowest rank).

    iteration_us   fn(i) once per iteration: inputs set up untimed, L2 flushed, ranks aligned per iteration
    sample_us      one sample of ``reps`` back-to-back calls (per call), ranks aligned before it
    median_us      the median of such samples, slowest rank
    paired_us      two functions sampled in turns (base, then fn): their medians and the paired difference
    slowest        the element-wise max over ranks of a list of numbers
    as_graph       capture fn in a CUDA graph: (replay, captured output)
    Clock          marks on the current stream and the spans between them (per-layer times of a stack)
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["Clock", "align", "l2_flush_buffer", "iteration_us", "sample_us", "median_us", "paired_us", "slowest",
           "as_graph", "L2_FLUSH_BYTES"]

L2_FLUSH_BYTES = 256 << 20   # larger than the L2 of the GPUs moe-wave runs on (H200: 60 MB)


def _device(ep, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    return ep.device if ep is not None else torch.device("cpu")


def align(ep=None, device: torch.device | str | None = None) -> None:
    """Start from an idle device, every rank of ``ep`` together."""
    if _device(ep, device).type == "cuda":
        torch.cuda.synchronize()   # HOST SYNC: the sample starts from an idle device
    if ep is not None and ep.pg is not None:
        dist.barrier(group=ep.pg)  # HOST SYNC: every rank starts the sample at the same moment


def l2_flush_buffer(device: torch.device | str) -> torch.Tensor | None:
    """A buffer whose ``fill_`` evicts the L2 cache (``iteration_us(flush=)``); None on CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)


class Clock:
    """Marks on the current stream: CUDA events on a GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def spans_ms(self, marks: list) -> list[float]:
        """Milliseconds between consecutive marks."""
        if not self.cuda:
            return [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]
        marks[-1].synchronize()   # HOST SYNC: the events must have completed to be read
        return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]


def iteration_us(fn: Callable[[int], object], iters: int, warmup: int = 0, *, ep=None,
                 device: torch.device | str | None = None, flush: torch.Tensor | None = None,
                 before: Callable[[int], object] | None = None) -> list[float]:
    """Per-iteration times of ``fn(i)`` on this rank (i counts from 0 through the warm-up).

    Each timed iteration runs ``before(i)`` (untimed: fresh inputs), writes ``flush`` (an L2 flush, see
    ``l2_flush_buffer``), aligns the ranks (``align``) and times ``fn(i)`` alone. ``device`` defaults to
    ``ep.device``, else CPU."""
    clock = Clock(_device(ep, device))
    for i in range(warmup):
        if before is not None:
            before(i)
        fn(i)
    spans = []
    for i in range(warmup, warmup + iters):
        if before is not None:
            before(i)
        if flush is not None:
            flush.fill_(i & 0xFF)
        align(ep, device)
        a = clock.mark()
        fn(i)
        spans.append((a, clock.mark()))
    # read after the loop, last first: only that read waits for the device (spans_ms)
    return [clock.spans_ms([a, b])[0] * 1e3 for a, b in reversed(spans)][::-1]


def sample_us(fn: Callable[[], object], reps: int, *, ep=None, device: torch.device | str | None = None) -> float:
    """Microseconds per ``fn()`` call over ``reps`` back-to-back calls, the ranks aligned first. Back to
    back, the ranks' launch skew after the barrier (tens of us) is paid once per sample, not once per call."""
    align(ep, device)
    clock = Clock(_device(ep, device))
    a = clock.mark()
    for _ in range(reps):
        fn()
    return clock.spans_ms([a, clock.mark()])[0] * 1e3 / reps


def slowest(ep, values) -> list[float]:
    """The element-wise max over the ranks of ``ep`` (HOST SYNC through ``EPGroup.max_over``); ``values``
    as floats without a group."""
    return [float(v) for v in values] if ep is None else ep.max_over(list(values))


def median_us(fn: Callable[[], object], iters: int, *, warmup: int = 3, reps: int = 1, ep=None,
              device: torch.device | str | None = None) -> float:
    """The median over ``iters`` samples (``sample_us``) of microseconds per ``fn()`` call, slowest rank."""
    for _ in range(warmup):
        fn()
    med = statistics.median(sample_us(fn, reps, ep=ep, device=device) for _ in range(iters))
    return slowest(ep, [med])[0]


def paired_us(base: Callable[[], object], fn: Callable[[], object], iters: int, *, warmup: int = 3, reps: int = 1,
              ep=None, device: torch.device | str | None = None) -> tuple[float, float, float]:
    """(base us, fn us, fn - base us), slowest rank of each: samples taken in turns, base then fn, and the
    median of the paired differences. Where ``base`` drifts over a run (a GEMM by up to ~8 %), each ``fn``
    sample is compared with the ``base`` sample taken just before it."""
    for _ in range(warmup):
        base()
        fn()
    pairs = [(sample_us(base, reps, ep=ep, device=device), sample_us(fn, reps, ep=ep, device=device))
             for _ in range(iters)]
    a, b = zip(*pairs)
    return tuple(slowest(ep, [statistics.median(a), statistics.median(b),
                              statistics.median(y - x for x, y in pairs)]))


def as_graph(fn: Callable[[int], object], device: torch.device | str, warmup: int = 2):
    """Capture ``fn(0)`` in a CUDA graph after ``warmup`` eager runs on a side stream (as capture requires):
    (replay function with fn's signature, the captured output). The output holds nothing until a replay."""
    device = torch.device(device)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn(0)
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)   # HOST SYNC (setup): the warm-up is done before the capture begins
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(0)
    return (lambda i: graph.replay()), out

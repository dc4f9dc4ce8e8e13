"""The backend contract: split-phase dispatch and combine per wave.

Legend: T local tokens, K top-k, P ranks, W waves, e local experts, S sent rows, R received rows,
D hidden.

A backend turns a ``DispatchLayout`` into an ``ExchangePlan`` (``prepare``: the count exchange),
then moves rows wave by wave:

    plan = backend.prepare(layout)                       # counts exchanged; host sync if the backend needs one
    pd = backend.dispatch(x_TD, plan, wave)              # -> Pending[Received]
    got = pd.wait()                                      # got.x_RD, got.expert_RK, got.weight_RK
    pc = backend.combine(y_RD, got.handle, out_TD)       # -> Pending[None]
    pc.wait()                                            # out_TD (fp32) += the wave's results

``combine(..., accumulate=False)`` ignores what ``out_TD`` held and writes every row (zero where the
wave brought nothing back): the first wave's combine into a fresh ``torch.empty`` output, with no
zero fill and no read of it.

``start`` work is queued on the backend's comm stream (GPU) or handed to the process group's
worker threads (gloo); ``wait`` makes the *current* stream (or the host, on CPU) wait. Compute
never communicates: everything between ``wait`` and the next ``start`` is local.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Generic, Protocol, TypeVar, runtime_checkable

import torch

from .layout import DispatchLayout

__all__ = ["Pending", "Received", "WaveHandle", "ExchangePlan", "CommBackend", "Done"]

R_ = TypeVar("R_")


class Pending(Generic[R_]):
    """A started communication. ``wait()`` returns its result; calling it twice is an error."""

    __slots__ = ("_finish", "_done", "_result", "name")

    def __init__(self, finish: Callable[[], R_], name: str = ""):
        self._finish = finish
        self._done = False
        self._result = None
        self.name = name

    def wait(self) -> R_:
        if self._done:
            raise RuntimeError(f"Pending({self.name}).wait() called twice")
        self._done = True
        self._result = self._finish()
        self._finish = None
        return self._result


def Done(value: R_ = None, name: str = "") -> Pending[R_]:
    """An already-finished Pending (single-process paths)."""
    return Pending(lambda: value, name)


@dataclass(frozen=True)
class ExchangePlan:
    """The layout plus what the peers told us. Host lists exist only on host-split backends.

    Attributes:
        layout: the send-side layout.
        send_counts: [W][P] rows sent per wave and peer (host ints) or None.
        recv_counts: [W][P] rows received per wave and source peer (host ints) or None.
        recv_pairs: [W][e] (token, k) pairs received per wave and local expert (host ints) or None.
        send_offsets: [W+1] start of each wave's block in the send order (host ints) or None.
        recv_counts_WP / recv_pairs_WPe: the same on the device (always present).
        extra: backend-private tensors computed once per layer (e.g. packed routing metadata).
    """

    layout: DispatchLayout
    recv_counts_WP: torch.Tensor
    recv_pairs_WPe: torch.Tensor
    send_counts: list | None = None
    recv_counts: list | None = None
    recv_pairs: list | None = None
    send_offsets: list | None = None
    extra: dict = field(default_factory=dict, compare=False)  # backend-private state

    @property
    def num_waves(self) -> int:
        return self.layout.plan.num_waves


@dataclass(frozen=True)
class WaveHandle:
    """Everything combine needs for one wave (the inverse of that wave's dispatch)."""

    wave: int
    plan: ExchangePlan
    send_token_S: torch.Tensor          # [S_w] token of each row sent this wave, send order
    extra: dict = field(default_factory=dict, compare=False)  # backend-private state


@dataclass(frozen=True)
class Received:
    """The rows a wave delivered to this rank, grouped by source peer.

    Attributes:
        x_RD: [R, D] rows in the dtype of x.
        expert_RK: [R, K] int32 local expert of slot k, -1 for slots that belong elsewhere.
        weight_RK: [R, K] float32 routing weights.
        pairs_e: host list [e] of valid (row, slot) pairs per local expert, or None when the
            backend keeps counts on the device only (then ``pairs_e_dev`` is authoritative).
        pairs_e_dev: [e] int64 the same on the device.
        handle: for ``combine``.
    """

    x_RD: torch.Tensor
    expert_RK: torch.Tensor
    weight_RK: torch.Tensor
    pairs_e: list | None
    pairs_e_dev: torch.Tensor
    handle: WaveHandle


@runtime_checkable
class CommBackend(Protocol):
    name: str

    def prepare(self, layout: DispatchLayout) -> ExchangePlan: ...

    def dispatch(self, x_TD: torch.Tensor, plan: ExchangePlan, wave: int) -> Pending[Received]: ...

    def combine(self, y_RD: torch.Tensor, handle: WaveHandle, out_TD: torch.Tensor, *,
                accumulate: bool = True) -> Pending[None]: ...

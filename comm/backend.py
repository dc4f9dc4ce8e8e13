"""The backend contract: split-phase dispatch and combine per wave.

Legend: T local tokens, K top-k, P ranks, W waves, e local experts, S sent rows, R received rows,
D hidden.

A backend turns a ``DispatchLayout`` into its own plan type (``prepare``: the count exchange), then moves
rows wave by wave:

    plan = backend.prepare(layout)                       # counts exchanged; host sync if the backend needs one
    pd = backend.dispatch(x_TD, plan, wave)              # -> Pending[Received]
    got = pd.wait()                                      # got.x_RD, got.expert_RK, got.weight_RK
    pc = backend.combine(y_RD, got.handle, CombineOut(out_TD))   # -> Pending[None]
    pc.wait()                                            # out_TD (fp32) += the wave's results

``CombineOut`` groups where the wave's sum goes. ``accumulate=False`` ignores what ``out_TD`` held and
writes every row (zero where the wave brought nothing back): the first wave's combine into a fresh
``torch.empty`` output, with no zero fill and no read of it. The sum can end the layer (``add_TD``,
``dst_TD``): ``dst_TD = (out_TD if accumulate else 0) + the wave's rows + add_TD``, summed in fp32 and
stored in ``dst_TD``'s dtype (WaveMoE's last wave: the shared expert's output added and the bf16 result
written in the same pass; ``out_TD`` is then scratch). ``add_TD`` is read when ``wait()`` runs, on the
stream current then.

``dispatch(..., combine_width=D)``: the rows the combine will send back are D wide where x's rows are not (rows
that travel packed: ``moe_wave.fp8_rows``' FP8 rows + scales in a bf16 container); a backend that sizes its
buffers ahead (symm) sizes the combine's by it. Backends copy dispatched rows and never compute on them, so any
bytes a row holds arrive as they were sent.

``dispatch(..., local_view=True)`` lets the backend leave this rank's own rows in x instead of copying
them into ``x_RD`` (``Received.local`` then says where they are; ``rows_of`` reads rows either way). A
backend may ignore it (``local`` is then None).

``start`` work is queued on the backend's comm stream (GPU) or handed to the process group's
worker threads (gloo); ``wait`` makes the *current* stream (or the host, on CPU) wait. Compute
never communicates: everything between ``wait`` and the next ``start`` is local.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Generic, Protocol, TypeVar, runtime_checkable

import torch

from .layout import DispatchLayout

__all__ = ["Pending", "Received", "OnceRows", "WaveHandle", "ExchangePlan", "CombineOut", "CommBackend",
           "check_sum_args", "pending_after", "rows_of", "refuse_once"]

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


@dataclass(frozen=True)
class ExchangePlan:
    """What every backend's plan holds: the layout plus what the peers told us, on the device. Each backend
    subclasses it with its own state (``TorchPlan``, ``SymmPlan``, ``DeepEPPlan``).

    Attributes:
        layout: the send-side layout.
        recv_counts_WP: [W, P] rows received per wave and source peer (device; zeros where the backend
            exchanges its counts inside each dispatch, as DeepEP does).
        recv_pairs_WPe: [W, P, e] (token, k) pairs received per wave, source and local expert (device).
    """

    layout: DispatchLayout
    recv_counts_WP: torch.Tensor
    recv_pairs_WPe: torch.Tensor

    @property
    def num_waves(self) -> int:
        return self.layout.plan.num_waves


@dataclass(frozen=True)
class WaveHandle:
    """Everything combine needs for one wave (the inverse of that wave's dispatch); backends subclass it."""

    wave: int
    plan: ExchangePlan


@dataclass(frozen=True)
class CombineOut:
    """Where a combine's sum goes (see the module docstring).

    Attributes:
        out_TD: [T, D] the fp32 accumulator (also what the sum is written into when ``dst_TD`` is None).
        accumulate: add to what ``out_TD`` holds (True) or write every row over it (False).
        add_TD: None or [T, D]: added to the sum in fp32 (read when ``wait()`` runs).
        dst_TD: None or [T, D]: receives the sum in its dtype (``out_TD`` is then scratch).
    """

    out_TD: torch.Tensor
    accumulate: bool = True
    add_TD: torch.Tensor | None = None
    dst_TD: torch.Tensor | None = None

    def __post_init__(self):
        check_sum_args(self.out_TD, self.add_TD, self.dst_TD)

    def add_rows(self, blocks) -> None:
        """The sum with torch ops, for backends that bring rows home unsummed: for each ``(token_N, rows_ND)``
        block in order, ``out_TD[token_N] += rows_ND`` (over zeros without ``accumulate``), then ``add_TD`` and
        ``dst_TD``. Within a block a token appears at most once (one row per token per peer), so every
        ``index_add_`` adds at most once to an element: the summation order is the blocks' order, fixed, the
        same as a fused kernel's (atomics racing on one element would make the result vary from run to run)."""
        out_TD = self.out_TD
        if not self.accumulate:
            out_TD.zero_()
        for token_N, rows_ND in blocks:
            out_TD.index_add_(0, token_N, rows_ND.to(out_TD.dtype))
        self.finish_sum()

    def finish_sum(self) -> None:
        """``out_TD += add_TD``, then ``dst_TD`` gets it in its dtype (after an unfused sum into ``out_TD``)."""
        if self.add_TD is not None:
            self.out_TD.add_(self.add_TD.to(self.out_TD.dtype))
        if self.dst_TD is not None and self.dst_TD is not self.out_TD:
            self.dst_TD.copy_(self.out_TD)

    @property
    def result(self) -> torch.Tensor:
        """The tensor holding the finished sum: ``dst_TD`` if given, else ``out_TD``."""
        return self.out_TD if self.dst_TD is None else self.dst_TD


@dataclass(frozen=True)
class OnceRows:
    """What the expert stage of wave ``wave`` needs when rows cross once per layer (``WavePlan.sends == "once"``,
    see ``comm.layout`` and ``comm.symm_once``): ``Received`` then holds every block that has arrived, the
    blocks of wave b being rows b * R // W .. (b + 1) * R // W - 1, and only the experts of this wave count (local
    expert x is in wave x * W // e). The stage adds each row's results to the sum that the earlier waves left in
    its row of y (``state["y"]``, [R, D], kept for the waves of one call; a row starts its sum in the wave of its
    block, its first), so that after the row's last wave its row of y holds the finished sum, which the combine
    of that wave reads; y's rows that no wave has touched are left as allocated.

    Attributes:
        wave: w; num_waves: W.
        state: shared by the waves of one call (one per prepare).
    """

    wave: int
    num_waves: int
    state: dict = field(compare=False, repr=False)


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
        local: None, or (row0, x_nD) where the dispatch was asked for ``local_view`` and took it: rows row0 ..
            row0 + n - 1 of ``x_RD`` were not filled, they are x_nD's rows (this rank's own tokens, left in
            x with no copy); rows row0 + n .. of that block carry no pair. Read rows with ``rows_of``.
        rows_P: None (the combine may read every row of y), or [P] int device counts for a backend whose
            receive buffer is P blocks of R // P rows, one per source: the combine reads only the first
            rows_P[p] rows of block p (more than R // P means all of them), so the expert stage may leave y's
            other rows unwritten and skip their slots (a fixed-capacity buffer's empty tail costs nothing).
        once: None, or ``OnceRows`` (a row crosses once per layer: the stage sums over waves, see there).
    """

    x_RD: torch.Tensor
    expert_RK: torch.Tensor
    weight_RK: torch.Tensor
    pairs_e: list | None
    pairs_e_dev: torch.Tensor
    handle: WaveHandle
    local: tuple | None = None
    rows_P: torch.Tensor | None = None
    once: OnceRows | None = None


def rows_of(x_RD: torch.Tensor, row_N: torch.Tensor, local: tuple | None) -> torch.Tensor:
    """``x_RD[row_N]`` where ``Received.local`` may hold some rows elsewhere (torch ops; the GPU expert stage
    has a kernel for it)."""
    out = x_RD.index_select(0, row_N)
    if local is None or local[1].shape[0] == 0:
        return out
    row0, x_nD = local
    own = (row_N >= row0) & (row_N < row0 + x_nD.shape[0])
    mine = x_nD.index_select(0, (row_N - row0).clamp(0, x_nD.shape[0] - 1))
    return torch.where(own[:, None], mine, out)


def check_sum_args(out_TD: torch.Tensor, add_TD: torch.Tensor | None, dst_TD: torch.Tensor | None) -> None:
    """Raise a ValueError naming the argument where ``add_TD`` / ``dst_TD`` cannot end ``out_TD``'s sum."""
    for name, t in (("add_TD", add_TD), ("dst_TD", dst_TD)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.shape != out_TD.shape or not t.is_floating_point():
            raise ValueError(f"combine: {name} {tuple(getattr(t, 'shape', ()))} {getattr(t, 'dtype', type(t))}: "
                             f"must be a floating tensor shaped like out_TD {tuple(out_TD.shape)}")
        if t.device != out_TD.device:
            raise ValueError(f"combine: {name} is on {t.device}: must be on out_TD's device {out_TD.device}")
    same = dst_TD is not None and out_TD.numel() and dst_TD.data_ptr() == out_TD.data_ptr()
    if same and dst_TD.dtype != out_TD.dtype:
        raise ValueError("combine: dst_TD shares out_TD's memory with another dtype: pass dst_TD=None to sum into "
                         "out_TD, or a separate tensor")


def refuse_once(layout: DispatchLayout, backend: str) -> None:
    """ValueError for a backend that sends a row per (token, peer, wave) when the plan asks for once per layer."""
    if layout.plan.once:
        raise ValueError(f"WaveConfig.sends='once' (a row once per layer, its sum home after its last wave) is "
                         f"implemented by the symm backend; backend {backend!r} sends a row per wave: use "
                         f"backend='symm' (it runs on CPU too, emulated over gloo) or sends='wave'")


def pending_after(name: str, works, comm_stream, device: torch.device, then: Callable[[], R_]) -> Pending[R_]:
    """The one way a backend finishes a started exchange: ``wait()`` makes ``comm_stream`` wait for the process
    group's ``works`` (gloo/NCCL async handles; the host waits on gloo), then the current stream wait for
    ``comm_stream``, then returns ``then()``. Buffers allocated on the comm stream are freed after this, so the
    allocator hands them out again only to work ordered after the collectives that read or wrote them."""
    from . import streams as st

    def finish() -> R_:
        with st.on(comm_stream):
            for wk in works:
                wk.wait()
        st.wait_stream(st.current_stream(device), comm_stream)
        return then()

    return Pending(finish, name)


@runtime_checkable
class CommBackend(Protocol):
    name: str

    def prepare(self, layout: DispatchLayout, header=None) -> ExchangePlan:
        """The count exchange. ``header``: a ``comm.header.CallHeader`` checked across ranks before any row moves
        where the count exchange reaches the host anyway (torch; symm over its CPU emulation); the others accept
        and ignore it (``comm.header`` says why)."""
        ...

    def dispatch(self, x_TD: torch.Tensor, plan: ExchangePlan, wave: int, *,
                 local_view: bool = False, combine_width: int | None = None) -> Pending[Received]: ...

    def combine(self, y_RD: torch.Tensor, handle: WaveHandle, out: CombineOut) -> Pending[None]: ...

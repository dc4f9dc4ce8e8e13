"""The ``symm`` backend's buffers: every allocation, collective ones first of all.

Legend: P ranks, W waves, C capacity rows per (wave, peer), D hidden, Dx the width of dispatched rows (D, or
fewer where the rows travel packed, e.g. as FP8 + scales), M = 2K metadata int32 per row, X count words per rank.

Every rank owns, in CUDA symmetric memory (``torch.distributed._symmetric_memory``):

    recv_x   [W, P(src), C, Dx]  rows that peer ``src`` sent us in wave w
    comb     [W, P(dst), C, D]   results that peer ``dst`` sent back for the rows we sent it
    recv_meta[W, P(src), C, M]   their (local expert, weight) slots, in an allocation of its own shared by every
                                 dtype and width of x, so that prepare can write this rank's own dense block
    ctrl     [P(src), X]         the count exchange, followed by its flag row [P] (the count barrier)
    flags    [2W, P(src)]        after recv_x and comb: one flag row per exchange channel (dispatch wave w is
                                 channel w, its combine W + w), for ``symm_signal.BarrierSignal``

``PeerHeap`` allocates them collectively (every rank, in the same order) and refuses to during CUDA-graph
capture: the first prepare, dispatch and combine of a shape run eagerly. ``LocalHeap`` makes the same buffers
in local memory for the emulated transport (CPU, or one rank), plus the staging it sends from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .symm_kernels import RowTargets

__all__ = ["Buffers", "PeerHeap", "LocalHeap"]


@dataclass
class Buffers:
    """One rank's data buffers for one (dtype, Dx, D, W, K), with what the transport needs to reach them.

    Attributes:
        recv_x, recv_meta, comb: see the module docstring.
        peers: [P] of (recv_x, recv_meta, comb) views of rank p's buffers (peer memory), else None.
        hdl: the symmetric-memory handle of recv_x / comb, else None.
        flags: peer memory: [P] of rank p's flag rows [2W, P] int64 (see the module docstring), else None.
        targets: per wave, RowTargets of block (w, me) of every rank's (recv_x, recv_meta, comb) (peer memory,
            Triton), or of every block of the staging (x, meta, None) (emulated, Triton); else None.
        stage: emulated transport: (x [W, P, C, Dx], meta [W, P, C, M]) packed locally, then exchanged.
        pack: peer memory, copy mode with Triton: per wave (stage_x [P, C, Dx], stage_m [P, C, M], targets x,
            targets meta): the peers' rows packed locally, this rank's own straight into place.
        once_targets: rows crossing once per layer, Triton: the comb blocks the combine writes
            (``symm_once.home_targets``).
    """

    recv_x: torch.Tensor
    recv_meta: torch.Tensor
    comb: torch.Tensor
    peers: list | None = None
    hdl: object | None = None
    targets: list | None = None
    stage: tuple | None = None
    pack: list | None = None
    flags: list | None = None
    once_targets: RowTargets | None = None


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class PeerHeap:
    """Symmetric-memory allocations of one backend (see the module docstring). Every method that allocates is
    collective: all ranks call it in the same order, before any capture."""

    def __init__(self, ep, capacity: int, timeout_ms: int, kernels: bool):
        self.ep, self.capacity, self.timeout_ms, self.kernels = ep, capacity, timeout_ms, kernels
        self.nbytes = 0           # symmetric memory allocated so far (this rank)
        self._ctrl: dict = {}
        self._meta: dict = {}
        self._data: dict = {}

    def alloc(self, nbytes: int):
        """(buffer, handle): ``nbytes`` of zeroed symmetric memory on every rank."""
        import torch.distributed._symmetric_memory as symm_mem

        if _capturing():
            raise RuntimeError("symm backend: run one prepare, dispatch and combine of this shape eagerly before "
                               "capturing a CUDA graph (its buffers are allocated on first use, by every rank)")
        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.ep.device)
        hdl = symm_mem.rendezvous(buf, self.ep.pg.group_name)
        buf.zero_()
        self.nbytes += nbytes
        return buf, hdl

    def ctrl(self, X: int):
        """(local [P, X] int64, the peers' rows for me (a RowTargets with kernels, else [P] views), handle,
        [P] every rank's count-barrier flag row [P] int64)."""
        if X not in self._ctrl:
            P, me = self.ep.size, self.ep.rank
            _, hdl = self.alloc(P * (X + 1) * 8)
            views = [hdl.get_buffer(p, [P, X], torch.int64, 0) for p in range(P)]
            flags = [hdl.get_buffer(p, [P], torch.int64, P * X) for p in range(P)]
            hdl.barrier(channel=0, timeout_ms=self.timeout_ms)  # all zeroed before anyone writes
            dst = RowTargets.of(v[me:me + 1] for v in views) if self.kernels else views
            self._ctrl[X] = (views[me], dst, hdl, flags)
        return self._ctrl[X]

    def meta(self, W: int, K: int):
        """(recv_meta [W, P, C, M] int32, [P] every rank's recv_meta, the handle)."""
        key = (W, K)
        if key not in self._meta:
            P, C, M = self.ep.size, self.capacity, 2 * K
            _, hdl = self.alloc(W * P * C * M * 4)
            peers = [hdl.get_buffer(p, [W, P, C, M], torch.int32, 0) for p in range(P)]
            hdl.barrier(channel=0, timeout_ms=self.timeout_ms)
            # the handle is kept: the peers' mappings live as long as it does (its views alone do not hold them)
            self._meta[key] = (peers[self.ep.rank], peers, hdl)
        return self._meta[key]

    def buffers(self, dtype: torch.dtype, D: int, W: int, K: int, Dx: int | None = None) -> Buffers:
        """The buffers for combined rows of D and dispatched rows of ``Dx`` (default D) elements of ``dtype``."""
        Dx = D if Dx is None else Dx
        key = (dtype, Dx, D, W, K)
        if key in self._data:
            return self._data[key]
        import torch.distributed._symmetric_memory as symm_mem

        P, C, me = self.ep.size, self.capacity, self.ep.rank
        pad_slots = symm_mem.get_signal_pad_size() // 4 if hasattr(symm_mem, "get_signal_pad_size") else 512
        if 2 * W * P > pad_slots:
            raise ValueError(f"num_waves={W}: the symm backend needs 2*W*P={2 * W * P} signal slots, the signal pad "
                             f"has {pad_slots}; use fewer waves or call symm_mem.set_signal_pad_size first")
        _, meta_peers, _ = self.meta(W, K)
        shape_x, shape_c = [W, P, C, Dx], [W, P, C, D]
        nx, nc = W * P * C * Dx, W * P * C * D
        data_words = -(-(nx + nc) * torch.empty((), dtype=dtype).element_size() // 8)   # the flags start 8-aligned
        _, hdl = self.alloc((data_words + 2 * W * P) * 8)
        peers = [(hdl.get_buffer(p, shape_x, dtype, 0), meta_peers[p], hdl.get_buffer(p, shape_c, dtype, nx))
                 for p in range(P)]
        flags = [hdl.get_buffer(p, [2 * W, P], torch.int64, data_words) for p in range(P)]
        hdl.barrier(channel=0, timeout_ms=self.timeout_ms)
        mine = peers[me]
        bufs = Buffers(mine[0], mine[1], mine[2], peers=peers, hdl=hdl, flags=flags)
        if self.kernels:   # block (w, me) of every rank's buffers, as pointer tables (built here, not in a capture)
            bufs.targets = [tuple(RowTargets.of(pb[j][w, me] for pb in peers) for j in range(3)) for w in range(W)]
        self._data[key] = bufs
        return bufs

    def pack_targets(self, bufs: Buffers, wave: int):
        """Copy mode with Triton: (stage x, stage meta, RowTargets x, RowTargets meta) that pack every peer's rows
        into a local staging and this rank's own rows straight into its ``recv_x`` / ``recv_meta`` block (built on
        first use, which must come before any capture: it copies the pointer table from the host)."""
        if bufs.pack is None:
            if _capturing():
                raise RuntimeError("symm copy mode: run one dispatch eagerly before capturing a CUDA graph "
                                   "(its staging buffers and pointer tables are built on first use)")
            W, P, C, D = bufs.recv_x.shape
            me = self.ep.rank
            sx = torch.empty((P, C, D), dtype=bufs.recv_x.dtype, device=bufs.recv_x.device)
            sm = torch.empty((P, C, bufs.recv_meta.shape[3]), dtype=torch.int32, device=bufs.recv_x.device)
            bufs.pack = [(sx, sm) + tuple(RowTargets.of(own[w, me] if p == me else stage[p] for p in range(P))
                                          for own, stage in ((bufs.recv_x, sx), (bufs.recv_meta, sm)))
                         for w in range(W)]
        return bufs.pack[wave]


class LocalHeap:
    """The same buffers in local memory, for the emulated transport (see the module docstring)."""

    def __init__(self, ep, capacity: int, kernels: bool):
        self.ep, self.capacity, self.kernels = ep, capacity, kernels
        self._meta: dict = {}
        self._data: dict = {}

    @property
    def nbytes(self) -> int:
        """What the same buffers take (the receive, combine and metadata blocks; staging not counted)."""
        data = sum(b.recv_x.nbytes + b.comb.nbytes for b in self._data.values())
        return data + sum(m[0].nbytes for m in self._meta.values())

    def meta(self, W: int, K: int):
        key = (W, K)
        if key not in self._meta:
            shape = [W, self.ep.size, self.capacity, 2 * K]
            self._meta[key] = (torch.zeros(shape, dtype=torch.int32, device=self.ep.device), None, None)
        return self._meta[key]

    def buffers(self, dtype: torch.dtype, D: int, W: int, K: int, Dx: int | None = None) -> Buffers:
        """As ``PeerHeap.buffers``."""
        Dx = D if Dx is None else Dx
        key = (dtype, Dx, D, W, K)
        if key in self._data:
            return self._data[key]
        P, C, dev = self.ep.size, self.capacity, self.ep.device
        shape_x, shape_m = [W, P, C, Dx], [W, P, C, 2 * K]
        bufs = Buffers(torch.zeros(shape_x, dtype=dtype, device=dev), self.meta(W, K)[0],
                       torch.zeros([W, P, C, D], dtype=dtype, device=dev))
        # rows are packed into a local stage, then exchanged with one all_to_all_single (one rank: in place)
        bufs.stage = ((bufs.recv_x, bufs.recv_meta) if P == 1 else
                      (torch.zeros(shape_x, dtype=dtype, device=dev), torch.zeros(shape_m, dtype=torch.int32, device=dev)))
        if self.kernels:
            bufs.targets = [(RowTargets.of(bufs.stage[0][w]), RowTargets.of(bufs.stage[1][w]), None)
                            for w in range(W)]
        self._data[key] = bufs
        return bufs

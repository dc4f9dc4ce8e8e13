"""EPGroup: who the expert-parallel peers are, on which device, over which process group.

The library never calls ``init_process_group``: a host application hands its group in through
``EPGroup.from_process_group(pg)``; ``moe_wave.comm.bootstrap`` creates one for the CLI and tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["EPGroup"]


@dataclass(frozen=True)
class EPGroup:
    """An expert-parallel group.

    Attributes:
        rank: this process's rank inside the group (0..size-1).
        size: number of ranks P; rank r owns the global experts [r*E/P, (r+1)*E/P).
        device: the device this rank computes on (``cuda:i`` on a GPU host, ``cpu`` with gloo).
        backend: the torch.distributed backend of ``pg`` (``nccl``, ``gloo``, ...), ``none`` for single.
        pg: the process group, or None for a single process.
    """

    rank: int
    size: int
    device: torch.device
    backend: str
    pg: object | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"EPGroup.size={self.size}: must be >= 1")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"EPGroup.rank={self.rank}: must be in [0, size={self.size})")
        if self.size > 1 and self.pg is None:
            raise ValueError(f"EPGroup.size={self.size} needs a process group (pg=None)")

    @classmethod
    def single(cls, device: torch.device | str | None = None) -> "EPGroup":
        """One process, no communication (the reference path)."""
        return cls(0, 1, torch.device(device or "cpu"), "none", None)

    @classmethod
    def from_process_group(cls, pg=None, device: torch.device | str | None = None) -> "EPGroup":
        """Wrap an initialised process group (default: the world group).

        ``device`` defaults to ``cuda:<current>`` when the group's backend is NCCL/RCCL, else ``cpu``.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("EPGroup.from_process_group: torch.distributed is not initialised; "
                               "call init_process_group first (or use moe_wave.comm.bootstrap.init_from_env)")
        pg = pg if pg is not None else dist.group.WORLD
        backend = str(dist.get_backend(pg)).lower()
        if device is None:
            if "nccl" in backend and torch.cuda.is_available():
                device = torch.device("cuda", torch.cuda.current_device())
            else:
                device = torch.device("cpu")
        return cls(dist.get_rank(pg), dist.get_world_size(pg), torch.device(device), backend, pg)

    # ------------------------------------------------------------------ cross-rank helpers (host)
    # Every rank of the group must call these together; a single process returns its own value.

    def gather_objects(self, value) -> list:
        """``value`` from every rank, in rank order (pickled; host sync)."""
        if self.size == 1:
            return [value]
        vals = [None] * self.size
        dist.all_gather_object(vals, value, group=self.pg)
        return vals

    def check_same(self, what: str, value) -> list:
        """Gather ``value`` from every rank; raise the same ValueError on every rank, naming ``what`` and each
        rank's value, if they differ. A dict is compared key by key, and the message names the keys that
        differ."""
        vals = self.gather_objects(value)
        if all(v == vals[0] for v in vals):
            return vals
        if all(isinstance(v, dict) for v in vals):
            keys = [k for k in vals[0] if any(v.get(k) != vals[0][k] for v in vals)]
            desc = "; ".join(f"{k}: " + ", ".join(f"rank {r} {v.get(k)!r}" for r, v in enumerate(vals)) for k in keys)
        else:
            desc = ", ".join(f"rank {r}: {v}" for r, v in enumerate(vals))
        raise ValueError(f"{what} differs between ranks ({desc}): every rank must use the same value")

    def max_over(self, values: list[float]) -> list[float]:
        """The element-wise maximum over ranks of a list of numbers (float64; host sync)."""
        if self.size == 1:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)
        return t.tolist()

    def broadcast_object(self, obj, src: int = 0):
        """Rank ``src``'s ``obj`` on every rank (pickled; host sync)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.pg, src), group=self.pg)
        return box[0]

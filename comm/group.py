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

    @property
    def is_single(self) -> bool:
        return self.size == 1

    def global_rank(self, group_rank: int) -> int:
        """The world rank of ``group_rank`` (what point-to-point calls need)."""
        if self.pg is None:
            return group_rank
        return dist.get_global_rank(self.pg, group_rank)

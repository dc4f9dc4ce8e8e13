"""Two projections of one input as one GEMM: their weights stacked without a second copy."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["stacked_rows"]


def stacked_rows(cached: torch.Tensor | None, owners: list) -> torch.Tensor:
    """The tensors ``getattr(module, name)`` for (module, name) in ``owners`` stacked on dim 0, as one tensor whose
    row slices they are. ``cached``, where they still are its slices, in order (no copy); else they are stacked
    anew and each owner's attribute becomes a view of its rows (a parameter's ``.data``, a buffer itself): one copy
    of the weights, and a write into either is a write into the stack. A move (``.to``) or a new tensor assigned
    gives them their own storage again, and the next call stacks again. For two projections of one input as one
    GEMM (``FUSE_QKV_A``, ``compressor.FUSE_KV_GATE``)."""
    ts = [getattr(m, n) for m, n in owners]
    if cached is not None:
        row = 0
        for t in ts:
            if t.device != cached.device or t.dtype != cached.dtype or t.shape[1:] != cached.shape[1:] or \
                    t.data_ptr() != cached.data_ptr() + row * cached.stride(0) * cached.element_size():
                break
            row += t.shape[0]
        else:
            if row == cached.shape[0]:
                return cached
    w = torch.cat([t.detach() for t in ts])
    row = 0
    for (m, n), t in zip(owners, ts):
        part = w[row:row + t.shape[0]]
        if isinstance(t, nn.Parameter):
            t.data = part
        else:
            setattr(m, n, part)
        row += t.shape[0]
    return w

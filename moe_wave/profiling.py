"""Named ranges for timelines: torch.profiler ``record_function`` while a profiler runs, NVTX
ranges when ``MOE_WAVE_NVTX=1`` (for Nsight). Both cost a flag check when off."""

from __future__ import annotations

import contextlib
import os

import torch

__all__ = ["annotate", "nvtx_enabled"]

_NULL = contextlib.nullcontext()


def nvtx_enabled() -> bool:
    return os.environ.get("MOE_WAVE_NVTX", "0") == "1" and torch.cuda.is_available()


@contextlib.contextmanager
def _both(name: str, prof: bool, nvtx: bool):
    if nvtx:
        torch.cuda.nvtx.range_push(name)
    try:
        if prof:
            with torch.profiler.record_function(name):
                yield
        else:
            yield
    finally:
        if nvtx:
            torch.cuda.nvtx.range_pop()


def annotate(name: str):
    """``with annotate("wave0.dispatch"): ...`` names the enclosed host range and its kernels."""
    prof = torch.autograd.profiler._is_profiler_enabled
    nvtx = nvtx_enabled()
    if not prof and not nvtx:
        return _NULL
    return _both(name, prof, nvtx)

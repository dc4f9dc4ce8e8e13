"""Named ranges for timelines: torch.profiler ``record_function`` while a profiler runs, NVTX
ranges once ``set_nvtx(True)`` (for Nsight; the CLI sets it from ``MOE_WAVE_NVTX``). Both cost a flag
check when off."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["annotate", "nvtx_enabled", "set_nvtx"]

_NULL = contextlib.nullcontext()
_NVTX = False


def set_nvtx(on: bool) -> None:
    """Emit NVTX ranges from ``annotate`` in this process (they need a CUDA build; ignored without one)."""
    global _NVTX
    if not isinstance(on, bool):
        raise ValueError(f"set_nvtx(on={on!r}): must be True or False")
    _NVTX = on and torch.cuda.is_available()


def nvtx_enabled() -> bool:
    return _NVTX


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

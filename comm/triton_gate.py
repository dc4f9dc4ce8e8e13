"""The one Triton import guard of moe-wave: ``triton`` / ``tl`` (None without Triton), ``triton_ok``, and the
SM count that kernels size their grids by (``sm_count``).

Triton is optional: every kernel has a torch twin that runs where Triton does not. On CPU the kernels run only
under Triton's interpreter (``TRITON_INTERPRET=1``, read by Triton when a kernel is defined) and only when a
caller asks for them (``want=True``): the tests do, to check each kernel against its twin.
"""

from __future__ import annotations

import functools

import torch

from . import environ

try:  # optional: without Triton the torch ops run
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = None

__all__ = ["triton", "tl", "triton_ok", "interpreting", "sm_count"]


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs, "runtime"):
        return bool(knobs.runtime.interpret)
    return environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device | str) -> int:
    """Streaming multiprocessors of a CUDA device (the current one when it has no index); cached."""
    device = torch.device(device)
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def triton_ok(device: torch.device | str, want: bool | None = None) -> bool:
    """Whether Triton kernels run on ``device``: ``want`` None (auto) means on a GPU with Triton; True also on
    CPU under the interpreter; False never."""
    if triton is None or want is False:
        return False
    if torch.device(device).type == "cpu":
        return bool(want) and interpreting()
    return True

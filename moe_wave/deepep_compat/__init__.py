"""DeepEP V1's Python API (``deep_ep``) on moe-wave's engine, within one node.

    from moe_wave.deepep_compat import Buffer, Config, EventOverlap, topk_idx_t

or, for code that does ``import deep_ep``, one of these switches:

    PYTHONPATH=$(python -m moe_wave deep-ep-path):$PYTHONPATH python app.py      # a shim package named deep_ep
    import moe_wave.deepep_compat; moe_wave.deepep_compat.install()              # in-process, before `import deep_ep`

Neither shadows a real DeepEP by accident: ``install()`` refuses when one is importable unless ``force=True``,
and the path switch is an explicit choice on the command line (``deep-ep-path`` names the DeepEP it would hide).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
from pathlib import Path

from .buffer import Buffer
from .config import Config, topk_idx_t
from .config import CompatOptions
from .utils import EventHandle, EventOverlap

__all__ = ["Buffer", "CompatOptions", "Config", "EventHandle", "EventOverlap", "topk_idx_t", "install", "shim_path",
           "real_deep_ep"]


def shim_path() -> Path:
    """The folder holding the ``deep_ep`` shim package: prepend it to ``PYTHONPATH`` (or ``sys.path``)."""
    return Path(__file__).resolve().parent / "shim"


def real_deep_ep() -> str | None:
    """Where an installed DeepEP (a ``deep_ep`` that is not this shim) would be imported from, or None."""
    shim = str(shim_path())
    for entry in sys.path:
        if Path(entry or ".").resolve() == Path(shim):
            continue
        spec = importlib.machinery.PathFinder.find_spec("deep_ep", [entry or "."])
        if spec is not None and spec.origin is not None:
            return spec.origin
    return None


def install(force: bool = False) -> None:
    """Make ``import deep_ep`` (and ``deep_ep.utils``, ``deep_ep.buffer``) give this module in this process: the
    shim's folder goes first on ``sys.path`` and a ``deep_ep`` already imported is forgotten (nothing is imported
    here: the shim imports this package, never the other way round).

    Raises:
        RuntimeError: a real DeepEP is importable (or already imported) and ``force`` is False.
    """
    loaded = sys.modules.get("deep_ep")
    if loaded is not None and not getattr(loaded, "MOE_WAVE", False) and not force:
        raise RuntimeError(f"deep_ep is already imported from {getattr(loaded, '__file__', '?')}: "
                           f"moe_wave.deepep_compat.install(force=True) replaces it")
    real = real_deep_ep()
    if real is not None and not force:
        raise RuntimeError(f"a real DeepEP is installed ({real}): install(force=True) would hide it; "
                           f"import moe_wave.deepep_compat directly to use both")
    path = str(shim_path())
    if path not in sys.path:
        sys.path.insert(0, path)
    for name in [m for m in sys.modules if m == "deep_ep" or m.startswith("deep_ep.")]:
        del sys.modules[name]
    importlib.invalidate_caches()       # the next ``import deep_ep`` finds the shim, first on the path

"""``deep_ep``: moe-wave's implementation of DeepEP V1's Python API (``moe_wave.deepep_compat``), within one node.

This folder is on ``sys.path`` only because someone chose it (``python -m moe_wave deep-ep-path`` or
``moe_wave.deepep_compat.install()``); a real DeepEP stays untouched elsewhere.
"""

from moe_wave.deepep_compat import Buffer, Config, EventOverlap, topk_idx_t  # noqa: F401
from moe_wave.deepep_compat.utils import EventHandle  # noqa: F401

from . import buffer, utils  # noqa: F401

MOE_WAVE = True     # marks this package as moe-wave's shim, not DeepEP
__all__ = ["Buffer", "Config", "EventOverlap", "EventHandle", "topk_idx_t"]

"""``deep_ep.buffer``: moe-wave's ``Buffer`` (``moe_wave.deepep_compat.buffer``)."""

from moe_wave.deepep_compat.buffer import Buffer  # noqa: F401
from moe_wave.deepep_compat.config import Config  # noqa: F401
from moe_wave.deepep_compat.utils import EventHandle, EventOverlap  # noqa: F401

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap"]

"""``deep_ep.utils``: moe-wave's event helpers (``moe_wave.deepep_compat.utils``)."""

from moe_wave.deepep_compat.utils import EventHandle, EventOverlap, check_nvlink_connections  # noqa: F401

__all__ = ["EventHandle", "EventOverlap", "check_nvlink_connections"]

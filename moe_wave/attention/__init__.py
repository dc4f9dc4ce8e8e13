"""DeepSeek-V4 attention front-end: RoPE, compressors, lightning indexer, sparse core, caches and
the multi-stream schedule (``ScheduleConfig``: overlap and the fused kernels)."""

from .attention import LAYER_TYPES, AttnConfig, V4Attention
from .cache import AttnCache
from .schedule import ScheduleConfig
from .sparse_core import CoreTuning

__all__ = ["V4Attention", "AttnConfig", "AttnCache", "ScheduleConfig", "CoreTuning", "LAYER_TYPES"]

"""DeepSeek-V4 attention front-end: RoPE, compressors, lightning indexer, sparse core, caches and
the multi-stream schedule (overlap switch: env ``MOE_WAVE_ATTN_OVERLAP=0``)."""

from .attention import LAYER_TYPES, AttnConfig, V4Attention
from .cache import AttnCache
from .schedule import OVERLAP_ENV, ScheduleConfig

__all__ = ["V4Attention", "AttnConfig", "AttnCache", "ScheduleConfig", "OVERLAP_ENV", "LAYER_TYPES"]

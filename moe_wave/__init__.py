"""moe-wave: wave-pipelined expert-parallel MoE for DeepSeek-V4."""

__version__ = "0.1.0"

from .config import MoEConfig, WaveConfig
from .moe import WaveMoE

__all__ = ["MoEConfig", "WaveConfig", "WaveMoE"]
try:  # the attention front-end lands separately
    from .attention import V4Attention  # noqa: F401
    from .layer import V4DecoderLayer  # noqa: F401
    __all__ += ["V4Attention", "V4DecoderLayer"]
except ImportError:
    pass

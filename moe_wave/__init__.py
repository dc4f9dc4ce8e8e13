"""moe-wave: wave-pipelined expert-parallel MoE for DeepSeek-V4."""

__version__ = "0.1.0"

# moe_wave.comm is the top-level folder comm/: the installed package maps it through setuptools' package-dir,
# and in a source checkout moe_wave/comm is a relative symbolic link to it, so imports and static readers
# (type checkers, go-to-definition) find it the same way.

from .attention import V4Attention
from .config import MoEConfig, WaveConfig
from .layer import V4DecoderLayer
from .moe import WaveMoE

__all__ = ["MoEConfig", "WaveConfig", "WaveMoE", "V4Attention", "V4DecoderLayer"]

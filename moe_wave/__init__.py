"""moe-wave: wave-pipelined expert-parallel MoE for DeepSeek-V4."""

__version__ = "0.1.0"

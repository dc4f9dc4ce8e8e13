"""moe-wave: wave-pipelined expert-parallel MoE for DeepSeek-V4."""

__version__ = "0.1.0"

# moe_wave.comm is the top-level folder comm/: the installed package maps it through setuptools' package-dir,
# and in a source checkout moe_wave/comm is a relative symbolic link to it, so imports and static readers
# (type checkers, go-to-definition) find it the same way.

# The public names are imported on first use (PEP 562), so that ``python -m moe_wave --help`` needs no torch.
__all__ = ["MoEConfig", "WaveConfig", "WaveMoE", "V4Attention", "V4DecoderLayer"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .attention import V4Attention
    from .config import MoEConfig, WaveConfig
    from .layer import V4DecoderLayer
    from .moe import WaveMoE

    public = {"MoEConfig": MoEConfig, "WaveConfig": WaveConfig, "WaveMoE": WaveMoE, "V4Attention": V4Attention,
              "V4DecoderLayer": V4DecoderLayer}
    globals().update(public)
    return public[name]


def __dir__():
    return sorted({*globals(), *__all__})

"""moe-wave: wave-pipelined expert-parallel MoE for DeepSeek-V4."""

__version__ = "0.1.0"


def _mount_comm() -> None:
    """In a source checkout that was not pip-installed, ``moe_wave.comm`` lives in ../comm (the
    installed package maps it there through setuptools' package-dir). Mount it the same way so
    ``python -m moe_wave`` and the GPU scripts work from a plain clone."""
    import importlib.util
    import os
    import sys

    if "moe_wave.comm" in sys.modules:
        return
    here = os.path.dirname(os.path.abspath(__file__))
    src = os.path.join(os.path.dirname(here), "comm")
    if os.path.isdir(os.path.join(here, "comm")) or not os.path.isfile(os.path.join(src, "__init__.py")):
        return
    if importlib.util.find_spec("moe_wave.comm") is not None:   # an editable install's finder has it
        return
    spec = importlib.util.spec_from_file_location("moe_wave.comm", os.path.join(src, "__init__.py"),
                                                  submodule_search_locations=[src])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["moe_wave.comm"] = mod
    spec.loader.exec_module(mod)
    setattr(sys.modules[__name__], "comm", mod)


_mount_comm()

from .attention import V4Attention  # noqa: E402
from .config import MoEConfig, WaveConfig  # noqa: E402
from .layer import V4DecoderLayer  # noqa: E402
from .moe import WaveMoE  # noqa: E402

__all__ = ["MoEConfig", "WaveConfig", "WaveMoE", "V4Attention", "V4DecoderLayer"]

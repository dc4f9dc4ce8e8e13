"""moe_wave.comm: the communication side of moe-wave (shipped from the top-level folder ``comm/``).

Always import it as ``from moe_wave.comm import ...``: a top-level ``comm`` would clash with the
``comm`` package that Jupyter installs.
"""

from .bootstrap import LaunchInfo, RankFailure, detect_launcher, init_from_env, spawn
from .group import EPGroup

__all__ = ["EPGroup", "LaunchInfo", "RankFailure", "detect_launcher", "init_from_env", "spawn"]

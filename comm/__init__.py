"""moe_wave.comm: the communication side of moe-wave (shipped from the top-level folder ``comm/``).

Always import it as ``from moe_wave.comm import ...``: a top-level ``comm`` would clash with the
``comm`` package that Jupyter installs.
"""

from .bootstrap import MULTICAST_OFF, LaunchInfo, RankFailure, detect_launcher, init_from_env, set_safe_env, spawn
from .group import EPGroup

set_safe_env()   # NVLink multicast off in every process that imports moe_wave.comm, before any group exists

__all__ = ["MULTICAST_OFF", "EPGroup", "LaunchInfo", "RankFailure", "detect_launcher", "init_from_env", "spawn"]

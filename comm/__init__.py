"""moe_wave.comm: the communication side of moe-wave (shipped from the top-level folder ``comm/``).

Always import it as ``from moe_wave.comm import ...``: a top-level ``comm`` would clash with the
``comm`` package that Jupyter installs.
"""

import os

# NVLink multicast off, before any process group or symmetric-memory allocation exists: it can take a shared
# host down. Every Python entry point imports moe_wave.comm; the shell launchers set the same in launch/env.sh.
# These win over the environment: moe-wave never uses multicast.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(MULTICAST_OFF)

from .bootstrap import LaunchInfo, RankFailure, detect_launcher, init_from_env, spawn
from .group import EPGroup

__all__ = ["MULTICAST_OFF", "EPGroup", "LaunchInfo", "RankFailure", "detect_launcher", "init_from_env", "spawn"]

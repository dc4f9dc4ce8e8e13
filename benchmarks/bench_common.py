"""What the launch scripts share: the torchrun NCCL group, the git commit a result names, where results go.

Importing ``moe_wave.comm`` (as every script here does, directly or through ``moe_wave``) turns NVLink
multicast off before any process group exists (``moe_wave.comm.MULTICAST_OFF``).
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:     # a plain checkout runs without an install
    sys.path.insert(0, str(REPO))

from moe_wave.comm import EPGroup  # noqa: E402
from moe_wave.env import read_env  # noqa: E402
from moe_wave.tools.sweep_report import git_sha as _git_sha  # noqa: E402

__all__ = ["init_ep", "git_sha", "out_dir", "out_path", "report", "now"]


def init_ep() -> EPGroup:
    """This torchrun rank's GPU (LOCAL_RANK) and an NCCL group over all ranks."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return EPGroup.from_process_group()


def git_sha() -> str:
    """MOE_WAVE_GIT_SHA when set (a copied tree, whose .git may be missing or stale), else HEAD of the
    checkout, else "unknown"."""
    return _git_sha(read_env().git_sha)


def out_dir() -> str | None:
    """The folder whose files the GPU host's runner brings back ($OUT), or None."""
    return os.environ.get("OUT") or None


def out_path(name: str, fallback: str | None = None) -> str | None:
    """``$OUT/<name>`` when OUT is set, else ``fallback`` (an argparse default)."""
    return os.path.join(out_dir(), name) if out_dir() else fallback


def report(text: str, name: str) -> None:
    """Print ``text`` and, when OUT is set, write it to ``$OUT/<name>`` as well (the profile scripts' tables)."""
    print(text)
    path = out_path(name)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


def now() -> str:
    """The UTC time of day, for the meta block of a result file."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")

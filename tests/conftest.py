"""Shared fixtures. ``ranks(n)`` gives a pool of n gloo ranks, spawned once per test module."""

from __future__ import annotations

import os

import pytest

# On a host without a GPU, Triton's kernels can only run in its interpreter, which Triton chooses when a
# kernel is defined (at import): turn it on before any kernel module is imported, so that the kernel tests
# run in-process (the library runs a kernel on CPU only where a caller asks for it: ``triton_ok(want=True)``,
# ``SymmOptions(kernels="triton")``, ``ScheduleConfig(kernels="on")``). Spawned ranks inherit it.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

from tests.ranks import RankPool


@pytest.fixture(scope="module")
def ranks():
    """A callable ``ranks(n) -> RankPool``: one pool per size, reused within the module, closed at its end."""
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    """``gpu`` / ``multigpu`` tests skip (with the reason) where the GPUs are missing."""
    gpus = _gpu_count()
    for item in items:
        if item.get_closest_marker("gpu") and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA/ROCm GPU (run launch/gpu_all.sh on a GPU host)"))
        elif item.get_closest_marker("multigpu") and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs two or more GPUs, {gpus} visible"))

"""Shared fixtures. ``ranks(n)`` gives a pool of n gloo ranks, spawned once per test module."""

from __future__ import annotations

import pytest

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

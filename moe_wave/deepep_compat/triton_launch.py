"""Relaunching a compiled Triton kernel without ``JITFunction.run``'s per-call binding and cache-key work (most of
a launch's host time, which DeepEP's tests count): the first launch of each specialization goes through the JIT
(which compiles), the next ones through ``CompiledKernel[grid](*args)``. Both deep_ep front-door kernel sets use it.
"""

from __future__ import annotations

import torch

from moe_wave.comm.triton_gate import interpreting

__all__ = ["Launcher", "spec"]


def spec(a):
    """What Triton specializes a runtime argument on: a tensor's dtype and 16-byte alignment; an int's value 1,
    divisibility by 16 and width."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() & 15 == 0
    if isinstance(a, int) and not isinstance(a, bool):
        return a == 1, a & 15 == 0, -0x80000000 <= a < 0x80000000
    return a


class Launcher:
    """One Triton kernel's launches (see the module docstring).

    Args:
        fn: the ``triton.jit`` function; its constexpr parameters follow its runtime ones.

    ``key`` (optional, per call) must name everything the JIT specializes on that can change between calls with
    the same constants; without it every runtime argument's ``spec`` is the key. ``fast=False`` (per call, from the
    Buffer's ``fast_launch`` option) sends the launch through the JIT.
    """

    def __init__(self, fn):
        self.fn = fn
        self._runners: dict = {}

    def __call__(self, grid: int, args: tuple, consts: dict, opts: dict, key: tuple | None = None,
                 fast: bool = True) -> None:
        if not fast or interpreting():
            self.fn[(grid,)](*args, **consts, **opts)
            return
        if key is None:
            dev = args[0].device if isinstance(args[0], torch.Tensor) else None
            key = (grid, dev, tuple(spec(a) for a in args), tuple(consts.values()), tuple(opts.items()))
        hit = self._runners.get(key)
        if hit is not None:
            hit[0](*args, *hit[1])
            return
        kernel = self.fn[(grid,)](*args, **consts, **opts)
        if kernel is not None and hasattr(kernel, "__getitem__"):
            names = self.fn.arg_names[len(args):]
            self._runners[key] = (kernel[(grid, 1, 1)], tuple(consts[n] for n in names))

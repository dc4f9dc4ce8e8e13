"""``launch/cublaslt.py`` (``launch/probe_cublaslt.py``'s cuBLASLt binding): its structs have the sizes of cuBLAS
13's ``cublasLt.h`` (ctypes passes them by pointer: a wrong layout would read past them), and a plan with a shape the
block scales cannot take is refused with the fields named, before any library call. On CPU."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "launch"))
lt = pytest.importorskip("cublaslt")


def test_struct_sizes_are_the_headers():
    assert ctypes.sizeof(lt.Algo) == 64                 # cublasLtMatmulAlgo_t: uint64_t data[8]
    # cublasLtMatmulHeuristicResult_t: algo, size_t workspaceSize, cublasStatus_t state, float wavesCount,
    # int reserved[4]
    assert ctypes.sizeof(lt.Heuristic) == 64 + 8 + 4 + 4 + 16
    assert lt.Heuristic.workspace.offset == 64 and lt.Heuristic.waves.offset == 76


@pytest.mark.parametrize("N, K, dtype, match", [
    (1024, 1000, torch.bfloat16, r"K=1000, N=1024 must be multiples of 128"),
    (1000, 1024, torch.bfloat16, r"K=1024, N=1000 must be multiples of 128"),
    (1024, 1024, torch.float16, r"out_dtype torch.float16 must be")])
def test_plan_refuses_shapes_the_scales_cannot_take(N, K, dtype, match):
    with pytest.raises(ValueError, match=match):
        lt.Plan(64, N, K, out_dtype=dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the library loads where CUDA is")
def test_without_cuda_the_plan_says_why():
    assert not lt.available()
    with pytest.raises(RuntimeError, match="could not be loaded"):
        lt.Plan(64, 128, 128)

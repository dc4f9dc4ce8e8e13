"""The experts' first-GEMM CUDA kernel's build (``gate_up_cuda``), on any machine: its source ships with the
package, the shared memory the launch asks for is the kernel's, its variants (rows in the layout, rows read where
they arrived; CTAs alone or in pairs) compile with NVRTC to sm_90a cubins (skipped with the reason where NVRTC is
absent), and the on-disk cache hands a compiled variant back without compiling it again."""

from __future__ import annotations

import os
import re

import pytest

from moe_wave import gate_up_cuda
from tests.test_core_cuda_build import ROOT, _nvrtc


def test_source_is_package_data_and_matches_the_launch():
    """pyproject ships moe_wave/csrc/*.cu; the kernel's stage count and shared-memory layout are the launch's."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert re.search(r'^"moe_wave"\s*=\s*\[[^\]]*"csrc/\*\.cu"', f.read(), re.M)
    src = gate_up_cuda.SOURCE
    assert '#include "sparse_core_device.cuh"' in src and "extern \"C\" __global__" in src
    stages = int(re.search(r"#define STAGES (\d+)", src).group(1))
    assert stages == gate_up_cuda.STAGES
    # OFF_BAR + 2 * STAGES mbarriers of 8 bytes: the bytes the launch asks for
    assert gate_up_cuda.SMEM_BYTES == stages * (32768 + 16384 + 512) + 1024 + 16 * stages <= 227 * 1024
    assert 'extern "C" __global__ void __launch_bounds__(384, 1) gate_up_sm90(' in src


@pytest.mark.parametrize("src,cluster", [(False, 2), (True, 2), (True, 1)])
def test_variants_compile_and_are_cached_on_disk(src, cluster, tmp_path, monkeypatch):
    _nvrtc()
    monkeypatch.setattr(gate_up_cuda, "CACHE_DIR", str(tmp_path))
    data = gate_up_cuda._cubin(src, cluster)
    assert data[:4] == b"\x7fELF"
    assert len(list(tmp_path.rglob("*.cubin"))) == 1
    monkeypatch.setattr(gate_up_cuda, "compile_cubin", lambda *a, **k: pytest.fail("compiled again"))
    assert gate_up_cuda._cubin(src, cluster) == data

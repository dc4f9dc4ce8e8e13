"""The CUDA C++ sparse core's build (``sparse_core.cuda_build``), on any machine: its source files ship with the
package, a ``Variant`` renders its defines and names its cubin, every variant compiles with NVRTC (PyPI's
``nvidia-cuda-nvrtc`` wheel: the test extra lists it; skipped with the reason where NVRTC is absent), and the
on-disk cache hands a compiled variant back without compiling it again."""

from __future__ import annotations

import os
import re

import pytest

from moe_wave.attention.sparse_core import cuda_build
from moe_wave.attention.sparse_core.cuda_build import Variant

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _nvrtc():
    try:
        return cuda_build.nvrtc_library()
    except (RuntimeError, OSError) as e:
        pytest.skip(f"needs NVRTC (pip install nvidia-cuda-nvrtc, the test extra's): {e}")


def test_sources_are_package_data_read_at_import():
    """The .cu and its header are read at import (the hash covers both) and pyproject ships csrc/ as package data."""
    assert set(cuda_build.SOURCES) == {"sparse_core.cu", "sparse_core_device.cuh"}
    assert '#include "sparse_core_device.cuh"' in cuda_build.SOURCES["sparse_core.cu"]
    assert re.fullmatch(r"[0-9a-f]{16}", cuda_build.SOURCE_HASH)
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        toml = f.read()
    assert re.search(r'"moe_wave\.attention\.sparse_core"\s*=\s*\[[^\]]*"csrc/\*\.cuh"[^\]]*"csrc/\*\.cu"', toml)


def test_variant_renders_its_defines_and_key():
    assert Variant().defines() == ""
    v = Variant(qrope=True, qrf=64, orf=64, fp8=True, wring=True, tmao=True, pos_int32=True, idx_bits=64)
    assert v.defines() == ("#define QROPE 1\n#define QRF 64\n#define OROPE 1\n#define ORF 64\n#define FP8 1\n"
                           "#define WRING 1\n#define TMAO 1\n#define POS_T int\n")
    assert v.kernel_name == "sparse_core_i64" and Variant().kernel_name == "sparse_core_i32"
    every = Variant.layer_variants() + Variant.others()
    assert len({x.key for x in every}) == len(every)
    for f in ("idx_bits", "qrope", "qrf", "orf", "fp8", "wring", "tmao", "pos_int32"):    # each field's values
        assert len({getattr(x, f) for x in every}) == ({"idx_bits": 2, "qrf": 4, "orf": 5}.get(f, 2)), f
    for bad, msg in ((dict(idx_bits=16), "idx_bits"), (dict(qrf=64), "qrf"), (dict(orf=32), "orf"),
                     (dict(tmao=True), "tmao"), (dict(pos_int32=True), "pos_int32")):
        with pytest.raises(ValueError, match=msg):
            Variant(**bad)


def _compile_and_cache(variants, tmp_path, monkeypatch):
    _nvrtc()
    got = {v: cuda_build.cubin(v, str(tmp_path)) for v in variants}
    for v, data in got.items():
        assert data[:4] == b"\x7fELF", v.key
        path = cuda_build.cubin_path(v, str(tmp_path))
        assert path.startswith(os.path.join(str(tmp_path), "sparse_core", cuda_build.SOURCE_HASH))
        assert os.path.exists(path) and cuda_build.ARCH in path
    # a second look (another process: the same files) compiles nothing
    monkeypatch.setattr(cuda_build, "compile_cubin", lambda *a, **k: pytest.fail("compiled again"))
    for v, data in got.items():
        assert cuda_build.cubin(v, str(tmp_path)) == data


def test_layer_variants_compile_and_are_cached_on_disk(tmp_path, monkeypatch):
    """Every variant V4's layer uses compiles with NVRTC to an sm_90a cubin, kept on disk under the source's hash."""
    _compile_and_cache(Variant.layer_variants(), tmp_path, monkeypatch)


@pytest.mark.large
def test_every_other_variant_compiles(tmp_path, monkeypatch):
    """The variants that give every field each of its values (int64 picks, int32 positions, the other RoPE tails)."""
    _compile_and_cache(Variant.others(), tmp_path, monkeypatch)


def test_instrumented_build_compiles():
    """``dev/``'s profiling hooks build from the same source (one of them: the trace)."""
    _nvrtc()
    assert cuda_build.compile_cubin(Variant(), "#define TRACE 1\n#define PROBE 2\n")[:4] == b"\x7fELF"

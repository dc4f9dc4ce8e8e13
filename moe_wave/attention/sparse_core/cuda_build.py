"""Build the CUDA C++ sparse core: its source files, its variants, NVRTC, an on-disk cache of compiled kernels.

The kernel's source lives in ``csrc/`` (``sparse_core.cu`` and the header it includes), read once at import and
shipped as package data. A call's features (the index width, the steps around the core, the sliding window's
ring, the output's TMA stores, the positions' type) form one frozen ``Variant``: it renders the ``#define`` lines
put in front of the source and names the compiled kernel. Compiled kernels (cubins) are cached on disk under
``cache_dir/sparse_core/<source hash>-<NVRTC version>/<arch>/<variant>.cubin``, as DeepGEMM's JIT caches its
kernels, so a second process loads them and compiles nothing; the default ``cache_dir`` is ``~/.cache/moe_wave``
(``CoreTuning.kernel_cache``, which ``moe_wave.env`` fills from ``MOE_WAVE_KERNEL_CACHE``).

NVRTC is reached through ctypes: the library torch's CUDA build loads (``libnvrtc.so.<major>``), else PyPI's
``nvidia-cuda-nvrtc`` wheel (which is how the CPU tests compile every variant without a GPU). A cubin is loaded
with the driver's ``cuModuleLoadData``.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass, fields

__all__ = ["Variant", "SOURCES", "SOURCE_HASH", "ARCH", "compile_cubin", "cubin", "nvrtc_library", "nvrtc_version",
           "default_cache_dir"]

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
HEADER, MAIN = "sparse_core_device.cuh", "sparse_core.cu"


def _read(name: str) -> str:
    with open(os.path.join(CSRC, name), encoding="utf-8") as f:
        return f.read()


SOURCES = {name: _read(name) for name in (HEADER, MAIN)}
SOURCE_HASH = hashlib.sha256("".join(f"{n}\0{t}\0" for n, t in sorted(SOURCES.items())).encode()).hexdigest()[:16]
ARCH = "sm_90a"
# the options torch.cuda._compile_kernel passes NVRTC (its NVCC flags that NVRTC takes), so that the kernel compiles
# to the same code as it did through torch
OPTIONS = (f"--gpu-architecture={ARCH}", "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
           "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__")


@dataclass(frozen=True, kw_only=True)
class Variant:
    """The compile-time features of one kernel (each a ``#define`` of ``csrc/``).

    idx_bits: the picks' integer width (32 or 64). qrope: q arrives raw and gets each head's RMSNorm and RoPE of
    its last qrf channels (0, 64, 128 or 256; 0: the norm alone). orf: the output's last orf channels get the
    inverse RoPE (0: none; a multiple of 64 up to 256). fp8: the output leaves as ``act_quant``'s e4m3 and scales.
    wring: one part of exactly 128 picks (a sliding window) held as a ring. tmao: an FP8 output in contiguous rows
    leaves by TMA stores. pos_int32: the RoPE positions are int32 (else int64).
    """

    idx_bits: int = 32
    qrope: bool = False
    qrf: int = 0
    orf: int = 0
    fp8: bool = False
    wring: bool = False
    tmao: bool = False
    pos_int32: bool = False

    def __post_init__(self):
        if self.idx_bits not in (32, 64):
            raise ValueError(f"Variant.idx_bits={self.idx_bits}: must be 32 or 64")
        if self.qrf not in (0, 64, 128, 256) or (self.qrf and not self.qrope):
            raise ValueError(f"Variant.qrf={self.qrf}: must be 0, 64, 128 or 256, and 0 without qrope")
        if self.orf % 64 or not 0 <= self.orf <= 256:
            raise ValueError(f"Variant.orf={self.orf}: must be a multiple of 64 up to 256")
        if self.tmao and not self.fp8:
            raise ValueError("Variant.tmao: the TMA stores are the FP8 output's")
        if self.pos_int32 and not (self.qrope or self.orf):
            raise ValueError("Variant.pos_int32: positions only come with qrope or orf")

    @property
    def kernel_name(self) -> str:
        return f"sparse_core_i{self.idx_bits}"

    @property
    def key(self) -> str:
        """A file name for the variant: every field, in order."""
        return "-".join(f"{f.name}{int(getattr(self, f.name))}" for f in fields(self))

    def defines(self) -> str:
        """The ``#define`` lines the variant puts in front of the source (the source's defaults: 0 / int64)."""
        lines = []
        if self.qrope:
            lines += ["QROPE 1", f"QRF {self.qrf}"]
        if self.orf:
            lines += ["OROPE 1", f"ORF {self.orf}"]
        if self.fp8:
            lines.append("FP8 1")
        if self.wring:
            lines.append("WRING 1")
        if self.tmao:
            lines.append("TMAO 1")
        if self.pos_int32:
            lines.append("POS_T int")
        return "".join(f"#define {d}\n" for d in lines)

    @classmethod
    def layer_variants(cls) -> list["Variant"]:
        """The variants V4's layer compiles: int32 picks, int64 positions, RoPE tails of 64 channels; a plain core
        or the layer's steps (q's norm and RoPE in, the output's inverse RoPE out, bf16 or FP8 by TMA stores);
        a window's ring or not."""
        out = []
        for wring in (False, True):
            out.append(cls(wring=wring))
            out.append(cls(wring=wring, qrope=True, qrf=64, orf=64))
            out.append(cls(wring=wring, qrope=True, qrf=64, orf=64, fp8=True, tmao=True))
        return out

    @classmethod
    def others(cls) -> list["Variant"]:
        """Variants that, with ``layer_variants``, give every field each of its values at least once."""
        return [cls(idx_bits=64), cls(qrope=True), cls(qrope=True, qrf=128, pos_int32=True),
                cls(qrope=True, qrf=256, orf=256, fp8=True), cls(orf=128, fp8=True, tmao=True, wring=True),
                cls(orf=192, idx_bits=64)]


@functools.lru_cache(maxsize=None)
def nvrtc_library() -> ctypes.CDLL:
    """NVRTC: the one torch's CUDA build uses, else the ``nvidia-cuda-nvrtc`` wheel's, else the system's."""
    import torch
    names = [f"libnvrtc.so.{torch.version.cuda.split('.')[0]}"] if torch.version.cuda else []
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec is not None else None) or []:
        for lib in sorted(glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so.*")), reverse=True):
            for builtins in glob.glob(os.path.join(os.path.dirname(lib), "libnvrtc-builtins.so*")):
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(lib)
    try:
        return ctypes.CDLL("libnvrtc.so")
    except OSError as e:
        raise RuntimeError("NVRTC not found: install a CUDA build of torch or `pip install nvidia-cuda-nvrtc`") from e


def nvrtc_version(lib: ctypes.CDLL | None = None) -> str:
    lib = lib or nvrtc_library()
    major, minor = ctypes.c_int(0), ctypes.c_int(0)
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def compile_cubin(variant: Variant, extra_defines: str = "", lib: ctypes.CDLL | None = None) -> bytes:
    """The variant compiled by NVRTC to a cubin for ``ARCH``; ``extra_defines`` (more ``#define`` lines, in front)
    is for the instrumented builds of ``dev/`` (``TRACE``, ``PROBE``, ...), never the library's. RuntimeError with
    NVRTC's log where it fails."""
    lib = lib or nvrtc_library()
    src = (extra_defines + variant.defines() + SOURCES[MAIN]).encode()
    prog = ctypes.c_void_p()
    headers = (ctypes.c_char_p * 1)(SOURCES[HEADER].encode())
    names = (ctypes.c_char_p * 1)(HEADER.encode())
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src, MAIN.encode(), 1, headers, names)
    if rc:
        raise RuntimeError(f"sparse core: nvrtcCreateProgram returned {rc}")
    try:
        opts = [o.encode() for o in OPTIONS]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        if rc:
            n = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
            log = ctypes.create_string_buffer(n.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"sparse core {variant.key}: NVRTC failed ({rc}):\n"
                               f"{log.value.decode(errors='replace')}")
        n = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetCUBIN(prog, buf)
        return buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "moe_wave")


def cubin_path(variant: Variant, cache_dir: str | None = None, lib: ctypes.CDLL | None = None) -> str:
    """Where ``cubin`` keeps the variant: keyed by the source's hash, NVRTC's version, the arch and the variant."""
    return os.path.join(cache_dir or default_cache_dir(), "sparse_core", f"{SOURCE_HASH}-nvrtc{nvrtc_version(lib)}",
                        ARCH, f"{variant.key}.cubin")


def cubin(variant: Variant, cache_dir: str | None = None) -> bytes:
    """The variant's cubin from the disk cache, compiled and written there (atomically) when absent."""
    return cached(cubin_path(variant, cache_dir), lambda: compile_cubin(variant))


def cached(path: str, make) -> bytes:
    """The bytes at ``path``, else ``make()``'s, written there atomically (kept where the folder is read-only)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        pass
    data = make()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:                     # a read-only cache: the kernel still runs, compiled by this process
        pass
    return data

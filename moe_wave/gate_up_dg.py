"""The routed experts' first grouped FP8 GEMM with SwiGLU + requant in its epilogue on DeepGEMM's own Hopper kernel
(``csrc/gate_up_dg.cu``: DeepGEMM's SM90 1D2D FP8 GEMM with its pipeline, scheduler and promotion as they are, a
block being the pair of gate and up tiles of the same 128 channels, both multiplied by each k-block of the rows as it
arrives, and an epilogue that writes e4m3 h and its per-(row, 128 channels) scales instead of bf16 gu). With
``CLUSTER`` = 2 (where I / 128 is even) two CTAs of a cluster run m-blocks m and m + 1 of one expert at the same
channels (DeepGEMM's scheduler's pairs for its multicast on B), and CTA r loads weight tile r (gate, up) for both by
TMA multicast. With ``src_J`` (its ``-DGU_SRC=1`` build, the contiguous layout) it reads rows that arrived as FP8
where they are, one TMA box a row and k-block through the ordering's src_J, instead of rows copied into the layout.

It returns what DeepGEMM's ``m_grouped_fp8_gemm_nt_contiguous`` (psum layout) or ``_masked`` followed by
``fp8_expert_kernels.swiglu_quant`` return, bit for bit (the same promoted sums, rounded to bf16 as the GEMM writes
them, then the same SwiGLU and quantisation instructions), without writing or reading gu. It needs what DeepGEMM's
own JIT needs: a Hopper GPU, ``deep_gemm`` (its include directory holds the kernel's headers and CUTLASS') and nvcc
(``torch.utils.cpp_extension.CUDA_HOME``). It compiles once per (experts, channels, layout, SMs) and is kept on disk
(``CACHE_DIR``); ``available(device_index, e, I, D, masked)`` says whether it runs here (a warning names the cause
once where it does not build or load); ``gate_up_dg`` launches it on the current stream (CUDA graph capturable: the
counts stay on the device).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
import warnings

import torch

from .attention.sparse_core.cuda_build import cached, default_cache_dir
from .attention.sparse_core.cuda_impl import load_function, tmap_2d
from .fp8 import BLOCK, FP8

__all__ = ["available", "gate_up_dg", "compile_cubin", "smem_bytes", "STAGES", "THREADS", "SOURCE"]

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
MAIN = "gate_up_dg.cu"
with open(os.path.join(_CSRC, MAIN), encoding="utf-8") as _f:
    SOURCE = _f.read()
STAGES = 4                  # pipeline stages (128 rows, 128 gate and 128 up weight rows of 128 channels, the rows'
                            # scales)
THREADS = 384               # a TMA warpgroup and two math warpgroups
# CTAs a cluster: 1 none; 2 the weight tiles multicast to a pair of CTAs (in the stage on an H100 faster than none at
# 15 of 18 points; 0.965 x the configuration before gate_up_dg on average, none 1.001: benchmarks/results/experts.md);
# 1 wherever I / 128 is odd
CLUSTER = 2
NAME = b"gate_up_dg_kernel"
# the compiled kernels' folder on disk (None: ~/.cache/moe_wave)
CACHE_DIR: str | None = None
# DeepGEMM's nvcc flags (its JIT's), for sm_90a
NVCC_FLAGS = ("-std=c++20", "--diag-suppress=39,161,174,177,186,940", "--ptxas-options=--register-usage-level=10",
              "--gpu-architecture=sm_90a", "-O3", "--expt-relaxed-constexpr", "--expt-extended-lambda",
              "--compiler-options=-fPIC,-O3,-fconcepts,-Wno-deprecated-declarations,-Wno-abi")


def smem_bytes(D: int, stages: int = STAGES) -> int:
    """The kernel's dynamic shared memory (its SMEM_SIZE): h's staging tile, the stages, the weight scales, the
    barriers."""
    sfb = -(-(2 * (D // BLOCK) * 4) // 8) * 8
    return 128 * 128 + stages * (3 * 128 * 128 + 128 * 4) + sfb + 2 * stages * 8


def _include_dir() -> str:
    """deep_gemm's include directory (its kernels' headers, CUTLASS' and cute's beside them)."""
    import deep_gemm

    inc = os.path.join(os.path.dirname(os.path.abspath(deep_gemm.__file__)), "include")
    for need in ("deep_gemm/scheduler/gemm.cuh", "cute/arch/copy_sm90_tma.hpp", "cutlass/arch/barrier.h"):
        if not os.path.exists(os.path.join(inc, need)):
            raise RuntimeError(f"gate_up_dg: deep_gemm's include directory {inc} has no {need}")
    return inc


def _nvcc() -> str:
    from torch.utils.cpp_extension import CUDA_HOME

    path = os.path.join(CUDA_HOME or "", "bin", "nvcc")
    if not CUDA_HOME or not os.path.exists(path):
        raise RuntimeError(f"gate_up_dg: no nvcc (CUDA_HOME={CUDA_HOME!r}); DeepGEMM's JIT needs it too")
    return path


def _defines(e: int, I: int, D: int, masked: bool, sms: int, stages: int, cluster: int, src: bool) -> list[str]:
    return [f"-DGU_GROUPS={e}", f"-DGU_I={I}", f"-DGU_K={D}", f"-DGU_MASKED={int(masked)}", f"-DGU_SMS={sms}",
            f"-DGU_STAGES={stages}", f"-DGU_CLUSTER={cluster}", f"-DGU_SRC={int(src)}"]


def compile_cubin(e: int, I: int, D: int, masked: bool, sms: int, stages: int = STAGES, cluster: int = 1,
                  src: bool = False) -> bytes:
    """The kernel for e experts, I channels of h, D of the rows, the layout, ``sms`` CTAs in clusters of
    ``cluster``, the rows in the layout or (``src``) where they arrived, compiled by nvcc."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "gate_up_dg.cubin")
        cmd = [_nvcc(), os.path.join(_CSRC, MAIN), "-cubin", "-o", out, f"-I{_include_dir()}", *NVCC_FLAGS,
               *_defines(e, I, D, masked, sms, stages, cluster, src)]
        run = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"gate_up_dg: nvcc failed ({run.returncode}): {(run.stdout + run.stderr)[-3000:]}")
        with open(out, "rb") as f:
            return f.read()


def _cubin(e: int, I: int, D: int, masked: bool, sms: int, cluster: int, src: bool) -> bytes:
    import deep_gemm

    key = hashlib.sha256((SOURCE + _include_dir() + str(getattr(deep_gemm, "__version__", "")) + _nvcc()
                          + " ".join(NVCC_FLAGS)).encode()).hexdigest()[:16]
    path = os.path.join(CACHE_DIR or default_cache_dir(), "gate_up_dg", key,
                        f"e{e}-i{I}-d{D}-m{int(masked)}-sm{sms}-s{STAGES}-c{cluster}-r{int(src)}.cubin")
    return cached(path, lambda: compile_cubin(e, I, D, masked, sms, cluster=cluster, src=src))


class _LaunchAttr(ctypes.Structure):        # CUlaunchAttribute: an id, padding, a 64-byte value
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("dims", ctypes.c_uint * 3),
                ("rest", ctypes.c_char * 52)]


class _LaunchConfig(ctypes.Structure):      # CUlaunchConfig
    _fields_ = ([(n, ctypes.c_uint) for n in ("gx", "gy", "gz", "bx", "by", "bz", "smem")]
                + [("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)), ("n_attrs", ctypes.c_uint)])


def _config(ctas: int, cluster: int, smem: int, stream) -> tuple:
    """(CUlaunchConfig of ``ctas`` CTAs in clusters of ``cluster``, the attribute it points to: keep both)."""
    attr = _LaunchAttr(id=4)                # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.dims[0], attr.dims[1], attr.dims[2] = cluster, 1, 1
    cfg = _LaunchConfig(gx=ctas, gy=1, gz=1, bx=THREADS, by=1, bz=1, smem=smem, stream=stream,
                        attrs=ctypes.pointer(attr), n_attrs=1)
    return cfg, attr


def cluster_size(I: int) -> int:
    """The cluster the kernel runs in for I channels of h: ``CLUSTER`` where the n-blocks pair up, else 1."""
    return CLUSTER if (I // BLOCK) % CLUSTER == 0 else 1


@functools.lru_cache(maxsize=None)
def _function(device_index: int, e: int, I: int, D: int, masked: bool, cluster: int, src: bool = False):
    """(CUfunction, CTAs) of the kernel on the device: one CTA an SM; in clusters of two, as many pairs as the
    GPU holds at once (its GPCs may leave an SM out)."""
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    ctas = sms - sms % cluster
    func = load_function(device_index, _cubin(e, I, D, masked, ctas, cluster, src), NAME, smem_bytes(D))
    if cluster == 1:
        return func, ctas
    lib = torch.cuda._utils._get_gpu_runtime_library()
    n = ctypes.c_int(0)
    cfg, _attr = _config(ctas, cluster, smem_bytes(D), None)
    with torch.cuda.device(device_index):
        code = lib.cuOccupancyMaxActiveClusters(ctypes.byref(n), func, ctypes.byref(cfg))
    if code or n.value < 1:
        raise RuntimeError(f"gate_up_dg: cuOccupancyMaxActiveClusters returned CUresult {code} ({n.value} "
                           f"clusters of {cluster})")
    if n.value * cluster < ctas:                    # the scheduler's CTA count is compiled in
        ctas = n.value * cluster
        func = load_function(device_index, _cubin(e, I, D, masked, ctas, cluster, src), NAME, smem_bytes(D))
    return func, ctas


def rule(device: torch.device, I: int, D: int) -> str | None:
    """None where the kernel can run here for I channels of h and D of the rows, else the rule it fails."""
    if device.type != "cuda" or torch.version.hip is not None:
        return f"needs a CUDA GPU, got {device}"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return f"needs a Hopper GPU (sm_90), got sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    if I % BLOCK or D % BLOCK:
        return f"I={I} and D={D} must be multiples of {BLOCK}"
    return None


@functools.lru_cache(maxsize=None)
def available(device_index: int, e: int, I: int, D: int, masked: bool = False, src: bool = False) -> bool:
    """Whether the kernel of this shape (``src``: reading the rows where they arrived) builds and loads on the
    CUDA device (``rule``, deep_gemm's headers, nvcc, the driver); where it does not build or load, a warning says
    why (the stage then runs DeepGEMM's GEMM or the Triton kernel)."""
    dev = torch.device("cuda", device_index)
    if rule(dev, I, D) is not None or (masked and src):
        return False
    try:
        _function(device_index, e, I, D, masked, cluster_size(I), src)
    except (RuntimeError, OSError, ImportError) as err:
        warnings.warn(f"moe_wave: gate_up_dg (e={e}, I={I}, D={D}, masked={masked}, src={src}) does not run here "
                      f"({type(err).__name__}: {str(err)[:2000]}); the first expert GEMM runs without it",
                      stacklevel=3)
        return False
    return True


def _tmap(ptr: int, dtype: int, inner: int, outer: int, stride: int, box_inner: int, box_outer: int,
          swizzle: int):
    """``cuda_impl.tmap_2d`` with DeepGEMM's L2 promotion (256 bytes); RuntimeError where the driver refuses it."""
    got = tmap_2d(ptr, inner, outer, stride, box_inner, box_outer, dtype, swizzle, l2_promotion=3)
    if got is None:
        raise RuntimeError(f"gate_up_dg: the driver made no tensor map ({inner} x {outer}, stride {stride}, box "
                           f"{box_inner} x {box_outer})")
    return got


_WEIGHT_MAPS: dict = {}


def _weight_map(w: torch.Tensor):
    """The tensor map of the weights [e, 2I, D] e4m3 (one per weight tensor, kept)."""
    key = (w.data_ptr(), tuple(w.shape), w.device.index)
    got = _WEIGHT_MAPS.get(key)
    if got is None:
        e, I2, D = w.shape
        got = _WEIGHT_MAPS[key] = _tmap(w.data_ptr(), 0, D, e * I2, w.stride(1), BLOCK, BLOCK, 3)
    return got


def _check_src(q: torch.Tensor, s: torch.Tensor, D: int, name: str) -> None:
    if (q.dtype != FP8 or q.dim() != 2 or q.shape[1] != D or q.stride(1) != 1 or (q.stride(0) % 16)
            or q.data_ptr() % 16 or tuple(s.shape) != (q.shape[0], D // BLOCK) or s.dtype != torch.float32
            or s.stride(1) != 1):
        raise ValueError(f"gate_up_dg: {name} {tuple(q.shape)} {q.dtype} stride {q.stride()}, scales "
                         f"{tuple(s.shape)} {s.dtype} stride {s.stride()}: with src_J they must be e4m3 [rows, {D}] "
                         f"(unit channel stride, rows 16-byte aligned: fp8_rows.unpack_rows' views) and fp32 "
                         f"[rows, {D // BLOCK}] with unit stride")


def gate_up_dg(q: torch.Tensor, s: torch.Tensor, w_eND: torch.Tensor, ws: torch.Tensor, layout: torch.Tensor,
               limit: float, group_rows: int | None = None, src_J: torch.Tensor | None = None,
               local: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(hq [JA, I] e4m3, hs) of the rows q [JA, D] e4m3 laid out expert-major: the contiguous psum layout (layout
    = the groups' int32 ends, DeepGEMM's ``use_psum_layout``; s [D/128, JA], hs [I/128, JA]) or, with
    ``group_rows`` = G, the masked one (expert x at rows x * G; layout = the int32 counts; s [JA/G, D/128, G], hs
    [JA/G, I/128, G]). w_eND [e, 2I, D] e4m3 (gate rows, then up), ws [e, 2I/128, D/128] fp32. Rows of a block
    past its group's end get values (as DeepGEMM's GEMM writes them there) that nothing reads.

    ``src_J`` (int64 [JA], ``expert_order``'s with the contiguous layout's starts): the rows are read where they
    arrived, row j of the layout being row src_J[j] of q [R, D] e4m3 with its scales s [R, D/128] fp32
    (``fp8_rows.unpack_rows``' views of the received packed rows; no copy into the layout); ``local`` = (row0, q_L,
    s_L): rows row0 .. row0 + L - 1 from those views instead (``Received.local``, unpacked). An index outside the
    rows (a position no pair fills) reads row 0."""
    e, I2, D = w_eND.shape
    I = I2 // 2
    JA = q.shape[0] if src_J is None else src_J.shape[0]
    G = group_rows
    why = rule(q.device, I, D)
    if why is not None:
        raise ValueError(f"gate_up_dg: {why}")
    if src_J is not None:
        if G is not None:
            raise ValueError("gate_up_dg: src_J (the rows where they arrived) takes the contiguous layout, not "
                             f"group_rows={G}")
        if src_J.dtype != torch.int64 or src_J.dim() != 1 or not src_J.is_contiguous():
            raise ValueError(f"gate_up_dg: src_J {tuple(src_J.shape)} {src_J.dtype}: must be a contiguous int64 [JA]")
        _check_src(q, s, D, "rows")
        if local is not None:
            _check_src(local[1], local[2], D, "local rows")
    want_s = (D // BLOCK, JA) if G is None else (JA // G, D // BLOCK, G)
    if src_J is None and (q.dtype != FP8 or q.shape[1] != D or not q.is_contiguous() or tuple(s.shape) != want_s
                          or not s.is_contiguous()):
        raise ValueError(f"gate_up_dg: rows {tuple(q.shape)} {q.dtype}, scales {tuple(s.shape)}: must be contiguous "
                         f"e4m3 [JA, {D}] and scales {want_s}")
    if (JA % 128 or not w_eND.is_contiguous() or tuple(ws.shape) != (e, I2 // BLOCK, D // BLOCK)
            or not ws.is_contiguous() or layout.dtype != torch.int32 or layout.numel() != e
            or not layout.is_contiguous() or (G is not None and (G % 128 or JA != e * G))):
        raise ValueError(f"gate_up_dg: rows {tuple(q.shape)} {q.dtype}, scales {tuple(s.shape)}, weights "
                         f"{tuple(w_eND.shape)}, weight scales {tuple(ws.shape)}, layout {tuple(layout.shape)} "
                         f"{layout.dtype}, group_rows {G}: must be contiguous e4m3 [JA, D] with JA a multiple of "
                         f"128, scales {want_s}, [e, 2I, D] and [e, 2I/128, D/128], a contiguous int32 [e] (masked: "
                         f"JA = e * G, G a multiple of 128)")
    hq = torch.empty(JA, I, dtype=FP8, device=q.device)
    hs = torch.empty((I // BLOCK, JA) if G is None else (JA // G, I // BLOCK, G), dtype=torch.float32,
                     device=q.device)
    if not (JA and I and e):
        return hq, hs
    cluster = cluster_size(I)
    src = src_J is not None
    func, ctas = _function(q.device.index, e, I, D, G is not None, cluster, src)
    M = JA if G is None else G                          # the rows of a group's index space
    h_map = _tmap(hq.data_ptr(), 0, I, JA, I, BLOCK, 128, 3)
    if src:                                             # one row's 128 channels a box
        R = q.shape[0]
        a_map = _tmap(q.data_ptr(), 0, D, max(R, 1), q.stride(0), BLOCK, 1, 3)
        has_local = local is not None and local[1].shape[0] > 0
        row0, lq, ls = local if has_local else (0, q, s)
        la_map = _tmap(lq.data_ptr(), 0, D, max(lq.shape[0], 1), lq.stride(0), BLOCK, 1, 3) if has_local else a_map
        sa_map = h_map                                  # (unused)
        rows = [src_J.data_ptr(), s.data_ptr(), s.stride(0), R, ls.data_ptr(), ls.stride(0), row0,
                lq.shape[0] if has_local else 0]
    else:
        a_map = la_map = _tmap(q.data_ptr(), 0, D, JA, D, BLOCK, 128, 3)
        sa_map = _tmap(s.data_ptr(), 7, M, s.numel() // M, M * 4, 128, 1, 0)
        rows = [0, 0, 0, 0, 0, 0, 0, 0]
    args = [ctypes.c_void_p(ws.data_ptr()), ctypes.c_void_p(layout.data_ptr()), ctypes.c_uint32(M),
            ctypes.c_void_p(hs.data_ptr()), ctypes.c_uint32(M), ctypes.c_float(float(limit)),
            ctypes.c_void_p(rows[0]), ctypes.c_void_p(rows[1]), ctypes.c_uint64(rows[2]), ctypes.c_uint32(rows[3]),
            ctypes.c_void_p(rows[4]), ctypes.c_uint64(rows[5]), ctypes.c_uint32(rows[6]), ctypes.c_uint32(rows[7])]
    maps = (a_map[1], _weight_map(w_eND)[1], sa_map[1], h_map[1], la_map[1])
    params = (ctypes.c_void_p * (len(args) + len(maps)))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p)
                                                          for a in args], *[ctypes.c_void_p(x) for x in maps])
    lib = torch.cuda._utils._get_gpu_runtime_library()
    stream = torch.cuda.current_stream()._as_parameter_
    if cluster == 1:
        rc = lib.cuLaunchKernel(func, ctas, 1, 1, THREADS, 1, 1, smem_bytes(D), stream, params, None)
    else:
        cfg, _attr = _config(ctas, cluster, smem_bytes(D), stream)
        rc = lib.cuLaunchKernelEx(ctypes.byref(cfg), func, params, None)
    del a_map, la_map, sa_map, h_map                    # the maps were copied into the launch
    if rc:
        raise RuntimeError(f"gate_up_dg: the launch returned CUresult {rc}")
    return hq, hs

"""The routed experts' first grouped FP8 GEMM with SwiGLU + requant in its epilogue, as a CUDA C++ kernel for Hopper
(``csrc/gate_up_sm90.cu``, compiled by NVRTC at run time, cached on disk as the sparse core's kernels are).

It computes ``fp8_expert_kernels.gate_up_swiglu``'s output (hq [JA, I] e4m3, hs [I/128, JA] fp32) from the same
inputs, where the GEMM is compute-bound (hundreds of pairs an expert), at the rate of DeepGEMM's grouped GEMM
rather than a Triton tile's:

- one CTA an SM, persistent over the tiles (128 rows x 128 of h's channels, the channel tile fastest), three
  warpgroups: a loader (the rows and their scales by cp.async, gathered through the ordering's ``src_J`` from
  where they arrived when they are FP8 already; the expert's gate and up weight blocks by TMA) and two math
  warpgroups (64 rows each, against the gate block and then the up block: m64n128k32 wgmmas), a 4-stage pipeline
  of mbarriers between them;
- CTAs in pairs (a cluster of ``CLUSTER``): a pair takes two row blocks of the same channels, and where both are
  one expert's rows each CTA loads one of the two weight blocks into both by TMA multicast, so the weights cross
  from L2 once for the two (DeepGEMM multicasts one operand the same way);
- each 128-channel step of D promoted by the row's and the weight block's scales in fp32 (DeepGEMM's 1d2d
  promotion), gu rounded to bf16 as the GEMM writes it, SwiGLU with V4's clamps and the per-(row, 128 channels)
  requant in registers: gu is never written, ``swiglu_quant`` and (for FP8 rows) ``gather_pairs`` do not run.

``available(device)`` says whether it runs (an sm_90 GPU, NVRTC, the driver's tensor maps); ``gate_up_sm90``
launches it on the current stream (CUDA-graph capturable: every count stays on the device).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os

import torch

from .attention.sparse_core import cuda_build
from .attention.sparse_core.cuda_impl import load_function, tmap_2d
from .fp8 import BLOCK, FP8

__all__ = ["available", "gate_up_sm90", "compile_cubin", "SOURCE", "STAGES", "THREADS", "SMEM_BYTES", "BM", "CLUSTER"]

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
MAIN = "gate_up_sm90.cu"
with open(os.path.join(_CSRC, MAIN), encoding="utf-8") as _f:
    SOURCE = _f.read()
STAGES = 4
THREADS = 384
BM = 128
# CTAs a cluster: 2 share each weight block by TMA multicast where both of a pair's row blocks are one expert's
CLUSTER = 2
# the kernel's shared memory: STAGES x (32 KB weights + 16 KB rows + 512 B scales) + the rows' address table (1 KB)
# + the stages' two mbarriers
SMEM_BYTES = STAGES * (32768 + 16384 + 512) + 1024 + 16 * STAGES
# the compiled kernels' folder on disk (None: cuda_build.default_cache_dir(), ~/.cache/moe_wave)
CACHE_DIR: str | None = None
_HASH = hashlib.sha256((SOURCE + cuda_build.SOURCES[cuda_build.HEADER]).encode()).hexdigest()[:16]


class _Args(ctypes.Structure):
    _fields_ = ([("a", ctypes.c_void_p), ("a_row", ctypes.c_longlong), ("sa", ctypes.c_void_p)]
                + [(n, ctypes.c_longlong) for n in ("sa_r", "sa_k")]
                + [("src", ctypes.c_void_p), ("la", ctypes.c_void_p), ("la_row", ctypes.c_longlong),
                   ("lsa", ctypes.c_void_p), ("lsa_row", ctypes.c_longlong)]
                + [("row0", ctypes.c_int), ("L", ctypes.c_int)]
                + [(n, ctypes.c_void_p) for n in ("ws", "starts", "bend", "n", "hq", "hs")]
                + [(n, ctypes.c_int) for n in ("E", "D", "I", "G")] + [("limit", ctypes.c_float)])


def _defines(src: bool, cluster: int) -> str:
    return f"#define STAGES {STAGES}\n#define CLUSTER {cluster}\n#define SRC {int(src)}\n"


def compile_cubin(src: bool, cluster: int = CLUSTER) -> bytes:
    """The kernel (rows gathered through src_J, or the layout's rows; ``cluster`` CTAs a cluster) compiled by NVRTC
    for sm_90a."""
    headers = {cuda_build.HEADER: cuda_build.SOURCES[cuda_build.HEADER]}
    return cuda_build.nvrtc_compile(MAIN, _defines(src, cluster) + SOURCE, headers,
                                    f"gate_up_sm90 (src={src}, cluster={cluster})")


def _cubin(src: bool, cluster: int = CLUSTER) -> bytes:
    path = os.path.join(CACHE_DIR or cuda_build.default_cache_dir(), "gate_up_sm90",
                        f"{_HASH}-nvrtc{cuda_build.nvrtc_version()}", cuda_build.ARCH,
                        f"s{STAGES}-c{cluster}-src{int(src)}.cubin")
    return cuda_build.cached(path, lambda: compile_cubin(src, cluster))


class _LaunchAttr(ctypes.Structure):        # CUlaunchAttribute: an id, padding, a 64-byte value
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("dims", ctypes.c_uint * 3),
                ("rest", ctypes.c_char * 52)]


class _LaunchConfig(ctypes.Structure):      # CUlaunchConfig
    _fields_ = ([(n, ctypes.c_uint) for n in ("gx", "gy", "gz", "bx", "by", "bz", "smem")]
                + [("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)), ("n_attrs", ctypes.c_uint)])


def _config(grid: int, cluster: int, stream) -> _LaunchConfig:
    attr = _LaunchAttr(id=4)                # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION (kept alive by the config)
    attr.dims[0], attr.dims[1], attr.dims[2] = cluster, 1, 1
    return _LaunchConfig(gx=grid, gy=1, gz=1, bx=THREADS, by=1, bz=1, smem=SMEM_BYTES, stream=stream,
                         attrs=ctypes.pointer(attr), n_attrs=1)


@functools.lru_cache(maxsize=None)
def _function(device_index: int, src: bool, cluster: int = CLUSTER):
    """(CUfunction, the CTAs a launch takes: as many clusters as the GPU holds at once)."""
    func = load_function(device_index, _cubin(src, cluster), b"gate_up_sm90", SMEM_BYTES)
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    if cluster == 1:
        return func, sms
    lib = torch.cuda._utils._get_gpu_runtime_library()
    n = ctypes.c_int(0)
    with torch.cuda.device(device_index):
        code = lib.cuOccupancyMaxActiveClusters(ctypes.byref(n), func, ctypes.byref(_config(sms, cluster, None)))
    if code or n.value < 1:
        raise RuntimeError(f"gate_up_sm90: cuOccupancyMaxActiveClusters returned CUresult {code} ({n.value})")
    return func, n.value * cluster


@functools.lru_cache(maxsize=None)
def available(device_index: int) -> bool:
    """Whether the kernel runs on this CUDA device: sm_90 (Hopper), NVRTC builds it, the driver loads it."""
    if torch.cuda.get_device_capability(device_index) != (9, 0):
        return False
    try:
        _function(device_index, False)
        _function(device_index, True)
    except (RuntimeError, OSError):
        return False
    return True


_TMAPS: dict = {}


def _weight_map(w: torch.Tensor):
    """The weights' tensor map (rows e * 2I of D bytes, 128 x 128 boxes), made once per weight buffer."""
    key = (w.data_ptr(), tuple(w.shape), w.device.index)
    got = _TMAPS.get(key)
    if got is None:
        e, I2, D = w.shape
        got = tmap_2d(w.data_ptr(), D, e * I2, w.stride(1), 128, 128)
        if got is None:
            raise RuntimeError("gate_up_sm90: the driver made no tensor map for the weights")
        _TMAPS[key] = got
    return got


def gate_up_sm90(q: torch.Tensor, s: torch.Tensor, w_eND: torch.Tensor, ws: torch.Tensor, starts_e: torch.Tensor,
                 bend: torch.Tensor, limit: float, n: torch.Tensor, src_J: torch.Tensor | None = None,
                 local: tuple | None = None, cluster: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up_swiglu``'s (hq [JA, I] e4m3, hs [I/128, JA] fp32) on this kernel (``available`` first; no
    group_rows: the aligned layout). The rows: src_J None: q [JA, D] and s [D/128, JA] (``quant_pairs`` /
    ``gather_pairs``); src_J [JA]: the layout's row j is received row src_J[j] of q [R, D] e4m3 with scales
    s [R, D/128] (``fp8_rows.unpack_rows``' views), ``local`` = (row0, q_L, s_L) as there. ``n`` [1]: the rows in
    use (``Groups.n``); ``cluster``: CTAs a cluster, 1 or 2 (default ``CLUSTER``)."""
    cluster = CLUSTER if cluster is None else cluster
    if cluster not in (1, 2):
        raise ValueError(f"gate_up_sm90: cluster={cluster}: must be 1 or 2")
    e, I2, D = w_eND.shape
    I = I2 // 2
    JA = q.shape[0] if src_J is None else src_J.shape[0]
    if (q.shape[1] != D or q.stride(1) != 1 or I % BLOCK or D % BLOCK or JA % 128 or not w_eND.is_contiguous()
            or ws.shape != (e, I2 // BLOCK, D // BLOCK) or not ws.is_contiguous()):
        raise ValueError(f"gate_up_sm90: rows {tuple(q.shape)}, weights {tuple(w_eND.shape)}, scales "
                         f"{tuple(ws.shape)}: must be [rows, D] (unit channel stride), contiguous [e, 2I, D] and "
                         f"[e, 2I/128, D/128] with I and D multiples of {BLOCK} and the layout's rows of 128")
    hq = torch.empty(JA, I, dtype=FP8, device=q.device)
    hs = torch.empty(I // BLOCK, JA, dtype=torch.float32, device=q.device)
    if not (JA and I and e):
        return hq, hs
    a = _Args(a=q.data_ptr(), a_row=q.stride(0), ws=ws.data_ptr(), starts=starts_e.data_ptr(), bend=bend.data_ptr(),
              n=n.data_ptr(), hq=hq.data_ptr(), hs=hs.data_ptr(), E=e, D=D, I=I, G=JA, limit=float(limit))
    if src_J is None:
        if s.shape != (D // BLOCK, JA):
            raise ValueError(f"gate_up_sm90: layout scales {tuple(s.shape)}: must be [{D // BLOCK}, {JA}]")
        a.sa, a.sa_r, a.sa_k = s.data_ptr(), s.stride(1), s.stride(0)
    else:
        if s.shape != (q.shape[0], D // BLOCK) or s.stride(1) != 1:
            raise ValueError(f"gate_up_sm90: row scales {tuple(s.shape)} stride {s.stride()}: must be "
                             f"[{q.shape[0]}, {D // BLOCK}] with unit stride along D/128")
        if src_J.dtype != torch.int64 or src_J.stride(0) != 1:
            raise ValueError(f"gate_up_sm90: src_J {src_J.dtype} stride {src_J.stride()}: must be int64 with unit "
                             f"stride (expert_order's)")
        a.sa, a.sa_r, a.sa_k, a.src = s.data_ptr(), s.stride(0), 1, src_J.data_ptr()
        lq, ls = (q, s) if local is None or not local[1].numel() else local[1:]
        a.la, a.la_row, a.lsa, a.lsa_row = lq.data_ptr(), lq.stride(0), ls.data_ptr(), ls.stride(0)
        a.row0, a.L = (0, 0) if local is None or not local[1].numel() else (int(local[0]), local[1].shape[0])
    func, most = _function(q.device.index, src_J is not None, cluster)
    _, addr = _weight_map(w_eND)
    units = -(-JA // (BM * cluster)) * (I // BLOCK)         # the most cluster tiles the layout can hold
    params = (ctypes.c_void_p * 2)(ctypes.cast(ctypes.byref(a), ctypes.c_void_p), ctypes.c_void_p(addr))
    lib = torch.cuda._utils._get_gpu_runtime_library()
    cfg = _config(min(most, units * cluster), cluster, torch.cuda.current_stream()._as_parameter_)
    rc = lib.cuLaunchKernelEx(ctypes.byref(cfg), func, params, None)
    if rc != 0:
        raise RuntimeError(f"gate_up_sm90: cuLaunchKernelEx returned CUresult {rc}")
    return hq, hs

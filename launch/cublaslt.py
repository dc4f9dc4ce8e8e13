"""FP8 GEMMs with 1 x 128 (activations) by 128 x 128 (weights) block scaling through cuBLASLt, the algorithm chosen.

``torch._scaled_mm`` runs the same cuBLASLt recipe with the first algorithm of cuBLASLt's heuristic. Here the
descriptors are built through ``ctypes`` (the library torch itself loaded) so that every algorithm cuBLASLt offers
for a shape (its heuristic's list, or every tile / stage / cluster configuration of its algorithm ids) can be timed
and the fastest kept. ``Plan`` describes one product y [M, N] = x [M, K] @ w [N, K]^T (a batch of them, strided, as
V4's grouped ``wo_a``), in torch's row-major terms; cuBLASLt sees the column-major transpose, y^T = w x^T:
A = w (K x N, op T, BLK128x128 scales s_w [N/128, K/128]), B = x (K x M, op N, VEC128 scales s [K/128, M]),
D = y^T (N x M).

Enum values are cuBLAS 13's ``cublasLt.h`` (nvidia-cublas 13.10); the structs' layouts are the header's. The block
scales' pointers must be set before cuBLASLt lists or checks algorithms (``Plan.scales``), and an algorithm that
``cublasLtMatmulAlgoCheck`` accepts can still compute garbage (one of wkv's did): compare outputs before keeping one.

This is ``launch/probe_cublaslt.py``'s binding, not the library's: on one H200 (session 35) none of cuBLASLt's
algorithms for the V4 projections beat the heuristic's first, which ``torch._scaled_mm`` already runs
(``benchmarks/2026-12-03-cublaslt-pool-1xh200-session35.md``).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import time

import torch

__all__ = ["available", "Plan", "config_of"]

OP_N, OP_T = 0, 1
R_32F, R_16BF, R_8F_E4M3 = 0, 14, 28               # cudaDataType_t
COMPUTE_32F = 68                                     # cublasComputeType_t
DESC_TRANSA, DESC_TRANSB = 3, 4                      # cublasLtMatmulDescAttributes_t
DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER = 17, 18
DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 31, 32
SCALE_VEC128_32F, SCALE_BLK128x128_32F = 4, 5        # cublasLtMatmulMatrixScale_t
LAYOUT_BATCH_COUNT, LAYOUT_STRIDED_BATCH_OFFSET = 5, 6
PREF_MAX_WORKSPACE_BYTES = 1
CAP_SPLITK_SUPPORT, CAP_CTA_SWIZZLING_SUPPORT, CAP_TILE_IDS = 0, 2, 6
CAP_CUSTOM_OPTION_MAX, CAP_STAGES_IDS = 7, 13
# cublasLtMatmulAlgoConfigAttributes_t: (id, ctype)
CONFIG = {"id": (0, ctypes.c_int32), "tile": (1, ctypes.c_uint32), "splitk": (2, ctypes.c_int32),
          "reduction": (3, ctypes.c_uint32), "swizzle": (4, ctypes.c_uint32), "custom": (5, ctypes.c_uint32),
          "stages": (6, ctypes.c_uint32), "inner": (7, ctypes.c_uint16), "cluster": (8, ctypes.c_uint16)}
CLUSTERS = (0, 2, 3, 5, 4, 7)      # CUBLASLT_CLUSTER_SHAPE_: AUTO, 1x1x1, 2x1x1, 1x2x1, 4x1x1, 2x2x1


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int), ("waves", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


_vp, _sz = ctypes.c_void_p, ctypes.c_size_t
_SIGS = {
    "cublasLtCreate": [ctypes.POINTER(_vp)],
    "cublasLtMatmulDescCreate": [ctypes.POINTER(_vp), ctypes.c_int, ctypes.c_int],
    "cublasLtMatmulDescDestroy": [_vp],
    "cublasLtMatmulDescSetAttribute": [_vp, ctypes.c_int, _vp, _sz],
    "cublasLtMatrixLayoutCreate": [ctypes.POINTER(_vp), ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64,
                                   ctypes.c_int64],
    "cublasLtMatrixLayoutDestroy": [_vp],
    "cublasLtMatrixLayoutSetAttribute": [_vp, ctypes.c_int, _vp, _sz],
    "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(_vp)],
    "cublasLtMatmulPreferenceDestroy": [_vp],
    "cublasLtMatmulPreferenceSetAttribute": [_vp, ctypes.c_int, _vp, _sz],
    "cublasLtMatmulAlgoGetHeuristic": [_vp, _vp, _vp, _vp, _vp, _vp, _vp, ctypes.c_int, ctypes.POINTER(Heuristic),
                                       ctypes.POINTER(ctypes.c_int)],
    "cublasLtMatmulAlgoGetIds": [_vp, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int),
                                 ctypes.POINTER(ctypes.c_int)],
    "cublasLtMatmulAlgoInit": [_vp, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_int, ctypes.POINTER(Algo)],
    "cublasLtMatmulAlgoCheck": [_vp, _vp, _vp, _vp, _vp, _vp, ctypes.POINTER(Algo), ctypes.POINTER(Heuristic)],
    "cublasLtMatmulAlgoCapGetAttribute": [ctypes.POINTER(Algo), ctypes.c_int, _vp, _sz, ctypes.POINTER(_sz)],
    "cublasLtMatmulAlgoConfigSetAttribute": [ctypes.POINTER(Algo), ctypes.c_int, _vp, _sz],
    "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(Algo), ctypes.c_int, _vp, _sz, ctypes.POINTER(_sz)],
    "cublasLtMatmul": [_vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, ctypes.POINTER(Algo), _vp, _sz,
                       _vp],
}


@functools.cache
def _lib():
    """cuBLASLt as torch loaded it (by its soname; the wheel's folder as a second try), or None."""
    names = ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]
    try:
        import nvidia  # the CUDA wheels' namespace package, where torch's cuBLAS comes from
        for root in getattr(nvidia, "__path__", []):
            for sub in ("cu13/lib", "cublas/lib"):
                names += [f"{root}/{sub}/libcublasLt.so.13", f"{root}/{sub}/libcublasLt.so.12"]
    except ImportError:
        pass
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        for fn, args in _SIGS.items():
            f = getattr(lib, fn)
            f.argtypes, f.restype = args, ctypes.c_int
        return lib
    return None


def available() -> bool:
    return torch.cuda.is_available() and _lib() is not None


def _check(status: int, what: str) -> None:
    if status:
        raise RuntimeError(f"cuBLASLt: {what} returned status {status}")


@functools.cache
def _handle(device_index: int):
    h = _vp()
    with torch.cuda.device(device_index):
        _check(_lib().cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
    return h


def _set(setter, obj, attr: int, value) -> None:
    _check(setter(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), f"{setter.__name__}({attr})")


def config_of(algo: Algo) -> dict:
    """An algorithm's configuration (cuBLASLt's enum values: tile, stages, cluster ids...)."""
    lib, out = _lib(), {}
    for name, (attr, ct) in CONFIG.items():
        v, n = ct(), _sz()
        if lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), ctypes.sizeof(v),
                                                    ctypes.byref(n)) == 0:
            out[name] = int(v.value)
    return out


class Plan:
    """y [M, N] (bf16 or fp32) = x_q [M, K] @ w_q [N, K]^T, ``batch`` of them at the given element strides.

    lda: x's row stride (a column slice of a wider activation has it above K); ldd: y's row stride; strides:
    (x, w, y) batch strides in elements. The scales of batch b are assumed packed after those of batch b - 1, as
    ``GroupedFP8``'s row slices are."""

    def __init__(self, M: int, N: int, K: int, out_dtype: torch.dtype = torch.bfloat16, lda: int | None = None,
                 ldd: int | None = None, batch: int = 1, strides: tuple[int, int, int] = (0, 0, 0),
                 device: int | None = None, scale_modes: tuple[int, int] = (SCALE_BLK128x128_32F, SCALE_VEC128_32F)):
        if K % 128 or N % 128:
            raise ValueError(f"cublaslt.Plan: K={K}, N={N} must be multiples of 128 (the weights' blocks)")
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"cublaslt.Plan: out_dtype {out_dtype} must be torch.bfloat16 or torch.float32")
        lib = _lib()
        if lib is None:
            raise RuntimeError("cuBLASLt: the library could not be loaded (torch without CUDA, or no libcublasLt)")
        self.M, self.N, self.K, self.batch = M, N, K, batch
        self.out_type = {torch.bfloat16: R_16BF, torch.float32: R_32F}[out_dtype]
        self.device = torch.cuda.current_device() if device is None else device
        self.handle = _handle(self.device)
        self.desc = _vp()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, R_32F), "MatmulDescCreate")
        for attr, v in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N), (DESC_A_SCALE_MODE, scale_modes[0]),
                        (DESC_B_SCALE_MODE, scale_modes[1])):
            _set(lib.cublasLtMatmulDescSetAttribute, self.desc, attr, ctypes.c_int32(v))
        self.layouts = []
        for typ, rows, cols, ld, stride in ((R_8F_E4M3, K, N, K, strides[1]), (R_8F_E4M3, K, M, lda or K, strides[0]),
                                            (self.out_type, N, M, ldd or N, strides[2])):
            lay = _vp()
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), typ, rows, cols, ld), "MatrixLayoutCreate")
            if batch > 1:
                _set(lib.cublasLtMatrixLayoutSetAttribute, lay, LAYOUT_BATCH_COUNT, ctypes.c_int32(batch))
                _set(lib.cublasLtMatrixLayoutSetAttribute, lay, LAYOUT_STRIDED_BATCH_OFFSET, ctypes.c_int64(stride))
            self.layouts.append(lay)
        self.a, self.b, self.d = self.layouts
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def __del__(self):
        lib = _lib()
        if lib is None:
            return
        for lay in getattr(self, "layouts", []):
            lib.cublasLtMatrixLayoutDestroy(lay)
        if getattr(self, "desc", None):
            lib.cublasLtMatmulDescDestroy(self.desc)

    def heuristics(self, count: int = 32, workspace: int = 32 << 20) -> list[Heuristic]:
        """cuBLASLt's own list for this product, best first (``torch._scaled_mm`` takes the first)."""
        lib = _lib()
        pref = _vp()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "MatmulPreferenceCreate")
        try:
            _set(lib.cublasLtMatmulPreferenceSetAttribute, pref, PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(workspace))
            res, n = (Heuristic * count)(), ctypes.c_int()
            _check(lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a, self.b, self.d, self.d, pref,
                                                      count, res, ctypes.byref(n)), "MatmulAlgoGetHeuristic")
            return [res[i] for i in range(n.value) if res[i].state == 0]
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)

    def check(self, algo: Algo) -> Heuristic | None:
        """The algorithm's workspace and waves where cuBLASLt accepts it for this product, else None."""
        r = Heuristic()
        if _lib().cublasLtMatmulAlgoCheck(self.handle, self.desc, self.a, self.b, self.d, self.d, ctypes.byref(algo),
                                          ctypes.byref(r)):
            return None
        r.algo = algo
        return r

    def configurations(self, limit: int = 2000, workspace: int = 32 << 20, seconds: float = 60.0) -> list[Heuristic]:
        """The (algorithm id, tile, stages, cluster shape, CTA swizzle, custom option) that cuBLASLt accepts for this
        product without split-K: all of them, or an even sample of ``limit`` (the search stops after ``seconds``)."""
        lib, out, t_end = _lib(), [], time.monotonic() + seconds
        ids, n = (ctypes.c_int * 256)(), ctypes.c_int()
        _check(lib.cublasLtMatmulAlgoGetIds(self.handle, COMPUTE_32F, R_32F, R_8F_E4M3, R_8F_E4M3, self.out_type,
                                            self.out_type, 256, ids, ctypes.byref(n)), "MatmulAlgoGetIds")

        def cap(algo, attr, ct, count=1):
            buf, written = (ct * count)(), _sz()
            if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, ctypes.byref(buf), ctypes.sizeof(buf),
                                                     ctypes.byref(written)):
                return []
            return list(buf[:written.value // ctypes.sizeof(ct)])

        def combos():                                   # (the algorithm id's initialised algo, its configuration)
            for i in range(n.value):
                base = Algo()
                if lib.cublasLtMatmulAlgoInit(self.handle, COMPUTE_32F, R_32F, R_8F_E4M3, R_8F_E4M3, self.out_type,
                                              self.out_type, ids[i], ctypes.byref(base)):
                    continue
                tiles = cap(base, CAP_TILE_IDS, ctypes.c_uint32, 1024) or [0]
                stages = cap(base, CAP_STAGES_IDS, ctypes.c_uint32, 256) or [0]
                swz = (0, 1) if (cap(base, CAP_CTA_SWIZZLING_SUPPORT, ctypes.c_int32) or [0])[0] else (0,)
                customs = range((cap(base, CAP_CUSTOM_OPTION_MAX, ctypes.c_int32) or [0])[0] + 1)
                for values in itertools.product(tiles, stages, CLUSTERS, swz, customs):
                    yield base, zip(("tile", "stages", "cluster", "swizzle", "custom"), values)

        for base, config in combos():
            algo = Algo.from_buffer_copy(base)
            for name, v in config:
                attr, ct = CONFIG[name]
                lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attr, ctypes.byref(ct(v)),
                                                         ctypes.sizeof(ct))
            r = self.check(algo)
            if r is not None and r.workspace <= workspace:
                out.append(r)
            if time.monotonic() > t_end:
                break
        return out[::max(1, -(-len(out) // limit))]

    def scales(self, s_KbM: torch.Tensor, s_w: torch.Tensor) -> "Plan":
        """Points the descriptor at the scales (cuBLASLt wants them set before it lists or checks algorithms)."""
        lib = _lib()
        _set(lib.cublasLtMatmulDescSetAttribute, self.desc, DESC_A_SCALE_POINTER, _vp(s_w.data_ptr()))
        _set(lib.cublasLtMatmulDescSetAttribute, self.desc, DESC_B_SCALE_POINTER, _vp(s_KbM.data_ptr()))
        return self

    def run(self, algo: Algo, x_q: torch.Tensor, s_KbM: torch.Tensor, w_q: torch.Tensor, s_w: torch.Tensor,
            out: torch.Tensor, workspace: torch.Tensor | None = None) -> torch.Tensor:
        """out = x_q @ w_q^T on the current stream with ``algo`` (tensors as the plan describes: no checks here)."""
        lib = _lib()
        self.scales(s_KbM, s_w)
        ws_ptr, ws_size = (workspace.data_ptr(), workspace.numel()) if workspace is not None else (None, 0)
        _check(lib.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self._alpha), w_q.data_ptr(), self.a,
                                  x_q.data_ptr(), self.b, ctypes.byref(self._beta), out.data_ptr(), self.d,
                                  out.data_ptr(), self.d, ctypes.byref(algo), ws_ptr, ws_size,
                                  torch.cuda.current_stream().cuda_stream), "cublasLtMatmul")
        return out

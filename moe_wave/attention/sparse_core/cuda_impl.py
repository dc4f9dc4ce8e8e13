"""The CUDA C++ implementation of the sparse core: Hopper's prefill kernel, one CTA an item and an SM.

The math is ``reference.run``'s (one query's 64 heads against 64-key tiles of its picks, the window part then the
compressed part in one online softmax, fp32 in the exp2 domain, the sink as the running max's start, -1 picks
masked). The kernel (``csrc/sparse_core.cu``) is laid out as follows:

- **One CTA holds one item** (a query's 64-head block), whole rows of d = 512: q (64 KB), a ring of two 64-key
  tiles (2 x 64 KB), two P tiles; one CTA an SM (227 KB of shared memory, 384 threads: two math warpgroups at 216
  registers, a copy warpgroup at 64). The tiles go in rounds of two: math warpgroup 0 takes the first, 1 the
  second, each QK over all of d. Each warpgroup owns one half of the output's d (a 64 x 256 fp32 accumulator): the
  two share their tiles' row maxima (the same new max on both sides) and their P (bf16, in shared memory), and each
  multiplies both P into its half of both tiles' V; a round with one tile runs only its PV. The row sums add once,
  at the end.
- **Persistent**: each CTA walks items with a stride of the CTAs resident. The copy warpgroup counts the next
  item's tiles and loads its first two tiles' picks, brings its q once the last QK is done and runs q's prologue
  while the math finishes the item (the RoPE angles' cos / sin while q lands, one a lane), then gathers the picked
  rows with ``cp.async`` into the 128-byte swizzle (a -1 pick reads nothing and is zero-filled) with their valid
  flags in shared memory as the slots free, and signals mbarriers. The math warpgroups sum q's squares (the copy
  warpgroup's chain of work sets an item's pace at sliding and HCA layers). QK and PV are ``wgmma`` from
  shared-memory descriptors, the own P from registers in the accumulator's layout, the other's from shared memory.
- **A sliding window's call** (one part of 128 picks: ``Variant.wring``): each CTA takes a contiguous run of items
  and its two slots hold the window's rows as a ring (pick j of query s at row (s - j) % 128); where an item's picks
  are the last item's (the next head block) or the last item's moved on by one (the next query), only the new row
  is copied. The next item's first QK is then issued under this item's output stores, its rows being there early;
  with the layer's steps q's RoPE tail is copied first and turned while the rest of q lands.
- **The layer's steps**: q raw (each head's RMSNorm a factor of its scores: the math warpgroups sum the squares of
  the channels before the RoPE tail in round 0 while its tile lands, the copy warpgroup those of the tail as it
  turns it in shared memory; both warpgroups add the three parts in one order: within bf16 rounding of the
  chain), the output's inverse RoPE and ``act_quant``'s FP8 with the unfused chain's bits, staged in shared memory
  (the P tiles and 16 KB after them) and stored by two TMA stores a warpgroup (``Variant.tmao``: a contiguous out,
  the tensor map from the driver's ``cuTensorMapEncodeTiled``), else in the threads' 16-byte rows.

It takes d = 512 (V4), whole 64-head blocks, one or two parts, bf16; every output element is written once in a
fixed order, so the bits repeat from run to run. ``cuda_build`` compiles it (NVRTC, sm_90a) and caches the cubins on
disk. The source keeps profiling hooks (``TRACE``, ``PROBE``, ``NOREUSE``, ``NOTMA``) that only ``dev/``'s
instrumented builds define (``dev/trace_core_cuda.py``); the library never does.
"""

from __future__ import annotations

import ctypes
import functools
import warnings

import torch

from ..kernels import use_kernels
from . import cuda_build, triton_impl
from .call import CoreCall
from .cuda_build import Variant

__all__ = ["Unavailable", "available", "rule", "supports", "run", "sparse_attention_cuda", "prepare", "launch", "kernel",
           "ctas_resident", "SMEM_BYTES", "load_function", "tmap_2d"]

NAME = "cuda"
D_FULL = 512                # head_dim the kernel takes (V4's)
BH = 64                     # heads an item (the GEMMs' M)
THREADS = 384               # two math warpgroups, a copy warpgroup
SMEM_BYTES = 65536 + 2 * 65536 + 32768 + 2576  # q, two whole-row tiles, P tiles + staging, barriers and the rest
_LOG2E = 1.4426950408889634


class Unavailable(RuntimeError):
    """The kernel does not build, load or launch here (NVRTC, the driver): raised before anything runs."""


class _Args(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_void_p) for n in ("q", "out", "sinks", "kv1", "kv2")]
                + [(n, ctypes.c_int) for n in ("S", "H", "J1", "J2", "two", "n_items")] + [("qk_scale", ctypes.c_float)]
                + [(n, ctypes.c_longlong) for n in ("s_qb", "s_qs", "s_qh", "s_ob", "s_os", "s_oh", "s_k1b", "s_k1m",
                                                    "s_i1b", "s_i1s", "s_k2b", "s_k2m", "s_i2b", "s_i2s")]
                + [("trace", ctypes.c_void_p),
                   ("qpos", ctypes.c_void_p), ("qfreq", ctypes.c_void_p), ("eps", ctypes.c_float),
                   ("opos", ctypes.c_void_p), ("ofreq", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                   ("M", ctypes.c_int)])


@functools.lru_cache(maxsize=None)
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def available() -> bool:
    """A Hopper GPU is current (CUDA, not ROCm)."""
    if not torch.cuda.is_available() or torch.version.hip is not None:
        return False
    return _hopper(torch.cuda.current_device())


def rule(q: torch.Tensor, n_parts: int, qrf: int = 0, orf: int = 0, picks: int = 0,
         max_picks: int = 2048) -> str | None:
    """None when this kernel can run a call of this shape, else the rule it fails: Hopper, bf16, d = 512, whole
    64-head blocks, one or two parts; with the layer's steps, q's RoPE tail qrf (channels) 0, 64, 128 or 256 and
    the output's orf a multiple of 64 up to 256; picks (J of both parts; 0: not asked) at most ``max_picks``."""
    if not 1 <= n_parts <= 2:
        return f"{n_parts} parts: it takes 1 or 2"
    if not q.is_cuda or q.dtype != torch.bfloat16 or q.shape[-1] != D_FULL or q.shape[-2] % BH:
        return f"it takes bf16 q [B, S, H, {D_FULL}] with H a multiple of {BH} on a GPU, got {q.dtype} " \
               f"{tuple(q.shape)} on {q.device}"
    if qrf not in (0, 64, 128, 256) or orf % 64 or not 0 <= orf <= 256:
        return f"RoPE tails of q ({qrf} channels) / the output ({orf}) must be 0, 64, 128 or 256 / a multiple of " \
               f"64 up to 256"
    if picks > max_picks:
        return f"{picks} picks a query: more than CoreTuning.cuda_max_picks={max_picks}"
    if not available():
        return "needs a Hopper GPU (sm_90)"
    return None


def supports(call: CoreCall) -> str | None:
    """The Hopper prefill calls: the rules of ``rule``, on a grid where the Triton kernel would neither split the
    keys nor run the steps inside itself, no Triton tiling asked for, the operands' alignment (``_operand_rule``)."""
    if call.impl not in ("auto", NAME):
        return f"impl={call.impl!r} was asked for"
    if not call.tuning.cuda:
        return "CoreTuning.cuda is False"
    if not use_kernels(call.q, call.kernels):
        return f"the kernels do not run on this call (kernels={call.kernels!r}, {call.q.device})"
    if call.items == 0:
        return "an empty call"
    if call.impl == "auto":
        if call.config is not None:
            return "a Triton tiling (config) was asked for"
        if triton_impl.steps_inside(call):
            return "the steps run inside the Triton kernel on this small grid (CoreTuning.fuse_max_waves)"
        B, S, H, _ = call.q.shape
        if triton_impl.splits(triton_impl.want_config(call), B, S, H, call.picks, call.q.device) != 1:
            return "the Triton kernel splits this call's keys across programs (a decode grid)"
    why = rule(call.q, len(call.parts), call.steps.qrf, call.steps.orf, call.picks, call.tuning.cuda_max_picks)
    return why or _operand_rule(call.q, call.kv1, call.kv2, call.steps)


def _operand_rule(q, kv1, kv2, steps) -> str | None:
    # 16-byte copies and stores; positions of one integer dtype
    for name, t in (("q", q), ("kv1", kv1), ("kv2", kv2)):
        if t.data_ptr() % 16 or any(st % 8 for st in t.stride()[:-1]):
            return f"{name} must be 16-byte aligned with strides that are multiples of 8 elements, got strides " \
                   f"{t.stride()} at address {t.data_ptr():#x}"
    pos = [p for p in (steps.qpos, steps.opos) if p is not None]
    if any(p.dtype not in (torch.int32, torch.int64) for p in pos) or len({p.dtype for p in pos}) > 1:
        return f"positions must be int32 / int64 of one dtype, got {[p.dtype for p in pos]}"
    return None


def run(call: CoreCall):
    """The kernel on the call; ``Unavailable`` (before anything runs) where its variant does not build, load or
    launch here: the dispatcher then takes the next implementation."""
    out, scales, result = call.outputs()
    try:
        sparse_attention_cuda(call.q, out, call.sinks, call.kv1, call.i1, call.kv2, call.i2, call.scale, call.two,
                              q_rope=call.steps.q_rope, o_rope=call.steps.o_rope, scales=scales,
                              cache_dir=call.tuning.kernel_cache)
    except RuntimeError as e:
        raise Unavailable(str(e)) from e
    return result


@functools.lru_cache(maxsize=None)
def _loaded(device_index: int, variant: Variant, cache_dir: str | None, extra_defines: str = ""):
    """(CUfunction, None) of the variant on the device, or (None, the error) where it does not build or load here
    (warned once a variant; the dispatcher then takes the next implementation)."""
    try:
        data = cuda_build.cubin(variant, cache_dir) if not extra_defines else \
            cuda_build.compile_cubin(variant, extra_defines)
        return load_function(device_index, data, variant.kernel_name.encode(), SMEM_BYTES), None
    except (RuntimeError, OSError) as e:
        warnings.warn(f"moe_wave: the CUDA C++ sparse-attention kernel {variant.key} does not run here "
                      f"({type(e).__name__}: {str(e)[:2000]}); the Triton kernel runs instead", stacklevel=4)
        return None, e


def load_function(device_index: int, cubin: bytes, name: bytes, smem: int):
    """The CUfunction ``name`` of ``cubin`` loaded on the device (its primary context) with ``smem`` bytes of dynamic
    shared memory allowed; RuntimeError naming the driver call that failed."""
    lib = torch.cuda._utils._get_gpu_runtime_library()
    with torch.cuda.device(device_index):
        torch.cuda.current_stream()                     # the device's primary context, current
        mod, func = ctypes.c_void_p(), ctypes.c_void_p()
        for what, rc in (("cuModuleLoadData", lambda: lib.cuModuleLoadData(ctypes.byref(mod), cubin)),
                         ("cuModuleGetFunction", lambda: lib.cuModuleGetFunction(ctypes.byref(func), mod, name)),
                         ("cuFuncSetAttribute", lambda: lib.cuFuncSetAttribute(func, 8, smem))):
            code = rc()
            if code:
                raise RuntimeError(f"{what} returned CUresult {code}")
    return func


def kernel(device_index: int, variant: Variant, cache_dir: str | None = None, extra_defines: str = ""):
    """The variant's CUfunction on the device (built once a process, the cubin from the disk cache); RuntimeError
    where it does not build or load. ``extra_defines``: ``dev/``'s instrumented builds (not cached on disk)."""
    func, err = _loaded(device_index, variant, cache_dir, extra_defines)
    if err is not None:
        raise RuntimeError(f"the CUDA sparse core {variant.key} does not build or load here: {err}") from err
    return func


def prepare(q, out, sinks, kv1, i1, kv2, i2, scale: float, two: bool, *, q_rope=None, o_rope=None,
            scales=None) -> tuple:
    """Check a launch's tensors (ValueError naming the rule) and make its (variant, _Args, CTAs, tensor map):
    q / out [B, S, H, 512] bf16 (out e4m3 with scales) with the last dim contiguous, kv [B, M, 512] bf16 rows
    contiguous, idx [B, S, J] int32 or int64 with the last dim contiguous, sinks [H]; q_rope = (pos [B*S], freq
    fp32 [F], eps), o_rope = (pos [B*S], freq fp32 [F]), scales fp32 [H*d/128, B*S] (the FP8 output)."""
    B, S, H, D = q.shape
    if D != D_FULL or H % BH or q.dtype != torch.bfloat16:
        raise ValueError(f"sparse_attention_cuda: q must be bf16 [B, S, H, {D_FULL}] with H a multiple of {BH}, "
                         f"got {q.dtype} {tuple(q.shape)}")
    for name, t in (("q", q), ("out", out), ("kv1", kv1), ("kv2", kv2), ("i1", i1), ("i2", i2)):
        if t.stride(-1) != 1:
            raise ValueError(f"sparse_attention_cuda: {name}'s last dim must be contiguous, strides {t.stride()}")
    for name, t in (("q", q), ("out", out), ("kv1", kv1), ("kv2", kv2)):     # 16-byte copies and stores
        if t.data_ptr() % 16 or any(st % 8 for st in t.stride()[:-1]):
            raise ValueError(f"sparse_attention_cuda: {name} must be 16-byte aligned with strides that are multiples "
                             f"of 8 elements, got strides {t.stride()} at address {t.data_ptr():#x}")
    odt = torch.float8_e4m3fn if scales is not None else torch.bfloat16
    if out.dtype != odt or out.shape != q.shape or kv1.dtype != q.dtype or kv2.dtype != q.dtype:
        raise ValueError(f"sparse_attention_cuda: out must be q's shape in {odt} (scales given: FP8) and kv bf16, got "
                         f"out {out.dtype} {tuple(out.shape)}, kv {kv1.dtype} / {kv2.dtype}")
    if scales is not None and not (scales.dtype == torch.float32 and scales.is_contiguous()
                                   and tuple(scales.shape) == (H * D // 128, B * S)):
        raise ValueError(f"sparse_attention_cuda: scales must be contiguous fp32 [{H * D // 128}, {B * S}], got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    qrf = 2 * q_rope[1].numel() if q_rope is not None else 0
    orf = 2 * o_rope[1].numel() if o_rope is not None else 0
    if qrf not in (0, 64, 128, 256) or orf % 64 or orf > 256:
        raise ValueError(f"sparse_attention_cuda: RoPE tails of q ({qrf} channels) / the output ({orf}) must be 0, 64, "
                         f"128 or 256 / a multiple of 64 up to 256")
    pos = [t[0] for t in (q_rope, o_rope) if t is not None]
    if any(p.numel() != B * S or not p.is_contiguous() or p.dtype not in (torch.int32, torch.int64) for p in pos) \
            or len({p.dtype for p in pos}) > 1:
        raise ValueError(f"sparse_attention_cuda: positions must be contiguous int32 / int64 [{B * S}] of one dtype, "
                         f"got {[(p.dtype, tuple(p.shape)) for p in pos]}")
    for name, t in (("q_rope", q_rope), ("o_rope", o_rope)):
        if t is not None and not (t[1].dtype == torch.float32 and t[1].is_contiguous()):
            raise ValueError(f"sparse_attention_cuda: {name}'s frequencies must be contiguous fp32")
    if i1.dtype != i2.dtype or i1.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sparse_attention_cuda: the picks must both be int32 or int64, got {i1.dtype} / {i2.dtype}")
    if sinks.dtype != torch.float32 or not sinks.is_contiguous():
        sinks = sinks.float().contiguous()
    J1, J2 = i1.shape[-1], (i2.shape[-1] if two else 0)
    n_items = B * S * (H // BH)
    a = _Args(q.data_ptr(), out.data_ptr(), sinks.data_ptr(), kv1.data_ptr(), kv2.data_ptr(), S, H, J1, J2, int(two),
              n_items, float(scale) * _LOG2E, q.stride(0), q.stride(1), q.stride(2), out.stride(0),
              out.stride(1), out.stride(2), kv1.stride(0), kv1.stride(1), i1.stride(0), i1.stride(1),
              kv2.stride(0), kv2.stride(1), i2.stride(0), i2.stride(1), None,
              q_rope[0].data_ptr() if q_rope else None, q_rope[1].data_ptr() if q_rope else None,
              float(q_rope[2]) if q_rope else 0.0, o_rope[0].data_ptr() if o_rope else None,
              o_rope[1].data_ptr() if o_rope else None, scales.data_ptr() if scales is not None else None, B * S)
    tmap = _tmap_rows(out, B * S * H) if scales is not None and out.is_contiguous() else None
    variant = Variant(idx_bits=32 if i1.dtype == torch.int32 else 64, qrope=q_rope is not None, qrf=qrf, orf=orf,
                      fp8=scales is not None, wring=not two and J1 == 2 * 64, tmao=tmap is not None,
                      pos_int32=bool(pos) and pos[0].dtype == torch.int32)
    return variant, a, min(n_items, ctas_resident(q.device.index)), tmap, sinks


def sparse_attention_cuda(q: torch.Tensor, out: torch.Tensor, sinks: torch.Tensor, kv1: torch.Tensor,
                          i1: torch.Tensor, kv2: torch.Tensor, i2: torch.Tensor, scale: float, two: bool, *,
                          q_rope: tuple | None = None, o_rope: tuple | None = None, scales: torch.Tensor | None = None,
                          cache_dir: str | None = None) -> None:
    """Launch the kernel on checked tensors (``prepare``'s contract) into ``out`` (and ``scales``).

    One part of exactly 128 picks (a sliding window's) runs the window ring: the two tile slots hold the picked
    rows, pick j of query s at row (s - j) % 128, each CTA takes a contiguous run of items, and an item whose picks
    are the last item's (the next head block) or the last item's moved on by one, newest first (the next query's
    window, ``kernels.picks``) copies only its new row. Its sums run in an order set by s alone, so the bits do not
    depend on which rows stayed. The output's steps have the unfused chain's bits (``triton_kernels._epilogue``'s
    roundings in its order); q's norm is a factor of the head's scores (within bf16 rounding of the chain)."""
    variant, a, n_ctas, tmap, keep = prepare(q, out, sinks, kv1, i1, kv2, i2, scale, two, q_rope=q_rope,
                                             o_rope=o_rope, scales=scales)
    launch(kernel(q.device.index, variant, cache_dir), n_ctas, a, i1, i2, tmap)
    del keep


@functools.lru_cache(maxsize=None)
def ctas_resident(device_index: int) -> int:
    """CTAs the GPU holds at once (the persistent grid): SMs x CTAs an SM (the driver's occupancy for THREADS and
    SMEM_BYTES: 1 on Hopper)."""
    func = kernel(device_index, Variant())
    lib = torch.cuda._utils._get_gpu_runtime_library()
    n = ctypes.c_int(0)
    rc = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), func, THREADS, ctypes.c_size_t(SMEM_BYTES))
    per_sm = n.value if rc == 0 and n.value > 0 else 1
    return max(1, torch.cuda.get_device_properties(device_index).multi_processor_count * per_sm)


TMAP_BYTES = 128            # sizeof(CUtensorMap)
_NO_TMAP = (ctypes.c_uint8 * TMAP_BYTES)()      # the tensor map argument of a kernel that has none (zeros)


def _tmap_rows(out: torch.Tensor, rows: int):
    """A CUtensorMap of ``out`` (FP8, contiguous) as ``rows`` rows of 512 bytes, boxes of 64 rows x 128 bytes in the
    128-byte swizzle (the kernel's TMA staging), by the driver's cuTensorMapEncodeTiled; None where the driver
    refuses it (the kernel then stores with its threads)."""
    return tmap_2d(out.data_ptr(), D_FULL, rows, D_FULL, 128, BH)


def tmap_2d(ptr: int, inner: int, outer: int, stride: int, box_inner: int, box_outer: int, dtype: int = 0,
            swizzle: int = 3, l2_promotion: int = 0):
    """(buffer, address) of a 2-D CUtensorMap at ``ptr``: ``outer`` rows of ``inner`` elements ``stride`` bytes
    apart, boxes of box_outer x box_inner; ``dtype`` a CU_TENSOR_MAP_DATA_TYPE (0 uint8, 7 float32), ``swizzle``
    (0 none, 3 128 bytes), ``l2_promotion`` (0 none, 3 256 bytes); by the driver's cuTensorMapEncodeTiled. None where
    the driver has none or refuses it. Keep the buffer alive while the address is in use."""
    lib = torch.cuda._utils._get_gpu_runtime_library()
    enc = getattr(lib, "cuTensorMapEncodeTiled", None)
    if enc is None:
        return None
    buf = (ctypes.c_uint8 * (TMAP_BYTES + 64))()       # the map 64-byte aligned inside
    addr = ctypes.addressof(buf) + (-ctypes.addressof(buf)) % 64
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    rc = enc(ctypes.c_void_p(addr), ctypes.c_int(dtype), u32(2), ctypes.c_void_p(ptr), (u64 * 2)(inner, outer),
             (u64 * 1)(stride), (u32 * 2)(box_inner, box_outer), (u32 * 2)(1, 1), ctypes.c_int(0),   # no interleave
             ctypes.c_int(swizzle), ctypes.c_int(l2_promotion), ctypes.c_int(0))
    return (buf, addr) if rc == 0 else None


def launch(func, n_ctas: int, a: _Args, i1: torch.Tensor, i2: torch.Tensor, tmap=None) -> None:
    """cuLaunchKernel with the argument struct and the output's tensor map (zeros where the kernel has none) by value
    on the current stream."""
    lib = torch.cuda._utils._get_gpu_runtime_library()
    p1, p2 = ctypes.c_void_p(i1.data_ptr()), ctypes.c_void_p(i2.data_ptr())
    buf, addr = tmap if tmap is not None else (_NO_TMAP, ctypes.addressof(_NO_TMAP))   # (buf: alive till the launch)
    params = (ctypes.c_void_p * 4)(ctypes.cast(ctypes.byref(a), ctypes.c_void_p),
                                   ctypes.cast(ctypes.byref(p1), ctypes.c_void_p),
                                   ctypes.cast(ctypes.byref(p2), ctypes.c_void_p), ctypes.c_void_p(addr))
    stream = torch.cuda.current_stream()
    rc = lib.cuLaunchKernel(func, n_ctas, 1, 1, THREADS, 1, 1, SMEM_BYTES, stream._as_parameter_, params, None)
    if rc != 0:
        raise RuntimeError(f"sparse_attention_cuda: cuLaunchKernel returned CUresult {rc}")

"""The Triton implementation of the sparse core: portable (any GPU Triton runs on, the CPU interpreter in the
tests), decode's and small grids' kernel, and every prefill call the CUDA core does not take.

``CoreConfig`` picks the tiling; the default and the split count depend only on shapes and dtype
(``default_config``, ``splits``); a config the GPU cannot hold (shared memory) falls back to the next one of
``FALLBACKS`` at its first launch, which then sticks for that shape. The kernels are in ``triton_kernels``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from moe_wave.comm.triton_gate import interpreting, sm_count, triton

from ..kernels import use_kernels
from . import triton_kernels as tk
from .call import CoreCall, CoreTuning

__all__ = ["CoreConfig", "default_config", "FALLBACKS", "splits", "fuse_inside", "supports", "run"]

NAME = "triton"
_LOG2E = 1.4426950408889634


@dataclass(frozen=True, kw_only=True)
class CoreConfig:
    """Tiling of the sparse core kernel (powers of two, each >= 16).

    block_h: query heads per program (the GEMM's M); block_n: picked keys per tile (N of QK, K of PV);
    block_dk: channels per QK dot (d rounded up to a power of two = one dot); block_dv: value channels per
    program (below d the QK is recomputed per value block); split_k: programs per query and head block, each
    over a run of its key tiles, merged by a second kernel in a fixed order (0: auto, more than one only when
    the grid would leave SMs idle, as in decode; 1: never); num_warps / num_stages: Triton's launch options.
    """

    block_h: int = 64
    block_n: int = 64
    block_dk: int = 512
    block_dv: int = 512
    num_warps: int = 8
    num_stages: int = 2
    split_k: int = 0

    def __post_init__(self):
        for name in ("block_h", "block_n", "block_dk", "block_dv"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"CoreConfig.{name}={v}: must be a power of two >= 16")
        if self.split_k < 0:
            raise ValueError(f"CoreConfig.split_k={self.split_k}: must be >= 0 (0: auto)")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"CoreConfig num_warps={self.num_warps}, num_stages={self.num_stages}: "
                             "num_warps a power of two <= 16, num_stages >= 1")

    def fit(self, H: int, D: int) -> "CoreConfig":
        """This config clipped to the problem: blocks no larger than the (power-of-two) head count and d."""
        return _fit(self, H, D)


# Tried in order when a config does not fit the GPU (triton OutOfResources at its first launch).
FALLBACKS = (
    CoreConfig(),                                                              # 64 x 64 tiles, d in one dot
    CoreConfig(num_stages=1),
    CoreConfig(block_dk=128, block_dv=256),                                    # QK in 4 dots, half the values
    CoreConfig(block_h=32, block_n=32, block_dk=64, block_dv=128, num_warps=4, num_stages=1),
)


@lru_cache(maxsize=256)
def _fit(cfg: CoreConfig, H: int, D: int) -> CoreConfig:
    bd = _pow2(D)
    return replace(cfg, block_h=min(cfg.block_h, max(16, _pow2(H))), block_dk=min(cfg.block_dk, bd),
                   block_dv=min(cfg.block_dv, bd))


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132                      # the interpreter: any fixed number keeps the choice shape-only
    return sm_count(device)


@lru_cache(maxsize=256)
def default_config(H: int, D: int, dtype: torch.dtype) -> CoreConfig:
    """The tiling for a problem: 64 heads x 64 keys with d in one dot for 16-bit inputs, the keys split
    across programs when the grid is small (``CoreConfig.split_k`` = 0); small exact tiles for fp32 (fp32 runs
    the tests and the CPU parity checks, not the model). Shapes and dtype only: the same call, the same bits."""
    if dtype == torch.float32:
        cfg = CoreConfig(block_h=32, block_n=32, block_dk=64, block_dv=128, num_warps=4, num_stages=1)
        return cfg.fit(H, D)
    return CoreConfig().fit(H, D)


_CHOSEN: dict = {}   # (device, shape key, requested config) -> the config that launched (a cache)


def splits(cfg: CoreConfig, B: int, S: int, H: int, J: int, device: torch.device) -> int:
    """Key splits per query: ``cfg.split_k``, or (0 = auto) as many as fit the SMs in one wave of programs when one
    program per query and head block would leave half of them idle (decode), at most one per key tile (a second,
    partial wave of programs costs more than the SMs it fills: ``benchmarks/results/attn.md``)."""
    if cfg.split_k:
        return cfg.split_k
    programs = B * S * triton.cdiv(H, cfg.block_h)
    if 2 * programs > _sm_count(device):
        return 1
    return max(1, min(_sm_count(device) // programs, triton.cdiv(max(J, 1), cfg.block_n)))


def want_config(call: CoreCall) -> CoreConfig:
    """The tiling the call asks for (its config or the default), clipped to H and d."""
    _, _, H, D = call.q.shape
    return (call.config or default_config(H, D, call.q.dtype)).fit(H, D)


def fuse_inside(q: torch.Tensor, want: CoreConfig, tuning: CoreTuning) -> bool:
    """The steps run inside the kernels up to ``tuning.fuse_max_waves`` waves of programs (query x head block)."""
    B, S, H, _ = q.shape
    return B * S * triton.cdiv(H, want.block_h) <= tuning.fuse_max_waves * _sm_count(q.device)


def steps_inside(call: CoreCall) -> bool:
    """Whether this call's steps run inside the Triton kernel (``call.fuse``, else by the grid's size)."""
    if not call.steps.any:
        return False
    if call.fuse is not None:
        return call.fuse
    return fuse_inside(call.q, want_config(call), call.tuning)


def supports(call: CoreCall) -> str | None:
    """One or two parts where the kernels run (``use_kernels``), the steps (if any) inside the kernel."""
    if call.impl not in ("auto", NAME):
        return f"impl={call.impl!r} was asked for"
    if triton is None or not use_kernels(call.q, call.kernels):
        return f"the kernels do not run on this call (kernels={call.kernels!r}, {call.q.device}, Triton " \
               f"{'present' if triton is not None else 'absent'})"
    if call.i1 is None:
        return f"{len(call.parts)} parts: it takes 1 or 2"
    if call.items and call.steps.any and not steps_inside(call):
        return "the steps around the core run inside this kernel only on small grids (CoreTuning.fuse_max_waves); " \
               "here the unfused passes run them around the plain core"
    return None


def run(call: CoreCall):
    """The Triton kernel (the ladder of ``FALLBACKS`` where the GPU cannot hold the tiling)."""
    _, _, H, D = call.q.shape
    st = call.steps
    want = want_config(call)
    if st.fp8 and want.block_dv < 128:
        raise ValueError(f"sparse_attention: out_fp8 needs CoreConfig.block_dv >= 128 (a program's value "
                         f"channels hold whole 128-channel scale blocks), got block_dv={want.block_dv}")
    out, scales, result = call.outputs()
    if call.items == 0:
        return result
    key = (call.q.device, call.q.dtype, H, D, call.two, want, st.key)
    cfg = _CHOSEN.get(key, want)
    ladder = [cfg] + [c.fit(H, D) for c in FALLBACKS if call.fallback and key not in _CHOSEN
                      and not (st.fp8 and c.fit(H, D).block_dv < 128)]
    for i, c in enumerate(ladder):
        try:
            _launch(c, call, out, scales)
        except triton.runtime.errors.OutOfResources:
            if i == len(ladder) - 1:
                raise
            continue
        _CHOSEN[key] = c
        return result
    raise AssertionError("unreachable: the ladder either launched or raised")


def _launch(cfg: CoreConfig, call: CoreCall, out: torch.Tensor, scales: torch.Tensor | None) -> None:
    q, sinks, kv1, i1, kv2, i2, two, fu = call.q, call.sinks, call.kv1, call.i1, call.kv2, call.i2, call.two, \
        call.steps
    B, S, H, D = q.shape
    BD = _pow2(D)
    J1, J2 = i1.shape[-1], (i2.shape[-1] if two else 0)
    ndv = triton.cdiv(D, cfg.block_dv)
    nsplit = splits(cfg, B, S, H, J1 + J2, q.device)
    if nsplit > 1:
        ws_ml = torch.empty(B * S * nsplit * 2 * H, dtype=torch.float32, device=q.device)
        ws_acc = torch.empty(B * S * nsplit * H * D, dtype=torch.float32, device=q.device)
    else:
        ws_ml = ws_acc = sinks                                          # unused
    unused = sinks
    qpos, qfreq = (fu.qpos, fu.qfreq) if fu.qpos is not None else (unused, unused)
    opos, ofreq = (fu.opos, fu.ofreq) if fu.opos is not None else (unused, unused)
    sc = scales if scales is not None else unused
    qrf = 0 if fu.qfreq is None else 2 * fu.qfreq.numel()
    orf = 0 if fu.ofreq is None else 2 * fu.ofreq.numel()
    orope, fp8, interp = fu.opos is not None, fu.fp8, interpreting()
    grid = (B * S, triton.cdiv(H, cfg.block_h), ndv * nsplit)
    tk._sparse_core_kernel[grid](
        q, out, sinks, kv1, i1, kv2, i2, ws_ml, ws_acc, qpos, qfreq, opos, ofreq, sc, fu.eps,
        S, H, J1, J2, ndv, nsplit, call.scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        kv1.stride(0), kv1.stride(1), i1.stride(0), i1.stride(1), kv2.stride(0), kv2.stride(1), i2.stride(0),
        i2.stride(1), D=D, BD=BD, BH=cfg.block_h, BN=cfg.block_n, BDK=cfg.block_dk, BDV=cfg.block_dv,
        TWO=two, SPLIT=nsplit > 1, IEEE=q.dtype == torch.float32 or interpreting(), QROPE=fu.qpos is not None,
        QRF=qrf, OROPE=orope, ORF=orf, FP8=fp8, INTERP=interp, JC=tk.picks_chunk(J1, J2, cfg.block_n),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if nsplit > 1:
        bdv = min(128, BD)
        tk._combine_kernel[(B * S, triton.cdiv(H, cfg.block_h), triton.cdiv(D, bdv))](
            ws_ml, ws_acc, out, q, sc, opos, ofreq, S, H, nsplit, out.stride(0), out.stride(1), out.stride(2), D=D,
            BH=cfg.block_h, BDV=bdv, RF=orf, OROPE=orope, FP8=fp8, INTERP=interp, num_warps=4)

"""The sparse core's one picker: an ordered table of implementations, the first that supports a call runs it.

Each implementation answers ``supports(call)`` with None or the rule the call fails; a call none takes raises a
ValueError that lists every implementation and its rule. In order:

- ``cuda``: Hopper's prefill kernel in CUDA C++ (``cuda_impl``), with the layer's steps inside.
- ``chain``: the steps around the core (q's norm and RoPE, the output's inverse RoPE and FP8) as the unfused
  passes around a plain core call (dispatched again): large grids the CUDA kernel does not take.
- ``triton``: the Triton kernel (``triton_impl``), portable: decode, small grids (the steps inside), every other
  GPU, the CPU interpreter in the tests.
- ``reference``: torch ops (``reference``), any device, any number of parts.
"""

from __future__ import annotations

import torch

from moe_wave.comm.triton_gate import triton
from moe_wave.fp8 import act_quant

from ..kernels import norm_rope, use_kernels
from . import cuda_impl, reference, triton_impl
from .call import CoreCall, CoreTuning

__all__ = ["sparse_attention", "sparse_attention_fused", "core_impl", "q_norm_inside", "core_flops", "IMPLS"]


class _Chain:
    """The steps as the unfused passes around a plain core call (``norm_rope``, the core, ``norm_rope(inverse)`` in
    place and ``fp8.act_quant``): the bits of the chain the kernels' fused steps reproduce."""

    NAME = "chain"

    @staticmethod
    def supports(call: CoreCall) -> str | None:
        if not call.steps.any:
            return "no steps around the core"
        if call.items == 0:
            return "an empty call"
        if call.i1 is None or not use_kernels(call.q, call.kernels):
            return "the kernels do not take this call (the reference runs the steps itself)"
        if triton_impl.steps_inside(call):
            return "the steps run inside the Triton kernel on this small grid (CoreTuning.fuse_max_waves)"
        return None

    @staticmethod
    def run(call: CoreCall):
        st = call.steps
        q = call.q
        B, S, H, D = q.shape
        if st.qpos is not None:
            q = norm_rope(q, st.qpos, st.qfreq, eps=st.eps)
        o = sparse_attention(q, [(call.kv1, call.i1)] + ([(call.kv2, call.i2)] if call.two else []), call.sinks,
                             call.scale, call.kernels, config=call.config, fallback=call.fallback, impl=call.impl,
                             reference=call.reference, tuning=call.tuning)
        if st.opos is not None:
            norm_rope(o, st.opos, st.ofreq, norm=False, inverse=True, out=o)
        return act_quant(o.reshape(B * S, H * D)) if st.fp8 else o


IMPLS = (cuda_impl, _Chain, triton_impl, reference)


def pick(call: CoreCall, skip: tuple = ()):
    """The first implementation of ``IMPLS`` (but ``skip``) that supports the call; ValueError listing each one's
    rule."""
    rules = []
    for impl in IMPLS:
        why = "does not run here (see the warning)" if impl in skip else impl.supports(call)
        if why is None:
            return impl
        rules.append(f"{impl.NAME}: {why}")
    B, S, H, D = call.q.shape
    raise ValueError(f"sparse_attention: no implementation takes this call (q {tuple(call.q.shape)} {call.q.dtype} "
                     f"on {call.q.device}, {len(call.parts)} parts, impl={call.impl!r}):\n  " + "\n  ".join(rules))


def sparse_attention(q_BSHd: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]], sinks_H: torch.Tensor,
                     scale: float, kernels: str = "auto", *, q_rope=None, o_rope=None, out_fp8: bool = False,
                     config=None, fallback: bool = True, fuse: bool | None = None, impl: str = "auto",
                     reference: bool = True, tuning: CoreTuning | None = None):
    """Attention of every query over the rows its parts pick (DeepSeek-V4's sparse core, spec 3.5).

    Args:
        q_BSHd: queries [B, S, H, d].
        parts: ``(kv_BMd, idx_BSJ)`` pairs (the window, then the compressed entries); ids index dim 1 of ``kv_BMd``,
            -1 is masked out. K = V: one head shared by all H query heads.
        sinks_H: per-head sink logits. scale: softmax scale (head_dim^-1/2).
        kernels: ``ScheduleConfig.kernels`` ("auto": the kernels on a GPU with Triton; "on": also under the CPU
            interpreter; "off": the reference).
        q_rope: ``(pos_BS, freq_F, eps)``: q is raw; first ``norm_rope(q, pos, freq, eps=eps)`` (per-head RMSNorm,
            no weight, then RoPE of the last 2F channels). freq may be None or empty (the norm only).
        o_rope: ``(pos_BS, freq_F)``: then the inverse RoPE of the output's last 2F channels.
        out_fp8: then ``fp8.act_quant`` of the output as ``[B*S, H*d]`` (d a multiple of 128).
        config: a Triton tiling (``CoreConfig``; default ``default_config``); the CUDA kernel then does not run.
        fallback: on a GPU that cannot hold ``config``, run the next of ``FALLBACKS`` (False: raise triton's
            OutOfResources, as a benchmark of that very tiling wants).
        fuse: where the Triton kernel runs the steps: True inside, False as the unfused chain around the plain
            kernel, None by ``tuning.fuse_max_waves``.
        impl: "auto" (the table's order), or "cuda" / "triton": that kernel for the core (an error listing its rule
            where it cannot).
        reference: the torch reference may take the call (``sparse_attention_fused``: False).
        tuning: ``CoreTuning`` (default: its defaults; the layer passes ``ScheduleConfig.core``).
    Returns:
        o_BSHd in q's dtype (a query whose every pick is masked returns 0: the sink takes all mass); with
        ``out_fp8`` the pair (o_q float8_e4m3fn [B*S, H*d], s fp32 [H*d/128, B*S]). The kernels agree with the
        reference to the dtype's rounding, not bit for bit; each repeats its own bits.
    """
    call = CoreCall.build(q_BSHd, parts, sinks_H, scale, q_rope=q_rope, o_rope=o_rope, out_fp8=out_fp8,
                          kernels=kernels, impl=impl, config=config, fallback=fallback, fuse=fuse, reference=reference,
                          tuning=tuning or CoreTuning())
    return run(call)


def run(call: CoreCall):
    """The call on the first implementation that supports it; one that turns out not to run here (the CUDA core's
    build or launch, ``cuda_impl.Unavailable``, before anything ran) hands it to the next."""
    skip = ()
    while True:
        impl = pick(call, skip)
        try:
            return impl.run(call)
        except cuda_impl.Unavailable:
            skip += (impl,)


def sparse_attention_fused(q_BSHd: torch.Tensor, parts: list, sinks_H: torch.Tensor, scale: float, config=None,
                           fallback: bool = True, **kw):
    """``sparse_attention`` on the kernels only (kernels "on": the CPU interpreter too; never the reference)."""
    return sparse_attention(q_BSHd, parts, sinks_H, scale, "on", config=config, fallback=fallback, reference=False,
                            **kw)


def core_impl(q_BSHd: torch.Tensor, parts: list, *, fusions: bool = False, config=None, impl: str = "auto",
              fuse: bool | None = None, tuning: CoreTuning | None = None, kernels: str = "on") -> str:
    """Which implementation runs a kernel call like this ("cuda", "chain", "triton" or "reference"; benchmarks label
    their rows with it). fusions: the call has the steps (here: the output's inverse RoPE, as the layer's)."""
    o_rope = None
    if fusions:
        B, S = q_BSHd.shape[:2]
        o_rope = (torch.zeros(B, S, dtype=torch.int64, device=q_BSHd.device),
                  torch.zeros(32, device=q_BSHd.device))
    call = CoreCall.build(q_BSHd, parts, torch.zeros(q_BSHd.shape[2], device=q_BSHd.device), 1.0, o_rope=o_rope,
                          kernels=kernels, impl=impl, config=config, fuse=fuse, reference=False,
                          tuning=tuning or CoreTuning())
    name = pick(call).NAME
    if name == "chain":                 # the core itself: what the plain call takes
        plain = CoreCall.build(q_BSHd, parts, call.sinks, 1.0, kernels=kernels, impl=impl, config=config,
                               reference=False, tuning=call.tuning)
        name = pick(plain).NAME
    return name


def q_norm_inside(q_BSHd: torch.Tensor, n_parts: int, tuning: CoreTuning | None = None) -> bool:
    """Whether ``sparse_attention(q_rope=...)`` of this raw q ([B, S, H, d]) with ``n_parts`` parts applies q's norm
    and RoPE inside the CUDA core as q arrives (a large grid on Hopper: prefill), which saves ``norm_rope``'s pass
    over q (``benchmarks/results/attn.md``); on small grids the layer keeps the norm on its q branch
    (``V4Attention.q_heads``). ``tuning.q_norm_inside = False`` says no everywhere."""
    tuning = tuning or CoreTuning()
    B, S, H, D = q_BSHd.shape
    if not tuning.q_norm_inside or not tuning.cuda or not B * S * H or not q_BSHd.is_cuda or triton is None:
        return False
    want = triton_impl.default_config(H, D, q_BSHd.dtype).fit(H, D)
    if triton_impl.fuse_inside(q_BSHd, want, tuning):
        return False
    return cuda_impl.rule(q_BSHd, n_parts) is None


def core_flops(H: int, D: int, idx_parts: list) -> tuple[float, float]:
    """(useful, nominal) FLOPs of the core: 4*H*d per (query, pick) (QK and PV), counting the valid picks
    (``idx >= 0``, a device reduction: a host sync) or every pick."""
    valid = sum(int((idx >= 0).sum()) for idx in idx_parts)   # HOST SYNC: benchmarks only
    nominal = sum(idx.numel() for idx in idx_parts)
    return 4.0 * H * D * valid, 4.0 * H * D * nominal

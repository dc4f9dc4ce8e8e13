"""One sparse-core call as a frozen record: its operands, the fused steps around the core, checked once.

Legend: B batch, S queries, H query heads, d head_dim (K = V), M rows of a key source, J picks per query.

``CoreCall.build`` checks the arguments (shapes, the steps' tensors) and prepares the kernels' operands once
(last dims contiguous, kv in q's dtype, the sinks readable by every kernel); the implementations
(``dispatch.IMPLS``) read the record and never check a shape again. ``CoreTuning`` is what remains tunable about
the core (``ScheduleConfig.core``): the dispatcher's thresholds, not what a call computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CoreCall", "CoreTuning", "Steps", "check_steps"]

IMPL_NAMES = ("auto", "cuda", "triton")     # the ``impl`` a call may ask for (auto: the dispatcher's order)


@dataclass(frozen=True, kw_only=True)
class CoreTuning:
    """Where each implementation of the sparse core runs (``dispatch``); the defaults are the measured best
    (``benchmarks/results/attn.md``).

    cuda: the CUDA C++ core runs the Hopper prefill calls it takes (False: the Triton kernel there).
    cuda_max_picks: ... for queries of at most this many picks (window + compressed; more: the Triton kernel).
    fuse_max_waves: the Triton kernel runs the fused steps (q's norm and RoPE, the output's inverse RoPE and FP8)
        inside itself on grids of at most this many waves of programs (query x head block) a SM count; beyond,
        they run as the unfused passes around the plain core (the kernel is at its register limit there).
    q_norm_inside: the layer leaves q raw where the CUDA core applies its norm and RoPE as q arrives (prefill on
        Hopper), saving ``norm_rope``'s pass over q; False: on the q branch everywhere.
    kernel_cache: the folder of the compiled CUDA kernels' on-disk cache (None: ``~/.cache/moe_wave``;
        ``moe_wave.env`` reads ``MOE_WAVE_KERNEL_CACHE``).
    """

    cuda: bool = True
    cuda_max_picks: int = 2048
    fuse_max_waves: int = 4
    q_norm_inside: bool = True
    kernel_cache: str | None = None

    def __post_init__(self):
        for name in ("cuda", "q_norm_inside"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CoreTuning.{name}={getattr(self, name)!r}: must be True or False")
        for name in ("cuda_max_picks", "fuse_max_waves"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"CoreTuning.{name}={v!r}: must be an integer >= 0")


@dataclass(frozen=True)
class Steps:
    """The optional steps around the core of one call, checked, on q's device.

    qpos / qfreq / eps: q is raw; first its per-head RMSNorm (no weight) and RoPE of the last 2F channels.
    opos / ofreq: the output's last 2F channels get the inverse RoPE. fp8: the output leaves as ``fp8.act_quant``'s
    e4m3 [B*S, H*d] and scales [H*d/128, B*S].
    """

    qpos: torch.Tensor | None = None            # [B*S] positions of q's RoPE; None: no prologue
    qfreq: torch.Tensor | None = None           # fp32 [F]
    eps: float = 0.0
    opos: torch.Tensor | None = None            # [B*S] positions of the output's inverse RoPE; None: none
    ofreq: torch.Tensor | None = None
    fp8: bool = False

    @property
    def key(self) -> tuple:
        return (self.qpos is not None, self.opos is not None, self.fp8)

    @property
    def any(self) -> bool:
        return self.key != (False, False, False)

    @property
    def qrf(self) -> int:
        """q's RoPE channels (0: none, or the norm alone)."""
        return 2 * self.qfreq.numel() if self.qpos is not None else 0

    @property
    def orf(self) -> int:
        return 2 * self.ofreq.numel() if self.opos is not None else 0

    @property
    def q_rope(self):
        return (self.qpos, self.qfreq, self.eps) if self.qpos is not None else None

    @property
    def o_rope(self):
        return (self.opos, self.ofreq) if self.opos is not None else None


def check_steps(q_BSHd: torch.Tensor, q_rope=None, o_rope=None, out_fp8: bool = False) -> Steps:
    """The steps' arguments of ``sparse_attention`` checked (clear errors)."""
    B, S, H, D = q_BSHd.shape

    def rope(name, pos, freq):
        F = 0 if freq is None else freq.numel()
        if 2 * F > D:
            raise ValueError(f"sparse_attention: {name} has {F} frequencies, 2 * {F} > d={D}")
        if pos is None or pos.numel() != B * S:
            got = None if pos is None else tuple(pos.shape)
            raise ValueError(f"sparse_attention: {name} positions {got} must be [B={B}, S={S}]")
        f = freq.float().contiguous() if F else torch.zeros(0, dtype=torch.float32, device=q_BSHd.device)
        return pos.reshape(-1).contiguous(), f

    st = {}
    if q_rope is not None:
        if len(q_rope) != 3:
            raise ValueError(f"sparse_attention: q_rope must be (pos_BS, freq_F, eps), got {len(q_rope)} items")
        st["qpos"], st["qfreq"] = rope("q_rope", q_rope[0], q_rope[1])
        st["eps"] = float(q_rope[2])
    if o_rope is not None:
        if len(o_rope) != 2:
            raise ValueError(f"sparse_attention: o_rope must be (pos_BS, freq_F), got {len(o_rope)} items")
        st["opos"], st["ofreq"] = rope("o_rope", o_rope[0], o_rope[1])
    if out_fp8 and D % 128:
        raise ValueError(f"sparse_attention: out_fp8 needs head_dim d={D} to be a multiple of 128 (one scale per "
                         f"128 channels of a head)")
    return Steps(**st, fp8=bool(out_fp8))


@dataclass(frozen=True, kw_only=True)
class CoreCall:
    """One call of the sparse core, checked (``build``).

    q: [B, S, H, d], last dim contiguous. parts: the ``(kv_BMd, idx_BSJ)`` pairs as given (the reference reads
    them). kv1 / i1, kv2 / i2: the first and last part prepared for the kernels (kv in q's dtype, last dims
    contiguous; one part: the same twice, ``two`` False); None for a call of another part count. sinks: the
    per-head sink logits (fp32, bf16 or fp16: the kernels widen them). steps: what runs around the core.
    kernels: ``ScheduleConfig.kernels`` (whether the kernels may run at all); impl: "auto" or the one
    implementation asked for; config: a Triton tiling asked for (None: the default); fallback: on a GPU that
    cannot hold it, the next of ``FALLBACKS``; fuse: where the Triton kernel runs the steps (None: by
    ``tuning.fuse_max_waves``); reference: the torch reference may take the call.
    """

    q: torch.Tensor
    parts: tuple
    kv1: torch.Tensor | None
    i1: torch.Tensor | None
    kv2: torch.Tensor | None
    i2: torch.Tensor | None
    two: bool
    sinks: torch.Tensor
    scale: float
    steps: Steps
    kernels: str = "auto"
    impl: str = "auto"
    config: object = None
    fallback: bool = True
    fuse: bool | None = None
    reference: bool = True
    tuning: CoreTuning = CoreTuning()

    @property
    def shape(self) -> tuple:
        return tuple(self.q.shape)

    @property
    def items(self) -> int:
        """B * S * H: 0 for an empty call."""
        B, S, H, _ = self.q.shape
        return B * S * H

    @property
    def picks(self) -> int:
        """J of both parts (a query's picks, -1 included)."""
        if self.i1 is None:
            return sum(idx.shape[-1] for _, idx in self.parts)
        return self.i1.shape[-1] + (self.i2.shape[-1] if self.two else 0)

    @classmethod
    def build(cls, q_BSHd: torch.Tensor, parts, sinks_H: torch.Tensor, scale: float, *, q_rope=None, o_rope=None,
              out_fp8: bool = False, **kw) -> "CoreCall":
        impl = kw.get("impl", "auto")
        if impl not in IMPL_NAMES:
            raise ValueError(f"sparse_attention: impl={impl!r} must be one of {IMPL_NAMES}")
        B, S, H, D = q_BSHd.shape
        steps = check_steps(q_BSHd, q_rope, o_rope, out_fp8)
        parts = tuple(parts)
        for kv, idx in parts:
            if kv.shape[0] != B or kv.shape[-1] != D or tuple(idx.shape[:2]) != (B, S):
                raise ValueError(f"sparse_attention: part kv {tuple(kv.shape)} / idx {tuple(idx.shape)} must be "
                                 f"[B={B}, M, d={D}] / [B={B}, S={S}, J]")
        q = q_BSHd if q_BSHd.stride(-1) == 1 else q_BSHd.contiguous()
        kv1 = i1 = kv2 = i2 = None
        two = len(parts) == 2
        if 1 <= len(parts) <= 2:
            srcs = []
            for kv, idx in parts:
                kv = kv.to(q.dtype)
                srcs.append((kv if kv.stride(-1) == 1 else kv.contiguous(),
                             idx if idx.stride(-1) == 1 else idx.contiguous()))
            (kv1, i1), (kv2, i2) = srcs[0], srcs[-1]
        # the kernels read the sinks in their dtype and widen them (no fp32 copy a call: a launch of its own)
        wide = sinks_H.dtype in (torch.float32, torch.bfloat16, torch.float16)
        sinks = (sinks_H if wide else sinks_H.float()).contiguous()
        return cls(q=q, parts=parts, kv1=kv1, i1=i1, kv2=kv2, i2=i2, two=two, sinks=sinks, scale=float(scale),
                   steps=steps, **kw)

    def outputs(self):
        """(out the kernels write [B, S, H, d], FP8 scales or None, what the call returns)."""
        B, S, H, D = self.q.shape
        if self.steps.fp8:
            o_q = torch.empty(B * S, H * D, dtype=torch.float8_e4m3fn, device=self.q.device)
            scales = torch.empty(H * D // 128, B * S, dtype=torch.float32, device=self.q.device)
            return o_q.view(B, S, H, D), scales, (o_q, scales)
        out = torch.empty_like(self.q)
        return out, None, out

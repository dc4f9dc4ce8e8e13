"""Interleaved tail RoPE of DeepSeek-V4 (spec 3.1).

Legend: B batch, S seq, H heads, d head_dim, r rope dim (the last r channels of a head), F = r/2
frequencies.

V4 rotates channel pairs (2i, 2i+1) as complex numbers (GPT-J layout) and only on the last ``r``
channels of each vector ("[nope | rope]"). Sliding-only layers use base ``rope_theta`` without
YaRN; compressed layers (c4, c128) and their indexer use ``compress_rope_theta`` with YaRN's
frequency blend and *no* mscale (the table has unit magnitude).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .kernels import norm_rope, use_kernels

__all__ = ["RopeConfig", "inv_freq", "rope_tail", "rope_config_from_hf"]


@dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """One layer's RoPE table. ``yarn_orig`` 0 means plain RoPE (no YaRN blend)."""

    dim: int
    theta: float
    yarn_orig: int = 0
    yarn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self):
        if self.dim <= 0 or self.dim % 2:
            raise ValueError(f"RopeConfig.dim={self.dim}: must be a positive even number")
        if self.theta <= 0:
            raise ValueError(f"RopeConfig.theta={self.theta}: must be > 0")
        if self.yarn_orig < 0 or self.yarn_factor <= 0:
            raise ValueError(f"RopeConfig yarn_orig={self.yarn_orig}, yarn_factor={self.yarn_factor}: "
                             "need yarn_orig >= 0 and yarn_factor > 0")


def inv_freq(cfg: RopeConfig, device=None) -> torch.Tensor:
    """fp32 [F] inverse frequencies; YaRN blend ``f/factor*(1-smooth) + f*smooth`` when enabled."""
    rd = cfg.dim
    f = 1.0 / (cfg.theta ** (torch.arange(0, rd, 2, dtype=torch.float32, device=device) / rd))
    if cfg.yarn_orig > 0:
        def corr_dim(rot: float) -> float:  # dimension whose wavelength fits `rot` turns in `orig`
            return rd * math.log(cfg.yarn_orig / (rot * 2 * math.pi)) / (2 * math.log(cfg.theta))
        lo = max(math.floor(corr_dim(cfg.beta_fast)), 0)
        hi = min(math.ceil(corr_dim(cfg.beta_slow)), rd - 1)
        if lo == hi:
            hi += 0.001  # avoid a zero-width ramp
        ramp = (torch.arange(rd // 2, dtype=torch.float32, device=device) - lo) / (hi - lo)
        smooth = 1 - ramp.clamp(0, 1)
        f = f / cfg.yarn_factor * (1 - smooth) + f * smooth
    return f


def rope_tail(x: torch.Tensor, pos: torch.Tensor, freq_F: torch.Tensor, inverse: bool = False,
              inplace: bool = False, kernels: str = "auto") -> torch.Tensor:
    """Rotate the last ``2*F`` channels of ``x`` by ``pos * freq`` (conjugate if ``inverse``).

    Args:
        x: [B, S, ..., d] (any number of middle dims, e.g. heads), any float dtype.
        pos: [B, S] int positions (or anything broadcastable to x's leading two dims).
        freq_F: fp32 [F] from ``inv_freq``.
        inplace: write the rotated channels into ``x`` (a fresh tensor nobody else reads) instead
            of copying all d channels into a new one.
        kernels: ``ScheduleConfig.kernels``: where ``use_kernels(x, kernels)`` one fused Triton kernel does
            it (``kernels.norm_rope``).
    Returns x's dtype and shape (``x`` itself when ``inplace``); the rotation is computed in fp32.
    """
    if use_kernels(x, kernels) and x.is_contiguous() and tuple(pos.shape) == tuple(x.shape[:2]):
        return norm_rope(x, pos, freq_F, norm=False, inverse=inverse, out=x if inplace else None)
    r = 2 * freq_F.shape[0]
    ang = pos.to(torch.float32)[..., None] * freq_F              # [B, S, F]
    for _ in range(x.dim() - 3):                                 # broadcast over middle dims
        ang = ang.unsqueeze(-2)
    cos, sin = ang.cos(), ang.sin()
    if inverse:
        sin = -sin
    t = x[..., -r:].float()
    a, b = t[..., 0::2], t[..., 1::2]
    rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    if inplace:
        x[..., -r:] = rot
        return x
    return torch.cat([x[..., :-r], rot.to(x.dtype)], dim=-1)


def rope_config_from_hf(hf_config, layer_type: str) -> RopeConfig:
    """RoPE table of an HF ``DeepseekV4Config`` layer type (sliding -> "main", else "compress")."""
    key = "main" if layer_type == "sliding_attention" else "compress"
    rp = hf_config.rope_parameters[key]
    yarn = rp.get("rope_type", rp.get("type")) == "yarn"
    return RopeConfig(dim=hf_config.qk_rope_head_dim, theta=float(rp["rope_theta"]),
                      yarn_orig=int(rp["original_max_position_embeddings"]) if yarn else 0,
                      yarn_factor=float(rp.get("factor", 1.0)) if yarn else 1.0,
                      beta_fast=float(rp.get("beta_fast", 32)), beta_slow=float(rp.get("beta_slow", 1)))

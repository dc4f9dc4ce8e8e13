"""Manifold-constrained hyper-connections (mHC) of DeepSeek-V4 (spec section 2).

Legend: B batch, S seq, N hc streams (hc_mult), D hidden, F = (2+N)*N mixing coefficients.

The residual is N streams X [B, S, N, D]. Each site (attention, MoE) computes from X, in fp32:
``pre`` (collapse weights, sigmoid + eps), ``post`` (expand weights, 2*sigmoid) and ``comb`` (an N x N
mixing matrix made doubly stochastic by Sinkhorn-Knopp). ``hc_pre`` collapses X to the sub-layer's
input h = sum_j pre_j X_j; ``hc_post`` expands the sub-layer's output back:
``X'[k] = post_k * out + sum_j comb[j, k] * X[j]``.

On a GPU with Triton (``kernels`` as ``ScheduleConfig.kernels``: "auto", "on", "off") each site runs the fused
kernels of ``moe_wave.mhc_kernels``: three launches instead of about ninety small ops (the Sinkhorn loop alone
is 4 per iteration); the torch ops here are their reference and the CPU path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["HCConfig", "HyperConnection", "hc_post"]


@dataclass(frozen=True, kw_only=True)
class HCConfig:
    hidden: int
    mult: int
    sinkhorn_iters: int
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6

    def __post_init__(self):
        for name in ("hidden", "mult", "sinkhorn_iters"):
            if getattr(self, name) <= 0:
                raise ValueError(f"HCConfig.{name}={getattr(self, name)}: must be > 0")

    @classmethod
    def from_hf(cls, c) -> "HCConfig":
        return cls(hidden=c.hidden_size, mult=c.hc_mult, sinkhorn_iters=c.hc_sinkhorn_iters, hc_eps=c.hc_eps,
                   norm_eps=c.rms_norm_eps)


class HyperConnection(nn.Module):
    """One mHC site: fp32 parameters ``fn`` [F, N*D], ``base`` [F], ``scale`` [3]."""

    def __init__(self, cfg: HCConfig):
        super().__init__()
        self.cfg = cfg
        N = cfg.mult
        self.fn = nn.Parameter(torch.zeros((2 + N) * N, N * cfg.hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + N) * N, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    @classmethod
    def from_hf(cls, hf_hc, hf_config) -> "HyperConnection":
        mod = cls(HCConfig.from_hf(hf_config))
        with torch.no_grad():
            mod.fn.copy_(hf_hc.fn)
            mod.base.copy_(hf_hc.base)
            mod.scale.copy_(hf_hc.scale)
        return mod

    def weights(self, X_BSND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 (pre [B, S, N], post [B, S, N], comb [B, S, N, N]); comb indexed [in j, out k]."""
        cfg, N = self.cfg, self.cfg.mult
        flat = X_BSND.flatten(-2).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + cfg.norm_eps)
        mix_BSF = flat @ self.fn.float().t()
        pre_w, post_w, comb_w = mix_BSF.split([N, N, N * N], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([N, N, N * N])
        s = self.scale.float()
        pre = torch.sigmoid(pre_w * s[0] + pre_b) + cfg.hc_eps
        post = 2 * torch.sigmoid(post_w * s[1] + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (N, N)) * s[2] + comb_b.view(N, N), dim=-1) + cfg.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + cfg.hc_eps)
        for _ in range(cfg.sinkhorn_iters - 1):  # Sinkhorn: rows, then columns
            comb = comb / (comb.sum(dim=-1, keepdim=True) + cfg.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + cfg.hc_eps)
        return pre, post, comb

    def hc_pre(self, X_BSND: torch.Tensor, kernels: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Collapse: (h [B, S, D] in X's dtype, post, comb)."""
        cfg = self.cfg
        if X_BSND.dim() != 4 or X_BSND.shape[-2:] != (cfg.mult, cfg.hidden):
            raise ValueError(f"X.shape={tuple(X_BSND.shape)}: must be [B, S, hc_mult={cfg.mult}, "
                             f"hidden={cfg.hidden}]")
        if _fused(X_BSND, kernels):
            from .mhc_kernels import hc_collapse, hc_mix

            B, S, N, D = X_BSND.shape
            X = X_BSND.contiguous()
            mix = hc_mix(X.view(B * S, N * D), self.fn)
            h, post, comb = hc_collapse(X.view(B * S, N, D), mix, self.base, self.scale, cfg.norm_eps, cfg.hc_eps,
                                        cfg.sinkhorn_iters)
            return h.view(B, S, D), post.view(B, S, N), comb.view(B, S, N, N)
        pre, post, comb = self.weights(X_BSND)
        h_BSD = (pre[..., None] * X_BSND).sum(dim=-2).to(X_BSND.dtype)
        return h_BSD, post, comb


def _fused(X: torch.Tensor, kernels: str) -> bool:
    from .attention.kernels import use_kernels
    from .mhc_kernels import fits

    return use_kernels(X, kernels) and fits(X.shape[-2])


def hc_post(out_BSD: torch.Tensor, X_BSND: torch.Tensor, post_BSN: torch.Tensor, comb_BSNN: torch.Tensor,
            kernels: str = "auto") -> torch.Tensor:
    """Expand and mix: ``X'[k] = post_k * out + sum_j comb[j, k] X[j]`` -> [B, S, N, D] in X's dtype."""
    if _fused(X_BSND, kernels):
        from .mhc_kernels import hc_expand

        B, S, N, D = X_BSND.shape
        y = hc_expand(out_BSD.to(X_BSND.dtype).contiguous().view(B * S, D), X_BSND.contiguous().view(B * S, N, D),
                      post_BSN.reshape(B * S, N), comb_BSNN.reshape(B * S, N, N))
        return y.view(B, S, N, D)
    dt = X_BSND.dtype
    return post_BSN.to(dt)[..., None] * out_BSD[..., None, :].to(dt) + torch.matmul(comb_BSNN.to(dt).transpose(-1, -2),
                                                                                    X_BSND)

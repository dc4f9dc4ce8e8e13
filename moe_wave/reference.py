"""Single-process reference of the V4 MoE block, written straight from v4_spec.md section 4.

It shares no code with the EP path (no layout, no waves, no grouped GEMM), so the EP path can be
tested against it, and it is the demo's error reference. Also builds random full weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import MoEConfig

__all__ = ["random_full_weights", "reference_moe", "reference_dispatch_combine"]


def random_full_weights(cfg: MoEConfig, seed: int = 0, dtype=torch.float32, device="cpu", scale: float = 0.1) -> dict:
    """All experts' weights, identical on every rank for the same seed (CPU generator)."""
    g = torch.Generator().manual_seed(seed)
    E, D, I, K = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k
    r = lambda *s: (torch.randn(*s, generator=g) * scale).to(device=device, dtype=dtype)  # noqa: E731
    full = {"gate": r(E, D) * 10, "bias": torch.randn(E, generator=g).mul(0.1).to(device),
            "gate_up": r(E, 2 * I, D), "down": r(E, D, I),
            "shared_gate": r(I, D), "shared_up": r(I, D), "shared_down": r(D, I)}
    if cfg.hash_routing:
        full["tid2eid"] = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(cfg.vocab_size)]).to(device)
    return full


def reference_dispatch_combine(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_w_TK: torch.Tensor,
                               expert_fn) -> torch.Tensor:
    """y[t] = sum_k w[t,k] * expert_fn(ids[t,k], x[t]) in fp32, one expert at a time."""
    y = torch.zeros(x_TD.shape, dtype=torch.float32, device=x_TD.device)
    for ex in topk_ids_TK.unique().tolist():
        tok, slot = torch.where(topk_ids_TK == ex)
        y.index_add_(0, tok, topk_w_TK[tok, slot, None].float() * expert_fn(ex, x_TD[tok]).float())
    return y


def _expert(h, w1, w3, w2, limit):
    g, u = h @ w1.t(), h @ w3.t()
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return (F.silu(g) * u) @ w2.t()


def reference_moe(full: dict, cfg: MoEConfig, x_TD: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
    s = F.softplus(x_TD.float() @ full["gate"].float().t()).sqrt()
    if cfg.hash_routing:
        idx = full["tid2eid"][input_ids.reshape(-1)].long()
    else:
        idx = (s + full["bias"].float()).topk(cfg.top_k, -1).indices
    w = s.gather(1, idx)
    w = w / w.sum(-1, keepdim=True) * cfg.routed_scaling_factor
    I, L = cfg.intermediate_size, cfg.swiglu_limit
    fn = lambda ex, h: _expert(h, full["gate_up"][ex][:I], full["gate_up"][ex][I:], full["down"][ex], L)  # noqa: E731
    y = reference_dispatch_combine(x_TD, idx, w, fn)
    if cfg.num_shared_experts:
        y += _expert(x_TD, full["shared_gate"], full["shared_up"], full["shared_down"],
                     L if cfg.clamp_shared else 0.0).float()
    return y.to(x_TD.dtype)

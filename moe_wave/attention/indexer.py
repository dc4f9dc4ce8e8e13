"""Lightning indexer of DeepSeek-V4 CSA layers (spec 3.4).

Legend: B batch, S chunk length, D hidden, L q_lora rank, h indexer heads, e indexer head dim,
N compressed-entry slots, K top-k.

K side: the indexer's own overlapping c4 compressor at dim e (``Compressor``), written into its own
``CompressorState``. Q side: ``qI = RoPE(q_lora @ Wq_b^T)`` viewed [B, S, h, e] (needs only the
q-LoRA latent, so it can start at the ``q_lora_ready`` event). Weights: ``w = x @ Wproj^T *
h^-1/2``. Score ``s[t, j] = sum_h w[t, h] * ReLU(qI[t, h] . kI[j]) * e^-1/2`` over visible entries
``j < (pos_t + 1) // m``; top-k of the visible ones, picks of invisible entries become -1.
The official Hadamard rotation is orthogonal and only matters with FP4 simulation, so it is omitted
(as in HF).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..fp8 import hf_weight

from .compressor import Compressor, CompressorConfig
from .kernels import index_scores, use_kernels
from .rope import rope_tail
from .topk import topk_select

__all__ = ["IndexerConfig", "Indexer"]


@dataclass(frozen=True, kw_only=True)
class IndexerConfig:
    hidden: int
    q_lora_rank: int
    heads: int
    dim: int
    topk: int
    ratio: int
    eps: float = 1e-6

    def __post_init__(self):
        for name in ("hidden", "q_lora_rank", "heads", "dim", "topk", "ratio"):
            if getattr(self, name) <= 0:
                raise ValueError(f"IndexerConfig.{name}={getattr(self, name)}: must be > 0")


class Indexer(nn.Module):
    def __init__(self, cfg: IndexerConfig):
        super().__init__()
        self.cfg = cfg
        self.compressor = Compressor(CompressorConfig(hidden=cfg.hidden, dim=cfg.dim, ratio=cfg.ratio,
                                                      overlap=True, eps=cfg.eps))
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.heads * cfg.dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden, cfg.heads, bias=False)

    @classmethod
    def from_hf(cls, hf_idx, hf_config) -> "Indexer":
        c = hf_config
        mod = cls(IndexerConfig(hidden=c.hidden_size, q_lora_rank=c.q_lora_rank, heads=hf_idx.num_heads,
                                dim=hf_idx.head_dim, topk=hf_idx.index_topk, ratio=int(hf_idx.compress_rate),
                                eps=c.rms_norm_eps))
        mod.compressor = Compressor.from_hf(hf_idx, hidden=c.hidden_size, overlap=True, eps=c.rms_norm_eps)
        with torch.no_grad():
            mod.q_b_proj.weight.copy_(hf_weight(hf_idx.q_b_proj))          # (an FP8 one dequantised; V4Attention
            mod.weights_proj.weight.copy_(hf_weight(hf_idx.scorer.weights_proj))   # keeps its bytes instead)
        return mod.to(hf_idx.kv_norm.weight.dtype)

    def weights(self, x_BSD: torch.Tensor) -> torch.Tensor:
        """fp32 [B, S, h] head weights, scaled by h^-1/2 and e^-1/2 (folded here, not in the scores)."""
        return self.weights_proj(x_BSD).float() * (self.cfg.heads ** -0.5 * self.cfg.dim ** -0.5)

    def query(self, qr_BSL, pos_BS: torch.Tensor, freq_F: torch.Tensor,
              kernels: str = "auto") -> torch.Tensor:
        """The index heads' queries [B, S, h, e] from q_lora [B, S, L] (or its ``fp8.QAct``, for an FP8 wq_b)."""
        B, S, _ = qr_BSL.shape
        q = self.q_b_proj(qr_BSL).view(B, S, self.cfg.heads, self.cfg.dim)
        # in place: the GEMM's output is fresh, so only the rotated tail is read and written (half of the channels
        # at e = 128, rope 64), not every channel copied into a new tensor
        return rope_tail(q, pos_BS, freq_F, inplace=True, kernels=kernels)

    def select(self, qI_BShe: torch.Tensor, w_BSh: torch.Tensor, k_BNe: torch.Tensor, pos_BS: torch.Tensor,
               num_slots: int, kernels: str = "auto") -> torch.Tensor:
        """[B, S, K] entry ids (absolute, -1 = none), K = min(topk, num_slots): int32 with the kernels (what the
        core kernels read), else int64.

        ``k_BNe`` may carry extra rows (the trash slot); only the first ``num_slots`` are scored.
        ``kernels``: ``ScheduleConfig.kernels``. With the kernels: ``topk.topk_select`` (the same set as
        ``torch.topk``, ties to the lowest ids, ids ascending); without: ``torch.topk`` (sorted by score).
        """
        k_BNe = k_BNe[:, :num_slots]
        k = min(self.cfg.topk, num_slots)
        if use_kernels(qI_BShe, kernels):   # fused scores (no [B, S, h, N] intermediate), then the selection
            score_BSN = index_scores(qI_BShe, w_BSh, k_BNe, pos_BS, self.cfg.ratio)
            return topk_select(score_BSN, k, torch.int32)   # valid ids ascending, then -1; ties: lowest ids (topk.py)
        s_BShN = torch.einsum("bshe,bne->bshn", qI_BShe, k_BNe.to(qI_BShe.dtype)).float().relu()
        score_BSN = (s_BShN * w_BSh[..., None]).sum(dim=2)
        visible_BSN = torch.arange(num_slots, device=pos_BS.device) < ((pos_BS + 1) // self.cfg.ratio)[..., None]
        score_BSN = score_BSN.masked_fill(~visible_BSN, float("-inf"))
        val_BSK, idx_BSK = score_BSN.topk(k, dim=-1)
        return torch.where(val_BSK == float("-inf"), torch.full_like(idx_BSK, -1), idx_BSK)

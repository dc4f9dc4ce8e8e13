"""``V4DecoderLayer``: one DeepSeek-V4 block = attention site + MoE site, each wrapped in mHC.

Legend: B batch, S seq, N hc streams, D hidden, T = B*S tokens.

  X [B, S, N, D] --hc_pre(attn_hc)--> h --attn_norm--> V4Attention --hc_post--> X1
  X1 --hc_pre(ffn_hc)--> h --ffn_norm--> WaveMoE on the flattened [T, D] tokens --hc_post--> X2

The MoE is the expert-parallel ``WaveMoE`` (every rank of the EP group must call the layer together);
attention and mHC are local to the rank.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import AttnCache, ScheduleConfig, V4Attention
from .attention.compressor import rms_norm
from .config import require_hf
from .mhc import HyperConnection, hc_post

__all__ = ["V4DecoderLayer"]


class V4DecoderLayer(nn.Module):
    """A V4 decoder layer.

    Forward: ``X2 = layer(X, positions=pos, input_ids=ids, cache=None)``; X [B, S, hc_mult, D],
    pos [B, S] int64, ids [B, S] (needed by hash-routed layers); cache from ``new_cache`` (the
    attention's, see ``moe_wave.attention.cache``). Returns [B, S, hc_mult, D] in X's dtype.
    """

    def __init__(self, attn: V4Attention, moe: nn.Module, attn_hc: HyperConnection, ffn_hc: HyperConnection,
                 attn_norm: torch.Tensor, ffn_norm: torch.Tensor, eps: float):
        super().__init__()
        self.attn, self.moe, self.attn_hc, self.ffn_hc = attn, moe, attn_hc, ffn_hc
        self.attn_norm = nn.Parameter(attn_norm.detach().float().clone())
        self.ffn_norm = nn.Parameter(ffn_norm.detach().float().clone())
        self.eps = eps

    @classmethod
    def from_hf(cls, hf_layer, hf_config, layer_idx: int, *, ep=None, wave=None,
                schedule: ScheduleConfig | None = None) -> "V4DecoderLayer":
        """Copy a transformers 5.23 ``DeepseekV4DecoderLayer``; under EP each rank keeps its experts. Needs
        transformers: pip install 'moe-wave[hf]'."""
        require_hf("V4DecoderLayer.from_hf")
        from .moe import WaveMoE  # lazy: the MoE side pulls in the comm backends

        attn = V4Attention.from_hf(hf_layer.self_attn, hf_config, layer_idx=layer_idx, schedule=schedule)
        moe = WaveMoE.from_hf(hf_layer.mlp, hf_config, ep=ep, wave=wave, layer_idx=layer_idx)
        dev = moe.gate.weight.device
        return cls(attn.to(dev), moe, HyperConnection.from_hf(hf_layer.attn_hc, hf_config).to(dev),
                   HyperConnection.from_hf(hf_layer.ffn_hc, hf_config).to(dev),
                   hf_layer.input_layernorm.weight.to(dev), hf_layer.post_attention_layernorm.weight.to(dev),
                   hf_config.rms_norm_eps)

    def new_cache(self, batch: int, max_len: int, device=None, dtype=None) -> AttnCache:
        return self.attn.new_cache(batch, max_len, device, dtype)

    def forward(self, X: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor | None = None,
                cache: AttnCache | None = None, *, validate: bool = True, overlap: bool | None = None,
                moe_overlap: bool | None = None) -> torch.Tensor:
        """``overlap`` overrides the attention's stream schedule, ``moe_overlap`` the MoE's wave pipeline
        (None: their configured ``ScheduleConfig`` / ``WaveConfig``)."""
        k = self.attn.schedule.kernels
        h, post, comb = self.attn_hc.hc_pre(X)
        o = self.attn(rms_norm(h, self.attn_norm, self.eps, k), positions=positions, cache=cache,
                      validate=validate, overlap=overlap)
        X = hc_post(o, X, post, comb)
        h, post, comb = self.ffn_hc.hc_pre(X)
        B, S, D = h.shape
        ids = None if input_ids is None else input_ids.reshape(-1)
        y = self.moe(rms_norm(h, self.ffn_norm, self.eps, k).reshape(B * S, D), input_ids=ids, overlap=moe_overlap)
        return hc_post(y.view(B, S, D), X, post, comb)

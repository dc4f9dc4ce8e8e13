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
from .graphs import BucketGraphs, graph_capable
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
        self.graphs: BucketGraphs | None = None     # capture_graphs() fills it

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

    @torch.no_grad()
    def capture_graphs(self, buckets, modes=((None, None),)) -> "V4DecoderLayer":
        """Capture the whole layer (attention front-end and core, mHC, MoE) in CUDA graphs, one per (token bucket,
        mode), for prefill of one sequence per rank without a cache: X [1, S, N, D]. A call with S tokens then
        replays the smallest bucket >= S (the pad sits at the end: attention is causal, and the MoE sends it
        nowhere); a larger S, a batch > 1 or a cache runs eagerly. ``modes``: (overlap, moe_overlap) pairs as
        ``forward`` takes them. Collective: every rank captures the same buckets together (``moe_wave.graphs``).
        ValueError where the MoE's backend or the device cannot capture."""
        why = graph_capable(getattr(self.moe, "backend", None), self.attn_norm.device)
        if why is not None:
            raise ValueError(f"V4DecoderLayer.capture_graphs: {why}")
        ep = getattr(self.moe, "ep", None)
        if ep is not None:
            ep.check_same("V4DecoderLayer.capture_graphs (buckets, modes)", (tuple(buckets), tuple(modes)))
        graphs = BucketGraphs(buckets, self.attn_norm.device)
        N, D = self.attn_hc.cfg.mult, self.attn_hc.cfg.hidden
        dev, dt = self.attn_norm.device, self.attn.kv_norm.dtype
        for b in graphs.buckets:
            static = {"X": torch.zeros(1, b, N, D, device=dev, dtype=dt),
                      "positions": torch.arange(b, device=dev)[None],
                      "input_ids": torch.zeros(1, b, dtype=torch.long, device=dev)}
            for mode in modes:
                ov, mov = mode
                graphs.capture(b, tuple(mode), dict(static), lambda n, **kw: self._forward_eager(
                    kw["X"], kw["positions"], kw["input_ids"], None, validate=False, overlap=ov, moe_overlap=mov,
                    num_valid=n))
        self.graphs = graphs
        return self

    def forward(self, X: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor | None = None,
                cache: AttnCache | None = None, *, validate: bool = True, overlap: bool | None = None,
                moe_overlap: bool | None = None) -> torch.Tensor:
        """``overlap`` overrides the attention's stream schedule, ``moe_overlap`` the MoE's wave pipeline
        (None: their configured ``ScheduleConfig`` / ``WaveConfig``). After ``capture_graphs`` a call that fits
        a captured bucket and mode replays it."""
        g = self.graphs
        if (g is not None and cache is None and X.shape[0] == 1 and not torch.cuda.is_current_stream_capturing()):
            S = X.shape[1]
            b = g.bucket_for(S)
            if b is not None and g.has(b, (overlap, moe_overlap)):
                inputs = {"X": X, "positions": positions}
                if input_ids is not None:
                    inputs["input_ids"] = input_ids
                return g.replay(b, (overlap, moe_overlap), inputs, S, token_dim=1)
        return self._forward_eager(X, positions, input_ids, cache, validate=validate, overlap=overlap,
                                   moe_overlap=moe_overlap)

    def _forward_eager(self, X, positions, input_ids, cache, *, validate: bool, overlap, moe_overlap,
                       num_valid: torch.Tensor | None = None) -> torch.Tensor:
        k = self.attn.schedule.kernels
        h, post, comb = self.attn_hc.hc_pre(X, k)
        o = self.attn(rms_norm(h, self.attn_norm, self.eps, k), positions=positions, cache=cache,
                      validate=validate, overlap=overlap)
        X = hc_post(o, X, post, comb, k)
        h, post, comb = self.ffn_hc.hc_pre(X, k)
        B, S, D = h.shape
        ids = None if input_ids is None else input_ids.reshape(-1)
        x = rms_norm(h, self.ffn_norm, self.eps, k).reshape(B * S, D)
        y = (self.moe(x, input_ids=ids, overlap=moe_overlap) if num_valid is None else
             self.moe(x, input_ids=ids, overlap=moe_overlap, num_valid=num_valid))
        return hc_post(y.view(B, S, D), X, post, comb, k)

"""``V4Attention``: the DeepSeek-V4 attention layer (sliding, CSA c4 + indexer, HCA), math only.

Legend: B batch, S chunk length, D hidden, H heads, d head_dim, r rope dim, L q_lora rank,
G output groups, Ro o_lora rank, W window, N compressed-entry slots, K picked entries.

The stream schedule is in ``schedule.py``; the cache in ``cache.py``. Switches: ``ScheduleConfig.overlap``
(side streams) and ``ScheduleConfig.kernels`` (the fused Triton kernels), see schedule.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import require_hf
from ..comm.streams import current_stream, keep_alive, on, record, wait
from ..fp8 import (BLOCK, FP8, FP8Linear, GroupedFP8, QAct, act_quant, dequant_weight, hf_fp8_payload, hf_weight,
                   weight_quant)
from .cache import AttnCache
from .compressor import Compressor, CompressorConfig, rms_norm
from .indexer import Indexer, IndexerConfig
from .kernels import norm_rope, picks, rms_norm_quant, use_kernels
from .rope import RopeConfig, inv_freq, rope_config_from_hf, rope_tail
from .schedule import ScheduleConfig, high_stream, is_capturing, run_frontend, side_streams
from .sparse_core import q_norm_inside, sparse_attention

__all__ = ["AttnConfig", "V4Attention", "LAYER_TYPES"]

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
# quantize_fp8(wo_a_fp8="auto")'s default: calls of at least this many tokens run the grouped FP8 wo_a (the FP8
# GEMMs win in prefill, the bf16 einsum at decode batches: benchmarks/results/attn.md)
WO_A_FP8_MIN_TOKENS = 2048


@dataclass(frozen=True, kw_only=True)
class AttnConfig:
    """Shapes of one V4 attention layer. ``ratio`` is 0 for sliding layers."""

    layer_type: str
    hidden: int
    heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    rope: RopeConfig
    ratio: int = 0
    index_heads: int = 0
    index_dim: int = 0
    index_topk: int = 0
    eps: float = 1e-6

    def __post_init__(self):
        if self.layer_type not in LAYER_TYPES:
            raise ValueError(f"AttnConfig.layer_type={self.layer_type!r}: must be one of {LAYER_TYPES}")
        for name in ("hidden", "heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "window"):
            if getattr(self, name) <= 0:
                raise ValueError(f"AttnConfig.{name}={getattr(self, name)}: must be > 0")
        if (self.ratio > 0) == (self.layer_type == "sliding_attention"):
            raise ValueError(f"AttnConfig.ratio={self.ratio}: must be 0 for sliding layers and > 0 otherwise "
                             f"(layer_type={self.layer_type!r})")
        if self.heads * self.head_dim % self.o_groups:
            raise ValueError(f"AttnConfig.o_groups={self.o_groups}: must divide heads*head_dim="
                             f"{self.heads * self.head_dim}")
        if self.rope.dim > self.head_dim:
            raise ValueError(f"AttnConfig.rope.dim={self.rope.dim}: must be <= head_dim={self.head_dim}")
        if self.layer_type == "compressed_sparse_attention" and min(self.index_heads, self.index_dim,
                                                                    self.index_topk) <= 0:
            raise ValueError(f"AttnConfig index_heads={self.index_heads}, index_dim={self.index_dim}, "
                             f"index_topk={self.index_topk}: must all be > 0 for CSA layers")

    @classmethod
    def from_hf(cls, hf_config, layer_idx: int, ratio: int) -> "AttnConfig":
        c, lt = hf_config, hf_config.layer_types[layer_idx]
        csa = lt == "compressed_sparse_attention"
        return cls(layer_type=lt, hidden=c.hidden_size, heads=c.num_attention_heads, head_dim=c.head_dim,
                   q_lora_rank=c.q_lora_rank, o_groups=c.o_groups, o_lora_rank=c.o_lora_rank,
                   window=c.sliding_window, rope=rope_config_from_hf(c, lt), ratio=ratio,
                   index_heads=c.index_n_heads if csa else 0, index_dim=c.index_head_dim if csa else 0,
                   index_topk=c.index_topk if csa else 0, eps=c.rms_norm_eps)


class V4Attention(nn.Module):
    """DeepSeek-V4 attention: q-LoRA, single shared K=V head, sliding window, compressed entries
    (CSA: top-k by the lightning indexer; HCA: all), per-head sinks, grouped output projection.

    Forward: ``attn(x, positions=pos, cache=None)``, x [B, S, D] -> [B, S, D]. Without a cache the
    rows are fresh sequences (positions must be 0..S-1). With ``cache=attn.new_cache(...)`` it
    continues the cached rows (prefill, chunked prefill, decode; see ``cache.py``).
    """

    def __init__(self, cfg: AttnConfig, schedule: ScheduleConfig | None = None):
        super().__init__()
        self.cfg = cfg
        self.schedule = schedule if schedule is not None else ScheduleConfig()
        H, d, D, L = cfg.heads, cfg.head_dim, cfg.hidden, cfg.q_lora_rank
        self.q_a_proj = nn.Linear(D, L, bias=False)
        self.q_a_norm = nn.Parameter(torch.ones(L))
        self.q_b_proj = nn.Linear(L, H * d, bias=False)
        self.kv_proj = nn.Linear(D, d, bias=False)
        self.kv_norm = nn.Parameter(torch.ones(d))
        self.o_a_weight = nn.Parameter(torch.empty(cfg.o_groups * cfg.o_lora_rank, H * d // cfg.o_groups))
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, D, bias=False)
        self.sinks = nn.Parameter(torch.zeros(H))
        csa = cfg.layer_type == "compressed_sparse_attention"
        self.compressor = None if cfg.ratio == 0 else Compressor(
            CompressorConfig(hidden=D, dim=d, ratio=cfg.ratio, overlap=csa, eps=cfg.eps))
        self.indexer = None if not csa else Indexer(IndexerConfig(
            hidden=D, q_lora_rank=L, heads=cfg.index_heads, dim=cfg.index_dim, topk=cfg.index_topk,
            ratio=cfg.ratio, eps=cfg.eps))
        self.register_buffer("freq_F", inv_freq(cfg.rope), persistent=False)     # fp32 always (see _apply)
        self.o_a_fp8: GroupedFP8 | None = None     # quantize_fp8(wo_a_fp8=True) (which drops o_a_weight) or "auto"
        self.o_a_fp8_min_tokens = 0                 # "auto": the FP8 wo_a from this many tokens (B * S) a call on
        nn.init.normal_(self.o_a_weight, std=0.02)

    def _apply(self, fn, recurse=True):
        """``.to(dtype)`` casts every floating buffer; the RoPE frequencies stay fp32 (the official code keeps them
        fp32; in bf16 the angle of a late position drifts by whole radians, and the kernels, which read fp32
        frequencies, would copy them on every call): recomputed, not cast back."""
        out = super()._apply(fn, recurse)
        if self.freq_F.dtype != torch.float32:
            self.freq_F = inv_freq(self.cfg.rope, device=self.freq_F.device)
        return out

    @property
    def fp8(self) -> bool:
        """Whether the projections are in the FP8 format (``quantize_fp8``)."""
        return isinstance(self.o_b_proj, FP8Linear)

    def quantize_fp8(self, wo_a_fp8: bool | str = False,
                     wo_a_fp8_min_tokens: int = WO_A_FP8_MIN_TOKENS) -> "V4Attention":
        """Store the projections as the released checkpoints do (spec section 5): wq_a, wq_b, wkv, wo_b and the
        indexer's wq_b in float8 e4m3 with one power-of-two scale per 128 x 128 block, their inputs quantised
        per (token, 128 channels) on the fly (``moe_wave.fp8``): on a Hopper GPU FP8 tensor-core GEMMs
        (``torch._scaled_mm``), on CPU the same math dequantised. The bf16 weights are dropped (like loading an
        FP8 checkpoint).

        wo_a: as the official inference code does, its FP8 weight dequantised to the model dtype and the grouped
        product in that dtype (default); ``wo_a_fp8=True``: G FP8 GEMMs on the core's quantised output (as S4 /
        S5 do: faster in prefill, slower at decode batches, where the G small block-scaled GEMMs cost more than
        the bf16 einsum: ``benchmarks/results/attn.md``). ``wo_a_fp8="auto"``: both, the FP8 GEMMs
        for calls of at least ``wo_a_fp8_min_tokens`` tokens (prefill), the dequantised bf16 product below (decode);
        the two round differently, so a layer's prefill and decode outputs then come from two wo_a products.
        Returns self."""
        if wo_a_fp8 not in (False, True, "auto"):
            raise ValueError(f"quantize_fp8: wo_a_fp8={wo_a_fp8!r} must be False, True or 'auto'")
        if wo_a_fp8_min_tokens < 0:
            raise ValueError(f"quantize_fp8: wo_a_fp8_min_tokens={wo_a_fp8_min_tokens} must be >= 0")
        if self.fp8:
            return self
        for name in ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj"):
            setattr(self, name, FP8Linear.from_linear(getattr(self, name)))
        if wo_a_fp8:
            self.o_a_fp8 = GroupedFP8(self.o_a_weight.detach(), self.cfg.o_groups)
        if wo_a_fp8 is True:
            self.o_a_weight = None
        else:
            with torch.no_grad():
                self.o_a_weight.copy_(dequant_weight(*weight_quant(self.o_a_weight.detach())))
        if self.indexer is not None:
            self.indexer.q_b_proj = FP8Linear.from_linear(self.indexer.q_b_proj)
        self.o_a_fp8_min_tokens = wo_a_fp8_min_tokens if wo_a_fp8 == "auto" else 0
        return self

    def fp8_out(self, tokens: int) -> bool:
        """Whether a call of ``tokens`` (B * S) tokens runs the FP8 wo_a (its input quantised by the core)."""
        return self.o_a_fp8 is not None and (self.o_a_weight is None or tokens >= self.o_a_fp8_min_tokens)

    # ----------------------------------------------------------------------------------- loading
    @classmethod
    def from_hf(cls, hf_attn, hf_config, layer_idx: int, schedule: ScheduleConfig | None = None) -> "V4Attention":
        """Copy a transformers 5.23 ``DeepseekV4Attention``; the ratio is read from its compressor. Needs
        transformers: pip install 'moe-wave[hf]'.

        An FP8 checkpoint (its projections loaded as transformers' ``FP8Linear``: e4m3 weights with 128 x 128
        block scales) gives an FP8 layer (``quantize_fp8``'s layout) holding the checkpoint's bytes unchanged;
        wo_a and any other FP8 weight of a module kept dense here (compressor, indexer weights) are dequantised.
        The model dtype is that of the norms."""
        require_hf("V4Attention.from_hf")
        ratio = 0 if hf_attn.compressor is None else int(hf_attn.compressor.compress_rate)
        mod = cls(AttnConfig.from_hf(hf_config, layer_idx, ratio), schedule)
        eps = hf_config.rms_norm_eps
        fp8 = hf_fp8_payload(hf_attn.q_a_proj) is not None
        with torch.no_grad():
            for name in ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj"):
                if fp8:
                    setattr(mod, name, FP8Linear.from_hf(getattr(hf_attn, name)))
                else:
                    getattr(mod, name).weight.copy_(getattr(hf_attn, name).weight)
            mod.q_a_norm.copy_(hf_attn.q_a_norm.weight)
            mod.kv_norm.copy_(hf_attn.kv_norm.weight)
            mod.o_a_weight.copy_(hf_weight(hf_attn.o_a_proj))
            mod.sinks.copy_(hf_attn.sinks)
        if ratio:
            csa = mod.indexer is not None
            mod.compressor = Compressor.from_hf(hf_attn.compressor, hidden=hf_config.hidden_size, overlap=csa, eps=eps)
            if csa:
                mod.indexer = Indexer.from_hf(hf_attn.compressor.indexer, hf_config)
                if fp8:
                    mod.indexer.q_b_proj = FP8Linear.from_hf(hf_attn.compressor.indexer.q_b_proj)
        return mod.to(hf_attn.q_a_norm.weight.dtype)

    def new_cache(self, batch: int, max_len: int, device=None, dtype=None) -> AttnCache:
        """Empty cache for ``batch`` rows of up to ``max_len`` tokens (default: this module's device/dtype)."""
        w = self.kv_norm                            # the model dtype (the projections may be FP8)
        return AttnCache(batch=batch, max_len=max_len, window=self.cfg.window, head_dim=self.cfg.head_dim,
                         comp_cfg=None if self.compressor is None else self.compressor.cfg,
                         index_cfg=None if self.indexer is None else self.indexer.compressor.cfg,
                         device=device if device is not None else w.device, dtype=dtype if dtype is not None else w.dtype)

    # ------------------------------------------------------------------------------ branch math
    def x_quant(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """x in the FP8 format (``act_quant``), once for the two FP8 projections that read it (wq_a and wkv,
        which would each quantise it: the same bits); None for a bf16 layer."""
        return act_quant(x_BSD.reshape(-1, self.cfg.hidden)) if self.fp8 else None

    @staticmethod
    def _proj(lin, x_BSD: torch.Tensor, xq: tuple | None) -> torch.Tensor:
        """``lin(x)``, or with x already quantised (``x_quant``) the FP8 GEMM on it."""
        if xq is None:
            return lin(x_BSD)
        return lin.forward_q(*xq, x_BSD.dtype).view(*x_BSD.shape[:-1], lin.out_features)

    def q_lora(self, x_BSD: torch.Tensor, xq: tuple | None = None) -> torch.Tensor | QAct:
        """wq_a and q_norm: [B, S, L]. Where every projection that reads it is FP8 (wq_b, the indexer's wq_b) and
        the kernels run, the normalised rows leave already quantised, as the ``QAct`` both take (one pass for the
        norm and the quantisation, once for the two): the same bits as each quantising the bf16 tensor."""
        qa = self._proj(self.q_a_proj, x_BSD, xq)
        k = self.schedule.kernels
        readers = [self.q_b_proj] + ([self.indexer.q_b_proj] if self.indexer is not None else [])
        if use_kernels(qa, k) and all(isinstance(r, FP8Linear) for r in readers):
            return rms_norm_quant(qa, self.q_a_norm, self.cfg.eps)
        return rms_norm(qa, self.q_a_norm, self.cfg.eps, k)

    def q_heads(self, qr_BSL: torch.Tensor | QAct, pos_BS: torch.Tensor, raw: bool = False) -> torch.Tensor:
        """The query heads [B, S, H, d]: wq_b, per-head RMSNorm, RoPE on the tail (raw=True: wq_b's output)."""
        B, S, _ = qr_BSL.shape
        q = self.q_b_proj(qr_BSL).view(B, S, self.cfg.heads, self.cfg.head_dim)
        return q if raw else self.q_norm_rope(q, pos_BS)

    def q_branch(self, qr_BSL: torch.Tensor | QAct, pos_BS: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The q branch's result (``run_frontend``): (q [B, S, H, d], raw). raw: q is wq_b's output and the core
        applies the norm and RoPE as it loads q (``core_norms_q``: Hopper prefill, the CUDA core, which saves a
        pass over q). Elsewhere they stay on the q branch, beside the other branches, which the decode layer
        measured faster than the Triton kernel's prologue (``benchmarks/results/attn.md``)."""
        q = self.q_heads(qr_BSL, pos_BS, raw=True)
        if self.core_norms_q(q):
            return q, True
        return self.q_norm_rope(q, pos_BS), False

    def core_norms_q(self, q_BSHd: torch.Tensor) -> bool:
        """Whether this layer's core applies q's per-head RMSNorm and RoPE itself for a raw q like this one
        (``sparse_core.q_norm_inside``: the CUDA core runs, a large grid on Hopper)."""
        return use_kernels(q_BSHd, self.schedule.kernels) and \
            q_norm_inside(q_BSHd, 1 if self.compressor is None else 2, self.schedule.core)

    def q_norm_rope(self, q: torch.Tensor, pos_BS: torch.Tensor) -> torch.Tensor:
        """q [B, S, H, d] fresh from wq_b, normalised per head and its tail rotated, in place."""
        if use_kernels(q, self.schedule.kernels):   # per-head RMSNorm + RoPE in one pass, in place
            return norm_rope(q, pos_BS, self.freq_F, eps=self.cfg.eps, out=q)
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.cfg.eps).to(q.dtype)
        return rope_tail(q, pos_BS, self.freq_F, inplace=True, kernels=self.schedule.kernels)   # q is fresh

    def window_kv(self, x_BSD: torch.Tensor, pos_BS: torch.Tensor, xq: tuple | None = None) -> torch.Tensor:
        kv = self._proj(self.kv_proj, x_BSD, xq)
        if use_kernels(kv, self.schedule.kernels):   # RMSNorm(kv_norm) + RoPE in one pass, in place
            return norm_rope(kv, pos_BS, self.freq_F, weight=self.kv_norm, eps=self.cfg.eps, out=kv)
        k = self.schedule.kernels
        return rope_tail(rms_norm(kv, self.kv_norm, self.cfg.eps, k), pos_BS, self.freq_F, inplace=True, kernels=k)

    def window_source(self, kv_BSd: torch.Tensor, pos_BS: torch.Tensor, cache: AttnCache):
        """Key source ``[ring | chunk]`` [B, W+S, d] and each query's W window rows [B, S, W] (-1: none)."""
        src_BMd = torch.cat([cache.win_BWd, kv_BSd.to(cache.win_BWd.dtype)], dim=1)
        return src_BMd, self._picks(pos_BS, window=self.cfg.window)

    def window_write(self, kv_BSd: torch.Tensor, pos_BS: torch.Tensor, cache: AttnCache) -> None:
        k = min(kv_BSd.shape[1], self.cfg.window)
        row = (pos_BS[:, -k:] % self.cfg.window)[..., None].expand(-1, -1, kv_BSd.shape[-1])
        cache.win_BWd.scatter_(1, row, kv_BSd[:, -k:].to(cache.win_BWd.dtype))

    def hca_index(self, pos_BS: torch.Tensor, cache: AttnCache) -> torch.Tensor:
        """HCA: every slot, the ones not yet complete for the query masked to -1. [B, S, N]"""
        return self._picks(pos_BS, slots=cache.comp.num_slots, ratio=self.cfg.ratio)

    def _picks(self, pos_BS: torch.Tensor, **part) -> torch.Tensor:
        """A part's per-query rows (``kernels.picks``): with the kernels one launch, int32 (the core kernels read
        int32 picks with fewer registers than int64); else the torch ops, int64."""
        on = use_kernels(pos_BS, self.schedule.kernels)
        return picks(pos_BS, dtype=torch.int32 if on else torch.int64, kernel=on, **part)

    def index_topk(self, qI_BShe: torch.Tensor, w_BSh: torch.Tensor, pos_BS: torch.Tensor,
                   cache: AttnCache) -> torch.Tensor:
        """CSA: the indexer's picks [B, S, K] for every query (the fused kernel scores all S at once;
        the torch ops go by query blocks to bound their [B, q_block, h, N] temporaries)."""
        ix, st, k = self.indexer, cache.index, self.schedule.kernels
        if use_kernels(qI_BShe, k):
            return ix.select(qI_BShe, w_BSh, st.entries_BNd, pos_BS, st.num_slots, k)
        return self.chunked(lambda sl: ix.select(qI_BShe[:, sl], w_BSh[:, sl], st.entries_BNd, pos_BS[:, sl],
                                                 st.num_slots, k), pos_BS.shape[1])

    def chunked(self, fn, S: int) -> torch.Tensor:
        """Run ``fn(slice)`` over query blocks of ``schedule.q_block`` and concatenate on dim 1."""
        qb = self.schedule.q_block
        if S <= qb:
            return fn(slice(0, S))
        return torch.cat([fn(slice(i, min(i + qb, S))) for i in range(0, S, qb)], dim=1)

    def project_out(self, o_BSHd: torch.Tensor) -> torch.Tensor:
        """Grouped o_a then o_b of the core's output (V's RoPE already undone). [B, S, D]"""
        B, S = o_BSHd.shape[:2]
        G, Ro = self.cfg.o_groups, self.cfg.o_lora_rank
        if self.fp8_out(B * S):
            o_q, s = act_quant(o_BSHd.reshape(B * S, -1))
            return self.output_q(o_q, s, B, S, o_BSHd.dtype)
        o = o_BSHd.reshape(B, S, G, -1)
        z_BSGR = torch.einsum("bsgk,grk->bsgr", o, self.o_a_weight.view(G, Ro, -1))
        return self.o_b_proj(z_BSGR.flatten(2))

    def output_q(self, o_q: torch.Tensor, s_KbM: torch.Tensor, B: int, S: int, dtype: torch.dtype) -> torch.Tensor:
        """The FP8 output projections from the core's output already quantised (``act_quant`` format, the
        inverse RoPE applied): grouped wo_a, then wo_b on the group-major z read in place. [B, S, D]"""
        sc = self.schedule
        if sc.wo_a_overlap and o_q.is_cuda and o_q.shape[0] >= sc.wo_a_overlap_min_tokens:
            z_q, z_s = self._wo_a_overlapped(o_q, s_KbM, dtype)
        else:
            z_GMR = self.o_a_fp8.forward_q(o_q, s_KbM, dtype)
            z_q, z_s = act_quant(z_GMR, groups=self.cfg.o_groups)
        return self.o_b_proj.forward_q(z_q, z_s, dtype).view(B, S, -1)

    def _wo_a_overlapped(self, o_q: torch.Tensor, s_KbM: torch.Tensor, dtype: torch.dtype):
        """The grouped FP8 wo_a and the quantisation of its output z (``ScheduleConfig.wo_a_overlap``): the groups'
        GEMMs on a priority -1 stream (``schedule.high_stream``: their CTAs get the SMs first), each group's
        ``act_quant`` into its columns of z's FP8 pair on a side stream as soon as its GEMM ends, beside the next
        groups' GEMMs. The same bits as the serial chain (each group's GEMM and each 128 channels' scale are the same
        calls). Returns (z_q [M, G*R], z_s)."""
        a = self.o_a_fp8
        G, R = a.groups, a.rank
        nb = R // BLOCK
        M, dev = o_q.shape[0], o_q.device
        z = torch.empty(G, M, R, dtype=dtype, device=dev)
        z_q = torch.empty(M, G * R, dtype=FP8, device=dev)
        z_s = torch.empty(G * nb, M, dtype=torch.float32, device=dev)
        main, side, hi = current_stream(dev), side_streams(dev)[0], high_stream(dev)
        others = (side, hi)
        start = record(main)                    # o_q, its scales and the fresh tensors: made on the caller's stream
        for s in others:
            wait(start, s)
        for g in range(G):
            with on(hi):
                a.forward_group(o_q, s_KbM, g, dtype, out=z[g])
                done = record(hi)
            with on(side):
                wait(done)
                act_quant(z[g], out=(z_q[:, g * R:(g + 1) * R], z_s[g * nb:(g + 1) * nb]))
        for s in others:
            wait(record(s), main)
        if not is_capturing(dev):               # eager: the caching allocator hands memory out by stream
            for t in (z, z_q, z_s, o_q, s_KbM):
                for s in others:
                    keep_alive(t, s)
        return z_q, z_s

    # ---------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: AttnCache | None = None, *,
                validate: bool = True, overlap: bool | None = None) -> torch.Tensor:
        """Attention over x.

        Args:
            x: [B, S, D] normalised hidden states (attn_norm(hc_pre(X))).
            positions: [B, S] int64 absolute positions; with a cache ``cache.length[b] + arange(S)``.
            cache: ``AttnCache`` from ``new_cache``, updated in place; None: fresh sequences.
            validate: check positions / capacity (one host sync; skipped under CUDA-graph capture).
            overlap: override ``schedule.overlap`` for this call.
        Returns:
            [B, S, D] in x's dtype.
        """
        if x.dim() != 3 or x.shape[-1] != self.cfg.hidden:
            raise ValueError(f"x.shape={tuple(x.shape)}: must be [B, S, hidden={self.cfg.hidden}]")
        if tuple(positions.shape) != tuple(x.shape[:2]):
            raise ValueError(f"positions.shape={tuple(positions.shape)}: must equal x.shape[:2]={tuple(x.shape[:2])}")
        B, S, _ = x.shape
        store = cache is not None   # a throw-away cache needs no state for a next step
        if cache is None:
            cache = self.new_cache(B, S, x.device, x.dtype)
        if validate and not is_capturing(x.device):
            cache.check(positions)
        if is_capturing(x.device) and cache.has_pending:
            raise ValueError("cache.pending: the cache has writes from an eager call in flight; call cache.join() "
                             "before capturing a CUDA graph (a capture may not wait on outside events)")
        cache.join()
        use_overlap = self.schedule.use_overlap(B, S) if overlap is None else overlap
        fe = run_frontend(self, x, positions, cache, use_overlap, store=store)
        o = self.core(fe, positions)
        cache.advance(S)
        if is_capturing(x.device):
            cache.join()  # every side stream joins the capture stream before the captured step ends
        return self.output_q(*o, B, S, x.dtype) if isinstance(o, tuple) else self.project_out(o)

    def core(self, fe, pos_BS: torch.Tensor):
        """The sparse core on the front-end's result, V's RoPE undone: o [B, S, H, d], or with a grouped FP8
        wo_a (``quantize_fp8(wo_a_fp8=True)``) the quantised pair (o_q [B*S, H*d], s) that ``output_q`` takes.
        The kernels do the inverse RoPE and the quantisation in their epilogues (the CUDA core; the Triton kernel
        on small grids) or as the passes after the core (``CoreTuning.fuse_max_waves``)."""
        scale, k = self.cfg.head_dim ** -0.5, self.schedule.kernels
        q, S = fe.q_BSHd, fe.q_BSHd.shape[1]
        fp8 = self.fp8_out(q.shape[0] * S)
        q_rope = (pos_BS, self.freq_F, self.cfg.eps) if fe.q_raw else None
        if use_kernels(q, k):   # the kernel gathers nothing, so it needs no query blocks
            return sparse_attention(q, fe.parts, self.sinks, scale, k, q_rope=q_rope, o_rope=(pos_BS, self.freq_F),
                                    out_fp8=fp8, tuning=self.schedule.core)
        if fe.q_raw:
            q = self.q_norm_rope(q, pos_BS)
        core = lambda sl: sparse_attention(  # noqa: E731
            q[:, sl], [(src, idx[:, sl]) for src, idx in fe.parts], self.sinks, scale, k, tuning=self.schedule.core)
        o = rope_tail(self.chunked(core, S), pos_BS, self.freq_F, inverse=True, inplace=True, kernels=k)
        return act_quant(o.reshape(-1, o.shape[2] * o.shape[3])) if fp8 else o

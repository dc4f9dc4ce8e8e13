"""Sparse attention core of DeepSeek-V4 (spec 3.5): MQA over gathered entries, with sinks.

Legend: B batch, S queries, H heads, d head_dim, M rows of a key source, J entries picked per query.

Each query attends to a few *parts*, each a key/value source ``kv_BMd`` (K = V, one head shared by
all H query heads) and per-query row ids ``idx_BSJ`` (-1 = nothing): the sliding window (J = W) and
the compressed entries (CSA: the indexer's top-k; HCA: every slot, invisible ones -1). Rows are
gathered per query, so memory is O(S * (W + K) * d), never S x S. The softmax runs in fp32 and the
per-head sink logit takes probability mass in the denominator only.
"""

from __future__ import annotations

import torch

from moe_wave.fp8 import act_quant_torch

from .core_kernel import check_fusion, sparse_attention_fused
from .kernels import norm_rope_torch, use_kernels

__all__ = ["sparse_attention", "gather_rows"]


def gather_rows(src_BMd: torch.Tensor, idx_BSJ: torch.Tensor) -> torch.Tensor:
    """[B, S, J, d] rows of ``src`` (ids clamped to 0; callers mask the -1 picks)."""
    B = src_BMd.shape[0]
    b_B11 = torch.arange(B, device=src_BMd.device)[:, None, None]
    return src_BMd[b_B11, idx_BSJ.clamp(min=0)]


def sparse_attention(q_BSHd: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]], sinks_H: torch.Tensor,
                     scale: float, kernels: str = "auto", *, q_rope=None, o_rope=None, out_fp8: bool = False):
    """Attention of every query over the rows its parts pick.

    Args:
        q_BSHd: queries.
        parts: ``(kv_BMd, idx_BSJ)`` pairs; ids index dim 1 of ``kv_BMd``, -1 is masked out.
        sinks_H: per-head sink logits (fp32).
        scale: softmax scale (head_dim^-1/2).
        kernels: ``ScheduleConfig.kernels``.
        q_rope: ``(pos_BS, freq_F, eps)``: q is raw; first ``norm_rope(q, pos, freq, eps=eps)`` (per-head RMSNorm,
            no weight, then RoPE of the last 2F channels).
        o_rope: ``(pos_BS, freq_F)``: then the inverse RoPE of the output's last 2F channels.
        out_fp8: then ``fp8.act_quant_torch`` of the output as ``[B*S, H*d]`` (d a multiple of 128).
    Returns:
        o_BSHd in q's dtype. A query whose every pick is masked returns 0 (the sink takes all mass). With
        ``out_fp8`` the pair (o_q float8_e4m3fn [B*S, H*d], s fp32 [H*d/128, B*S]).
    Where ``use_kernels(q, kernels)`` one Triton kernel does it (``core_kernel.sparse_attention_fused``:
    tensor-core tiles of a token's heads against 64-key tiles, online softmax, no gather, the q_rope / o_rope /
    out_fp8 steps fused into its loads and stores); these torch ops are the CPU reference and the fallback.
    """
    if use_kernels(q_BSHd, kernels) and 1 <= len(parts) <= 2:
        return sparse_attention_fused(q_BSHd, parts, sinks_H, scale, q_rope=q_rope, o_rope=o_rope, out_fp8=out_fp8)
    check_fusion(q_BSHd, q_rope, o_rope, out_fp8)
    if q_rope is not None:
        pos_BS, freq_F, eps = q_rope
        q_BSHd = norm_rope_torch(q_BSHd, pos_BS, freq_F, eps=eps)
    rows, logits = [], []
    for kv_BMd, idx_BSJ in parts:
        kv_BSJd = gather_rows(kv_BMd, idx_BSJ).to(q_BSHd.dtype)
        s_BSHJ = torch.einsum("bshd,bsjd->bshj", q_BSHd, kv_BSJd).float() * scale
        logits.append(s_BSHJ.masked_fill((idx_BSJ < 0)[:, :, None, :], float("-inf")))
        rows.append(kv_BSJd)
    s_BSHJ = torch.cat(logits, dim=-1)
    sink_BSH = sinks_H.float().expand(s_BSHJ.shape[:-1])
    m_BSH = torch.maximum(s_BSHJ.amax(dim=-1), sink_BSH)
    e_BSHJ = (s_BSHJ - m_BSH[..., None]).exp()
    den_BSH = e_BSHJ.sum(dim=-1) + (sink_BSH - m_BSH).exp()
    p_BSHJ = (e_BSHJ / den_BSH[..., None]).to(q_BSHd.dtype)
    out, start = None, 0
    for kv_BSJd in rows:
        J = kv_BSJd.shape[2]
        o = torch.einsum("bshj,bsjd->bshd", p_BSHJ[..., start:start + J], kv_BSJd)
        out, start = (o if out is None else out + o), start + J
    if o_rope is not None:
        out = norm_rope_torch(out, o_rope[0], o_rope[1], norm=False, inverse=True)
    if out_fp8:
        B, S, H, D = out.shape
        return act_quant_torch(out.reshape(B * S, H * D))
    return out

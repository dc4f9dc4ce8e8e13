"""The sparse core in torch ops: the CPU reference and the fallback of every call (``dispatch``).

Each query attends to a few *parts*, each a key/value source ``kv_BMd`` (K = V, one head shared by all H query
heads) and per-query row ids ``idx_BSJ`` (-1 = nothing): the sliding window (J = W) and the compressed entries
(CSA: the indexer's top-k; HCA: every slot, invisible ones -1). Rows are gathered per query, so memory is
O(S * (W + K) * d), never S x S. The softmax runs in fp32 and the per-head sink logit takes probability mass in the
denominator only.
"""

from __future__ import annotations

import torch

from moe_wave.fp8 import act_quant_torch

from ..kernels import norm_rope_torch
from .call import CoreCall

__all__ = ["gather_rows", "supports", "run"]

NAME = "reference"


def gather_rows(src_BMd: torch.Tensor, idx_BSJ: torch.Tensor) -> torch.Tensor:
    """[B, S, J, d] rows of ``src`` (ids clamped to 0; callers mask the -1 picks)."""
    B = src_BMd.shape[0]
    b_B11 = torch.arange(B, device=src_BMd.device)[:, None, None]
    return src_BMd[b_B11, idx_BSJ.clamp(min=0)]


def supports(call: CoreCall) -> str | None:
    """Every call, unless a kernel was asked for."""
    if not call.reference:
        return "a kernel was asked for (sparse_attention_fused)"
    if call.impl != "auto":
        return f"impl={call.impl!r} was asked for"
    return None


def run(call: CoreCall):
    """o_BSHd in q's dtype (0 for a query whose every pick is masked: the sink takes all mass); with the FP8 step
    the pair (o_q float8_e4m3fn [B*S, H*d], s fp32 [H*d/128, B*S])."""
    q_BSHd, st = call.q, call.steps
    if st.qpos is not None:
        B, S = q_BSHd.shape[:2]
        q_BSHd = norm_rope_torch(q_BSHd, st.qpos.view(B, S), st.qfreq, eps=st.eps)
    rows, logits = [], []
    for kv_BMd, idx_BSJ in call.parts:
        kv_BSJd = gather_rows(kv_BMd, idx_BSJ).to(q_BSHd.dtype)
        s_BSHJ = torch.einsum("bshd,bsjd->bshj", q_BSHd, kv_BSJd).float() * call.scale
        logits.append(s_BSHJ.masked_fill((idx_BSJ < 0)[:, :, None, :], float("-inf")))
        rows.append(kv_BSJd)
    s_BSHJ = torch.cat(logits, dim=-1)
    sink_BSH = call.sinks.float().expand(s_BSHJ.shape[:-1])
    m_BSH = torch.maximum(s_BSHJ.amax(dim=-1), sink_BSH)
    e_BSHJ = (s_BSHJ - m_BSH[..., None]).exp()
    den_BSH = e_BSHJ.sum(dim=-1) + (sink_BSH - m_BSH).exp()
    p_BSHJ = (e_BSHJ / den_BSH[..., None]).to(q_BSHd.dtype)
    out, start = None, 0
    for kv_BSJd in rows:
        J = kv_BSJd.shape[2]
        o = torch.einsum("bshj,bsjd->bshd", p_BSHJ[..., start:start + J], kv_BSJd)
        out, start = (o if out is None else out + o), start + J
    if st.opos is not None:
        B, S = out.shape[:2]
        out = norm_rope_torch(out, st.opos.view(B, S), st.ofreq, norm=False, inverse=True)
    if st.fp8:
        B, S, H, D = out.shape
        return act_quant_torch(out.reshape(B * S, H * D))
    return out

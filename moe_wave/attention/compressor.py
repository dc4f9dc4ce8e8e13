"""Gated-pooling KV compressor of DeepSeek-V4 (spec 3.3): c4 (CSA, overlapping) and c128 (HCA).

Legend: B batch, S chunk length, D hidden, d entry dim, m ratio, c overlap multiplier (2 for the
overlapping c4 scheme, else 1), C = c*d projected channels, R = c*m state rows, n windows touched by
a chunk, J = c*m pooling slots per entry, N entry slots in the cache (+1 trash slot).

Every token t gets ``kv_t = x_t Wkv^T`` and ``score_t = x_t Wgate^T + ape[t mod m]`` ([C]). Entry i is a
per-channel softmax over its slots of ``score`` weighting ``kv``:
  plain (c=1):   slots = the m tokens of window i;
  overlap (c=2): slots = window i-1's A-halves (channels :d) then window i's B-halves (channels d:).
Then RMSNorm and RoPE at position ``i*m``.

State is a ring of the last R tokens' (kv, score), indexed by ``pos mod R``: enough to rebuild any
entry touched by the next chunk. A chunk recomputes *every* window it touches, including the trailing
partial one: the partial entry is written to its slot but stays invisible (visibility is
``j < (pos+1)//m``) and is overwritten once its window is complete. This keeps decode free of
data-dependent branches (CUDA-graph friendly) and makes chunked prefill equal the full pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..fp8 import hf_weight
from .compressor_kernels import pool_entries, ring_write
from .kernels import norm_rope, use_kernels
from .rope import rope_tail

__all__ = ["CompressorConfig", "Compressor", "CompressorState", "rms_norm"]

_MASKED = -1e30  # finite "minus infinity": a fully masked (trash) window pools to finite values, not NaN


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, kernels: str = "auto") -> torch.Tensor:
    """RMSNorm in fp32, weight (fp32) applied before the cast back, as HF 5.23 does (one fused
    kernel where ``use_kernels(x, kernels)``: ``kernels.norm_rope`` without RoPE)."""
    if use_kernels(x, kernels) and x.is_contiguous():
        return norm_rope(x, weight=weight, eps=eps)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y if weight is None else weight * y).to(x.dtype)


@dataclass(frozen=True, kw_only=True)
class CompressorConfig:
    hidden: int
    dim: int
    ratio: int
    overlap: bool
    eps: float = 1e-6

    def __post_init__(self):
        for name in ("hidden", "dim", "ratio"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CompressorConfig.{name}={getattr(self, name)}: must be > 0")

    @property
    def mult(self) -> int:
        return 2 if self.overlap else 1

    @property
    def state_rows(self) -> int:
        return self.mult * self.ratio


@dataclass
class CompressorState:
    """Per-sequence state of one compressor: ring of pending (kv, score) and the emitted entries.

    kv_BRC, score_BRC: fp32 [B, R, C], row ``pos mod R``; entries_BNd: [B, N+1, d] in the model dtype,
    entry i at row i, the last row is a trash slot for windows that fall outside the cache.
    """

    kv_BRC: torch.Tensor
    score_BRC: torch.Tensor
    entries_BNd: torch.Tensor

    @classmethod
    def empty(cls, cfg: CompressorConfig, batch: int, max_len: int, device, dtype) -> "CompressorState":
        n = -(-max_len // cfg.ratio)
        C = cfg.mult * cfg.dim
        return cls(kv_BRC=torch.zeros(batch, cfg.state_rows, C, device=device, dtype=torch.float32),
                   score_BRC=torch.zeros(batch, cfg.state_rows, C, device=device, dtype=torch.float32),
                   entries_BNd=torch.zeros(batch, n + 1, cfg.dim, device=device, dtype=dtype))

    @property
    def num_slots(self) -> int:
        return self.entries_BNd.shape[1] - 1


class Compressor(nn.Module):
    """Weights of one compressor (main: d = head_dim; indexer: d = index_head_dim)."""

    def __init__(self, cfg: CompressorConfig):
        super().__init__()
        self.cfg = cfg
        C = cfg.mult * cfg.dim
        self.kv_proj = nn.Linear(cfg.hidden, C, bias=False)
        self.gate_proj = nn.Linear(cfg.hidden, C, bias=False)
        self.ape = nn.Parameter(torch.zeros(cfg.ratio, C))
        self.norm_weight = nn.Parameter(torch.ones(cfg.dim))

    @classmethod
    def from_hf(cls, hf_mod, *, hidden: int, overlap: bool, eps: float) -> "Compressor":
        """Copy an HF compressor (or the indexer, which holds its own compressor weights)."""
        dim = hf_mod.kv_norm.weight.shape[0]
        mod = cls(CompressorConfig(hidden=hidden, dim=dim, ratio=int(hf_mod.compress_rate), overlap=overlap, eps=eps))
        with torch.no_grad():
            mod.kv_proj.weight.copy_(hf_weight(hf_mod.kv_proj))     # an FP8 checkpoint's weights dequantised
            mod.gate_proj.weight.copy_(hf_weight(hf_mod.gate_proj))
            mod.ape.copy_(hf_mod.position_bias)
            mod.norm_weight.copy_(hf_mod.kv_norm.weight)
        return mod.to(hf_mod.kv_norm.weight.dtype)

    def project(self, x_BSD: torch.Tensor, pos_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token GEMMs as they come out (x's dtype, [B, S, C] each): kv and the gate score
        before the position bias; ``emit`` and ``write_state`` take these."""
        return self.kv_proj(x_BSD), self.gate_proj(x_BSD)

    def _fp32(self, kv_BSC: torch.Tensor, gate_BSC: torch.Tensor, pos_BS: torch.Tensor):
        """fp32 kv and score = gate + ape[pos mod m] (what the ring stores)."""
        return kv_BSC.float(), gate_BSC.float() + self.ape.float()[pos_BS % self.cfg.ratio]

    def emit(self, kv_BSC: torch.Tensor, gate_BSC: torch.Tensor, pos_BS: torch.Tensor, state: CompressorState,
             freq_F: torch.Tensor, kernels: str = "auto") -> None:
        """Recompute every window the chunk touches and write them into ``state.entries_BNd``.

        Reads the ring (older tokens) and the chunk; does not modify the ring (``write_state`` does,
        and may run later on another stream, before this layer's next step). Where
        ``use_kernels(kv, kernels)`` it is one kernel, two for HCA's long windows (``compressor_kernels.pool_entries``).
        """
        cfg = self.cfg
        if use_kernels(kv_BSC, kernels):
            pool_entries(kv_BSC, gate_BSC, state.kv_BRC, state.score_BRC, self.ape, pos_BS, self.norm_weight, freq_F,
                         state.entries_BNd, ratio=cfg.ratio, mult=cfg.mult, eps=cfg.eps)
            return
        kv_BSC, score_BSC = self._fp32(kv_BSC, gate_BSC, pos_BS)
        B, S, C = kv_BSC.shape
        m, R, d = cfg.ratio, cfg.state_rows, cfg.dim
        dev = kv_BSC.device
        p0_B1 = pos_BS[:, :1]
        n = (S + m - 2) // m + 1                                          # most windows S tokens can touch
        win_Bn = p0_B1 // m + torch.arange(n, device=dev)                 # window ids touched by the chunk
        slot_J = torch.arange(R, device=dev)
        q_BnJ = (win_Bn - cfg.mult + 1)[..., None] * m + slot_J           # source position of each slot
        valid_BnJ = (q_BnJ >= 0) & (q_BnJ < p0_B1[..., None] + S)
        p0 = p0_B1[..., None]
        src_BnJ = torch.where(q_BnJ >= p0, R + q_BnJ - p0, q_BnJ % R).clamp(0, R + S - 1)
        kv_src = torch.cat([state.kv_BRC, kv_BSC], dim=1)                 # [B, R+S, C]
        sc_src = torch.cat([state.score_BRC, score_BSC], dim=1)
        idx = src_BnJ.reshape(B, n * R, 1).expand(-1, -1, C)
        kv_BnJC = kv_src.gather(1, idx).view(B, n, R, C)
        sc_BnJC = sc_src.gather(1, idx).view(B, n, R, C)
        if cfg.overlap:  # slots :m read the A-half (previous window), slots m: the B-half
            kv_BnJd = torch.cat([kv_BnJC[:, :, :m, :d], kv_BnJC[:, :, m:, d:]], dim=2)
            sc_BnJd = torch.cat([sc_BnJC[:, :, :m, :d], sc_BnJC[:, :, m:, d:]], dim=2)
        else:
            kv_BnJd, sc_BnJd = kv_BnJC, sc_BnJC
        sc_BnJd = sc_BnJd.masked_fill(~valid_BnJ[..., None], _MASKED)
        pooled_Bnd = (kv_BnJd * sc_BnJd.softmax(dim=2)).sum(dim=2)
        out_Bnd = rms_norm(pooled_Bnd.to(state.entries_BNd.dtype), self.norm_weight, cfg.eps, kernels)
        out_Bnd = rope_tail(out_Bnd, win_Bn * m, freq_F, kernels=kernels)
        # windows past the chunk's last token or past the capacity go to the trash slot
        N = state.num_slots
        live = (win_Bn * m < p0_B1 + S) & (win_Bn < N)
        dst_Bn = torch.where(live, win_Bn, torch.full_like(win_Bn, N))
        state.entries_BNd.scatter_(1, dst_Bn[..., None].expand(-1, -1, d), out_Bnd)

    def write_state(self, kv_BSC: torch.Tensor, gate_BSC: torch.Tensor, pos_BS: torch.Tensor,
                    state: CompressorState, kernels: str = "auto") -> None:
        """Store the chunk's last ``min(S, R)`` tokens in the ring (distinct rows: no scatter races). Where
        ``use_kernels(kv, kernels)`` one kernel (``kernels.ring_write``, the same fp32 values)."""
        if use_kernels(kv_BSC, kernels):
            ring_write(kv_BSC, gate_BSC, self.ape, pos_BS, state.kv_BRC, state.score_BRC, self.cfg.ratio)
            return
        R = self.cfg.state_rows
        k = min(kv_BSC.shape[1], R)
        kv_Bk, score_Bk = self._fp32(kv_BSC[:, -k:], gate_BSC[:, -k:], pos_BS[:, -k:])
        row_Bk = (pos_BS[:, -k:] % R)[..., None].expand(-1, -1, kv_BSC.shape[-1])
        state.kv_BRC.scatter_(1, row_Bk, kv_Bk)
        state.score_BRC.scatter_(1, row_Bk, score_Bk)

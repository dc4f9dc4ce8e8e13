"""Dispatch layout: where every (token, k) pair goes, computed on the device.

Legend: T local tokens, K top-k, P ranks, W waves, e local experts per rank (E = P*e global),
C = W*P cells (one cell = one (wave, peer) pair), S send rows, R received rows, D hidden.

Rank p owns the global experts [p*e, (p+1)*e). A wave is a subset of the (token, k) pairs:
  * partition "experts" (V4): wave w holds the pairs whose local expert lies in the w-th contiguous
    block of local experts (the same blocks on every rank);
  * partition "tokens" (Tutel style): wave w holds the pairs of the w-th contiguous chunk of tokens.
A token is sent once per cell even when several of its K experts live there: the row carries
K (local expert, weight) slots, -1 where slot k belongs to another cell. Send rows are ordered
(wave, peer, token), so each wave's rows are one contiguous block ordered by destination peer,
which is exactly what ``all_to_all_single`` with splits wants.

``sends`` says how often a (token, peer) pair crosses:
  * "wave": once per wave that holds one of its experts on that peer (the cell above);
  * "once" (partition "experts"): once per layer in each direction. The row goes in the first wave that needs
    it on that peer, carrying all of the token's slots there (of every wave); the peer keeps it for the later
    waves, sums the token's results there over the waves, and sends that sum home after the last of them
    (``last_TP``). The bytes of a layer are then those of W = 1 whatever W is. (With "tokens" both are the same:
    a token's experts are all in its wave.)

Nothing here synchronises with the host: every size is static (S is bounded by T*K, the valid
prefix is given by the counts), so backends decide where the one host sync happens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["WavePlan", "DispatchLayout", "compute_layout", "check_topk", "PARTITIONS", "SENDS", "PARTITION_SPECS",
           "split_partition", "rows_to_peers"]

PARTITIONS = ("experts", "tokens")
SENDS = ("wave", "once")
# the tools' partition axis: a partition, or the experts partition with a row once per layer
PARTITION_SPECS = PARTITIONS + ("experts-once",)


def split_partition(spec: str) -> tuple[str, str]:
    """(partition, sends) of a ``PARTITION_SPECS`` entry ("experts-once" is the experts partition, sends "once")."""
    if spec not in PARTITION_SPECS:
        raise ValueError(f"partition {spec!r}: must be one of {', '.join(PARTITION_SPECS)}")
    partition, _, sends = spec.partition("-")
    return partition, sends or "wave"


@dataclass(frozen=True, kw_only=True)
class WavePlan:
    """How pairs are cut into waves. ``num_waves`` is the effective count (see ``make``)."""

    num_ranks: int
    num_local_experts: int
    num_waves: int
    partition: str = "experts"
    sends: str = "wave"

    def __post_init__(self):
        for name in ("num_ranks", "num_local_experts", "num_waves"):
            if getattr(self, name) < 1:
                raise ValueError(f"WavePlan.{name}={getattr(self, name)}: must be >= 1")
        if self.partition not in PARTITIONS:
            raise ValueError(f"WavePlan.partition={self.partition!r}: must be one of {PARTITIONS}")
        if self.sends not in SENDS:
            raise ValueError(f"WavePlan.sends={self.sends!r}: must be one of {SENDS}")
        if self.partition == "experts" and self.num_waves > self.num_local_experts:
            raise ValueError(f"WavePlan.num_waves={self.num_waves}: an 'experts' partition has at most "
                             f"num_local_experts={self.num_local_experts} waves (use WavePlan.make)")

    @classmethod
    def make(cls, *, num_ranks: int, num_local_experts: int, num_waves: int, partition: str = "experts",
             sends: str = "wave"):
        """Clamp ``num_waves`` to the local expert count for the 'experts' partition (a wave with no
        expert would only add a synchronisation point)."""
        if num_waves < 1:
            raise ValueError(f"num_waves={num_waves}: must be >= 1")
        if partition == "experts":
            num_waves = min(num_waves, num_local_experts)
        return cls(num_ranks=num_ranks, num_local_experts=num_local_experts, num_waves=num_waves,
                   partition=partition, sends=sends)

    @property
    def once(self) -> bool:
        """A row crosses once per layer and its results come home after its last wave, which differs from a
        row per wave ("wave") only for the 'experts' partition with W > 1."""
        return self.sends == "once" and self.partition == "experts" and self.num_waves > 1

    @property
    def num_experts(self) -> int:
        return self.num_ranks * self.num_local_experts

    def expert_bounds(self, wave: int) -> tuple[int, int]:
        """[start, end) of the local experts in ``wave`` (the 'experts' partition)."""
        e, W = self.num_local_experts, self.num_waves
        return wave * e // W, (wave + 1) * e // W

    def wave_of_local_expert(self, device) -> torch.Tensor:
        e, W = self.num_local_experts, self.num_waves
        return (torch.arange(e, device=device) * W) // e  # inverse of expert_bounds


@dataclass(frozen=True)
class DispatchLayout:
    """Everything dispatch and combine need, on the device. Shapes use the legend above.

    Attributes:
        plan: the wave plan.
        num_tokens: T.
        send_token_S: [T*min(K, W*P)] int64, token index of each send row in (wave, peer, token)
            order; only the first ``send_counts_WP.sum()`` entries are valid (the rest are arbitrary
            token indices in range).
        send_expert_SK: [S, K] int32, local expert (on the destination) of slot k, or -1.
        send_weight_SK: [S, K] float32, routing weight of slot k (0 where the slot is -1).
        send_counts_WP: [W, P] int64, rows sent to each peer in each wave.
        pair_counts_WPe: [W, P, e] int64, (token, k) pairs sent per destination local expert.
        ids_min, ids_max: 0-dim int64 tensors, for validation without an extra host sync.
        last_TP: ``plan.once`` only (else None): [T, P] int64, the last wave with one of token t's experts on
            peer p (-1 where none): the wave after which the peer sends that token's sum home.
        send_last_S: ``plan.once`` only: [S] int64, the same for each send row.
    """

    plan: WavePlan
    num_tokens: int
    send_token_S: torch.Tensor
    send_expert_SK: torch.Tensor
    send_weight_SK: torch.Tensor
    send_counts_WP: torch.Tensor
    pair_counts_WPe: torch.Tensor
    ids_min: torch.Tensor
    ids_max: torch.Tensor
    last_TP: torch.Tensor | None = None
    send_last_S: torch.Tensor | None = None


def check_topk(topk_ids_TK: torch.Tensor, topk_w_TK: torch.Tensor, num_tokens: int | None = None) -> None:
    """Shape and dtype checks that need no host sync (the range check rides on the count sync)."""
    if not isinstance(topk_ids_TK, torch.Tensor) or topk_ids_TK.dim() != 2:
        raise ValueError(f"topk_ids: shape {tuple(getattr(topk_ids_TK, 'shape', ()))}: must be 2-D [T, K]")
    if topk_ids_TK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids.dtype={topk_ids_TK.dtype}: must be torch.int32 or torch.int64")
    if num_tokens is not None and topk_ids_TK.shape[0] != num_tokens:
        raise ValueError(f"topk_ids.shape[0]={topk_ids_TK.shape[0]}: must equal the number of tokens {num_tokens}")
    if topk_w_TK.shape != topk_ids_TK.shape:
        raise ValueError(f"topk_weights.shape={tuple(topk_w_TK.shape)}: must equal topk_ids.shape "
                         f"{tuple(topk_ids_TK.shape)}")
    if not topk_w_TK.is_floating_point():
        raise ValueError(f"topk_weights.dtype={topk_w_TK.dtype}: must be a floating dtype")


def compute_layout(topk_ids_TK: torch.Tensor, topk_w_TK: torch.Tensor, plan: WavePlan,
                   num_valid: torch.Tensor | None = None) -> DispatchLayout:
    """Compute the send side of the layout from the router output (device-side, no host sync).

    ``num_valid``: a 0-dim int64 tensor n on the device (CUDA graphs padded to a token bucket): tokens t >= n
    are padding, sent nowhere (no row, no pair; their routed output is 0)."""
    check_topk(topk_ids_TK, topk_w_TK)
    dev = topk_ids_TK.device
    T, K = topk_ids_TK.shape
    P, e, W = plan.num_ranks, plan.num_local_experts, plan.num_waves
    C = W * P
    ids_TK = topk_ids_TK.long()
    # Out-of-range ids are clamped here so that no kernel indexes out of bounds; the backend raises
    # a ValueError from ids_min/ids_max at its host sync, before any result is used.
    safe_TK = ids_TK.clamp(0, P * e - 1)
    peer_TK = safe_TK // e
    local_TK = safe_TK % e
    if plan.partition == "experts":
        wave_TK = (local_TK * W) // e                   # = wave_of_local_expert()[local_TK]
    else:
        wave_TK = ((torch.arange(T, device=dev) * W) // max(T, 1))[:, None].expand(T, K)
    last_TP = None
    if plan.once:
        # the row goes in the first wave with one of the token's experts on that peer and carries all of them
        same_TKK = peer_TK[:, :, None] == peer_TK[:, None, :]
        first_TK = torch.where(same_TKK, wave_TK[:, None, :], W).amin(-1)
        last_TP = torch.full((T, P), -1, dtype=torch.long, device=dev).scatter_reduce_(1, peer_TK, wave_TK, "amax")
        if num_valid is not None:
            last_TP.masked_fill_((torch.arange(T, device=dev) >= num_valid)[:, None], -1)
        cell_TK = first_TK * P + peer_TK
    else:
        cell_TK = wave_TK * P + peer_TK

    hit_TC = torch.zeros(T, C, dtype=torch.bool, device=dev)
    keep_TK = None
    if num_valid is None:
        hit_TC.scatter_(1, cell_TK, True)
    else:
        keep_TK = (torch.arange(T, device=dev) < num_valid)[:, None].expand(T, K)
        hit_TC.scatter_(1, cell_TK, keep_TK)            # a token's K sources agree: the same value per cell
    hit_F = hit_TC.t().reshape(-1)                      # flat index f = cell*T + token, sorted order
    send_counts_WP = hit_TC.sum(0).view(W, P)
    # Stable compaction without nonzero() (which syncs): a stable sort puts the hits first, in flat
    # order; the entries past the valid count are misses that no consumer reads.
    S_max = T * min(K, C)
    flat_S = torch.argsort(hit_F.logical_not(), stable=True)[:S_max]
    send_token_S = flat_S % max(T, 1)
    send_cell_S = flat_S // max(T, 1)

    row_cell_SK = cell_TK[send_token_S]                 # [S, K]
    mine_SK = row_cell_SK == send_cell_S[:, None]
    send_expert_SK = torch.where(mine_SK, local_TK[send_token_S], -1).to(torch.int32)
    send_weight_SK = torch.where(mine_SK, topk_w_TK[send_token_S].float(), 0.0)

    # scatter_add, not bincount: CUDA bincount reads max() on the host (a sync that breaks graph capture).
    key_F = (cell_TK * e + local_TK).reshape(-1)      # (wave, peer, local expert)
    ones_F = torch.ones_like(key_F) if keep_TK is None else keep_TK.reshape(-1).long()
    pair_counts_WPe = torch.zeros(C * e, dtype=torch.long, device=dev).scatter_add_(0, key_F, ones_F).view(W, P, e)
    if T == 0:
        ids_min = torch.zeros((), dtype=torch.long, device=dev)
        ids_max = ids_min
    else:
        ids_min, ids_max = torch.aminmax(ids_TK)
    send_last_S = None if last_TP is None else last_TP[send_token_S, send_cell_S % P]
    return DispatchLayout(plan=plan, num_tokens=T, send_token_S=send_token_S, send_expert_SK=send_expert_SK,
                          send_weight_SK=send_weight_SK, send_counts_WP=send_counts_WP,
                          pair_counts_WPe=pair_counts_WPe, ids_min=ids_min, ids_max=ids_max, last_TP=last_TP,
                          send_last_S=send_last_S)


def rows_to_peers(layout: DispatchLayout, rank: int) -> int:
    """Rows that ``rank``'s dispatches send to other ranks over the whole layer, every wave (HOST SYNC: for tools
    and tests). Its combines bring as many back: a row per (token, peer, wave) with sends "wave", one per (token,
    peer) with "once". The bytes on the wire are these rows times a row's bytes (``WaveMoE.traffic``)."""
    counts = layout.send_counts_WP.sum(0)
    return int(counts.sum()) - (int(counts[rank]) if 0 <= rank < counts.numel() else 0)

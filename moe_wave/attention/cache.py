"""Per-layer attention cache for prefill, chunked prefill and decode (static shapes).

Legend: B batch, W sliding window, d head_dim, e indexer head dim, N compressed-entry slots.

API::

    cache = attn.new_cache(batch, max_len, device, dtype)   # one per layer
    o = attn(x_BSD, positions=pos_BS, cache=cache)          # prefill, chunk or decode step

A call with S tokens must continue every row exactly where its cache stopped: ``positions[b]`` is
``cache.length[b] + arange(S)`` (rows may be at different lengths). ``length + S`` may not exceed
``max_len``. Both are checked (``ValueError``) unless ``validate=False`` or while a CUDA graph is
being captured, since the check costs one host sync.

Contents (all device tensors, updated in place, so a decode step replays under a CUDA graph):
  * ``length_B``: tokens seen per row;
  * ``win_BWd``: ring buffer of the last W window keys (= values), row ``pos mod W``;
  * ``comp`` / ``index``: ``CompressorState`` of the main and indexer compressors (pending-token
    ring, emitted entries), None where the layer type has none.

Writes that only the *next* step reads (the window ring, the compressor rings) may still be running
on a side stream when the call returns; their events are kept in ``pending`` and waited on at the
start of the same layer's next call (``join``).
"""

from __future__ import annotations

import torch

from moe_wave.comm.streams import wait

from .compressor import CompressorConfig, CompressorState

__all__ = ["AttnCache"]


class AttnCache:
    """Cache of one V4 attention layer; build it with ``V4Attention.new_cache``."""

    def __init__(self, *, batch: int, max_len: int, window: int, head_dim: int, comp_cfg: CompressorConfig | None,
                 index_cfg: CompressorConfig | None, device, dtype):
        if batch <= 0:
            raise ValueError(f"AttnCache batch={batch}: must be > 0")
        if max_len <= 0:
            raise ValueError(f"AttnCache max_len={max_len}: must be > 0")
        self.batch, self.max_len, self.window = batch, max_len, window
        self.length_B = torch.zeros(batch, dtype=torch.long, device=device)
        self.win_BWd = torch.zeros(batch, window, head_dim, dtype=dtype, device=device)
        mk = lambda cfg: None if cfg is None else CompressorState.empty(cfg, batch, max_len, device, dtype)  # noqa: E731
        self.comp = mk(comp_cfg)
        self.index = mk(index_cfg)
        self.pending: dict[str, object] = {}

    @property
    def device(self) -> torch.device:
        return self.length_B.device

    @property
    def has_pending(self) -> bool:
        return any(ev is not None for ev in self.pending.values())

    def join(self) -> None:
        """Make the current stream wait for every deferred write of the previous step (no-op on CPU)."""
        for ev in self.pending.values():
            wait(ev)
        self.pending.clear()

    def check(self, pos_BS: torch.Tensor) -> None:
        """ValueError unless ``pos_BS`` continues every row and fits in ``max_len``. One host sync."""
        B, S = pos_BS.shape
        if B != self.batch:
            raise ValueError(f"positions batch={B}: must equal the cache batch {self.batch}")
        want_BS = self.length_B[:, None] + torch.arange(S, device=pos_BS.device)
        bad = (pos_BS != want_BS).any(dim=1)
        # host sync: validation only (skipped with validate=False and under CUDA-graph capture)
        bad_l, len_l = bad.tolist(), self.length_B.tolist()
        for b, (is_bad, n) in enumerate(zip(bad_l, len_l)):
            if is_bad:
                raise ValueError(f"positions[{b}]={pos_BS[b].tolist()[:8]}...: must be cache.length[{b}] + "
                                 f"arange(S) = {n}..{n + S - 1} (the cache holds {n} tokens of that row)")
            if n + S > self.max_len:
                raise ValueError(f"sequence length {n + S} (row {b}: {n} cached + {S} new): must be <= cache "
                                 f"max_len={self.max_len}")

    def advance(self, S: int) -> None:
        self.length_B.add_(S)

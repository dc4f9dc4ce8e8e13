"""DeepEP's ``Config`` (its performance knobs) and the per-rank-count tables behind ``Buffer.get_*_config``.

The engine underneath does not chunk through a ring buffer, so these values do not change what it does: they are
validated as DeepEP validates them, kept, and handed back, and ``num_sms`` sizes the handle's channel matrices.
"""

from __future__ import annotations

__all__ = ["Config", "DISPATCH_TABLE", "COMBINE_TABLE", "NUM_MAX_NVL_PEERS", "topk_idx_t"]

import torch

NUM_MAX_NVL_PEERS = 8
topk_idx_t = torch.int64

_FIELDS = ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
           "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens")

# DeepEP 567632d buffer.py: ranks -> (nvl send, nvl recv, rdma send, rdma recv) chunk sizes
DISPATCH_TABLE = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
                  24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
                  96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
COMBINE_TABLE = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
                 24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
                 96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}


def _int(name: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"Config.{name}={value!r}: must be an int >= {lo}")
    return value


class Config:
    """DeepEP's tuning config, positional or keyword: ``Config(24, 8, 256)``, ``Config(**json)``.

    Args:
        num_sms: SMs of the normal kernels (>= 0); the handle has ``num_sms // 2`` channels.
        num_max_nvl_chunked_send_tokens / num_max_nvl_chunked_recv_tokens: > 0, send < recv.
        num_max_rdma_chunked_send_tokens / num_max_rdma_chunked_recv_tokens: > 0; recv is rounded up to a multiple
            of send, and send <= recv / 2 (DeepEP's rules).
    """

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256):
        self.num_sms = _int("num_sms", num_sms, 0)
        self.num_max_nvl_chunked_send_tokens = _int("num_max_nvl_chunked_send_tokens",
                                                    num_max_nvl_chunked_send_tokens, 1)
        self.num_max_nvl_chunked_recv_tokens = _int("num_max_nvl_chunked_recv_tokens",
                                                    num_max_nvl_chunked_recv_tokens, 1)
        if num_max_nvl_chunked_send_tokens >= num_max_nvl_chunked_recv_tokens:
            raise ValueError(f"Config.num_max_nvl_chunked_send_tokens={num_max_nvl_chunked_send_tokens}: must be < "
                             f"num_max_nvl_chunked_recv_tokens={num_max_nvl_chunked_recv_tokens}")
        rs = _int("num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens, 1)
        rr = _int("num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens, 1)
        rr = -(-rr // rs) * rs
        if rs > rr // 2:
            raise ValueError(f"Config.num_max_rdma_chunked_send_tokens={rs}: must be <= half of "
                             f"num_max_rdma_chunked_recv_tokens (rounded up to a multiple of it: {rr})")
        self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens = rs, rr

    @property
    def num_channels(self) -> int:
        return max(self.num_sms // 2, 1)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's NVLink buffer size for these chunk sizes (its formula, for callers that size buffers with it)."""
        nvl = min(num_ranks, NUM_MAX_NVL_PEERS)
        rdma = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        per_slot = hidden_bytes + 128 * 8 + 128 * 4 + 128 * 4        # row, top-k ids and weights, scales
        n = self.num_channels * nvl * ((2 * rdma + 3) * 4 + self.num_max_nvl_chunked_recv_tokens * per_slot)
        return -(-n // 128) * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0 within a node (DeepEP's value there); across nodes there is no RDMA path here."""
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        raise NotImplementedError(f"Config.get_rdma_buffer_size_hint(num_ranks={num_ranks}): moe-wave's deep_ep runs "
                                  f"within one node (<= {NUM_MAX_NVL_PEERS} ranks); across nodes use DeepEP itself")

    def __repr__(self) -> str:
        return "Config(" + ", ".join(f"{f}={getattr(self, f)}" for f in _FIELDS) + ")"

    def __eq__(self, other) -> bool:
        return isinstance(other, Config) and all(getattr(self, f) == getattr(other, f) for f in _FIELDS)

    @classmethod
    def from_table(cls, table: dict, num_ranks: int, num_sms: int, what: str) -> "Config":
        if num_ranks not in table:
            raise ValueError(f"{what}(num_ranks={num_ranks}): DeepEP has configs for {sorted(table)} ranks only")
        return cls(num_sms, *table[num_ranks])

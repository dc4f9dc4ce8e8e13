"""DeepEP's low-latency mode on moe-wave's engine (placeholder while normal mode is brought up)."""

from __future__ import annotations

__all__ = ["LowLatency", "rdma_size_hint", "check_overlap_kwargs"]


def rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """DeepEP 567632d ``get_low_latency_rdma_size_hint`` (``csrc/config.hpp`` ``LowLatencyLayout``), bytes."""
    T, E, S = num_max_dispatch_tokens_per_rank, num_experts, hidden // 128
    dispatch_msg = 16 + max(hidden * 2, hidden + S * 4)
    combine_msg = S * 4 + hidden * 2
    send = max(T * dispatch_msg, E * T * combine_msg)
    recv = max(E * T * dispatch_msg, E * T * combine_msg)
    signal = -(-(E * 4) // 128) * 128
    total = 2 * (send + recv + signal)
    return (total + 128) // 128 * 128


def check_overlap_kwargs(kwargs: dict) -> None:
    pass


class LowLatency:
    def __init__(self, ep, comm_stream, options=None):
        self.ep, self.comm_stream = ep, comm_stream

    def close(self) -> None:
        pass

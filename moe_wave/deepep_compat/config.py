"""The knobs of ``deep_ep.Buffer``: DeepEP's ``Config`` and moe-wave's own ``CompatOptions`` and ``LLTune``.

DeepEP's ``Config`` (its performance knobs) and the per-rank-count tables behind ``Buffer.get_*_config``: the
engine underneath does not chunk through a ring buffer, so these values do not change what it does: they are
validated as DeepEP validates them, kept, and handed back, and ``num_sms`` sizes the handle's channel matrices.

moe-wave's own knobs of ``deep_ep.Buffer``: which implementation each mode runs and how the direct kernels are
tuned, as one frozen record validated on construction.

Every field is also a keyword of ``Buffer`` (the keyword wins); a keyword left None takes its default from the
environment through ``moe_wave.env.deepep_options`` (the one reader of ``MOE_WAVE_*``), else the field's default:

    field               variable                      values
    normal              MOE_WAVE_NORMAL_PATH          auto | direct | engine
    normal_channels     MOE_WAVE_NORMAL_CHANNELS      int in [1, 64]
    normal_rows         MOE_WAVE_NORMAL_ROWS          power of two in [1, 256]
    ll                  MOE_WAVE_LL_PATH              auto | direct | engine
    ll_partial          MOE_WAVE_LL_PARTIAL           bf16 | fp32
    normal_fast_launch  MOE_WAVE_NORMAL_FAST_LAUNCH   1 | 0
    ll_fast_launch      MOE_WAVE_LL_FAST_LAUNCH       1 | 0

"direct" is the one-launch Triton kernels on peer memory (CUDA ranks of an NCCL group; one CPU rank under
TRITON_INTERPRET=1 for normal mode), "engine" the symm backend's exchange (any group, the CPU emulation on gloo),
"auto" the direct kernels where they run. The fast launch relaunches compiled kernels without Triton's JIT
dispatch (``triton_launch.Launcher``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

__all__ = ["Config", "DISPATCH_TABLE", "COMBINE_TABLE", "NUM_MAX_NVL_PEERS", "topk_idx_t", "CompatOptions", "LLTune",
           "PATHS", "PARTIALS", "NCH_MAX", "ROWS_MAX"]

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


# ----------------------------------------------------------------------------- moe-wave's own knobs
PATHS = ("auto", "direct", "engine")
PARTIALS = ("bf16", "fp32")
NCH_MAX = 64                # the direct kernels' flag slots per source (normal_plan.NCH_MAX)
ROWS_MAX = 256


def _int_in(name: str, v, lo: int, hi: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"CompatOptions.{name}={v!r}: must be an int in [{lo}, {hi}]")


@dataclass(frozen=True, kw_only=True)
class CompatOptions:
    """See the module docstring."""

    normal: str = "auto"
    normal_channels: int = 32
    normal_rows: int = 8
    ll: str = "auto"
    ll_partial: str = "bf16"
    normal_fast_launch: bool = True
    ll_fast_launch: bool = True

    def __post_init__(self):
        for name in ("normal", "ll"):
            if getattr(self, name) not in PATHS:
                raise ValueError(f"CompatOptions.{name}={getattr(self, name)!r}: must be one of {PATHS}")
        if self.ll_partial not in PARTIALS:
            raise ValueError(f"CompatOptions.ll_partial={self.ll_partial!r}: must be one of {PARTIALS}")
        _int_in("normal_channels", self.normal_channels, 1, NCH_MAX)
        _int_in("normal_rows", self.normal_rows, 1, ROWS_MAX)
        if self.normal_rows & (self.normal_rows - 1):
            raise ValueError(f"CompatOptions.normal_rows={self.normal_rows}: must be a power of two")
        for name in ("normal_fast_launch", "ll_fast_launch"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CompatOptions.{name}={getattr(self, name)!r}: must be a bool")

    @staticmethod
    def names() -> tuple:
        return tuple(f.name for f in fields(CompatOptions))


@dataclass(frozen=True, kw_only=True)
class LLTune:
    """The low-latency direct kernels' launch tuning (the benchmarks' ``--tune``): warps per program, the combine's
    row blocks ``bh`` / ``br`` (0: the default) and the software pipelining of its row loops (``stages``)."""

    warps: int = 16
    bh: int = 0
    br: int = 0
    stages: int = 1

    def __post_init__(self):
        if self.warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"LLTune.warps={self.warps!r}: must be a power of two in [1, 32]")
        for name in ("bh", "br"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v & (v - 1):
                raise ValueError(f"LLTune.{name}={v!r}: must be 0 (the default) or a power of two")
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or not 1 <= self.stages <= 8:
            raise ValueError(f"LLTune.stages={self.stages!r}: must be an int in [1, 8]")

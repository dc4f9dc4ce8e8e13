"""moe-wave's own knobs of ``deep_ep.Buffer``: which implementation each mode runs and how the direct kernels are
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

__all__ = ["CompatOptions", "LLTune", "PATHS", "PARTIALS", "NCH_MAX", "ROWS_MAX"]

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

"""Typed options of the ``symm`` backend, with the environment variable each one is read from by the CLI.

The library never reads the environment for these. ``moe_wave.env.read_env`` maps the variables onto the
fields below for the CLI and the launch scripts, under one rule: an explicit argument wins over the
environment, which wins over the default.

=================  =======================  ===============================================================
field              environment              meaning
=================  =======================  ===============================================================
capacity           MOE_WAVE_SYMM_CAPACITY   C, the rows of each (wave, peer) block: the most tokens one rank
                                            may bring to a layer call (one row per token per (wave, peer))
mode               MOE_WAVE_SYMM_MODE       "kernel" (one Triton launch of SM row copies), "copy" (copy
                                            engines), "auto" (copy mode with dense blocks where they fill and
                                            ``capacity >= AUTO_COPY_MIN_TOKENS``, kernel mode below)
dense              MOE_WAVE_SYMM_DENSE      copy mode: send each wave's token range whole (True), only the
                                            rows that carry pairs (False), or by the expected fill (None)
signal             MOE_WAVE_SYMM_SIGNAL     what closes an exchange: "barrier" (our barrier kernel),
                                            "flags" (copy-engine completion flags), "memops" (stream memory
                                            operations, no SM, bounded by a watchdog thread)
timeout_ms         MOE_WAVE_SYMM_TIMEOUT_MS a peer that does not arrive within it is an error naming it
grace_s            MOE_WAVE_SYMM_GRACE_S    memops: how long the caller has to raise the watchdog's error
                                            before the process exits
kernels            MOE_WAVE_SYMM_KERNELS    "auto" (Triton on a GPU, torch ops on CPU), "triton" (also on CPU
                                            under TRITON_INTERPRET=1: the tests), "torch" (never Triton)
copy.rows_block    MOE_WAVE_COPY_ROWS_BLOCK elements a row-copy program moves per step (a power of two)
copy.warps         MOE_WAVE_COPY_ROWS_WARPS warps of a row-copy program (0: by tile size)
copy.rows          MOE_WAVE_COPY_ROWS       rows a program keeps in flight (a power of two)
copy.grid          MOE_WAVE_COPY_GRID       a cap on the row-copy programs, to leave SMs to a GEMM (0: none)
=================  =======================  ===============================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

__all__ = ["SymmOptions", "CopyTuning", "MODES", "SIGNALS", "KERNELS", "DEFAULT_CAPACITY", "AUTO_COPY_MIN_TOKENS",
           "DENSE_FILL", "parse_variant"]

DEFAULT_CAPACITY = 4096
MODES = ("auto", "kernel", "copy")
SIGNALS = ("barrier", "flags", "memops")
KERNELS = ("auto", "triton", "torch")
# the expected fraction of a dense block's rows that carry a pair, from which "auto" takes dense blocks
DENSE_FILL = 0.8
# mode "auto": copy mode with dense blocks from this capacity, kernel mode below: kernel mode has the lower latency
# alone at small token counts, dense copy mode hides better beside a GEMM (benchmarks/results/comm.md).
AUTO_COPY_MIN_TOKENS = 1024
_WARPS = (0, 1, 2, 4, 8, 16, 32)


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _int(owner: str, name: str, value, lo: int, rule: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{owner}.{name}={value!r}: {rule}")


@dataclass(frozen=True, kw_only=True)
class CopyTuning:
    """The row-copy kernels' launch shape (``symm_kernels.scatter_rows`` / ``gather_add``); a kernel argument.

    Attributes:
        rows_block: elements a program moves per step of a row (a power of two >= 16).
        warps: warps per program; 0 chooses by tile size.
        rows: rows (tokens, for gather_add) a program keeps in flight (a power of two).
        grid: a cap on the programs (0: one per tile); with a cap each program walks several tiles.
    """

    rows_block: int = 2048
    warps: int = 0
    rows: int = 1
    grid: int = 0

    def __post_init__(self):
        if not (isinstance(self.rows_block, int) and _pow2(self.rows_block) and self.rows_block >= 16):
            raise ValueError(f"CopyTuning.rows_block={self.rows_block!r}: must be a power of two >= 16")
        if self.warps not in _WARPS:
            raise ValueError(f"CopyTuning.warps={self.warps!r}: must be one of {_WARPS} (0: by tile size)")
        if not (isinstance(self.rows, int) and _pow2(self.rows)):
            raise ValueError(f"CopyTuning.rows={self.rows!r}: must be a power of two >= 1")
        _int("CopyTuning", "grid", self.grid, 0, "must be an int >= 0 (0: one program per tile)")


@dataclass(frozen=True, kw_only=True)
class SymmOptions:
    """Options of the ``symm`` backend (see the module docstring for each field and its variable).

    Every rank of a group must pass the same options: the data mode and the block shapes are collective.
    """

    capacity: int = DEFAULT_CAPACITY
    mode: str = "auto"
    dense: bool | None = None
    signal: str = "barrier"
    timeout_ms: int = 120_000
    grace_s: float = 10.0
    kernels: str = "auto"
    copy: CopyTuning = field(default_factory=CopyTuning)

    def __post_init__(self):
        _int("SymmOptions", "capacity", self.capacity, 1, "must be an int >= 1 (rows per (wave, peer) block: the "
             "most tokens a rank brings to one call)")
        if self.mode not in MODES:
            raise ValueError(f"SymmOptions.mode={self.mode!r}: must be one of {MODES}")
        if self.dense not in (None, True, False):
            raise ValueError(f"SymmOptions.dense={self.dense!r}: must be True, False or None (by the expected fill)")
        if self.signal not in SIGNALS:
            raise ValueError(f"SymmOptions.signal={self.signal!r}: must be one of {SIGNALS}")
        if self.kernels not in KERNELS:
            raise ValueError(f"SymmOptions.kernels={self.kernels!r}: must be one of {KERNELS}")
        _int("SymmOptions", "timeout_ms", self.timeout_ms, 1, "must be an int >= 1 (a missing peer is an error "
             "after that many milliseconds; there is no 'wait forever')")
        if isinstance(self.grace_s, bool) or not isinstance(self.grace_s, (int, float)) or not self.grace_s > 0:
            raise ValueError(f"SymmOptions.grace_s={self.grace_s!r}: must be a number > 0 (seconds)")
        if not isinstance(self.copy, CopyTuning):
            raise ValueError(f"SymmOptions.copy={self.copy!r}: must be a CopyTuning")
        if self.dense and self.mode == "kernel":
            raise ValueError("SymmOptions.dense=True with mode='kernel': dense blocks are a copy-mode layout (kernel "
                             "mode writes only the rows that carry pairs); use mode='copy' or 'auto'")
        if self.signal == "flags" and self.mode == "kernel":
            raise ValueError("SymmOptions.signal='flags' with mode='kernel': completion flags are written by the copy "
                             "engines; use mode='copy' or 'auto'")
        if self.kernels == "torch" and self.mode == "kernel":
            raise ValueError("SymmOptions.mode='kernel' with kernels='torch': kernel mode is a Triton launch")

    def replace(self, **changes) -> "SymmOptions":
        """A copy with ``changes``; ``copy`` may be given as a dict of CopyTuning fields."""
        if isinstance(changes.get("copy"), dict):
            changes["copy"] = replace(self.copy, **changes["copy"])
        return replace(self, **changes)

    @classmethod
    def variant(cls, name: str, **kw) -> "SymmOptions":
        """Options from a variant name as the benchmarks and tests spell it (``parse_variant``)."""
        mode, dense, signal = parse_variant(name)
        return cls(mode=mode, dense=dense, signal=signal, **kw)


def parse_variant(name: str) -> tuple[str, bool | None, str]:
    """(mode, dense, signal) from a variant name: the data mode, then "+dense" / "+sparse" (neither: chosen by the
    fill) and "+flags" / "+memops" (neither: the barrier), e.g. "copy+dense+memops"."""
    mode, *opts = name.split("+")
    bad = [o for o in opts if o not in ("dense", "sparse") + SIGNALS]
    if mode not in MODES or bad:
        raise ValueError(f"symm variant {name!r}: must be one of {MODES} followed by +dense/+sparse and "
                         f"+flags/+memops")
    dense = True if "dense" in opts else False if "sparse" in opts else None
    return mode, dense, next((o for o in opts if o in SIGNALS), "barrier")

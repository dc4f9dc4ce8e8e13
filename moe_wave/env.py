"""The one parser of moe-wave's own environment variables (``MOE_WAVE_*``), for the CLI and the launch scripts.

The library itself never reads ``MOE_WAVE_*``: every knob is a typed argument (``WaveConfig``,
``SymmOptions``, ``ScheduleConfig``, ``init_from_env(high_priority=)``). ``read_env`` turns the variables
into those arguments once, and the callers merge them under one rule everywhere:

    an explicit argument (a CLI flag, a keyword)  >  the environment  >  the default

The variables are read through ``moe_wave.comm.environ`` (the one module that touches the process environment;
its table declares the ``MOE_WAVE_*`` family, this module's table below documents each variable). A malformed
value is a ValueError naming the variable, the value and the rule. Every on/off variable takes 1 | 0,
on | off, true | false, yes | no.

========================== ===================================== ==========================================
variable                   becomes                               values
========================== ===================================== ==========================================
MOE_WAVE_SYMM_CAPACITY     SymmOptions.capacity                  int >= 1
MOE_WAVE_SYMM_MODE         SymmOptions.mode                      auto | kernel | copy
MOE_WAVE_SYMM_DENSE        SymmOptions.dense                     auto | 1 | 0 (on | off)
MOE_WAVE_SYMM_SIGNAL       SymmOptions.signal                    barrier | flags | memops
MOE_WAVE_SYMM_TIMEOUT_MS   SymmOptions.timeout_ms                int >= 1
MOE_WAVE_SYMM_GRACE_S      SymmOptions.grace_s                   seconds > 0
MOE_WAVE_SYMM_KERNELS      SymmOptions.kernels                   auto | triton | torch
MOE_WAVE_COPY_ROWS_BLOCK   SymmOptions.copy.rows_block           power of two >= 16
MOE_WAVE_COPY_ROWS_WARPS   SymmOptions.copy.warps                0 1 2 4 8 16 32
MOE_WAVE_COPY_ROWS         SymmOptions.copy.rows                 power of two
MOE_WAVE_COPY_GRID         SymmOptions.copy.grid                 int >= 0
MOE_WAVE_OVERLAP           WaveConfig.overlap                    1 | 0
MOE_WAVE_ATTN_OVERLAP      ScheduleConfig.overlap                1 | 0
MOE_WAVE_ATTN_KERNELS      ScheduleConfig.kernels                auto | 1 | 0 (on | off)
MOE_WAVE_PRECISION         the tools' precision (--precision)    auto | bf16 | fp8
MOE_WAVE_FP8_GEMM          fp8.set_fp8_gemm (the FP8 GEMMs)      auto | cublas | deepgemm
MOE_WAVE_GRAPH             the tools' CUDA graphs (demo --graph) auto | 1 | 0 (on | off)
MOE_WAVE_CACHE             WaveConfig.autowave_cache             a .json file or a folder; off: none
MOE_WAVE_KERNEL_CACHE      CoreTuning.kernel_cache (compiled     a folder (default ~/.cache/moe_wave)
                           CUDA kernels on disk)
MOE_WAVE_NVTX              profiling.set_nvtx                    1 | 0
MOE_WAVE_NCCL_HIGH_PRIORITY init_from_env(high_priority=)        1 | 0
MOE_WAVE_GIT_SHA           the commit named in result files      text (a copy of the tree without .git)
========================== ===================================== ==========================================

``deep_ep.Buffer`` (``moe_wave.deepep_compat``) is made by serving stacks with no moe-wave CLI in between: its
constructor asks ``deepep_options`` for the defaults of the keywords it was not given (the variables
``MOE_WAVE_NORMAL_*`` and ``MOE_WAVE_LL_*``: the table in ``moe_wave.deepep_compat.config``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from moe_wave.comm import environ
from moe_wave.comm.options import KERNELS, MODES, SIGNALS, SymmOptions
from moe_wave.deepep_compat.config import PARTIALS, PATHS, CompatOptions
from moe_wave.fp8 import FP8_GEMMS, PRECISIONS

__all__ = ["EnvSettings", "read_env", "deepep_options", "VARIABLES"]

_TRUE, _FALSE = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def _flag(var: str, v: str) -> bool:
    s = v.strip().lower()
    if s in _TRUE or s in _FALSE:
        return s in _TRUE
    raise ValueError(f"{var}={v!r}: must be 1 or 0 (also on/off, true/false, yes/no)")


def _int(var: str, v: str, lo: int) -> int:
    try:
        n = int(v)
    except ValueError:
        n = None
    if n is None or n < lo:
        raise ValueError(f"{var}={v!r}: must be an integer >= {lo}")
    return n


def _seconds(var: str, v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        x = float("nan")
    if not x > 0:
        raise ValueError(f"{var}={v!r}: must be a number of seconds > 0")
    return x


def _choice(var: str, v: str, choices) -> str:
    if v not in choices:
        raise ValueError(f"{var}={v!r}: must be one of {', '.join(choices)}")
    return v


def _auto_flag(var: str, v: str) -> bool | None:
    """auto (None), or a flag; the error lists every accepted value."""
    s = v.strip().lower()
    if s == "auto":
        return None
    if s in _TRUE or s in _FALSE:
        return s in _TRUE
    raise ValueError(f"{var}={v!r}: must be auto, 1 or 0 (also on/off, true/false, yes/no)")


def _attn_kernels(var: str, v: str) -> str:
    on = _auto_flag(var, v)
    return "auto" if on is None else ("on" if on else "off")


def _cache(var: str, v: str) -> str | None:
    return None if v.strip().lower() in ("", "0", "off", "none") else v


# variable -> (where it goes, parser). "symm.X" and "copy.X" are SymmOptions fields.
_SYMM = {
    "MOE_WAVE_SYMM_CAPACITY": ("symm.capacity", lambda k, v: _int(k, v, 1)),
    "MOE_WAVE_SYMM_MODE": ("symm.mode", lambda k, v: _choice(k, v, MODES)),
    "MOE_WAVE_SYMM_DENSE": ("symm.dense", _auto_flag),
    "MOE_WAVE_SYMM_SIGNAL": ("symm.signal", lambda k, v: _choice(k, v, SIGNALS)),
    "MOE_WAVE_SYMM_TIMEOUT_MS": ("symm.timeout_ms", lambda k, v: _int(k, v, 1)),
    "MOE_WAVE_SYMM_GRACE_S": ("symm.grace_s", _seconds),
    "MOE_WAVE_SYMM_KERNELS": ("symm.kernels", lambda k, v: _choice(k, v, KERNELS)),
    "MOE_WAVE_COPY_ROWS_BLOCK": ("copy.rows_block", lambda k, v: _int(k, v, 16)),
    "MOE_WAVE_COPY_ROWS_WARPS": ("copy.warps", lambda k, v: _int(k, v, 0)),
    "MOE_WAVE_COPY_ROWS": ("copy.rows", lambda k, v: _int(k, v, 1)),
    "MOE_WAVE_COPY_GRID": ("copy.grid", lambda k, v: _int(k, v, 0)),
}
_OTHER = {
    "MOE_WAVE_OVERLAP": ("overlap", _flag),
    "MOE_WAVE_ATTN_OVERLAP": ("attn_overlap", _flag),
    "MOE_WAVE_ATTN_KERNELS": ("attn_kernels", _attn_kernels),
    "MOE_WAVE_PRECISION": ("precision", lambda k, v: _choice(k, v.strip().lower(), PRECISIONS)),
    "MOE_WAVE_FP8_GEMM": ("fp8_gemm", lambda k, v: _choice(k, v.strip().lower(), FP8_GEMMS)),
    "MOE_WAVE_GRAPH": ("graph", _auto_flag),
    "MOE_WAVE_CACHE": ("autowave_cache", _cache),
    "MOE_WAVE_KERNEL_CACHE": ("kernel_cache", lambda k, v: v.strip() or None),
    "MOE_WAVE_NVTX": ("nvtx", _flag),
    "MOE_WAVE_NCCL_HIGH_PRIORITY": ("nccl_high_priority", _flag),
    "MOE_WAVE_GIT_SHA": ("git_sha", lambda k, v: v.strip() or None),
}
# deep_ep.Buffer's defaults (``deepep_options``): variable -> (CompatOptions field, parser)
_DEEPEP = {
    "MOE_WAVE_NORMAL_PATH": ("normal", lambda k, v: _choice(k, v, PATHS)),
    "MOE_WAVE_NORMAL_CHANNELS": ("normal_channels", lambda k, v: _int(k, v, 1)),
    "MOE_WAVE_NORMAL_ROWS": ("normal_rows", lambda k, v: _int(k, v, 1)),
    "MOE_WAVE_LL_PATH": ("ll", lambda k, v: _choice(k, v, PATHS)),
    "MOE_WAVE_LL_PARTIAL": ("ll_partial", lambda k, v: _choice(k, v, PARTIALS)),
    "MOE_WAVE_NORMAL_FAST_LAUNCH": ("normal_fast_launch", _flag),
    "MOE_WAVE_LL_FAST_LAUNCH": ("ll_fast_launch", _flag),
}
VARIABLES = tuple(_SYMM) + tuple(_OTHER) + tuple(_DEEPEP)
_RETIRED = {"MOE_WAVE_SYMM_FLAGS": "use MOE_WAVE_SYMM_SIGNAL=flags",
            "MOE_WAVE_ATTN_FP8": "use MOE_WAVE_PRECISION=fp8 (FP8 attention projections and FP8 experts)"}


@dataclass(frozen=True)
class EnvSettings:
    """What the environment sets; None (or absent from ``symm`` / ``copy``) where a variable is unset.

    Attributes:
        symm: SymmOptions fields set by ``MOE_WAVE_SYMM_*``.
        copy: CopyTuning fields set by ``MOE_WAVE_COPY_*``.
        overlap, attn_overlap, attn_kernels, precision, fp8_gemm, graph, autowave_cache, kernel_cache, nvtx,
        nccl_high_priority, git_sha:
            see the table (graph None: auto).
        autowave_cache_set: True when MOE_WAVE_CACHE was given (``off`` sets it to None on purpose).
    """

    symm: dict = field(default_factory=dict)
    copy: dict = field(default_factory=dict)
    overlap: bool | None = None
    attn_overlap: bool | None = None
    attn_kernels: str | None = None
    precision: str | None = None
    fp8_gemm: str | None = None
    graph: bool | None = None
    autowave_cache: str | None = None
    autowave_cache_set: bool = False
    kernel_cache: str | None = None
    nvtx: bool | None = None
    nccl_high_priority: bool | None = None
    git_sha: str | None = None

    def symm_options(self, base: SymmOptions | None = None, **given) -> SymmOptions:
        """SymmOptions under the rule argument > environment > ``base`` (default ``SymmOptions()``). ``given``
        holds the arguments the caller has (None: not given); ``copy_<field>`` names a CopyTuning field."""
        given = {k: v for k, v in given.items() if v is not None}
        copy = {**self.copy, **{k[5:]: given.pop(k) for k in list(given) if k.startswith("copy_")}}
        return (base or SymmOptions()).replace(**{**self.symm, **given}, copy=copy)

    def pick(self, name: str, given, default):
        """One setting under the rule: ``given`` unless None, else the environment's ``name``, else ``default``."""
        if given is not None:
            return given
        env = getattr(self, name)
        if name == "autowave_cache":
            return env if self.autowave_cache_set else default
        return default if env is None else env


def read_env(env: Mapping[str, str] | None = None) -> EnvSettings:
    """Read every ``MOE_WAVE_*`` variable once (``env`` defaults to the process environment, ``environ.view()``);
    see the module docstring."""
    env = environ.view() if env is None else env
    for var, hint in _RETIRED.items():
        if var in env:
            raise ValueError(f"{var}={env[var]!r}: no longer read; {hint}")
    symm, copy, other = {}, {}, {}
    for table in (_SYMM, _OTHER):
        for var, (dest, parse) in table.items():
            if var not in env:
                continue
            value = parse(var, env[var])
            if dest.startswith("symm."):
                symm[dest[5:]] = value
            elif dest.startswith("copy."):
                copy[dest[5:]] = value
            else:
                other[dest] = value
    if "autowave_cache" in other:
        other["autowave_cache_set"] = True
    try:
        SymmOptions().replace(**symm, copy=copy)   # the combination must be valid too
    except ValueError as e:
        set_vars = ", ".join(f"{k}={env[k]}" for k in _SYMM if k in env)
        raise ValueError(f"the environment's symm options ({set_vars}): {e}") from None
    return EnvSettings(symm=symm, copy=copy, **other)


def deepep_options(env: Mapping[str, str] | None = None, **given) -> CompatOptions:
    """``deep_ep.Buffer``'s ``CompatOptions`` under the rule keyword > environment > default: ``given`` holds the
    keywords the caller passed (None: not given); ``env`` defaults to the process environment (``environ.view()``)
    and only the ``_DEEPEP`` variables are read. ValueError naming the keyword or the variable, its value and the
    rule."""
    env = environ.view() if env is None else env
    fields = {}
    for var, (name, parse) in _DEEPEP.items():
        if var in env:
            fields[name] = parse(var, env[var])
    from_env = dict(fields)
    fields.update({k: v for k, v in given.items() if v is not None})
    try:
        return CompatOptions(**fields)
    except ValueError as e:
        wrong = str(e).split("=", 1)[0].rsplit(".", 1)[-1]
        var = next((v for v, (n, _) in _DEEPEP.items() if n == wrong), None)
        if var is not None and wrong in from_env and given.get(wrong) is None:
            raise ValueError(f"{var}={env[var]!r}: {str(e).split(': ', 1)[-1]}") from None
        raise ValueError(f"Buffer({wrong}=...): {e}") from None

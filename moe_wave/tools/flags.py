"""Command-line flags shared by ``demo`` and ``sweep``: the parser, the value types, and the symm backend's
options, merged with the environment.

Every flag's value is checked at parse time by its ``type=`` (``at_least``, ``seconds``, ``waves``): a bad value
is one line, ``moe-wave demo: error: argument --ranks: '0': must be an integer >= 1``, and exit status 2.
Every ``SymmOptions`` field has a flag. ``symm_options`` merges them under the one rule of ``moe_wave.env``:
a flag given wins over its ``MOE_WAVE_*`` variable, which wins over the default. The result travels to the
ranks inside the ``WaveConfig`` their function builds, never through the environment.
"""

from __future__ import annotations

import argparse

from moe_wave.comm.options import KERNELS, MODES, SIGNALS, SymmOptions
from moe_wave.env import EnvSettings

__all__ = ["Parser", "at_least", "seconds", "waves", "add_symm_args", "symm_options", "symm_argv", "SYMM_FLAGS",
           "HelpFormatter"]


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, ``<prog>: error: <message>`` (no usage block), exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def at_least(lo: int, why: str = ""):
    """``type=`` for an integer flag >= ``lo``; ``why`` is said after the rule."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < lo:
            raise argparse.ArgumentTypeError(f"{text!r}: must be an integer >= {lo}{f' ({why})' if why else ''}")
        return v
    return parse


def number(rule: str, zero: bool = False):
    """``type=`` for a finite float flag: > 0 (``zero``: >= 0); the error names ``rule``."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = float("nan")
        if not ((0 <= v) if zero else (0 < v)) or v == float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r}: must be {rule}")
        return v
    return parse


# ``type=`` for a duration flag: seconds > 0 (0 would mean "no time at all", not "forever")
seconds = number("a number of seconds > 0")


def waves(text: str) -> int | str:
    """``type=`` for ``--waves``: an integer W >= 1, or ``auto``."""
    if text == "auto":
        return text
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an integer >= 1 or 'auto'")
    return v

_DENSE = {"auto": None, "on": True, "off": False}

# (flag, SymmOptions field or copy_<CopyTuning field>, argparse keywords, help)
SYMM_FLAGS = (
    ("--symm-capacity", "capacity", dict(type=at_least(1), metavar="N"),
     "rows of each (wave, peer) block: the most tokens a rank brings to one call (env MOE_WAVE_SYMM_CAPACITY; "
     "default 4096)"),
    ("--symm-mode", "mode", dict(choices=MODES),
     "SM copies (kernel), copy engines (copy), or auto: dense copy mode where its blocks fill and the capacity is "
     ">= 1024 tokens, kernel mode below (env MOE_WAVE_SYMM_MODE; default auto)"),
    ("--symm-dense", "dense", dict(choices=tuple(_DENSE)),
     "copy mode: send each wave's tokens whole, with no pack kernel; auto where a block is expected to be >= 80%% "
     "useful (env MOE_WAVE_SYMM_DENSE; default auto)"),
    ("--symm-signal", "signal", dict(choices=SIGNALS),
     "what closes an exchange: the barrier kernel, copy-engine completion flags, or stream memory operations (no "
     "SM; a watchdog bounds the wait) (env MOE_WAVE_SYMM_SIGNAL; default barrier)"),
    ("--symm-timeout-ms", "timeout_ms", dict(type=at_least(1), metavar="MS"),
     "a peer that does not arrive within it is an error naming it (env MOE_WAVE_SYMM_TIMEOUT_MS; default 120000)"),
    ("--symm-grace-s", "grace_s", dict(type=seconds, metavar="S"),
     "memops: how long the caller has to raise the watchdog's error before the process exits (env "
     "MOE_WAVE_SYMM_GRACE_S; default 10)"),
    ("--symm-kernels", "kernels", dict(choices=KERNELS),
     "Triton on a GPU and torch ops on CPU (auto), Triton also on CPU under TRITON_INTERPRET=1 (triton), or never "
     "Triton (torch) (env MOE_WAVE_SYMM_KERNELS; default auto)"),
    ("--copy-rows-block", "copy_rows_block", dict(type=at_least(16), metavar="N"),
     "row-copy kernels: elements a program moves per step, a power of two >= 16 (env MOE_WAVE_COPY_ROWS_BLOCK; "
     "default 2048)"),
    ("--copy-warps", "copy_warps", dict(type=at_least(0), metavar="N"),
     "row-copy kernels: warps per program, 0 by tile size (env MOE_WAVE_COPY_ROWS_WARPS; default 0)"),
    ("--copy-rows", "copy_rows", dict(type=at_least(1), metavar="N"),
     "row-copy kernels: rows a program keeps in flight, a power of two (env MOE_WAVE_COPY_ROWS; default 1)"),
    ("--copy-grid", "copy_grid", dict(type=at_least(0), metavar="N"),
     "row-copy kernels: a cap on the programs, to leave SMs to a GEMM; 0 none (env MOE_WAVE_COPY_GRID; default 0)"),
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the None of flags whose default is decided later (their help says by what)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_symm_args(p: argparse.ArgumentParser) -> None:
    """Add a flag per SymmOptions field (default None: not given, the environment or the default decides)."""
    g = p.add_argument_group("symm backend options (only with the symm backend; a flag wins over its variable)")
    for flag, _, kw, help_ in SYMM_FLAGS:
        g.add_argument(flag, default=None, help=help_, **kw)


def symm_options(args, env: EnvSettings, backends) -> SymmOptions:
    """The SymmOptions of ``args``' flags over ``env`` over the defaults. A flag given without the symm backend
    among ``backends`` is a ValueError naming it; so is a combination SymmOptions rejects."""
    given = {field: getattr(args, _dest(flag), None) for flag, field, _, _ in SYMM_FLAGS}
    named = [flag for flag, field, _, _ in SYMM_FLAGS if given[field] is not None]
    if named and not {"symm", "auto"} & set(backends):
        raise ValueError(f"{', '.join(named)}: only with the symm backend (--backend is {','.join(backends)!r})")
    dense = given.pop("dense")
    try:
        opts = env.symm_options(**given)
        # "auto" is a value of its own (None), which symm_options would read as "not given"
        return opts if dense is None else opts.replace(dense=_DENSE[dense])
    except ValueError as e:
        raise ValueError(f"{', '.join(named) or 'the symm options'}: {e}") from None


def symm_argv(opts: SymmOptions) -> list[str]:
    """The flags that reproduce ``opts`` (those of the fields that differ from the defaults)."""
    base, out = SymmOptions(), []
    for flag, field, _, _ in SYMM_FLAGS:
        get = (lambda o, f=field: getattr(o.copy, f[5:])) if field.startswith("copy_") else (
            lambda o, f=field: getattr(o, f))
        value = get(opts)
        if value != get(base):
            out += [flag, {None: "auto", True: "on", False: "off"}[value] if field == "dense" else str(value)]
    return out

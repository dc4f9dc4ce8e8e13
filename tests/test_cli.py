"""CLI: ``info`` lists versions, backends and launcher; the parser takes the documented flags."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moe_wave.cli import build_parser, comm_backends, format_table

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(60)
def test_info_runs_and_lists_backends():
    proc = subprocess.run([sys.executable, "-m", "moe_wave", "info"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for key in ("moe-wave", "python", "torch", "comm backends", "launcher", "devices"):
        assert key in out, out
    backends = next(ln for ln in out.splitlines() if ln.startswith("comm backends"))
    assert "torch" in backends


def test_torch_backend_always_available():
    assert comm_backends()[0] == "torch"


def test_demo_flags_parse():
    args = build_parser().parse_args(["demo", "--ranks", "3", "--tokens", "0", "--waves", "4", "--partition",
                                      "tokens", "--backend", "torch", "--no-overlap", "--seed", "7", "--dtype",
                                      "bfloat16"])
    assert (args.ranks, args.tokens, args.waves, args.partition, args.overlap, args.seed, args.dtype) == (
        3, 0, 4, "tokens", False, 7, "bfloat16")
    assert build_parser().parse_args(["demo"]).overlap is True


def test_bad_flag_value_is_rejected():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--partition", "rows"])


def test_table_is_aligned():
    lines = format_table(["a", "bbb"], [[1, 2], [333, 4]]).splitlines()
    assert len({len(ln) for ln in lines}) == 1


def test_symm_flags_set_the_backend_environment():
    from moe_wave.cli import apply_symm_flags

    args = build_parser().parse_args(["demo", "--backend", "symm", "--symm-mode", "copy", "--symm-dense", "off",
                                      "--symm-signal", "memops"])
    env = {}
    apply_symm_flags(args, env)
    assert env == {"MOE_WAVE_SYMM_MODE": "copy", "MOE_WAVE_SYMM_DENSE": "0", "MOE_WAVE_SYMM_SIGNAL": "memops"}
    env = {}
    apply_symm_flags(build_parser().parse_args(["demo", "--backend", "symm"]), env)
    assert env == {}, "flags not given leave the environment alone"
    with pytest.raises(ValueError, match=r"--symm-dense: only with --backend symm \(--backend is 'torch'\)"):
        apply_symm_flags(build_parser().parse_args(["demo", "--symm-dense", "on"]), {})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--symm-signal", "bell"])
    helptext = subprocess.run([sys.executable, "-m", "moe_wave", "demo", "--help"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60).stdout
    for flag in ("--symm-mode", "--symm-dense", "--symm-signal"):
        assert flag in helptext, helptext

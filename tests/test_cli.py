"""CLI: ``info`` lists versions, backends and launcher; flags and the environment merge under one rule (flag >
MOE_WAVE_* > default) into the options the ranks get as arguments; bad values are one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_wave.cli import build_parser, demo_args, format_table, info_lines
from moe_wave.comm.options import CopyTuning, SymmOptions
from moe_wave.tools import sweep
from moe_wave.tools.demo import demo_configs
from moe_wave.fp8 import resolve_precision

ROOT = Path(__file__).resolve().parents[1]
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("MOE_WAVE_")}

SYMM_ARGV = ["--backend", "symm", "--symm-capacity", "256", "--symm-mode", "copy", "--symm-dense", "off",
             "--symm-signal", "memops", "--symm-timeout-ms", "5000", "--symm-grace-s", "2.5", "--symm-kernels", "torch",
             "--copy-rows-block", "512", "--copy-warps", "4", "--copy-rows", "2", "--copy-grid", "16"]
SYMM_WANT = SymmOptions(capacity=256, mode="copy", dense=False, signal="memops", timeout_ms=5000, grace_s=2.5,
                        kernels="torch", copy=CopyTuning(rows_block=512, warps=4, rows=2, grid=16))


def _demo(argv, environ=None):
    return demo_args(build_parser().parse_args(["demo", "--preset", "tiny", *argv]), environ or {})


def _cli(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "moe_wave", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**CLEAN_ENV, **(env or {})})


@pytest.mark.timeout(60)
def test_info_runs_and_lists_backends():
    proc = _cli("info", env={"MOE_WAVE_SYMM_MODE": "copy"})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for key in ("moe-wave", "python", "torch", "comm backends", "launcher", "devices"):
        assert key in out, out
    backends = next(ln for ln in out.splitlines() if ln.startswith("comm backends"))
    assert "torch" in backends
    assert "MOE_WAVE_SYMM_MODE=copy" in next(ln for ln in out.splitlines() if ln.startswith("environment"))


def _rank_options(ep, args):
    wave, schedule = demo_configs(args, ep.size)
    return wave.symm, wave.overlap, schedule.overlap, schedule.kernels, os.environ.get("MOE_WAVE_SYMM_MODE")


def test_symm_flags_reach_the_options_every_rank_gets(ranks):
    """Each flag lands in its SymmOptions field, and the spawned ranks get it as an argument (no environment)."""
    args = _demo([*SYMM_ARGV, "--no-overlap", "--attn-kernels", "off"])
    assert args.symm == SYMM_WANT
    for got in ranks(2).run(_rank_options, args):
        assert got == (SYMM_WANT, False, True, "off", None)


def test_flag_beats_environment_beats_default():
    environ = {"MOE_WAVE_SYMM_MODE": "kernel", "MOE_WAVE_SYMM_CAPACITY": "64", "MOE_WAVE_COPY_GRID": "8",
               "MOE_WAVE_OVERLAP": "0", "MOE_WAVE_ATTN_OVERLAP": "off", "MOE_WAVE_ATTN_KERNELS": "0",
               "MOE_WAVE_CACHE": "/tmp/aw.json", "MOE_WAVE_SYMM_DENSE": "0"}
    env_only = _demo(["--backend", "symm"], environ)
    assert env_only.symm == SymmOptions(capacity=64, mode="kernel", dense=False, copy=CopyTuning(grid=8))
    assert (env_only.overlap, env_only.attn_overlap, env_only.attn_kernels, env_only.autowave_cache) == (
        False, False, "off", "/tmp/aw.json")
    flags = _demo(["--backend", "symm", "--symm-mode", "copy", "--symm-capacity", "2048", "--copy-grid", "0",
                   "--symm-dense", "auto", "--overlap", "--attn-overlap", "--attn-kernels", "auto",
                   "--autowave-cache", "/tmp/other"], environ)
    assert flags.symm == SymmOptions(capacity=2048, mode="copy", dense=None, copy=CopyTuning(grid=0))
    assert (flags.overlap, flags.attn_overlap, flags.attn_kernels, flags.autowave_cache) == (
        True, True, "auto", "/tmp/other")
    assert _demo([], {"MOE_WAVE_PRECISION": "fp8"}).precision == "fp8"
    assert _demo(["--precision", "bf16"], {"MOE_WAVE_PRECISION": "fp8"}).precision == "bf16"
    with pytest.raises(ValueError, match="MOE_WAVE_PRECISION"):
        _demo([], {"MOE_WAVE_PRECISION": "fp4"})
    with pytest.raises(ValueError, match="MOE_WAVE_ATTN_FP8.*no longer read; use MOE_WAVE_PRECISION=fp8"):
        _demo([], {"MOE_WAVE_ATTN_FP8": "1"})
    default = _demo([])
    assert default.precision == ("fp8" if resolve_precision("auto", "cuda" if torch.cuda.is_available() else "cpu")
                                 == "fp8" else "bf16")
    assert default.symm == SymmOptions()
    assert (default.overlap, default.attn_overlap, default.attn_kernels, default.autowave_cache, default.nvtx) == (
        True, True, "auto", None, False)


def test_symm_flags_need_the_symm_backend():
    with pytest.raises(ValueError, match=r"--symm-dense, --copy-grid: only with the symm backend \(--backend is "
                                         r"'torch'\)"):
        _demo(["--backend", "torch", "--symm-dense", "on", "--copy-grid", "4"])
    _demo(["--symm-dense", "on"])      # the default backend, auto, is symm on a GPU host: its flags are taken
    with pytest.raises(ValueError, match=r"--symm-mode: SymmOptions.mode='kernel' with kernels='torch'"):
        _demo(["--backend", "symm", "--symm-mode", "kernel"], {"MOE_WAVE_SYMM_KERNELS": "torch"})


def test_sweep_takes_the_symm_flags_and_the_environment(tmp_path):
    p = build_parser()
    argv = ["sweep", "--backend", "torch,symm", "--symm-signal", "flags", "--out", str(tmp_path / "s.csv")]
    spec = sweep.build_spec(p.parse_args(argv), 2, "none", env=None)
    assert spec["symm"] == SymmOptions(signal="flags") and spec["autowave_cache"] is None
    assert spec["common"].endswith("--symm-signal flags"), "each row's command reproduces the options"
    again = sweep.build_spec(p.parse_args(["sweep", "--backend", "symm", *spec["common"].split()]), 2, "none")
    assert again["symm"] == spec["symm"]
    full = sweep.build_spec(p.parse_args(["sweep", *SYMM_ARGV]), 2, "none")
    assert sweep.build_spec(p.parse_args(["sweep", "--backend", "symm", *full["common"].split()]), 2,
                            "none")["symm"] == SYMM_WANT
    with pytest.raises(ValueError, match=r"--symm-signal: only with the symm backend \(--backend is 'torch'\)"):
        sweep.build_spec(p.parse_args(["sweep", "--backend", "torch", "--symm-signal", "flags"]), 2, "none")
    graphed = sweep.build_spec(p.parse_args(["sweep", "--no-graph", "--out", str(tmp_path / "g.csv")]), 2, "none")
    assert graphed["graph"] is False and "--no-graph" in graphed["common"], "the row's command keeps the switch"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("var, value", [("MOE_WAVE_SYMM_TIMEOUT_MS", "soon"), ("MOE_WAVE_OVERLAP", "maybe"),
                                        ("MOE_WAVE_SYMM_FLAGS", "1")])
def test_bad_environment_is_a_one_line_error(var, value):
    proc = _cli("demo", env={var: value})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"moe-wave demo: error: {var}={value!r}"), proc.stderr


@pytest.mark.timeout(60)
def test_help_lists_every_symm_flag():
    for cmd in ("demo", "sweep"):
        text = _cli(cmd, "--help").stdout
        for flag in ("--symm-capacity", "--symm-mode", "--symm-dense", "--symm-signal", "--symm-timeout-ms",
                     "--symm-grace-s", "--symm-kernels", "--copy-rows-block", "--copy-warps", "--copy-rows",
                     "--copy-grid"):
            assert flag in text, (cmd, flag)


def test_info_reads_the_environment_it_is_given():
    rows = dict(info_lines({"MOE_WAVE_NVTX": "1"}))
    assert rows["environment"] == "MOE_WAVE_NVTX=1"
    with pytest.raises(ValueError, match=r"MOE_WAVE_NVTX='2': must be 1 or 0"):
        info_lines({"MOE_WAVE_NVTX": "2"})


def test_table_is_aligned():
    lines = format_table(["a", "bbb"], [[1, 2], [333, 4]]).splitlines()
    assert len({len(ln) for ln in lines}) == 1


def test_info_says_what_precision_auto_means_and_what_runs_the_fp8_gemms():
    rows = dict(info_lines({}))
    if not torch.cuda.is_available():
        assert rows["precision"] == "auto = bf16; FP8 projections on torch-ref, FP8 experts on per-expert"
    assert rows["precision"].startswith("auto = ") and "FP8 experts on " in rows["precision"]
    assert "deep_gemm" in rows


def test_demo_waves_default_is_one_on_one_rank_and_two_on_several():
    """One rank exchanges nothing, so the demo's default there is one wave (W=2 only splits the experts' work);
    several ranks get two; a --waves the user gives is kept on any number of ranks."""
    for ranks, want in ((1, 1), (2, 2), (4, 2)):
        args = _demo([])
        wave, _ = demo_configs(args, ranks)
        assert (args.waves, wave.num_waves, args.waves_default) == (want, want, True), ranks
    args = _demo([])
    demo_configs(args, 1)
    assert demo_configs(args, 2)[0].num_waves == 2       # the default follows each run's world size
    args = _demo(["--waves", "2"])
    assert demo_configs(args, 1)[0].num_waves == 2 and not args.waves_default
    args = _demo(["--waves", "auto"])
    assert demo_configs(args, 1)[0].num_waves == "auto"

"""sweep: a 2 x 2 grid on 2 gloo ranks (CSV columns, sidecar, traces), resume, plots, bad grid values."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from moe_wave.env import read_env
from moe_wave.tools import plots, sweep
from moe_wave.tools.trace import load_trace, range_names

ROOT = Path(__file__).resolve().parents[1]


def _args(*argv) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    sweep.add_sweep_args(p)
    return p.parse_args(list(argv))


def _spec(tmp_path, waves="1,2", trace=True):
    argv = ["--preset", "tiny", "--tokens", "8,16", "--waves", waves, "--shared", "bubbles", "--iters", "2",
            "--warmup", "1", "--pool", "2", "--out", str(tmp_path / "s.csv"), "--no-plots"]
    if trace:
        argv += ["--trace", str(tmp_path / "traces")]
    return sweep.build_spec(_args(*argv), 2, "none", read_env({"MOE_WAVE_GIT_SHA": "abc123"}))


@pytest.fixture(scope="module")
def grid(ranks, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    measured = ranks(2).run(sweep.run_rank, _spec(tmp))
    return tmp, measured


def test_grid_writes_csv_sidecar_and_traces(grid):
    tmp, measured = grid
    assert len(measured[0]) == 4 and measured[0] == measured[1]
    with (tmp / "s.csv").open() as f:
        assert tuple(f.readline().strip().split(",")) == sweep.COLUMNS
    rows = sweep.read_rows(tmp / "s.csv")
    assert [(r["tokens_per_rank"], r["num_waves"]) for r in rows] == [("8", "1"), ("8", "2"), ("16", "1"), ("16", "2")]
    for r in rows:
        assert r["check"] == "ok", r
        assert r["world_size"] == "2" and r["shape"] == "tiny" and r["dtype"] == "float32"
        for k in ("serial_us", "pipelined_us", "comm_only_us", "compute_only_us", "ideal_us", "auto_us"):
            assert float(r[k]) > 0, (k, r)
        assert float(r["ideal_us"]) == max(float(r["comm_only_us"]), float(r["compute_only_us"]))
        assert int(r["auto_num_waves"]) >= 1
        assert r["command"].startswith("python -m moe_wave sweep --ranks 2 --preset tiny")
        assert f"--tokens {r['tokens_per_rank']} --waves {r['num_waves']}" in r["command"]
    doc = json.loads((tmp / "s.json").read_text())
    for k in ("date", "command", "git_sha", "gpus", "torch", "nccl", "world_size", "env", "settings"):
        assert k in doc["meta"], k
    assert doc["meta"]["git_sha"] == "abc123" and doc["meta"]["settings"]["autowave_cache"] is None
    assert len(doc["rows"]) == 4
    assert "| tiny |" in (tmp / "s.md").read_text()
    for r in range(2):
        path = tmp / "traces" / f"trace_rank{r}.json.gz"
        assert isinstance(load_trace(path)["traceEvents"], list)
        names = range_names(path)
        for n in ("router", "layout", "prepare", "wave0.dispatch", "wave0.experts", "wave0.combine", "wave1.experts",
                  "bench.pipelined", "bench.comm_only", "bench.compute_only", "shared.serial"):
            assert n in names, (n, sorted(names))


def test_resume_skips_finished_points(ranks, grid):
    tmp, _ = grid
    again = ranks(2).run(sweep.run_rank, _spec(tmp, trace=False))
    assert again == [[], []]
    more = ranks(2).run(sweep.run_rank, _spec(tmp, waves="1,2,4", trace=False))
    assert sorted((k[5], k[6]) for k in more[0]) == [("16", "4"), ("8", "4")]
    rows = sweep.read_rows(tmp / "s.csv")
    keys = [tuple(r[k] for k in sweep.KEY) for r in rows]
    assert len(rows) == 6 and len(set(keys)) == 6


def test_resume_after_a_torn_row(ranks, grid, tmp_path, capsys):
    """A crash mid-row: the torn row is dropped, its point measured again, and no row is glued onto it."""
    tmp, _ = grid
    lines = (tmp / "s.csv").read_bytes().split(b"\r\n")[:5]          # the header and the 2 x 2 grid
    (tmp_path / "s.csv").write_bytes(b"\r\n".join(lines[:4]) + b"\r\n" + lines[4][: len(lines[4]) // 2])
    measured = ranks(2).run(sweep.run_rank, _spec(tmp_path, trace=False))
    assert [(k[5], k[6]) for k in measured[0]] == [("16", "2")], "only the torn point is measured again"
    text = (tmp_path / "s.csv").read_bytes()
    assert text.endswith(b"\r\n") and text.count(b"\r\n") == 5, text
    assert [(r["tokens_per_rank"], r["num_waves"]) for r in sweep.read_rows(tmp_path / "s.csv")] == [
        ("8", "1"), ("8", "2"), ("16", "1"), ("16", "2")]


def test_sweep_without_matplotlib_writes_csv_and_says_why_no_plots(ranks, grid, tmp_path, capsys, monkeypatch):
    tmp, _ = grid
    (tmp_path / "s.csv").write_bytes((tmp / "s.csv").read_bytes())
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # the base install
    monkeypatch.setattr(sweep, "spawn", lambda fn, n, args, **kw: ranks(n).run(fn, *args))
    args = _args("--preset", "tiny", "--tokens", "8,16", "--waves", "1,2", "--shared", "bubbles", "--iters", "1",
                 "--warmup", "0", "--pool", "1", "--ranks", "2", "--out", str(tmp_path / "s.csv"))
    assert sweep.run(args, read_env({})) == 0
    out, err = capsys.readouterr()
    assert "moe-wave sweep: note: plots need matplotlib: pip install 'moe-wave[bench]'" in err
    assert "plots: none (plots need matplotlib: pip install 'moe-wave[bench]')" in out
    assert f"csv: {tmp_path / 's.csv'}" in out and (tmp_path / "s.md").exists()
    assert not list(tmp_path.glob("*.png"))


def test_plots_from_csv(grid):
    tmp, _ = grid
    from moe_wave.cli import main

    assert main(["plot", str(tmp / "s.csv")]) == 0
    for name in ("s_speedup.png", "s_exposed.png", "s_best_waves.png"):
        p = tmp / name
        assert p.exists() and p.read_bytes()[:4] == b"\x89PNG", name
    assert plots.draw([], tmp / "none") == []
    assert plots.draw([{**r, "check": "FAIL"} for r in sweep.read_rows(tmp / "s.csv")], tmp / "failed") == []


def test_default_out_is_never_the_committed_folder(tmp_path):
    spec = sweep.build_spec(_args("--preset", "tiny"), 2, "none")
    assert Path(spec["out"]).parts[:2] == ("results", "sweep") and spec["out"].endswith(".csv")
    assert sweep.build_spec(_args(), 2, "none", out_root=str(tmp_path))["out"] == str(tmp_path / "sweep.csv")


@pytest.mark.parametrize("argv, match", [
    (["--waves", "0"], r"--waves='0': 0 is invalid \(wave counts must be >= 1\)"),
    (["--waves", "2,x"], r"--waves='2,x': 'x' is not an integer"),
    (["--tokens", "0"], r"--tokens='0': 0 is invalid \(tokens per rank must be >= 1\)"),
    (["--preset", "v5"], r"--preset='v5': 'v5' is not one of"),
    (["--partition", "rows"], r"--partition='rows': 'rows' is not one of experts, tokens"),
    (["--shared", "never"], r"--shared='never'"),
    (["--hidden", "64", "--intermediate", "32", "--experts", "8"], r"--topk missing"),
    (["--hidden", "64", "--intermediate", "32", "--experts", "7", "--topk", "2"], r"--experts: num_experts=7 must be "
                                                                                    r"divisible by the 2 ranks"),
    (["--hidden", "64", "--intermediate", "32", "--experts", "8", "--topk", "9"], r"--topk=9: must be <= --experts=8"),
    (["--out", "x.txt"], r"--out='x.txt': must be a folder or end in .csv"),
])
def test_bad_grid_values(argv, match):
    with pytest.raises(ValueError, match=match):
        sweep.build_spec(_args(*argv), 2, "none")


def test_cli_reports_bad_values(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "moe_wave", "sweep", "--waves", "0", "--out", str(tmp_path / "a.csv")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--waves='0'" in proc.stderr, proc.stderr


def test_experts_once_point(ranks, tmp_path):
    """--partition experts-once: the experts partition with a row once per layer (WaveConfig.sends='once', on the
    symm backend that backend 'auto' then takes), measured and checked like any point."""
    argv = ["--preset", "tiny", "--tokens", "16", "--waves", "2", "--shared", "bubbles", "--iters", "2",
            "--warmup", "1", "--pool", "2", "--out", str(tmp_path / "o.csv"), "--no-plots",
            "--partition", "experts-once"]
    measured = ranks(2).run(sweep.run_rank, sweep.build_spec(_args(*argv), 2, "none", read_env({})))
    assert len(measured[0]) == 1
    rows = sweep.read_rows(tmp_path / "o.csv")
    assert [(r["partition"], r["check"]) for r in rows] == [("experts-once", "ok")], rows

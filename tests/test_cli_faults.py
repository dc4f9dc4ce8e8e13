"""Faults at the CLI's edges (issue 17, items 5 and 8): every bad flag is a one-line parse error, exit 2, no
traceback; a torn, malformed or foreign sweep CSV is repaired or named on resume, never counted as done;
``plot`` on a missing file and the base install without matplotlib say so. CPU only, no ranks."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moe_wave.cli import build_parser, main
from moe_wave.tools import plots, sweep, sweep_csv

ROOT = Path(__file__).resolve().parents[1]
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("MOE_WAVE_")}


def _cli(*argv):
    return subprocess.run([sys.executable, "-m", "moe_wave", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=CLEAN_ENV)


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


# ----------------------------------------------------------------------------- flags

@pytest.mark.parametrize("cmd, flag, value, rule", [
    ("demo", "--ranks", "0", "must be an integer >= 1"),
    ("demo", "--ranks", "x", "must be an integer >= 1"),
    ("demo", "--waves", "0", "must be an integer >= 1 or 'auto'"),
    ("demo", "--waves", "abc", "must be an integer >= 1 or 'auto'"),
    ("demo", "--tokens", "-5", "must be an integer >= 1 (tokens per rank"),
    ("demo", "--tokens", "0", "must be an integer >= 1 (tokens per rank"),
    ("demo", "--timeout", "0", "must be a number of seconds > 0"),
    ("demo", "--timeout", "nan", "must be a number of seconds > 0"),
    ("demo", "--layers", "0", "must be an integer >= 1"),
    ("demo", "--iters", "0", "must be an integer >= 1"),
    ("demo", "--warmup", "-1", "must be an integer >= 0"),
    ("demo", "--symm-capacity", "0", "must be an integer >= 1"),
    ("demo", "--symm-timeout-ms", "0", "must be an integer >= 1"),
    ("demo", "--symm-grace-s", "0", "must be a number of seconds > 0"),
    ("sweep", "--ranks", "0", "must be an integer >= 1"),
    ("sweep", "--timeout", "0", "must be a number of seconds > 0"),
    ("sweep", "--deadline", "-1", "must be a number of seconds > 0"),
    ("sweep", "--iters", "0", "must be an integer >= 1"),
    ("sweep", "--pool", "0", "must be an integer >= 1"),
    ("sweep", "--hidden", "0", "must be an integer >= 1"),
])
def test_bad_flag_is_a_one_line_parse_error(capsys, cmd, flag, value, rule):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([cmd, f"{flag}={value}"])
    assert exit_.value.code == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"moe-wave {cmd}: error: argument {flag}: {value!r}: {rule}"), line


def test_good_values_still_parse():
    a = build_parser().parse_args(["demo", "--waves", "auto", "--timeout", "0.5", "--tokens", "1", "--warmup", "0"])
    assert (a.waves, a.timeout, a.tokens, a.warmup) == ("auto", 0.5, 1, 0)
    assert build_parser().parse_args(["demo", "--waves", "3"]).waves == 3


def test_more_waves_than_local_experts_is_an_error(capsys):
    # tiny: 8 experts over 2 ranks = 4 local experts; a wave is a block of them
    assert main(["demo", "--preset", "tiny", "--ranks", "2", "--waves", "16"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("moe-wave demo: error: --waves=16: must be <= 4, the local experts per rank "
                           "(preset tiny: 8 experts over 2 ranks)"), line


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv, start", [
    (["demo", "--ranks", "0"], "moe-wave demo: error: argument --ranks: '0': must be an integer >= 1"),
    (["demo", "--preset", "tiny", "--ranks", "2", "--waves", "16"], "moe-wave demo: error: --waves=16: must be <= 4"),
])
def test_no_traceback_end_to_end(argv, start):
    proc = _cli(*argv)
    assert proc.returncode == 2, proc.stderr
    assert _one_line(proc.stderr).startswith(start)


# ----------------------------------------------------------------------------- plot, matplotlib

def _row(waves: int, tokens: int = 8) -> dict:
    """A well-formed sweep row (strings, as the CSV holds them)."""
    return dict(shape="tiny", hidden="64", intermediate="32", experts="8", topk="2", tokens_per_rank=str(tokens),
                num_waves=str(waves), partition="experts", backend="torch", shared_placement="bubbles",
                dtype="float32", world_size="2", effective_waves=str(waves), serial_us="10.0", pipelined_us="9.0",
                comm_only_us="4.0", compute_only_us="6.0", ideal_us="6.0", exposed_us="3.0", overlap_ratio="0.25",
                speedup="1.11", link_bytes="1024", GBps="0.26", check="ok", max_err="0.0", auto_num_waves="2",
                auto_us="9.5", device="cpu", command=f"python -m moe_wave sweep --waves {waves}")


def _write(path: Path, rows: list[dict], tail: str = "") -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, sweep_csv.COLUMNS)
        w.writeheader()
        w.writerows(rows)
        f.write(tail)


def test_plot_of_a_missing_file_is_an_error(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "none.csv")]) == 2
    assert _one_line(capsys.readouterr().err) == f"moe-wave plot: error: {tmp_path / 'none.csv'}: no such file"
    _write(tmp_path / "empty.csv", [])
    assert main(["plot", str(tmp_path / "empty.csv")]) == 1
    assert "no row with check ok: nothing to draw" in _one_line(capsys.readouterr().err)


def test_no_matplotlib_says_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib -> ImportError
    _write(tmp_path / "s.csv", [_row(1), _row(2)])
    assert not plots.available()
    assert main(["plot", str(tmp_path / "s.csv")]) == 1
    assert _one_line(capsys.readouterr().err) == "moe-wave plot: error: plots need matplotlib: pip install " \
                                                 "'moe-wave[bench]'"
    spec = {"out": str(tmp_path / "s.csv"), "plots": True}
    sweep._preflight(spec, show=True)       # before any point is measured
    assert spec["plots"] is False
    assert "plots need matplotlib: pip install 'moe-wave[bench]'" in _one_line(capsys.readouterr().err)


# ----------------------------------------------------------------------------- the sweep's CSV

def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_torn_last_row_is_dropped_and_measured_again(tmp_path):
    path = tmp_path / "s.csv"
    torn = ",".join(_row(4).values())[:40]          # the crash cut the row in flight
    _write(path, [_row(1), _row(2)], tail=torn)
    said = []
    rows, writer = sweep_csv.resume(path, report=said.append)
    assert [r["num_waves"] for r in rows] == ["1", "2"], "the torn row is not done"
    assert said == [f"{path}:4: the last row has no newline (torn by a crash): dropped, its point is measured again"]
    writer.write(_row(4))
    writer.close()
    assert [r["num_waves"] for r in sweep_csv.read_rows(path)] == ["1", "2", "4"]
    assert sweep_csv.load(path).clean and len(_lines(path)) == 4, "no row glued onto the torn one"


def test_torn_header_and_empty_file_start_over(tmp_path):
    for text in ("", ",".join(sweep_csv.COLUMNS)[:25]):
        path = tmp_path / "s.csv"
        path.write_text(text)
        rows, writer = sweep_csv.resume(path, report=lambda m: None)
        writer.write(_row(1))
        writer.close()
        assert rows == [] and [r["num_waves"] for r in sweep_csv.read_rows(path)] == ["1"]
        assert sweep_csv.load(path).clean


def test_malformed_rows_are_named_and_not_done(tmp_path):
    path = tmp_path / "s.csv"
    _write(path, [_row(1)], tail="\x00garbage,\"unclosed\r\n" + ",".join({**_row(2), "num_waves": "x"}.values())
           + "\r\n" + ",".join(_row(4).values()) + "\r\n")
    said = []
    rows, writer = sweep_csv.resume(path, report=said.append)
    writer.close()
    assert [r["num_waves"] for r in rows] == ["1", "4"], "a malformed row counts as done"
    assert said[0].startswith(f"{path}:3: not one CSV record")
    assert said[1].startswith(f"{path}:4: num_waves='x': not an integer >= 1")
    assert len(said) == 2 and sweep_csv.load(path).clean, "the malformed rows are removed from the file"
    assert [r["num_waves"] for r in sweep_csv.read_rows(path)] == ["1", "4"]


def test_wrong_field_count_is_malformed(tmp_path):
    path = tmp_path / "s.csv"
    _write(path, [_row(1)], tail="1,2,3\r\n")
    found = sweep_csv.load(path)
    assert len(found.rows) == 1 and found.problems == [f"{path}:3: 3 fields, a row has {len(sweep_csv.COLUMNS)}"]


def test_each_row_is_synced(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(sweep_csv.os, "fsync", lambda fd: synced.append(fd))
    _, writer = sweep_csv.resume(tmp_path / "s.csv")
    before = len(synced)
    writer.write(_row(1))
    writer.write(_row(2))
    writer.close()
    assert len(synced) - before == 2


def test_foreign_header_is_one_clear_error(tmp_path):
    foreign = tmp_path / "f.csv"
    foreign.write_text("a,b\n1,2\n")
    want = (re.escape(str(foreign)) + r": not a CSV of this sweep: expected 29 columns \(shape,hidden,intermediate,experts,\.\.\.,"
            r"command\), found 2 columns \(a,b\) \(missing shape,hidden,intermediate,experts,\.\.\.; not sweep "
            r"columns: a,b\)")
    with pytest.raises(ValueError, match=want):
        sweep_csv.resume(foreign)
    assert foreign.read_text() == "a,b\n1,2\n", "a foreign file is left as it was"


@pytest.mark.timeout(120)
def test_foreign_out_file_end_to_end(tmp_path):
    foreign = tmp_path / "f.csv"
    foreign.write_text("a,b\n1,2\n")
    proc = _cli("sweep", "--preset", "tiny", "--tokens", "8", "--waves", "1", "--out", str(foreign))
    assert proc.returncode == 2, proc.stderr
    assert _one_line(proc.stderr).startswith(f"moe-wave sweep: error: {foreign}: not a CSV of this sweep")

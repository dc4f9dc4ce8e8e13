"""The first hour of a new user (issue 53, item 5): the README's first example runs as written (this test reads it
from README.md and executes it), the Quickstart is two commands followed by how to run the CLI from the venv, the
README has the sections a user looks for and links one results table per area, every value the knob table shows
is accepted, and the sweep on CPU prints no speedups."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moe_wave.env import VARIABLES, read_env

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _section(name: str) -> str:
    """The text under ``## name`` up to the next ``## `` heading."""
    m = re.search(rf"^## {re.escape(name)}\n(.*?)(?=^## |\Z)", README, re.S | re.M)
    assert m, f"README.md has no '## {name}' section"
    return m.group(1)


def _fenced(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


@pytest.mark.timeout(300)
def test_the_first_example_runs_as_written(capsys):
    (code,) = _fenced(_section("First example"), "python")[:1]
    exec(compile(code, "README.md#first-example", "exec"), {"__name__": "readme_first_example"})
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"\(16, \d+\) \(1, 16, 2, \d+\)", out), out


def test_quickstart_is_two_commands_and_says_how_to_run_the_cli():
    quick = _section("Quickstart")
    assert _fenced(quick, "bash")[0].strip().splitlines() == ["bash launch/demo.sh", "bash launch/test.sh"]
    assert ".venv/bin/python -m moe_wave --help" in quick and "source .venv/bin/activate" in quick
    assert re.search(r"about \d+ minutes on 2 CPU cores", quick), "the test command's duration"


def test_readme_sections_and_results_links():
    heads = re.findall(r"^## (.+)$", README, re.M)
    for name in ("Quickstart", "First example", "Launching", "API", "Knobs", "Results"):
        assert name in heads, heads
    results = _section("Results")
    for area in ("moe", "comm", "attn", "deepep_api", "sweep", "experts"):
        assert f"(benchmarks/results/{area}.md)" in results, area
    assert len(README.splitlines()) <= 300, "a README read in ten minutes"
    assert "docs/attention.md" in README and "Gluon" not in README, "the attention kernels live in docs/attention.md"


def test_every_value_the_knob_table_shows_is_accepted():
    rows = [ln for ln in _section("Knobs").splitlines() if ln.startswith("|") and "MOE_WAVE_" in ln]
    checked = 0
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        env, meaning = cells[2], cells[3]
        names = re.findall(r"`(MOE_WAVE_[A-Z0-9_]+)`", env)
        if len(names) != 1 or names[0] not in VARIABLES:
            continue
        for value in re.findall(r"`([a-z0-9]+)`", meaning):
            read_env({names[0]: value})      # a ValueError names the variable and the value
            checked += 1
    assert checked >= 20, checked
    documented = set(re.findall(r"MOE_WAVE_[A-Z0-9_]+", _section("Knobs")))
    short = {f"MOE_WAVE_COPY{s}" for s in re.findall(r"`(_[A-Z_]+)`", _section("Knobs"))}
    assert set(VARIABLES) <= documented | short, set(VARIABLES) - documented - short


def test_the_sweep_prints_no_speedup_on_cpu(capsys):
    from moe_wave.tools import sweep

    row = dict(shape="tiny", tokens_per_rank="8", num_waves="1", partition="experts", shared_placement="bubbles",
               serial_us="10.0", pipelined_us="6.9", comm_only_us="4.0", compute_only_us="6.0", speedup="1.45",
               overlap_ratio="0.25", check="ok", auto_num_waves="1", device="cpu")
    sweep.print_table([row])
    text = capsys.readouterr().out
    assert "1.45" not in text and "speedup" not in text.splitlines()[0], text
    assert "on CPU the timings are not meaningful" in text
    sweep.print_table([{**row, "device": "NVIDIA H200"}])
    assert "1.45" in capsys.readouterr().out

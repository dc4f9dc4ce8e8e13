"""Plots of a sweep's rows (matplotlib, Agg), written beside the sweep's CSV (``<stem>`` is its path
without the suffix):

    <stem>_speedup.png      serial / pipelined vs tokens per rank, one line per wave count, a panel per shape
    <stem>_exposed.png      exposed comm (pipelined - compute_only) vs waves, one line per tokens per rank
    <stem>_best_waves.png   heat map of the best wave count (lowest pipelined time), shape x tokens per rank

The rows are dicts of strings as ``csv.DictReader`` gives them (``sweep.read_rows``). Rows whose check
failed are left out. When the rows hold several partitions, backends or shared placements, each
(partition, backend, placement) combination gets its own line style / heat-map row.

matplotlib comes with the ``[bench]`` extra: without it ``available()`` is False and ``draw`` raises an
ImportError that says what to install.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

__all__ = ["draw", "available", "INSTALL_HINT"]

INSTALL_HINT = "plots need matplotlib: pip install 'moe-wave[bench]'"


def available() -> bool:
    """Whether matplotlib can be imported here."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _usable(rows: list[dict]) -> list[dict]:
    out = []
    for row in rows:
        if row.get("check") != "ok" or not row.get("pipelined_us"):
            continue
        r = dict(row)   # the caller's rows stay as they were
        r["T"] = int(r["tokens_per_rank"])
        r["W"] = int(r["num_waves"])
        r["sched"] = f"{r['partition']}/{r['backend']}/{r['shared_placement']}"
        out.append(r)
    return out


def _panels(n: int, plt):
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def _line_panels(plt, rows, shapes, scheds, path: str, *, series: str, x: str, y, hline: float,
                 xlabel: str, ylabel: str) -> Path:
    """One panel per shape: a line per (schedule, ``series`` value) of y(row) against row[x] (log2)."""
    styles = ["-", "--", ":", "-."]
    fig, axes = _panels(len(shapes), plt)
    for ax, shape in zip(axes, shapes):
        lines = defaultdict(list)
        for r in rows:
            if r["shape"] == shape:
                lines[(r["sched"], r[series])].append((r[x], y(r)))
        for (sched, v), pts in sorted(lines.items()):
            pts.sort()
            label = f"{series}={v}" if len(scheds) == 1 else f"{series}={v} {sched}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[scheds.index(sched) % 4], marker="o", label=label)
        ax.axhline(hline, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set(title=shape, xlabel=xlabel, ylabel=ylabel)
        ax.legend(fontsize=7)
    return _save(fig, plt, path)


def draw(rows: list[dict], stem: str | os.PathLike) -> list[Path]:
    """Draw the three PNGs of ``rows`` at ``<stem>_*.png``; returns their paths (none when no row passed its
    check)."""
    rows = _usable(rows)
    if not rows:
        return []
    try:
        import matplotlib   # the [bench] extra: only where there is something to draw
    except ImportError:
        raise ImportError(INSTALL_HINT) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem = Path(stem)
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    scheds = list(dict.fromkeys(r["sched"] for r in rows))
    out = []

    out.append(_line_panels(plt, rows, shapes, scheds, f"{stem}_speedup.png", series="W", x="T",
                            y=lambda r: float(r["serial_us"]) / float(r["pipelined_us"]), hline=1.0,
                            xlabel="tokens per rank", ylabel="speedup (serial / pipelined)"))
    out.append(_line_panels(plt, [r for r in rows if r.get("exposed_us")], shapes, scheds, f"{stem}_exposed.png",
                            series="T", x="W", y=lambda r: float(r["exposed_us"]), hline=0.0,
                            xlabel="waves W", ylabel="exposed comm (us)"))

    best = {}
    for r in rows:
        k = (r["shape"], r["sched"], r["T"])
        if k not in best or float(r["pipelined_us"]) < float(best[k]["pipelined_us"]):
            best[k] = r
    ylabels = list(dict.fromkeys((s, sc) for s, sc, _ in best))
    tokens = sorted({T for _, _, T in best})
    grid = [[float("nan")] * len(tokens) for _ in ylabels]
    for (s, sc, T), r in best.items():
        grid[ylabels.index((s, sc))][tokens.index(T)] = r["W"]
    fig, ax = plt.subplots(figsize=(1.2 * len(tokens) + 3, 0.6 * len(ylabels) + 2))
    im = ax.imshow(grid, cmap="viridis", aspect="auto")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v == v:
                ax.text(j, i, f"{int(v)}", ha="center", va="center", color="w")
    ax.set_xticks(range(len(tokens)), [str(t) for t in tokens])
    ax.set_yticks(range(len(ylabels)), [s if len(scheds) == 1 else f"{s} {sc}" for s, sc in ylabels])
    ax.set(xlabel="tokens per rank", title="best wave count (lowest pipelined time)")
    fig.colorbar(im, ax=ax, label="W")
    out.append(_save(fig, plt, f"{stem}_best_waves.png"))
    return out


def _save(fig, plt, path: str) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)

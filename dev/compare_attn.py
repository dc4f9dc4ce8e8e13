"""Before / after for bench_attn: the same points from two trees, measured alternately in one call.

    python dev/compare_attn.py BEFORE.json [BEFORE2.json ...] -- AFTER.json [AFTER2.json ...] [--tol 0.02]

(a ``.log`` of bench_attn's output works too: its JSON lines.)

Each side's value for a point (shape, layer type, precision, mode, tokens/batch, graphs) is the smallest of its
runs' ``layer_us`` (and ``core_us``); prints after / before per point and whether it is within ``--tol``.
Exit status 1 when a point is outside it (or missing on one side).
"""

from __future__ import annotations

import json
import sys


def points(paths: list[str]) -> dict:
    out: dict = {}
    for p in paths:
        with open(p) as f:
            text = f.read()
        if p.endswith(".json"):
            d = json.loads(text)
            rows = d["rows"] if isinstance(d, dict) else d
        else:                       # a run's log: the rows it printed as JSON lines (a run cut short keeps them)
            rows = [json.loads(line) for line in text.splitlines() if line.startswith("{") and '"layer_us"' in line]
        for r in rows:
            if r.get("mode") not in ("prefill", "decode"):
                continue
            key = (r["shape"], r["layer_type"], r["precision"], r["mode"], r.get("batch") or r.get("tokens"),
                   bool(r.get("cuda_graph")))
            for field in ("layer_us", "core_us"):
                if r.get(field) is not None:
                    out.setdefault(key, {}).setdefault(field, []).append(float(r[field]))
    return out


def main(argv: list[str]) -> int:
    tol = 0.02
    if "--tol" in argv:
        i = argv.index("--tol")
        tol = float(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    if "--" not in argv:
        sys.exit("compare_attn: BEFORE.json ... -- AFTER.json ...")
    cut = argv.index("--")
    before, after = points(argv[:cut]), points(argv[cut + 1:])
    bad = 0
    print(f"{'shape':9} {'type':8} {'prec':5} {'mode':8} {'n':>5} {'before us':>10} {'after us':>10} {'after/before':>12}"
          f" {'core b/a':>16}  within {tol:.0%}")
    for key in sorted(set(before) | set(after), key=str):
        b, a = before.get(key, {}), after.get(key, {})
        if "layer_us" not in b or "layer_us" not in a:
            print(f"{key}: only {'before' if b else 'after'}")
            bad += 1
            continue
        lb, la = min(b["layer_us"]), min(a["layer_us"])
        ratio = la / lb
        ok = ratio <= 1 + tol
        bad += not ok
        core = (f"{min(b['core_us']):.1f}/{min(a['core_us']):.1f}" if "core_us" in b and "core_us" in a else "-")
        print(f"{key[0]:9} {key[1]:8} {key[2]:5} {key[3]:8} {key[4]!s:>5} {lb:10.1f} {la:10.1f} {ratio:12.3f} "
              f"{core:>16}  {'yes' if ok else 'NO'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Before / after for bench_experts: the same points from two trees, measured alternately in one call.

    python dev/compare_experts.py BEFORE.json [BEFORE2.json ...] -- AFTER.json [AFTER2.json ...]

Each side's value for a point (shape, local experts, tokens, precision, waves) is the smallest of its runs'
``stage_us``; prints before, after and after / before per point, W=4 / W=1 on each side, and the same run's
DeepGEMM GEMMs alone (``deepgemm_gemms_us``, the smallest of all runs) with after / DeepGEMM.
"""

from __future__ import annotations

import json
import sys


def points(paths: list[str]) -> tuple[dict, dict]:
    stage: dict = {}
    dg: dict = {}
    for p in paths:
        with open(p) as f:
            rows = json.load(f)["rows"]
        for r in rows:
            key = (r["shape"], r["local_experts"], r["tokens_per_rank"], r["precision"], r["num_waves"])
            stage.setdefault(key, []).append(float(r["stage_us"]))
            if r.get("deepgemm_gemms_us"):
                dg.setdefault(key[:3], []).append(float(r["deepgemm_gemms_us"]))
    return {k: min(v) for k, v in stage.items()}, {k: min(v) for k, v in dg.items()}


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print(__doc__)
        return 2
    cut = argv.index("--")
    (before, dg0), (after, dg1) = points(argv[:cut]), points(argv[cut + 1:])
    dg = {k: min(v for v in (dg0.get(k), dg1.get(k)) if v) for k in set(dg0) | set(dg1)}
    head = ["shape", "T", "prec", "W", "before us", "after us", "after / before", "W / W1 before", "W / W1 after",
            "DG alone", "after / DG"]
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for k in sorted(set(before) | set(after), key=lambda k: (k[0], -k[1], k[2], k[3], k[4])):
        b, a = before.get(k), after.get(k)
        b1, a1 = before.get(k[:4] + (1,)), after.get(k[:4] + (1,))
        d = dg.get(k[:3]) if k[3] == "fp8" else None

        def f(x, y, fmt="{:.3f}"):
            return fmt.format(x / y) if x and y else "-"
        print(" | ".join([f"{k[0]}:{k[1]}", str(k[2]), k[3], str(k[4]), f"{b:.1f}" if b else "-",
                          f"{a:.1f}" if a else "-", f(a, b), f(b, b1), f(a, a1), f"{d:.1f}" if d else "-",
                          f(a, d)]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

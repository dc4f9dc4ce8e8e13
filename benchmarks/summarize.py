"""Print a short table of the key rows of a gpu_all.sh run: python benchmarks/summarize.py OUT_DIR."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _fmt(v):
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def table(rows, cols, title):
    if not rows:
        return
    print(f"\n{title}")
    w = [max(len(c), *(len(_fmt(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(c.rjust(n) for c, n in zip(cols, w)))
    for r in rows:
        print("  ".join(_fmt(r.get(c, "")).rjust(n) for c, n in zip(cols, w)))


def moe_table(moe, name: str) -> None:
    if not moe:
        return
    # the partition column names the expert streams too (bench_moe --expert-streams 1,2 puts both in one file)
    rows = [dict(r, partition=f"{r.get('partition', 'experts')}/s{r.get('expert_streams', 1)}",
                 vs_ideal=r["pipelined_us"] / max(r["comm_only_us"], r["compute_only_us"]),
                 speedup=r["serial_us"] / r["pipelined_us"])
            for r in moe["rows"] if r.get("pipelined_us")]
    key = [r for r in rows if r.get("tokens_per_rank") in (2048, 8192)
           and r.get("shared_placement") == "bubbles"]
    best = {}
    for r in key:
        k = (r["shape"], r["tokens_per_rank"], r["partition"])
        if k not in best or r["pipelined_us"] < best[k]["pipelined_us"]:
            best[k] = r
    table(list(best.values()), ["shape", "tokens_per_rank", "partition", "num_waves", "serial_us", "pipelined_us",
                                "comm_only_us", "compute_only_us", "vs_ideal", "speedup"],
          f"{name}: best W per shape/tokens/partition, shared in bubbles")
    table(wave_ratios(rows), ["shape", "tokens_per_rank", "partition", "comm_W4_W1", "compute_W4_W1",
                              "best_W", "best_vs_compute_W1", "serial_W1_vs_best"],
          f"{name}: issue 15's ratios (W=4 against W=1; the best pipelined W against W=1's compute_only and serial)")


def ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}"


def wave_ratios(rows: list) -> list:
    """Per (shape, tokens, partition) with a W=1 row: comm_only and compute_only at W=4 over W=1, the best W's
    pipelined time over W=1's compute_only, and W=1's serial time over the best pipelined time."""
    groups: dict = {}
    for r in rows:
        if r.get("shared_placement", "bubbles") == "bubbles":
            groups.setdefault((r["shape"], r["tokens_per_rank"], r["partition"]), {})[r["num_waves"]] = r
    out = []
    for (shape, T, part), by_w in sorted(groups.items()):
        one = by_w.get(1)
        if one is None:
            continue
        four = by_w.get(4)
        b = min(by_w.values(), key=lambda r: r["pipelined_us"])
        out.append(dict(shape=shape, tokens_per_rank=T, partition=part,
                        comm_W4_W1=ratio(four["comm_only_us"], one["comm_only_us"]) if four else "",
                        compute_W4_W1=ratio(four["compute_only_us"], one["compute_only_us"]) if four else "",
                        best_W=b["num_waves"], best_vs_compute_W1=ratio(b["pipelined_us"], one["compute_only_us"]),
                        serial_W1_vs_best=ratio(one["serial_us"], b["pipelined_us"])))
    return out


def _comm_key_rows(comm) -> list:
    """The V4-Flash rows at 128 and 4096 tokens and the bytes rows at 16 and 64 MB, with their hidden fractions
    (against each row's own GEMM time; paired differences where the run measured them)."""
    rows = []
    for r in comm["rows"]:
        if r["backend"].endswith("-tune") or "alone_us" not in r:
            continue
        if not (r.get("layout") == "v4-flash" and r.get("tokens_per_rank") in (128, 4096)
                or r.get("layout") == "bytes" and r.get("bytes_per_rank") in (16 * 2**20, 64 * 2**20)):
            continue
        r = dict(r, MB=round(r["bytes_per_rank"] / 2**20, 1), graph=bool(r.get("graph")))
        g_us = r.get("gemm_row_us", r.get("gemm_us", 0))
        if "beside_gemm_us" in r:
            r["hidden"] = round(1 - r.get("exposed_us", r["beside_gemm_us"] - g_us) / r["alone_us"], 2)
        if "beside_gemm_transfer_us" in r:     # the exchanges alone, the sum left to the consumer
            exp = r.get("exposed_transfer_us", r["beside_gemm_transfer_us"] - g_us)
            r["hidden_transfer"] = round(1 - exp / r["transfer_us"], 2)
        if "algbw_GBps" in r:
            r["pct_p2p"] = round(100 * r["algbw_GBps"] / r["p2p_limit_GBps"])
        rows.append(r)
    return rows


def comm_tables(comm) -> None:
    if not comm:
        return
    table(_comm_key_rows(comm), ["backend", "graph", "layout", "tokens_per_rank", "MB", "prepare_us", "dispatch_us",
                                 "combine_us", "combine_accumulate_us", "alone_us", "beside_gemm_us", "gemm_row_us",
                                 "hidden", "transfer_us", "hidden_transfer", "pct_p2p"],
          f"comm (key rows; P2P limit {comm['rows'][0].get('p2p_limit_GBps', 0):.0f} GB/s)")
    tune = [dict(r, hidden=round(1 - (r.get("beside_gemm_carveout_us", r.get("beside_gemm_us", 0))
                                      - r.get("gemm_us", 0)) / r["alone_us"], 2) if "gemm_us" in r else "")
            for r in comm["rows"] if r["backend"].endswith("-tune")]
    table(tune, ["backend", "copy_block", "copy_warps", "copy_rows", "copy_grid", "carveout_sms", "dispatch_us",
                 "combine_us", "alone_us", "gemm_carveout_us", "beside_gemm_carveout_us", "hidden",
                 "hidden_vs_best"], "symm tune (V4-Flash 4096, graphs; hidden against the whole GEMM)")
    table([r for r in comm["rows"] if r.get("skipped")], ["backend", "layout", "tokens_per_rank", "skipped"],
          "comm rows skipped")


def main(out: str) -> None:
    out = Path(out)
    for path in sorted(out.glob("moe*.json")):
        moe_table(_load(path), path.name)
    comm_tables(_load(out / "comm.json"))
    attn = _load(out / "attn.json")
    if attn:
        table(attn["rows"][:16], ["shape", "layer_type", "mode", "tokens", "cuda_graph", "serial_us",
                                  "overlapped_us", "critical_path_us"], "attention front-end")
    for p in sorted(out.glob("*.log")):
        txt = p.read_text(errors="replace").strip().splitlines()
        print(f"{p.name}: {txt[-1] if txt else ''}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")

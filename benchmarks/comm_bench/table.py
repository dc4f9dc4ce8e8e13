"""The table bench_comm prints last: one line per row, then notes for the bytes, carve-out, transfer and
skipped rows."""

from __future__ import annotations

from .common import MB

__all__ = ["table"]

HEADER = (f"{'backend':15} {'layout':14} {'T':>5} {'MB/rank':>8} {'disp_us':>8} {'comb_us':>8} {'alone':>8} "
          f"{'beside':>8} {'gemm':>7} {'hidden':>6} {'serial':>8} {'piped':>8}")


def _gemm_us(r: dict) -> float:
    return r.get("gemm_row_us", r.get("gemm_us", 0))     # the GEMM timed in the same row where it was


def _name(r: dict) -> str:
    tag = f"/{r.get('copy_rows', 1)}x{r['copy_grid']}" if r.get("copy_grid") else ""
    return r["backend"] + ("[g]" if r.get("graph") else "") + tag


def _line(r: dict) -> str:
    g_us = _gemm_us(r)
    hid = ""
    if "beside_gemm_us" in r:       # paired differences where measured
        hid = f"{1 - r.get('exposed_us', r['beside_gemm_us'] - g_us) / r['alone_us']:6.2f}"
    f = lambda k: f"{r[k]:8.1f}" if k in r else f"{'':8}"  # noqa: E731
    return (f"{_name(r):15} {r['layout']:14} {r['tokens_per_rank']:5d} {r.get('bytes_per_rank', 0) / MB:8.1f} "
            f"{f('dispatch_us')} {f('combine_us')} {f('alone_us')} {f('beside_gemm_us')} {g_us:7.1f} {hid:>6} "
            f"{f('serial_us')} {f('pipelined_us')}")


def _carveout_note(r: dict) -> str:
    hc = 1 - (r["beside_gemm_carveout_us"] - _gemm_us(r)) / r["alone_us"]
    tag = f"/{r.get('copy_rows', 1)}x{r['copy_grid']}" if r.get("copy_grid") else ""
    vs = f", vs the best alone {r['hidden_vs_best']:.2f}" if "hidden_vs_best" in r else ""
    return (f"{r['backend']}[g]{tag} {r['layout']} T={r['tokens_per_rank']} (alone {r['alone_us']:.0f} us): GEMM "
            f"with {r['carveout_sms']} SMs carved out {r['gemm_carveout_us']:.0f} us (whole {r['gemm_us']:.0f}), "
            f"beside {r['beside_gemm_carveout_us']:.0f} us, hidden {hc:.2f}{vs}")


def _transfer_note(r: dict) -> str:
    exp = r.get("exposed_transfer_us", r["beside_gemm_transfer_us"] - _gemm_us(r))
    return (f"{r['backend']}[g] {r['layout']} T={r['tokens_per_rank']}: exchanges alone (the sum left to the "
            f"consumer) {r['transfer_us']:.0f} us, beside the GEMM {r['beside_gemm_transfer_us']:.0f} us, hidden "
            f"{1 - exp / r['transfer_us']:.2f}; the sum alone {r['sum_us']:.0f} us")


def _notes(r: dict) -> list[str]:
    out = []
    if "algbw_GBps" in r:
        out.append(f"{_name(r)} bytes {r['bytes_per_rank'] / MB:.0f} MB: {r['algbw_GBps']:.0f} GB/s across, "
                   f"{100 * r['algbw_GBps'] / r['p2p_limit_GBps']:.0f}% of P2P")
    if "beside_gemm_carveout_us" in r:
        out.append(_carveout_note(r))
    if "beside_gemm_transfer_us" in r:
        out.append(_transfer_note(r))
    return out


def table(rows: list[dict]) -> str:
    lines, notes = [HEADER], []
    for r in rows:
        if r.get("skipped"):
            notes.append(f"{r['backend']} {r['layout']} T={r['tokens_per_rank']}: skipped: {r['skipped']}")
        elif r.get("diag"):
            notes.append(f"{r['backend']}[g] bytes {r['bytes_per_rank'] / MB:.0f} MB: {r['alone_us']:.1f} us")
        else:
            lines.append(_line(r))
            notes += _notes(r)
    return "\n".join(lines + notes)

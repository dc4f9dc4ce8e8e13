"""The vdev section: torch's own symmetric-memory all-to-all (``torch.ops.symm_mem.all_to_all_vdev_2d``, over
NVSHMEM) on DeepEP's normal-mode test shape, as a baseline row, or a skipped row that says why it does not run
(``benchmarks/probe_vdev.py`` does the work)."""

from __future__ import annotations

from argparse import Namespace

from probe_vdev import probe_or_fewer

__all__ = ["vdev_rows"]


def vdev_rows(run) -> list[dict]:
    T, H = 4096, 7168
    us, line = probe_or_fewer(run.ep, Namespace(tokens=T, hidden=H, topk=8, experts=256, iters=8 if run.s.quick else 20))
    run.log(line)
    row = dict(backend="torch-vdev-2d", layout="deepep-normal", tokens_per_rank=T, note=line)
    if us is None:
        row["skipped"] = line
    else:
        row["dispatch_us"] = us
    return [row]

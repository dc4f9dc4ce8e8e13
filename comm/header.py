"""The call header: what every rank must agree on before a layer's rows move.

Legend: P ranks, H header fields.

A desync (one rank calls ``moe(x, overlap=False)`` while its peer calls ``overlap=True``, one rank caught an error
and called again while its peer is still in the previous call, two ranks call layers of different hidden sizes)
would otherwise send payloads of different sizes into one collective, which gloo ends with a size-mismatch abort
(SIGABRT) and NCCL with a hang or garbage. The header travels folded into the first columns of the count exchange
that precedes every layer's rows (the torch backend's ``prepare``: one small all-to-all with one host sync, so the
header costs no collective and no sync of its own), and every rank checks every rank's header on the host before
any row moves. A mismatch is then the same ``HeaderMismatch`` (a ValueError) on every rank, naming each field that
differs and each rank's value.

Where it is checked: under the ``torch`` backend only. The ``symm`` backend exchanges its counts on the device with
no host sync (CUDA-graph capturable) and ``deepep`` inside DeepEP's dispatch; both accept the header and ignore it,
and keep their own guards (symm: the capacity watchdog; deepep: DeepEP's own checks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CallHeader", "HeaderMismatch", "check_headers", "NUM_FIELDS"]

# The kind column's value for a WaveMoE forward; a row of zeros is a call made without a header (a probe, a
# benchmark calling ``prepare`` directly).
KINDS = {0: "none", 0x4D570001: "WaveMoE.forward"}
_KIND_CODE = {v: k for k, v in KINDS.items()}
_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn)
FIELDS = ("kind", "module", "call", "overlap", "hidden", "dtype")
NUM_FIELDS = len(FIELDS)


@dataclass(frozen=True)
class CallHeader:
    """One call's header.

    Attributes:
        kind: what is called ("WaveMoE.forward").
        module: the module's number in its group (the ranks build modules together, in the same order).
        call: how many times the module was called on this rank, this call included (counted on entry, before
            the input is checked, so a call that raised on one rank only still counts there).
        overlap: the call's wave overlap (the order of the collectives depends on it).
        hidden: the row width D.
        dtype: the rows' dtype.
    """

    kind: str
    module: int
    call: int
    overlap: bool
    hidden: int
    dtype: torch.dtype

    def encode(self) -> list[int]:
        """The H int64 columns sent to every peer."""
        return [_KIND_CODE[self.kind], self.module, self.call, int(self.overlap), self.hidden,
                _DTYPES.index(self.dtype) if self.dtype in _DTYPES else -1]


def _decode(row: list[int]) -> dict:
    kind, module, call, overlap, hidden, dt = row
    dtype = _DTYPES[dt] if 0 <= dt < len(_DTYPES) else f"code {dt}"
    return {"kind": KINDS.get(kind, f"code {kind}"), "module": module, "call": call, "overlap": bool(overlap),
            "hidden": hidden, "dtype": str(dtype).removeprefix("torch.")}


class HeaderMismatch(ValueError):
    """The ranks' headers differ. ``headers`` holds every rank's decoded header (a dict per rank, rank order)."""

    def __init__(self, message: str, headers: list[dict]):
        super().__init__(message)
        self.headers = headers


def check_headers(rows_PH: list[list[int]]) -> None:
    """Raise ``HeaderMismatch`` if the P rows (every rank's header, in rank order, as each rank received them)
    differ. Every rank receives the same rows, so every rank raises the same error."""
    if all(r == rows_PH[0] for r in rows_PH):
        return
    heads = [_decode(r) for r in rows_PH]
    diff = [f for f in FIELDS if any(h[f] != heads[0][f] for h in heads)]
    desc = "; ".join(f"{f}: " + ", ".join(f"rank {r} {h[f]}" for r, h in enumerate(heads)) for f in diff)
    raise HeaderMismatch(f"{heads[0]['kind'] if heads[0]['kind'] != 'none' else 'the call'} out of step between "
                         f"ranks ({desc}): every rank must call the same module, the same number of times, with the "
                         f"same overlap, hidden size and dtype, before any row moves", heads)

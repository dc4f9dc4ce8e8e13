"""The call header: what every rank must agree on before a call's rows move.

Legend: P ranks, H header fields.

A desync (one rank calls ``moe(x, overlap=False)`` while its peer calls ``overlap=True``, one rank caught an error
and called again while its peer is still in the previous call, two ranks call layers of different hidden sizes)
would otherwise send payloads of different sizes into one collective, which gloo ends with a size-mismatch abort
(SIGABRT) and NCCL with a hang or garbage. The header travels folded into the first columns of a count exchange
that precedes the rows anyway, so it costs no collective and no host sync of its own, and every rank checks every
rank's header before any row moves. A mismatch is then the same ``HeaderMismatch`` (a ValueError) on every rank,
naming each field that differs, each rank's value and the rule of the call's kind; calls of different kinds
meeting name each rank's call kind (and call number, where it differs too), with the rule of calls in order
(``ORDER_RULE``): the fields past the call number mean different things per kind.

Where it is checked:

- ``torch`` backend: in ``prepare``'s count exchange, on the host (that exchange's one host sync);
- ``symm`` backend over the emulated transport (CPU ranks on gloo): in ``prepare``'s count exchange, on the host
  (the all-to-all there is host-synchronous anyway): the header and the count row's width travel first, in an
  all-to-all of the same width on every rank, so counts of different widths (another number of experts) are
  a ``HeaderMismatch`` too, not gloo's abort. On peer memory (GPU) the count exchange is a device-side
  write with no host read (CUDA-graph capturable), and the row copies are sized on each rank's host from its own
  arguments before any device word could stop them: the header is not checked there (``symm_transport``);
- ``moe_wave.deepep_compat``'s ``Buffer.dispatch`` and ``low_latency_dispatch`` (kinds below): in their count
  all-gather (normal mode) or the symm backend's count exchange (low-latency mode on the exchange engine); see
  ``moe_wave.deepep_compat.guard`` for the paths with no host read. ``Buffer.combine``, a cached
  ``Buffer.dispatch`` (with a handle), ``low_latency_dispatch`` and ``low_latency_combine`` have no count
  all-gather before their rows: on CPU ranks (gloo, host-driven anyway) each gathers its header first, one small
  all-gather of the shape of a dispatch's count all-gather, so any two of the Buffer's calls meet there (a cached
  dispatch and a fresh one: a mismatch of ``cached``; calls of different kinds: of the call kind); on GPUs the
  caller is trusted, as in DeepEP. One count numbers the Buffer's calls of every kind;
- ``deepep`` backend (``comm.deepep``): not checked; DeepEP's dispatch exchanges its own counts inside its kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CallHeader", "HeaderMismatch", "check_headers", "agreed_call", "describe", "label", "NUM_FIELDS",
           "FIELDS", "KINDS", "ORDER_RULE"]


@dataclass(frozen=True)
class Kind:
    """A kind of call: its name, the rule a mismatch breaks, and the caller's names for generic fields."""

    name: str
    rule: str
    labels: tuple = ()      # (field, the caller's name for it) pairs


_MOE_RULE = ("every rank must call the same module, the same number of times, with the same overlap, hidden size and "
             "dtype, before any row moves")
# The kind column's value; a row of zeros is a call made without a header (a probe, a benchmark calling ``prepare``
# directly).
KINDS = {
    0: Kind("none", _MOE_RULE),
    0x4D570001: Kind("WaveMoE.forward", _MOE_RULE),
    0x4D570002: Kind("deep_ep.Buffer.dispatch",
                     "every rank must call dispatch the same number of times, each with a handle where the others "
                     "pass one (a cached dispatch), with x of the same hidden size, dtype and scale columns, topk_idx "
                     "of the same width, the same number of experts and the same num_worst_tokens, before any row "
                     "moves",
                     (("rows", "num_worst_tokens"), ("experts", "num_experts"), ("cached", "handle given"))),
    0x4D570003: Kind("deep_ep.Buffer.low_latency_dispatch",
                     "every rank must call low_latency_dispatch the same number of times, with x of the same hidden "
                     "size, the same use_fp8, topk_idx of the same width, the same num_experts and the same "
                     "num_max_dispatch_tokens_per_rank, before any row moves",
                     (("rows", "num_max_dispatch_tokens_per_rank"), ("experts", "num_experts"),
                      ("dtype", "dtype (use_fp8)"))),
    0x4D570004: Kind("deep_ep.Buffer.combine",
                     "every rank must call combine the same number of times, with x of the same hidden size and "
                     "dtype and topk_weights of the same width (or none), before any row moves",
                     (("top_k", "topk_weights columns"),)),
    0x4D570005: Kind("deep_ep.Buffer.low_latency_combine",
                     "every rank must call low_latency_combine the same number of times, each with the handle of "
                     "the same low_latency_dispatch, before any row moves",
                     (("rows", "num_max_dispatch_tokens_per_rank"), ("experts", "num_experts"))),
    0x4D570006: Kind("deep_ep.Buffer.destroy",
                     "every rank must call destroy after the same calls, the buffer's last collective"),
}
# The rule of calls of different kinds meeting (the fields past ``call`` mean different things per kind).
ORDER_RULE = ("every rank must make the same calls in the same order (each call meets a call of the same kind on "
              "every rank) before any row moves")
_LABELS = {"kind": "call kind"}             # the names every kind gives these fields
_KIND_CODE = {k.name: c for c, k in KINDS.items()}
_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn,
           getattr(torch, "float8_e5m2", None))
FIELDS = ("kind", "module", "call", "overlap", "hidden", "dtype", "top_k", "experts", "rows", "scales", "cached")
NUM_FIELDS = len(FIELDS)


@dataclass(frozen=True)
class CallHeader:
    """One call's header.

    Attributes:
        kind: what is called (a name in ``KINDS``: "WaveMoE.forward", "deep_ep.Buffer.dispatch", ...).
        module: the module's number in its group (the ranks build modules together, in the same order).
        call: how many times the module was called on this rank, this call included (counted on entry, before
            the input is checked, so a call that raised on one rank only still counts there).
        overlap: the call's wave overlap (the order of the collectives depends on it).
        hidden: the row width H (elements).
        dtype: the rows' dtype.
        top_k, experts, rows, scales: the width of the top-k, the number of experts, a per-call receive bound
            (DeepEP's ``num_worst_tokens`` / ``num_max_dispatch_tokens_per_rank``), the FP8 scale columns; 0
            where the kind has no such argument (WaveMoE's are fixed by its config, checked when it is built).
        cached: the call reuses an earlier call's routing (DeepEP's dispatch with a handle).
    """

    kind: str
    module: int
    call: int
    overlap: bool
    hidden: int
    dtype: torch.dtype
    top_k: int = 0
    experts: int = 0
    rows: int = 0
    scales: int = 0
    cached: bool = False

    def encode(self) -> list[int]:
        """The H int64 columns sent to every peer."""
        return [_KIND_CODE[self.kind], self.module, self.call, int(self.overlap), self.hidden,
                _DTYPES.index(self.dtype) if self.dtype in _DTYPES else -1, self.top_k, self.experts, self.rows,
                self.scales, int(self.cached)]


def encode(header: CallHeader | None) -> list[int]:
    """``header.encode()``, or H zeros for a call made without one."""
    return header.encode() if header is not None else [0] * NUM_FIELDS


def _kind(code: int) -> Kind:
    return KINDS.get(code, Kind(f"code {code}", _MOE_RULE))


def _value(field: str, v: int):
    if field == "kind":
        return _kind(v).name
    if field in ("overlap", "cached"):
        return bool(v)
    if field == "dtype":
        dtype = _DTYPES[v] if 0 <= v < len(_DTYPES) and _DTYPES[v] is not None else f"code {v}"
        return "none" if v == 0 else str(dtype).removeprefix("torch.")
    return v


def _decode(row: list[int]) -> dict:
    return {f: _value(f, v) for f, v in zip(FIELDS, row)}


def label(kind_code: int, field: str) -> str:
    """The caller's name of ``field`` in a call of kind ``kind_code``."""
    return dict(_kind(kind_code).labels).get(field, _LABELS.get(field, field))


def describe(kind_code: int, field: str, values: list[int], ranks: list[int] | None = None) -> str:
    """``"{field}: rank 0 {value}, rank 1 {value}, ..."`` for one field, values decoded (``ranks``: whose values
    they are; default 0, 1, ...)."""
    ranks = range(len(values)) if ranks is None else ranks
    return f"{label(kind_code, field)}: " + ", ".join(f"rank {r} {_value(field, v)}" for r, v in zip(ranks, values))


def rule(kind_code: int) -> str:
    return _kind(kind_code).rule


class HeaderMismatch(ValueError):
    """The ranks' headers differ. ``headers`` holds every rank's decoded header (a dict per rank, rank order)."""

    def __init__(self, message: str, headers: list[dict]):
        super().__init__(message)
        self.headers = headers


def check_headers(rows_PH: list[list[int]], widths: list[int] | None = None) -> None:
    """Raise ``HeaderMismatch`` if the P rows (every rank's header, in rank order, as each rank received them)
    differ, or, where they agree, if ``widths`` (each rank's width of the exchange the header precedes) differ.
    Every rank receives the same rows, so every rank raises the same error."""
    if all(r == rows_PH[0] for r in rows_PH):
        if widths is None or all(w == widths[0] for w in widths):
            return
        what = KINDS[rows_PH[0][0]].name if rows_PH[0][0] in KINDS and rows_PH[0][0] else "the call"
        raise HeaderMismatch(f"{what} out of step between ranks (count row width: "
                             + ", ".join(f"rank {r} {w}" for r, w in enumerate(widths))
                             + "): every rank must exchange counts of the same layout (ranks, waves, local "
                               "experts) before any row moves", [_decode(r) for r in rows_PH])
    heads = [_decode(r) for r in rows_PH]
    code = next((r[0] for r in rows_PH if r[0]), 0)          # the first rank's kind that is not "none"
    diff = [i for i, f in enumerate(FIELDS) if any(r[i] != rows_PH[0][i] for r in rows_PH)]
    what, why = (KINDS[rows_PH[0][0]].name if rows_PH[0][0] in KINDS and rows_PH[0][0] else "the call"), rule(code)
    if diff[0] == 0:        # calls of different kinds: their other fields are not comparable past the call number
        diff, what, why = [i for i in diff if FIELDS[i] in ("kind", "module", "call")], "calls", ORDER_RULE
    desc = "; ".join(describe(code, FIELDS[i], [r[i] for r in rows_PH]) for i in diff)
    raise HeaderMismatch(f"{what} out of step between ranks ({desc}): {why}", heads)


def agreed_call(e: HeaderMismatch, kind, module: int, calls: int) -> int:
    """The call count a caller takes after ``e`` so that its next call is in step again: the largest of the ranks'
    where every rank called one of ``kind`` (a name, or a collection of the names that share the caller's count)
    on this module (each rank computes the same), else ``calls`` unchanged."""
    kinds = {kind} if isinstance(kind, str) else set(kind)
    if all(h["kind"] in kinds and h["module"] == module for h in e.headers):
        return max(h["call"] for h in e.headers)
    return calls

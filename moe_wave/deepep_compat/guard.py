"""What DeepEP leaves unchecked, checked on the device with no host sync: expert ids out of range, an
``is_token_in_rank`` that contradicts ``topk_idx``, rows due beyond ``num_worst_tokens``, and ranks whose
calls are out of step (the call header, below). One ``Guard`` per Buffer serves both modes: low-latency
dispatches check their expert ids here too (``low_latency``), their fault words riding the count exchange of the
exchange engine, or, in the direct kernels, the dispatch launch itself, which also folds them and writes ``status``
and its host copy (``ll_direct``).

Legend: T local tokens, K top-k, P ranks, E experts.

A check is a few tensor ops on the device. What one rank finds alone (its ids, its ``is_token_in_rank``) waits in
``pending`` (``WORDS``: kind, count, limit, value) and travels with the dispatch's count all-gather, so every rank
learns every rank's fault in the same call; what the gathered counts show (a rank receiving more rows than
``num_worst_tokens``) every rank computes itself. The first fault sticks in ``status`` (kind, rank, count, limit,
and two words more: the first bad id, or a header mismatch's kind and field); from then on the outputs of every call
(received rows, combined sums, weights) are NaN, so no plausible wrong result leaves the buffer. ``status`` is
copied to pinned host memory at the end of each dispatch (non-blocking, on the stream that wrote it) and raised at
the start of a later call on every rank (on a GPU one or two calls later), or at once by ``check()`` (a host
sync). Raising clears it. A fault found by ``get_dispatch_layout`` alone waits in ``pending`` for the next
dispatch: raising it on one rank before a collective would leave the others waiting.

The call header. Every dispatch (without a handle) adds its header (``moe_wave.comm.header``, kind
"deep_ep.Buffer.dispatch": the Buffer's call number, x's hidden size, dtype and scale columns, the top-k width,
the number of experts, ``num_worst_tokens``) to the same count all-gather, so every rank holds every rank's header
before any row moves. Where the dispatch reads the gathered counts on the host anyway (without
``num_worst_tokens``, as DeepEP's CPU wait; and always on CPU ranks, where the gather is host memory) a mismatch is
a ``HeaderMismatch`` (a ValueError) raised there on every rank, naming each field that differs, each rank's value
and the rule (without it: gloo's size-mismatch abort, SIGABRT, on CPU ranks; rows of mismatched sizes on GPUs).
With ``num_worst_tokens`` on a GPU nothing is read on the host (the call can be captured in a CUDA graph): the
mismatch is then a fault here like the others (the outputs NaN, a later call raises naming the field, the first
rank that differs from rank 0 and both values), which cannot stop that call's rows, whose sizes each rank took from
its own arguments. The gathered row's width must not depend on anything the header checks: the direct kernels'
per-expert counts travel in a tail of the width every rank agreed on before (``normal_direct.CountGather``), so
ranks passing different numbers of experts are a header mismatch like the others; and the direct path gathers its
counts before it takes the direct kernels or, for rows that are not whole 4-byte words, the engine (which reads
its counts from that gather), so a rank whose rows take the other path (another hidden size or dtype) is a
mismatch too, not gathers of two widths (gloo's SIGABRT; NCCL a hang or a read past a buffer). With
``num_worst_tokens`` on a GPU that mismatch is the device-side fault above, and the two ranks' exchanges then do not
meet: each waits for its peer until ``SymmOptions.timeout_ms`` (the direct kernels record a fault naming the peer).

The call number. One count per Buffer numbers every call that carries a header (``dispatch``, cached too,
``combine``, ``low_latency_dispatch``, ``low_latency_combine``; ``Buffer._count``), taken on entry before any
check, on GPUs too (it costs nothing there), so a call one rank skipped or made of another kind shows as a
mismatch of ``call`` in the next header the ranks exchange, and calls of different kinds meeting leave the counts
in step. After a ``HeaderMismatch`` every rank takes the largest of the ranks' numbers, so the next call runs.
On the GPU path with no host read (``num_worst_tokens``) the header's call number is 0: a CUDA-graph replay could
not update a host value, and a device count bumped by calls that run on different streams would race. There a
dispatch one rank skipped pairs with its peer's next one unnoticed where every other field agrees; the next
dispatch that reads its counts on the host names ``call``.

Calls without a count exchange before their rows: a cached dispatch (with a handle), a combine, a low-latency
dispatch and a low-latency combine. On CPU ranks (gloo, host-driven anyway) each gathers its header first, in an
all-gather of the shape of the engine's count all-gather (a cached dispatch's row holds its token count and guard
words, its header marked ``cached``; the others' is ``normal_engine.gate``), so every call there starts with an
all-gather of one shape, and any two calls meet: a cached dispatch meeting a fresh one is a ``HeaderMismatch``
naming ``cached``, calls of different kinds (a dispatch and a combine, a normal dispatch and a low-latency one, a
low-latency dispatch and a low-latency combine, ...) one naming each rank's call kind, never gloo's size-mismatch
abort or a collective of another type waiting until gloo's timeout. On GPUs nothing is gathered for these calls
(it would cost a collective the call does not make; DeepEP trusts the caller), so the ranks do not meet at a header:

- a cached dispatch or a combine meeting another call: the rank in the direct kernels waits for rows its peer does
  not send until ``SymmOptions.timeout_ms``, records a fault naming the peer (a combine's sums waiting for it are
  NaN) and returns; that rank's next dispatch that reads its counts on the host (without ``num_worst_tokens``)
  raises it;
- a low-latency dispatch or combine meeting another call: its kernel gives up on the peer after
  ``SymmOptions.timeout_ms``, masks it, and the rank's next low-latency call raises naming it (with
  ``enable_shrink`` the peer stays masked, DeepEP's shrink mode; ``ll_direct``);
- a fresh dispatch meeting one of these: it waits in its count all-gather (NCCL) until the other rank's next fresh
  dispatch joins it; that dispatch's header carries a later call number (one count), so the pair is a
  ``HeaderMismatch`` of ``call`` on both ranks (where read on the host; with ``num_worst_tokens`` the device-side
  fault), not two dispatches paired out of step;
- on the exchange engine (``normal="engine"``, ``ll="engine"`` on a GPU) the waits are its exchange's, each bounded
  by ``SymmOptions.timeout_ms`` the same way.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from moe_wave.comm.header import FIELDS, NUM_FIELDS, CallHeader, check_headers, describe, rule

__all__ = ["Guard", "WORDS", "NONE", "WORST", "IDS", "IN_RANK", "HEADER", "head_at", "tail_at"]

NONE, WORST, IDS, IN_RANK, HEADER = 0, 1, 2, 3, 4
WORDS = 4                   # what a rank adds to the gathered counts: kind, count, limit, value (IDS: the first bad id)


def head_at(F: int) -> int:
    """The column where the call header starts in a count all-gather's row (``Guard.count_row``) with F count
    columns: [counts [F] | tokens | guard words [WORDS] | call header [NUM_FIELDS] | tail]."""
    return F + 1 + WORDS


def tail_at(F: int) -> int:
    """The column where the tail starts in such a row (after the call header)."""
    return head_at(F) + NUM_FIELDS


class Guard:
    """The device-side fault status of one Buffer (see the module docstring)."""

    def __init__(self, rank: int, device: torch.device):
        self.rank, self.device = rank, device
        # kind, rank, count, limit, then for IDS the first bad id, for HEADER the header kind and field (count: that
        # rank's value, limit: rank 0's)
        self.status = torch.zeros(6, dtype=torch.int64, device=device)
        self.pending = torch.zeros(WORDS, dtype=torch.int64, device=device)
        self._host = torch.zeros(6, dtype=torch.int64, device="cpu", pin_memory=device.type == "cuda")
        self._headers: dict = {}        # header words on the device, per header (``header_words``)

    @property
    def addresses(self) -> tuple[int, int]:
        """(``status``'s address, the pinned host words' address): the low-latency direct kernels record a fault
        in both (``ll_direct``)."""
        return self.status.data_ptr(), self._host.data_ptr()

    # ------------------------------------------------------------------ local checks
    def check_ids(self, topk_idx_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
        """``topk_idx`` with every id outside [-1, E) replaced by -1 (so no kernel indexes with it); the count of
        such ids and the first of them (row-major) are recorded in ``pending`` (limit E)."""
        bad = (topk_idx_TK >= num_experts) | (topk_idx_TK < -1)
        value = None
        if bad.numel():     # the first bad id (index_select: indexing with a 0-dim tensor would read it on the host)
            first = torch.argmax(bad.reshape(-1).to(torch.int8)).view(1)
            value = topk_idx_TK.reshape(-1).index_select(0, first)[0]
        self._note(IDS, bad.sum(), num_experts, value)
        return topk_idx_TK.masked_fill(bad, -1)

    def check_in_rank(self, in_rank_TP: torch.Tensor, topk_idx_TK: torch.Tensor, num_experts: int) -> None:
        """Record the tokens whose ``is_token_in_rank`` row is not the ranks of their valid top-k experts (limit:
        T, the tokens)."""
        T, P = in_rank_TP.shape
        ids = topk_idx_TK.long()
        valid = (ids >= 0) & (ids < num_experts)
        want = torch.zeros(T, P + 1, dtype=torch.bool, device=ids.device)
        want.scatter_(1, torch.where(valid, ids // max(num_experts // P, 1), P), True)
        wrong = (want[:, :P] != in_rank_TP).any(1).sum()
        self._note(IN_RANK, wrong, T)

    def _note(self, kind: int, count: torch.Tensor, limit: int, value: torch.Tensor | None = None) -> None:
        count = count.to(torch.int64)
        new = torch.stack([torch.full_like(count, kind), count, torch.full_like(count, limit),
                           torch.zeros_like(count) if value is None else value.to(torch.int64)])
        take = (self.pending[0] == 0) & (count > 0)
        self.pending.copy_(torch.where(take, new, self.pending))

    # ------------------------------------------------------------------ after the gather
    def words(self) -> torch.Tensor:
        """[WORDS] int64: what this rank adds to the gathered counts (its pending fault; then cleared)."""
        w = self.pending.clone()
        self.pending.zero_()
        return w

    def count_row(self, counts: torch.Tensor, T: int, header: CallHeader, on_host: bool,
                  tail: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's row of a count all-gather: [its counts (flattened, int64) | its tokens T | its guard words
        [WORDS] | its call header [NUM_FIELDS] (| ``tail``)]; ``read_counts`` reads the gather."""
        c = counts.reshape(-1).long()
        parts = [c, c.new_full((1,), T), self.words(), self.header_words(header, on_host)]
        return torch.cat(parts if tail is None else parts + [tail])

    def read_counts(self, G: torch.Tensor, F: int, recv_P: torch.Tensor, worst: int, host=None) -> None:
        """A gather of ``count_row`` rows with F count columns: every rank's guard words folded (``fold``; the
        headers on the device where ``host`` is None). ``host``: the gather read on the host (a tensor, or its
        rows as lists), where the headers are checked (``agree``: the same error on every rank before any row
        moves)."""
        H0, H1 = head_at(F), tail_at(F)
        self.fold(G[:, F + 1:H0], recv_P, worst, None if host is not None else G[:, H0:H1])
        if host is not None:
            self.agree(host[:, H0:H1].tolist() if torch.is_tensor(host) else [row[H0:H1] for row in host])

    def fold(self, words_PW: torch.Tensor, recv_P: torch.Tensor | None, worst: int,
             head_PH: torch.Tensor | None = None) -> None:
        """Every rank's gathered words [P, WORDS], (``worst`` > 0) the rows each rank receives [P] and (where the
        caller does not check them on the host, ``agree``) every rank's call header [P, H]: the first fault (a
        header mismatch, then the lowest rank; a worst-case overflow before the others) sticks in ``status``."""
        P = words_PW.shape[0]
        ranks = torch.arange(P, device=words_PW.device)
        cand = torch.cat([ranks[:, None], words_PW[:, 1:], torch.zeros(P, 1, dtype=torch.int64,
                                                                        device=words_PW.device)], 1)
        kind = words_PW[:, 0]
        if worst and recv_P is not None:
            over = recv_P.to(torch.int64) > worst
            cand = torch.where(over[:, None], torch.stack([ranks, recv_P.to(torch.int64),
                                                           torch.full_like(ranks, worst)] + [ranks * 0] * 2, 1), cand)
            kind = torch.where(over, WORST, kind)
        if head_PH is not None:
            # the first rank whose header differs from rank 0's, its first differing field (index_select: indexing
            # with a 0-dim tensor would read it on the host)
            diff_PH = head_PH != head_PH[:1]
            bad_P = diff_PH.any(1)
            r = torch.argmax(bad_P.to(torch.int8)).view(1)
            f = torch.argmax(diff_PH.index_select(0, r)[0].to(torch.int8)).view(1)
            mine, first_row = head_PH.index_select(0, r)[0], head_PH[0]
            row = torch.cat([r, mine.index_select(0, f), first_row.index_select(0, f), first_row[:1], f])
            cand = torch.where(bad_P.any(), row.expand(P, -1), cand)
            kind = torch.where(bad_P.any(), torch.full_like(kind, HEADER), kind)
        hit = kind != 0
        first = torch.argmax(hit.to(torch.int8)).view(1)        # index_select: no host read of the index
        new = torch.cat([kind.index_select(0, first), cand.index_select(0, first)[0]])
        take = (self.status[0] == 0) & hit.any()
        self.status.copy_(torch.where(take, new, self.status))

    def header_words(self, header: CallHeader, on_host: bool) -> torch.Tensor:
        """[H] int64 on the device: ``header`` encoded, for the count all-gather. ``on_host``: the dispatch reads
        the gather on the host (CPU ranks; a GPU dispatch without ``num_worst_tokens``): made from this call's values
        (a GPU copy from pinned memory, behind which that read waits anyway). Else (a GPU path with no host read,
        which a CUDA graph may capture and replay): ``device_header``."""
        if self.device.type == "cpu":
            return torch.tensor(header.encode(), dtype=torch.int64)
        if on_host:
            return torch.tensor(header.encode(), dtype=torch.int64).pin_memory().to(self.device, non_blocking=True)
        return self.device_header(header)

    def device_header(self, header: CallHeader) -> torch.Tensor:
        """``header`` encoded on the device, made once per header with the call number 0 (a replay could not
        update it; see the module docstring)."""
        key = tuple(replace(header, call=0).encode())
        if key not in self._headers:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("deep_ep.Buffer.dispatch: run one dispatch of this shape eagerly before capturing "
                                   "a CUDA graph (its call header is set up on first use)")
            self._headers[key] = torch.tensor(key, dtype=torch.int64, device=self.device)
        return self._headers[key]

    @staticmethod
    def agree(head_rows: list[list[int]]) -> None:
        """Every rank's call header as read on the host (rank order): ``HeaderMismatch`` on every rank if they
        differ (see the module docstring)."""
        check_headers(head_rows)

    # ------------------------------------------------------------------ poison and raise
    def poison(self, *tensors) -> None:
        """NaN into the floating-point tensors while a fault is recorded (device ops, no sync); FP8 ones get the
        byte 0x7F (NaN in e4m3fn and e5m2)."""
        flagged = self.status[0] != 0
        for t in tensors:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or not t.numel():
                continue
            if t.element_size() > 1:
                t.masked_fill_(flagged, float("nan"))
            else:
                t.view(torch.uint8).masked_fill_(flagged, 0x7F)

    def poison_words(self, t: torch.Tensor, value: int) -> None:
        """``value`` into the integer tensor ``t`` while a fault is recorded (UE8M0 scales: -1, four NaN bytes)."""
        t.masked_fill_(self.status[0] != 0, value)

    def snapshot(self) -> None:
        """Copy the status to pinned host memory (non-blocking on a GPU): the next call reads it without a sync."""
        self._host.copy_(self.status, non_blocking=self.device.type == "cuda")

    def raise_if_flagged(self, what: str) -> None:
        """Raise the fault the last snapshot holds (no sync), then clear it."""
        kind, rank, count, limit, a, b = self._host.tolist()
        if kind:
            self._host.zero_()
            self.status.zero_()
            raise fault_error(what, kind, rank, count, limit, a, b)

    def check(self, what: str = "Buffer.check") -> None:
        """Raise a recorded fault now. HOST SYNC: reads the device status."""
        self._host.copy_(self.status)
        self.raise_if_flagged(what)


def fault_error(what: str, kind: int, rank: int, count: int, limit: int, a: int = 0, b: int = 0) -> Exception:
    """The error of a recorded fault (``Guard.status``'s words; ``a``, ``b``: IDS the first bad id, HEADER the
    header kind and field)."""
    if kind == HEADER:
        values = describe(a, FIELDS[b], [limit, count], [0, rank])
        return ValueError(f"deep_ep.Buffer.{what}: the ranks' dispatches were out of step ({values}): "
                          f"{rule(a)}; with num_worst_tokens on a GPU nothing is read on the host, so that "
                          f"dispatch's rows moved unchecked and the outputs since were poisoned with NaN")
    if kind == WORST:
        return RuntimeError(f"deep_ep.Buffer.{what}: rank {rank} was due {count} received rows, more than "
                            f"num_worst_tokens={limit}: the rows past it were dropped and the outputs since were "
                            f"poisoned with NaN; pass num_worst_tokens >= the most rows a rank receives (<= the "
                            f"tokens of every rank together)")
    if kind == IDS:
        return ValueError(f"deep_ep.Buffer.{what}: rank {rank} passed {count} topk_idx entries outside [-1, "
                          f"{limit}) (the first: {a}; num_experts={limit}; an expert id must be -1 or in [0, "
                          f"num_experts)): they were treated as -1 and the outputs since were poisoned with NaN")
    return ValueError(f"deep_ep.Buffer.{what}: rank {rank} passed an is_token_in_rank that contradicts topk_idx in "
                      f"{count} of its {limit} tokens (a token goes exactly to the ranks of its experts; "
                      f"get_dispatch_layout computes it): the outputs since were poisoned with NaN")

"""DeepEP's low-latency mode with no NVSHMEM: the interface (``LowLatencyMode``: argument checks, handles, the
zero-copy buffers, rank masks) of its two implementations, chosen once when the Buffer is made: ``ll_direct``
(two Triton kernels straight through peer memory: CUDA ranks of an NCCL group) and ``ll_engine`` (the exchange
engine: gloo ranks on CPU, the tests, and comparisons). Both receive expert-major, with no host sync.

Legend: N local tokens (<= T, the most any rank dispatches), H hidden, S = H / 128, K top-k, P ranks, E experts,
e = E / P local experts, PT = P * T receive slots per local expert.

Two buffer sets, used in turn by successive dispatches (a combine uses its dispatch's set), so two low-latency
operations can be in flight, as in DeepEP. The returned tensors are fresh (they stay valid), except the zero-copy
combine buffer (``next_combine_buffer``), one per set.

Expert ids outside [-1, E) (DeepEP's kernels index with them unchecked) are sent nowhere, as -1, and are a fault of
the Buffer's guard (``guard``), as in normal mode: that dispatch's received rows and scales (on every rank) and the
outputs of every call since are NaN, and a later call on every rank, or ``Buffer.check()``, raises naming the rank,
the count, the first bad id and the rule (on CPU ranks the next call; on a GPU each rank reads its own copy of the
fault words with no sync, so one or two calls later, not necessarily the same call on every rank). Every rank learns
of it in the same call, with no host sync: on the exchange engine the rank's fault words ride the count exchange the
dispatch makes anyway (``CompactExchange.prepare``'s ``extra``) and every rank folds every rank's words there; in the
direct kernels they travel in the dispatch's own launch, next to the per-expert counts, and the receiving side folds
them, stores the rows as NaN and records the fault in the guard's words (``ll_direct``): no launch of its own.

Ranks out of step (different hidden sizes, ``use_fp8``, top-k widths, ``num_experts`` or
``num_max_dispatch_tokens_per_rank``, a call one rank skipped or repeated, or calls of different kinds: a
dispatch meeting a combine, a normal-mode call meeting a low-latency one): on the exchange engine over gloo (CPU
ranks) each dispatch and combine gathers its call header first (``moe_wave.comm.header``, kinds
"deep_ep.Buffer.low_latency_dispatch" and "deep_ep.Buffer.low_latency_combine"; the call number is the Buffer's
one count), in an all-gather of the shape every call of the Buffer starts with there (``normal_engine.gate``), so
a mismatch, of any field or of the call kind, is the same ValueError on every rank, naming each field and each
rank's value, before any row moves and before the buffer set is taken; the dispatch's header also travels with
the symm backend's count exchange, first and in an all-to-all of the same width on every rank (the count row's
width follows ``num_experts``). On GPUs neither implementation checks (the caller is trusted, as in DeepEP): the
engine's count exchange on peer memory reads nothing on the host (``comm.symm_transport``), and the direct kernels
have no exchange before the rows (each token's row, its ids and the counts travel in one launch and the receivers
wait only on call-number flags), so there is nothing a header could ride that would stop the rows. There a rank
with another ``num_experts`` (or hidden size, top-k width, ``num_max_dispatch_tokens_per_rank``: the direct
kernels' region is chosen by all four) writes into and waits on another region than its peers, and a rank in a
dispatch while its peer is in a combine (or in a normal-mode call) waits on flags the peer does not set: each
rank's wait for the others gives up after ``SymmOptions.timeout_ms``, masks them and the rank's next low-latency
call raises naming them; a region that one rank allocates alone (its first call of a configuration) waits in the
symmetric-memory rendezvous until the others allocate one (``guard`` for a normal-mode rank's side).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .guard import Guard

__all__ = ["LowLatencyMode", "LowLatencyHandle", "rdma_size_hint", "check_overlap_kwargs", "outputs", "check_shape",
           "OVERLAP_KWARGS"]

# SGLang's single-batch-overlap keywords (DeepEP forks): accepted while their feature is off
OVERLAP_KWARGS = frozenset({"overlap", "packed_recv_count", "comp_signal", "block_m", "threshold", "num_sms",
                            "src_signals", "src_signal_expect_value"})


def rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """DeepEP 567632d ``get_low_latency_rdma_size_hint`` (``csrc/config.hpp`` ``LowLatencyLayout``), bytes."""
    T, E, S = num_max_dispatch_tokens_per_rank, num_experts, hidden // 128
    dispatch_msg = 16 + max(hidden * 2, hidden + S * 4)
    combine_msg = S * 4 + hidden * 2
    send = max(T * dispatch_msg, E * T * combine_msg)
    recv = max(E * T * dispatch_msg, E * T * combine_msg)
    signal = -(-(E * 4) // 128) * 128
    total = 2 * (send + recv + signal)
    return (total + 128) // 128 * 128


def check_overlap_kwargs(kwargs: dict) -> None:
    """SGLang passes its single-batch-overlap keywords whenever that feature is configured; with ``overlap`` false
    they change nothing. ``overlap=True`` needs a DeepEP fork's signalling kernels."""
    unknown = sorted(set(kwargs) - OVERLAP_KWARGS)
    if unknown:
        raise TypeError(f"low_latency_combine() got unexpected keyword arguments {unknown}")
    if kwargs.get("overlap"):
        raise NotImplementedError("deep_ep.Buffer.low_latency_combine(overlap=True): SGLang's single-batch overlap "
                                  "needs a DeepEP fork's signalling kernels; run with that feature off")


class LowLatencyHandle(tuple):
    """DeepEP's low-latency handle ``(src_info int32 [e, PT], layout_range int64 [e, P], T, H, E)``, plus ``state``.

    ``src_info[i][j]`` is the source token index of expert i's slot j; ``layout_range[i][p]`` is ``begin << 32 |
    count`` of the slots holding rank p's tokens."""

    def __new__(cls, items, state):
        h = super().__new__(cls, items)
        h.state = state
        return h


def outputs(e: int, P: int, T: int, H: int, fp8: bool, ue8m0: bool, dev):
    """A dispatch's fresh outputs: (recv [e, PT, H] fp8 or bf16, the scales' physical tensor or None, the scales
    (column-major in the last two dimensions) or None, count int32 [e], src_info int32 [e, PT], layout_range int64
    [e, P])."""
    PT = P * T
    recv = torch.empty(e, PT, H, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=dev)
    phys = scales = None
    if fp8:
        phys = torch.empty(e, H // 512, PT, dtype=torch.int32, device=dev) if ue8m0 else \
            torch.empty(e, H // 128, PT, dtype=torch.float32, device=dev)
        scales = phys.transpose(1, 2)
    return (recv, phys, scales, torch.empty(e, dtype=torch.int32, device=dev),
            torch.empty(e, PT, dtype=torch.int32, device=dev), torch.empty(e, P, dtype=torch.int64, device=dev))


def check_shape(what: str, name: str, t, shape, dtypes) -> None:
    ok = isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(shape) and t.dtype in dtypes
    if not ok:
        got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{what}: {name} is {got}: must be {list(shape)} of {', '.join(map(str, dtypes))}")


def _pos_int(what: str, name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{what}: {name}={v!r} must be an int > 0")
    return v


class LowLatencyMode(ABC):
    """One implementation of the low-latency half of ``deep_ep.Buffer`` (see the module docstring).

    Args:
        ep: the group; comm_stream: the buffer's communication stream (None on CPU); guard: the Buffer's fault
        status (``guard.Guard``), which the dispatch's expert-id check writes.
    """

    def __init__(self, ep, comm_stream, guard: Guard):
        self.ep, self.comm_stream, self.guard = ep, comm_stream, guard
        self._next = 0
        self._combine_bufs: dict = {}

    def close(self) -> None:
        self._combine_bufs.clear()

    def clean(self, T: int, H: int, E: int) -> None:
        """Back to the first buffer set (every rank calls it, as in DeepEP). Nothing else is left dirty: slot
        counts are recomputed by every dispatch."""
        for name, v in (("num_max_dispatch_tokens_per_rank", T), ("hidden", H), ("num_experts", E)):
            _pos_int("clean_low_latency_buffer", name, v)
        self._next = 0

    def _take_set(self) -> int:
        """The buffer set of the next dispatch (sets alternate)."""
        set_index, self._next = self._next, self._next ^ 1
        return set_index

    def dispatch(self, x, topk_idx, T, E, stats, wait_stats, use_fp8, round_scale, use_ue8m0, async_finish, hook,
                 call: int = 0):
        """DeepEP's ``low_latency_dispatch``.

        Args:
            x: bf16 [N, H], N <= T, H a multiple of 128 (of 512 with ``use_ue8m0``).
            topk_idx: [N, K] int64 (or int32) global experts, -1: none.
            T: the most tokens any rank dispatches (the same on every rank); E: experts, a multiple of P.
            stats: None or int32 [e], += each local expert's received count. wait_stats: None or int64 [P, ...]:
                accepted, not measured (it stays as it is).
            use_fp8, round_scale, use_ue8m0: FP8 rows with one scale per 128 channels, scales rounded to powers of
                two, and those packed as UE8M0 bytes (needs round_scale).
            async_finish / hook: see the module docstring (not both).
            call: the Buffer's call number (``Buffer._count``), for the call header where one is checked.

        Returns:
            recv_x: bf16 [e, PT, H], or (fp8 [e, PT, H], scales float32 [e, PT, S] or int32 [e, PT, S / 4], both
            column-major in the last two dimensions); recv_count int32 [e]; the handle; the event; the hook or None.
        """
        what = "low_latency_dispatch"
        P = self.ep.size
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16:
            raise ValueError(f"{what}: x must be a bf16 [N, H] tensor, got "
                             f"{tuple(getattr(x, 'shape', ()))} {getattr(x, 'dtype', type(x).__name__)}")
        N, H = x.shape
        _pos_int(what, "num_max_dispatch_tokens_per_rank", T)
        _pos_int(what, "num_experts", E)
        if N > T:
            raise ValueError(f"{what}: x has {N} tokens, more than num_max_dispatch_tokens_per_rank={T}")
        if E % P:
            raise ValueError(f"{what}: num_experts={E} must be a multiple of the {P} ranks")
        if H % 128 or (use_fp8 and use_ue8m0 and H % 512):
            raise ValueError(f"{what}: hidden={H} must be a multiple of 128 (of 512 with use_ue8m0)")
        if use_ue8m0 and not round_scale:
            raise ValueError(f"{what}: use_ue8m0=True needs round_scale=True (DeepEP's rule)")
        if async_finish and hook:
            raise ValueError(f"{what}: async_finish and return_recv_hook cannot both be set")
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or topk_idx.shape[0] != N \
                or topk_idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{what}: topk_idx must be int64 [{N}, K], got "
                             f"{tuple(getattr(topk_idx, 'shape', ()))} {getattr(topk_idx, 'dtype', '')}")
        e, K = E // P, topk_idx.shape[1]
        if stats is not None:
            check_shape(what, "cumulative_local_expert_recv_stats", stats, (e,), (torch.int32, torch.int64))
        if wait_stats is not None and (not isinstance(wait_stats, torch.Tensor) or wait_stats.dtype != torch.int64
                                       or wait_stats.shape[0] != P):
            raise ValueError(f"{what}: dispatch_wait_recv_cost_stats must be int64 with {P} rows")
        return self._dispatch(x, topk_idx, T, E, K, stats, bool(use_fp8), bool(round_scale), bool(use_ue8m0),
                              async_finish, hook, call)

    def next_combine_buffer(self, handle) -> torch.Tensor:
        """The zero-copy combine buffer of the handle's buffer set: bf16 [e, PT, H], to be filled by the caller."""
        st = self._state("get_next_low_latency_combine_buffer", handle)
        _, _, T, H, E = handle
        key = (st.set_index, T, H, E)
        if key not in self._combine_bufs:
            P = self.ep.size
            self._combine_bufs[key] = torch.empty(E // P, P * T, H, dtype=torch.bfloat16, device=self.ep.device)
        return self._combine_bufs[key]

    @staticmethod
    def _state(what: str, handle):
        if not isinstance(handle, LowLatencyHandle):
            raise ValueError(f"{what}: handle must be the handle low_latency_dispatch returned, got "
                             f"{type(handle).__name__}")
        return handle.state

    def combine(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish, hook, out, wait_stats,
                call: int = 0):
        """DeepEP's ``low_latency_combine``: ``combined[t] = sum_k topk_weights[t, k] * (expert topk_idx[t, k]'s row
        for t)`` over the slots with ``topk_idx >= 0``, fp32 sums stored in bf16.

        Args:
            x: bf16 [e, PT, H] the experts' outputs in the dispatch's layout (ignored with ``zero_copy``: the
                buffer ``next_combine_buffer`` gave is read instead).
            topk_idx, topk_weights: [N, K] (int64, float32): the dispatch's tokens.
            out: None or bf16 [N, H] to write into (returned).
            call: the Buffer's call number (``Buffer._count``), for the call header where one is checked.
        """
        what = "low_latency_combine"
        st = self._state(what, handle)
        if use_logfmt:
            raise NotImplementedError("deep_ep.Buffer.low_latency_combine(use_logfmt=True): the LogFMT wire format is "
                                      "not implemented; combine in bf16 (use_logfmt=False)")
        if async_finish and hook:
            raise ValueError(f"{what}: async_finish and return_recv_hook cannot both be set")
        _, _, T, H, E = handle
        P, N, K = self.ep.size, st.num_tokens, st.top_k
        e, PT = E // P, P * T
        check_shape(what, "x", x, (e, PT, H), (torch.bfloat16,))
        check_shape(what, "topk_idx", topk_idx, (N, K), (torch.int64, torch.int32))
        check_shape(what, "topk_weights", topk_weights, (N, K), (torch.float32,))
        if out is not None:
            check_shape(what, "out", out, (N, H), (torch.bfloat16,))
            if out.stride(1) != 1:
                raise ValueError(f"{what}: out must have contiguous rows")
        if wait_stats is not None and (not isinstance(wait_stats, torch.Tensor) or wait_stats.dtype != torch.int64):
            raise ValueError(f"{what}: combine_wait_recv_cost_stats must be an int64 tensor")
        y = self.next_combine_buffer(handle) if zero_copy else x.contiguous()
        result = out if out is not None else torch.empty(N, H, dtype=torch.bfloat16, device=x.device)
        return self._combine(st, y, topk_idx, topk_weights, result, async_finish, hook, call)

    @abstractmethod
    def _dispatch(self, x, topk_idx, T, E, K, stats, fp8, round_scale, ue8m0, async_finish, hook, call) -> tuple:
        """The checked dispatch: (recv_x, recv_count, handle, event, hook or None)."""

    @abstractmethod
    def _combine(self, st, y, topk_idx, topk_weights, result, async_finish, hook, call) -> tuple:
        """The checked combine into ``result``: (result, event, hook or None)."""

    # ------------------------------------------------------------------ rank masks
    def update_mask(self, rank: int, mask: bool) -> None:
        """The exchange engine waits for every rank: masking is the direct kernels' (``DirectLowLatency``)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.ep.size:
            raise ValueError(f"low_latency_update_mask_buffer: rank_to_mask={rank!r} must be in [0, {self.ep.size})")
        if mask:
            raise NotImplementedError("deep_ep.Buffer.low_latency_update_mask_buffer(mask=True): moe-wave's exchange "
                                      "waits for every rank, so a rank cannot be masked out; rebuild the Buffer over "
                                      "the surviving ranks' group instead")

    def query_mask(self, mask_status: torch.Tensor) -> None:
        """No rank is ever masked: ``mask_status`` (int32 [P]) is zeroed."""
        check_shape("low_latency_query_mask_buffer", "mask_status", mask_status, (self.ep.size,), (torch.int32,))
        mask_status.zero_()

    def clean_mask(self) -> None:
        """Nothing is ever masked here."""

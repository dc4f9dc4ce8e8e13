"""The ``symm`` backend: fixed-capacity peer buffers, device-side counts, no host sync.

Legend: T local tokens, K top-k, P ranks, W waves, e local experts, S send rows (T*min(K, W*P)),
C capacity rows per (wave, peer), N = min(C, T) rows a block can hold from this rank, D hidden,
M = 2K metadata int32 per row (K local expert ids, K fp32 weights bit-cast).

Every rank owns, in one CUDA symmetric-memory allocation (``torch.distributed._symmetric_memory``):

    recv_x   [W, P(src), C, D]   rows that peer ``src`` sent us in wave w, in its send order
    recv_meta[W, P(src), C, M]   their (local expert, weight) slots
    comb     [W, P(dst), C, D]   results that peer ``dst`` sent back for the rows we sent it

(``recv_meta`` in an allocation of its own, so that prepare can write this rank's own dense block), and in a
small further allocation ``ctrl [P(src), X]`` for the count exchange. Each (wave, peer)
block has its own region, so a sender needs no offset from anyone: row i of its block for peer p
lands at ``recv_x[w, me, i]`` on p. One token goes at most once per (wave, peer), so C =
``WaveConfig.max_tokens_per_rank`` (default 4096) rows can never overflow while T <= C; past that a
block may overflow: its rows past C are never written (the index tables say -1), and the overflow
is reported as a RuntimeError naming wave, peers, count and capacity (see ``check``).

Flow per layer (all on the comm stream, every size static, so it captures in a CUDA graph):

    prepare:  each rank writes its count row into every peer's ``ctrl`` (one Triton program per
              peer, ``symm_tables.count_rows``; copy engines without Triton), barrier(0) on ``ctrl``,
              then builds every index table and the error status from the counts in one launch
              (``symm_tables.build_tables``).
    dispatch: one Triton launch (``symm_kernels.scatter_rows``) copies the wave's send rows and their
              metadata into every peer's ``recv_x``/``recv_meta`` block, this rank's own block
              included (mode "kernel", the default); mode "copy" packs locally and moves N-row
              blocks with ``copy_`` (cudaMemcpyAsync, copy engines, no SMs); with Triton the packing
              is one ``scatter_rows`` launch (this rank's own rows straight into place), without it
              index_select with the local block on a second stream. Then barrier(channel=w) on the
              data allocation (copy mode with ``flags``: completion flags instead, ``CopySignal``:
              the copy engines write a call number after the data, a waiter started beside the
              copies sees them: no barrier kernel waiting for the copies to drain; ``signal="memops"``:
              an acknowledgement before and a flag after the data per peer, written and awaited by
              stream memory operations, no kernel at all).
              Copy mode with dense blocks (``dense``) has no pack: x's rows are copied as they are,
              this rank's own metadata block comes from prepare, and with ``local_view`` its own rows
              are not copied at all (``Received.local``): the dispatch is then copy engines only.
    combine:  results go back into each source's ``comb[w, me]`` (kernel: valid rows only, one
              launch; copy: the whole C-row block per peer), barrier(channel=W+w); the source sums
              them into out_TD in fp32 (``gather_add``: per token, peers in order; with Triton this
              rank's own block is never copied: gather_add reads it from y), optionally adding
              ``add_TD`` and storing into ``dst_TD`` in the same pass, or later (``reduce=False``).

Ordering: peers write into a block only after a barrier that every rank reaches after it has
finished reading that block (prepare and each wave's barrier are issued after the comm stream waits
for the caller's stream), so wave w+1 travels while wave w is consumed, and the next layer never
overwrites rows still in use. ``Received.x_RD`` is a view of ``recv_x`` valid until the next
``prepare`` (on the GPU ``expert_RK`` / ``weight_RK`` are views of ``recv_meta`` too); rows past a
block's count are stale and have expert slot -1, weight 0 (reset in place after each dispatch's
barrier on the GPU).

On CPU (gloo) and for one rank, the very same layout and index tables run with a local staging
buffer and an equal-split ``all_to_all_single`` in place of peer writes, so the CPU tests exercise
everything but the transport. Multicast is never used (TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import streams as st
from .backend import ExchangePlan, Pending, Received, WaveHandle, check_sum_args, sum_tail
from .group import EPGroup
from .layout import DispatchLayout
from .symm_kernels import RowTargets, gather_add, scatter_rows, triton_ok
from . import symm_memops as memops
from .symm_signal import CopySignal
from .symm_tables import (STATUS_LEN, build_tables, build_tables_torch, count_rows, count_rows_torch, densify,
                          densify_torch)

__all__ = ["SymmBackend", "SymmPlan", "DEFAULT_CAPACITY", "MODES", "SIGNALS", "DENSE_FILL", "AUTO_COPY_MIN_TOKENS",
           "dense_fill", "parse_variant", "wave_token_ranges"]



DEFAULT_CAPACITY = 4096
MODES = ("auto", "kernel", "copy")
SIGNALS = ("barrier", "flags", "memops")
DENSE_FILL = 0.8
# mode "auto": copy mode with dense blocks from this capacity (max tokens per rank), kernel mode below. On 2 x H200
# (V4-Flash / V4-Pro, CUDA graphs, benchmarks/2026-11-30-comm-2xh200-session5.json) kernel mode has the
# lower latency alone up to 2048 tokens (Flash round trip 132 vs 146 us at 2048, 24 vs 48 us at 128), and
# dense copy mode hides better beside a GEMM from 512 tokens on (beside 379 vs 400 us at 2048) and is as
# fast alone from 4096 (Pro 8192: 772 vs 777 us).
AUTO_COPY_MIN_TOKENS = 1024


def parse_variant(name: str) -> tuple[str, bool | None, str]:
    """(mode, dense, signal) from a variant name as the benchmarks and tests spell it: the data mode, then
    "+dense" / "+sparse" (neither: chosen by the fill) and "+flags" / "+memops" (neither: the barrier),
    e.g. "copy+dense+memops"."""
    mode, *opts = name.split("+")
    bad = [o for o in opts if o not in ("dense", "sparse") + SIGNALS]
    if mode not in MODES or bad:
        raise ValueError(f"symm variant {name!r}: must be one of {MODES} followed by +dense/+sparse and "
                         f"+flags/+memops")
    dense = True if "dense" in opts else False if "sparse" in opts else None
    return mode, dense, next((o for o in opts if o in SIGNALS), "barrier")


def dense_fill(num_ranks: int, num_waves: int, top_k: int, partition: str) -> float:
    """Expected fraction of a dense block's rows that carry at least one pair, under uniform routing."""
    cells = num_ranks * num_waves if partition == "experts" else num_ranks
    return 1.0 - (1.0 - 1.0 / cells) ** top_k


def wave_token_ranges(T: int, W: int, partition: str) -> tuple:
    """(start, length) of each wave's tokens: all T for "experts", the contiguous chunks of
    ``compute_layout`` (token t in wave t*W // T) for "tokens"."""
    if partition == "experts":
        return tuple((0, T) for _ in range(W))
    bounds = [-(-w * T // W) for w in range(W + 1)]
    return tuple((bounds[w], bounds[w + 1] - bounds[w]) for w in range(W))


def _wave_rows(x_TD: torch.Tensor, plan, wave: int) -> torch.Tensor:
    """Dense blocks: x's rows of wave ``wave`` (its token range, capped at the capacity), a view."""
    start, n = plan.dense[wave]
    return x_TD[start:start + n]


@dataclass(frozen=True)
class SymmPlan(ExchangePlan):
    """The exchange plan plus the device-side index tables of the symm backend.

    Attributes:
        capacity: C.
        mode: the data mode of this plan's exchanges, "kernel" or "copy" (``SymmBackend.choose``).
        tok_WPN: [W, P, N] int64 token of row i of the block for (wave, peer); junk where invalid.
        row_WPN: [W, P, N] int64 send row (into the layout's S rows) of the same.
        send_dst_WPN: [W, P, N] int64 i where row i is valid (i < count and i < C), else -1.
        recv_dst_WPC: [W, P, C] int64 i where received row i of source p is valid, else -1.
        meta_SM: [S, M] int32 the send rows' (local expert, weight) slots.
        slot_WTP: [W, T, P] int64 row ``p*C + i`` of the comb block where token t's result from peer
            p lands in wave w, -1 where t sent nothing to p in that wave (the inverse of tok_WPN);
            None where the combine accumulates with torch ops (no Triton).
        src_PC: [P, C] int64 ``p*C + i``: the rows of y that go back to peer p.
        stale_WPC1: [W, P, C, 1] bool, True where received row i of source p is past its count (its
            metadata is reset in place at dispatch: expert -1, weight 0); sparse blocks on the GPU only.
        pairs_We: [W, e] int64 (row, slot) pairs received per local expert: the exchanged counts summed
            over the sources.
        dense: ((start, rows) per wave) in dense blocks (see ``SymmBackend``): row i of block (w, p) is
            token start_w + i for i < rows_w, whether or not it has an expert on p; None for sparse blocks.
        meta_WPCM: [W, P, C, M] int32, dense blocks only: the (local expert, weight) slots of each row
            for peer p (expert -1 and weight 0 where the token has none of p's experts in wave w, and in
            the rows past the wave's tokens: the whole block is sent, so no stale row remains).
    """

    capacity: int = 0
    mode: str = "copy"
    tok_WPN: torch.Tensor | None = None
    row_WPN: torch.Tensor | None = None
    send_dst_WPN: torch.Tensor | None = None
    recv_dst_WPC: torch.Tensor | None = None
    meta_SM: torch.Tensor | None = None
    slot_WTP: torch.Tensor | None = None
    src_PC: torch.Tensor | None = None
    stale_WPC1: torch.Tensor | None = None
    pairs_We: torch.Tensor | None = None
    dense: tuple | None = None
    meta_WPCM: torch.Tensor | None = None


@dataclass
class _Buffers:
    """One rank's data buffers for one (dtype, D, W) and the views of every peer's (GPU)."""

    recv_x: torch.Tensor          # [W, P, C, D]
    recv_meta: torch.Tensor       # [W, P, C, M] int32
    comb: torch.Tensor            # [W, P, C, D]
    peers: list | None = None     # [P] of (recv_x, recv_meta, comb) views of rank p's buffers
    hdl: object | None = None     # the symmetric-memory handle (barriers)
    # per wave: RowTargets of (recv_x[w, me], recv_meta[w, me], comb[w, me]) on every rank p (kernel mode)
    targets: list | None = None
    stage: tuple | None = None    # emulated transport (CPU / one rank): (x [W, P, C, D], meta [W, P, C, M])
    # copy mode with Triton: a local [P, C, D] / [P, C, M] staging for the peers' rows, and per wave the
    # RowTargets (x, meta) of [stage[p] for every peer p, recv_x[w, me] / recv_meta[w, me] for this rank]
    pack: list | None = None


class SymmBackend:
    """Dispatch/combine through symmetric memory with device-side counts (see the module docstring).

    Args:
        ep: the expert-parallel group (NCCL on GPU; gloo on CPU runs the emulated transport).
        cfg: the MoE config (``top_k``).
        wave: the wave config (``max_tokens_per_rank`` sets the capacity C; 0 means 4096).
        comm_stream: the stream transfers are issued from (GPU); None on CPU.
        Environment: MOE_WAVE_SYMM_TIMEOUT_MS (default 120000): a peer that does not reach a barrier
            within it makes the barrier kernel trap (a CUDA error naming the barrier) instead of hanging.
        mode: "kernel" (Triton, writes only valid rows), "copy" (copy engines, N-row blocks) or
            "auto": without Triton copy; with it, chosen at each prepare (``choose``): copy mode with
            dense blocks where they fill (2 ranks, one wave) and the capacity (max_tokens_per_rank,
            the same on every rank) is at least ``AUTO_COPY_MIN_TOKENS`` (1024), kernel mode otherwise
            (size the capacity to the decode batch for decode graphs). Environment override:
            MOE_WAVE_SYMM_MODE.
        signal: what closes each dispatch / combine exchange (environment override
            MOE_WAVE_SYMM_SIGNAL):
            "barrier" (default): torch's symmetric-memory barrier kernel, with its timeout.
            "flags": copy mode only: completion flags written by the copy engines (``CopySignal``).
                Its waiter spins on one SM for the whole exchange, and beside a GEMM that holds every
                SM this costs a second wave of the GEMM (2 x H200, bytes all-to-all of 64 MB per rank:
                alone 112.9 vs 113.7 us with the barrier, beside the GEMM 399.9 vs 354.8 us;
                benchmarks/README.md, fourth session).
            "memops": stream memory operations (``symm_memops.MemopSignal``): written and awaited by
                the GPU's front end, no SM at all; the wait is bounded by a host watchdog thread
                that names the missing peer and stops the rank after MOE_WAVE_SYMM_TIMEOUT_MS (plus
                MOE_WAVE_SYMM_GRACE_S for the caller to raise it). Another stream that shares a
                hardware queue with the comm stream waits behind a memops wait too.
        flags: the same as signal="flags" (environment: MOE_WAVE_SYMM_FLAGS=1).
        dense: copy mode only: dense blocks (an all-gather layout). Row i of block (w, p) is token
            start_w + i of the wave's token range, sent whether or not it has an expert on p (its
            metadata then says expert -1): the dispatch copies x itself with one cudaMemcpyAsync per
            peer, with no pack kernel, at the price of the rows that carry no pair. None (the default)
            chooses dense where the expected fill of a block under uniform routing,
            1 - (1 - 1/(W*P))^K ("experts" partition) or 1 - (1 - 1/P)^K ("tokens"), is at least
            ``DENSE_FILL`` (0.8): e.g. 2 ranks, one wave, top-6 (0.98), not 8 ranks (0.55). True with
            mode "auto" means copy mode. Environment override: MOE_WAVE_SYMM_DENSE=0|1|auto.
    """

    name = "symm"

    def __init__(self, ep: EPGroup, *, cfg=None, wave=None, comm_stream=None, mode: str = "auto",
                 flags: bool = False, dense: bool | None = None, signal: str | None = None):
        self.ep, self.cfg, self.comm_stream = ep, cfg, comm_stream
        cap = getattr(wave, "max_tokens_per_rank", 0) or DEFAULT_CAPACITY
        self.capacity = int(cap)
        mode = os.environ.get("MOE_WAVE_SYMM_MODE", mode)
        if mode not in MODES:
            raise ValueError(f"SymmBackend mode={mode!r}: must be one of {MODES}")
        env = os.environ.get("MOE_WAVE_SYMM_DENSE")
        if env is not None:
            if env not in ("0", "1", "auto"):
                raise ValueError(f"MOE_WAVE_SYMM_DENSE={env!r}: must be 0, 1 or auto")
            dense = None if env == "auto" else env == "1"
        if dense and mode == "kernel":
            raise ValueError(f"SymmBackend dense=True needs mode='copy' (mode is {mode!r}): kernel mode writes only "
                             f"the rows that carry pairs, so it has no pack to save")
        if os.environ.get("MOE_WAVE_SYMM_FLAGS") == "1" or (flags and signal is None):
            signal = "flags"
        signal = os.environ.get("MOE_WAVE_SYMM_SIGNAL", signal or "barrier")
        if signal not in SIGNALS:
            raise ValueError(f"SymmBackend signal={signal!r}: must be one of {SIGNALS}")
        if mode == "auto" and (dense or signal == "flags" or not triton_ok(ep.device)):
            mode = "copy"       # otherwise "auto" stays, and each prepare chooses (``choose``)
        if mode == "kernel" and not triton_ok(ep.device):
            raise ValueError(f"SymmBackend mode='kernel' needs Triton on {ep.device} (pip install triton; on CPU "
                             f"also TRITON_INTERPRET=1); mode='copy' runs without it")
        self.mode = mode
        self.dense = dense
        # Triton where it runs: prepare's count rows and tables, the combine's accumulate (gather_add)
        self._kernels = triton_ok(ep.device)
        self.symm = st.is_accelerator(ep.device) and ep.size > 1
        if signal == "flags" and (mode == "kernel" or not self._kernels):
            raise ValueError(f"SymmBackend signal='flags' needs mode='copy' and Triton (mode is {mode!r}, Triton "
                             f"{'usable' if self._kernels else 'not usable'} on {ep.device})")
        if signal == "memops" and self.symm and memops.available():
            raise ValueError(f"SymmBackend signal='memops': {memops.available()}")
        self.signal = signal
        # Copy mode: the block for this rank itself is a local copy on a second stream, beside the peer
        # copies over NVLink instead of after them (kernel mode interleaves it in the one launch).
        self.local_stream = (st.accel_module(ep.device).Stream(device=ep.device, priority=-1)
                             if self.symm and comm_stream is not None else None)
        self._other_ranks = [p for p in range(ep.size) if p != ep.rank]
        # the same as a device index (made here, outside any capture: a list index copies from the host)
        self._others = torch.tensor(self._other_ranks, dtype=torch.long, device=ep.device)
        self._src_PC = torch.arange(ep.size * self.capacity, device=ep.device).view(ep.size, self.capacity)
        if self.symm and (ep.pg is None or "nccl" not in ep.backend):
            raise ValueError(f"EPGroup.backend={ep.backend!r}: the symm backend on {ep.device} needs an NCCL group")
        self._num_experts = 0
        self.timeout_ms = int(os.environ.get("MOE_WAVE_SYMM_TIMEOUT_MS", "120000"))
        self._ctrl: dict = {}
        self._data: dict = {}
        self._meta_bufs: dict = {}
        self._signals: dict = {}     # copy mode: (buffers, channel) -> CopySignal
        self._dense_cache: dict = {}  # (T, W, P, partition) -> the routing-independent dense tables
        dev = ep.device
        self._status_dev = torch.zeros(STATUS_LEN, dtype=torch.long, device=dev)
        pin = st.is_accelerator(dev)
        self._status_host = torch.zeros(STATUS_LEN, dtype=torch.long, pin_memory=pin)

    # ---------------------------------------------------------------- overflow / id errors
    def check(self) -> None:
        """Raise the first capacity overflow or out-of-range expert id seen so far, then clear it.

        HOST SYNC: waits for the comm stream so that the latest status has reached the host.
        """
        if self.comm_stream is not None:
            self.comm_stream.synchronize()
        elif st.is_accelerator(self.ep.device):
            st.accel_module(self.ep.device).synchronize(self.ep.device)
        self._raise_if_flagged()
        for sig in self._signals.values():
            sig.check()

    def _raise_if_flagged(self) -> None:
        # Reads pinned host memory that the last prepare's non-blocking copy wrote: no CUDA call,
        # so it is safe on the hot path and during graph capture (the value may be one call old).
        s = self._status_host.tolist()
        if not (s[0] or s[5]):
            return
        self._status_host.zero_()
        self._status_dev.zero_()
        if s[5]:
            E = self._num_experts
            raise ValueError(f"topk_ids out of range (rank {s[6]}: ids in [{s[7]}, {s[8]}]): "
                             f"expert ids must be in [0, {E})")
        raise RuntimeError(
            f"symm backend capacity overflow in wave {s[2]}: rank {s[1]} sent {s[4]} rows to rank {s[3]}, "
            f"capacity is {self.capacity} rows per (wave, peer); set WaveConfig.max_tokens_per_rank >= {s[4]} "
            f"(at most one row per token per (wave, peer), so >= the tokens per rank always fits). "
            f"The rows past the capacity were not sent: that call's results are wrong.")

    # ---------------------------------------------------------------- buffers (collective, lazy)
    def _alloc(self, nbytes: int):
        import torch.distributed._symmetric_memory as symm_mem

        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("symm backend: run one prepare, dispatch and combine of this shape eagerly before "
                               "capturing a CUDA graph (its buffers are allocated on first use, by every rank)")
        name = self.ep.pg.group_name
        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.ep.device)
        hdl = symm_mem.rendezvous(buf, name)
        buf.zero_()
        return buf, hdl

    def _ctrl_buf(self, P: int, X: int):
        """(local [P, X] int64, the peers' rows for me (a RowTargets with kernels, else [P] views), handle)
        for the count exchange."""
        if X not in self._ctrl:
            _, hdl = self._alloc(P * X * 8)
            views = [hdl.get_buffer(p, [P, X], torch.int64, 0) for p in range(P)]
            hdl.barrier(channel=0, timeout_ms=self.timeout_ms)  # all zeroed before anyone writes
            me = self.ep.rank
            dst = RowTargets.of(v[me:me + 1] for v in views) if self._kernels else views
            self._ctrl[X] = (views[me], dst, hdl)
        return self._ctrl[X]

    def _meta(self, W: int, K: int):
        """(recv_meta [W, P, C, M] int32, [P] every rank's recv_meta (GPU) or None, the handle): the routing
        metadata, in an allocation of its own shared by every dtype and width of x, so that prepare can
        write this rank's own dense block before x is seen (collective on first use, before any capture)."""
        key = (W, K)
        if key not in self._meta_bufs:
            P, C, M, dev = self.ep.size, self.capacity, 2 * K, self.ep.device
            if not self.symm:
                self._meta_bufs[key] = (torch.zeros([W, P, C, M], dtype=torch.int32, device=dev), None, None)
            else:
                _, hdl = self._alloc(W * P * C * M * 4)
                peers = [hdl.get_buffer(p, [W, P, C, M], torch.int32, 0) for p in range(P)]
                hdl.barrier(channel=0, timeout_ms=self.timeout_ms)
                # the handle is kept: the peers' mappings live as long as it does (its views alone do not hold them)
                self._meta_bufs[key] = (peers[self.ep.rank], peers, hdl)
        return self._meta_bufs[key]

    def _buffers(self, dtype: torch.dtype, D: int, W: int, K: int) -> _Buffers:
        key = (dtype, D, W, K)
        if key in self._data:
            return self._data[key]
        P, C, M, dev = self.ep.size, self.capacity, 2 * K, self.ep.device
        shape_x, shape_m = [W, P, C, D], [W, P, C, M]
        recv_meta, meta_peers, _ = self._meta(W, K)
        if not self.symm:
            bufs = _Buffers(torch.zeros(shape_x, dtype=dtype, device=dev), recv_meta,
                            torch.zeros(shape_x, dtype=dtype, device=dev))
            # the emulated transport: rows are packed into a local stage, then one all_to_all_single
            stage = ((bufs.recv_x, bufs.recv_meta) if P == 1 else
                     (torch.zeros(shape_x, dtype=dtype, device=dev), torch.zeros(shape_m, dtype=torch.int32, device=dev)))
            bufs.stage = stage
            if triton_ok(dev):
                bufs.targets = [(RowTargets.of(stage[0][w]), RowTargets.of(stage[1][w]), None) for w in range(W)]
            self._data[key] = bufs
            return bufs
        import torch.distributed._symmetric_memory as symm_mem

        pad_slots = symm_mem.get_signal_pad_size() // 4 if hasattr(symm_mem, "get_signal_pad_size") else 512
        if 2 * W * P > pad_slots:
            raise ValueError(f"num_waves={W}: the symm backend needs 2*W*P={2 * W * P} signal slots, the signal pad "
                             f"has {pad_slots}; use fewer waves or call symm_mem.set_signal_pad_size first")
        es = torch.empty((), dtype=dtype).element_size()
        nx = W * P * C * D
        _, hdl = self._alloc(2 * nx * es)
        peers = [(hdl.get_buffer(p, shape_x, dtype, 0), meta_peers[p], hdl.get_buffer(p, shape_x, dtype, nx))
                 for p in range(P)]
        hdl.barrier(channel=0, timeout_ms=self.timeout_ms)
        mine = peers[self.ep.rank]
        bufs = _Buffers(mine[0], mine[1], mine[2], peers, hdl)
        if triton_ok(dev):   # block (w, me) of every rank's buffers, as pointer tables (built here, not in a capture)
            me = self.ep.rank
            bufs.targets = [tuple(RowTargets.of(pb[j][w, me] for pb in peers) for j in range(3)) for w in range(W)]
        self._data[key] = bufs
        return bufs

    def _signal(self, bufs: _Buffers, channel: int, what: str):
        """The signal that closes one exchange channel: completion flags (``CopySignal``), stream memory
        operations (``MemopSignal``), or None for the barrier kernel. Allocated on first use,
        collectively, so that first use must come before any capture."""
        if not self.symm or self.signal == "barrier":
            return None
        key = (id(bufs), channel)
        if key not in self._signals:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"symm signal={self.signal!r}: run one dispatch and combine eagerly before "
                                   f"capturing a CUDA graph (the signal words are allocated on first use, by every rank)")
            if self.signal == "flags":
                self._signals[key] = CopySignal(self.ep, self._alloc, self.timeout_ms)
            else:
                self._signals[key] = memops.MemopSignal(self.ep, self._alloc, timeout_ms=self.timeout_ms, name=what)
        return self._signals[key]

    def _close(self, sig, bufs: _Buffers, channel: int) -> None:
        """End an exchange: the signal's wait, or the barrier kernel on the data allocation."""
        if sig is not None:
            sig.end()
        else:
            bufs.hdl.barrier(channel=channel, timeout_ms=self.timeout_ms)

    def _raise_watchdog(self) -> None:
        if self.signal == "memops" and self._signals:
            memops.watchdog().raise_if_fired()

    # ---------------------------------------------------------------- count exchange
    def prepare(self, layout: DispatchLayout) -> SymmPlan:
        """Exchange counts and build the index tables (device-side). Dispatch the plan's waves before the
        next ``prepare``: its count writes are ordered behind the peers' reads by the wave barriers."""
        plan = layout.plan
        P, W, e, me = plan.num_ranks, plan.num_waves, plan.num_local_experts, self.ep.rank
        if P != self.ep.size:
            raise ValueError(f"WavePlan.num_ranks={P}: must equal the EP group size {self.ep.size}")
        self._num_experts = plan.num_experts
        self._raise_watchdog()
        if st.is_accelerator(self.ep.device):
            self._raise_if_flagged()
        dev, C, T = layout.send_counts_WP.device, self.capacity, layout.num_tokens
        cur = st.current_stream(dev)
        K = layout.send_expert_SK.shape[1]
        mode, dense = self.choose(plan, K)
        static = self._dense_static(T, plan) if dense else None
        # dense blocks: the counts exchanged are the blocks' row counts (the wave's token range)
        counts = (static["counts_WP"] if dense else layout.send_counts_WP, layout.pair_counts_WPe,
                  layout.ids_min, layout.ids_max)
        with st.on(self.comm_stream):
            st.wait_stream(self.comm_stream, cur)
            recv_PX = self._exchange_counts(counts, P, W * P + W * e + 2)
            slot_WTP = torch.full((W, T, P), -1, dtype=torch.long, device=dev) if self._kernels else None
            build = build_tables if self._kernels else build_tables_torch
            # the send side always from the sparse rows (dense blocks are derived from them below); the
            # receive side and the overflow status from the exchanged counts
            tabs = build(recv_PX, layout.send_counts_WP, layout.send_token_S, C, T, me, plan.num_experts,
                         slot_WTP, self._status_dev)
            self._status_host.copy_(self._status_dev, non_blocking=True)
            meta_SM = torch.cat([layout.send_expert_SK, layout.send_weight_SK.view(torch.int32)], 1)
            extra = {}
            if dense:
                extra = self._densify(tabs, meta_SM, slot_WTP, static, K, C)
                if self.symm:   # this rank's own block of metadata, here: the dispatch sends the peers' only
                    self._meta(W, K)[0][:, me].copy_(extra["meta_WPCM"][:, me], non_blocking=True)
            recv_pairs_WPe = recv_PX[:, W * P:W * P + W * e].view(P, W, e).permute(1, 0, 2)
            xplan = SymmPlan(layout=layout, recv_pairs_WPe=recv_pairs_WPe, capacity=C, meta_SM=meta_SM, mode=mode,
                             slot_WTP=slot_WTP, src_PC=self._src_PC, pairs_We=recv_pairs_WPe.sum(1),
                             stale_WPC1=(tabs["recv_dst_WPC"] < 0)[..., None] if self.symm and not dense else None,
                             **{**tabs, **extra})
        st.wait_stream(cur, self.comm_stream)
        for t in (recv_PX, xplan.tok_WPN, xplan.row_WPN, xplan.send_dst_WPN, xplan.recv_dst_WPC, meta_SM, slot_WTP,
                  xplan.pairs_We, xplan.stale_WPC1, xplan.meta_WPCM):
            if t is not None:
                st.keep_alive(t, cur)
        if not st.is_accelerator(dev):
            self._raise_if_flagged()  # CPU: the status is already on the host (eager error, all ranks alike)
        return xplan

    # ---------------------------------------------------------------- dense blocks
    def choose(self, plan, top_k: int) -> tuple[str, bool]:
        """(data mode, dense blocks) for one prepare: the settings where they are fixed; mode "auto" takes
        copy mode with dense blocks where they are expected to fill (``DENSE_FILL``) and the capacity
        (``WaveConfig.max_tokens_per_rank``) reaches ``AUTO_COPY_MIN_TOKENS``, else kernel mode. Only
        what every rank shares decides (the plan, top-k, the capacity), never this call's token count:
        all ranks must pick the same."""
        full = dense_fill(plan.num_ranks, plan.num_waves, top_k, plan.partition) >= DENSE_FILL
        mode = self.mode
        if mode == "auto":
            mode = "copy" if self.dense is not False and full and self.capacity >= AUTO_COPY_MIN_TOKENS else "kernel"
        return mode, mode == "copy" and (full if self.dense is None else self.dense)

    def _dense_static(self, T: int, plan) -> dict:
        """The routing-independent part of dense blocks for T tokens (cached; made outside any capture:
        the first prepare of a shape runs eagerly)."""
        W, P, C, dev = plan.num_waves, plan.num_ranks, self.capacity, self.ep.device
        key = (T, W, P, plan.partition)
        if key not in self._dense_cache:
            N = min(C, T)
            ranges = wave_token_ranges(T, W, plan.partition)
            start_W1 = torch.tensor([a for a, _ in ranges], dtype=torch.long).view(W, 1)
            len_W1 = torch.tensor([n for _, n in ranges], dtype=torch.long).view(W, 1)
            i_N = torch.arange(N)
            tok_WPN = (start_W1 + i_N).clamp(max=max(T - 1, 0)).view(W, 1, N).expand(W, P, N)
            send_dst_WPN = torch.where(i_N < len_W1.clamp(max=C), i_N, -1).view(W, 1, N).expand(W, P, N)
            self._dense_cache[key] = dict(
                ranges=tuple((a, min(n, N)) for a, n in ranges), max_len=max((n for _, n in ranges), default=0),
                counts_WP=len_W1.expand(W, P).contiguous().to(dev), rng_W2=torch.cat([start_W1, len_W1], 1).to(dev),
                start_W=start_W1.view(W).to(dev),
                tok_WPN=tok_WPN.contiguous().to(dev), send_dst_WPN=send_dst_WPN.contiguous().to(dev))
        return self._dense_cache[key]

    def _densify(self, tabs: dict, meta_SM, slot_WTP, static: dict, K: int, C: int) -> dict:
        """Dense blocks from the sparse tables (``symm_tables.densify``): each send row's metadata moves to
        its token's row of the block, and the combine's slots point at those rows."""
        if slot_WTP is not None:         # Triton: one launch
            meta = densify(slot_WTP, tabs["row_WPN"], meta_SM, static["rng_W2"], C, K, static["max_len"])
        else:
            meta = densify_torch(tabs["tok_WPN"], tabs["row_WPN"], tabs["send_dst_WPN"], meta_SM, None,
                                 static["start_W"], C, K)
        return dict(tok_WPN=static["tok_WPN"], send_dst_WPN=static["send_dst_WPN"], row_WPN=None,
                    meta_WPCM=meta, dense=static["ranges"])

    def _exchange_counts(self, counts, P: int, X: int) -> torch.Tensor:
        """[P, X]: row src is what rank src sent this rank (see ``symm_tables``)."""
        if self.symm and self._kernels:     # one kernel writes my row into every peer's ctrl, then the barrier
            mine, targets, hdl = self._ctrl_buf(P, X)
            count_rows(targets, *counts)
            hdl.barrier(channel=0, timeout_ms=self.timeout_ms)
            return mine.clone()
        send_PX = count_rows_torch(*counts)
        if P == 1:
            return send_PX
        if not self.symm:
            recv_PX = torch.empty_like(send_PX)
            dist.all_to_all_single(recv_PX, send_PX, group=self.ep.pg)
            return recv_PX
        mine, views, hdl = self._ctrl_buf(P, X)
        for p in range(P):
            views[p][self.ep.rank].copy_(send_PX[p])     # peer write over NVLink (copy engine)
        hdl.barrier(channel=0, timeout_ms=self.timeout_ms)
        return mine.clone()

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, x_TD: torch.Tensor, plan: SymmPlan, wave: int, *,
                 local_view: bool = False) -> Pending[Received]:
        """See ``comm.backend``. ``local_view``: with dense blocks this rank's own rows are not copied into its
        receive block (on the GPU a same-device copy runs on the SMs, which a GEMM beside it holds):
        ``Received.local`` names them in x instead, and the caller's consumer must read them there."""
        lay = plan.layout
        P, C = self.ep.size, plan.capacity
        K, D = lay.send_expert_SK.shape[1], x_TD.shape[1]
        if x_TD.shape[0] != lay.num_tokens:
            raise ValueError(f"x.shape[0]={x_TD.shape[0]}: must equal the layout's {lay.num_tokens} tokens")
        self._raise_watchdog()
        bufs = self._buffers(x_TD.dtype, D, plan.num_waves, K)
        dev, cur = x_TD.device, st.current_stream(x_TD.device)
        works = ()
        with st.on(self.comm_stream):
            st.wait_stream(self.comm_stream, cur)
            st.keep_alive(x_TD, self.comm_stream)
            if self.symm:
                sig = self._signal(bufs, wave, f"dispatch wave {wave}")
                if sig is not None:     # flags: a waiter started beside the copies; memops: the acknowledgements
                    sig.begin()
                self._push_peers(x_TD, plan, bufs, wave, local_view)
                self._close(sig, bufs, wave)
                # rows past a source's count hold stale (copy mode: junk) metadata: expert -1, weight 0,
                # in place, so that finish() hands out views. After the barrier: copy mode's N-row blocks
                # write those rows too; the next writes into this block come after the next prepare.
                if plan.dense is None:      # dense blocks send all C metadata rows: nothing is stale
                    meta = bufs.recv_meta[wave]
                    meta[..., :K].masked_fill_(plan.stale_WPC1[wave], -1)
                    meta[..., K:].masked_fill_(plan.stale_WPC1[wave], 0)
            else:
                stage_x, stage_m = bufs.stage[0][wave], bufs.stage[1][wave]
                if plan.mode == "kernel":
                    self._scatter(x_TD, plan, bufs, wave)
                else:
                    for p in range(P):
                        self._pack(x_TD, plan, wave, p, stage_x[p], stage_m[p])
                if P > 1:
                    works = (dist.all_to_all_single(bufs.recv_x[wave].view(P * C, D), stage_x.view(P * C, D),
                                                    group=self.ep.pg, async_op=True),
                             dist.all_to_all_single(bufs.recv_meta[wave].view(P * C, 2 * K),
                                                    stage_m.view(P * C, 2 * K), group=self.ep.pg, async_op=True))
        handle = WaveHandle(wave=wave, plan=plan, send_token_S=plan.tok_WPN[wave].reshape(-1), extra={"bufs": bufs})
        e = plan.layout.plan.num_local_experts
        local = (self.ep.rank * C, _wave_rows(x_TD, plan, wave)) if local_view and plan.dense is not None else None

        def finish() -> Received:
            for wk in works:
                wk.wait()
            now = st.current_stream(dev)
            st.wait_stream(now, self.comm_stream)
            meta_RM = bufs.recv_meta[wave].view(P * C, 2 * K)
            if local is not None:
                st.keep_alive(x_TD, now)
                if not st.is_accelerator(dev):    # emulated transport (CPU): the rows the GPU would not copy
                    bufs.recv_x[wave, self.ep.rank].fill_(float("nan"))    # are poisoned: reading them fails
            if self.symm:       # stale rows were reset at dispatch: views, and the exchanged pair counts
                return Received(x_RD=bufs.recv_x[wave].view(P * C, D), expert_RK=meta_RM[:, :K],
                                weight_RK=meta_RM[:, K:].view(torch.float32), pairs_e=None,
                                pairs_e_dev=plan.pairs_We[wave], handle=handle, local=local)
            valid_R1 = (plan.recv_dst_WPC[wave] >= 0).reshape(-1, 1)
            expert_RK = torch.where(valid_R1, meta_RM[:, :K], -1)
            weight_RK = torch.where(valid_R1, meta_RM[:, K:].view(torch.float32), 0.0)
            key = torch.where(expert_RK >= 0, expert_RK, e).long().reshape(-1)
            pairs = torch.zeros(e + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))[:e]
            return Received(x_RD=bufs.recv_x[wave].view(P * C, D), expert_RK=expert_RK, weight_RK=weight_RK,
                            pairs_e=None, pairs_e_dev=pairs, handle=handle, local=local)

        return Pending(finish, f"dispatch[{wave}]")

    def _pack(self, x_TD, plan: SymmPlan, wave: int, p: int, dst_x_CD, dst_m_CM) -> None:
        """Copy mode: the rows of block (wave, p) into a [C, D] / [C, M] destination (local, or p's block
        with dense blocks); sparse rows past the count get junk from valid rows, within the N-row block
        (masked by the receiver)."""
        N = plan.tok_WPN.shape[2]
        if plan.dense is not None:          # dense: the wave's token range as it is, and p's metadata rows
            rows = _wave_rows(x_TD, plan, wave)
            dst_x_CD[:rows.shape[0]].copy_(rows, non_blocking=True)
            dst_m_CM.copy_(plan.meta_WPCM[wave, p], non_blocking=True)     # all C rows: none left stale
        elif N:
            torch.index_select(x_TD, 0, plan.tok_WPN[wave, p], out=dst_x_CD[:N])
            torch.index_select(plan.meta_SM, 0, plan.row_WPN[wave, p], out=dst_m_CM[:N])

    def _scatter(self, x_TD, plan: SymmPlan, bufs: _Buffers, wave: int) -> None:
        """Kernel mode: every block's valid rows and their metadata, one launch."""
        tx, tm, _ = bufs.targets[wave]
        scatter_rows(x_TD, tx, plan.tok_WPN[wave], plan.send_dst_WPN[wave], plan.meta_SM, tm, plan.row_WPN[wave])

    def _local_fork(self, *tensors):
        """Start the local block's stream behind the comm stream (None: run it on the comm stream)."""
        loc = self.local_stream
        if loc is None:
            return None
        st.wait_stream(loc, self.comm_stream)
        if not torch.cuda.is_current_stream_capturing():
            for t in tensors:
                st.keep_alive(t, loc)
        return loc

    def _pack_targets(self, bufs: _Buffers, wave: int):
        """Copy mode with Triton: (x, meta) RowTargets that pack every peer's rows into the local staging
        and this rank's own rows straight into its ``recv_x`` / ``recv_meta`` block (built on first use,
        which must come before any capture: it copies the pointer table from the host)."""
        if bufs.pack is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("symm copy mode: run one dispatch eagerly before capturing a CUDA graph "
                                   "(its staging buffers and pointer tables are built on first use)")
            W, P, C, D = bufs.recv_x.shape
            me = self.ep.rank
            sx = torch.empty((P, C, D), dtype=bufs.recv_x.dtype, device=bufs.recv_x.device)
            sm = torch.empty((P, C, bufs.recv_meta.shape[3]), dtype=torch.int32, device=bufs.recv_x.device)
            bufs.pack = [(sx, sm) + tuple(RowTargets.of(own[w, me] if p == me else stage[p] for p in range(P))
                                          for own, stage in ((bufs.recv_x, sx), (bufs.recv_meta, sm)))
                         for w in range(W)]
        return bufs.pack[wave]

    def _push_peers(self, x_TD, plan: SymmPlan, bufs: _Buffers, wave: int, local_view: bool = False) -> None:
        if plan.mode == "kernel":
            self._scatter(x_TD, plan, bufs, wave)
            return
        me, N = self.ep.rank, plan.tok_WPN.shape[2]
        if plan.dense is not None:      # even with no rows: the metadata block is sent whole (no stale rows)
            # dense blocks: no pack. One cudaMemcpyAsync of x's rows and one of the metadata per peer (copy
            # engines, no SMs). This rank's own metadata block was written by prepare; its own rows are
            # copied on the local stream unless the caller reads them from x (local_view: a same-device copy
            # runs on the SMs, and would wait for a GEMM beside it).
            loc = None
            if not local_view:
                loc = self._local_fork(x_TD)
                rows = _wave_rows(x_TD, plan, wave)
                with st.on(loc):
                    bufs.recv_x[wave, me, :rows.shape[0]].copy_(rows, non_blocking=True)
            for p in self._other_ranks:
                prx, prm, _ = bufs.peers[p]
                self._pack(x_TD, plan, wave, p, prx[wave, me], prm[wave, me])
            if loc is not None:
                st.wait_stream(self.comm_stream, loc)
            return
        if not N:
            return
        if self._kernels:
            # one Triton launch packs every peer's valid rows (and metadata) into the local staging and this
            # rank's own rows into place; then one cudaMemcpyAsync per peer block (copy engines, no SMs)
            sx, sm, tx, tm = self._pack_targets(bufs, wave)
            scatter_rows(x_TD, tx, plan.tok_WPN[wave], plan.send_dst_WPN[wave], plan.meta_SM, tm, plan.row_WPN[wave])
            for p in self._other_ranks:
                prx, prm, _ = bufs.peers[p]
                prx[wave, me, :N].copy_(sx[p, :N], non_blocking=True)
                prm[wave, me, :N].copy_(sm[p, :N], non_blocking=True)
            return
        # Copy engines: gather the peers' rows (one index_select), one cudaMemcpyAsync per peer block;
        # the local block is gathered straight into place on the local stream.
        loc = self._local_fork(x_TD)
        rx, rm, _ = bufs.peers[me]
        with st.on(loc):
            self._pack(x_TD, plan, wave, me, rx[wave, me], rm[wave, me])
        rows = plan.tok_WPN[wave].index_select(0, self._others).reshape(-1)
        stage_x = x_TD.index_select(0, rows).view(-1, N, x_TD.shape[1])
        stage_m = plan.meta_SM.index_select(0, plan.row_WPN[wave].index_select(0, self._others).reshape(-1)).view(
            -1, N, plan.meta_SM.shape[1])
        for i, p in enumerate(self._other_ranks):
            prx, prm, _ = bufs.peers[p]
            prx[wave, me, :N].copy_(stage_x[i], non_blocking=True)
            prm[wave, me, :N].copy_(stage_m[i], non_blocking=True)
        if loc is not None:
            st.wait_stream(self.comm_stream, loc)

    # ---------------------------------------------------------------- combine
    def combine(self, y_RD: torch.Tensor, handle: WaveHandle, out_TD: torch.Tensor, *, accumulate: bool = True,
                add_TD: torch.Tensor | None = None, dst_TD: torch.Tensor | None = None, reduce: bool = True) -> Pending:
        """See ``comm.backend``. With ``reduce=False`` the returned sum reads this wave's ``comb`` block (and
        y, for this rank's own rows): run it before the next ``prepare`` on the stream that calls it (or
        one that stream is ordered after)."""
        check_sum_args(out_TD, add_TD, dst_TD)
        plan, wave, bufs = handle.plan, handle.wave, handle.extra["bufs"]
        P, me, C, W = self.ep.size, self.ep.rank, plan.capacity, plan.num_waves
        D = y_RD.shape[1]
        if y_RD.shape != (P * C, D) or y_RD.dtype != bufs.comb.dtype:
            raise ValueError(f"y: shape {tuple(y_RD.shape)} dtype {y_RD.dtype}: must be {(P * C, D)} "
                             f"{bufs.comb.dtype} (one row per received row)")
        self._raise_watchdog()
        dev, cur = y_RD.device, st.current_stream(y_RD.device)
        works = ()
        gather = self._kernels and out_TD.dtype == torch.float32
        local_from_y = self.symm and gather
        with st.on(self.comm_stream):
            st.wait_stream(self.comm_stream, cur)
            st.keep_alive(y_RD, self.comm_stream)
            y_RD = y_RD.contiguous()
            sig = self._signal(bufs, W + wave, f"combine wave {wave}")
            if sig is not None:
                sig.begin()
            if self.symm and plan.mode == "kernel":   # valid rows only, every source's block in one launch
                # this rank's own results stay in y: gather_add reads them there (no local copy)
                scatter_rows(y_RD, bufs.targets[wave][2], plan.src_PC, plan.recv_dst_WPC[wave],
                             skip=me if local_from_y else None)
                self._close(sig, bufs, W + wave)
            elif self.symm:
                loc = None if local_from_y else self._local_fork(y_RD)
                for s, (_, _, cb) in enumerate(bufs.peers):
                    if s == me and local_from_y:      # gather_add reads this rank's own block from y
                        continue
                    with st.on(loc if s == me else self.comm_stream):
                        cb[wave, me].copy_(y_RD[s * C:(s + 1) * C], non_blocking=True)
                if loc is not None:
                    st.wait_stream(self.comm_stream, loc)
                self._close(sig, bufs, W + wave)
            elif P == 1:
                bufs.comb[wave].view(C, D).copy_(y_RD)
            else:
                works = (dist.all_to_all_single(bufs.comb[wave].view(P * C, D), y_RD, group=self.ep.pg,
                                                async_op=True),)

        def total() -> None:
            N = plan.tok_WPN.shape[2]
            if gather:
                # one program per token (tile) sums its rows from every peer block in peer order (fp32, no
                # temporaries, no atomics): out[t] += sum_p comb[w, p, slot_p(t)] (+ add[t], into dst);
                # this rank's own block straight from y (same row index) on the GPU
                if local_from_y:
                    st.keep_alive(y_RD, st.current_stream(dev))
                    gather_add(out_TD, bufs.comb[wave].view(P * C, D), plan.slot_WTP[wave], y_RD, me,
                               accumulate=accumulate, add_TD=add_TD, dst_TD=dst_TD)
                else:
                    gather_add(out_TD, bufs.comb[wave].view(P * C, D), plan.slot_WTP[wave], accumulate=accumulate,
                               add_TD=add_TD, dst_TD=dst_TD)
                return
            if not accumulate:
                out_TD.zero_()
            back_PND = bufs.comb[wave][:, :N].float()
            back_PND = torch.where((plan.send_dst_WPN[wave] >= 0)[..., None], back_PND, 0.0)
            out_TD.index_add_(0, plan.tok_WPN[wave].reshape(-1), back_PND.reshape(-1, D).to(out_TD.dtype))
            sum_tail(out_TD, add_TD, dst_TD)

        def finish():
            for wk in works:
                wk.wait()
            st.wait_stream(st.current_stream(dev), self.comm_stream)
            if not reduce:
                return total
            total()

        return Pending(finish, f"combine[{wave}]")

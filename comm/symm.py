"""The ``symm`` backend: fixed-capacity peer buffers, device-side counts, no host sync.

Legend: T local tokens, K top-k, P ranks, W waves, e local experts, S send rows (T*min(K, W*P)),
C capacity rows per (wave, peer), N = min(C, T) rows a block can hold from this rank, D hidden,
M = 2K metadata int32 per row (K local expert ids, K fp32 weights bit-cast).

Each (wave, peer) block has its own region in every rank's buffers (``symm_heap``), so a sender needs no
offset from anyone: row i of its block for peer p lands at ``recv_x[w, me, i]`` on p. One token goes at most
once per (wave, peer), so C = ``SymmOptions.capacity`` rows can never overflow while T <= C; past that a block
may overflow: its rows past C are never written (the index tables say -1), and the overflow is reported as a
RuntimeError naming wave, peers, count and capacity (``check``).

Flow per layer (all on the comm stream, every size static, so it captures in a CUDA graph):

    prepare:  each rank writes its count row into every peer's ``ctrl`` (``symm_tables.count_rows``), a barrier,
              then every index table and the error status from the counts in one launch
              (``symm_tables.build_tables``); the data mode and block layout come from ``symm_plan.choose``.
    dispatch: the wave's rows and their metadata into every peer's block (``symm_transport``: a Triton launch,
              or copy engines), closed by a barrier or a signal.
    combine:  results go back into each source's ``comb[w, me]``; the source sums them into out_TD in fp32
              (``gather_add``: per token, peers in order; this rank's own block read from y on peer memory),
              adding ``add_TD`` and storing into ``dst_TD`` in the same pass, or later (``combine_deferred``).

``Received.x_RD`` is a view of ``recv_x`` valid until the next ``prepare``, and so are ``expert_RK`` /
``weight_RK`` (views of ``recv_meta``). On CPU (gloo) and for one rank the very same layout and index tables
run over an emulated transport (``symm_transport.EmulatedTransport``), so the CPU tests exercise everything
but the peer writes. Multicast is never used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from . import streams as st
from .backend import CombineOut, OnceRows, Pending, Received, WaveHandle, pending_after
from .group import EPGroup
from .layout import DispatchLayout
from .options import SymmOptions
from .symm_heap import Buffers
from .symm_kernels import gather_add, poison_rows
from .symm_once import flag_layer_overflow, once_tables
from .symm_plan import DenseTables, SymmPlan, choose, wave_rows
from .symm_tables import POISON, STATUS_LEN, build_tables, build_tables_torch
from .symm_transport import EmulatedTransport, PeerTransport
from .triton_gate import triton_ok

__all__ = ["SymmBackend", "SymmHandle"]

_WANT = {"auto": None, "triton": True, "torch": False}


@dataclass(frozen=True)
class SymmHandle(WaveHandle):
    """One wave's combine state: the buffers it travelled through."""

    bufs: Buffers = field(compare=False, repr=False)


class SymmBackend:
    """Dispatch/combine through symmetric memory with device-side counts (see the module docstring).

    Args:
        ep: the expert-parallel group (NCCL on GPU; gloo on CPU runs the emulated transport).
        options: ``SymmOptions`` (capacity, data mode, dense blocks, signal, timeouts, kernels, copy tuning).
            Mode "auto" is "copy" where Triton does not run or the options ask for dense blocks or flags; else
            each prepare chooses (``symm_plan.choose``).
        comm_stream: the stream transfers are issued from (GPU); None on CPU.

    Signals (``options.signal``): "barrier", our barrier kernel over flag words in the data allocation (it names a
    peer that does not arrive within ``timeout_ms`` and poisons the output; torch's barrier without Triton); "flags"
    (copy mode), completion flags written by the copy engines, awaited by a one-SM waiter; "memops", stream
    memory operations, no SM at all, each wait bounded by a watchdog thread that names the missing peer and
    stops the rank after ``timeout_ms`` (plus ``grace_s`` for the caller to raise it).
    """

    name = "symm"

    def __init__(self, ep: EPGroup, options: SymmOptions | None = None, *, comm_stream=None):
        options = SymmOptions() if options is None else options
        if not isinstance(options, SymmOptions):
            raise ValueError(f"SymmBackend options={options!r}: must be a SymmOptions")
        self.ep, self.comm_stream = ep, comm_stream
        self.kernels = triton_ok(ep.device, _WANT[options.kernels])
        if options.kernels == "triton" and not self.kernels:
            raise ValueError(f"SymmOptions.kernels='triton': Triton does not run on {ep.device} (pip install triton; "
                             f"on CPU also TRITON_INTERPRET=1)")
        mode = options.mode
        if mode == "auto" and (options.dense or options.signal == "flags" or not self.kernels):
            mode = "copy"       # otherwise "auto" stays, and each prepare chooses
        if mode == "kernel" and not self.kernels:
            raise ValueError(f"SymmOptions.mode='kernel' needs Triton on {ep.device} (pip install triton; on CPU "
                             f"also TRITON_INTERPRET=1 and kernels='triton'); mode='copy' runs without it")
        if options.signal == "flags" and not self.kernels:
            raise ValueError(f"SymmOptions.signal='flags' needs Triton (its waiter is a kernel), which does not run "
                             f"on {ep.device} here")
        self.options, self.mode = options, mode
        # the device-side fault status (``symm_tables``): overflow, bad ids, and the poison word that the exchanges'
        # waiters also set (with the peer they gave up on); its host copy is read without a sync
        self._status_dev = torch.zeros(STATUS_LEN, dtype=torch.long, device=ep.device)
        self._status_host = torch.zeros(STATUS_LEN, dtype=torch.long, device="cpu",
                                        pin_memory=st.is_accelerator(ep.device))
        peer = st.is_accelerator(ep.device) and ep.size > 1
        self.transport = (PeerTransport if peer else EmulatedTransport)(ep, options, comm_stream, self.kernels,
                                                                        self._status_dev)
        self._src_PC = torch.arange(ep.size * options.capacity, device=ep.device).view(ep.size, options.capacity)
        self._dense = DenseTables(options.capacity, ep.device)
        self._num_experts = 0

    @property
    def capacity(self) -> int:
        return self.options.capacity

    def memory_bytes(self) -> int:
        """Symmetric memory this rank holds for the backend (every buffer set allocated so far)."""
        return self.transport.heap.nbytes

    # ---------------------------------------------------------------- faults
    # A fault the device detects (a capacity overflow, an expert id out of range, a peer that never arrived)
    # sets the status's poison word, and from then on every combine's sum is NaN: no call returns a plausible
    # wrong result. The error itself reaches the host without a sync: the status is copied to pinned memory at
    # each prepare and raised at a later call's prepare (one or two calls later), or at once by ``check()``
    # (a host sync: under CUDA graphs, call it after a replay). Raising clears the status.

    def check(self) -> None:
        """Raise the first fault seen so far (capacity overflow, ids out of range, a missing peer), then clear it.

        HOST SYNC: waits for the comm stream, then reads the device status.
        """
        if self.comm_stream is not None:
            self.comm_stream.synchronize()
        elif st.is_accelerator(self.ep.device):
            st.accel_module(self.ep.device).synchronize(self.ep.device)
        self.transport.raise_watchdog()
        self._status_host.copy_(self._status_dev)
        self._raise_if_flagged()

    def _raise_if_flagged(self) -> None:
        # Reads pinned host memory that a prepare's non-blocking copy wrote: no CUDA call,
        # so it is safe on the hot path and during graph capture (the value may be a call or two old).
        s = self._status_host.tolist()
        if not (s[0] or s[5] or s[POISON]):
            return
        self._status_host.zero_()
        self._status_dev.zero_()
        if not (s[0] or s[5]):
            raise RuntimeError(
                f"symm backend: rank {self.ep.rank} gave up waiting for rank {s[POISON + 1]} (exchange call "
                f"{s[POISON + 2]}) after SymmOptions.timeout_ms={self.options.timeout_ms}: that rank stopped or fell "
                f"behind; the outputs since then were poisoned with NaN")
        if s[5]:
            raise ValueError(f"topk_ids out of range (rank {s[6]}: ids in [{s[7]}, {s[8]}]): "
                             f"expert ids must be in [0, {self._num_experts})")
        if s[2] < 0:
            raise RuntimeError(
                f"symm backend capacity overflow with WaveConfig.sends='once': rank {s[1]} sent {s[4]} rows to rank "
                f"{s[3]} over the layer's waves, which must fit one block of SymmOptions.capacity={self.capacity} "
                f"rows; set capacity >= {s[4]} (>= the tokens per rank always fits). That call's output (and any "
                f"since) was poisoned with NaN.")
        raise RuntimeError(
            f"symm backend capacity overflow in wave {s[2]}: rank {s[1]} sent {s[4]} rows to rank {s[3]}, "
            f"capacity is {self.capacity} rows per (wave, peer); set SymmOptions.capacity >= {s[4]} "
            f"(at most one row per token per (wave, peer), so >= the tokens per rank always fits). "
            f"The rows past the capacity were not sent: that call's output (and any since) was poisoned with NaN.")

    # ---------------------------------------------------------------- count exchange
    def prepare(self, layout: DispatchLayout, header=None, extra: torch.Tensor | None = None) -> SymmPlan:
        """Exchange counts and build the index tables (device-side). Dispatch the plan's waves before the
        next ``prepare``: its count writes are ordered behind the peers' reads by the wave barriers. ``header``
        (``moe_wave.comm.header``) travels with the counts and is checked on the host by the emulated transport (CPU
        ranks: ``HeaderMismatch`` on every rank before any row moves); on peer memory it is not checked (no host
        read there, see ``symm_transport.PeerTransport.exchange_counts``). ``extra``: None or A int64 words on the
        device that travel in this rank's count rows; every rank's come back in the plan's ``extra_PA``."""
        plan = layout.plan
        P, W, e, me = plan.num_ranks, plan.num_waves, plan.num_local_experts, self.ep.rank
        if P != self.ep.size:
            raise ValueError(f"WavePlan.num_ranks={P}: must equal the EP group size {self.ep.size}")
        self._num_experts = plan.num_experts
        self.transport.raise_watchdog()
        if st.is_accelerator(self.ep.device):
            self._raise_if_flagged()
        dev, C, T = layout.send_counts_WP.device, self.capacity, layout.num_tokens
        cur = st.current_stream(dev)
        K = layout.send_expert_SK.shape[1]
        if plan.once and self.transport.peer_memory and not self.kernels:
            raise ValueError(f"WaveConfig.sends='once' on {self.ep.device}: its combine is a Triton kernel (each row "
                             f"goes home after its last wave), and Triton does not run here; use sends='wave'")
        mode, dense = choose(self.options, self.mode, plan, K)
        static = self._dense.static(T, plan) if dense else None
        # dense blocks: the counts exchanged are the blocks' row counts (the wave's token range)
        counts = (static["counts_WP"] if dense else layout.send_counts_WP, layout.pair_counts_WPe,
                  layout.ids_min, layout.ids_max)
        with st.on(self.comm_stream):
            st.wait_stream(self.comm_stream, cur)
            A = 0 if extra is None else extra.numel()
            recv_PX = self.transport.exchange_counts(counts, W * P + W * e + A + 2, header, extra)
            slot_WTP = torch.full((W, T, P), -1, dtype=torch.long, device=dev) if self.kernels else None
            build = build_tables if self.kernels else build_tables_torch
            # the send side always from the sparse rows (dense blocks are derived from them below); the
            # receive side and the overflow status from the exchanged counts
            tabs = build(recv_PX, layout.send_counts_WP, layout.send_token_S, C, T, me, plan.num_experts,
                         slot_WTP, self._status_dev)
            if plan.once:   # a source's rows over the layer must fit one block (symm_once)
                flag_layer_overflow(recv_PX, W, P, C, self._status_dev)
            self._status_host.copy_(self._status_dev, non_blocking=True)
            meta_SM = torch.cat([layout.send_expert_SK, layout.send_weight_SK.view(torch.int32)], 1)
            extra = self._dense.densify(tabs, meta_SM, slot_WTP, static, K) if dense else {}
            recv_pairs_WPe = recv_PX[:, W * P:W * P + W * e].view(P, W, e).permute(1, 0, 2)
            recv_rows_WP = tabs["recv_counts_WP"].clamp(max=C)
            once = None
            if plan.once:
                once = once_tables(layout, recv_pairs_WPe, recv_rows_WP, tabs, slot_WTP, C)
            xplan = SymmPlan(layout=layout, recv_pairs_WPe=recv_pairs_WPe, capacity=C, meta_SM=meta_SM, mode=mode,
                             slot_WTP=slot_WTP, src_PC=self._src_PC, pairs_We=recv_pairs_WPe.sum(1),
                             recv_rows_WP=recv_rows_WP, once=once,
                             extra_PA=recv_PX[:, W * P + W * e:W * P + W * e + A] if A else None,
                             stale_WPC1=None if dense else (tabs["recv_dst_WPC"] < 0)[..., None],
                             **{**tabs, **extra})
            if dense:
                self.transport.write_own_meta(xplan, W, K)
        st.wait_stream(cur, self.comm_stream)
        for t in (recv_PX,) + xplan.tensors():
            st.keep_alive(t, cur)
        if not st.is_accelerator(dev):
            self._raise_if_flagged()  # CPU: the status is already on the host (eager error, all ranks alike)
        return xplan

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, x_TD: torch.Tensor, plan: SymmPlan, wave: int, *,
                 local_view: bool = False, combine_width: int | None = None) -> Pending[Received]:
        """See ``comm.backend``. ``local_view``: with dense blocks this rank's own rows are not copied into its
        receive block (on the GPU a same-device copy runs on the SMs, which a GEMM beside it holds):
        ``Received.local`` names them in x instead, and the caller's consumer must read them there.
        ``combine_width``: the width of the rows the combine sends back, where it differs from x's (packed rows)."""
        lay = plan.layout
        P, C = self.ep.size, plan.capacity
        K, D = lay.send_expert_SK.shape[1], x_TD.shape[1]
        if x_TD.shape[0] != lay.num_tokens:
            raise ValueError(f"x.shape[0]={x_TD.shape[0]}: must equal the layout's {lay.num_tokens} tokens")
        self.transport.raise_watchdog()
        bufs = self.transport.buffers(x_TD.dtype, D if combine_width is None else combine_width, plan.num_waves, K,
                                      D)
        dev, cur = x_TD.device, st.current_stream(x_TD.device)
        local = (self.ep.rank * C, wave_rows(x_TD, plan, wave)) if local_view and plan.dense is not None else None
        with st.on(self.comm_stream):
            st.wait_stream(self.comm_stream, cur)
            st.keep_alive(x_TD, self.comm_stream)
            works = self.transport.dispatch(x_TD, plan, bufs, wave, local is not None)
        handle = SymmHandle(wave, plan, bufs)

        def received() -> Received:
            if plan.once is not None:     # every block that has arrived (comm.symm_once)
                W = plan.num_waves
                meta_RM = bufs.recv_meta.view(W * P * C, 2 * K)
                return Received(x_RD=bufs.recv_x.view(W * P * C, D), expert_RK=meta_RM[:, :K],
                                weight_RK=meta_RM[:, K:].view(torch.float32), pairs_e=None,
                                pairs_e_dev=plan.once.pairs_We[wave], handle=handle, rows_P=plan.once.rows_WB[wave],
                                once=OnceRows(wave, W, plan.once.state))
            if local is not None:
                st.keep_alive(x_TD, st.current_stream(dev))
                self.transport.poison_local(bufs, wave)
            meta_RM = bufs.recv_meta[wave].view(P * C, 2 * K)    # stale rows were reset: views
            return Received(x_RD=bufs.recv_x[wave].view(P * C, D), expert_RK=meta_RM[:, :K],
                            weight_RK=meta_RM[:, K:].view(torch.float32), pairs_e=None,
                            pairs_e_dev=plan.pairs_We[wave], handle=handle, local=local,
                            rows_P=plan.recv_rows_WP[wave])

        return pending_after(f"dispatch[{wave}]", works, self.comm_stream, dev, received)

    # ---------------------------------------------------------------- combine
    def combine(self, y_RD: torch.Tensor, handle: SymmHandle, out: CombineOut) -> Pending[None]:
        """See ``comm.backend``."""
        total, works, dev = self._start_combine(y_RD, handle, out)
        return pending_after(f"combine[{handle.wave}]", works, self.comm_stream, dev, total)

    def combine_deferred(self, y_RD: torch.Tensor, handle: SymmHandle, out: CombineOut) -> Pending[Callable[[], None]]:
        """``combine`` without the sum: ``wait()`` makes the current stream wait for the rows to arrive and
        returns the sum as a function of no arguments, to run when and on the stream the caller chooses (the
        exchange itself does no SM work then, and the sum can join the op that consumes it). It reads this
        wave's ``comb`` block (and y, for this rank's own rows): run it before the next ``prepare``, on the
        stream that waited or one ordered after it."""
        total, works, dev = self._start_combine(y_RD, handle, out)
        return pending_after(f"combine[{handle.wave}]", works, self.comm_stream, dev, lambda: total)

    def _start_combine(self, y_RD: torch.Tensor, handle: SymmHandle, out: CombineOut):
        plan, wave, bufs = handle.plan, handle.wave, handle.bufs
        P, me, C = self.ep.size, self.ep.rank, plan.capacity
        D = bufs.comb.shape[-1]
        R = P * C * (plan.num_waves if plan.once is not None else 1)
        if y_RD.shape != (R, D) or y_RD.dtype != bufs.comb.dtype:
            raise ValueError(f"y: shape {tuple(y_RD.shape)} dtype {y_RD.dtype}: must be {(R, D)} "
                             f"{bufs.comb.dtype} (one row per received row)")
        self.transport.raise_watchdog()
        dev, cur = y_RD.device, st.current_stream(y_RD.device)
        # gather_add (Triton, fp32 out) reads this rank's own block from y: the transport need not move it there
        gather = self.kernels and out.out_TD.dtype == torch.float32
        poison = self._status_dev[POISON:POISON + 1]
        with st.on(self.comm_stream):
            st.wait_stream(self.comm_stream, cur)
            st.keep_alive(y_RD, self.comm_stream)
            y_RD = y_RD.contiguous()
            works = self.transport.combine(y_RD, plan, bufs, wave, own_from_y=gather)

        def total() -> None:
            if plan.once is not None:
                return self._once_total(y_RD, plan, bufs, wave, out, gather, poison)
            if gather:
                # one program per token (tile) sums its rows from every peer block in peer order (fp32, no
                # temporaries, no atomics): out[t] += sum_p comb[w, p, slot_p(t)] (+ add[t], into dst)
                st.keep_alive(y_RD, st.current_stream(dev))
                gather_add(out.out_TD, bufs.comb[wave].view(P * C, D), plan.slot_WTP[wave], y_RD, me,
                           accumulate=out.accumulate, add_TD=out.add_TD, dst_TD=out.dst_TD, poison=poison,
                           tune=self.options.copy)
                return
            N = plan.tok_WPN.shape[2]
            back_PND = torch.where((plan.send_dst_WPN[wave] >= 0)[..., None], bufs.comb[wave][:, :N].float(), 0.0)
            out.add_rows(zip(plan.tok_WPN[wave], back_PND))     # peer by peer: gather_add's order
            poison_rows(out.result, poison)

        return total, works, dev

    def _once_total(self, y_RD, plan: SymmPlan, bufs, wave: int, out: CombineOut, gather: bool, poison) -> None:
        """The sum of combine ``wave`` when rows cross once per layer: every token's rows whose last wave this is,
        from the flat comb (``comm.symm_once``), peers in order."""
        P, me, D = self.ep.size, self.ep.rank, y_RD.shape[1]
        dev = y_RD.device
        if gather:
            st.keep_alive(y_RD, st.current_stream(dev))
            gather_add(out.out_TD, bufs.comb.view(-1, D), plan.once.slot_WTP[wave], y_RD, me, accumulate=out.accumulate,
                       add_TD=out.add_TD, dst_TD=out.dst_TD, poison=poison, tune=self.options.copy)
            return
        N, last = plan.tok_WPN.shape[2], plan.once.last_WPN
        blocks = [(plan.tok_WPN[b, p], torch.where((last[b, p] == wave)[:, None], bufs.comb[b, p, :N].float(), 0.0))
                  for p in range(P) for b in range(wave + 1)]          # peers in order, as gather_add
        out.add_rows(blocks)
        poison_rows(out.result, poison)

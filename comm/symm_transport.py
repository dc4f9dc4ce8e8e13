"""How the ``symm`` backend's rows reach the peers: real peer memory, or an emulation of it.

Legend: T local tokens, K top-k, P ranks, W waves, C capacity rows per (wave, peer), N = min(C, T), D hidden,
M = 2K metadata int32 per row, X count words per rank.

Both transports have the same small interface, and the backend picks one at construction:

    exchange_counts(counts, X, header, extra) -> recv_PX   row src: what rank src sent this rank (``symm_tables``:
                                               its counts and its extra words); the emulation also checks the
                                               call header (``comm.header``) first
    write_own_meta(plan, W, K)                 dense blocks: this rank's own metadata block, at prepare
    dispatch(x_TD, plan, bufs, wave, local_view) -> works
    combine(y_RD, plan, bufs, wave, own_from_y) -> works
    raise_watchdog()                           the memops watchdog's error, if it fired

``works`` are handles whose ``wait()`` completes the exchange (the host waits on gloo); the caller then orders
its stream after the comm stream (``backend.pending_after``).

``PeerTransport`` (CUDA/ROCm, more than one rank) writes into the peers' symmetric-memory blocks:

- kernel mode: one Triton launch (``scatter_rows``) copies the wave's valid rows and their metadata into every
  peer's block, this rank's own included;
- copy mode, sparse blocks: the rows are packed locally (one ``scatter_rows`` launch with Triton, that writes
  this rank's own rows straight into place; ``index_select`` without it) and each peer's N-row block moves with
  one ``copy_`` (cudaMemcpyAsync: copy engines, no SMs);
- copy mode, dense blocks: no pack: x's rows are copied as they are, one cudaMemcpyAsync per peer; this rank's
  own rows are copied on a second stream, or not at all with ``local_view`` (a same-device copy runs on the SMs,
  which a GEMM beside it holds).

An exchange is closed by our barrier kernel (``BarrierSignal``) over the flag rows of the data allocation
(channel w for dispatch wave w, W + w for its combine; the count exchange has its own row), by completion flags written by the copy engines (``CopySignal``), or by stream memory operations
(``MemopSignal``, no SM; bounded by a watchdog). A waiter that gives up on a peer records it in the backend's
status and sets its poison word (the combine's sum is then NaN). Ordering: peers write into a block only after a barrier that
every rank reaches after it has finished reading that block, so wave w+1 travels while wave w is consumed, and
the next layer never overwrites rows still in use. Rows past a sparse block's count hold stale metadata: it is
reset in place (expert -1, weight 0) after the exchange, so the receiver hands out views.

``EmulatedTransport`` (CPU with gloo, or one rank) packs the very same blocks into a local staging buffer and
exchanges it with one equal-split ``all_to_all_single``, so the CPU tests exercise everything but the transport.
As on peer memory, this rank's own rows stay where they are when the consumer reads them there (``local_view``,
the combine's sum reading y): on one rank (a GPU with every expert) no row is copied at all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import streams as st
from . import symm_memops as memops
from .header import NUM_FIELDS, check_headers
from .header import encode as encode_header
from .options import SymmOptions
from .symm_heap import Buffers, LocalHeap, PeerHeap
from .symm_kernels import scatter_rows
from .symm_once import emulated_rows, home_targets, send_home
from .symm_plan import SymmPlan, wave_rows
from .symm_signal import BarrierSignal, CopySignal
from .symm_tables import POISON, count_rows, count_rows_torch
from .triton_gate import triton_ok

__all__ = ["PeerTransport", "EmulatedTransport", "pack_block"]


def pack_block(x_TD, plan: SymmPlan, wave: int, p: int, dst_x_CD, dst_m_CM, rows: bool = True) -> None:
    """The rows of block (wave, p) into a [C, D] / [C, M] destination (local, or p's block with dense blocks);
    sparse rows past the count get junk from valid rows, within the N-row block (masked by the receiver).
    ``rows=False`` (dense blocks): the metadata only."""
    N = plan.tok_WPN.shape[2]
    if plan.dense is not None:          # dense: the wave's token range as it is, and p's metadata rows
        if rows:
            x_rows = wave_rows(x_TD, plan, wave)
            dst_x_CD[:x_rows.shape[0]].copy_(x_rows, non_blocking=True)
        dst_m_CM.copy_(plan.meta_WPCM[wave, p], non_blocking=True)     # all C rows: none left stale
    elif N:
        torch.index_select(x_TD, 0, plan.tok_WPN[wave, p], out=dst_x_CD[:N])
        torch.index_select(plan.meta_SM, 0, plan.row_WPN[wave, p], out=dst_m_CM[:N])


def reset_stale(bufs: Buffers, plan: SymmPlan, wave: int, K: int) -> None:
    """Sparse blocks: rows past a source's count get expert -1, weight 0, in place (dense blocks send every row)."""
    if plan.dense is None:
        meta = bufs.recv_meta[wave]
        meta[..., :K].masked_fill_(plan.stale_WPC1[wave], -1)
        meta[..., K:].masked_fill_(plan.stale_WPC1[wave], 0)


def _scatter(x_TD, plan: SymmPlan, bufs: Buffers, wave: int, tune) -> None:
    """Kernel mode: every block's valid rows and their metadata into the wave's targets, one launch."""
    tx, tm, _ = bufs.targets[wave]
    scatter_rows(x_TD, tx, plan.tok_WPN[wave], plan.send_dst_WPN[wave], plan.meta_SM, tm, plan.row_WPN[wave],
                 tune=tune)


class PeerTransport:
    """Peer memory (see the module docstring)."""

    peer_memory = True

    def __init__(self, ep, options: SymmOptions, comm_stream, kernels: bool, status: torch.Tensor):
        if ep.pg is None or "nccl" not in ep.backend:
            raise ValueError(f"EPGroup.backend={ep.backend!r}: the symm backend on {ep.device} needs an NCCL group")
        if options.signal == "memops" and memops.available():
            raise ValueError(f"SymmOptions.signal='memops': {memops.available()}")
        self.ep, self.options, self.comm_stream, self.kernels = ep, options, comm_stream, kernels
        # where a waiter that gives up records it: [poison, peer, call] of the backend's status
        self.fault = status[POISON:POISON + 3]
        self.heap = PeerHeap(ep, options.capacity, options.timeout_ms, kernels)
        # Copy mode: the block for this rank itself is a local copy on a second stream, beside the peer
        # copies over NVLink instead of after them (kernel mode interleaves it in the one launch).
        self.local_stream = (st.accel_module(ep.device).Stream(device=ep.device, priority=-1)
                             if comm_stream is not None else None)
        self._others = [p for p in range(ep.size) if p != ep.rank]
        # the same as a device index (made here, outside any capture: a list index copies from the host)
        self._others_dev = torch.tensor(self._others, dtype=torch.long, device=ep.device)
        self._signals: dict = {}     # (buffers, channel) -> BarrierSignal / CopySignal / MemopSignal
        # our barrier kernel is Triton; without Triton on the device, torch's (bounded, but it does not name the peer)
        self._own_barrier = triton_ok(ep.device)

    # ------------------------------------------------------------------ setup and signals
    def meta(self, W: int, K: int) -> torch.Tensor:
        return self.heap.meta(W, K)[0]

    def buffers(self, dtype, D: int, W: int, K: int, Dx: int | None = None) -> Buffers:
        return self.heap.buffers(dtype, D, W, K, Dx)

    def write_own_meta(self, plan: SymmPlan, W: int, K: int) -> None:
        """Dense blocks: this rank's own metadata block, at prepare: the dispatch sends the peers' only."""
        me = self.ep.rank
        self.meta(W, K)[:, me].copy_(plan.meta_WPCM[:, me], non_blocking=True)

    def _signal(self, bufs: Buffers, channel: int, what: str):
        """The signal that closes one exchange channel. Made on first use (flags and memops: allocated,
        collectively), so that first use must come before any capture."""
        kind = self.options.signal
        key = (id(bufs), channel)
        if key not in self._signals:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"symm signal={kind!r}: run one dispatch and combine eagerly before capturing a "
                                   f"CUDA graph (the signal words are set up on first use, by every rank)")
            o = self.options
            if kind == "barrier":
                sig = (BarrierSignal(self.ep, [f[channel] for f in bufs.flags], o.timeout_ms, self.fault)
                       if self._own_barrier else _TorchBarrier(bufs.hdl, channel, o.timeout_ms))
            elif kind == "flags":
                sig = CopySignal(self.ep, self.heap.alloc, o.timeout_ms, self.fault)
            else:
                sig = memops.MemopSignal(self.ep, self.heap.alloc, timeout_ms=o.timeout_ms, grace_s=o.grace_s,
                                         name=what, fault=self.fault)
            self._signals[key] = sig
        return self._signals[key]

    def _exchange(self, bufs: Buffers, channel: int, what: str, push) -> None:
        """Open the channel's signal, ``push()`` the data, close it (the signal's wait)."""
        sig = self._signal(bufs, channel, what)
        sig.begin()     # flags and barrier: nothing; memops: the acknowledgements
        push()
        sig.end()

    def raise_watchdog(self) -> None:
        if self.options.signal == "memops" and self._signals:
            memops.watchdog().raise_if_fired()

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

    # ------------------------------------------------------------------ counts
    def exchange_counts(self, counts, X: int, header=None, extra=None) -> torch.Tensor:
        """[P, X]: one kernel (or a copy per peer) writes my row (``extra``: None or words added to it, see
        ``symm_tables``) into every peer's ctrl, then the count barrier (ours in every signal mode: a missing peer is
        named, and the layer's output poisoned).

        ``header`` (``comm.header``) is not checked here: the caller trusts that every rank makes the same call.
        Nothing is read on the host on this path (it is captured in CUDA graphs), and by the time a device-side
        comparison could flag a mismatch the dispatch's copies are already queued with sizes each rank took from
        its own arguments (the copy modes move whole blocks whose bytes the host chose; the buffers are allocated
        by a rendezvous each rank sizes alone): a device check could only report an overrun afterwards, not stop
        it. The torch backend checks the header on GPUs (its count exchange has a host sync)."""
        mine, targets, hdl, flags = self.heap.ctrl(X)
        key = ("counts", X)
        if key not in self._signals:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("symm backend: run one prepare eagerly before capturing a CUDA graph (the count "
                                   "exchange is set up on first use, by every rank)")
            t = self.options.timeout_ms
            self._signals[key] = (BarrierSignal(self.ep, flags, t, self.fault) if self._own_barrier
                                  else _TorchBarrier(hdl, 0, t))
        if self.kernels:
            count_rows(targets, *counts, extra=extra)
        else:
            send_PX = count_rows_torch(*counts, extra=extra)
            for p in range(self.ep.size):
                targets[p][self.ep.rank].copy_(send_PX[p])     # peer write over NVLink (copy engine)
        self._signals[key].end()
        return mine.clone()

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x_TD, plan: SymmPlan, bufs: Buffers, wave: int, local_view: bool) -> tuple:
        K = bufs.recv_meta.shape[3] // 2
        self._exchange(bufs, wave, f"dispatch wave {wave}", lambda: self._push_rows(x_TD, plan, bufs, wave, local_view))
        # after the close: copy mode's N-row blocks write the rows past the count too; the next writes into this
        # block come after the next prepare
        reset_stale(bufs, plan, wave, K)
        return ()

    def _push_rows(self, x_TD, plan: SymmPlan, bufs: Buffers, wave: int, local_view: bool) -> None:
        if plan.mode == "kernel":
            _scatter(x_TD, plan, bufs, wave, self.options.copy)
        elif plan.dense is not None:     # even with no rows: the metadata block is sent whole (no stale rows)
            self._push_dense(x_TD, plan, bufs, wave, local_view)
        elif plan.tok_WPN.shape[2] and self.kernels:
            self._push_packed(x_TD, plan, bufs, wave)
        elif plan.tok_WPN.shape[2]:
            self._push_gathered(x_TD, plan, bufs, wave)

    def _push_dense(self, x_TD, plan: SymmPlan, bufs: Buffers, wave: int, local_view: bool) -> None:
        """One cudaMemcpyAsync of x's rows and one of the metadata per peer (copy engines, no SMs). This rank's
        own metadata block was written by prepare; its own rows are copied on the local stream unless the caller
        reads them from x (``local_view``)."""
        me, loc = self.ep.rank, None
        if not local_view:
            loc = self._local_fork(x_TD)
            rows = wave_rows(x_TD, plan, wave)
            with st.on(loc):
                bufs.recv_x[wave, me, :rows.shape[0]].copy_(rows, non_blocking=True)
        for p in self._others:
            prx, prm, _ = bufs.peers[p]
            pack_block(x_TD, plan, wave, p, prx[wave, me], prm[wave, me])
        if loc is not None:
            st.wait_stream(self.comm_stream, loc)

    def _push_packed(self, x_TD, plan: SymmPlan, bufs: Buffers, wave: int) -> None:
        """One Triton launch packs every peer's valid rows (and metadata) into the local staging and this rank's
        own rows into place; then one cudaMemcpyAsync per peer block (copy engines, no SMs)."""
        me, N = self.ep.rank, plan.tok_WPN.shape[2]
        sx, sm, tx, tm = self.heap.pack_targets(bufs, wave)
        scatter_rows(x_TD, tx, plan.tok_WPN[wave], plan.send_dst_WPN[wave], plan.meta_SM, tm, plan.row_WPN[wave],
                     tune=self.options.copy)
        for p in self._others:
            prx, prm, _ = bufs.peers[p]
            prx[wave, me, :N].copy_(sx[p, :N], non_blocking=True)
            prm[wave, me, :N].copy_(sm[p, :N], non_blocking=True)

    def _push_gathered(self, x_TD, plan: SymmPlan, bufs: Buffers, wave: int) -> None:
        """Without Triton: gather the peers' rows (one index_select), one cudaMemcpyAsync per peer block; the local
        block is gathered straight into place on the local stream."""
        me, N = self.ep.rank, plan.tok_WPN.shape[2]
        loc = self._local_fork(x_TD)
        rx, rm, _ = bufs.peers[me]
        with st.on(loc):
            pack_block(x_TD, plan, wave, me, rx[wave, me], rm[wave, me])
        rows = plan.tok_WPN[wave].index_select(0, self._others_dev).reshape(-1)
        stage_x = x_TD.index_select(0, rows).view(-1, N, x_TD.shape[1])
        stage_m = plan.meta_SM.index_select(0, plan.row_WPN[wave].index_select(0, self._others_dev).reshape(-1)).view(
            -1, N, plan.meta_SM.shape[1])
        for i, p in enumerate(self._others):
            prx, prm, _ = bufs.peers[p]
            prx[wave, me, :N].copy_(stage_x[i], non_blocking=True)
            prm[wave, me, :N].copy_(stage_m[i], non_blocking=True)
        if loc is not None:
            st.wait_stream(self.comm_stream, loc)

    def poison_local(self, bufs: Buffers, wave: int) -> None:
        """Nothing to do: on peer memory this rank's own block is simply not written with ``local_view``."""

    # ------------------------------------------------------------------ combine
    def combine(self, y_RD, plan: SymmPlan, bufs: Buffers, wave: int, own_from_y: bool) -> tuple:
        """Results go back into each source's ``comb[w, me]`` (kernel mode: valid rows only, one launch; copy mode:
        the whole C-row block per peer). ``own_from_y``: this rank's own block is not copied (the sum reads it
        from y)."""
        W, me, C = plan.num_waves, self.ep.rank, plan.capacity

        def push() -> None:
            if plan.once is not None:      # the rows whose last wave this is, from every arrived block
                send_home(y_RD, plan, bufs, wave, home_targets(bufs, [pb[2] for pb in bufs.peers], me),
                          me if own_from_y else None, self.options.copy)
                return
            if plan.mode == "kernel":
                scatter_rows(y_RD, bufs.targets[wave][2], plan.src_PC, plan.recv_dst_WPC[wave],
                             skip=me if own_from_y else None, tune=self.options.copy)
                return
            loc = None if own_from_y else self._local_fork(y_RD)
            for s, (_, _, cb) in enumerate(bufs.peers):
                if s == me and own_from_y:
                    continue
                with st.on(loc if s == me else self.comm_stream):
                    cb[wave, me].copy_(y_RD[s * C:(s + 1) * C], non_blocking=True)
            if loc is not None:
                st.wait_stream(self.comm_stream, loc)

        self._exchange(bufs, W + wave, f"combine wave {wave}", push)
        return ()


class _TorchBarrier:
    """torch's symmetric-memory barrier kernel on one channel of a handle's signal pad: where Triton does not run.
    It traps after ``timeout_ms`` (a CUDA error that ends the rank) without naming the peer."""

    def __init__(self, hdl, channel: int, timeout_ms: int):
        self.hdl, self.channel, self.timeout_ms = hdl, channel, timeout_ms

    def begin(self) -> None:
        """Nothing before the data."""

    def end(self) -> None:
        self.hdl.barrier(channel=self.channel, timeout_ms=self.timeout_ms)


class _Then:
    """A work whose ``wait()`` waits for others, then runs ``then()`` (the emulated transport's stale reset)."""

    def __init__(self, works, then):
        self.works, self.then = works, then

    def wait(self) -> None:
        for wk in self.works:
            wk.wait()
        self.then()


class EmulatedTransport:
    """Local staging plus ``all_to_all_single`` (see the module docstring)."""

    peer_memory = False

    def __init__(self, ep, options: SymmOptions, comm_stream, kernels: bool, status: torch.Tensor):
        self.ep, self.options, self.comm_stream, self.kernels = ep, options, comm_stream, kernels
        self.heap = LocalHeap(ep, options.capacity, kernels)

    def meta(self, W: int, K: int) -> torch.Tensor:
        return self.heap.meta(W, K)[0]

    def buffers(self, dtype, D: int, W: int, K: int, Dx: int | None = None) -> Buffers:
        return self.heap.buffers(dtype, D, W, K, Dx)

    def write_own_meta(self, plan: SymmPlan, W: int, K: int) -> None:
        """Nothing to do: the staging carries this rank's own block with the others."""

    def raise_watchdog(self) -> None:
        """No watchdog: gloo's timeout bounds every wait."""

    def exchange_counts(self, counts, X: int, header=None, extra=None) -> torch.Tensor:
        """[P, X] as ``PeerTransport.exchange_counts``. First the call header (``comm.header``; None: zeros) and X,
        in an all-to-all of the same width on every rank, checked on the host before the counts move (X depends on
        the caller's arguments, e.g. the number of experts, and gloo aborts an all-to-all whose sizes differ): with
        more than one rank this transport runs on CPU (gloo, where the all-to-all has already waited for every
        rank), so the check reads no device and adds no sync. A mismatch is the same ``HeaderMismatch`` on every
        rank. Then the counts, in a second all-to-all."""
        send_PX = count_rows_torch(*counts, extra=extra)
        P = self.ep.size
        if P == 1:
            return send_PX
        head = torch.tensor(encode_header(header) + [X], dtype=send_PX.dtype, device=send_PX.device)
        got = torch.empty(P, NUM_FIELDS + 1, dtype=send_PX.dtype, device=send_PX.device)
        dist.all_to_all_single(got, head.expand(P, -1).contiguous(), group=self.ep.pg)
        rows = got.tolist()
        check_headers([r[:NUM_FIELDS] for r in rows], [r[NUM_FIELDS] for r in rows])
        recv = torch.empty_like(send_PX)
        dist.all_to_all_single(recv, send_PX, group=self.ep.pg)
        return recv

    def dispatch(self, x_TD, plan: SymmPlan, bufs: Buffers, wave: int, local_view: bool) -> tuple:
        P, C, D, K = self.ep.size, plan.capacity, x_TD.shape[1], bufs.recv_meta.shape[3] // 2
        stage_x, stage_m = bufs.stage[0][wave], bufs.stage[1][wave]
        if plan.mode == "kernel":
            _scatter(x_TD, plan, bufs, wave, self.options.copy)
        else:       # with local_view the consumer reads this rank's own rows in x: only their metadata is staged
            for p in range(P):
                own = local_view and p == self.ep.rank
                pack_block(x_TD, plan, wave, p, stage_x[p], stage_m[p], rows=not own)
        works = ()
        if P > 1:
            works = (dist.all_to_all_single(bufs.recv_x[wave].view(P * C, D), stage_x.view(P * C, D),
                                            group=self.ep.pg, async_op=True),
                     dist.all_to_all_single(bufs.recv_meta[wave].view(P * C, 2 * K), stage_m.view(P * C, 2 * K),
                                            group=self.ep.pg, async_op=True))
        return (_Then(works, lambda: reset_stale(bufs, plan, wave, K)),)

    def poison_local(self, bufs: Buffers, wave: int) -> None:
        """``local_view`` on CPU: the rows the GPU would not copy are NaN, so a consumer that reads them instead of
        ``Received.local`` fails the tests."""
        if not st.is_accelerator(bufs.recv_x.device):
            bufs.recv_x[wave, self.ep.rank].fill_(float("nan"))

    def combine(self, y_RD, plan: SymmPlan, bufs: Buffers, wave: int, own_from_y: bool) -> tuple:
        """``own_from_y``: the sum reads this rank's own block from y. One rank: nothing moves then; more (CPU):
        the all-to-all still carries every block, and this rank's own block of ``comb`` is NaN once it lands, so a
        sum that read it instead of y would fail the tests (as ``poison_local`` does for the dispatch)."""
        P, C, D, me = self.ep.size, plan.capacity, y_RD.shape[1], self.ep.rank
        if P == 1 and own_from_y:
            return ()
        poison = own_from_y and not st.is_accelerator(y_RD.device)
        if plan.once is not None:          # y holds every block: [W, P(src), C, D] -> [P(dst), b <= wave, C, D]
            if P == 1 and self.kernels:      # one rank: the rows whose last wave this is, as peer memory does
                send_home(y_RD, plan, bufs, wave, home_targets(bufs, [bufs.comb], 0), None, self.options.copy)
                return ()
            send = y_RD.view(plan.num_waves, P, C, D)[:wave + 1].transpose(0, 1)
            if P == 1:
                emulated_rows(bufs.comb, send, plan.once.last_WPN, wave)
                return ()
            send = send.contiguous()
            back = torch.empty_like(send)
            works = (dist.all_to_all_single(back.view(-1, D), send.view(-1, D), group=self.ep.pg, async_op=True),)

            def land(back=back, send=send) -> None:     # (both referenced until the exchange is waited for)
                emulated_rows(bufs.comb, back, plan.once.last_WPN, wave)
                if poison:
                    bufs.comb[:wave + 1, me].fill_(float("nan"))

            return (_Then(works, land),)
        if P == 1:
            bufs.comb[wave].view(C, D).copy_(y_RD)
            return ()
        works = (dist.all_to_all_single(bufs.comb[wave].view(P * C, D), y_RD, group=self.ep.pg, async_op=True),)
        if not poison:
            return works
        return (_Then(works, lambda: bufs.comb[wave, me].fill_(float("nan"))),)

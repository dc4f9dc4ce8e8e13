"""The ``torch`` backend: torch.distributed ``all_to_all_single`` with explicit splits.

Legend: T local tokens, K top-k, P ranks, W waves, e local experts, S sent rows, R received rows,
D hidden.

NCCL/RCCL on GPU, gloo on CPU. Splits live on the host, so ``prepare`` holds the one host sync of
the layer: after the count exchange it copies every count (and the topk_ids range, for validation)
to the host in a single transfer. The count exchange carries the call header (``moe_wave.comm.header``), checked
there before any row moves. Rows travel with their routing metadata (K local expert ids, then K fp32 weights, 8K bytes)
bit-cast into extra columns of the row, so a wave is one collective each way.
On GPU every collective is issued from the comm stream (its NCCL kernels then run on the process
group's stream in issue order: dispatch(0) dispatch(1) combine(0) dispatch(2) ...), and ``wait``
makes the caller's current stream wait. On gloo the collectives run on the group's worker threads
while the caller computes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import streams as st
from dataclasses import dataclass

from .backend import CombineOut, ExchangePlan, Pending, Received, WaveHandle, pending_after, refuse_once
from .group import EPGroup
from .header import NUM_FIELDS, CallHeader, check_headers
from .layout import DispatchLayout

__all__ = ["TorchBackend", "TorchPlan", "TorchHandle"]


@dataclass(frozen=True)
class TorchPlan(ExchangePlan):
    """The plan with the host splits that ``all_to_all_single`` needs.

    Attributes:
        send_counts: [W][P] rows sent per wave and peer (host ints).
        recv_counts: [W][P] rows received per wave and source peer (host ints).
        recv_pairs: [W][e] (token, k) pairs received per wave and local expert (host ints).
        send_offsets: [W+1] start of each wave's rows in the layout's send order (host ints).
        meta_SM: [S, 2K] int32 every send row's K local expert ids and K fp32 weights (bit-cast).
    """

    send_counts: list
    recv_counts: list
    recv_pairs: list
    send_offsets: list
    meta_SM: torch.Tensor


@dataclass(frozen=True)
class TorchHandle(WaveHandle):
    """One wave's combine state: the token of each row this rank sent (send order)."""

    send_token_S: torch.Tensor


def _a2a(out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, pg):
    return dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                  group=pg, async_op=True)


class TorchBackend:
    """Dispatch/combine over torch.distributed. One instance per (EPGroup, device); reusable.

    Args:
        ep: the expert-parallel group.
        comm_stream: the stream collectives are issued from (GPU); None on CPU.
    """

    name = "torch"

    def __init__(self, ep: EPGroup, comm_stream=None):
        self.ep = ep
        self.comm_stream = comm_stream

    # ---------------------------------------------------------------- count exchange
    def prepare(self, layout: DispatchLayout, header: CallHeader | None = None) -> TorchPlan:
        """The count exchange, with ``header`` (``moe_wave.comm.header``; None: zeros) in its first columns: every
        rank checks every rank's header on the host before any row moves (``HeaderMismatch`` on every rank)."""
        plan = layout.plan
        P, W, e = plan.num_ranks, plan.num_waves, plan.num_local_experts
        if P != self.ep.size:
            raise ValueError(f"WavePlan.num_ranks={P}: must equal the EP group size {self.ep.size}")
        refuse_once(layout, self.name)
        dev = layout.send_counts_WP.device
        # Per destination peer: [rows(w), pairs(w, 0..e-1)] for every wave, then this rank's id range.
        per_peer = torch.cat([layout.send_counts_WP.t().unsqueeze(-1),            # [P, W, 1]
                              layout.pair_counts_WPe.permute(1, 0, 2)], -1)        # [P, W, e]
        rng = torch.stack([layout.ids_min, layout.ids_max]).to(dev)
        head = torch.tensor(header.encode() if header is not None else [0] * NUM_FIELDS, dtype=rng.dtype)
        if dev.type != "cpu":   # pinned and non_blocking: the header adds no host sync of its own
            head = head.pin_memory().to(dev, non_blocking=True)
        send_PX = torch.cat([head.expand(P, NUM_FIELDS), per_peer.reshape(P, -1), rng.expand(P, 2)], 1).contiguous()
        if P == 1:
            recv_PX = send_PX
        else:
            recv_PX = torch.empty_like(send_PX)
            cur = st.current_stream(dev)        # looked up outside the comm-stream context
            with st.on(self.comm_stream):
                st.wait_stream(self.comm_stream, cur)
                dist.all_to_all_single(recv_PX, send_PX, group=self.ep.pg)
            st.wait_stream(cur, self.comm_stream)
        # HOST SYNC (the only one of the layer on this backend): splits must be host ints.
        host = torch.stack([send_PX, recv_PX]).cpu()
        check_headers(host[1, :, :NUM_FIELDS].tolist())     # before the range: a desync explains a bad range
        send_h, recv_h = host[0, :, NUM_FIELDS:], host[1, :, NUM_FIELDS:]
        self._check_range(recv_h[:, -2:], plan.num_experts)
        send_WP1e = send_h[:, :-2].view(P, W, 1 + e).permute(1, 0, 2)   # [W, P, 1+e]
        recv_WP1e = recv_h[:, :-2].view(P, W, 1 + e).permute(1, 0, 2)   # [W, P(src), 1+e]
        send_counts = send_WP1e[..., 0].tolist()
        recv_counts = recv_WP1e[..., 0].tolist()
        recv_pairs = recv_WP1e[..., 1:].sum(1).tolist()                   # [W][e]
        offs = [0]
        for w in range(W):
            offs.append(offs[-1] + sum(send_counts[w]))
        recv_dev = recv_PX[:, NUM_FIELDS:-2].view(P, W, 1 + e).permute(1, 0, 2)
        # Every wave's routing metadata in one kernel: [S, 2K] int32 (K local ids, K fp32 weights).
        meta_SM = torch.cat([layout.send_expert_SK, layout.send_weight_SK.view(torch.int32)], 1)
        return TorchPlan(layout=layout, recv_counts_WP=recv_dev[..., 0], recv_pairs_WPe=recv_dev[..., 1:],
                         send_counts=send_counts, recv_counts=recv_counts, recv_pairs=recv_pairs,
                         send_offsets=offs, meta_SM=meta_SM)

    def _check_range(self, rng_P2: torch.Tensor, num_experts: int) -> None:
        # Every rank sees every rank's id range, so all of them raise the same error (no hang).
        bad = [(r, int(lo), int(hi)) for r, (lo, hi) in enumerate(rng_P2.tolist())
               if lo < 0 or hi >= num_experts]
        if bad:
            desc = "; ".join(f"rank {r}: ids in [{lo}, {hi}]" for r, lo, hi in bad)
            raise ValueError(f"topk_ids out of range ({desc}): expert ids must be in [0, {num_experts})")

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, x_TD: torch.Tensor, plan: TorchPlan, wave: int, *,
                 local_view: bool = False, combine_width: int | None = None) -> Pending[Received]:
        lay = plan.layout
        K = lay.send_expert_SK.shape[1]
        lo, hi = plan.send_offsets[wave], plan.send_offsets[wave + 1]
        send_counts, recv_counts = plan.send_counts[wave], plan.recv_counts[wave]
        R = sum(recv_counts)
        dev, cur = x_TD.device, st.current_stream(x_TD.device)
        tok_S = lay.send_token_S[lo:hi]
        D = x_TD.shape[1]
        with st.on(self.comm_stream):
            st.wait_stream(self.comm_stream, cur)
            # One collective per wave: each row carries its K local expert ids and K fp32 weights
            # (8K bytes) bit-cast into extra columns of x's dtype.
            send = torch.cat([x_TD.index_select(0, tok_S), plan.meta_SM[lo:hi].view(x_TD.dtype)], 1)
            if self.ep.size == 1:
                recv, works = send, ()
            else:
                recv = torch.empty(R, send.shape[1], dtype=x_TD.dtype, device=dev)
                works = (_a2a(recv, send, recv_counts, send_counts, self.ep.pg),)
        pairs = plan.recv_pairs[wave]
        pairs_dev = plan.recv_pairs_WPe[wave].sum(0)
        handle = TorchHandle(wave=wave, plan=plan, send_token_S=tok_S)

        def received() -> Received:
            st.keep_alive(recv, st.current_stream(dev))
            recv_m = recv[:, D:].contiguous().view(torch.int32)          # [R, 2K]
            return Received(x_RD=recv[:, :D], expert_RK=recv_m[:, :K], weight_RK=recv_m[:, K:].view(torch.float32),
                            pairs_e=pairs, pairs_e_dev=pairs_dev, handle=handle)

        return pending_after(f"dispatch[{wave}]", works, self.comm_stream, dev, received)

    # ---------------------------------------------------------------- combine
    def combine(self, y_RD: torch.Tensor, handle: TorchHandle, out: CombineOut) -> Pending[None]:
        plan, wave = handle.plan, handle.wave
        send_counts, recv_counts = plan.send_counts[wave], plan.recv_counts[wave]
        dev, cur = y_RD.device, st.current_stream(y_RD.device)
        with st.on(self.comm_stream):
            st.wait_stream(self.comm_stream, cur)
            st.keep_alive(y_RD, self.comm_stream)
            if self.ep.size == 1:
                back_SD, works = y_RD, ()
            else:
                back_SD = torch.empty(sum(send_counts), y_RD.shape[1], dtype=y_RD.dtype, device=dev)
                works = (_a2a(back_SD, y_RD.contiguous(), send_counts, recv_counts, self.ep.pg),)

        def total() -> None:
            st.keep_alive(back_SD, st.current_stream(dev))
            # peer by peer (each token at most once per peer): a fixed summation order
            out.add_rows(zip(handle.send_token_S.split(send_counts), back_SD.split(send_counts)))

        return pending_after(f"combine[{wave}]", works, self.comm_stream, dev, total)

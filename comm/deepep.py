"""The ``deepep`` backend: DeepEP's intranode/internode normal kernels (``deep_ep.Buffer``, V1 API).

Legend: T local tokens, K top-k, P ranks, W waves, e local experts, E = P*e experts, S send rows,
R received rows, D hidden.

Targets DeepEP V1 (github.com/deepseek-ai/DeepEP ``deep_ep/buffer.py``, releases 1.0-1.2 and the
main branch of 2025): ``Buffer(group, num_nvl_bytes, num_rdma_bytes)``, ``Buffer.get_dispatch_config``
/ ``get_combine_config``, ``Config.get_nvl_buffer_size_hint``, ``get_dispatch_layout(topk_idx,
num_experts, previous_event, async_finish, allocate_on_comm_stream)``, ``dispatch(x, num_tokens_per_rank=,
is_token_in_rank=, num_tokens_per_expert=, topk_idx=, topk_weights=, ...)`` returning ``(recv_x,
recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)`` and
``combine(x, handle, ...)`` returning ``(combined_x, combined_topk_weights, event)``. DeepEP V2 and
the low-latency kernels (a different, expert-major receive layout) are not wrapped here.

Waves: DeepEP routes by ``topk_idx`` with -1 meaning "no selection", so wave w dispatches the
router's top-k with every expert outside wave w masked to -1 (reconstructed on the device from the
layout: ``prepare`` needs no host sync of its own). DeepEP's normal dispatch itself waits on the
host for the receive counts (a host sync inside DeepEP, per wave), so this backend is not CUDA-graph
capturable; use ``symm`` for graphs. Combine sums each token's rows over the ranks (bf16), and
``out_TD`` accumulates that in fp32. DeepEP runs on its own communication stream; ``previous_event``
/ ``async_finish`` order it against the caller's stream.

Ranks out of step: the call header (``comm.header``) is accepted and not checked. This backend has no count
exchange of its own: DeepEP's dispatch exchanges its counts inside its kernels and waits for them on the host
there, and nothing of ours can ride that exchange. What is checked: ``prepare`` checks this rank's plan (the
group size, sends per wave, DeepEP's limit on experts per rank), ``dispatch`` x's dtype, and the settings that
must agree across ranks (hidden size, waves, experts, overlap default) are compared when a ``WaveMoE`` is built.
A per-call desync (a per-call ``overlap`` that differs by rank, a call one rank skipped) reaches DeepEP unchecked;
run the same calls on the ``torch`` backend, which checks the header before any row moves, to find it.

Install: https://github.com/deepseek-ai/DeepEP (needs NVSHMEM for internode; intranode needs NVLink).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import CombineOut, ExchangePlan, Pending, Received, WaveHandle, refuse_once
from .group import EPGroup
from .layout import DispatchLayout

__all__ = ["DeepEPBackend", "DeepEPPlan", "DeepEPHandle", "import_deep_ep", "wave_topk"]

# DeepEP V1's intranode kernels assert num_experts / num_ranks <= 128 (the V4-Pro layout at EP2 has 192).
MAX_LOCAL_EXPERTS = 128


@dataclass(frozen=True)
class DeepEPPlan(ExchangePlan):
    """The plan plus each wave's masked top-k (``wave_topk``); DeepEP exchanges its own counts."""

    ids_WTK: torch.Tensor
    w_WTK: torch.Tensor


@dataclass(frozen=True)
class DeepEPHandle(WaveHandle):
    """One wave's combine state: DeepEP's own dispatch handle."""

    deep_ep: object


def import_deep_ep():
    try:
        import deep_ep
    except ImportError as e:
        raise ImportError("WaveConfig(backend='deepep') needs DeepEP: build and pip install it from "
                          "https://github.com/deepseek-ai/DeepEP (pip install . in its checkout), or use "
                          "backend='symm' / 'torch'") from e
    return deep_ep


def wave_topk(layout: DispatchLayout):
    """Per wave the router's top-k with the slots outside the wave set to -1, rebuilt on the device.

    Returns:
        ids_WTK: [W, T, K] int64 global expert ids or -1.
        w_WTK: [W, T, K] float32 weights (0 where the id is -1).
    """
    plan, lay = layout.plan, layout
    W, P, e, T = plan.num_waves, plan.num_ranks, plan.num_local_experts, lay.num_tokens
    S, K = lay.send_expert_SK.shape
    dev = lay.send_expert_SK.device
    ends = torch.cumsum(lay.send_counts_WP.reshape(-1), 0)
    cell_S = torch.searchsorted(ends, torch.arange(S, device=dev), right=True)
    valid_S = cell_S < W * P
    cell_S = cell_S.clamp(max=W * P - 1)
    ex_SK = lay.send_expert_SK.long()
    ok_SK = valid_S[:, None] & (ex_SK >= 0)
    glob_SK = (cell_S % P)[:, None] * e + ex_SK
    flat_SK = ((cell_S // P)[:, None] * T + lay.send_token_S[:, None]) * K + torch.arange(K, device=dev)
    flat_SK = torch.where(ok_SK, flat_SK, W * T * K).reshape(-1)          # misses go to a dump slot
    ids = torch.full((W * T * K + 1,), -1, dtype=torch.long, device=dev).scatter_(0, flat_SK, glob_SK.reshape(-1))
    wts = torch.zeros(W * T * K + 1, dtype=torch.float32, device=dev).scatter_(
        0, flat_SK, lay.send_weight_SK.reshape(-1))
    return ids[:-1].view(W, T, K), wts[:-1].view(W, T, K)


class DeepEPBackend:
    """Dispatch/combine through ``deep_ep.Buffer`` (V1 normal kernels), one DeepEP dispatch per wave.

    Args:
        ep: the expert-parallel group (NCCL).
        hidden_size: D, which sizes the NVLink buffer (bf16 rows).
        comm_stream: unused: DeepEP owns its communication stream.
        num_sms: SMs DeepEP's kernels may take (``Buffer.set_num_sms``); None keeps DeepEP's default.
    """

    name = "deepep"

    def __init__(self, ep: EPGroup, *, hidden_size: int, comm_stream=None, num_sms: int | None = None):
        if ep.pg is None or not ep.device.type == "cuda":
            raise ValueError(f"EPGroup(device={ep.device}, backend={ep.backend!r}): DeepEP needs CUDA ranks and "
                             "a process group")
        self.deep_ep = import_deep_ep()
        self.ep = ep
        Buffer = self.deep_ep.Buffer
        if num_sms is not None:
            Buffer.set_num_sms(num_sms)
        hidden_bytes = hidden_size * 2   # bf16 rows
        nvl = 0
        for c in (Buffer.get_dispatch_config(ep.size), Buffer.get_combine_config(ep.size)):
            nvl = max(nvl, c.get_nvl_buffer_size_hint(hidden_bytes, ep.size))
        self.buffer = Buffer(ep.pg, nvl, 0)

    def prepare(self, layout: DispatchLayout, header=None) -> DeepEPPlan:
        """The layout per wave (DeepEP exchanges counts inside each dispatch); ``header`` is not checked here (see
        the module docstring)."""
        plan = layout.plan
        if plan.num_ranks != self.ep.size:
            raise ValueError(f"WavePlan.num_ranks={plan.num_ranks}: must equal the EP group size {self.ep.size}")
        refuse_once(layout, self.name)
        if plan.num_local_experts > MAX_LOCAL_EXPERTS:
            raise ValueError(f"num_experts / num_ranks = {plan.num_local_experts}: DeepEP V1 supports at most "
                             f"{MAX_LOCAL_EXPERTS} experts per rank; use more ranks or backend='symm' / 'torch'")
        ids_WTK, w_WTK = wave_topk(layout)
        # DeepEP exchanges its own counts inside each dispatch: the device count fields stay zero.
        W, P, e = plan.num_waves, plan.num_ranks, plan.num_local_experts
        zeros = torch.zeros(W, P, dtype=torch.long, device=ids_WTK.device)
        return DeepEPPlan(layout=layout, recv_counts_WP=zeros, recv_pairs_WPe=zeros[..., None].expand(W, P, e),
                          ids_WTK=ids_WTK, w_WTK=w_WTK)

    def dispatch(self, x_TD: torch.Tensor, plan: DeepEPPlan, wave: int, *,
                 local_view: bool = False, combine_width: int | None = None) -> Pending[Received]:
        if x_TD.dtype != torch.bfloat16:
            raise ValueError(f"x.dtype={x_TD.dtype}: the deepep backend moves bfloat16 rows")
        # combine_width: DeepEP's combine takes any width (its buffer is sized for the hidden size, which packed
        # rows do not exceed)
        ids_TK, w_TK = plan.ids_WTK[wave], plan.w_WTK[wave]
        E = plan.layout.plan.num_experts
        buf, Buffer = self.buffer, self.deep_ep.Buffer
        n_rank, n_rdma, n_exp, in_rank, ev = buf.get_dispatch_layout(
            ids_TK, E, previous_event=Buffer.capture(), async_finish=True, allocate_on_comm_stream=True)
        # HOST SYNC inside DeepEP: its normal dispatch waits on the CPU for the receive counts.
        recv_x, recv_ids, recv_w, counts_e, dhandle, event = buf.dispatch(
            x_TD, num_tokens_per_rank=n_rank, num_tokens_per_rdma_rank=n_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=n_exp, topk_idx=ids_TK, topk_weights=w_TK, previous_event=ev,
            async_finish=True, allocate_on_comm_stream=True)
        handle = DeepEPHandle(wave=wave, plan=plan, deep_ep=dhandle)

        def finish() -> Received:
            event.current_stream_wait()
            return Received(x_RD=recv_x, expert_RK=recv_ids.to(torch.int32), weight_RK=recv_w.float(),
                            pairs_e=list(counts_e), pairs_e_dev=torch.tensor(counts_e, device=recv_x.device),
                            handle=handle)

        return Pending(finish, f"deepep.dispatch[{wave}]")

    def combine(self, y_RD: torch.Tensor, handle: DeepEPHandle, out: CombineOut) -> Pending[None]:
        combined_TD, _, event = self.buffer.combine(
            y_RD.to(torch.bfloat16).contiguous(), handle.deep_ep, previous_event=self.deep_ep.Buffer.capture(),
            async_finish=True, allocate_on_comm_stream=True)

        def finish() -> None:    # DeepEP's combine has summed each token's rows already (on its SMs)
            event.current_stream_wait()
            if out.accumulate:
                out.out_TD.add_(combined_TD.to(out.out_TD.dtype))   # in place: out_TD is the caller's
            else:
                out.out_TD.copy_(combined_TD)
            out.finish_sum()

        return Pending(finish, f"deepep.combine[{handle.wave}]")

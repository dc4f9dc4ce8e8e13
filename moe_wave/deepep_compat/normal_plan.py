"""Normal mode's direct kernels, host side: one rank's symmetric memory and device words (``NormalState``), one
routing's tables (``DirectPlan``, ``make_plan``) and the torch form of the layout. The kernels and their launches
are in ``normal_kernels`` (its docstring describes the regions, flags and acks these tables feed).

Legend: T local tokens, P ranks, me this rank, K top-k, E experts, X received rows (compact), Xc the region
capacity (rows, the same on every rank), nch channels.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moe_wave.comm.triton_gate import sm_count

__all__ = ["NormalState", "DirectPlan", "make_plan", "clip_plan", "channel_counts", "send_heads", "layout_torch",
           "NCH_MAX", "DEFAULT_CHANNELS", "DEFAULT_ROWS", "device_sms"]

NCH_MAX = 64                # channels at most (flag slots per source)
DEFAULT_CHANNELS = 32
DEFAULT_ROWS = 8


def device_sms(device: torch.device) -> int:
    """Programs a launch may keep resident: the SM count on CUDA, unbounded elsewhere."""
    return sm_count(device) if device.type == "cuda" else 1 << 20


class NormalState:
    """One rank's symmetric memory and device words for the direct kernels (see the module docstring).

    Args:
        me, P: this rank, the ranks.
        device: where the words live.
        alloc: ``alloc(nbytes) -> [P] uint8 tensors`` (rank p's buffer of one new allocation, zeroed, every rank
            past a barrier after the zeroing): collective, every rank calls it in the same order, outside any
            CUDA-graph capture. The GPU path passes ``symm_alloc(ep)``; the tests share CPU tensors.
        timeout_ms: how long a wait for a peer lasts before it is recorded as a fault.
        sms: programs at most per launch (default: the device's SM count).
        fast_launch: relaunch compiled kernels without Triton's JIT dispatch (``triton_launch.Launcher``).
    """

    def __init__(self, me: int, P: int, device, alloc, timeout_ms: int = 120_000, sms: int | None = None,
                 fast_launch: bool = True):
        self.me, self.P, self.device, self.alloc = me, P, torch.device(device), alloc
        self.fast_launch = bool(fast_launch)
        self.timeout_ms = int(timeout_ms)
        self.sms = sms or device_sms(self.device)
        self.kind_words = P * NCH_MAX + P
        views = [v.view(torch.int64) for v in alloc(2 * self.kind_words * 8)]
        self.ctrl = views[me]
        self.ctrl_comb = self.ctrl[self.kind_words:]
        self._views: dict = {}
        self.c8 = torch.tensor([v.data_ptr() - self.ctrl.data_ptr() for v in views], dtype=torch.int64) // 8
        self.c8 = self.c8.to(self.device)
        self.words = torch.zeros(2, 2, dtype=torch.int64, device=self.device)   # per kind: [call number, done]
        self.fault = torch.zeros(3, dtype=torch.int64, device=self.device)      # [poison, peer, call]
        self._regions: dict = {}
        self._kept: list = []     # outgrown regions stay mapped: a peer's kernel may still write into one

    def region(self, kind: str, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's uint8 region of ``kind``, [P] int64 (rank p's region - mine) / 16 bytes), grown (collective:
        ``nbytes`` must be the same on every rank) when it holds fewer than ``nbytes``."""
        have = self._regions.get(kind)
        if have is None or have[0].numel() < nbytes:
            if have is not None:
                self._kept.append(have)
            views = self.alloc(max(nbytes, 2 * have[0].numel() if have is not None else 0))
            mine = views[self.me]
            delta = [v.data_ptr() - mine.data_ptr() for v in views]
            assert all(d % 16 == 0 for d in delta), f"regions must be 16-byte aligned relative to each other: {delta}"
            have = (mine, torch.tensor([d // 16 for d in delta], dtype=torch.int64).to(self.device), views)
            self._regions[kind] = have
        return have[0], have[1]

    def view(self, reg: torch.Tensor, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        """``reg[offset:]`` as ``dtype`` (cached: a cached call makes no view)."""
        key = (reg.data_ptr(), dtype, offset)
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = reg[offset:].view(dtype)
        return v

    @property
    def nbytes(self) -> int:
        return sum(r[0].numel() for r in self._regions.values()) + sum(r[0].numel() for r in self._kept)

    def check(self, what: str) -> None:
        """Raise the recorded fault, if any. HOST SYNC: reads the fault words."""
        poison, peer, call = self.fault.tolist()
        if poison:
            raise RuntimeError(f"{what}: rank {self.me} waited past {self.timeout_ms} ms for rank {peer} in call "
                               f"{call} of the normal-mode kernels (a rank missed a collective call or died)")


@dataclass(frozen=True)
class DirectPlan:
    """One routing's tables for the direct kernels (kept in the handle; cached calls reuse them).

    Attributes:
        me, P, T: this rank, ranks, tokens.
        nch, per: channels and tokens per channel.
        rows: X, the rows of the outputs (the received count, or the caller's worst case).
        capacity: Xc, the region rows (the same on every rank, >= every rank's X).
        tab: int32 [2P + 4 P nch]: send_base [P], recv_base [P], rstart [P, nch], rend [P, nch] (the rows each
            source's channels send here, in its send order to me), scnt [P, nch] (the rows my channels send each
            rank), sstart [P, nch] (where they start in my send order to that rank).
        head: int32 [T, P]: token t's index among the tokens sent p, -1: not sent.
        recv_pad: bool [X, 1] (worst-case outputs: True past the received count, the padding), else None.
        num_recv: the received count where it was read on the host, else None.
    """

    me: int
    P: int
    T: int
    nch: int
    per: int
    rows: int
    capacity: int
    tab: torch.Tensor
    head: torch.Tensor
    recv_pad: torch.Tensor | None
    num_recv: int | None


def channel_counts(in_rank_TP: torch.Tensor, nch: int) -> torch.Tensor:
    """[P, nch] int64: the tokens of each channel sent to each rank (channel c: tokens [c per, (c + 1) per))."""
    T, P = in_rank_TP.shape
    per = max(-(-T // nch), 1)
    chan = torch.zeros(P, nch, dtype=torch.long, device=in_rank_TP.device)
    chan.index_add_(1, torch.arange(T, device=in_rank_TP.device) // per, in_rank_TP.t().long())
    return chan


def send_heads(in_rank_TP: torch.Tensor) -> torch.Tensor:
    """[T, P] int32: token t's index among the tokens sent p (-1: not sent); DeepEP's send_head here."""
    return torch.where(in_rank_TP, torch.cumsum(in_rank_TP.long(), 0) - 1, -1).to(torch.int32)


def make_plan(me: int, in_rank_TP: torch.Tensor, chan_PPN: torch.Tensor, rows: int, capacity: int,
              num_recv: int | None = None, head: torch.Tensor | None = None) -> DirectPlan:
    """The tables of one routing (device ops, no host sync). ``chan_PPN`` [P(src), P(dst), nch]: every rank's
    ``channel_counts`` (all-gathered)."""
    T, P = in_rank_TP.shape
    nch = chan_PPN.shape[2]
    counts = chan_PPN.sum(2)                                  # [P(src), P(dst)]
    excl = torch.cumsum(counts, 0) - counts                   # tokens ranks < s send d
    rch = chan_PPN[:, me, :]                                  # [P(src), nch] rows each source's channels send me
    rend = torch.cumsum(rch, 1)
    sch = chan_PPN[me]                                        # [P(dst), nch] rows my channels send each rank
    tab = torch.cat([excl[me], excl[:, me], (rend - rch).reshape(-1), rend.reshape(-1), sch.reshape(-1),
                     (torch.cumsum(sch, 1) - sch).reshape(-1)]).to(torch.int32)
    pad = None
    if num_recv is None:
        pad = (torch.arange(rows, device=tab.device) >= counts[:, me].sum())[:, None]
    return DirectPlan(me=me, P=P, T=T, nch=nch, per=max(-(-T // nch), 1), rows=rows, capacity=capacity, tab=tab,
                      head=send_heads(in_rank_TP) if head is None else head, recv_pad=pad, num_recv=num_recv)


def clip_plan(plan: DirectPlan, rows: int) -> DirectPlan:
    """``plan`` with every row past compact row ``rows`` (worst-case outputs that are too small) left out: senders
    skip the tokens whose row would land there (``head`` -1) and receivers stop at it, so no kernel writes past a
    region or an output. Device ops; the guard reports the overflow."""
    P, nch = plan.P, plan.nch
    tab = plan.tab.long()
    send_base, recv_base = tab[:P], tab[P:2 * P]
    room = (rows - recv_base).clamp(min=0)[:, None]                       # [P(src), 1] rows each source may fill
    rstart = tab[2 * P:2 * P + P * nch].view(P, nch)
    rend = tab[2 * P + P * nch:2 * P + 2 * P * nch].view(P, nch)
    clipped = torch.cat([tab[:2 * P], torch.minimum(rstart, room).reshape(-1), torch.minimum(rend, room).reshape(-1),
                         tab[2 * P + 2 * P * nch:]]).to(torch.int32)
    head = plan.head.long()
    head = torch.where((head >= 0) & (send_base[None, :] + head < rows), head, -1).to(torch.int32)
    return replace(plan, tab=clipped, head=head)


def layout_torch(topk_idx_TK: torch.Tensor, num_experts: int, P: int) -> tuple:
    """The layout with torch ops: (tokens per rank int32 [P], tokens per expert int32 [E], is_token_in_rank bool
    [T, P])."""
    ids = topk_idx_TK.long()
    valid = ids >= 0
    e = num_experts // P
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
    per_expert.scatter_add_(0, torch.where(valid, ids, num_experts).reshape(-1),
                            torch.ones(ids.numel(), dtype=torch.int32, device=ids.device))
    in_rank = torch.zeros(ids.shape[0], P + 1, dtype=torch.bool, device=ids.device)
    in_rank.scatter_(1, torch.where(valid, ids // e, P), True)
    in_rank = in_rank[:, :P].contiguous()
    return in_rank.sum(0, dtype=torch.int32), per_expert[:num_experts], in_rank

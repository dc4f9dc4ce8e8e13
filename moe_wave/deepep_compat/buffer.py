"""DeepEP V1's ``Buffer`` (``deep_ep/buffer.py`` at 567632d) on moe-wave's symmetric-memory engine, within one node.

Legend: T local tokens, H hidden, K top-k, P ranks, E experts (e = E / P local), X received rows (compact), S
scale columns.

Normal mode (``get_dispatch_layout``, ``dispatch``, ``combine``) runs, on CUDA ranks with Triton, on the direct
kernels of ``normal_kernels`` (one Triton launch per call into peers' symmetric memory; the "direct" path), and
elsewhere on ``moe_wave.comm.deepep_normal``: the symm backend's exchange (its CPU emulation on gloo ranks; the
"engine" path). ``MOE_WAVE_NORMAL_PATH`` = auto (default) | direct | engine chooses (engine: the A/B comparison);
``MOE_WAVE_NORMAL_CHANNELS`` (channels, default 32) and ``MOE_WAVE_NORMAL_ROWS`` (tokens per chunk, default 8)
tune the direct kernels (the keywords ``normal``, ``normal_channels``, ``normal_rows`` win over them).
``Buffer.last_sms()`` gives the programs of each phase's last launch. Received rows come grouped by source rank in
rank order, each source's rows in its token order, every time. Low-latency mode lives in
``low_latency.py``. Internode calls raise ``NotImplementedError``.

Stream rules (DeepEP's): a call queues its work on the buffer's communication stream, which first waits for
``previous_event`` or, without one, for the caller's current stream. With ``async_finish`` the call returns an
``EventOverlap`` recorded on the communication stream; without it the caller's stream waits before the call
returns (a call with neither runs on the caller's stream: the same order, less host time). Outputs are made on
the communication stream and marked as used by the caller's stream (and inputs as used by the communication
stream), so either may free them early. ``allocate_on_comm_stream`` needs both
``previous_event`` and ``async_finish``, as in DeepEP. On CPU every call is synchronous.

Host waits: a normal ``dispatch`` without ``num_worst_tokens`` reads the received counts on the host (DeepEP's CPU
wait); with ``num_worst_tokens`` nothing is read and the call can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Callable, Optional, Tuple, Union

import torch
import torch.distributed as dist

from moe_wave.comm.deepep_normal import (CompactExchange, CompactPlan, capacity_for, routing_counts,
                                         routing_layout)
from moe_wave.comm.group import EPGroup
from moe_wave.comm.options import SymmOptions

from moe_wave.comm.triton_gate import triton_ok

from . import low_latency as ll
from . import normal_kernels as nk
from .config import COMBINE_TABLE, DISPATCH_TABLE, NUM_MAX_NVL_PEERS, Config, topk_idx_t
from .utils import EventHandle, EventOverlap

__all__ = ["Buffer", "IntranodeHandle"]

_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
_ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _unsupported(call: str, alternative: str):
    return NotImplementedError(f"deep_ep.Buffer.{call}: not supported by moe-wave's deep_ep (one node, symmetric "
                               f"memory); {alternative}")


class IntranodeHandle(tuple):
    """DeepEP's intranode handle, the 6-tuple ``(rank_prefix_matrix [P, P], channel_prefix_matrix [P, ch],
    recv_channel_prefix_matrix [P, ch], recv_src_idx [X], is_token_in_rank [T, P], send_head [T, P])`` (all int32
    but ``is_token_in_rank``; ch = ``config.num_sms // 2``), plus ``state``: the exchange plan that cached dispatches
    and combines reuse.

    ``rank_prefix_matrix[i][j]`` is the tokens ranks 0..i send rank j. ``send_head[t][p]`` is token t's row in the
    block it sends rank p (-1: not sent), where DeepEP stores a ring-buffer slot.
    """

    def __new__(cls, items, state: CompactPlan):
        h = super().__new__(cls, items)
        h.state = state
        return h


class _Scope:
    """What a call made inside ``Buffer._comm``: its outputs (for stream lifetimes) and the returned event."""

    def __init__(self):
        self.outputs: list = []
        self.event: EventOverlap | None = None

    def out(self, *tensors):
        self.outputs.extend(t for t in tensors if isinstance(t, torch.Tensor))
        return tensors[0] if len(tensors) == 1 else tensors


def _check_stream_args(what: str, previous_event, async_finish: bool, allocate_on_comm_stream: bool) -> None:
    if previous_event is not None and not isinstance(previous_event, (EventOverlap, EventHandle)):
        raise ValueError(f"{what}: previous_event={previous_event!r} must be an EventOverlap (Buffer.capture()) or "
                         f"None")
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        raise ValueError(f"{what}: allocate_on_comm_stream=True needs previous_event and async_finish=True (DeepEP's "
                         f"rule)")


def _tensor(what: str, name: str, t, dims: int, dtypes=None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != dims or (dtypes is not None and t.dtype not in dtypes):
        want = f"a {dims}-D tensor" + (f" of {', '.join(map(str, dtypes))}" if dtypes else "")
        got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{what}: {name} is {got}: must be {want}")
    return t


class Buffer:
    """DeepEP V1's communication buffer on moe-wave's engine (see the module docstring).

    Every V1 constructor argument is accepted. ``num_nvl_bytes`` / ``num_rdma_bytes`` are kept (callers read them)
    but do not bound anything: receive blocks are sized per call. ``low_latency_mode``, ``num_qps_per_rank``,
    ``allow_nvlink_for_low_latency_mode``, ``allow_mnnvl``, ``use_fabric`` and ``enable_shrink`` do not apply
    within a node with no NVSHMEM and are ignored; both modes are always available. ``group`` may be NCCL or gloo
    (on a GPU a gloo group gets an NCCL twin over the same ranks for the symmetric memory). ``options`` (moe-wave's
    own, keyword only) tunes the engine underneath (``SymmOptions``: kernels, timeouts, copy tuning); ``device``
    (also moe-wave's) defaults to the current CUDA device where there is one, as in DeepEP, and "cpu" runs the CPU
    emulation over a gloo group (the tests). ``normal`` ("auto", "direct", "engine"; default
    ``MOE_WAVE_NORMAL_PATH`` or "auto"), ``normal_channels`` and ``normal_rows`` (moe-wave's) choose and tune the
    normal-mode path (see the module docstring).

    Attributes:
        rank, group_size, group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, explicitly_destroy: as DeepEP.
        num_sms: class attribute, the SMs DeepEP's normal kernels would take (``set_num_sms``).
    """

    num_sms: int = 20

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False, use_fabric: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None, *,
                 options: SymmOptions | None = None, device: torch.device | str | None = None,
                 normal: str | None = None, normal_channels: int | None = None,
                 normal_rows: int | None = None) -> None:
        if group is None:
            if comm is not None:
                raise _unsupported("__init__(comm=<mpi4py communicator>)", "pass group=<a torch.distributed "
                                   "ProcessGroup over the same ranks> (e.g. dist.new_group(ranks))")
            raise ValueError("Buffer(group=None): pass the torch.distributed process group of the EP ranks")
        for name, v in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Buffer({name}={v!r}): must be an int >= 0")
        self.rank, self.group, self.group_size = group.rank(), group, group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy = bool(low_latency_mode), bool(explicitly_destroy)
        self.enable_shrink = bool(enable_shrink)
        if self.group_size > NUM_MAX_NVL_PEERS:
            raise _unsupported(f"__init__ with {self.group_size} ranks", f"it runs within one node (<= "
                               f"{NUM_MAX_NVL_PEERS} ranks); for internode EP use DeepEP itself")
        hosts = [None] * self.group_size
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        if len(set(hosts)) > 1:
            raise _unsupported(f"__init__ over hosts {sorted(set(hosts))}", "every rank must share one node; for "
                               "internode EP use DeepEP itself")
        backend = str(dist.get_backend(group)).lower()
        if device is None:      # DeepEP's: the current CUDA device, whatever the group's backend
            cuda = "nccl" in backend or torch.cuda.is_available()
        else:
            cuda = torch.device(device).type == "cuda"
            if not cuda and torch.device(device).type != "cpu":
                raise ValueError(f"Buffer(device={device!r}): must be a CUDA device or 'cpu'")
            if not cuda and "nccl" in backend:
                raise ValueError(f"Buffer(device={device!r}): an NCCL group needs a CUDA device")
        index = torch.device(device).index if device is not None and cuda else None
        self._device = (torch.device("cuda", torch.cuda.current_device() if index is None else index) if cuda
                        else torch.device("cpu"))
        pg = group
        if cuda and "nccl" not in backend and self.group_size > 1:
            # vLLM hands over its CPU (gloo) group; symmetric memory rendezvous over an NCCL group of the same ranks
            pg = dist.new_group(dist.get_process_group_ranks(group), backend="nccl", use_local_synchronization=True)
            backend = "nccl"
        self._ep = EPGroup(self.rank, self.group_size, self._device, backend if self.group_size > 1 else "none",
                           pg if self.group_size > 1 else None)
        self._comm_stream = torch.cuda.Stream(device=self._device, priority=-1) if cuda else None
        self._normal = CompactExchange(self._ep, options, comm_stream=self._comm_stream)
        self._direct = self._direct_state(normal, normal_channels, normal_rows, options or SymmOptions())
        self._ll = ll.LowLatency(self._ep, self._comm_stream, options, shrink=self.enable_shrink)
        self._destroyed = False

    def _direct_state(self, path, channels, rows, options: SymmOptions):
        """The direct kernels' state (``normal_kernels.NormalState``), or None on the engine path."""
        path = os.environ.get("MOE_WAVE_NORMAL_PATH", "auto") if path is None else path
        if path not in ("auto", "direct", "engine"):
            raise ValueError(f"Buffer(normal={path!r}) / MOE_WAVE_NORMAL_PATH: must be auto, direct or engine")
        self._nch = _env_int("normal_channels", channels, "MOE_WAVE_NORMAL_CHANNELS", nk.DEFAULT_CHANNELS, nk.NCH_MAX)
        self._rows = _env_int("normal_rows", rows, "MOE_WAVE_NORMAL_ROWS", nk.DEFAULT_ROWS, 256)
        if self._rows & (self._rows - 1):
            raise ValueError(f"Buffer(normal_rows={self._rows}): must be a power of two")
        ep, cuda = self._ep, self._device.type == "cuda"
        # one CPU rank runs them under the interpreter (the tests); several CPU ranks share no memory
        fits = (triton_ok(self._device, None if cuda else True) and (cuda and (ep.size == 1 or "nccl" in ep.backend)
                                                                     or not cuda and ep.size == 1))
        if path == "direct" and not fits:
            raise ValueError(f"Buffer(normal='direct'): needs CUDA ranks of an NCCL group with Triton, or one CPU "
                             f"rank under TRITON_INTERPRET=1; here {self._device.type}, {ep.size} rank(s), "
                             f"{ep.backend}")
        if path == "engine" or not fits or (path == "auto" and not cuda):
            return None
        return nk.NormalState(self.rank, self.group_size, self._device, _symm_alloc(ep, options.timeout_ms),
                              options.timeout_ms)

    @staticmethod
    def last_sms() -> dict:
        """The programs (one resident program per SM) of the last direct launch of each normal-mode phase:
        ``{"layout": n, "dispatch": n, "combine": n}`` (the phases run so far)."""
        return nk.last_sms()

    # ------------------------------------------------------------------ lifetime and static helpers
    def destroy(self) -> None:
        """Release the buffers. Needs ``explicitly_destroy``. Collective, as DeepEP's: this rank's work drains, then
        a barrier of the group, so that no peer's kernel still writes into a region (flags, acks, rows) when its
        owner frees it."""
        if not self.explicitly_destroy:
            raise RuntimeError("Buffer.destroy(): the buffer was made with explicitly_destroy=False (DeepEP's rule); "
                               "its memory is released when it is garbage-collected")
        if self._comm_stream is not None:
            self._comm_stream.synchronize()
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        if self.group_size > 1:
            dist.barrier(group=self._ep.pg)
        self._normal.close()
        self._ll.close()
        self._direct = None         # the direct kernels' regions (their symmetric memory goes with the state)
        self._destroyed = True

    def _alive(self, what: str) -> None:
        if self._destroyed:
            raise RuntimeError(f"Buffer.{what}: the buffer was destroyed")

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: FP8 rows are moved as bytes, on any GPU."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set ``Buffer.num_sms`` (even, as DeepEP requires); it feeds ``get_dispatch_config`` and friends."""
        if isinstance(new_num_sms, bool) or not isinstance(new_num_sms, int) or new_num_sms <= 0 or new_num_sms % 2:
            raise ValueError(f"Buffer.set_num_sms({new_num_sms!r}): the SM count must be an even int > 0")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream, for ``previous_event``."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """DeepEP's low-latency buffer size (its formula), for callers that size ``num_rdma_bytes`` with it."""
        return ll.rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config.from_table(DISPATCH_TABLE, num_ranks, Buffer.num_sms, "Buffer.get_dispatch_config")

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config.from_table(COMBINE_TABLE, num_ranks, Buffer.num_sms, "Buffer.get_combine_config")

    def get_comm_stream(self):
        """The communication stream (a ``torch.cuda.Stream``); None on CPU."""
        return self._comm_stream

    def get_local_buffer_tensor(self, dtype: torch.dtype, size=None, offset: int = 0, use_rdma_buffer: bool = False):
        raise _unsupported("get_local_buffer_tensor", "there is no raw DeepEP buffer to view: receive blocks are "
                           "sized per call; use the tensors dispatch returns")

    # ------------------------------------------------------------------ streams
    @contextlib.contextmanager
    def _comm(self, what: str, previous_event, async_finish: bool, allocate_on_comm_stream: bool, inputs=()):
        """Run the block on the communication stream with DeepEP's stream rules (see the module docstring)."""
        _check_stream_args(what, previous_event, async_finish, allocate_on_comm_stream)
        self._alive(what)
        scope = _Scope()
        comm = self._comm_stream
        if comm is None:
            yield scope
            scope.event = EventOverlap(EventHandle() if async_finish else None)
            return
        if previous_event is None and not async_finish:
            # DeepEP's rules here: the comm stream waits for the caller's, runs the call, and the caller's waits for
            # it before the call returns. Running on the caller's stream orders the work the same, without the two
            # waits, the stream switch and the record_stream calls (host time DeepEP's tests count).
            yield scope
            scope.event = EventOverlap(None)
            return
        caller = torch.cuda.current_stream(self._device)
        if previous_event is not None:
            ev = previous_event.event if isinstance(previous_event, EventOverlap) else previous_event
            if ev is None:
                raise ValueError(f"{what}: previous_event holds no event")
            ev.wait_on(comm)
        else:
            comm.wait_stream(caller)
        with torch.cuda.stream(comm):
            yield scope
        if not torch.cuda.is_current_stream_capturing():
            for t in inputs:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(comm)
            for t in scope.outputs:
                t.record_stream(caller)
        if async_finish:
            scope.event = EventOverlap(EventHandle(comm), tuple(scope.outputs))
        else:
            caller.wait_stream(comm)
            scope.event = EventOverlap(None)

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """From ``topk_idx`` [T, K] (``topk_idx_t``; -1: no expert): ``num_tokens_per_rank`` int32 [P], None (no RDMA
        ranks), ``num_tokens_per_expert`` int32 [E], ``is_token_in_rank`` bool [T, P], the event."""
        what = "get_dispatch_layout"
        _tensor(what, "topk_idx", topk_idx, 2, (torch.int64, torch.int32))
        P = self.group_size
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0 or num_experts % P:
            raise ValueError(f"{what}: num_experts={num_experts!r} must be a positive multiple of the {P} ranks")
        with self._comm(what, previous_event, async_finish, allocate_on_comm_stream, (topk_idx,)) as s:
            if self._direct is not None:
                per_rank, per_expert, in_rank = nk.dispatch_layout(topk_idx, num_experts, P)
            else:
                in_rank, per_expert = routing_counts(topk_idx, num_experts, P)
                per_rank = in_rank.sum(0, dtype=torch.int32)
            s.out(per_rank, per_expert, in_rank)
        return per_rank, None, per_expert, in_rank, s.event

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], handle: Optional[Tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Send each token to the ranks ``is_token_in_rank`` names (DeepEP's ``dispatch``).

        Args:
            x: bf16 [T, H] (fp16 / fp32 also move), or ``(fp8 [T, H], scales [T, S] float32 or int32, or [T])``;
                scales may have any strides.
            handle: a previous dispatch's handle: the same routing again (cached; no top-k arguments then).
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: ``get_dispatch_layout``'s outputs.
            topk_idx, topk_weights: [T, K] (int64, float32) or both None.
            expert_alignment: rounds up each count of the returned per-expert list.
            num_worst_tokens: > 0: the outputs have this many rows (padding rows: top-k -1, weight 0, x 0), nothing is
                read on the host and the per-expert list is empty; the same on every rank.
            config: accepted and checked; it does not change the exchange.

        Returns:
            recv_x (as ``x``: a tensor or an (fp8, scales) tuple, [X, ...]), recv_topk_idx [X, K] int64 (local
            experts, -1 elsewhere) or None, recv_topk_weights [X, K] float32 or None, the per-expert list, the
            handle (``IntranodeHandle``), the event. A cached dispatch returns ``(recv_x, None, None, None, None,
            event)``.
        """
        what = "dispatch"
        if num_tokens_per_rdma_rank is not None:
            raise _unsupported("dispatch(num_tokens_per_rdma_rank=...)", "within a node pass None (get_dispatch_layout "
                               "returns None there)")
        if config is not None and not isinstance(config, Config):
            raise ValueError(f"{what}: config={config!r} must be a deep_ep.Config or None")
        words = _words(what, x) if self._direct is not None else None
        if words is not None and (handle is None or isinstance(getattr(handle, "state", None), nk.DirectPlan)):
            return self._dispatch_direct(what, words, handle, num_tokens_per_rank, is_token_in_rank,
                                         num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                         num_worst_tokens, config, previous_event, async_finish,
                                         allocate_on_comm_stream)
        rows, unpack = _pack_x(what, x)
        if handle is not None:
            if not isinstance(handle, IntranodeHandle):
                raise ValueError(f"{what}: handle must be the handle a dispatch of this Buffer returned, got "
                                 f"{type(handle).__name__}")
            if topk_idx is not None or topk_weights is not None:
                raise ValueError(f"{what}: a cached dispatch (handle given) takes no topk_idx / topk_weights")
            cp = handle.state
            if not isinstance(cp, CompactPlan):
                raise ValueError(f"{what}: the handle comes from the direct kernels, x does not fit them (rows of "
                                 f"whole 4-byte words)")
            if rows.shape[0] != cp.plan.layout.num_tokens:
                raise ValueError(f"{what}: x has {rows.shape[0]} tokens, the handle's dispatch had "
                                 f"{cp.plan.layout.num_tokens}")
            with self._comm(what, previous_event, async_finish, allocate_on_comm_stream, (rows,)) as s:
                got, _, _ = self._normal.dispatch(rows, cp)
                recv_x = unpack(got)
                s.out(*(recv_x if isinstance(recv_x, tuple) else (recv_x,)))
            return recv_x, None, None, None, None, s.event
        args = self._check_route(what, rows.shape[0], num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                 topk_idx, topk_weights, expert_alignment, num_worst_tokens)
        with self._comm(what, previous_event, async_finish, allocate_on_comm_stream,
                        (rows, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                         topk_weights)) as s:
            recv_x, recv_idx, recv_w, counts_e, handle = self._route_and_dispatch(
                rows, unpack, *args, config or self.get_dispatch_config(self.group_size))
            s.out(*(recv_x if isinstance(recv_x, tuple) else (recv_x,)), recv_idx, recv_w, *handle)
        return recv_x, recv_idx, recv_w, counts_e, handle, s.event

    def _check_route(self, what, T, per_rank, in_rank, per_expert, topk_idx, topk_weights, alignment, worst):
        P = self.group_size
        missing = [n for n, v in (("num_tokens_per_rank", per_rank), ("is_token_in_rank", in_rank),
                                  ("num_tokens_per_expert", per_expert)) if v is None]
        if missing:
            raise ValueError(f"{what}: {', '.join(missing)} missing: pass get_dispatch_layout's outputs, or a handle")
        _tensor(what, "num_tokens_per_rank", per_rank, 1, (torch.int32, torch.int64))
        _tensor(what, "is_token_in_rank", in_rank, 2, (torch.bool,))
        _tensor(what, "num_tokens_per_expert", per_expert, 1, (torch.int32, torch.int64))
        if per_rank.numel() != P or tuple(in_rank.shape) != (T, P):
            raise ValueError(f"{what}: num_tokens_per_rank {tuple(per_rank.shape)} / is_token_in_rank "
                             f"{tuple(in_rank.shape)}: must be [{P}] / [{T}, {P}] (ranks, tokens of x)")
        if per_expert.numel() == 0 or per_expert.numel() % P:
            raise ValueError(f"{what}: num_tokens_per_expert has {per_expert.numel()} experts: must be a positive "
                             f"multiple of the {P} ranks")
        if (topk_idx is None) != (topk_weights is None):
            raise ValueError(f"{what}: pass topk_idx and topk_weights together, or neither")
        if topk_idx is not None:
            _tensor(what, "topk_idx", topk_idx, 2, (torch.int64, torch.int32))
            _tensor(what, "topk_weights", topk_weights, 2, (torch.float32,))
            if topk_idx.shape[0] != T or topk_weights.shape != topk_idx.shape:
                raise ValueError(f"{what}: topk_idx {tuple(topk_idx.shape)} / topk_weights "
                                 f"{tuple(topk_weights.shape)}: must both be [{T}, K]")
        for name, v, lo in (("expert_alignment", alignment, 1), ("num_worst_tokens", worst, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{what}: {name}={v!r} must be an int >= {lo}")
        return per_rank, in_rank, per_expert, topk_idx, topk_weights, alignment, worst

    def _route_and_dispatch(self, rows, unpack, per_rank, in_rank, per_expert, topk_idx, topk_weights, alignment,
                            worst, config):
        P, me, T = self.group_size, self.rank, rows.shape[0]
        counts = self._normal.count_matrix(torch.cat([per_rank.long(), per_rank.new_full((1,), T).long()]))
        counts_PP, tokens_P = counts[:, :P], counts[:, P]
        if worst:
            capacity, X, num_recv = self._capacity(worst), worst, None
        else:
            # HOST SYNC (DeepEP waits on the CPU here too): the received count and the capacity every rank agrees on
            host = counts_PP.tolist()
            num_recv = sum(row[me] for row in host)
            capacity, X = self._capacity(max(max(row) for row in host)), num_recv
        layout = routing_layout(in_rank, topk_idx, topk_weights, per_expert)
        cp = self._normal.make_plan(layout, counts_PP, capacity, X, num_recv)
        got, meta, weight = self._normal.dispatch(rows, cp)
        recv_src = meta[:, -1].contiguous()
        recv_idx = recv_w = None
        if topk_idx is not None:
            K = topk_idx.shape[1]
            recv_idx, recv_w = meta[:, :K].to(topk_idx_t), weight[:, :K].contiguous()
        counts_e = []
        if not worst:
            # HOST SYNC: the per-expert list is a host list (DeepEP's CPU wait covers it)
            counts_e = [-(-c // alignment) * alignment for c in cp.plan.pairs_We[0].tolist()]
        src_X = torch.div(cp.row_X, cp.plan.capacity, rounding_mode="floor").clamp(max=P - 1)
        mats = _handle_matrices(counts_PP, tokens_P, in_rank, src_X, cp.valid_X, recv_src, config.num_channels, me)
        handle = IntranodeHandle((*mats[:3], recv_src, in_rank, mats[3]), cp)
        return unpack(got), recv_idx, recv_w, counts_e, handle

    def _dispatch_direct(self, what, words, handle, per_rank, in_rank, per_expert, topk_idx, topk_weights, alignment,
                         worst, config, previous_event, async_finish, allocate_on_comm_stream):
        """``dispatch`` on the direct kernels (``normal_kernels``); ``words``: ``_words(x)``."""
        a, sc, unpack = words
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError(f"{what}: a cached dispatch (handle given) takes no topk_idx / topk_weights")
            plan = handle.state
            if a.shape[0] != plan.T:
                raise ValueError(f"{what}: x has {a.shape[0]} tokens, the handle's dispatch had {plan.T}")
            with self._comm(what, previous_event, async_finish, allocate_on_comm_stream, (a, sc)) as s:
                oa, ob = nk.dispatch(self._direct, plan, a, sc, rows=self._rows)
                if plan.recv_pad is not None:
                    oa.masked_fill_(plan.recv_pad, 0)
                    if ob is not None:
                        ob.masked_fill_(plan.recv_pad, 0)
                recv_x = unpack(oa, ob)
                s.out(*(recv_x if isinstance(recv_x, tuple) else (recv_x,)))
            return recv_x, None, None, None, None, s.event
        args = self._check_route(what, a.shape[0], per_rank, in_rank, per_expert, topk_idx, topk_weights, alignment,
                                 worst)
        with self._comm(what, previous_event, async_finish, allocate_on_comm_stream,
                        (a, sc, per_rank, in_rank, per_expert, topk_idx, topk_weights)) as s:
            recv_x, recv_idx, recv_w, counts_e, handle = self._route_direct(
                what, a, sc, unpack, *args, config or self.get_dispatch_config(self.group_size))
            s.out(*(recv_x if isinstance(recv_x, tuple) else (recv_x,)), recv_idx, recv_w, *handle)
        return recv_x, recv_idx, recv_w, counts_e, handle, s.event

    def _route_direct(self, what, a, sc, unpack, per_rank, in_rank, per_expert, topk_idx, topk_weights, alignment,
                      worst, config):
        P, me, T, nch = self.group_size, self.rank, a.shape[0], self._nch
        E = per_expert.numel()
        e = E // P
        chan = nk.channel_counts(in_rank, nch)
        G = self._normal.count_matrix(torch.cat([chan.reshape(-1), per_expert.long(), chan.new_full((1,), T)]))
        chan_G = G[:, :P * nch].reshape(P, P, nch)
        counts_PP = chan_G.sum(2)
        if worst:
            X, cap, num_recv, counts_e = worst, capacity_for(worst), None, []
        else:
            # HOST SYNC (DeepEP waits on the CPU here too): the received counts, the capacity every rank agrees on,
            # the per-expert list
            host = G.cpu()
            recv = host[:, :P * nch].reshape(P, P, nch).sum(2).sum(0)
            X = num_recv = int(recv[me])
            cap = capacity_for(int(recv.max()))
            got_e = host[:, P * nch + me * e:P * nch + (me + 1) * e].sum(0)
            counts_e = [-(-c // alignment) * alignment for c in got_e.tolist()]
            self._direct.check(what)        # a fault of an earlier call (the host already waited here)
        plan = nk.make_plan(me, in_rank, chan_G, X, cap, num_recv)
        S = sc.shape[1] if sc is not None else 0
        K = topk_idx.shape[1] if topk_idx is not None else 0
        parts = [] if sc is None else [sc]
        if K:
            parts += [topk_idx.to(torch.int32), topk_weights.contiguous().view(torch.int32)]
        parts.append(torch.arange(T, dtype=torch.int32, device=a.device)[:, None])
        oa, ob = nk.dispatch(self._direct, plan, a, torch.cat(parts, 1), rows=self._rows)
        recv_src = ob[:, S + 2 * K].contiguous()
        scales = ob[:, :S].contiguous() if sc is not None else None
        recv_idx = recv_w = None
        if K:
            ids = ob[:, S:S + K].long()
            local = ids - me * e
            mine = (ids >= 0) & (local >= 0) & (local < e)
            recv_idx = torch.where(mine, local, -1).to(topk_idx_t)
            recv_w = torch.where(mine, ob[:, S + K:S + 2 * K].contiguous().view(torch.float32), 0.0)
        if plan.recv_pad is not None:
            pad = plan.recv_pad
            oa.masked_fill_(pad, 0)
            recv_src.masked_fill_(pad[:, 0], -1)
            if scales is not None:
                scales.masked_fill_(pad, 0)
            if K:
                recv_idx.masked_fill_(pad, -1)
                recv_w.masked_fill_(pad, 0.0)
        recv_P = counts_PP[:, me]
        end_P = torch.cumsum(recv_P, 0)
        j_X = torch.arange(X, device=a.device)
        src_X = torch.searchsorted(end_P, j_X, right=True)
        mats = _handle_matrices(counts_PP, G[:, -1], in_rank, src_X.clamp(max=P - 1), src_X < P, recv_src,
                                config.num_channels, me)
        handle = IntranodeHandle((*mats[:3], recv_src, in_rank, plan.head), plan)
        return unpack(oa, scales), recv_idx, recv_w, counts_e, handle

    def _capacity(self, rows: int) -> int:
        """The smallest block capacity already made that holds ``rows``, else a new one (the same on every rank:
        ``rows`` is a global figure and the backends were made in the same order everywhere)."""
        made = [c for c in self._normal._backends if c >= rows]
        return min(made) if made else capacity_for(rows)

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, handle: Tuple, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None,
                config: Optional[Config] = None, previous_event=None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """Send the received rows back and sum them per token over the ranks that received it (no weights).

        Args:
            x: [X, H] (bf16; fp16 / fp32 also work), the dispatch's rows in its order.
            handle: the dispatch's handle.
            topk_weights: None or [X, K] float32: summed the same way.
            bias: None, one or two [T, H] tensors added to the sum (in fp32).

        Returns:
            combined_x [T, H] in x's dtype (fp32 sums, one rounding), combined_topk_weights [T, K] or None, the event.
        """
        what = "combine"
        if not isinstance(handle, IntranodeHandle):
            raise ValueError(f"{what}: handle must be the handle a dispatch of this Buffer returned, got "
                             f"{type(handle).__name__}")
        cp = handle.state
        direct = isinstance(cp, nk.DirectPlan)
        T, X = (cp.T, cp.rows) if direct else (cp.plan.layout.num_tokens, cp.rows)
        _tensor(what, "x", x, 2, _ROW_DTYPES)
        if x.shape[0] != X:
            raise ValueError(f"{what}: x has {x.shape[0]} rows: must have the dispatch's {X} received rows")
        if topk_weights is not None:
            _tensor(what, "topk_weights", topk_weights, 2, (torch.float32,))
            if topk_weights.shape[0] != X:
                raise ValueError(f"{what}: topk_weights has {topk_weights.shape[0]} rows: must have {X}")
        biases = _biases(what, bias, (T, x.shape[1]))
        if direct:
            with self._comm(what, previous_event, async_finish, allocate_on_comm_stream,
                            (x, topk_weights, *biases)) as s:
                combined, weights = nk.combine(self._direct, cp, x.contiguous(), None if topk_weights is None else
                                               topk_weights.contiguous(), tuple(b.contiguous() for b in biases),
                                               rows=self._rows)
                s.out(combined, weights)
            return combined, weights, s.event
        with self._comm(what, previous_event, async_finish, allocate_on_comm_stream, (x, topk_weights, *biases)) as s:
            add = None
            for b in biases:
                add = b.float() if add is None else add + b.float()
            combined = torch.empty(T, x.shape[1], dtype=x.dtype, device=x.device)
            self._normal.combine(x.contiguous(), cp, out_TH=combined, add_TH=add)
            weights = None
            if topk_weights is not None:
                weights = self._normal.combine(topk_weights.contiguous(), cp)
            s.out(combined, weights)
        return combined, weights, s.event

    # ------------------------------------------------------------------ internode
    def internode_dispatch(self, *args, **kwargs):
        raise _unsupported("internode_dispatch", "within one node call dispatch(); across nodes use DeepEP itself")

    def internode_combine(self, *args, **kwargs):
        raise _unsupported("internode_combine", "within one node call combine(); across nodes use DeepEP itself")

    # ------------------------------------------------------------------ low-latency mode: see low_latency.py
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Clear the low-latency buffers' state (DeepEP needs it after normal-mode use; here it resets the
        alternation of the two buffer sets). Collective."""
        self._alive("clean_low_latency_buffer")
        self._ll.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """DeepEP's ``low_latency_dispatch``; see ``low_latency.LowLatency.dispatch``."""
        self._alive("low_latency_dispatch")
        return self._ll.dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                 cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                                 round_scale, use_ue8m0, async_finish, return_recv_hook)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: tuple,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None, **overlap_kwargs):
        """DeepEP's ``low_latency_combine``; see ``low_latency.LowLatency.combine``. SGLang's single-batch-overlap
        keywords are accepted while their feature is off (``overlap`` false)."""
        self._alive("low_latency_combine")
        ll.check_overlap_kwargs(overlap_kwargs)
        return self._ll.combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                return_recv_hook, out, combine_wait_recv_cost_stats)

    def get_next_low_latency_combine_buffer(self, handle: object) -> torch.Tensor:
        """The bf16 [e, P * T, H] buffer the next ``low_latency_combine(zero_copy=True)`` reads."""
        self._alive("get_next_low_latency_combine_buffer")
        return self._ll.next_combine_buffer(handle)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        self._alive("low_latency_update_mask_buffer")
        self._ll.update_mask(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        self._alive("low_latency_query_mask_buffer")
        self._ll.query_mask(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        self._alive("low_latency_clean_mask_buffer")
        self._ll.clean_mask()


def _pack_x(what: str, x) -> tuple[torch.Tensor, Callable]:
    """(rows to send [T, W], ``unpack(rows [X, W]) -> recv_x`` in x's form). An (fp8, scales) pair travels as one
    byte row: the fp8 bytes, then the scales' bytes (so both arrive bit for bit)."""
    if isinstance(x, torch.Tensor):
        _tensor(what, "x", x, 2, _ROW_DTYPES)
        return x.contiguous(), lambda r: r
    _check_fp8(what, x)
    x8, sc = x
    T, H = x8.shape
    S = sc.shape[1] if sc.dim() == 2 else 1
    sc2 = sc.reshape(T, S).contiguous()
    rows = torch.cat([x8.contiguous().view(torch.uint8), sc2.view(torch.uint8).reshape(T, 4 * S)], 1)

    def unpack(r: torch.Tensor):
        n = r.shape[0]
        scales = r[:, H:].contiguous().view(sc.dtype)
        return r[:, :H].contiguous().view(x8.dtype), scales.view(n) if sc.dim() == 1 else scales.view(n, S)

    return rows, unpack


def _words(what: str, x):
    """The direct kernels' form of x: (rows as int32 words [T, WA], the scales as int32 words [T, S] (row-major)
    or None, ``unpack(words [X, WA], scale words [X, S] or None) -> recv_x`` in x's form); None where a row is not
    whole words (the engine path takes those)."""
    if isinstance(x, torch.Tensor):
        _tensor(what, "x", x, 2, _ROW_DTYPES)
        if x.shape[1] * x.element_size() % 4:
            return None
        return x.contiguous().view(torch.int32), None, lambda a, s: a.view(x.dtype)
    _check_fp8(what, x)
    x8, sc = x
    T, H = x8.shape
    if H % 4:
        return None
    S = sc.shape[1] if sc.dim() == 2 else 1

    def unpack(a, s):
        return a.view(torch.uint8).view(x8.dtype), (s.view(sc.dtype) if sc.dim() == 2 else s.view(sc.dtype).view(-1))

    # scales row-major: DeepEP's callers often pass them column-major ([T, S] with strides (1, T)), and a kernel
    # reading a row's S words 4*T bytes apart issues one memory transaction per word
    return x8.contiguous().view(torch.uint8).view(torch.int32), sc.reshape(T, S).contiguous().view(torch.int32), \
        unpack


def _check_fp8(what: str, x) -> None:
    if not isinstance(x, tuple) or len(x) != 2:
        raise ValueError(f"{what}: x must be a [T, H] tensor or an (fp8 [T, H], scales) tuple, got {type(x).__name__}")
    x8, sc = x
    _tensor(what, "x[0]", x8, 2, _FP8)
    if not isinstance(sc, torch.Tensor) or sc.dtype not in (torch.float32, torch.int32) or sc.dim() not in (1, 2) \
            or sc.shape[0] != x8.shape[0]:
        raise ValueError(f"{what}: x[1] (scales) is {getattr(sc, 'shape', type(sc))} {getattr(sc, 'dtype', '')}: must "
                         f"be float32 or int32, [{x8.shape[0]}] or [{x8.shape[0]}, S]")


def _symm_alloc(ep: EPGroup, timeout_ms: int):
    """``alloc(nbytes) -> [P] uint8``: a zeroed symmetric-memory allocation and every rank's view of it (collective,
    outside CUDA-graph capture; the handles are kept for the Buffer's life)."""
    kept = []

    def alloc(nbytes: int) -> list:
        if ep.size == 1 or ep.device.type != "cuda":
            return [torch.zeros(nbytes, dtype=torch.uint8, device=ep.device)]
        import torch.distributed._symmetric_memory as symm_mem

        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("deep_ep.Buffer: run one dispatch and combine of this size eagerly before capturing a "
                               "CUDA graph (the normal-mode regions are allocated, by every rank, on first use)")
        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=ep.device)
        hdl = symm_mem.rendezvous(buf, ep.pg.group_name)
        buf.zero_()
        views = [hdl.get_buffer(p, [nbytes], torch.uint8, 0) for p in range(ep.size)]
        hdl.barrier(channel=0, timeout_ms=timeout_ms)      # every rank's copy zeroed before anyone signals
        kept.append((buf, hdl))
        return views

    return alloc


def _env_int(name: str, value, env: str, default: int, hi: int) -> int:
    if value is None:
        raw = os.environ.get(env)
        try:
            value = default if raw is None else int(raw)
        except ValueError:
            raise ValueError(f"{env}={raw!r}: must be an int in [1, {hi}]") from None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
        raise ValueError(f"Buffer({name}={value!r}) / {env}: must be an int in [1, {hi}]")
    return value


def _biases(what: str, bias, shape) -> tuple:
    if bias is None:
        return ()
    items = bias if isinstance(bias, tuple) else (bias,)
    if len(items) > 2:
        raise ValueError(f"{what}: bias holds {len(items)} tensors: DeepEP takes 0, 1 or 2")
    for i, b in enumerate(items):
        _tensor(what, f"bias[{i}]", b, 2, _ROW_DTYPES)
        if tuple(b.shape) != tuple(shape):
            raise ValueError(f"{what}: bias[{i}] is {tuple(b.shape)}: must be [{shape[0]}, {shape[1]}] "
                             f"(tokens, hidden)")
    return tuple(items)


def _handle_matrices(counts_PP, tokens_P, in_rank_TP, src_X, valid_X, recv_src_X, ch: int, me: int):
    """(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, send_head), int32, on the device.

    Channel c of a rank with n tokens covers tokens [c * ceil(n / ch), (c + 1) * ceil(n / ch)), as DeepEP splits them:
    ``channel_prefix_matrix[p][c]`` counts this rank's tokens for p in channels 0..c; ``recv_channel_prefix_matrix[
    s][c]`` is where source s's channel c starts among the rows s sent here."""
    P, dev = counts_PP.shape[0], counts_PP.device
    T = in_rank_TP.shape[0]
    rank_prefix = torch.cumsum(counts_PP, 0).to(torch.int32)
    per = max(-(-T // ch), 1)
    chan_T = torch.arange(T, device=dev) // per
    chan = torch.zeros(P, ch, dtype=torch.long, device=dev)
    chan.index_add_(1, chan_T, in_rank_TP.t().long())
    chan_prefix = torch.cumsum(chan, 1).to(torch.int32)
    # the receive side: each valid row's source (src_X) and that source's channel of its token
    X = src_X.shape[0]
    per_src = torch.clamp(-(-tokens_P // ch), min=1)[src_X]
    key = torch.where(valid_X, src_X * ch + (recv_src_X.long() // per_src).clamp(max=ch - 1), P * ch)
    recv_chan = torch.zeros(P * ch + 1, dtype=torch.long, device=dev).index_add_(0, key, torch.ones(X, dtype=torch.long,
                                                                                                  device=dev))
    recv_chan = recv_chan[:-1].view(P, ch)
    recv_chan_prefix = (torch.cumsum(recv_chan, 1) - recv_chan).to(torch.int32)
    send_head = torch.where(in_rank_TP, torch.cumsum(in_rank_TP.long(), 0) - 1, -1).to(torch.int32)
    return rank_prefix, chan_prefix, recv_chan_prefix, send_head

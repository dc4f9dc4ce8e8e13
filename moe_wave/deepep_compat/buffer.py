"""DeepEP V1's ``Buffer`` (``deep_ep/buffer.py`` at 567632d) on moe-wave's engine, within one node: a facade that
keeps DeepEP's signatures and docstrings and delegates each call to one implementation per mode, chosen once
when the Buffer is made (``CompatOptions``: a keyword, else ``moe_wave.env.deepep_options``'s default):

    normal mode        normal_direct.DirectNormal (one Triton launch per call, CUDA ranks of an NCCL group)
                       normal_engine.EngineNormal (the symm backend's exchange; its CPU emulation on gloo)
    low-latency mode   ll_direct.DirectLowLatency (two kernels straight through peer memory)
                       ll_engine.EngineLowLatency (the exchange engine; gloo ranks, comparisons)

Arguments are checked on the host (``checks``); what only the device can see (expert ids out of range, in both
modes, an ``is_token_in_rank`` that contradicts ``topk_idx``, rows due past ``num_worst_tokens``) is checked on the
device with no host sync (``guard``): the outputs turn NaN and a later call, on every rank, or ``check()``, raises.
Stream rules are DeepEP's (``normal.comm_scope``); on CPU every call is synchronous. Internode calls raise
``NotImplementedError``.
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import asdict, replace
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from moe_wave import env as moe_env
from moe_wave.comm.group import EPGroup
from moe_wave.comm.header import CallHeader, HeaderMismatch, agreed_call
from moe_wave.comm.options import SymmOptions
from moe_wave.comm.triton_gate import triton_ok

from . import checks
from . import normal_kernels as nk
from .config import COMBINE_TABLE, DISPATCH_TABLE, NUM_MAX_NVL_PEERS, Config
from .guard import Guard
from .ll_direct import DirectLowLatency
from .ll_engine import EngineLowLatency
from .low_latency import check_overlap_kwargs, rdma_size_hint
from .normal import IntranodeHandle, Route, comm_scope
from .normal_direct import DirectNormal
from .normal_engine import EngineNormal, gate
from .utils import EventHandle, EventOverlap

__all__ = ["Buffer", "IntranodeHandle", "CALL_KINDS"]

# the kinds of the calls that carry a header; they share the Buffer's one call count (``Buffer._count``)
CALL_KINDS = ("deep_ep.Buffer.dispatch", "deep_ep.Buffer.combine", "deep_ep.Buffer.low_latency_dispatch",
              "deep_ep.Buffer.low_latency_combine", "deep_ep.Buffer.destroy")


class Buffer:
    """DeepEP V1's communication buffer on moe-wave's engine (see the module docstring).

    Every V1 constructor argument is accepted. ``num_nvl_bytes`` / ``num_rdma_bytes`` are kept (callers read them)
    but do not bound anything: receive blocks are sized per call. ``low_latency_mode``, ``num_qps_per_rank``,
    ``allow_nvlink_for_low_latency_mode``, ``allow_mnnvl``, ``use_fabric`` and ``enable_shrink`` do not apply
    within a node with no NVSHMEM and are ignored; both modes are always available. ``group`` may be NCCL or gloo
    (on a GPU a gloo group gets an NCCL twin over the same ranks for the symmetric memory).

    moe-wave's own keywords: ``options`` tunes the engine underneath (``SymmOptions``: kernels, timeouts, copy
    tuning); ``device`` defaults to the current CUDA device where there is one, as in DeepEP, and "cpu" runs the
    CPU emulation over a gloo group (the tests); ``normal``, ``normal_channels``, ``normal_rows``, ``ll``,
    ``ll_partial``, ``normal_fast_launch``, ``ll_fast_launch`` choose and tune each mode's implementation
    (``CompatOptions``; None: the environment's default, read by ``moe_wave.env.deepep_options``).

    Attributes:
        rank, group_size, group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, explicitly_destroy: as DeepEP.
        num_sms: class attribute, the SMs DeepEP's normal kernels would take (``set_num_sms``).
        compat: the ``CompatOptions`` the Buffer runs with.
    """

    num_sms: int = 20

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False, use_fabric: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None, *,
                 options: SymmOptions | None = None, device: torch.device | str | None = None,
                 normal: str | None = None, normal_channels: int | None = None, normal_rows: int | None = None,
                 ll: str | None = None, ll_partial: str | None = None, normal_fast_launch: bool | None = None,
                 ll_fast_launch: bool | None = None) -> None:
        checks.group_arg(group, comm)
        self.rank, self.group, self.group_size = group.rank(), group, group.size()
        # this rank's own argument checks, held until the one object gather below: a bad argument (or MOE_WAVE_*
        # variable) on one rank is then the same error on every rank, not one rank's error and the others' timeout
        try:
            checks.byte_size("num_nvl_bytes", num_nvl_bytes)
            checks.byte_size("num_rdma_bytes", num_rdma_bytes)
            if options is not None and not isinstance(options, SymmOptions):
                raise ValueError(f"Buffer(options={options!r}): must be a moe_wave.comm.options.SymmOptions or None")
            self.compat = moe_env.deepep_options(normal=normal, normal_channels=normal_channels,
                                                 normal_rows=normal_rows, ll=ll, ll_partial=ll_partial,
                                                 normal_fast_launch=normal_fast_launch, ll_fast_launch=ll_fast_launch)
            backend = str(dist.get_backend(group)).lower()
            dev = checks.device_arg(device, backend)
            error = None
        except (ValueError, NotImplementedError) as exc:
            error = exc
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy = bool(low_latency_mode), bool(explicitly_destroy)
        self.enable_shrink = bool(enable_shrink)
        if self.group_size > NUM_MAX_NVL_PEERS:
            raise checks.unsupported(f"__init__ with {self.group_size} ranks", f"it runs within one node (<= "
                                     f"{NUM_MAX_NVL_PEERS} ranks); for internode EP use DeepEP itself")
        settings = None
        if error is None:
            cuda = ("nccl" in backend or torch.cuda.is_available()) if dev is None else dev.type == "cuda"
            # the settings that shape every call's collectives (the count gather's width is normal_channels wide;
            # a CUDA rank of a gloo group makes an NCCL twin group; the engine's data mode and signals are
            # collective): ranks that differ would hang NCCL or abort gloo later
            options = options or SymmOptions()
            settings = asdict(self.compat)
            settings.update({f"options.{k}": v for k, v in asdict(options).items()
                             if k not in ("timeout_ms", "grace_s")})
            settings["device"] = "cuda" if cuda else "cpu"
        # one object gather: the host (one node), the settings, and each rank's argument error
        seen = [None] * self.group_size
        dist.all_gather_object(seen, (socket.gethostname(), settings, None if error is None else str(error)),
                               group=group)
        checks.rank_errors([e for _, _, e in seen], error)
        hosts = [h for h, _, _ in seen]
        if len(set(hosts)) > 1:
            raise checks.unsupported(f"__init__ over hosts {sorted(set(hosts))}", "every rank must share one node; "
                                     "for internode EP use DeepEP itself")
        checks.same_settings([st for _, st, _ in seen])
        index = dev.index if dev is not None and cuda else None
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
        self._guard = Guard(self.rank, self._device)
        # the call header's call number, one count for every kind (``_count``)
        self._calls = 0
        self._normal = self._normal_mode(options)
        self._ll = self._ll_mode(options)
        self._destroyed = False

    def _normal_mode(self, options: SymmOptions):
        """The normal-mode implementation ``compat.normal`` names ("auto": the direct kernels where they run)."""
        ep, cuda, c = self._ep, self._device.type == "cuda", self.compat
        engine = EngineNormal(ep, options, self._comm_stream, self._guard)
        # one CPU rank runs them under the interpreter (the tests); several CPU ranks share no memory
        fits = (triton_ok(self._device, None if cuda else True) and (cuda and (ep.size == 1 or "nccl" in ep.backend)
                                                                     or not cuda and ep.size == 1))
        if c.normal == "direct" and not fits:
            raise ValueError(f"Buffer(normal='direct'): needs CUDA ranks of an NCCL group with Triton, or one CPU "
                             f"rank under TRITON_INTERPRET=1; here {self._device.type}, {ep.size} rank(s), "
                             f"{ep.backend}")
        if c.normal == "engine" or not fits or (c.normal == "auto" and not cuda):
            return engine
        return DirectNormal(ep, engine, self._guard, c.normal_channels, c.normal_rows, options.timeout_ms,
                            c.normal_fast_launch)

    def _ll_mode(self, options: SymmOptions):
        """The low-latency implementation ``compat.ll`` names ("auto": the direct kernels where they run)."""
        ep, c = self._ep, self.compat
        kernels = triton_ok(ep.device, {"auto": None, "triton": True, "torch": False}[options.kernels])
        peer = ep.device.type == "cuda" and ep.size > 1 and "nccl" in ep.backend and kernels
        if c.ll == "direct" and not peer:
            raise ValueError(f"Buffer(ll='direct'): needs CUDA ranks of an NCCL group with Triton; here: "
                             f"{ep.device.type}, {ep.size} rank(s), {ep.backend}, Triton {kernels}")
        if peer and c.ll != "engine":
            return DirectLowLatency(ep, self._comm_stream, self._guard, options, shrink=self.enable_shrink,
                                    part_bf16=c.ll_partial == "bf16", fast_launch=c.ll_fast_launch)
        return EngineLowLatency(ep, self._comm_stream, self._guard, options)

    @staticmethod
    def last_sms() -> dict:
        """The programs (one resident program per SM) of the last direct launch of each normal-mode phase:
        ``{"layout": n, "dispatch": n, "combine": n}`` (the phases run so far)."""
        return nk.last_sms()

    # ------------------------------------------------------------------ lifetime and static helpers
    def destroy(self) -> None:
        """Release the buffers. Needs ``explicitly_destroy``. Collective, as DeepEP's: this rank's work drains, then
        a barrier of the group, so that no peer's kernel still writes into a region (flags, acks, rows) when its
        owner frees it. On CPU ranks its header is gathered first, as every call's there (``gate``): a destroy
        meeting another call on a peer is the same ``HeaderMismatch`` on every rank, and the buffer stays usable."""
        if not self.explicitly_destroy:
            raise RuntimeError("Buffer.destroy(): the buffer was made with explicitly_destroy=False (DeepEP's rule); "
                               "its memory is released when it is garbage-collected")
        if self._destroyed:
            raise RuntimeError("Buffer.destroy: the buffer was destroyed")
        call = self._count()
        if self._comm_stream is not None:
            self._comm_stream.synchronize()
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        if self.group_size > 1:
            if self._device.type == "cpu":
                with self._in_step():
                    gate(self._ep, CallHeader(kind="deep_ep.Buffer.destroy", module=0, call=call, overlap=False,
                                              hidden=0, dtype=None))
            dist.barrier(group=self._ep.pg)
        self._normal.close()
        self._ll.close()
        self._destroyed = True

    def check(self) -> None:
        """(moe-wave's) Raise a fault the device recorded (an expert id out of range, in either mode, an
        ``is_token_in_rank`` that contradicts ``topk_idx``, rows due past ``num_worst_tokens``) now, instead of at a
        later call. HOST SYNC;
        every rank calls it (every rank holds the same fault after the dispatch that found it)."""
        if self._comm_stream is not None:
            self._comm_stream.synchronize()     # HOST SYNC: the status is written on the communication stream
        self._guard.check("check")

    def _enter(self, what: str) -> None:
        if self._destroyed:
            raise RuntimeError(f"Buffer.{what}: the buffer was destroyed")
        self._guard.raise_if_flagged(what)

    def _count(self) -> int:
        """The call number of a call that carries a header (``dispatch``, cached too, ``combine``,
        ``low_latency_dispatch``, ``low_latency_combine``, ``destroy``): one count for all of them, taken on entry,
        before any check (a call that raised on one rank only still counts there), so calls of different kinds
        meeting on two ranks leave the counts in step, and a call one rank skipped shows in the next header the
        ranks exchange."""
        self._calls += 1
        return self._calls

    @contextlib.contextmanager
    def _in_step(self):
        """A call whose ``HeaderMismatch`` (raised on every rank) leaves every rank's call numbers agreed again
        (``_realign``), so the next call runs."""
        try:
            yield
        except HeaderMismatch as e:
            self._realign(e)
            raise

    def _realign(self, e: HeaderMismatch) -> None:
        """After a ``HeaderMismatch`` (raised on every rank): the call number every rank takes, so the next call is
        in step again (``agreed_call``: the largest of the ranks' where every rank made one of these calls)."""
        self._calls = agreed_call(e, CALL_KINDS, 0, self._calls)

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
        return rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

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
        raise checks.unsupported("get_local_buffer_tensor", "there is no raw DeepEP buffer to view: receive blocks "
                                 "are sized per call; use the tensors dispatch returns")

    def _scope(self, what: str, previous_event, async_finish: bool, allocate_on_comm_stream: bool, inputs=()):
        """The call's stream scope (``normal.comm_scope``), after the argument and fault checks."""
        checks.stream_args(what, previous_event, async_finish, allocate_on_comm_stream)
        self._enter(what)
        return comm_scope(self._comm_stream, self._device, what, previous_event, async_finish, inputs)

    # ------------------------------------------------------------------ normal mode
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """From ``topk_idx`` [T, K] (``topk_idx_t``; -1: no expert): ``num_tokens_per_rank`` int32 [P], None (no RDMA
        ranks), ``num_tokens_per_expert`` int32 [E], ``is_token_in_rank`` bool [T, P], the event. An id outside
        [-1, E) counts as -1 and is a fault (see the module docstring)."""
        what = "get_dispatch_layout"
        checks.tensor(what, "topk_idx", topk_idx, 2, (torch.int64, torch.int32))
        checks.num_experts_arg(what, num_experts, self.group_size)
        with self._scope(what, previous_event, async_finish, allocate_on_comm_stream, (topk_idx,)) as s:
            per_rank, per_expert, in_rank = s.out(*self._normal.layout(self._guard.check_ids(topk_idx, num_experts),
                                                                       num_experts))
        return per_rank, None, per_expert, in_rank, s.event

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
            handle: a previous dispatch's handle: the same routing again (cached; no top-k arguments then). On
                CPU ranks its call header is checked first (a cached dispatch meeting a fresh one on another rank
                is a ``HeaderMismatch`` on every rank); on GPUs it is not (``guard``).
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: ``get_dispatch_layout``'s outputs;
                ``is_token_in_rank`` must name exactly the ranks of each token's experts (checked on the device
                when ``topk_idx`` is given).
            topk_idx, topk_weights: [T, K] (int64, float32) or both None; ids in [-1, E).
            expert_alignment: rounds up each count of the returned per-expert list.
            num_worst_tokens: > 0: the outputs have this many rows (padding rows: top-k -1, weight 0, x 0), nothing is
                read on the host and the per-expert list is empty; the same on every rank; a rank due more rows
                is a fault (the rows past it are dropped, the outputs NaN, a later call raises).
            config: accepted and checked; it does not change the exchange.

        Returns:
            recv_x (as ``x``: a tensor or an (fp8, scales) tuple, [X, ...]), recv_topk_idx [X, K] int64 (local
            experts, -1 elsewhere) or None, recv_topk_weights [X, K] float32 or None, the per-expert list, the
            handle (``IntranodeHandle``), the event. A cached dispatch returns ``(recv_x, None, None, None, None,
            event)``.
        """
        what = "dispatch"
        call = self._count()
        if num_tokens_per_rdma_rank is not None:
            raise checks.unsupported("dispatch(num_tokens_per_rdma_rank=...)", "within a node pass None "
                                     "(get_dispatch_layout returns None there)")
        checks.config_arg(what, config)
        T = checks.rows_arg(what, x)
        if handle is not None:
            self._handle_rows(what, handle, T)
            if topk_idx is not None or topk_weights is not None:
                raise ValueError(f"{what}: a cached dispatch (handle given) takes no topk_idx / topk_weights")
            with self._scope(what, previous_event, async_finish, allocate_on_comm_stream, (x,)) as s:
                with self._in_step():
                    recv_x = s.out(self._normal.cached_dispatch(x, handle, call))
                self._guard.poison(*(recv_x if isinstance(recv_x, tuple) else (recv_x,)))
            return recv_x, None, None, None, None, s.event
        route = Route(*checks.route_args(what, self.group_size, T, num_tokens_per_rank, is_token_in_rank,
                                         num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                         num_worst_tokens), call=call)
        with self._scope(what, previous_event, async_finish, allocate_on_comm_stream,
                         (x, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                          topk_weights)) as s:
            route = self._guarded(route)
            with self._in_step():
                recv_x, recv_idx, recv_w, counts_e, handle = self._normal.dispatch(
                    x, route, config or self.get_dispatch_config(self.group_size))
            self._guard.poison(*(recv_x if isinstance(recv_x, tuple) else (recv_x,)), recv_w)
            self._guard.snapshot()      # the status as this dispatch left it, on the stream that wrote it
            s.out(recv_x, recv_idx, recv_w, *handle)
        return recv_x, recv_idx, recv_w, counts_e, handle, s.event

    def _guarded(self, route: Route) -> Route:
        """The route with the device-side checks queued: top-k ids outside [-1, E) become -1 and
        ``is_token_in_rank`` is compared with the top-k's ranks (faults go to the guard)."""
        if route.topk_idx is None:
            return route
        E = route.per_expert.numel()
        ids = self._guard.check_ids(route.topk_idx, E)
        self._guard.check_in_rank(route.in_rank, ids, E)
        return replace(route, topk_idx=ids)

    def _handle_rows(self, what: str, handle, T: Optional[int]) -> int:
        """X, the received rows of ``handle``'s dispatch (ValueError for a foreign handle or other tokens)."""
        if not isinstance(handle, IntranodeHandle):
            raise ValueError(f"{what}: handle must be the handle a dispatch of this Buffer returned, got "
                             f"{type(handle).__name__}")
        try:
            tokens, X = self._normal.handle_rows(handle)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
        if T is not None and T != tokens:
            raise ValueError(f"{what}: x has {T} tokens, the handle's dispatch had {tokens}")
        return X

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
        call = self._count()
        X = self._handle_rows(what, handle, None)
        T = self._normal.handle_rows(handle)[0]
        checks.tensor(what, "x", x, 2, checks.ROW_DTYPES)
        if x.shape[0] != X:
            raise ValueError(f"{what}: x has {x.shape[0]} rows: must have the dispatch's {X} received rows")
        if topk_weights is not None:
            checks.tensor(what, "topk_weights", topk_weights, 2, (torch.float32,))
            if topk_weights.shape[0] != X:
                raise ValueError(f"{what}: topk_weights has {topk_weights.shape[0]} rows: must have {X}")
        biases = checks.biases(what, bias, (T, x.shape[1]))
        self._combine_agrees(x, topk_weights, call)
        with self._scope(what, previous_event, async_finish, allocate_on_comm_stream, (x, topk_weights, *biases)) as s:
            combined, weights = s.out(*self._normal.combine(x, handle, topk_weights, biases))
            self._guard.poison(combined, weights)
        return combined, weights, s.event

    def _combine_agrees(self, x: torch.Tensor, topk_weights: Optional[torch.Tensor], call: int) -> None:
        """On CPU ranks (gloo), the combine's call header (call number, hidden size, dtype, topk_weights width)
        checked across ranks before its rows move, in the gate (``normal_engine.gate``: one small all-gather of
        the shape of a dispatch's count all-gather; the exchange is host-driven there anyway): the same
        ``HeaderMismatch`` on every rank, also where the peer makes a call of another kind, instead of gloo's
        size-mismatch abort or timeout. On GPUs nothing is checked (no exchange precedes the rows; the caller is
        trusted, as in DeepEP; see ``guard``)."""
        if self.group_size == 1 or x.device.type != "cpu":
            return
        head = CallHeader(kind="deep_ep.Buffer.combine", module=0, call=call, overlap=False,
                          hidden=x.shape[1], dtype=x.dtype, top_k=0 if topk_weights is None else topk_weights.shape[1])
        with self._in_step():
            gate(self._ep, head)

    def internode_dispatch(self, *args, **kwargs):
        raise checks.unsupported("internode_dispatch", "within one node call dispatch(); across nodes use DeepEP "
                                 "itself")

    def internode_combine(self, *args, **kwargs):
        raise checks.unsupported("internode_combine", "within one node call combine(); across nodes use DeepEP "
                                 "itself")

    # ------------------------------------------------------------------ low-latency mode
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Clear the low-latency buffers' state (DeepEP needs it after normal-mode use; here it resets the
        alternation of the two buffer sets). Collective."""
        self._enter("clean_low_latency_buffer")
        self._ll.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """DeepEP's ``low_latency_dispatch``; see ``low_latency.LowLatencyMode.dispatch``."""
        call = self._count()
        self._enter("low_latency_dispatch")
        with self._in_step():
            return self._ll.dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                     cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                                     round_scale, use_ue8m0, async_finish, return_recv_hook, call)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: tuple,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None, **overlap_kwargs):
        """DeepEP's ``low_latency_combine``; see ``low_latency.LowLatencyMode.combine``. SGLang's single-batch-overlap
        keywords are accepted while their feature is off (``overlap`` false)."""
        call = self._count()
        self._enter("low_latency_combine")
        check_overlap_kwargs(overlap_kwargs)
        with self._in_step():
            return self._ll.combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                    return_recv_hook, out, combine_wait_recv_cost_stats, call)

    def get_next_low_latency_combine_buffer(self, handle: object) -> torch.Tensor:
        """The bf16 [e, P * T, H] buffer the next ``low_latency_combine(zero_copy=True)`` reads."""
        self._enter("get_next_low_latency_combine_buffer")
        return self._ll.next_combine_buffer(handle)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        self._enter("low_latency_update_mask_buffer")
        self._ll.update_mask(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        self._enter("low_latency_query_mask_buffer")
        self._ll.query_mask(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        self._enter("low_latency_clean_mask_buffer")
        self._ll.clean_mask()

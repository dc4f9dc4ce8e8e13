"""DeepEP's low-latency mode in two kernels, straight through peer memory: one launch per call and phase.

Legend: N local tokens (<= T, the most any rank dispatches), H hidden, S = H / 128 scale groups, K top-k, P ranks,
e = E / P local experts, PT = P * T receive slots per local expert, c a call number (per buffer set and exchange).

Every rank owns, per buffer set, a region of symmetric memory (``Region``) that the peers write and it reads:

    rows [P(src), T, 2H bytes]   token t of rank src, if it has an expert here: bf16, or fp8 [H] + float32 scales [S]
    ids  [P(src), T, 2, K] int32 every token's top-k ids (global) and its slot among src's tokens of each of those
                                 experts, for every rank: the receiver routes from them
    cnt  [P(src), e] int32       how many of src's tokens each local expert gets
    w    [P(src), T, K] float32  the combine's weights (0 where the id is -1), for every rank
    part [P(dst), T, H]          rank dst's weighted sum over its experts of token t (the combine's partial; bf16
                                 by default, fp32 with ``Buffer(ll_partial="fp32")``)
    fw   [P(src), 4] int64       src's fault words for this dispatch (``guard``: kind, count, limit, value)
    ntok / dflag / wflag / pflag [P] int64: tokens src dispatched, and the three exchanges' flags (call numbers)

Dispatch (``_ZN8moe_wave8dispatchEv``; the profilers demangle it to ``moe_wave::dispatch()``):

- send: program-strided over the tokens, each token's row (FP8-cast where asked: DeepEP's per-128-channel
  ``amax / 448`` scales, or powers of two with ``round_scale``) goes once to every rank that holds one of its
  experts, and its top-k ids with its slots (the tokens before it with the same expert) to every rank. Program 0
  writes each rank its per-expert counts (a histogram of the ids) and this rank's fault words (ids outside
  [-1, E): their count and the first of them; such ids are sent nowhere, as -1). The last program to finish (an
  arrival counter) writes each rank N, and then the call number into that rank's flag for this rank, with release
  semantics at system scope.
- receive: every program waits (acquire, bounded) for every live rank's flag, then takes received tokens (s, t):
  the slot of token t in local expert i is its slot among s's tokens plus the counts of the sources before s
  (sources in rank order, each source's tokens in order), so the layout is deterministic and needs no atomics.
  The row, its scales (column-major float32 [e, S, PT], or UE8M0 bytes in int32 [e, S / 4, PT]) and t go to every
  slot; the last program writes the counts, DeepEP's ``layout_range`` and the statistics. Each (s, t, k) slot is
  kept (``posmap``) for the combine. Every rank's fault words are in every rank's region after the wait, so every
  rank folds them in this call (the Buffer's ``guard``): where any live rank, or an earlier call, recorded a fault,
  the rows and scales are stored as NaN (bf16 0x7FC0, FP8 0x7F, UE8M0 0xFF), and the last program records the
  first rank's fault in the guard's device status and its pinned host words (kind last, plain stores with no
  fence: a host reader may see the kind before the other words), which the next call reads without a sync.

Combine (``_ZN8moe_wave7combineEv``), three steps:

- weights: each token's top-k weights to every rank (flag ``wflag``);
- partials: on the expert side, each received token's weighted sum over its slots here (fp32, top-k order) goes
  to its source rank's ``part`` (flag ``pflag``); the sources are taken in turn from this rank, each source's
  weights awaited only when its first token comes up, so this rank's own sums start before a peer's weights land;
  the weights travel (K floats a token), the expert rows do not
  (one row per (token, rank) instead of one per (token, expert));
- receive: each token's partials summed in rank order (fp32), stored in the output's dtype (NaN while the guard's
  status holds a fault).

Phases: without a receive hook a call is one launch (send, then receive); with one, the call launches the send
(dispatch) or the weights and partials (combine) and the hook the receive. ``_ZN8moe_wave8dispatchEv`` and
``_ZN8moe_wave7combineEv`` are the only kernels a call launches.

Flags never need resetting: a call number c per (set, exchange) lives on the device (``state``); a sender stores c,
a receiver waits until the flag holds at least c. Ranks call in the same order, so their numbers agree; graph
replays advance them (they order the exchanges; they do not check that the ranks made the same call: ranks
passing different shapes are not detected here, see ``low_latency``). A region is rewritten only two calls later
(two sets, in turn), after every rank has read it: a rank reaches its next use of a set only through exchanges that
need every peer's progress past the last one.

A peer that does not arrive within ``timeout_ms`` (the GPU's global timer; bounded spins in the interpreter) is
marked in the rank mask and recorded in the fault words ``[1, peer, call, site]`` (pinned host memory the kernel
writes, read without a sync): the call completes without that rank, and the next call raises, unless the buffer
was made with ``enable_shrink`` (DeepEP's: the rank stays masked). A masked rank is skipped: nothing is sent to
it and nothing is awaited from it.

Programs: at most one per SM (``num_programs``), every one resident, so a program that waits never keeps a sender
of the same launch from running. Launches after the first of a specialization skip Triton's JIT dispatch
(``Launcher``): the host time of a call is what DeepEP's test measures.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from moe_wave.comm.options import SymmOptions
from moe_wave.comm.symm_signal import SPINS_PER_MS, globaltimer
from moe_wave.comm.triton_gate import interpreting, sm_count, triton

from .guard import IDS, WORDS, Guard
from .ll_direct_kernels import combine_kernel, dispatch_kernel
from .low_latency import LowLatencyHandle, LowLatencyMode, check_shape, outputs
from .config import LLTune
from .utils import EventHandle, EventOverlap
from .triton_launch import Launcher, spec

__all__ = ["DirectLowLatency", "Region", "DirectLL", "region_layout", "dispatch_launch", "combine_launch",
           "num_programs", "ST"]

# state words (int64) per buffer set
ST_DCALL, ST_CCALL, ST_DARR, ST_WARR, ST_PARR = 0, 1, 2, 3, 4
ST = 8
# fault words: poison, the peer, the call, the site (1 dispatch, 2 combine weights, 3 combine partials)
FAULT_WORDS = 4
_ALIGN = 256


def region_layout(P: int, T: int, H: int, K: int, E: int) -> dict:
    """Byte offsets of one buffer set's region (see the module docstring), and its size ``"bytes"``."""
    off, lay = 0, {}
    for name, nbytes in (("rows", P * T * 2 * H), ("ids", P * T * 2 * K * 4), ("cnt", P * (E // P) * 4),
                         ("w", P * T * K * 4), ("part", P * T * H * 4), ("fw", P * WORDS * 8), ("ntok", P * 8),
                         ("dflag", P * 8), ("wflag", P * 8), ("pflag", P * 8)):
        lay[name] = off
        off += -(-nbytes // _ALIGN) * _ALIGN
    lay["bytes"] = off
    return lay


def num_programs(device: torch.device, work: int) -> int:
    """Programs of one launch: enough for the work, at most one per SM (all resident), 4 in the interpreter."""
    if device.type != "cuda" or interpreting():
        return max(1, min(work, 4))
    return max(1, min(work, sm_count(device)))


def _pad(n: int) -> int:
    """The power of two at or above n (at least 2)."""
    return max(2, 1 << (int(n) - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _clock_limit(device_type: str, timeout_ms: int) -> tuple[bool, int]:
    clock = globaltimer is not None and device_type == "cuda" and torch.version.cuda is not None \
        and not interpreting()
    return clock, (int(timeout_ms) * 1_000_000 if clock else max(1, int(timeout_ms) * SPINS_PER_MS))


@dataclass
class Region:
    """One (T, H, K, E) configuration's buffers on one rank: both sets' symmetric regions and the local state.

    Attributes:
        P, T, H, K, E: the configuration; lay: ``region_layout``; set_bytes: one set's region.
        tab: int64 [P] every rank's region address (device); keep: what holds the memory (buffer, handle).
        state: int64 [2, ST] call numbers and arrival counters per set (device).
        posmap: int32 [2, P, T, K] each received (source, token, top-k) slot: expert * PT + slot, or -1.
        nrecv: int32 [2, P] tokens received from each source.
        hist: int32 [2, NBE] the send's histogram of the ids (scratch).
        sets: per set, the addresses of (state, posmap, nrecv, hist) and the byte offset, made once.
        configs: the launches' constants per (kernel, phase, options), made once.
    """

    P: int
    T: int
    H: int
    K: int
    E: int
    lay: dict
    tab: torch.Tensor
    state: torch.Tensor
    posmap: torch.Tensor
    nrecv: torch.Tensor
    hist: torch.Tensor
    keep: tuple = field(default=(), repr=False)
    sets: tuple = field(default=(), repr=False)
    configs: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.sets = tuple((self.state[i].data_ptr(), self.posmap[i].data_ptr(), self.nrecv[i].data_ptr(),
                           self.hist[i].data_ptr(), i * self.set_bytes) for i in range(2))
        self.tab_addr = self.tab.data_ptr()

    @property
    def set_bytes(self) -> int:
        return self.lay["bytes"]

    @property
    def geometry(self) -> tuple:
        """What the launches' constants depend on besides the call's options: (P, T, H, K, E). Part of every
        relaunch key: the relaunch cache is shared by every region of the process, ``configs`` is not."""
        return self.P, self.T, self.H, self.K, self.E


def make_region(P: int, T: int, H: int, K: int, E: int, device, base_addrs: list[int], keep=()) -> Region:
    """A ``Region`` over regions (two sets each) already allocated at ``base_addrs`` (one per rank)."""
    dev = torch.device(device)
    return Region(P, T, H, K, E, region_layout(P, T, H, K, E),
                  torch.tensor(base_addrs, dtype=torch.int64, device=dev),
                  torch.zeros(2, ST, dtype=torch.int64, device=dev),
                  torch.full((2, P, T, K), -1, dtype=torch.int32, device=dev),
                  torch.zeros(2, P, dtype=torch.int32, device=dev),
                  torch.zeros(2, _pad(E + 1), dtype=torch.int32, device=dev), keep)


_DISPATCH = Launcher(dispatch_kernel) if triton is not None else None
_COMBINE = Launcher(combine_kernel) if triton is not None else None

# The measurement hook (benchmarks/bench_ll.py): ``DirectLL.times``, an int64 [16] device tensor, makes the kernels
# record the GPU's global timer at their phase boundaries (``TIME_WORDS`` says which word is what); ``DirectLL.tune``
# (``LLTune``) sets the launch's warps, the combine's row blocks and the software pipelining of its row loops. Both
# are part of every launch's cache key.
TIME_WORDS = {"d": ("start", "sent", "signalled", "waited", "end"),
              "c": ("start", "weights sent", "weights waited", "partials sent", "signalled", "partials waited", "end")}


def _knobs(tune: LLTune, times) -> tuple:
    return (times is not None, tune.warps, tune.bh, tune.br, tune.stages)


def _times_addr(rg: "Region", times) -> int:
    return times.data_ptr() if times is not None else rg.sets[0][0]


def _dispatch_consts(rg: Region, send, recv, fp8, round_scale, ue8m0, stats, clock, timed: bool):
    P, T, H, K, e = rg.P, rg.T, rg.H, rg.K, rg.E // rg.P
    lay = rg.lay
    SP = _pad(H // 128)
    return dict(P=P, T=T, H=H, K=K, E_LOC=e, O_ROWS=lay["rows"], O_IDS=lay["ids"], O_CNT=lay["cnt"],
                O_FW=lay["fw"], O_NTOK=lay["ntok"], O_FLAG=lay["dflag"], IDS=IDS, WORDS=WORDS,
                # a poisoned row's 8-byte words: NaN bytes (FP8 0x7F, bf16 0x7FC0)
                NANW=0x7F7F7F7F7F7F7F7F if fp8 else 0x7FC07FC07FC07FC0, SEND=send, RECV=recv, FP8=fp8,
                ROUND=round_scale,
                UE8M0=ue8m0, STATS=stats, CLOCK=clock, P_PAD=_pad(P), K_PAD=_pad(K), TB=min(128, _pad(T)),
                G=min(SP, 64), SP=SP, NB=_pad(e + 1), NBE=_pad(rg.E + 1), FB=1024, WS=min(4096, _pad(H // 4)),
                WR=min(_pad(H // 4), 8192 // _pad(K)), TIMES=timed)


def dispatch_launch(rg: Region, set_index: int, me: int, x: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                    fault_addr: int, timeout_ms: int, out: torch.Tensor, scales, info: torch.Tensor,
                    count: torch.Tensor, layout_range: torch.Tensor, stats, *, guard: Guard, send: bool, recv: bool,
                    fp8: bool, round_scale: bool, ue8m0: bool, programs: int | None = None, tune: LLTune = LLTune(),
                    times: torch.Tensor | None = None, fast: bool = True) -> None:
    """One dispatch launch (``send`` and/or ``recv``) on the current stream; see the module docstring.

    ``x`` bf16 [N, H] with 8-byte aligned rows; ``out`` is the receive tensor [e, PT, H] (fp8 rows as uint8),
    ``scales`` the physical scale tensor (float32 [e, S, PT] or int32 [e, S / 4, PT]) or None, ``info`` int32
    [e, PT], ``count`` int32 [e], ``layout_range`` int64 [e, P], ``stats`` None or [e]; ``guard``: this rank's
    ``Guard`` (the receive records a fault in its status words). ``tune``, ``times``: see ``TIME_WORDS``;
    ``fast``: ``Launcher``'s."""
    N = x.shape[0]
    dev = x.device
    ckey = ("d", dev.type, timeout_ms, send, recv, fp8, round_scale, ue8m0, stats is not None, programs,
            N) + _knobs(tune, times)
    cfg = rg.configs.get(ckey)
    if cfg is None:
        clock, limit = _clock_limit(dev.type, timeout_ms)
        nprog = programs or num_programs(dev, max(N if send else 1, rg.P * rg.T if recv else 1))
        cfg = rg.configs[ckey] = (nprog, limit, _dispatch_consts(rg, send, recv, fp8, round_scale, ue8m0,
                                                                 stats is not None, clock, times is not None))
    nprog, limit, consts = cfg
    st, posmap, nrecv, hist, set_off = rg.sets[set_index]
    sc = scales if scales is not None else out
    if fp8 and ue8m0:
        sc = sc.view(torch.uint8)
    sx, sid = x.stride(0), ids.stride(0)
    _DISPATCH(nprog, (x, sx, ids, sid, N, rg.tab_addr, set_off, me, mask.data_ptr(), st, fault_addr, limit, out,
                      sc.data_ptr(), info.data_ptr(), count.data_ptr(), layout_range.data_ptr(),
                      stats if stats is not None else count, posmap, nrecv, hist, *guard.addresses,
                      _times_addr(rg, times)),
              consts, dict(num_warps=tune.warps),
              (ckey, rg.geometry, set_index, spec(x), spec(ids), spec(sx), spec(sid), spec(stats), me), fast=fast)


def _combine_consts(rg: Region, weights, partials, recv, part_bf16, clock, timed: bool, tune: LLTune) -> dict:
    P, T, H, K, e = rg.P, rg.T, rg.H, rg.K, rg.E // rg.P
    lay = rg.lay
    return dict(P=P, T=T, H=H, K=K, E_LOC=e, O_W=lay["w"], O_PART=lay["part"], O_WFLAG=lay["wflag"],
                O_PFLAG=lay["pflag"], WEIGHTS=weights, PARTIALS=partials, RECV=recv, PART_BF16=part_bf16, CLOCK=clock,
                P_PAD=_pad(P), K_PAD=_pad(K), BH=tune.bh or min(_pad(H), 16384 // _pad(K)),
                BR=tune.br or min(_pad(H), 16384 // _pad(P)), TW=min(_pad(T), 4096 // _pad(K)),
                TIMES=timed, STAGES=tune.stages)


def combine_launch(rg: Region, set_index: int, me: int, y: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                   mask: torch.Tensor, fault_addr: int, timeout_ms: int, out: torch.Tensor, *, guard: Guard,
                   weights: bool, partials: bool, recv: bool, part_bf16: bool = True, programs: int | None = None,
                   tune: LLTune = LLTune(), times: torch.Tensor | None = None, fast: bool = True) -> None:
    """One combine launch (any run of its three steps) on the current stream; ``y`` is [e * PT, H] bf16 rows.
    ``guard``: this rank's ``Guard`` (the output is NaN while its status holds a fault). ``part_bf16``: partial
    sums travel in bf16 (else fp32); ``tune``, ``times``, ``fast``: as ``dispatch_launch``."""
    N = ids.shape[0]
    dev = ids.device
    ckey = ("c", dev.type, timeout_ms, weights, partials, recv, part_bf16, programs, N) + _knobs(tune, times)
    cfg = rg.configs.get(ckey)
    if cfg is None:
        clock, limit = _clock_limit(dev.type, timeout_ms)
        nprog = programs or num_programs(dev, max(N, rg.P * rg.T if partials else 1))
        cfg = rg.configs[ckey] = (nprog, limit, _combine_consts(rg, weights, partials, recv, part_bf16, clock,
                                                                times is not None, tune))
    nprog, limit, consts = cfg
    st, posmap, nrecv, _, set_off = rg.sets[set_index]
    sy, sid, sw, so = y.stride(0), ids.stride(0), w.stride(0), out.stride(0)
    _COMBINE(nprog, (y, sy, ids, sid, w, sw, N, rg.tab_addr, set_off, me, mask.data_ptr(), st, fault_addr, limit,
                     out, so, posmap, nrecv, guard.addresses[0], _times_addr(rg, times)),
             consts, dict(num_warps=tune.warps),
             (ckey, rg.geometry, set_index, spec(y), spec(ids), spec(w), spec(out), spec(sy), spec(sid), spec(sw),
              spec(so), me), fast=fast)


class DirectLL:
    """The low-latency mode's GPU path on peer memory (see the module docstring): regions per configuration,
    the rank mask and the fault words.

    Args:
        ep: the group (NCCL, ranks of one host); timeout_ms: how long a peer may be late; shrink: DeepEP's
            ``enable_shrink`` (a late rank stays masked, and no error is raised).
        part_bf16: the combine's partial sums travel in bf16 (half the bytes, one rounding more than DeepEP's fp32
            sum of bf16 rows), else fp32. fast_launch: ``Launcher``'s fast path.

    ``tune`` (``LLTune``) and ``times`` (see ``TIME_WORDS``) are the benchmarks' hooks.
    """

    def __init__(self, ep, timeout_ms: int, shrink: bool = False, part_bf16: bool = True, fast_launch: bool = True):
        self.ep, self.timeout_ms, self.shrink = ep, int(timeout_ms), bool(shrink)
        self.part_bf16, self.fast_launch = bool(part_bf16), bool(fast_launch)
        self.tune, self.times = LLTune(), None
        self.mask = torch.zeros(ep.size, dtype=torch.int32, device=ep.device)
        pin = ep.device.type == "cuda"
        # pinned host words the kernels write (callers may have made CUDA the default device: say cpu)
        self.fault = torch.zeros(FAULT_WORDS, dtype=torch.int64, device="cpu", pin_memory=pin)
        self._fault_np = self.fault.numpy()
        self._regions: dict = {}

    @property
    def fault_addr(self) -> int:
        return self.fault.data_ptr()

    def region(self, T: int, H: int, K: int, E: int) -> Region:
        """The configuration's region (collective on first use: every rank asks for the same, outside capture)."""
        key = (T, H, K, E)
        rg = self._regions.get(key)
        if rg is None:
            import torch.distributed._symmetric_memory as symm_mem

            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("low-latency mode: run one dispatch and combine of this shape eagerly before "
                                   "capturing a CUDA graph (its buffers are allocated on first use, by every rank)")
            P = self.ep.size
            nbytes = 2 * region_layout(P, T, H, K, E)["bytes"]
            buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.ep.device)
            hdl = symm_mem.rendezvous(buf, self.ep.pg.group_name)
            buf.zero_()
            addrs = [hdl.get_buffer(p, [nbytes], torch.uint8, 0).data_ptr() for p in range(P)]
            hdl.barrier(channel=0, timeout_ms=self.timeout_ms)      # every region zeroed before anyone writes
            rg = make_region(P, T, H, K, E, self.ep.device, addrs, keep=(buf, hdl))
            self._regions[key] = rg
        return rg

    def memory_bytes(self) -> int:
        return sum(2 * r.set_bytes for r in self._regions.values())

    def check(self) -> None:
        """Raise a recorded late peer (pinned words: no sync), unless shrinking; then clear the record."""
        f = self._fault_np
        if f[0]:
            peer, call, site = int(f[1]), int(f[2]), int(f[3])
            f[:] = 0
            if not self.shrink:
                what = {1: "dispatch", 2: "combine (weights)", 3: "combine (partial sums)"}.get(site, "exchange")
                raise RuntimeError(
                    f"low-latency {what}: rank {self.ep.rank} gave up waiting for rank {peer} (call {call}) after "
                    f"SymmOptions.timeout_ms={self.timeout_ms}: that rank stopped or fell behind; it is masked "
                    f"(low_latency_query_mask_buffer) and that call's outputs lack its tokens")

    def close(self) -> None:
        self._regions.clear()


@dataclass(frozen=True)
class _DirectState:
    """What the direct path's combine needs: the buffer set and the region (its ``posmap`` holds the slots)."""

    set_index: int
    region: object = field(repr=False)
    num_tokens: int = 0
    top_k: int = 0


class DirectLowLatency(LowLatencyMode):
    """The low-latency mode on the direct kernels (see the module docstring): ``direct`` (``DirectLL``) holds the
    regions, the rank mask and the fault words.

    Args:
        ep: the group (NCCL, ranks of one host); comm_stream: the buffer's communication stream; options: the
        engine's options (``timeout_ms``); shrink, part_bf16, fast_launch: as ``DirectLL``.
    """

    def __init__(self, ep, comm_stream, guard, options: SymmOptions, shrink: bool = False, part_bf16: bool = True,
                 fast_launch: bool = True):
        super().__init__(ep, comm_stream, guard)
        self.direct = DirectLL(ep, options.timeout_ms, shrink, part_bf16, fast_launch)

    def close(self) -> None:
        self.direct.close()
        super().close()

    def _launch(self, fn, async_finish: bool, hook: bool, inputs, outputs, send, receive):
        """Stream rules of the direct path: ``send()`` on the caller's stream (then the hook runs ``receive()`` on
        the stream current when it is called), or both in one launch: on the caller's stream, or with
        ``async_finish`` on the communication stream (inputs and outputs marked used there, an event returned)."""
        if hook:
            send()
            return EventOverlap(None), receive
        if not async_finish or self.comm_stream is None:
            fn()
            return EventOverlap(EventHandle() if async_finish else None), None
        caller = torch.cuda.current_stream(self.ep.device)
        comm = self.comm_stream
        comm.wait_stream(caller)
        with torch.cuda.stream(comm):
            fn()
        if not torch.cuda.is_current_stream_capturing():
            for t in (*inputs, *outputs):
                if t is not None:
                    t.record_stream(comm)
        return EventOverlap(EventHandle(comm), tuple(t for t in (*inputs, *outputs) if t is not None)), None

    def _dispatch(self, x, topk_idx, T, E, K, stats, fp8, round_scale, ue8m0, async_finish, hook, call):
        """``LowLatencyMode._dispatch``; ``call`` is not sent (no header travels here: ``low_latency``)."""
        d = self.direct
        d.check()
        P, me = self.ep.size, self.ep.rank
        N, H = x.shape
        e = E // P
        rg = d.region(T, H, K, E)
        set_index = self._take_set()
        recv, phys, scales, count, info, layout_range = outputs(e, P, T, H, fp8, ue8m0, x.device)
        # the kernel reads rows as 8-byte words: rows contiguous and 16-byte aligned, or a copy
        xc = x if x.stride(1) == 1 and not x.data_ptr() % 16 and not x.stride(0) % 8 else x.clone()
        ids = topk_idx if topk_idx.stride(1) == 1 else topk_idx.contiguous()
        out = recv.view(torch.uint8) if fp8 else recv

        def go(send: bool, receive: bool):
            dispatch_launch(rg, set_index, me, xc, ids, d.mask, d.fault_addr, d.timeout_ms, out, phys, info, count,
                            layout_range, stats, guard=self.guard, send=send, recv=receive, fp8=fp8,
                            round_scale=round_scale, ue8m0=ue8m0, tune=d.tune, times=d.times, fast=d.fast_launch)

        event, hook_fn = self._launch(lambda: go(True, True), async_finish, hook, (xc, ids, stats),
                                      (recv, phys, count, info, layout_range), lambda: go(True, False),
                                      lambda: go(False, True))
        handle = LowLatencyHandle((info, layout_range, T, H, E), _DirectState(set_index, rg, N, K))
        return (recv, scales) if fp8 else recv, count, handle, event, hook_fn

    def _combine(self, st: _DirectState, y, topk_idx, topk_weights, result, async_finish, hook, call):
        """``LowLatencyMode._combine``; ``call`` is not sent (no header travels here: ``low_latency``)."""
        d = self.direct
        d.check()
        me, H = self.ep.rank, y.shape[-1]
        y2 = y.view(-1, H)
        ids = topk_idx if topk_idx.stride(1) == 1 else topk_idx.contiguous()
        w = topk_weights if topk_weights.stride(1) == 1 else topk_weights.contiguous()

        def go(weights: bool, partials: bool, receive: bool):
            combine_launch(st.region, st.set_index, me, y2, ids, w, d.mask, d.fault_addr, d.timeout_ms, result,
                           guard=self.guard, weights=weights, partials=partials, recv=receive,
                           part_bf16=d.part_bf16, tune=d.tune, times=d.times, fast=d.fast_launch)

        event, hook_fn = self._launch(lambda: go(True, True, True), async_finish, hook, (y, ids, w), (result,),
                                      lambda: go(True, True, False), lambda: go(False, False, True))
        return result, event, hook_fn

    # ------------------------------------------------------------------ rank masks
    def update_mask(self, rank: int, mask: bool) -> None:
        """Mask (or unmask) a rank, on the current stream, ordered with the calls around it."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.ep.size:
            raise ValueError(f"low_latency_update_mask_buffer: rank_to_mask={rank!r} must be in [0, {self.ep.size})")
        self.direct.mask[rank:rank + 1].fill_(1 if mask else 0)

    def query_mask(self, mask_status: torch.Tensor) -> None:
        """``mask_status`` (int32 [P]) = the rank mask (1: masked)."""
        check_shape("low_latency_query_mask_buffer", "mask_status", mask_status, (self.ep.size,), (torch.int32,))
        mask_status.copy_(self.direct.mask)

    def clean_mask(self) -> None:
        """Unmask every rank."""
        self.direct.mask.zero_()

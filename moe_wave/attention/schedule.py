"""Multi-stream schedule of the V4 attention front-end (spec 3.6). Math lives in ``attention.py``.

Legend: B batch, S chunk length, D hidden, H heads, d head_dim, W window, K picked entries.

Once x exists (an FP8 layer: quantised once, on the main stream, for wq_a and wkv), the front-end is independent
chains joined once before the core:

  main (current) stream:  q_a -> q_norm --record q_lora_ready--> q_b -> head norm -> RoPE (prefill on Hopper:
                          the core's kernel does the last two as it loads q, ``V4Attention.q_branch``)
  side a:  kv_proj -> kv_norm -> RoPE -> window source -> ring write      --kv_ready-->
           (the window's picks: one kernel, ``kernels.picks``)
  side b:  compressor GEMMs -> pool -> entry write -> state write        --comp_ready-->
  side c:  indexer compressor -> entry write, weights_proj, wait q_lora_ready -> q side -> top-k -> state write
           --idx_ready-->
  main:    wait kv_ready, comp_ready, idx_ready -> core -> output projection

The ring and state writes are read only by the same layer's next step; they run on their side streams before the
branch's ready event, so that nothing of the layer runs beside the core (issuing them beside the core measured
slower: ``benchmarks/results/attn.md``).
Under CUDA-graph capture every side stream is joined before the call returns.

Switches: ``ScheduleConfig.overlap`` (default on; the CLI maps ``MOE_WAVE_ATTN_OVERLAP`` onto it) and
``ScheduleConfig.kernels`` (the fused Triton kernels, ``attention/kernels.py``).
``decode_overlap_min_batch`` turns overlap off for decode steps (S == 1) with a smaller batch, should
launch latency beat the overlap. Default 0 (always overlap: it shortens the decode front-end and layer at every
measured batch, ``benchmarks/results/attn.md``, ``benchmarks/bench_attn.py``). On CPU every stream op is a no-op
and both settings run the same code serially.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_wave.comm.streams import Streams, current_stream, keep_alive, on, record, wait
from moe_wave.fp8 import QAct

from .kernels import KERNEL_MODES
from .sparse_core.call import CoreTuning

__all__ = ["ScheduleConfig", "FrontEnd", "run_frontend", "side_streams", "high_stream", "is_capturing"]


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """How the front-end runs (not what it computes).

    overlap: run the branches on side streams.
    kernels: the fused Triton kernels (``attention/kernels.py``): "auto" (on a GPU with Triton), "on"
        (wherever Triton runs: also on CPU under ``TRITON_INTERPRET=1``, as the tests do) or "off"
        (the torch ops everywhere). The two agree to the dtype's rounding, not bit for bit.
    decode_overlap_min_batch: decode steps (S == 1) with batch < this run serially (0: never).
    q_block: queries per core block in prefill; bounds the gathered memory to q_block*(W+K)*d.
    core: where the sparse core's implementations run (``sparse_core.CoreTuning``).
    wo_a_overlap: an FP8 layer's grouped wo_a runs its GEMMs on a priority -1 stream and quantises each group's
        output on a side stream beside the next groups' GEMMs (``V4Attention._wo_a_overlapped``: the same bits), for
        calls of at least ``wo_a_overlap_min_tokens`` tokens (prefill; decode keeps one launch a step).
    """

    overlap: bool = True
    kernels: str = "auto"
    decode_overlap_min_batch: int = 0
    q_block: int = 1024
    core: CoreTuning = CoreTuning()
    wo_a_overlap: bool = True
    wo_a_overlap_min_tokens: int = 2048

    def __post_init__(self):
        if not isinstance(self.overlap, bool):
            raise ValueError(f"ScheduleConfig.overlap={self.overlap!r}: must be True or False")
        if self.kernels not in KERNEL_MODES:
            raise ValueError(f"ScheduleConfig.kernels={self.kernels!r}: must be one of {KERNEL_MODES}")
        if self.decode_overlap_min_batch < 0:
            raise ValueError(f"ScheduleConfig.decode_overlap_min_batch={self.decode_overlap_min_batch}: must be >= 0")
        if self.q_block <= 0:
            raise ValueError(f"ScheduleConfig.q_block={self.q_block}: must be > 0")
        if not isinstance(self.wo_a_overlap, bool) or self.wo_a_overlap_min_tokens < 0:
            raise ValueError(f"ScheduleConfig wo_a_overlap={self.wo_a_overlap!r}, wo_a_overlap_min_tokens="
                             f"{self.wo_a_overlap_min_tokens}: must be True or False and >= 0")
        if not isinstance(self.core, CoreTuning):
            raise ValueError(f"ScheduleConfig.core={self.core!r}: must be a CoreTuning")

    def use_overlap(self, batch: int, seq: int) -> bool:
        return self.overlap and not (seq == 1 and batch < self.decode_overlap_min_batch)


_SIDE: dict[torch.device, Streams] = {}   # a cache: one bundle a device


def _streams(device: torch.device) -> Streams:
    """The device's bundle: three side streams at the default priority (0) and a priority -1 one, shared by all
    layers."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _SIDE:
        _SIDE[device] = Streams.for_device(device, num_extra=3, priority=0)
    return _SIDE[device]


def side_streams(device: torch.device) -> tuple:
    """Three side streams per device (at the default priority), shared by all layers (None on CPU)."""
    return _streams(device).extra


def high_stream(device: torch.device):
    """A priority -1 stream of the device (the bundle's ``comm``; None on CPU): work there gets SMs before the side
    streams' as they free up."""
    return _streams(device).comm


def is_capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@dataclass
class FrontEnd:
    """What the core needs: queries and (key source, per-query row ids) parts."""

    q_BSHd: torch.Tensor
    parts: list
    q_raw: bool = False     # q not yet normalised and rotated: the core does it (``V4Attention.q_branch``)


def _cache_tensors(cache) -> dict:
    """The cache tensors each side stream writes: the caller may drop the cache before they finish."""
    out = {"win": [cache.win_BWd]}
    for key, st in (("comp", cache.comp), ("index", cache.index)):
        if st is not None:
            out[key] = [st.kv_BRC, st.score_BRC, st.entries_BNd]
    return out


def _ready(stream, cache, key: str, write) -> object:
    """A branch's ready event on ``stream``, after its ring write (``write``, or False: none)."""
    if write:
        write()
    return record(stream)


def run_frontend(attn, x_BSD: torch.Tensor, pos_BS: torch.Tensor, cache, overlap: bool,
                 store: bool = True) -> FrontEnd:
    """Issue the front-end of ``attn`` (a ``V4Attention``) on its streams; returns after the join.

    ``store=False`` skips the writes that only a next step reads (the window ring and the compressor rings): for a
    throw-away cache (a call without one).
    """
    dev, kernels = x_BSD.device, attn.schedule.kernels
    sa, sb, sc = side_streams(dev) if overlap else (None, None, None)
    main = current_stream(dev) if overlap else None
    hold = not is_capturing(dev)  # record_stream is for the caching allocator's eager mode only
    fork = record(main)
    # FP8 layers: x quantised once for wq_a (main) and wkv (side a). Only side a waits for it: the other sides fork
    # before it (with every side behind it the overlapped front-end lost its gain: benchmarks/results/attn.md)
    xq = attn.x_quant(x_BSD)
    xq_ready = record(main) if xq is not None else fork
    if hold and overlap:
        # Side streams write into the cache (entries before the join, rings after it): should the
        # caller drop the cache, its memory must not be handed out again before those writes end.
        owned = _cache_tensors(cache)
        for s, key in ((sa, "win"), (sb, "comp"), (sc, "index")):
            keep_alive(x_BSD, s)
            keep_alive(pos_BS, s)
            for t in owned.get(key, ()):
                keep_alive(t, s)
        for t in xq or ():
            keep_alive(t, sa)

    with on(sa):                                              # (a) window kv
        wait(xq_ready)
        kv_BSd = attn.window_kv(x_BSD, pos_BS, xq)
        win_src, win_idx = attn.window_source(kv_BSd, pos_BS, cache)
        kv_ready = _ready(sa, cache, "win", store and (lambda: attn.window_write(kv_BSd, pos_BS, cache)))
    parts = [(win_src, win_idx)]

    comp_ready = None
    if attn.compressor is not None:                           # (b) main compressor
        with on(sb):
            wait(fork)
            ckv, csc = attn.compressor.project(x_BSD, pos_BS)
            attn.compressor.emit(ckv, csc, pos_BS, cache.comp, attn.freq_F, kernels=kernels)
            comp_idx = attn.hca_index(pos_BS, cache) if attn.indexer is None else None
            comp_ready = _ready(sb, cache, "comp", store and (
                lambda: attn.compressor.write_state(ckv, csc, pos_BS, cache.comp, kernels=kernels)))

    qr_BSL = attn.q_lora(x_BSD, xq)                           # main: q chain
    q_lora_ready = record(main)

    idx_ready = None
    if attn.indexer is not None:                              # (c) indexer
        ix = attn.indexer
        with on(sc):
            wait(fork)
            ikv, isc = ix.compressor.project(x_BSD, pos_BS)
            ix.compressor.emit(ikv, isc, pos_BS, cache.index, attn.freq_F, kernels=kernels)
            w_BSh = ix.weights(x_BSD)
            wait(q_lora_ready)
            if hold:
                for t in (qr_BSL.q, qr_BSL.s) if isinstance(qr_BSL, QAct) else (qr_BSL,):
                    keep_alive(t, sc)
            qI = ix.query(qr_BSL, pos_BS, attn.freq_F, kernels=kernels)
            comp_idx = attn.index_topk(qI, w_BSh, pos_BS, cache)
            idx_ready = _ready(sc, cache, "index", store and (
                lambda: ix.compressor.write_state(ikv, isc, pos_BS, cache.index, kernels=kernels)))

    q_BSHd, q_raw = attn.q_branch(qr_BSL, pos_BS)
    for ev in (kv_ready, comp_ready, idx_ready):              # the single join before the core
        wait(ev)
    if attn.compressor is not None:
        parts.append((cache.comp.entries_BNd, comp_idx))
    if hold:
        for _, idx in parts:
            keep_alive(idx, main)
        keep_alive(win_src, main)
    return FrontEnd(q_BSHd=q_BSHd, parts=parts, q_raw=q_raw)

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
                                 by default, fp32 with MOE_WAVE_LL_PARTIAL=fp32)
    ntok / dflag / wflag / pflag [P] int64: tokens src dispatched, and the three exchanges' flags (call numbers)

Dispatch (``_ZN8moe_wave8dispatchEv``; the profilers demangle it to ``moe_wave::dispatch()``):

- send: program-strided over the tokens, each token's row (FP8-cast where asked: DeepEP's per-128-channel
  ``amax / 448`` scales, or powers of two with ``round_scale``) goes once to every rank that holds one of its
  experts, and its top-k ids with its slots (the tokens before it with the same expert) to every rank. The last
  program to finish (an arrival counter) writes each rank its per-expert counts (a histogram of the ids), N, and
  then the call number into that rank's flag for this rank, with release semantics at system scope.
- receive: every program waits (acquire, bounded) for every live rank's flag, then takes received tokens (s, t):
  the slot of token t in local expert i is its slot among s's tokens plus the counts of the sources before s
  (sources in rank order, each source's tokens in order), so the layout is deterministic and needs no atomics.
  The row, its scales (column-major float32 [e, S, PT], or UE8M0 bytes in int32 [e, S / 4, PT]) and t go to every
  slot; the last program writes the counts, DeepEP's ``layout_range`` and the statistics. Each (s, t, k) slot is
  kept (``posmap``) for the combine.

Combine (``_ZN8moe_wave7combineEv``), three steps:

- weights: each token's top-k weights to every rank (flag ``wflag``);
- partials: on the expert side, each received token's weighted sum over its slots here (fp32, top-k order) goes
  to its source rank's ``part`` (flag ``pflag``); the sources are taken in turn from this rank, each source's
  weights awaited only when its first token comes up, so this rank's own sums start before a peer's weights land; the weights travel (K floats a token), the expert rows do not
  (one row per (token, rank) instead of one per (token, expert));
- receive: each token's partials summed in rank order (fp32), stored in the output's dtype.

Phases: without a receive hook a call is one launch (send, then receive); with one, the call launches the send
(dispatch) or the weights and partials (combine) and the hook the receive. ``_ZN8moe_wave8dispatchEv`` and
``_ZN8moe_wave7combineEv`` are the only kernels a call launches.

Flags never need resetting: a call number c per (set, exchange) lives on the device (``state``); a sender stores c,
a receiver waits until the flag holds at least c. Ranks call in the same order, so their numbers agree; graph
replays advance them. A region is rewritten only two calls later (two sets, in turn), after every rank has read it:
a rank reaches its next use of a set only through exchanges that need every peer's progress past the last one.

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
import os
from dataclasses import dataclass, field

import torch

from moe_wave.comm.symm_signal import SPINS_PER_MS, globaltimer
from moe_wave.comm.triton_gate import interpreting, sm_count, tl, triton

from .ll_kernels import fp8_scales
from .triton_launch import Launcher, spec

__all__ = ["Region", "DirectLL", "region_layout", "dispatch_launch", "combine_launch", "num_programs", "ST"]

# state words (int64) per buffer set
ST_DCALL, ST_CCALL, ST_DARR, ST_WARR, ST_PARR = 0, 1, 2, 3, 4
ST = 8
# the partial sums' wire type: bf16 (the default: half the bytes, one rounding more than DeepEP's fp32 sum of bf16
# rows) or fp32
PARTIAL_ENV = "MOE_WAVE_LL_PARTIAL"
# fault words: poison, the peer, the call, the site (1 dispatch, 2 combine weights, 3 combine partials)
FAULT_WORDS = 4
_ALIGN = 256


def region_layout(P: int, T: int, H: int, K: int, E: int) -> dict:
    """Byte offsets of one buffer set's region (see the module docstring), and its size ``"bytes"``."""
    off, lay = 0, {}
    for name, nbytes in (("rows", P * T * 2 * H), ("ids", P * T * 2 * K * 4), ("cnt", P * (E // P) * 4),
                         ("w", P * T * K * 4),
                         ("part", P * T * H * 4), ("ntok", P * 8), ("dflag", P * 8), ("wflag", P * 8),
                         ("pflag", P * 8)):
        lay[name] = off
        off += -(-nbytes // _ALIGN) * _ALIGN
    lay["bytes"] = off
    return lay


if triton is not None:

    @triton.jit
    def _stamp(times_ptr, slot: tl.constexpr, TIMES: tl.constexpr, FIRST: tl.constexpr):
        """(``TIMES``, a measurement build) the GPU's global timer into word ``slot``: the earliest program's
        (``FIRST``, word reset to INT64_MAX) or the latest's (reset to 0)."""
        if TIMES:
            now = globaltimer()
            if FIRST:
                tl.atomic_min(times_ptr + slot, now)
            else:
                tl.atomic_max(times_ptr + slot, now)

    @triton.jit
    def _wait(flag_ptr, target, limit, CLOCK: tl.constexpr):
        """Wait (acquire, system scope) until ``*flag_ptr >= target``; False after ``limit`` (ns or spins)."""
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        n = target * 0
        if CLOCK:
            t0 = globaltimer()
        while (seen < target) & (n < limit):
            seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            if CLOCK:
                n = globaltimer() - t0
            else:
                n += 1
        return seen >= target

    @triton.jit
    def _wait_rank(flags, p, c, mask_ptr, fault_addr, limit, site: tl.constexpr, CLOCK: tl.constexpr):
        """Wait for rank p's flag (``flags + p``) to reach c, unless p is masked; a rank that does not arrive is masked
        and recorded in the fault words."""
        if tl.load(mask_ptr + p, volatile=True) == 0:
            arrived = _wait(flags + p, c, limit, CLOCK)
            if arrived.to(tl.int32) == 0:
                tl.atomic_xchg(mask_ptr + p, 1)
                fault = fault_addr.to(tl.pointer_type(tl.int64))
                if tl.load(fault, volatile=True) == 0:
                    tl.store(fault + 1, p * tl.full([], 1, tl.int64))
                    tl.store(fault + 2, c)
                    tl.store(fault + 3, tl.full([], site, tl.int64))
                    tl.store(fault, 1)

    @triton.jit
    def _flags(tab_ptr, set_off, flag_off, me):
        """This rank's row of flags at ``flag_off`` (slot p: rank p's call number)."""
        return (tl.load(tab_ptr + me).to(tl.pointer_type(tl.uint8)) + set_off + flag_off).to(tl.pointer_type(tl.int64))

    @triton.jit
    def _wait_all(tab_ptr, set_off, flag_off, me, c, mask_ptr, fault_addr, limit, site: tl.constexpr,
                  P: tl.constexpr, CLOCK: tl.constexpr):
        """Wait for every live rank's flag (slot p of this rank's ``flag_off`` row) to reach c (``_wait_rank``)."""
        flags = _flags(tab_ptr, set_off, flag_off, me)
        for p in range(P):
            _wait_rank(flags, p, c, mask_ptr, fault_addr, limit, site, CLOCK)

    @triton.jit
    def _arrive_and_signal(state_ptr, arr_word: tl.constexpr, call_word: tl.constexpr, store_call: tl.constexpr,
                           tab_ptr, set_off, flag_off: tl.constexpr, ntok_off: tl.constexpr, n, me, c, mask_ptr,
                           P: tl.constexpr, P_PAD: tl.constexpr, SIGNAL: tl.constexpr, call):
        """Count this program in; the last one (``SIGNAL``) stores (``ntok_off`` >= 0: n, then) c into slot ``me``
        of every live rank's ``flag_off`` row (release, system scope), and (``store_call``) ``call`` as the set's
        call number."""
        tl.debug_barrier()
        old = tl.atomic_add(state_ptr + arr_word, 1, sem="acq_rel", scope="sys")
        if old == tl.num_programs(0) - 1:
            tl.store(state_ptr + arr_word, 0)
            pp = tl.arange(0, P_PAD)
            live = (pp < P) & (tl.load(mask_ptr + pp, mask=pp < P, other=1) == 0)
            base = tl.load(tab_ptr + pp, mask=pp < P, other=0).to(tl.pointer_type(tl.uint8)) + set_off
            if SIGNAL:
                if ntok_off >= 0:
                    tl.store((base + ntok_off).to(tl.pointer_type(tl.int64)) + me, tl.zeros([P_PAD], tl.int64) + n,
                             mask=live)
                tl.atomic_xchg((base + flag_off).to(tl.pointer_type(tl.int64)) + me, tl.zeros([P_PAD], tl.int64) + c,
                               mask=live, sem="release", scope="sys")
            if store_call:
                tl.store(state_ptr + call_word, call)

    @triton.jit
    def _ZN8moe_wave8dispatchEv(
            x_ptr, sx, ids_ptr, sid, N, tab_ptr, set_off, me, mask_ptr, state_ptr, fault_addr, limit,
            out_ptr, sc_ptr, info_ptr, count_ptr, range_ptr, stats_ptr, posmap_ptr, nrecv_ptr, hist_ptr, times_ptr,
            P: tl.constexpr, T: tl.constexpr, H: tl.constexpr, K: tl.constexpr, E_LOC: tl.constexpr,
            O_ROWS: tl.constexpr, O_IDS: tl.constexpr, O_CNT: tl.constexpr, O_NTOK: tl.constexpr,
            O_FLAG: tl.constexpr, SEND: tl.constexpr, RECV: tl.constexpr, FP8: tl.constexpr, ROUND: tl.constexpr,
            UE8M0: tl.constexpr, STATS: tl.constexpr, CLOCK: tl.constexpr,
            P_PAD: tl.constexpr, K_PAD: tl.constexpr, TB: tl.constexpr, G: tl.constexpr,
            SP: tl.constexpr, NB: tl.constexpr, NBE: tl.constexpr, FB: tl.constexpr, WS: tl.constexpr,
            WR: tl.constexpr, TIMES: tl.constexpr):
        # addresses passed as ints (the launcher takes them as they are; a tensor costs it a driver query)
        times_ptr = times_ptr.to(tl.pointer_type(tl.int64))
        _stamp(times_ptr, 0, TIMES, True)
        tab_ptr = tab_ptr.to(tl.pointer_type(tl.int64))
        mask_ptr = mask_ptr.to(tl.pointer_type(tl.int32))
        state_ptr = state_ptr.to(tl.pointer_type(tl.int64))
        info_ptr = info_ptr.to(tl.pointer_type(tl.int32))
        count_ptr = count_ptr.to(tl.pointer_type(tl.int32))
        range_ptr = range_ptr.to(tl.pointer_type(tl.int64))
        posmap_ptr = posmap_ptr.to(tl.pointer_type(tl.int32))
        nrecv_ptr = nrecv_ptr.to(tl.pointer_type(tl.int32))
        hist_ptr = hist_ptr.to(tl.pointer_type(tl.int32))
        if UE8M0:
            sc_ptr = sc_ptr.to(tl.pointer_type(tl.uint8))
        else:
            sc_ptr = sc_ptr.to(tl.pointer_type(tl.float32))
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        one = tl.full([], 1, tl.int64)                # int64 arithmetic on loop indices
        c = tl.load(state_ptr + 0)                    # state word 0: the set's dispatch call number
        if SEND:
            c = c + 1
        RB: tl.constexpr = 2 * H                      # row bytes in the region
        S: tl.constexpr = H // 128
        PT: tl.constexpr = P * T
        kk = tl.arange(0, K_PAD)
        km = kk < K
        pp = tl.arange(0, P_PAD)
        pm = pp < P
        tt = tl.arange(0, TB)
        if SEND:
            # every rank's region of this set, and whether it is live (not masked)
            bases = tl.load(tab_ptr + pp, mask=pm, other=0).to(tl.pointer_type(tl.uint8)) + set_off
            live = pm & (tl.load(mask_ptr + pp, mask=pm, other=1) == 0)
            for t in range(pid, N, nprog):
                ids = tl.load(ids_ptr + t * sid + kk, mask=km, other=-1).to(tl.int32)
                dst = tl.where(ids >= 0, ids // E_LOC, -1)
                hit = (tl.sum((dst[None, :] == pp[:, None]).to(tl.int32), 1) > 0) & live     # [P_PAD]
                # the token's slot among this rank's tokens of each of its experts: the tokens before it with it
                before = tl.zeros([K_PAD], tl.int32)
                for t0 in range(0, t, TB):
                    tm = (t0 + tt) < t
                    blk = tl.load(ids_ptr + (t0 + tt)[:, None] * sid + kk[None, :], mask=tm[:, None] & km[None, :],
                                  other=-1).to(tl.int32)                                          # [TB, K_PAD]
                    before += tl.sum(tl.sum((blk[:, :, None] == ids[None, None, :]).to(tl.int32), 0), 0)
                slot = (me * T + t) * one
                idp = (bases + O_IDS).to(tl.pointer_type(tl.int32)) + slot * (2 * K)              # [ids | slots]
                tl.store(idp[:, None] + kk[None, :], tl.broadcast_to(ids[None, :], [P_PAD, K_PAD]),
                         mask=live[:, None] & km[None, :])
                tl.store(idp[:, None] + K + kk[None, :], tl.broadcast_to(before[None, :], [P_PAD, K_PAD]),
                         mask=live[:, None] & km[None, :])
                # the row, once per rank that holds one of its experts: computed (FP8) or read (bf16, as 8-byte words)
                # once, stored per rank
                if FP8:
                    gg = tl.arange(0, G)
                    ch = tl.arange(0, 128)
                    for s0 in range(0, S, G):
                        gm = (s0 + gg) < S
                        v = tl.load(x_ptr + t * sx + (s0 + gg)[:, None] * 128 + ch[None, :], mask=gm[:, None],
                                    other=0.0).to(tl.float32)                                    # [G, 128]
                        amax = tl.maximum(tl.max(tl.abs(v), 1), 1e-4)
                        scale, scale_inv = fp8_scales(amax, ROUND)
                        q = tl.reshape((v * scale[:, None]).to(tl.float8e4nv), [G * 128])
                        qo = s0 * 128 + tl.arange(0, G * 128)
                        for p in range(P):
                            if tl.sum(tl.where(pp == p, hit.to(tl.int32), 0), 0) > 0:
                                rowp = tl.load(tab_ptr + p).to(tl.pointer_type(tl.uint8)) + set_off + O_ROWS + \
                                    slot * RB
                                tl.store(rowp.to(tl.pointer_type(tl.float8e4nv)) + qo, q, mask=qo < H)
                                tl.store((rowp + H).to(tl.pointer_type(tl.float32)) + s0 + gg, scale_inv, mask=gm)
                else:
                    xw = (x_ptr + t * sx).to(tl.pointer_type(tl.int64))              # the row as 8-byte words
                    for w0 in range(0, H // 4, WS):
                        wo = w0 + tl.arange(0, WS)
                        wm = wo < H // 4
                        v = tl.load(xw + wo, mask=wm)
                        for p in range(P):
                            if tl.sum(tl.where(pp == p, hit.to(tl.int32), 0), 0) > 0:
                                rowp = tl.load(tab_ptr + p).to(tl.pointer_type(tl.uint8)) + set_off + O_ROWS + \
                                    slot * RB
                                tl.store(rowp.to(tl.pointer_type(tl.int64)) + wo, v, mask=wm)
            # program 0: this rank's count of each rank's local experts (one histogram of every id, bin E: none,
            # through a local scratch row, then each rank's slice)
            if pid == 0:
                hb = tl.arange(0, NBE)
                ff = tl.arange(0, FB)
                h = tl.zeros([NBE], tl.int32)
                for f0 in range(0, N * K, FB):
                    f = f0 + ff
                    fm = f < N * K
                    g = tl.load(ids_ptr + (f // K) * sid + f % K, mask=fm, other=-1).to(tl.int32)
                    h += tl.histogram(tl.where(fm & (g >= 0), g, NBE - 1), NBE)
                tl.store(hist_ptr + hb, h)
                tl.debug_barrier()
                bb = tl.arange(0, NB)
                for p in range(P):
                    if tl.load(mask_ptr + p) == 0:
                        cnt = (tl.load(tab_ptr + p).to(tl.pointer_type(tl.uint8)) + set_off + O_CNT)
                        tl.store(cnt.to(tl.pointer_type(tl.int32)) + me * E_LOC + bb,
                                 tl.load(hist_ptr + p * E_LOC + bb, mask=bb < E_LOC), mask=bb < E_LOC)
            _stamp(times_ptr, 1, TIMES, False)
            # the last program to finish: N, then the flag (release: everything written before it), per rank
            tl.debug_barrier()
            old = tl.atomic_add(state_ptr + 2, 1, sem="acq_rel", scope="sys")     # state word 2: arrivals
            if old == nprog - 1:
                tl.store(state_ptr + 2, 0)
                base = tl.load(tab_ptr + pp, mask=pm, other=0).to(tl.pointer_type(tl.uint8)) + set_off
                tl.store((base + O_NTOK).to(tl.pointer_type(tl.int64)) + me, tl.zeros([P_PAD], tl.int64) + N,
                         mask=live)
                tl.atomic_xchg((base + O_FLAG).to(tl.pointer_type(tl.int64)) + me, tl.zeros([P_PAD], tl.int64) + c,
                               mask=live, sem="release", scope="sys")
                tl.store(state_ptr + 0, c)
                _stamp(times_ptr, 2, TIMES, False)
        if RECV:
            _wait_all(tab_ptr, set_off, O_FLAG, me, c, mask_ptr, fault_addr, limit, 1, P, CLOCK)
            _stamp(times_ptr, 3, TIMES, False)
            mine = tl.load(tab_ptr + me).to(tl.pointer_type(tl.uint8)) + set_off
            ids_reg = (mine + O_IDS).to(tl.pointer_type(tl.int32))
            cnt_reg = (mine + O_CNT).to(tl.pointer_type(tl.int32))
            ntok_reg = (mine + O_NTOK).to(tl.pointer_type(tl.int64))
            lo = me * E_LOC
            # received tokens (s, t): their slots, rows, scales and source indices
            for item in range(pid, PT, nprog):
                s = item // T
                t = item % T
                n_s = tl.where(tl.load(mask_ptr + s, volatile=True) == 0, tl.load(ntok_reg + s), 0).to(tl.int32)
                if t < n_s:
                    src = mine + O_ROWS + (s * T + t) * one * RB
                    NW: tl.constexpr = H // 8 if FP8 else H // 4        # the row in 8-byte words
                    # the row's first words and its scales are read before the slots are known (no dependency)
                    w_first = tl.arange(0, WR)
                    v_first = tl.load(src.to(tl.pointer_type(tl.int64)) + w_first, mask=w_first < NW)
                    if FP8:
                        ss = tl.arange(0, SP)
                        sm = ss < S
                        sc = tl.load((src + H).to(tl.pointer_type(tl.float32)) + ss, mask=sm, other=1.0)
                    msg = ids_reg + (s * T + t) * (2 * K)
                    g = tl.load(msg + kk, mask=km, other=-1)
                    loc = g - lo
                    ok = km & (g >= 0) & (loc >= 0) & (loc < E_LOC)
                    # slot = the tokens of earlier sources with the expert, then this token's slot in its source
                    slot = tl.load(msg + K + kk, mask=ok, other=0)
                    for s2 in range(0, s):
                        live2 = (tl.load(mask_ptr + s2, volatile=True) == 0).to(tl.int32)
                        slot += live2 * tl.load(cnt_reg + s2 * E_LOC + loc, mask=ok, other=0)
                    dest = loc.to(tl.int64) * PT + slot                                         # [K_PAD]
                    tl.store(posmap_ptr + (s * T + t) * K + kk, tl.where(ok, dest, -1).to(tl.int32), mask=km)
                    tl.store(info_ptr + dest, tl.zeros([K_PAD], tl.int32) + t, mask=ok)
                    # the row as 8-byte words (H / 8 of FP8, H / 4 of bf16) to each of its slots
                    ow = out_ptr.to(tl.pointer_type(tl.int64))
                    tl.store(ow + dest[:, None] * NW + w_first[None, :], tl.broadcast_to(v_first[None, :], [K_PAD, WR]),
                             mask=ok[:, None] & (w_first < NW)[None, :])
                    for w0 in range(WR, NW, WR):
                        wo = w0 + tl.arange(0, WR)
                        wm = wo < NW
                        v = tl.load(src.to(tl.pointer_type(tl.int64)) + wo, mask=wm)
                        tl.store(ow + dest[:, None] * NW + wo[None, :], tl.broadcast_to(v[None, :], [K_PAD, WR]),
                                 mask=ok[:, None] & wm[None, :])
                    if FP8:
                        sl = slot.to(tl.int64)
                        if UE8M0:   # exponent byte s of int32 group s // 4, column-major [e, S / 4, PT] int32
                            byte = ((sc.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)
                            adr = loc.to(tl.int64)[:, None] * (S * PT) + (ss // 4)[None, :] * (PT * 4) + \
                                sl[:, None] * 4 + (ss % 4)[None, :]
                            tl.store(sc_ptr + adr, tl.broadcast_to(byte[None, :], [K_PAD, SP]),
                                     mask=ok[:, None] & sm[None, :])
                        else:       # column-major [e, S, PT] float32
                            adr = loc.to(tl.int64)[:, None] * (S * PT) + ss[None, :] * PT + sl[:, None]
                            tl.store(sc_ptr + adr, tl.broadcast_to(sc[None, :], [K_PAD, SP]),
                                     mask=ok[:, None] & sm[None, :])
                else:
                    tl.store(posmap_ptr + (s * T + t) * K + kk, tl.full([K_PAD], -1, tl.int32), mask=km)
                if t == 0:
                    tl.store(nrecv_ptr + s, n_s)
            # the last program: per local expert the counts, DeepEP's layout_range (begin << 32 | count per
            # source, sources in rank order), the statistics
            if pid == nprog - 1:
                ee = tl.arange(0, NB)
                em = ee < E_LOC
                live = pm & (tl.load(mask_ptr + pp, mask=pm, other=1) == 0)
                cnt = tl.load(cnt_reg + pp[:, None] * E_LOC + ee[None, :], mask=live[:, None] & em[None, :],
                              other=0).to(tl.int64)                                              # [P_PAD, NB]
                begin = tl.cumsum(cnt, 0) - cnt
                tl.store(range_ptr + ee[None, :] * P + pp[:, None], (begin << 32) | cnt,
                         mask=pm[:, None] & em[None, :])
                total = tl.sum(cnt, 0)
                tl.store(count_ptr + ee, total.to(tl.int32), mask=em)
                if STATS:
                    tl.store(stats_ptr + ee, tl.load(stats_ptr + ee, mask=em) + total.to(stats_ptr.dtype.element_ty),
                             mask=em)
        _stamp(times_ptr, 4, TIMES, False)

    @triton.jit
    def _ZN8moe_wave7combineEv(
            y_ptr, sy, ids_ptr, sid, w_ptr, sw, N, tab_ptr, set_off, me, mask_ptr, state_ptr, fault_addr, limit,
            out_ptr, so, posmap_ptr, nrecv_ptr, times_ptr,
            P: tl.constexpr, T: tl.constexpr, H: tl.constexpr, K: tl.constexpr, E_LOC: tl.constexpr,
            O_W: tl.constexpr, O_PART: tl.constexpr, O_WFLAG: tl.constexpr, O_PFLAG: tl.constexpr,
            WEIGHTS: tl.constexpr, PARTIALS: tl.constexpr, RECV: tl.constexpr, PART_BF16: tl.constexpr,
            CLOCK: tl.constexpr, P_PAD: tl.constexpr, K_PAD: tl.constexpr, BH: tl.constexpr, BR: tl.constexpr,
            TW: tl.constexpr, TIMES: tl.constexpr, STAGES: tl.constexpr):
        tab_ptr = tab_ptr.to(tl.pointer_type(tl.int64))          # addresses passed as ints
        times_ptr = times_ptr.to(tl.pointer_type(tl.int64))
        _stamp(times_ptr, 0, TIMES, True)
        mask_ptr = mask_ptr.to(tl.pointer_type(tl.int32))
        state_ptr = state_ptr.to(tl.pointer_type(tl.int64))
        posmap_ptr = posmap_ptr.to(tl.pointer_type(tl.int32))
        nrecv_ptr = nrecv_ptr.to(tl.pointer_type(tl.int32))
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        one = tl.full([], 1, tl.int64)                # int64 arithmetic on loop indices
        c = tl.load(state_ptr + 1)                    # state word 1: the set's combine call number
        if WEIGHTS:
            c = c + 1
        kk = tl.arange(0, K_PAD)
        km = kk < K
        pp = tl.arange(0, P_PAD)
        pm = pp < P
        bases = tl.load(tab_ptr + pp, mask=pm, other=0).to(tl.pointer_type(tl.uint8)) + set_off
        mine = tl.load(tab_ptr + me).to(tl.pointer_type(tl.uint8)) + set_off
        if WEIGHTS:     # program 0: every token's weights (0 where its id is -1) to every live rank, then the flags
            if pid == 0:
                live = pm & (tl.load(mask_ptr + pp, mask=pm, other=1) == 0)
                tw = tl.arange(0, TW)
                for t0 in range(0, N, TW):
                    tm = (t0 + tw) < N
                    m2 = tm[:, None] & km[None, :]
                    ids = tl.load(ids_ptr + (t0 + tw)[:, None] * sid + kk[None, :], mask=m2, other=-1)
                    w = tl.where(ids >= 0, tl.load(w_ptr + (t0 + tw)[:, None] * sw + kk[None, :], mask=m2, other=0.0),
                                 0.0)
                    for p in range(P):
                        if tl.load(mask_ptr + p) == 0:
                            wp = (tl.load(tab_ptr + p).to(tl.pointer_type(tl.uint8)) + set_off + O_W)
                            wp = wp.to(tl.pointer_type(tl.float32)) + (me * T + t0) * K
                            tl.store(wp + tw[:, None] * K + kk[None, :], w, mask=m2)
                tl.debug_barrier()
                tl.atomic_xchg((bases + O_WFLAG).to(tl.pointer_type(tl.int64)) + me, tl.zeros([P_PAD], tl.int64) + c,
                               mask=live, sem="release", scope="sys")
                _stamp(times_ptr, 1, TIMES, False)
            if not PARTIALS:    # (a launch of the weights alone) the call number, once every program has read it
                _arrive_and_signal(state_ptr, 3, 1, True, tab_ptr, set_off, O_WFLAG, -1, 0, me, c, mask_ptr, P,
                                   P_PAD, False, c)
        if PARTIALS:    # expert side: each received token's weighted sum over its slots here, to its source
            # sources in turn from this rank (whose weights need no hop), each waited for when first needed
            wflags = _flags(tab_ptr, set_off, O_WFLAG, me)
            waited = tl.zeros([], tl.int64)                 # bit s: source s's weights are here
            wreg = (mine + O_W).to(tl.pointer_type(tl.float32))
            for item in range(pid, P * T, nprog):
                s = (item // T + me) % P
                t = item % T
                if ((waited >> s) & 1) == 0:
                    _wait_rank(wflags, s, c, mask_ptr, fault_addr, limit, 2, CLOCK)
                    waited = waited | (one << s)
                    _stamp(times_ptr, 2, TIMES, False)
                live_s = tl.load(mask_ptr + s, volatile=True) == 0
                if live_s & (t < tl.load(nrecv_ptr + s)):
                    dest = tl.load(posmap_ptr + (s * T + t) * K + kk, mask=km, other=-1)
                    ok = dest >= 0
                    if tl.sum(ok.to(tl.int32), 0) > 0:
                        w = tl.load(wreg + (s * T + t) * K + kk, mask=ok, other=0.0)
                        dst = (tl.load(tab_ptr + s).to(tl.pointer_type(tl.uint8)) + set_off + O_PART)
                        if PART_BF16:
                            dst = dst.to(tl.pointer_type(tl.bfloat16)) + (me * T + t) * one * H
                        else:
                            dst = dst.to(tl.pointer_type(tl.float32)) + (me * T + t) * one * H
                        d64 = tl.maximum(dest, 0).to(tl.int64)
                        for h0 in tl.range(0, H, BH, num_stages=STAGES):
                            offs = h0 + tl.arange(0, BH)
                            hm = offs < H
                            v = tl.load(y_ptr + d64[:, None] * sy + offs[None, :], mask=ok[:, None] & hm[None, :],
                                        other=0.0).to(tl.float32)                                 # [K_PAD, BH]
                            acc = tl.sum(v * w[:, None], 0)
                            tl.store(dst + offs, acc.to(dst.dtype.element_ty), mask=hm)
            _stamp(times_ptr, 3, TIMES, False)
            _arrive_and_signal(state_ptr, 4, 1, True, tab_ptr, set_off, O_PFLAG, -1, 0, me, c,  # word 4
                               mask_ptr, P, P_PAD, True, c)
            _stamp(times_ptr, 4, TIMES, False)
        if RECV:        # source side: each token's partials, summed in rank order
            _wait_all(tab_ptr, set_off, O_PFLAG, me, c, mask_ptr, fault_addr, limit, 3, P, CLOCK)
            _stamp(times_ptr, 5, TIMES, False)
            if PART_BF16:
                part = (mine + O_PART).to(tl.pointer_type(tl.bfloat16))
            else:
                part = (mine + O_PART).to(tl.pointer_type(tl.float32))
            live = pm & (tl.load(mask_ptr + pp, mask=pm, other=1) == 0)
            for t in range(pid, N, nprog):
                ids = tl.load(ids_ptr + t * sid + kk, mask=km, other=-1).to(tl.int32)
                dst = tl.where(ids >= 0, ids // E_LOC, -1)
                has = (tl.sum((dst[None, :] == pp[:, None]).to(tl.int32), 1) > 0) & live           # [P_PAD]
                for h0 in tl.range(0, H, BR, num_stages=STAGES):
                    offs = h0 + tl.arange(0, BR)
                    hm = offs < H
                    v = tl.load(part + (pp.to(tl.int64) * T + t)[:, None] * H + offs[None, :],
                                mask=has[:, None] & hm[None, :], other=0.0).to(tl.float32)
                    tl.store(out_ptr + t * so + offs, tl.sum(v, 0).to(out_ptr.dtype.element_ty), mask=hm)
        _stamp(times_ptr, 6, TIMES, False)


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


_DISPATCH = _COMBINE = None
if triton is not None:      # MOE_WAVE_LL_FAST_LAUNCH=0: every launch through Triton's JIT
    _DISPATCH = Launcher(_ZN8moe_wave8dispatchEv, "MOE_WAVE_LL_FAST_LAUNCH")
    _COMBINE = Launcher(_ZN8moe_wave7combineEv, "MOE_WAVE_LL_FAST_LAUNCH")


# Measurement and tuning hooks (benchmarks/bench_ll.py): ``TIMES`` an int64 [16] device tensor makes the kernels record
# the GPU's global timer at their phase boundaries (``TIME_WORDS`` says which word is what); ``TUNE`` overrides the
# launch's warps, the combine's row blocks (0: the default) and the software pipelining of its row loops (stages).
# Both are part of every launch's cache key.
TIMES: torch.Tensor | None = None
TUNE = {"warps": 16, "bh": 0, "br": 0, "stages": 1}
TIME_WORDS = {"d": ("start", "sent", "signalled", "waited", "end"),
              "c": ("start", "weights sent", "weights waited", "partials sent", "signalled", "partials waited", "end")}


def _knobs() -> tuple:
    return (TIMES is not None, TUNE["warps"], TUNE["bh"], TUNE["br"], TUNE["stages"])


def _times_addr(rg: "Region") -> int:
    return TIMES.data_ptr() if TIMES is not None else rg.sets[0][0]


def _dispatch_consts(rg: Region, send, recv, fp8, round_scale, ue8m0, stats, clock):
    P, T, H, K, e = rg.P, rg.T, rg.H, rg.K, rg.E // rg.P
    lay = rg.lay
    SP = _pad(H // 128)
    return dict(P=P, T=T, H=H, K=K, E_LOC=e, O_ROWS=lay["rows"], O_IDS=lay["ids"], O_CNT=lay["cnt"],
                O_NTOK=lay["ntok"], O_FLAG=lay["dflag"], SEND=send, RECV=recv, FP8=fp8, ROUND=round_scale,
                UE8M0=ue8m0, STATS=stats, CLOCK=clock, P_PAD=_pad(P), K_PAD=_pad(K), TB=min(128, _pad(T)),
                G=min(SP, 64), SP=SP, NB=_pad(e + 1), NBE=_pad(rg.E + 1), FB=1024, WS=min(4096, _pad(H // 4)),
                WR=min(_pad(H // 4), 8192 // _pad(K)), TIMES=TIMES is not None)


def dispatch_launch(rg: Region, set_index: int, me: int, x: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                    fault_addr: int, timeout_ms: int, out: torch.Tensor, scales, info: torch.Tensor,
                    count: torch.Tensor, layout_range: torch.Tensor, stats, *, send: bool, recv: bool, fp8: bool,
                    round_scale: bool, ue8m0: bool, programs: int | None = None) -> None:
    """One dispatch launch (``send`` and/or ``recv``) on the current stream; see the module docstring.

    ``x`` bf16 [N, H] with 8-byte aligned rows; ``out`` is the receive tensor [e, PT, H] (fp8 rows as uint8),
    ``scales`` the physical scale tensor (float32 [e, S, PT] or int32 [e, S / 4, PT]) or None, ``info`` int32
    [e, PT], ``count`` int32 [e], ``layout_range`` int64 [e, P], ``stats`` None or [e]."""
    N = x.shape[0]
    dev = x.device
    ckey = ("d", dev.type, timeout_ms, send, recv, fp8, round_scale, ue8m0, stats is not None, programs,
            N) + _knobs()
    cfg = rg.configs.get(ckey)
    if cfg is None:
        clock, limit = _clock_limit(dev.type, timeout_ms)
        nprog = programs or num_programs(dev, max(N if send else 1, rg.P * rg.T if recv else 1))
        cfg = rg.configs[ckey] = (nprog, limit, _dispatch_consts(rg, send, recv, fp8, round_scale, ue8m0,
                                                                 stats is not None, clock))
    nprog, limit, consts = cfg
    st, posmap, nrecv, hist, set_off = rg.sets[set_index]
    sc = scales if scales is not None else out
    if fp8 and ue8m0:
        sc = sc.view(torch.uint8)
    sx, sid = x.stride(0), ids.stride(0)
    _DISPATCH(nprog, (x, sx, ids, sid, N, rg.tab_addr, set_off, me, mask.data_ptr(), st, fault_addr, limit, out,
                      sc.data_ptr(), info.data_ptr(), count.data_ptr(), layout_range.data_ptr(),
                      stats if stats is not None else count, posmap, nrecv, hist, _times_addr(rg)),
              consts, dict(num_warps=TUNE["warps"]),
              (ckey, rg.geometry, set_index, spec(x), spec(ids), spec(sx), spec(sid), spec(stats), me))


def combine_launch(rg: Region, set_index: int, me: int, y: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                   mask: torch.Tensor, fault_addr: int, timeout_ms: int, out: torch.Tensor, *, weights: bool,
                   partials: bool, recv: bool, part_bf16: bool = True, programs: int | None = None) -> None:
    """One combine launch (any run of its three steps) on the current stream; ``y`` is [e * PT, H] bf16 rows.
    ``part_bf16``: partial sums travel in bf16 (else fp32)."""
    N = ids.shape[0]
    dev = ids.device
    ckey = ("c", dev.type, timeout_ms, weights, partials, recv, part_bf16, programs, N) + _knobs()
    cfg = rg.configs.get(ckey)
    if cfg is None:
        P, T, H, K, e = rg.P, rg.T, rg.H, rg.K, rg.E // rg.P
        clock, limit = _clock_limit(dev.type, timeout_ms)
        nprog = programs or num_programs(dev, max(N, P * T if partials else 1))
        lay = rg.lay
        cfg = rg.configs[ckey] = (nprog, limit, dict(
            P=P, T=T, H=H, K=K, E_LOC=e, O_W=lay["w"], O_PART=lay["part"], O_WFLAG=lay["wflag"],
            O_PFLAG=lay["pflag"], WEIGHTS=weights, PARTIALS=partials, RECV=recv, PART_BF16=part_bf16, CLOCK=clock,
            P_PAD=_pad(P), K_PAD=_pad(K), BH=TUNE["bh"] or min(_pad(H), 16384 // _pad(K)),
            BR=TUNE["br"] or min(_pad(H), 16384 // _pad(P)), TW=min(_pad(T), 4096 // _pad(K)),
            TIMES=TIMES is not None, STAGES=TUNE["stages"]))
    nprog, limit, consts = cfg
    st, posmap, nrecv, _, set_off = rg.sets[set_index]
    sy, sid, sw, so = y.stride(0), ids.stride(0), w.stride(0), out.stride(0)
    _COMBINE(nprog, (y, sy, ids, sid, w, sw, N, rg.tab_addr, set_off, me, mask.data_ptr(), st, fault_addr, limit,
                     out, so, posmap, nrecv, _times_addr(rg)),
             consts, dict(num_warps=TUNE["warps"]),
             (ckey, rg.geometry, set_index, spec(y), spec(ids), spec(w), spec(out), spec(sy), spec(sid), spec(sw),
              spec(so), me))


class DirectLL:
    """The low-latency mode's GPU path on peer memory (see the module docstring): regions per configuration,
    the rank mask and the fault words.

    Args:
        ep: the group (NCCL, ranks of one host); timeout_ms: how long a peer may be late; shrink: DeepEP's
            ``enable_shrink`` (a late rank stays masked, and no error is raised).
    """

    def __init__(self, ep, timeout_ms: int, shrink: bool = False):
        self.ep, self.timeout_ms, self.shrink = ep, int(timeout_ms), bool(shrink)
        part = os.environ.get(PARTIAL_ENV, "bf16")
        if part not in ("bf16", "fp32"):
            raise ValueError(f"{PARTIAL_ENV}={part!r}: must be bf16 or fp32")
        self.part_bf16 = part == "bf16"
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

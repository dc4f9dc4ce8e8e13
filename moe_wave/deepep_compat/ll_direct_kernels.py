"""The low-latency direct kernels (Triton): ``_ZN8moe_wave8dispatchEv`` and ``_ZN8moe_wave7combineEv`` (the profilers
demangle them to ``moe_wave::dispatch()`` and ``moe_wave::combine()``) and their device helpers. The protocol they
implement (regions, flags, call numbers, faults) and their launches are described and made in ``ll_direct``.
"""

from __future__ import annotations

from moe_wave.comm.symm_signal import globaltimer
from moe_wave.comm.triton_gate import tl, triton

from .ll_kernels import fp8_scales

__all__ = ["dispatch_kernel", "combine_kernel"]

dispatch_kernel = combine_kernel = None

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
    def _valid(ids, E):
        """Expert ids as int32, those outside [0, E) as -1 (compared in int64: a cast first could wrap one in)."""
        g = ids.to(tl.int64)
        return tl.where((g >= 0) & (g < E), g, -1).to(tl.int32)

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
            out_ptr, sc_ptr, info_ptr, count_ptr, range_ptr, stats_ptr, posmap_ptr, nrecv_ptr, hist_ptr, gstat_ptr,
            ghost_ptr, times_ptr,
            P: tl.constexpr, T: tl.constexpr, H: tl.constexpr, K: tl.constexpr, E_LOC: tl.constexpr,
            O_ROWS: tl.constexpr, O_IDS: tl.constexpr, O_CNT: tl.constexpr, O_FW: tl.constexpr, O_NTOK: tl.constexpr,
            O_FLAG: tl.constexpr, IDS: tl.constexpr, WORDS: tl.constexpr, NANW: tl.constexpr, SEND: tl.constexpr,
            RECV: tl.constexpr,
            FP8: tl.constexpr, ROUND: tl.constexpr,
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
        gstat_ptr = gstat_ptr.to(tl.pointer_type(tl.int64))       # the guard's status: device, pinned host
        ghost_ptr = ghost_ptr.to(tl.pointer_type(tl.int64))
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
        E: tl.constexpr = P * E_LOC
        ww = tl.arange(0, WORDS)
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
                ids = _valid(tl.load(ids_ptr + t * sid + kk, mask=km, other=-1), E)
                dst = tl.where(ids >= 0, ids // E_LOC, -1)
                hit = (tl.sum((dst[None, :] == pp[:, None]).to(tl.int32), 1) > 0) & live     # [P_PAD]
                # the token's slot among this rank's tokens of each of its experts: the tokens before it with it
                before = tl.zeros([K_PAD], tl.int32)
                for t0 in range(0, t, TB):
                    tm = (t0 + tt) < t
                    blk = _valid(tl.load(ids_ptr + (t0 + tt)[:, None] * sid + kk[None, :],
                                         mask=tm[:, None] & km[None, :], other=-1), E)            # [TB, K_PAD]
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
            # program 0: this rank's count of each rank's local experts (one histogram of every id in [0, E), bin
            # NBE - 1: none, through a local scratch row, then each rank's slice), and its fault words (ids outside
            # [-1, E): their count and the first of them, row-major), to every live rank
            if pid == 0:
                hb = tl.arange(0, NBE)
                ff = tl.arange(0, FB)
                h = tl.zeros([NBE], tl.int32)
                nbad = one * 0
                fbad = one * N * K
                for f0 in range(0, N * K, FB):
                    f = f0 + ff
                    fm = f < N * K
                    g = tl.load(ids_ptr + (f // K) * sid + f % K, mask=fm, other=-1).to(tl.int64)
                    bad = fm & ((g < -1) | (g >= E))
                    h += tl.histogram(tl.where(fm & (g >= 0) & (g < E), g, NBE - 1).to(tl.int32), NBE)
                    nbad += tl.sum(bad.to(tl.int64), 0)
                    fbad = tl.minimum(fbad, tl.min(tl.where(bad, f.to(tl.int64), N * K * one), 0))
                tl.store(hist_ptr + hb, h)
                tl.debug_barrier()
                val = tl.load(ids_ptr + (fbad // K) * sid + fbad % K, mask=nbad > 0, other=0).to(tl.int64)
                word = tl.where(ww == 0, tl.where(nbad > 0, IDS, 0), tl.where(ww == 1, nbad,
                                                                             tl.where(ww == 2, E, val)))
                bb = tl.arange(0, NB)
                for p in range(P):
                    if tl.load(mask_ptr + p) == 0:
                        base_p = tl.load(tab_ptr + p).to(tl.pointer_type(tl.uint8)) + set_off
                        tl.store((base_p + O_CNT).to(tl.pointer_type(tl.int32)) + me * E_LOC + bb,
                                 tl.load(hist_ptr + p * E_LOC + bb, mask=bb < E_LOC), mask=bb < E_LOC)
                        tl.store((base_p + O_FW).to(tl.pointer_type(tl.int64)) + me * WORDS + ww, word)
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
            fw_reg = (mine + O_FW).to(tl.pointer_type(tl.int64))
            lo = me * E_LOC
            # every live rank's fault words, and an earlier call's fault: the rows and scales are stored as NaN
            live_w = pm & (tl.load(mask_ptr + pp, mask=pm, other=1, volatile=True) == 0)
            kinds = tl.load(fw_reg + pp * WORDS, mask=live_w, other=0)
            prior = tl.load(gstat_ptr, volatile=True)
            poison = (tl.sum((kinds != 0).to(tl.int32), 0) > 0) | (prior != 0)
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
                    v_first = tl.where(poison, NANW, tl.load(src.to(tl.pointer_type(tl.int64)) + w_first,
                                                             mask=w_first < NW))
                    if FP8:
                        ss = tl.arange(0, SP)
                        sm = ss < S
                        sc = tl.where(poison, float("nan"),
                                      tl.load((src + H).to(tl.pointer_type(tl.float32)) + ss, mask=sm, other=1.0))
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
                        v = tl.where(poison, NANW, tl.load(src.to(tl.pointer_type(tl.int64)) + wo, mask=wm))
                        tl.store(ow + dest[:, None] * NW + wo[None, :], tl.broadcast_to(v[None, :], [K_PAD, WR]),
                                 mask=ok[:, None] & wm[None, :])
                    if FP8:
                        sl = slot.to(tl.int64)
                        if UE8M0:   # exponent byte s of int32 group s // 4, column-major [e, S / 4, PT] int32
                            byte = ((sc.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)   # NaN: 0xFF
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
                # the first live rank's fault (none recorded before): [kind, rank, count, limit, value, 0] into the
                # guard's status and its pinned host words, the kind last
                hit = live_w & (kinds != 0)
                r = tl.min(tl.where(hit, pp, P), 0)
                if (prior == 0) & (r < P):
                    got = tl.load(fw_reg + r * WORDS + ww)
                    s8 = tl.arange(0, 8)
                    rec = tl.where(s8 == 1, r.to(tl.int64), 0)
                    for j in range(WORDS - 1):
                        rec = tl.where(s8 == j + 2, tl.sum(tl.where(ww == j + 1, got, 0), 0), rec)
                    kind = tl.sum(tl.where(ww == 0, got, 0), 0)
                    tl.store(gstat_ptr + s8, rec, mask=(s8 > 0) & (s8 < 6))
                    tl.store(ghost_ptr + s8, rec, mask=(s8 > 0) & (s8 < 6))
                    tl.store(gstat_ptr, kind)
                    tl.store(ghost_ptr, kind)
        _stamp(times_ptr, 4, TIMES, False)

    @triton.jit
    def _ZN8moe_wave7combineEv(
            y_ptr, sy, ids_ptr, sid, w_ptr, sw, N, tab_ptr, set_off, me, mask_ptr, state_ptr, fault_addr, limit,
            out_ptr, so, posmap_ptr, nrecv_ptr, gstat_ptr, times_ptr,
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
            flagged = tl.load(gstat_ptr.to(tl.pointer_type(tl.int64)), volatile=True) != 0  # the guard: NaN
            for t in range(pid, N, nprog):
                ids = _valid(tl.load(ids_ptr + t * sid + kk, mask=km, other=-1), P * E_LOC)
                dst = tl.where(ids >= 0, ids // E_LOC, -1)
                has = (tl.sum((dst[None, :] == pp[:, None]).to(tl.int32), 1) > 0) & live           # [P_PAD]
                for h0 in tl.range(0, H, BR, num_stages=STAGES):
                    offs = h0 + tl.arange(0, BR)
                    hm = offs < H
                    v = tl.load(part + (pp.to(tl.int64) * T + t)[:, None] * H + offs[None, :],
                                mask=has[:, None] & hm[None, :], other=0.0).to(tl.float32)
                    acc = tl.where(flagged, float("nan"), tl.sum(v, 0))
                    tl.store(out_ptr + t * so + offs, acc.to(out_ptr.dtype.element_ty), mask=hm)
        _stamp(times_ptr, 6, TIMES, False)

    dispatch_kernel, combine_kernel = _ZN8moe_wave8dispatchEv, _ZN8moe_wave7combineEv

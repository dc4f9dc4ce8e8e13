"""Normal mode's direct kernels: one Triton launch per dispatch, one per combine, one for the layout.

Legend: T local tokens, P ranks, me this rank, K top-k, E experts (e = E / P local), H hidden, X received rows
(compact), Xc the region capacity (rows, the same on every rank), N channels, R rows per chunk (tokens), WA / WB
the words (int32) of a row's two parts: A the payload (bf16 / fp16 / fp32 / fp8 bytes), B the small part (fp8
scales and, on a dispatch that is not cached, the top-k ids, weights and the source token index).

Each rank owns, in symmetric memory (``NormalState``): a control block of int64 words (per kind, dispatch and
combine: progress flags [P(src), NCH_MAX] and acks [P]), a dispatch region [Xc, SA + SB] words (row j: compact row
j, the order of DeepEP's output) and a combine region [P(expert rank), Xc, SH] in the rows' dtype, then [P, Xc, SK]
fp32 (the top-k weights).

Dispatch (``dispatch``): sender programs take units (destination d, channel c): channel c is the token range
[c * per, (c + 1) * per), per = ceil(T / N). A token sent d (``head[t, d] >= 0``, its index among the tokens sent d)
goes to row ``send_base[d] + head[t, d]`` of d's region (send_base[d]: the tokens ranks < me send d), straight
into the output when d == me. After each chunk of R tokens the sender stores ``call * 2^32 + (highest index + 1)``
into flag [me, c] of d's control block (release, system scope, after a CTA barrier). Receiver programs take units
(source s != me, channel c), poll flag [s, c] of their own block (acquire) and copy the rows that have landed
(rows ``recv_base[s] + [rstart[s, c], rend[s, c])``) from the region to the output, as they land.

Combine (``combine``): expert-side programs take units (source s != me, channel c of s): compact row j of that
range (index i = j - recv_base[s] among the rows s sent here) goes to row [me, i] of s's combine region; progress
flags as above (rows done in the channel). Source-side programs take units (channel c, split), in blocks of R
tokens: for each peer p they wait until p has sent its rows of channel c up to the block's last one (rows arrive in
token order: ``head[t, p] + 1 - sstart[p, c]`` rows), then sum each token's rows in rank order (its own row
straight from the local x), in fp32 from 0, then add the biases, and store in x's dtype.

Reuse of the regions: the last program of a launch (a done counter) advances the call number ``seq`` and stores
it in ack slot [me] of every peer's block (release, system scope): "I have read everything you wrote in call k".
A sender of call k waits for d's ack >= k - 1 before it writes d's region. Flags carry the call number, so nothing
is reset on the host and CUDA graphs replay. Every wait is bounded (the GPU's global timer on CUDA, spins under the
interpreter); a peer that does not come is recorded in ``fault`` as [1, peer, call] (the first fault sticks), a
combine's block of R tokens that waited for it in vain is NaN, and ``NormalState.check`` raises it.

``PHASE`` (constexpr): 0 both roles in one launch (the GPU path: the grid is capped by the SM count so every
program is resident and spinning receivers never starve senders); 1 senders only; 2 receivers only, then the
ack. The tests run every rank's phase 1, then every rank's phase 2, in one process under ``TRITON_INTERPRET=1``
(each rank's "symmetric" memory an ordinary CPU tensor), so that no wait blocks.
"""

from __future__ import annotations

import functools
import torch

from moe_wave.comm.triton_gate import interpreting, tl, triton

from .normal_plan import (DEFAULT_CHANNELS, DEFAULT_ROWS, NCH_MAX, DirectPlan, NormalState, channel_counts,
                          device_sms, layout_torch, make_plan, send_heads)
from .triton_launch import Launcher

__all__ = ["NormalState", "DirectPlan", "make_plan", "dispatch_layout", "layout_torch", "dispatch", "combine",
           "NCH_MAX", "BIG", "DEFAULT_CHANNELS", "DEFAULT_ROWS", "last_sms", "channel_counts", "send_heads"]

BIG = 1 << 32               # flag = call * BIG + progress
SPINS_PER_MS = 2000
_LAST: dict = {}            # phase name -> programs of its last launch


def last_sms() -> dict:
    """The programs (SMs: one resident program each, the grid is capped by the device's SM count) of the last
    launch of each normal-mode phase: {"layout": n, "dispatch": n, "combine": n}."""
    return dict(_LAST)


if triton is not None:
    try:
        from triton.language.extra.cuda import globaltimer
    except ImportError:  # pragma: no cover - depends on the Triton build
        globaltimer = None

    @triton.jit
    def _copy(src_ptr, src_rows, src_sr, src_sc, dst_ptr, dst_rows, dst_sr, valid, W, BLOCK: tl.constexpr,
              CG: tl.constexpr):
        for w0 in range(0, W, BLOCK):
            cols = w0 + tl.arange(0, BLOCK)
            m = valid[:, None] & (cols < W)[None, :]
            src = src_ptr + src_rows[:, None] * src_sr + cols[None, :] * src_sc
            if CG:
                v = tl.load(src, mask=m, cache_modifier=".cg")
            else:
                v = tl.load(src, mask=m)
            tl.store(dst_ptr + dst_rows[:, None] * dst_sr + cols[None, :], v, mask=m)

    @triton.jit
    def _wait_at_least(ptr, want, limit, fault_ptr, CLOCK: tl.constexpr):
        """Acquire-poll ``*ptr`` until it reaches ``want`` or the bound passes; returns the last value seen. Once a
        fault is recorded it does not wait (one missing peer costs one timeout, not one per wait)."""
        seen = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
        n = tl.zeros([], tl.int64)      # int64 whatever the types of want and limit (Triton types an int
        if tl.load(fault_ptr, volatile=True) != 0:    # argument by its value: int32 or int64)
            n = n + limit
        if CLOCK:
            t0 = globaltimer()
        while (seen < want) & (n < limit):
            seen = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
            if CLOCK:
                n = globaltimer() - t0
            else:
                n += 1
        return seen

    @triton.jit
    def _fault(fault_ptr, peer, call):
        if tl.load(fault_ptr) == 0:
            tl.store(fault_ptr + 1, peer)
            tl.store(fault_ptr + 2, call)
            tl.store(fault_ptr, 1)

    @triton.jit
    def _finish(ctrl_ptr, c8_ptr, word_ptr, target, me, P, ACKS, NPROG):
        """The last program of the launch: advance the call number, ack every peer (their region reads are done)."""
        tl.debug_barrier()          # every thread's reads of the region are done before the count (and the ack)
        old = tl.atomic_add(word_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if old == NPROG - 1:
            tl.store(word_ptr + 1, 0)
            tl.store(word_ptr, target)
            for p in range(P):
                if p != me:
                    peer = ctrl_ptr + tl.load(c8_ptr + p)
                    tl.atomic_xchg(peer + ACKS + me, target, sem="release", scope="sys")

    @triton.jit
    def _dispatch_kernel(a_ptr, WA, b_ptr, b_sr, b_sc, WB, reg_ptr, d16_ptr, SA, SB, RB, oa_ptr, ob_ptr,
                         head_ptr, tab_ptr, ctrl_ptr, c8_ptr, word_ptr, fault_ptr,
                         me, P, Q, T, per, NCH, n_send, n_recv, limit, NPROG,
                         HAS_B: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, ROWS: tl.constexpr,
                         NSEND: tl.constexpr, NRECV: tl.constexpr, PHASE: tl.constexpr, CLOCK: tl.constexpr,
                         NCHM: tl.constexpr):
        pid = tl.program_id(0)
        if PHASE == 2:
            pid += NSEND
        target = tl.load(word_ptr) + 1
        base = target * 4294967296
        ACKS = P * NCHM
        r_ar = tl.arange(0, ROWS)
        if pid < NSEND:
            for u in range(pid, n_send, NSEND):
                c = u // P
                d = (me + 1 + u % P) % P
                row0 = tl.load(tab_ptr + d).to(tl.int64)
                t0 = c * per
                t1 = tl.minimum(t0 + per, T)
                if d == me:
                    for tb in range(t0, t1, ROWS):
                        toks = tb + r_ar
                        h = tl.load(head_ptr + toks.to(tl.int64) * P + d, mask=toks < t1, other=-1)
                        ok = h >= 0
                        dst = row0 + h.to(tl.int64)
                        _copy(a_ptr, toks.to(tl.int64), WA, 1, oa_ptr, dst, WA, ok, WA, BLOCK_A, False)
                        if HAS_B:
                            _copy(b_ptr, toks.to(tl.int64), b_sr, b_sc, ob_ptr, dst, WB, ok, WB, BLOCK_B, False)
                else:
                    seen = _wait_at_least(ctrl_ptr + ACKS + d, target - 1, limit, fault_ptr, CLOCK)
                    if seen < target - 1:
                        _fault(fault_ptr, d, target)
                    tl.debug_barrier()      # no thread writes d's region before d's ack was seen
                    dreg = reg_ptr + tl.load(d16_ptr + d) * 4
                    flag = ctrl_ptr + tl.load(c8_ptr + d) + me * NCHM + c
                    hi = target * 0
                    for tb in range(t0, t1, ROWS):
                        toks = tb + r_ar
                        h = tl.load(head_ptr + toks.to(tl.int64) * P + d, mask=toks < t1, other=-1)
                        ok = h >= 0
                        dst = row0 + h.to(tl.int64)
                        _copy(a_ptr, toks.to(tl.int64), WA, 1, dreg, dst, SA, ok, WA, BLOCK_A, False)
                        if HAS_B:
                            _copy(b_ptr, toks.to(tl.int64), b_sr, b_sc, dreg + RB, dst, SB, ok, WB, BLOCK_B, False)
                        hi = tl.maximum(hi, tl.max(h, 0).to(tl.int64) + 1)
                        tl.debug_barrier()
                        tl.atomic_xchg(flag, base + hi, sem="release", scope="sys")
        else:
            mine = reg_ptr + tl.load(d16_ptr + me) * 4
            for u in range(pid - NSEND, n_recv, NRECV):
                c = u // Q
                s = (me + 1 + u % Q) % P
                r0 = tl.load(tab_ptr + P + s).to(tl.int64)
                st = tl.load(tab_ptr + 2 * P + s * NCH + c).to(tl.int64)
                en = tl.load(tab_ptr + 2 * P + P * NCH + s * NCH + c).to(tl.int64)
                flag = ctrl_ptr + s * NCHM + c
                done = st
                n = tl.zeros([], tl.int64)
                if tl.load(fault_ptr, volatile=True) != 0:
                    n = n + limit
                if CLOCK:
                    t_0 = globaltimer()
                while (done < en) & (n < limit):
                    f = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
                    avail = tl.minimum(f - base, en)
                    if avail > done:
                        tl.debug_barrier()
                        for rb in range(done, avail, ROWS):
                            rows = rb + r_ar
                            ok = rows < avail
                            j = r0 + rows
                            _copy(mine, j, SA, 1, oa_ptr, j, WA, ok, WA, BLOCK_A, True)
                            if HAS_B:
                                _copy(mine + RB, j, SB, 1, ob_ptr, j, WB, ok, WB, BLOCK_B, True)
                        done = avail
                    if CLOCK:
                        n = globaltimer() - t_0
                    else:
                        n += 1
                if done < en:
                    _fault(fault_ptr, s, target)
        if PHASE != 1:
            _finish(ctrl_ptr, c8_ptr, word_ptr, target, me, P, ACKS, NPROG)

    @triton.jit
    def _combine_kernel(y_ptr, H, w_ptr, K, rega_ptr, regb_ptr, d16_ptr, SH, SK, XC, out_ptr, ow_ptr,
                        b0_ptr, b1_ptr, head_ptr, tab_ptr, ctrl_ptr, c8_ptr, word_ptr, fault_ptr,
                        me, P, Q, T, per, NCH, split, n_send, n_recv, limit, NPROG,
                        HAS_W: tl.constexpr, HAS_B0: tl.constexpr, HAS_B1: tl.constexpr, UA: tl.constexpr,
                        BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, ROWS: tl.constexpr, NSEND: tl.constexpr,
                        NRECV: tl.constexpr, PHASE: tl.constexpr, CLOCK: tl.constexpr, NCHM: tl.constexpr):
        pid = tl.program_id(0)
        if PHASE == 2:
            pid += NSEND
        target = tl.load(word_ptr) + 1
        base = target * 4294967296
        ACKS = P * NCHM
        r_ar = tl.arange(0, ROWS)
        if pid < NSEND:     # expert side: rows back to their sources
            for u in range(pid, n_send, NSEND):
                c = u // Q
                s = (me + 1 + u % Q) % P
                r0 = tl.load(tab_ptr + P + s).to(tl.int64)
                st = tl.load(tab_ptr + 2 * P + s * NCH + c).to(tl.int64)
                en = tl.load(tab_ptr + 2 * P + P * NCH + s * NCH + c).to(tl.int64)
                if st < en:
                    seen = _wait_at_least(ctrl_ptr + ACKS + s, target - 1, limit, fault_ptr, CLOCK)
                    if seen < target - 1:
                        _fault(fault_ptr, s, target)
                    tl.debug_barrier()      # no thread writes s's region before s's ack was seen
                    d16 = tl.load(d16_ptr + s)
                    da = rega_ptr + d16 * UA
                    db = regb_ptr + d16 * 4
                    flag = ctrl_ptr + tl.load(c8_ptr + s) + me * NCHM + c
                    for rb in range(st, en, ROWS):
                        rows = rb + r_ar
                        ok = rows < en
                        dst = me * XC + rows
                        _copy(y_ptr, r0 + rows, H, 1, da, dst, SH, ok, H, BLOCK_A, False)
                        if HAS_W:
                            _copy(w_ptr, r0 + rows, K, 1, db, dst, SK, ok, K, BLOCK_B, False)
                        tl.debug_barrier()
                        tl.atomic_xchg(flag, base + tl.minimum(rb + ROWS, en) - st, sem="release", scope="sys")
        else:               # source side: wait for channel c from every peer, then sum
            mine_a = rega_ptr + tl.load(d16_ptr + me) * UA
            mine_b = regb_ptr + tl.load(d16_ptr + me) * 4
            own0 = tl.load(tab_ptr + P + me).to(tl.int64)
            for u in range(pid - NSEND, n_recv, NRECV):
                c = u // split
                sub = u % split
                chunk = tl.cdiv(per, split)
                ts = c * per + sub * chunk
                te = tl.minimum(tl.minimum(ts + chunk, c * per + per), T)
                for tb in range(ts, te, ROWS):
                    miss = 0
                    toks = tb + r_ar
                    tm = toks < te
                    t64 = toks.to(tl.int64)
                    # the block's rows from each peer: its rows of channel c up to the block's last one (they
                    # arrive in token order), so the sum follows the transfer
                    for p in range(P):
                        if p != me:
                            h = tl.load(head_ptr + t64 * P + p, mask=tm, other=-1).to(tl.int64)
                            sstart = tl.load(tab_ptr + 2 * P + 3 * P * NCH + p * NCH + c).to(tl.int64)
                            need = tl.max(h, 0) + 1 - sstart
                            if need > 0:
                                seen = _wait_at_least(ctrl_ptr + p * NCHM + c, base + need, limit, fault_ptr, CLOCK)
                                if seen < base + need:
                                    _fault(fault_ptr, p, target)
                                    miss += 1
                    tl.debug_barrier()
                    for w0 in range(0, H, BLOCK_A):
                        cols = w0 + tl.arange(0, BLOCK_A)
                        cm = tm[:, None] & (cols < H)[None, :]
                        acc = tl.zeros([ROWS, BLOCK_A], dtype=tl.float32)
                        for p in range(P):
                            h = tl.load(head_ptr + t64 * P + p, mask=tm, other=-1).to(tl.int64)
                            m = cm & (h >= 0)[:, None]
                            if p == me:
                                v = tl.load(y_ptr + (own0 + h)[:, None] * H + cols[None, :], mask=m, other=0.0)
                            else:
                                v = tl.load(mine_a + (p * XC + h)[:, None] * SH + cols[None, :], mask=m,
                                            other=0.0, cache_modifier=".cg")
                            acc += v.to(tl.float32)
                        if HAS_B0:
                            acc += tl.load(b0_ptr + t64[:, None] * H + cols[None, :], mask=cm).to(tl.float32)
                        if HAS_B1:
                            acc += tl.load(b1_ptr + t64[:, None] * H + cols[None, :], mask=cm).to(tl.float32)
                        acc += tl.where(miss > 0, float("nan"), 0.0)
                        tl.store(out_ptr + t64[:, None] * H + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                                 mask=cm)
                    if HAS_W:
                        kc = tl.arange(0, BLOCK_B)
                        km = tm[:, None] & (kc < K)[None, :]
                        accw = tl.zeros([ROWS, BLOCK_B], dtype=tl.float32)
                        for p in range(P):
                            h = tl.load(head_ptr + t64 * P + p, mask=tm, other=-1).to(tl.int64)
                            m = km & (h >= 0)[:, None]
                            if p == me:
                                v = tl.load(w_ptr + (own0 + h)[:, None] * K + kc[None, :], mask=m, other=0.0)
                            else:
                                v = tl.load(mine_b + (p * XC + h)[:, None] * SK + kc[None, :], mask=m,
                                            other=0.0, cache_modifier=".cg")
                            accw += v
                        accw += tl.where(miss > 0, float("nan"), 0.0)
                        tl.store(ow_ptr + t64[:, None] * K + kc[None, :], accw, mask=km)
        if PHASE != 1:
            _finish(ctrl_ptr, c8_ptr, word_ptr, target, me, P, ACKS, NPROG)

    @triton.jit
    def _layout_kernel(ids_ptr, T, K, e, per_rank_ptr, per_expert_ptr, in_rank_ptr, P,
                       ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr):
        t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        k = tl.arange(0, BLOCK_K)
        tm = t < T
        m = tm[:, None] & (k < K)[None, :]
        ids = tl.load(ids_ptr + t.to(tl.int64)[:, None] * K + k[None, :], mask=m, other=-1).to(tl.int32)
        valid = m & (ids >= 0)
        tl.atomic_add(per_expert_ptr + tl.where(valid, ids, 0), tl.where(valid, 1, 0), mask=valid, sem="relaxed")
        ranks = tl.where(valid, ids // e, -1)
        ps = tl.arange(0, BLOCK_P)
        hit = tl.zeros([ROWS, BLOCK_P], dtype=tl.int32)
        for kk in range(K):
            rk = tl.max(tl.where(k[None, :] == kk, ranks, -1), 1)
            hit = hit | (rk[:, None] == ps[None, :]).to(tl.int32)
        pm = ps < P
        tl.store(in_rank_ptr + t.to(tl.int64)[:, None] * P + ps[None, :], hit.to(tl.int8),
                 mask=tm[:, None] & pm[None, :])
        tl.atomic_add(per_rank_ptr + ps, tl.sum(hit, 0), mask=pm, sem="relaxed")


_launch: dict = {}


def _launcher(name: str) -> Launcher:
    if name not in _launch:
        _launch[name] = Launcher(globals()[name])
    return _launch[name]


def _round16(n: int) -> int:
    return -(-n // 16) * 16


@functools.lru_cache(maxsize=None)
def _clock_limit(timeout_ms: int, device_type: str) -> tuple[bool, int]:
    """(use the global timer, the wait's bound: nanoseconds, or spins without the timer)."""
    clock = globaltimer is not None and device_type == "cuda" and torch.version.cuda is not None and not interpreting()
    return clock, (int(timeout_ms) * 1_000_000 if clock else max(1, int(timeout_ms) * SPINS_PER_MS))


def _split(n_send: int, n_recv: int, sms: int) -> tuple[int, int]:
    """(sender programs, receiver programs), each >= 1, together <= sms where both fit (every program resident)."""
    n_send, n_recv = max(n_send, 1), max(n_recv, 1)
    if n_send + n_recv <= sms:
        return n_send, n_recv
    s = max(1, min(n_send, sms * n_send // (n_send + n_recv)))
    return s, max(1, min(n_recv, sms - s))


def dispatch(state: NormalState, plan: DirectPlan, a_TW: torch.Tensor, b_TW: torch.Tensor | None = None,
             rows: int = DEFAULT_ROWS, phase: int = 0, out: tuple | None = None) -> tuple:
    """Move rows ``a_TW`` [T, WA] (int32 words, contiguous) and ``b_TW`` [T, WB] (int32 words, any strides) to
    the ranks ``plan.head`` names. Returns (a [X, WA], b [X, WB] or None) in compact order (rows past the received
    count untouched: zero them where the outputs are padded). ``phase``: see the module docstring; ``out``: the
    outputs (the phase-2 launch of the tests reuses phase 1's)."""
    P, me, X, Xc, nch = state.P, state.me, plan.rows, plan.capacity, plan.nch
    WA = a_TW.shape[1]
    WB = b_TW.shape[1] if b_TW is not None else 0
    SA, SB = _round16(WA), _round16(WB)
    reg, d16 = state.region("dispatch", Xc * (SA + SB) * 4)
    if out is None:
        oa = torch.empty(X, WA, dtype=torch.int32, device=a_TW.device)
        ob = torch.empty(X, WB, dtype=torch.int32, device=a_TW.device) if b_TW is not None else None
    else:
        oa, ob = out
    n_send, n_recv = P * nch, (P - 1) * nch
    NS, NR = _split(n_send, n_recv, state.sms)
    grid = {0: NS + NR, 1: NS, 2: NR}[phase]
    clock, limit = _clock_limit(state.timeout_ms, a_TW.device.type)
    has_b = b_TW is not None
    bb = b_TW if has_b else a_TW
    _launcher("_dispatch_kernel")(grid, (
        a_TW, WA, bb, bb.stride(0) if has_b else 0, bb.stride(1) if has_b else 0, WB,
        state.view(reg, torch.int32), d16, SA, SB, Xc * SA, oa, ob if has_b else oa,
        plan.head, plan.tab, state.ctrl, state.c8, state.words[0], state.fault,
        me, P, max(P - 1, 1), plan.T, plan.per, nch, n_send, n_recv, limit, grid), dict(
        HAS_B=has_b, BLOCK_A=min(triton.next_power_of_2(max(WA, 16)), 1024),
        BLOCK_B=min(triton.next_power_of_2(max(WB, 16)), 1024), ROWS=rows, NSEND=NS, NRECV=NR, PHASE=phase,
        CLOCK=clock, NCHM=NCH_MAX), dict(num_warps=8), fast=state.fast_launch)
    _LAST["dispatch"] = min(NS + NR, state.sms)
    return oa, ob


def combine(state: NormalState, plan: DirectPlan, y_XH: torch.Tensor, w_XK: torch.Tensor | None = None,
            biases: tuple = (), rows: int = DEFAULT_ROWS, split: int = 2, phase: int = 0,
            out: tuple | None = None) -> tuple:
    """Each token's rows summed over the ranks it went to (rank order, fp32 from 0, own row from ``y_XH``), plus
    the biases ([T, H] each, added in order), in ``y_XH``'s dtype; ``w_XK`` [X, K] fp32 summed the same way.
    Returns (out [T, H], out_w [T, K] or None)."""
    P, me, Xc, nch, T = state.P, state.me, plan.capacity, plan.nch, plan.T
    H = y_XH.shape[1]
    K = w_XK.shape[1] if w_XK is not None else 0
    es = y_XH.element_size()
    SH, SK = _round16(H), _round16(K)
    nbytes_a = P * Xc * SH * es
    reg, d16 = state.region("combine", nbytes_a + P * Xc * SK * 4)
    if out is None:
        o = torch.empty(T, H, dtype=y_XH.dtype, device=y_XH.device)
        ow = torch.empty(T, K, dtype=torch.float32, device=y_XH.device) if w_XK is not None else None
    else:
        o, ow = out
    n_send, n_recv = (P - 1) * nch, nch * split
    NS, NR = _split(n_send, n_recv, state.sms)
    grid = {0: NS + NR, 1: NS, 2: NR}[phase]
    clock, limit = _clock_limit(state.timeout_ms, y_XH.device.type)
    has_w = w_XK is not None
    b0 = biases[0] if len(biases) > 0 else y_XH
    b1 = biases[1] if len(biases) > 1 else y_XH
    _launcher("_combine_kernel")(grid, (
        y_XH, H, w_XK if has_w else y_XH, K, state.view(reg, y_XH.dtype), state.view(reg, torch.float32, nbytes_a),
        d16, SH, SK, Xc, o, ow if has_w else o, b0, b1, plan.head, plan.tab, state.ctrl_comb, state.c8,
        state.words[1], state.fault, me, P, max(P - 1, 1), T, plan.per, nch, split, n_send, n_recv, limit, grid), dict(
        HAS_W=has_w, HAS_B0=len(biases) > 0, HAS_B1=len(biases) > 1, UA=16 // es,
        BLOCK_A=min(triton.next_power_of_2(max(H, 16)), 512), BLOCK_B=triton.next_power_of_2(max(K, 16)),
        ROWS=rows, NSEND=NS, NRECV=NR, PHASE=phase, CLOCK=clock, NCHM=NCH_MAX), dict(num_warps=8),
        fast=state.fast_launch)
    _LAST["combine"] = min(NS + NR, state.sms)
    return o, ow


def dispatch_layout(topk_idx_TK: torch.Tensor, num_experts: int, P: int, rows: int = 32, fast: bool = True) -> tuple:
    """``layout_torch`` in one Triton launch (plus one memset); ``fast`` as ``Launcher``'s."""
    T, K = topk_idx_TK.shape
    counts = torch.zeros(P + num_experts, dtype=torch.int32, device=topk_idx_TK.device)
    in_rank = torch.empty(T, P, dtype=torch.bool, device=topk_idx_TK.device)
    if T:
        grid = triton.cdiv(T, rows)
        _launcher("_layout_kernel")(grid, (topk_idx_TK.contiguous(), T, K, num_experts // P, counts, counts[P:],
                                           in_rank.view(torch.int8), P),
                                    dict(ROWS=rows, BLOCK_K=triton.next_power_of_2(max(K, 2)),
                                         BLOCK_P=triton.next_power_of_2(max(P, 2))), dict(num_warps=4), fast=fast)
        _LAST["layout"] = min(grid, device_sms(topk_idx_TK.device))
    return counts[:P], counts[P:], in_rank

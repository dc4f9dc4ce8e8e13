"""The ``symm`` backend's prepare step: the count rows a rank sends, and the index tables built from the
exchanged counts. Each exists as one Triton kernel (one launch instead of some forty small torch ops:
prepare is on the critical path of every decode step) and as its torch twin (CPU without Triton, and
the reference the CI checks the kernels against under ``TRITON_INTERPRET=1``).

Legend: T local tokens, S send rows, K top-k, P ranks, W waves, e local experts, C capacity rows per
(wave, peer) block, N = min(C, T) rows a block can hold from this rank, A extra words, X = W*P + W*e +
A + 2 int64 per count row, me this rank.

Count row for destination p (``count_rows``): [my send counts [W*P] | my pair counts for p's
experts [W*e] | my extra words [A] (the caller's, the same for every destination) | my expert id range
(min, max)]. Rank p's ``ctrl[me]`` receives it; after the barrier ``recv_PX[src]`` is source src's row
for this rank.

Tables (``build_tables``), all int64:
    row_WPN      send row (into the layout's S rows) of row i of block (w, p), clamped to S-1
    tok_WPN      its token (0 when S == 0)
    send_dst_WPN i where the row is valid (i < count and i < C), else -1
    recv_dst_WPC i where received row i of source p is valid, else -1
    slot_WTP     p*C + i: where token t's result from peer p lands in wave w, -1 where t sent nothing
                 (filled with -1 by the caller: a token is sent at most once per (wave, peer), so
                 every valid row writes its own slot)
    status [12]  [overflow, src, wave, dst, count, ids_bad, rank, ids_min, ids_max] of the first
                 capacity overflow (count > C) and the first rank whose ids leave [0, E); the first
                 error sticks (an entry with a flag set is never overwritten). [9] is the poison word:
                 nonzero once any fault was seen (set here with either flag, and by the exchanges'
                 waiters with [10] the peer they gave up on and [11] the call): the combine's sum then
                 writes NaN, so no call after a fault returns a plausible result.

Dense blocks (``densify``, from the sparse tables above): row r of block (w, p) is token start_w + r
of wave w's token range [start_w, start_w + len_w):
    meta_WPCM    [W, P, C, M] int32: the metadata of the send row of that token for (w, p) where it
                 has one (and r < N), else K slots of expert -1 and K of weight 0 (rows N..C-1 too: the
                 whole block is copied, so no stale row is left at the receiver)
    slot_WTP     rewritten in place: p*C + r where the token sent a row to p in wave w and r < N,
                 else -1
"""

from __future__ import annotations

import torch

from .triton_gate import tl, triton

__all__ = ["count_rows", "count_rows_torch", "build_tables", "build_tables_torch", "densify", "densify_torch",
           "STATUS_LEN", "POISON"]

STATUS_LEN = 12
POISON = 9   # the poison word of the status (see the module docstring)


def count_rows_torch(send_counts_WP, pair_counts_WPe, ids_min, ids_max, extra=None) -> torch.Tensor:
    """[P, X]: row p is what destination p receives (see the module docstring); ``extra``: None or the A
    int64 words added to every row."""
    W, P, e = pair_counts_WPe.shape
    parts = [send_counts_WP.reshape(1, W * P).expand(P, -1), pair_counts_WPe.permute(1, 0, 2).reshape(P, W * e)]
    if extra is not None:
        parts.append(extra.to(torch.long).view(1, -1).expand(P, -1))
    parts.append(torch.stack([ids_min, ids_max]).view(1, 2).expand(P, -1))
    return torch.cat(parts, 1).contiguous()


def count_rows(targets, send_counts_WP, pair_counts_WPe, ids_min, ids_max, extra=None) -> None:
    """Write row p of ``count_rows_torch`` into block p of ``targets`` (a ``RowTargets`` of P [1, X]
    int64 blocks: row ``me`` of every peer's ``ctrl``), one launch, one program per peer."""
    W, P, e = pair_counts_WPe.shape
    A = 0 if extra is None else extra.numel()
    X = W * P + W * e + A + 2
    if targets.num_blocks != P or targets.width != X or targets.base.dtype != torch.int64:
        raise ValueError(f"count_rows: targets must be {P} int64 blocks of width {X}, got {targets.num_blocks} "
                         f"{targets.base.dtype} of width {targets.width}")
    _count_rows_kernel[(P,)](targets.base, targets.offs_P, send_counts_WP.contiguous(), pair_counts_WPe.contiguous(),
                             ids_min, ids_max, extra.to(torch.long).contiguous() if A else ids_min, A, W * P, e, P,
                             UNIT=targets.unit, BLOCK=triton.next_power_of_2(max(W * P, W * e, A)))


def build_tables_torch(recv_PX, send_counts_WP, send_token_S, C: int, T: int, me: int, num_experts: int,
                       slot_WTP, status) -> dict:
    """The tables (see the module docstring) in torch; ``slot_WTP`` (may be None) and ``status`` are updated
    in place, the rest returned."""
    W, P = send_counts_WP.shape
    dev, N, S = send_counts_WP.device, min(C, T), send_token_S.shape[0]
    counts = send_counts_WP.reshape(-1)
    start_WP = (torch.cumsum(counts, 0) - counts).view(W, P, 1)
    i_N = torch.arange(N, device=dev)
    row_WPN = (start_WP + i_N).clamp(max=max(S - 1, 0))
    tok_WPN = send_token_S[row_WPN] if S else torch.zeros_like(row_WPN)
    send_dst_WPN = torch.where(i_N < send_counts_WP.clamp(max=C)[..., None], i_N, -1)
    sent_PWP = recv_PX[:, :W * P].view(P, W, P)            # [src, wave, dst], identical on all ranks
    recv_counts_WP = sent_PWP[:, :, me].t()
    i_C = torch.arange(C, device=dev)
    recv_dst_WPC = torch.where(i_C < recv_counts_WP.clamp(max=C)[..., None], i_C, -1)
    if slot_WTP is not None:
        # the junk slots (i >= count) write to a spare token row T that is dropped
        slot = torch.full((W, T + 1, P), -1, dtype=torch.long, device=dev)
        p_P1 = torch.arange(P, device=dev).view(1, P, 1)
        tok_or_spare = torch.where(send_dst_WPN >= 0, tok_WPN, T)
        slot.view(W, -1).scatter_(1, (tok_or_spare * P + p_P1).view(W, -1),
                                  (p_P1 * C + i_N).expand(W, P, N).reshape(W, -1))
        slot_WTP.copy_(slot[:, :T])
    # status: the first overflowing (src, wave, dst) and the first rank with ids out of range
    over = (sent_PWP > C).flatten()
    first = torch.argmax(over.to(torch.int32))
    rng_P2 = recv_PX[:, -2:]
    bad = (rng_P2[:, 0] < 0) | (rng_P2[:, 1] >= num_experts)
    r = torch.argmax(bad.to(torch.int32))
    # index_select, not t[i]: indexing by a 0-dim tensor reads it on the host (a sync, and no capture).
    count = sent_PWP.flatten().index_select(0, first.view(1))[0]
    lo_hi = rng_P2.index_select(0, r.view(1))[0]
    new = torch.stack([over.any().long(), first // (W * P), (first // P) % W, first % P,
                       count, bad.any().long(), r, lo_hi[0], lo_hi[1]])
    status[:9].copy_(torch.where((status[0] > 0) | (status[5] > 0), status[:9], new))   # the first error sticks
    status[9:10].copy_(torch.maximum(status[9:10], (over.any() | bad.any()).long().view(1)))
    return dict(row_WPN=row_WPN, tok_WPN=tok_WPN, send_dst_WPN=send_dst_WPN, recv_dst_WPC=recv_dst_WPC,
                recv_counts_WP=recv_counts_WP)


def build_tables(recv_PX, send_counts_WP, send_token_S, C: int, T: int, me: int, num_experts: int,
                 slot_WTP, status) -> dict:
    """``build_tables_torch`` in one Triton launch (``slot_WTP`` must be pre-filled with -1)."""
    W, P = send_counts_WP.shape
    dev, N, S = send_counts_WP.device, min(C, T), send_token_S.shape[0]
    X = recv_PX.shape[1]
    row_WPN = torch.empty(W, P, N, dtype=torch.long, device=dev)
    tok_WPN, send_dst_WPN = torch.empty_like(row_WPN), torch.empty_like(row_WPN)
    recv_dst_WPC = torch.empty(W, P, C, dtype=torch.long, device=dev)
    bn, bc = min(triton.next_power_of_2(max(N, 1)), 1024), min(triton.next_power_of_2(max(C, 1)), 1024)
    nb_n, nb_c = triton.cdiv(N, bn), triton.cdiv(C, bc)
    has_slot = slot_WTP is not None
    _tables_kernel[(W * P * (nb_n + nb_c) + 1,)](
        recv_PX, send_counts_WP.contiguous(), send_token_S, row_WPN, tok_WPN, send_dst_WPN, recv_dst_WPC,
        slot_WTP if has_slot else row_WPN, status, W, P, N, C, S, T, X, me, num_experts, nb_n, nb_c,
        HAS_SLOT=has_slot, BLOCK_N=bn, BLOCK_C=bc, BLOCK_WP=triton.next_power_of_2(W * P),
        BLOCK_PWP=triton.next_power_of_2(P * W * P), BLOCK_P=triton.next_power_of_2(P))
    recv_counts_WP = recv_PX[:, :W * P].view(P, W, P)[:, :, me].t()
    return dict(row_WPN=row_WPN, tok_WPN=tok_WPN, send_dst_WPN=send_dst_WPN, recv_dst_WPC=recv_dst_WPC,
                recv_counts_WP=recv_counts_WP)


def densify_torch(tok_WPN, row_WPN, send_dst_WPN, meta_SM, slot_WTP, start_W, C: int, K: int) -> torch.Tensor:
    """Dense blocks from the sparse tables (see the module docstring): returns meta_WPCM and rewrites
    ``slot_WTP`` (may be None) in place."""
    W, P, N = tok_WPN.shape
    dev, M, flat = tok_WPN.device, meta_SM.shape[1], W * P * C
    rel_WPN = tok_WPN - start_W.view(W, 1, 1)
    base_WP1 = torch.arange(W * P, device=dev).view(W, P, 1) * C
    dst = torch.where((send_dst_WPN >= 0) & (rel_WPN >= 0) & (rel_WPN < N), base_WP1 + rel_WPN, flat)
    meta = torch.zeros(flat + 1, M, dtype=torch.int32, device=dev)     # the last row takes the rest
    meta[:, :K] = -1
    meta.index_copy_(0, dst.reshape(-1), meta_SM.index_select(0, row_WPN.reshape(-1)))
    if slot_WTP is not None:
        T = slot_WTP.shape[1]
        rel_WT1 = (torch.arange(T, device=dev).view(1, T) - start_W.view(W, 1))[..., None]
        dense = torch.arange(P, device=dev).view(1, 1, P) * C + rel_WT1
        slot_WTP.copy_(torch.where((slot_WTP >= 0) & (rel_WT1 >= 0) & (rel_WT1 < N), dense, -1))
    return meta[:flat].view(W, P, C, M)


def densify(slot_WTP, row_WPN, meta_SM, rng_W2, C: int, K: int, max_len: int) -> torch.Tensor:
    """``densify_torch`` in one Triton launch, from the sparse ``slot_WTP`` (rewritten in place);
    ``rng_W2`` [W, 2] int64 (start, len) of each wave's tokens, ``max_len`` the largest len (host)."""
    W, P, N = row_WPN.shape
    T, M = slot_WTP.shape[1], meta_SM.shape[1]
    out = torch.empty(W, P, C, M, dtype=torch.int32, device=row_WPN.device)
    R = max(C, max_len)
    if R == 0:
        return out
    block = min(triton.next_power_of_2(R), 256)
    _densify_kernel[(W * P, triton.cdiv(R, block))](slot_WTP, row_WPN, meta_SM, out, rng_W2, P, N, C, T, K, M,
                                                    BLOCK=block, BLOCK_M=triton.next_power_of_2(M))
    return out


if triton is not None:

    @triton.jit
    def _densify_kernel(slot_ptr, row_ptr, meta_ptr, out_ptr, rng_ptr, P, N, C, T, K, M,
                        BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
        wp = tl.program_id(0)
        w = wp // P
        p = wp % P
        start = tl.load(rng_ptr + 2 * w)
        n = tl.load(rng_ptr + 2 * w + 1)
        r = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        in_wave = r < n
        sidx = ((w * T + start + r) * P + p).to(tl.int64)
        s = tl.load(slot_ptr + sidx, mask=in_wave, other=-1)
        hit = in_wave & (s >= 0) & (r < N)
        row = tl.load(row_ptr + wp.to(tl.int64) * N + (s - p * C), mask=hit, other=0)
        m = tl.arange(0, BLOCK_M)
        mm = m < M
        vals = tl.load(meta_ptr + row[:, None] * M + m[None, :], mask=hit[:, None] & mm[None, :], other=0)
        fill = tl.where(m < K, -1, 0)
        vals = tl.where(hit[:, None], vals, fill[None, :])
        tl.store(out_ptr + (wp.to(tl.int64) * C + r)[:, None] * M + m[None, :], vals, mask=(r < C)[:, None] & mm[None, :])
        tl.store(slot_ptr + sidx, tl.where(hit, p * C + r, -1), mask=in_wave)

    @triton.jit
    def _count_rows_kernel(dst_ptr, offs_ptr, counts_ptr, pairs_ptr, lo_ptr, hi_ptr, extra_ptr, A, WP, e, P,
                           UNIT: tl.constexpr, BLOCK: tl.constexpr):
        p = tl.program_id(0)
        dst = dst_ptr + tl.load(offs_ptr + p) * UNIT
        k = tl.arange(0, BLOCK)
        tl.store(dst + k, tl.load(counts_ptr + k, mask=k < WP), mask=k < WP)
        W = WP // P
        for w in range(W):           # my pairs for p's experts, wave by wave
            m = k < e
            tl.store(dst + WP + w * e + k, tl.load(pairs_ptr + (w * P + p) * e + k, mask=m), mask=m)
        tl.store(dst + WP + W * e + k, tl.load(extra_ptr + k, mask=k < A), mask=k < A)
        tl.store(dst + WP + W * e + A, tl.load(lo_ptr))
        tl.store(dst + WP + W * e + A + 1, tl.load(hi_ptr))

    @triton.jit
    def _tables_kernel(recv_ptr, counts_ptr, tok_ptr, row_ptr, tokout_ptr, sdst_ptr, rdst_ptr, slot_ptr, status_ptr,
                       W, P, N, C, S, T, X, me, E, nb_n, nb_c, HAS_SLOT: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_C: tl.constexpr, BLOCK_WP: tl.constexpr, BLOCK_PWP: tl.constexpr,
                       BLOCK_P: tl.constexpr):
        j = tl.program_id(0)
        WP = W * P
        if j < WP * nb_n:                                   # send side: BLOCK_N rows of block (w, p)
            wp = j // nb_n
            i = (j % nb_n) * BLOCK_N + tl.arange(0, BLOCK_N)
            q = tl.arange(0, BLOCK_WP)
            cnt_q = tl.load(counts_ptr + q, mask=q < WP, other=0)
            start = tl.sum(tl.where(q < wp, cnt_q, 0))
            cnt = tl.minimum(tl.sum(tl.where(q == wp, cnt_q, 0)), C)
            m = i < N
            row = tl.minimum(start + i, tl.maximum(S - 1, 0))
            tok = tl.load(tok_ptr + row, mask=m & (row < S), other=0)
            dst = tl.where(i < cnt, i, -1)
            o = wp.to(tl.int64) * N + i
            tl.store(row_ptr + o, row, mask=m)
            tl.store(tokout_ptr + o, tok, mask=m)
            tl.store(sdst_ptr + o, dst, mask=m)
            if HAS_SLOT:
                w = wp // P
                p = wp % P
                tl.store(slot_ptr + ((w * T + tok) * P + p), p * C + i, mask=m & (dst >= 0))
        elif j < WP * (nb_n + nb_c):                        # receive side: BLOCK_C rows of block (w, src p)
            jj = j - WP * nb_n
            wp = jj // nb_c
            w = wp // P
            p = wp % P
            i = (jj % nb_c) * BLOCK_C + tl.arange(0, BLOCK_C)
            rc = tl.minimum(tl.load(recv_ptr + p * X + w * P + me), C)
            tl.store(rdst_ptr + wp.to(tl.int64) * C + i, tl.where(i < rc, i, -1), mask=i < C)
        else:                                               # status (one program)
            f = tl.arange(0, BLOCK_PWP)                     # flat (src, wave, dst)
            mf = f < P * WP
            sent = tl.load(recv_ptr + (f // WP) * X + f % WP, mask=mf, other=0)
            over = mf & (sent > C)
            first = tl.min(tl.where(over, f, P * WP), 0)
            any_over = first < P * WP
            first = tl.where(any_over, first, 0)
            count = tl.sum(tl.where(f == first, sent, 0))
            r = tl.arange(0, BLOCK_P)
            mr = r < P
            lo = tl.load(recv_ptr + r * X + X - 2, mask=mr, other=0)
            hi = tl.load(recv_ptr + r * X + X - 1, mask=mr, other=0)
            bad = mr & ((lo < 0) | (hi >= E))
            rb = tl.min(tl.where(bad, r, P), 0)
            any_bad = rb < P
            rb = tl.where(any_bad, rb, 0)
            lo_r = tl.sum(tl.where(r == rb, lo, 0))
            hi_r = tl.sum(tl.where(r == rb, hi, 0))
            if (tl.load(status_ptr) == 0) & (tl.load(status_ptr + 5) == 0):   # no earlier error
                tl.store(status_ptr, any_over.to(tl.int64))
                tl.store(status_ptr + 1, (first // WP).to(tl.int64))
                tl.store(status_ptr + 2, ((first // P) % W).to(tl.int64))
                tl.store(status_ptr + 3, (first % P).to(tl.int64))
                tl.store(status_ptr + 4, count.to(tl.int64))
                tl.store(status_ptr + 5, any_bad.to(tl.int64))
                tl.store(status_ptr + 6, rb.to(tl.int64))
                tl.store(status_ptr + 7, lo_r.to(tl.int64))
                tl.store(status_ptr + 8, hi_r.to(tl.int64))
            if any_over | any_bad:                          # the poison word sticks until cleared
                tl.store(status_ptr + 9, 1)

"""V4 router, routed experts (grouped GEMM) and the shared expert (chunked for bubble filling).

Legend: T tokens, D hidden, I intermediate, E experts, e local experts, K top-k, N routed rows
(expert-major), R received rows, C row chunks.

Math (v4_spec.md section 4): scores = sqrt(softplus(x @ Wg^T)) in fp32; selection = top-k of
scores + e_score_correction_bias (or tid2eid[input_ids] on hash layers); weights = the unbiased
scores of the selection, renormalised, times routed_scaling_factor. Expert = SwiGLU with the gate
clamped from above and up clamped both ways at swiglu_limit.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from moe_wave.comm import streams as st
from moe_wave.comm.backend import OnceRows, Received, rows_of

from .config import MoEConfig

__all__ = ["V4Router", "RoutedExperts", "SharedExpert", "swiglu", "expert_rows"]


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class V4Router(nn.Module):
    """Top-k (bias-corrected) or hash routing. Returns (topk_ids [T, K] int64, topk_w [T, K] fp32)."""

    def __init__(self, cfg: MoEConfig, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, device=device, dtype=dtype))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, device=device))
        if cfg.hash_routing:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.top_k, dtype=torch.long, device=device))
        else:
            self.tid2eid = None

    def forward(self, x_TD: torch.Tensor, input_ids: torch.Tensor | None = None):
        cfg = self.cfg
        scores_TE = F.softplus(x_TD.float() @ self.weight.float().t()).sqrt()
        if cfg.hash_routing:
            if input_ids is None:
                raise ValueError("input_ids=None: this is a hash-routed layer (tid2eid), it needs the token ids")
            ids_T = input_ids.reshape(-1)
            if ids_T.numel() != x_TD.shape[0]:
                raise ValueError(f"input_ids has {ids_T.numel()} elements: must equal the {x_TD.shape[0]} tokens")
            ids_TK = self.tid2eid[ids_T.long()].long()
        else:
            ids_TK = torch.topk(scores_TE + self.e_score_correction_bias.float(), cfg.top_k, dim=-1).indices
        w_TK = scores_TE.gather(1, ids_TK)
        w_TK = w_TK / (w_TK.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
        return ids_TK, w_TK


def _grouped_ok(mode: str, x: torch.Tensor) -> bool:
    if mode == "off" or not hasattr(torch, "_grouped_mm"):
        return False
    if mode == "on":
        return True
    return x.is_cuda and x.dtype == torch.bfloat16


class RoutedExperts(nn.Module):
    """This rank's ``e`` routed experts. Weights as in HF: gate_up [e, 2I, D] (gate rows first),
    down [e, D, I]."""

    def __init__(self, cfg: MoEConfig, num_local: int, grouped_mm: str = "auto", device=None, dtype=None):
        super().__init__()
        self.cfg, self.num_local, self.grouped_mm = cfg, num_local, grouped_mm
        I, D = cfg.intermediate_size, cfg.hidden_size
        self.gate_up = nn.Parameter(torch.empty(num_local, 2 * I, D, device=device, dtype=dtype))
        self.down = nn.Parameter(torch.empty(num_local, D, I, device=device, dtype=dtype))

    def forward(self, x_ND: torch.Tensor, counts_e: list | None, offs_e: torch.Tensor | None = None) -> torch.Tensor:
        """Rows sorted by expert; ``counts_e`` (host) or ``offs_e`` (device cumulative int32) gives the groups."""
        I, lim = self.cfg.intermediate_size, self.cfg.swiglu_limit
        if _grouped_ok(self.grouped_mm, x_ND):
            if offs_e is None:
                # HOST SYNC (pageable copy): only for callers that have no device-side counts.
                offs_e = torch.tensor(counts_e, device=x_ND.device).cumsum(0).to(torch.int32)
            gu = torch._grouped_mm(x_ND, self.gate_up.transpose(-2, -1), offs=offs_e)
            h = swiglu(gu[:, :I], gu[:, I:], lim).to(x_ND.dtype)
            return torch._grouped_mm(h, self.down.transpose(-2, -1), offs=offs_e)
        if counts_e is None:
            # HOST SYNC: the loop fallback needs host group sizes (CPU, or GPUs without grouped GEMM).
            counts_e = torch.diff(offs_e, prepend=offs_e.new_zeros(1)).tolist()
        out = x_ND.new_empty(x_ND.shape[0], self.cfg.hidden_size)
        start = 0
        for j, n in enumerate(counts_e):
            if n:
                xs = x_ND[start:start + n]
                gu = xs @ self.gate_up[j].t()
                out[start:start + n] = swiglu(gu[:, :I], gu[:, I:], lim).to(x_ND.dtype) @ self.down[j].t()
            start += n
        out[start:] = 0
        return out


def expert_rows(got: Received, experts: nn.Module, *, packed: bool = False) -> torch.Tensor:
    """Apply the local experts to one wave's received rows (``comm.backend.Received``): y[r] = sum_k w[r,k] *
    expert_{id[r,k]}(x[r]), [R, D] in x's dtype (see ``_stage``). ``packed``: the rows arrived as FP8 rows
    (``moe_wave.fp8_rows``, FP8 experts): the experts' own device stage takes them as they are, any other path
    reads them dequantised (exactly: the same products); y is bf16 then."""
    x_RD, local = got.x_RD, got.local
    own = _own_stage(x_RD, experts, got.pairs_e_dev)        # decided once a wave, passed down
    if packed and not own:
        from .fp8_rows import dequant_rows

        D = experts.cfg.hidden_size
        x_RD = dequant_rows(x_RD, D)
        local = None if local is None else (local[0], dequant_rows(local[1], D))
        packed = False
    return _stage(x_RD, got.expert_RK, got.weight_RK, experts, got.pairs_e, got.pairs_e_dev, local, got.rows_P,
                  got.once, packed, own)


def _own_stage(x_RD: torch.Tensor, experts: nn.Module, pairs_e_dev: torch.Tensor | None) -> bool:
    """Whether the experts' own device-count stage runs here (``fused_pairs``: the FP8 experts on DeepGEMM)."""
    ok = getattr(experts, "fused_ok", None)
    return ok is not None and pairs_e_dev is not None and experts.num_local > 0 and ok(x_RD)


def _group_ends(pairs_e_dev: torch.Tensor, cap: int) -> torch.Tensor:
    """int32 [e] cumulative group ends from the device counts, clamped to ``cap`` pairs (the R*K slots, or one
    wave's blocks' for rows that stay over several waves: a capacity overflow, reported later, must not send a
    group past them). Built on the device: from a host list it would be a
    pageable host-to-device copy, which synchronises the host with the stream once per wave."""
    return pairs_e_dev.cumsum(0).clamp_(max=cap).to(torch.int32)


def _stage(x_RD: torch.Tensor, expert_RK: torch.Tensor, weight_RK: torch.Tensor, experts: RoutedExperts,
           pairs_e: list | None, pairs_e_dev: torch.Tensor | None = None,
           local: tuple | None = None, rows_P: torch.Tensor | None = None,
           once: OnceRows | None = None, packed: bool = False, own: bool = False) -> torch.Tensor:
    """``expert_rows`` on the fields of ``Received``; ``own``: the experts' own stage runs here (``_own_stage``).

    ``local`` (``Received.local``): rows of x_RD held elsewhere, read there. ``rows_P`` (``Received.rows_P``): the
    device path reads and writes only the rows that the combine reads (the others of y are left as allocated);
    the torch path computes every row. ``once`` (``Received.once``): rows that stay for several waves; only this
    wave's experts count, each row's sum runs on in y over its waves, and y holds the finished sums of the rows
    whose last wave this is (``_expert_rows_once``).

    Pairs are sorted expert-major, run as one grouped GEMM, weighted, and summed per row in fp32
    (in slot order k = 0..K-1, so the result is bitwise reproducible).
    With host counts (``pairs_e``) only the valid pairs are computed; without them (device-side
    counts, CUDA graphs) all R*K slots are computed with the invalid ones masked to zero. Experts with a device
    stage of their own (``fused_pairs``: ``fp8_experts.FP8RoutedExperts`` on DeepGEMM, a Hopper GPU with
    ``deep_gemm``; ``packed`` FP8 rows only there) take it where it runs (``fused_ok``), their own per-expert
    forward elsewhere.
    """
    R, K = expert_RK.shape
    e = experts.num_local
    if once is not None:
        if pairs_e_dev is None or pairs_e is not None:
            raise ValueError("expert_rows: once= needs device counts only (pairs_e=None, pairs_e_dev given)")
        return _expert_rows_once(x_RD, expert_RK, weight_RK, experts, pairs_e_dev, local, rows_P, once, packed, own)
    if own:         # the experts' stage takes the counts as they are (its groups come from one launch)
        from .expert_kernels import weighted_sum

        out, pos, n = experts.fused_pairs(x_RD, expert_RK, pairs_e_dev, local, rows_P, packed)
        return weighted_sum(out, pos, weight_RK, n, torch.bfloat16 if packed else x_RD.dtype, rows_P)
    offs = _group_ends(pairs_e_dev, R * K) if pairs_e_dev is not None else None
    if pairs_e is None and offs is not None and e and _fused_ok(x_RD, experts):
        return _expert_rows_fused(x_RD, expert_RK, weight_RK, experts, offs, local, rows_P)
    return _slot_sums(x_RD, expert_RK, weight_RK, experts, pairs_e, offs, local).to(x_RD.dtype)


def _slot_sums(x_RD, expert_RK, weight_RK, experts: RoutedExperts, pairs_e, offs, local) -> torch.Tensor:
    """The torch path of ``expert_rows`` before the cast: [R, D] fp32 (ids outside [0, e) are other cells')."""
    R, K = expert_RK.shape
    e = experts.num_local
    key = torch.remainder(expert_RK.reshape(-1), e + 1)      # -1 (another cell's slot) sorts last, as e
    order = torch.argsort(key, stable=True)
    if pairs_e is not None:
        order = order[:sum(pairs_e)]
    row = order // K
    out = experts(rows_of(x_RD, row, local), pairs_e, offs)
    w = weight_RK.reshape(-1).index_select(0, order)[:, None]
    contrib = out * w                                         # fp32 (w is fp32)
    if pairs_e is None:
        contrib = torch.where((key.index_select(0, order) < e)[:, None], contrib, 0.0)
    # Each pair back to its (row, k) slot, then a sum over k in slot order: deterministic (an
    # index_add_ over rows would add a row's K contributions by atomics, in a run-dependent order).
    slots = torch.zeros(R * K, x_RD.shape[1], dtype=torch.float32, device=x_RD.device)
    slots.index_copy_(0, order, contrib)
    return slots.view(R, K, x_RD.shape[1]).sum(1)


def _expert_rows_once(x_RD, expert_RK, weight_RK, experts: RoutedExperts, pairs_e_dev, local, rows_P,
                      once: OnceRows, packed: bool = False, own: bool = False) -> torch.Tensor:
    """``expert_rows`` for rows that stay over several waves (``comm.backend.OnceRows``): the pairs of this wave's
    experts only (the device counts ``pairs_e_dev`` name no other expert), each row's sum over k in slot order
    added to what its earlier waves left in its row of y (a row's first wave writes it), y in x's dtype and kept
    in ``once.state["y"]`` for the waves of this call: after a row's last wave its row holds the finished sum,
    which the combine of that wave reads (the partial sums are rounded to x's dtype between waves, as a row per
    wave's are when they travel).
    Returns y: [R, D], the rows no wave has touched as allocated."""
    R, K = expert_RK.shape
    D, e, w, W = experts.cfg.hidden_size, experts.num_local, once.wave, once.num_waves   # x may be packed rows
    rpw = R // W                      # the rows of one wave's blocks
    y = once.state.get("y")
    if w == 0 or y is None or y.shape != (R, D) or y.dtype != x_RD.dtype or y.device != x_RD.device:
        y = once.state["y"] = torch.empty(R, D, dtype=x_RD.dtype, device=x_RD.device)
        once.state["summed"] = None
    if not (R and D and e):
        return y
    # the pairs of one wave fit the rows of one wave's blocks (a source sends a token once per layer, and the
    # backend reports a source whose rows over the layer pass one block): the grouped GEMM is sized for them,
    # as a row per wave's is, not for every block
    if own or _fused_ok(x_RD, experts):
        _once_fused(x_RD, expert_RK, weight_RK, experts, pairs_e_dev, local, rows_P, once, y, packed, own)
        return y
    offs = _group_ends(pairs_e_dev, rpw * K)
    _after_last_sums(once, y)         # the torch path reads y's sums from the start: no overlap of waves here
    ids = expert_RK.long()
    ok = (ids >= 0) & (ids < e)
    if rows_P is not None:
        rb = R // rows_P.numel()
        r_ = torch.arange(R, device=x_RD.device)
        ok &= ((r_ % rb) < rows_P.reshape(-1)[r_ // rb])[:, None]
    wv = torch.where(ok, ids * W // e, -1)
    mine = wv == w
    s = _slot_sums(x_RD, torch.where(mine, ids, -1).to(torch.int32), weight_RK, experts, None, offs, local)
    first = (torch.arange(R, device=x_RD.device) // rpw == w)[:, None]
    tot = torch.where(first, s, y.float() + s)
    y.copy_(torch.where(mine.any(1)[:, None], tot.to(y.dtype), y))
    _sums_done(once, y)
    return y


def _once_fused(x_RD, expert_RK, weight_RK, experts: RoutedExperts, pairs_e_dev, local, rows_P,
                once: OnceRows, y, packed: bool = False, own: bool = False) -> None:
    """``_expert_rows_once`` on the device-count kernels (as ``_expert_rows_fused``, or the experts' own
    ``fused_pairs``), into y; the pairs sized for one wave's blocks (the counts clamped to them)."""
    from .expert_kernels import expert_order, weighted_sum_once

    R, K = expert_RK.shape
    cap = R // once.num_waves * K
    # the other waves' experts have empty groups: their pairs get pos -1 (expert_order's guard)
    if own:
        out, pos, n = experts.fused_pairs(x_RD, expert_RK, pairs_e_dev, local, rows_P, packed, cap)
    else:
        offs = _group_ends(pairs_e_dev, cap)
        n = offs[-1:]
        src, pos = expert_order(expert_RK, experts.num_local, offs, rows_P)
        out = _grouped_experts(x_RD, src[:cap], n, offs, local, experts)
    # the waves may take turns on streams (WaveConfig.expert_streams): everything above may overlap the last
    # wave's stage, but its sums (read here) must be done
    _after_last_sums(once, y)
    weighted_sum_once(out, pos, weight_RK, n, y, rows_P, once)
    _sums_done(once, y)


def _after_last_sums(once: OnceRows, y) -> None:
    """The current stream waits for the last wave's sums into y (the waves may take turns on streams)."""
    cur = st.current_stream(y.device)
    if cur is not None and once.state.get("summed") is not None:
        cur.wait_event(once.state["summed"])
    st.keep_alive(y, cur)


def _sums_done(once: OnceRows, y) -> None:
    """Mark this wave's sums into y done, for the next wave's ``_after_last_sums``."""
    cur = st.current_stream(y.device)
    if cur is not None:
        once.state["summed"] = cur.record_event()


def _fused_ok(x_RD: torch.Tensor, experts: RoutedExperts) -> bool:
    """The device-count path's kernels (``expert_kernels``) run here: a GPU with Triton and the grouped GEMM,
    and experts whose forward is ours (a subclass with its own forward keeps the generic path)."""
    from moe_wave.comm.triton_gate import triton_ok

    return (x_RD.is_cuda and type(experts).forward is RoutedExperts.forward and triton_ok(x_RD.device)
            and _grouped_ok(experts.grouped_mm, x_RD))


def _expert_rows_fused(x_RD, expert_RK, weight_RK, experts: RoutedExperts, offs, local=None,
                       rows_P=None) -> torch.Tensor:
    """``expert_rows`` with device counts, touching only the n valid pairs (n = offs[-1], on the device):
    the expert-major order comes from ``expert_order`` (no sort), and gather, SwiGLU and the weighted per-row sum
    skip the pairs past n; the grouped GEMMs only compute the groups. Same math as the torch path (the sum
    over k in slot order, in fp32)."""
    from .expert_kernels import expert_order, weighted_sum

    n = offs[-1:]
    src, pos = expert_order(expert_RK, experts.num_local, offs, rows_P)   # src: each sorted pair's row; pos: its place
    out = _grouped_experts(x_RD, src, n, offs, local, experts)
    return weighted_sum(out, pos, weight_RK, n, x_RD.dtype, rows_P)


def _grouped_experts(x_RD, src_J, n, offs, local, experts: RoutedExperts) -> torch.Tensor:
    """The experts on the sorted pairs: rows x[src_J[j]] gathered for j < n, gate_up as one grouped GEMM, the
    clamped SwiGLU, down as another; [len(src_J), D] (rows past n as allocated)."""
    from .expert_kernels import gather_rows, swiglu_rows

    xs = gather_rows(x_RD, src_J, n, local)
    gu = torch._grouped_mm(xs, experts.gate_up.transpose(-2, -1), offs=offs)
    h = swiglu_rows(gu, experts.cfg.swiglu_limit, n, x_RD.dtype)
    return torch._grouped_mm(h, experts.down.transpose(-2, -1), offs=offs)


class SharedExpert(nn.Module):
    """The shared expert, callable in pieces so the schedule can spread it over the pipeline's
    bubbles: ``up(x)`` (gate_up + activation), then ``down_chunk(h, c, C, out)`` per row chunk."""

    def __init__(self, cfg: MoEConfig, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        I, D = cfg.intermediate_size, cfg.hidden_size
        self.gate_proj = nn.Parameter(torch.empty(I, D, device=device, dtype=dtype))
        self.up_proj = nn.Parameter(torch.empty(I, D, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(D, I, device=device, dtype=dtype))

    def up(self, x_TD: torch.Tensor) -> torch.Tensor:
        lim = self.cfg.swiglu_limit if self.cfg.clamp_shared else 0.0
        return swiglu(x_TD @ self.gate_proj.t(), x_TD @ self.up_proj.t(), lim).to(x_TD.dtype)

    @staticmethod
    def chunk_bounds(T: int, c: int, C: int) -> tuple[int, int]:
        return c * T // C, (c + 1) * T // C

    def down_chunk(self, h_TI: torch.Tensor, c: int, C: int, out_TD: torch.Tensor) -> None:
        lo, hi = self.chunk_bounds(h_TI.shape[0], c, C)
        if hi > lo:
            torch.matmul(h_TI[lo:hi], self.down_proj.t(), out=out_TD[lo:hi])

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.up(x_TD) @ self.down_proj.t()

"""The routed and shared experts at DeepSeek-V4's own precision: FP8 e4m3 weights with 128 x 128 power-of-two
block scales (``moe_wave.fp8``'s format), activations quantised per (row, 128 channels).

Legend: R received rows, K top-k slots, D hidden, I intermediate, e local experts, N routed rows (expert-major),
JA rows of the aligned expert-major layout (``fp8_expert_kernels``).

Weights come from bf16 (``FP8RoutedExperts.from_dense``: ``moe.quantize_fp8()``, ``from_hf``, random init) or
from V4's FP4 expert format (``fp4_to_fp8``: e2m1 values with a power-of-two scale per 32 input channels,
re-encoded to the 128 x 128 FP8 blocks; exact wherever a block's scales span at most 2^13, see there).

The expert math per pair (row x, expert j): gu = bf16(q(x) @ W13_j^T), h = SwiGLU(gu) with V4's clamps in fp32,
out = bf16(q(h) @ W2_j^T), q(.) the per-128-channel activation quantisation; the weighted sum over a row's slots
runs in fp32 in slot order, as the bf16 stage's. Where it runs:

- ``fp8_fused_pairs`` (a Hopper GPU with ``deep_gemm``, device counts): one ordering of the pairs into the aligned
  expert-major layout (``expert_order`` with group starts rounded up to DeepGEMM's 128-row blocks), one kernel
  that reads each received row once and writes its FP8 rows and scales there (``quant_pairs``; rows that
  travelled as FP8, ``fp8_rows``, are copied there as they are: ``gather_pairs``), DeepGEMM's
  ``m_grouped_fp8_gemm_nt_contiguous`` with the group ends as its psum layout (the counts stay on the device: a
  CUDA graph replays it), SwiGLU + clamps + requant in one kernel (``swiglu_quant``), the second grouped GEMM into
  bf16 rows, and the weighted sum. The masked layout (expert x at rows x * max_m, DeepGEMM's
  ``m_grouped_fp8_gemm_nt_masked`` with the per-expert counts on the device) replaces the aligned one on top-k
  layers where its buffers are no larger (decode-sized batches), where it measured faster
  (``FP8RoutedExperts.gemm_layout``: "auto", the default; "contiguous" or "masked" force one; ``fp8_gemm_layout``).
  Where the first GEMM has few rows an expert (``FUSED_GATE_UP_ROWS_PER_EXPERT``: it streams weights), it runs
  with SwiGLU + requant as one Triton kernel (``gate_up_swiglu``) that never writes gu and reads rows that
  arrived as FP8 where they are, through the ordering's src_J, with no copy into the layout; 64-row tiles where
  the rows an expert are fewer still (``FUSED_SMALL_TILE_ROWS_PER_EXPERT``), 128 above. In the aligned layout
  above ``FUSED_SMALL_TILE_ROWS_PER_EXPERT`` pairs an expert, on the cards ``GATE_UP_DG`` names, where
  ``gate_up_dg`` builds, ``gate_up_dg`` runs the first GEMM instead, at every size (in place of both the Triton
  kernel's 128-row tiles and DeepGEMM's GEMM + ``swiglu_quant``): DeepGEMM's own Hopper GEMM with SwiGLU +
  requant in its epilogue (the same bits as DeepGEMM's GEMM + ``swiglu_quant``), on the rows copied into the
  layout (``GATE_UP_DG_SRC``, off: on rows that arrived as FP8 where they are, through src_J).
- ``FP8RoutedExperts.forward`` everywhere else (CPU, other GPUs, host counts): the same math per expert through
  ``fp8.fp8_matmul`` (cuBLAS's block-scaled GEMM on a GPU that takes it, the dequantised fp32 product on CPU,
  which is also the tests' reference).
"""

from __future__ import annotations

import torch
from torch import nn

from .config import MoEConfig
from .experts import SharedExpert
from .fp8 import BLOCK, FP8, act_quant, fp8_matmul, weight_quant
from .fp8_rows import unpack_rows

__all__ = ["quant_experts", "dequant_experts", "fp4_to_fp8", "dequant_fp4", "FP8RoutedExperts", "FP8SharedExpert",
           "fp8_fused_ok", "fp8_fused_pairs", "fp8_gemm_grouped_library"]

# e2m1 codes 0..7 (the sign is bit 3)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
GEMM_LAYOUTS = ("auto", "contiguous", "masked")
# what "auto" takes (``fp8_gemm_layout``), in words for ``info``
AUTO_LAYOUT = "masked GEMMs at decode sizes on top-k layers, contiguous otherwise"
# the first GEMM and SwiGLU + requant run as one kernel (``fp8_expert_kernels.gate_up_swiglu``: gu stays in
# registers) where the pairs are at most this many an expert (the GEMM streams weights, which the Triton tile does
# at DeepGEMM's rate and saves gu's round trip: V4-Flash at 128 and 2048 tokens, benchmarks/results/experts.md);
# DeepGEMM's GEMM and ``swiglu_quant`` above (compute-bound: DeepGEMM's tiles are the faster there); its 64-row
# tiles where the pairs are at most FUSED_SMALL_TILE_ROWS_PER_EXPERT an expert (decode), 128-row ones above. Both
# apply where ``gate_up_dg`` does not run (GATE_UP_DG below)
FUSED_GATE_UP_ROWS_PER_EXPERT = 128
FUSED_SMALL_TILE_ROWS_PER_EXPERT = 32
# in the aligned layout above FUSED_SMALL_TILE_ROWS_PER_EXPERT pairs an expert, the first GEMM and SwiGLU + requant
# run on DeepGEMM's own Hopper GEMM with the epilogue changed (``gate_up_dg``, on rows copied into the layout, in
# clusters of two: ``gate_up_dg.CLUSTER``; its masked layout is not measured in the stage) where it builds, on the
# GPUs whose name holds one of these strings (True: every Hopper GPU, False or (): none), instead of the Triton kernel
# (<= FUSED_GATE_UP_ROWS_PER_EXPERT) and DeepGEMM's GEMM + ``swiglu_quant`` (above). Measured in the stage on an
# H100 (benchmarks/results/experts.md, V4-Flash:32 and :128, V4-Pro:48 at 2048 and 8192 tokens, W = 1, 2, 4):
# 0.918-1.019 x that configuration, 0.965 on average
GATE_UP_DG: bool | tuple[str, ...] = True
# where ``gate_up_dg`` runs on rows that arrived as FP8 (``fp8_rows``): True reads them where they arrived through the
# ordering's src_J (one TMA box a row and k-block, no ``gather_pairs`` copy into the layout), False copies them into
# the layout first (the same bits either way; not measured on a GPU yet, so off)
GATE_UP_DG_SRC = False


def quant_experts(w_eNK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[e, N, K] weights as (q [e, N, K] e4m3, s [e, N/128, K/128] fp32 powers of two): ``fp8.weight_quant`` per
    expert, batched. N and K must be multiples of 128 (every V4 expert shape is)."""
    e, N, K = w_eNK.shape
    if N % BLOCK or K % BLOCK:
        raise ValueError(f"quant_experts: weights {tuple(w_eNK.shape)}: N and K must be multiples of {BLOCK} (FP8 "
                         f"experts store 128 x 128 blocks)")
    q = torch.empty(e, N, K, dtype=FP8, device=w_eNK.device)
    s = torch.empty(e, N // BLOCK, K // BLOCK, dtype=torch.float32, device=w_eNK.device)
    for j in range(e):          # one expert at a time: the fp32 copy of all of them would not fit (V4-Pro)
        q[j], s[j] = weight_quant(w_eNK[j])
    return q, s


def dequant_experts(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp32 [..., N, K] from ``quant_experts``'s pair."""
    return q.float() * s.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)


def dequant_fp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [..., N, K] of V4's FP4 expert weights: ``packed`` [..., N, K/2] uint8 (or int8, or torch's
    float4_e2m1fn_x2) holding two e2m1 codes a byte, element 2i in the low nibble and 2i + 1 in the high one;
    ``scales`` [..., N, K/32] powers of two (fp32, or float8_e8m0fnu as the checkpoints store ue8m0), one per 32
    input channels."""
    if packed.dtype not in (torch.uint8, torch.int8) and "float4" not in str(packed.dtype):
        raise ValueError(f"dequant_fp4: packed dtype {packed.dtype}: must be uint8, int8 or float4_e2m1fn_x2")
    b = packed.view(torch.uint8).to(torch.int32)
    codes = torch.stack((b & 0xF, b >> 4), -1).flatten(-2)                        # [..., N, K]
    lut = torch.tensor(_E2M1, device=packed.device)
    v = lut[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    K = v.shape[-1]
    if scales.shape[-1] * 32 != K or scales.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"dequant_fp4: scales {tuple(scales.shape)} must be [..., N, K/32] for values "
                         f"{tuple(v.shape)}")
    return v * scales.float().repeat_interleave(32, -1)


def fp4_to_fp8(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Re-encode FP4 experts (``dequant_fp4``'s format, [e, N, K/2] and [e, N, K/32]) to FP8 128 x 128 blocks:
    (q [e, N, K] e4m3, s [e, N/128, K/128] fp32, exact [e, N/128, K/128] bool).

    A block's scale is the FP8 format's (pow2_ceil(amax / 448)); an e2m1 value (at most two significant bits)
    times its 1 x 32 scale lands on an e4m3 value exactly unless it falls below e4m3's subnormal step, i.e. where
    the block's 1 x 32 scales spread over more than about 2^13; ``exact`` says which blocks kept every value (the
    others round their smallest values to the nearest e4m3 step, as quantising any weight would)."""
    if packed.dim() != 3:
        raise ValueError(f"fp4_to_fp8: packed {tuple(packed.shape)} must be [e, N, K/2]")
    e, N, Kh = packed.shape
    q = torch.empty(e, N, 2 * Kh, dtype=FP8, device=packed.device)
    s = torch.empty(e, N // BLOCK, 2 * Kh // BLOCK, dtype=torch.float32, device=packed.device)
    exact = torch.empty(e, N // BLOCK, 2 * Kh // BLOCK, dtype=torch.bool, device=packed.device)
    for j in range(e):
        w = dequant_fp4(packed[j], scales[j])
        qj, sj = quant_experts(w[None])
        q[j], s[j] = qj[0], sj[0]
        same = dequant_experts(qj[0], sj[0]) == w
        exact[j] = same.view(N // BLOCK, BLOCK, -1, BLOCK).all(dim=3).all(dim=1)
    return q, s, exact


class FP8RoutedExperts(nn.Module):
    """This rank's ``e`` routed experts in FP8: gate_up [e, 2I, D] (gate rows first) and down [e, D, I] as e4m3
    with [e, 2I/128, D/128] and [e, D/128, I/128] fp32 block scales (buffers, not parameters: inference only).

    ``forward(x_ND, counts_e, offs_e)`` has ``RoutedExperts.forward``'s meaning (rows sorted by expert, the
    groups from host ``counts_e`` or device ``offs_e``); it returns bf16 rows."""

    def __init__(self, cfg: MoEConfig, num_local: int, device=None):
        super().__init__()
        I, D = cfg.intermediate_size, cfg.hidden_size
        if I % BLOCK or D % BLOCK:
            raise ValueError(f"FP8 experts: hidden_size={D}, intermediate_size={I}: both must be multiples of "
                             f"{BLOCK} (activations are quantised per {BLOCK} channels)")
        self.cfg, self.num_local = cfg, num_local
        self.gemm_layout = "auto"           # the fused stage's layout and grouped GEMMs (fp8_gemm_layout)
        self.register_buffer("gate_up", torch.zeros(num_local, 2 * I, D, dtype=FP8, device=device))
        self.register_buffer("gate_up_scale", torch.ones(num_local, 2 * I // BLOCK, D // BLOCK, device=device))
        self.register_buffer("down", torch.zeros(num_local, D, I, dtype=FP8, device=device))
        self.register_buffer("down_scale", torch.ones(num_local, D // BLOCK, I // BLOCK, device=device))

    @classmethod
    def from_dense(cls, cfg: MoEConfig, gate_up: torch.Tensor, down: torch.Tensor) -> "FP8RoutedExperts":
        m = cls(cfg, gate_up.shape[0], device=gate_up.device)
        m.load_dense(gate_up, down)
        return m

    @torch.no_grad()
    def load_dense(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Quantise dense weights (gate_up [e, 2I, D], down [e, D, I]) into the buffers."""
        for name, w in (("gate_up", gate_up), ("down", down)):
            q, s = quant_experts(w.to(self.gate_up.device))
            getattr(self, name).copy_(q)
            getattr(self, name + "_scale").copy_(s)

    @torch.no_grad()
    def load_fp4(self, gate_up: tuple, down: tuple) -> torch.Tensor:
        """Load V4's FP4 experts, each a (packed, scales) pair (``dequant_fp4``'s format), re-encoded to FP8
        (``fp4_to_fp8``). Returns the fraction of 128 x 128 blocks kept exactly."""
        exact = []
        for name, (packed, scales) in (("gate_up", gate_up), ("down", down)):
            q, s, ok = fp4_to_fp8(packed.to(self.gate_up.device), scales.to(self.gate_up.device))
            if q.shape != getattr(self, name).shape:
                raise ValueError(f"load_fp4: {name} re-encodes to {tuple(q.shape)}: this rank's experts are "
                                 f"{tuple(getattr(self, name).shape)}")
            getattr(self, name).copy_(q)
            getattr(self, name + "_scale").copy_(s)
            exact.append(ok.flatten())
        return torch.cat(exact).float().mean()

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) dequantised to fp32."""
        return dequant_experts(self.gate_up, self.gate_up_scale), dequant_experts(self.down, self.down_scale)

    def expert(self, x_MD: torch.Tensor, j: int) -> torch.Tensor:
        """Expert j on rows x [M, D]: bf16 [M, D] (the module docstring's math)."""
        h_q, hs = _gate_up_act(x_MD, self.gate_up[j], self.gate_up_scale[j], self.cfg.swiglu_limit)
        return fp8_matmul(h_q, hs, self.down[j], self.down_scale[j], torch.bfloat16)

    def fused_ok(self, x_RD: torch.Tensor) -> bool:
        """Whether ``fused_pairs`` runs for rows on x_RD's device (``fp8_fused_ok``)."""
        return fp8_fused_ok(x_RD, self)

    def fused_pairs(self, x_RD, expert_RK, counts_e, local=None, rows_P=None, packed: bool = False,
                    max_pairs: int | None = None) -> tuple:
        """``expert_rows``' stage up to the weighted sum on DeepGEMM (``fp8_fused_pairs``); call where
        ``fused_ok``."""
        return fp8_fused_pairs(x_RD, expert_RK, self, counts_e, local, rows_P, packed, max_pairs)

    def forward(self, x_ND: torch.Tensor, counts_e: list | None, offs_e: torch.Tensor | None = None) -> torch.Tensor:
        if counts_e is None:
            # HOST SYNC: the per-expert path needs host group sizes (CPU, or GPUs without DeepGEMM).
            counts_e = torch.diff(offs_e, prepend=offs_e.new_zeros(1)).tolist()
        out = torch.zeros(x_ND.shape[0], self.cfg.hidden_size, dtype=torch.bfloat16, device=x_ND.device)
        start = 0
        for j, n in enumerate(counts_e):
            if n:
                out[start:start + n] = self.expert(x_ND[start:start + n], j)
            start += n
        return out


def _gate_up_act(x_MD: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, limit: float,
                 quantised: tuple | None = None):
    """The first half of an FP8 expert: x quantised (or ``quantised``, x's ``act_quant`` pair where the caller has
    it), gu = bf16(x @ [gate | up]^T), h = the clamped SwiGLU in fp32, returned quantised for the second GEMM:
    (h_q [M, I], h_s [I/128, M]); SwiGLU and the requant in one kernel where Triton runs (``swiglu_quant_rows``)."""
    from .fp8_expert_kernels import swiglu_quant_rows

    x_q, s = act_quant(x_MD) if quantised is None else quantised
    return swiglu_quant_rows(fp8_matmul(x_q, s, w_q, w_s, torch.bfloat16), limit)


class FP8SharedExpert(nn.Module):
    """The shared expert in FP8 (``SharedExpert``'s interface: ``up(x)``, ``down_chunk(h, c, C, out)``,
    ``chunk_bounds``): gate and up as one [2I, D] FP8 weight (one GEMM), down [D, I]; x quantised once per call,
    h once, each down chunk a block of h's quantised rows."""

    def __init__(self, cfg: MoEConfig, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        for name, w in (("gate_up", torch.cat([gate, up])), ("down", down)):
            q, s = weight_quant(w.detach())
            self.register_buffer(name, q)
            self.register_buffer(name + "_scale", s)

    chunk_bounds = staticmethod(SharedExpert.chunk_bounds)

    def up(self, x_TD: torch.Tensor, quantised: tuple | None = None):
        """(h_q, h_s): the activation quantised for ``down_chunk``. ``quantised``: x's ``act_quant`` pair (q [T, D],
        s [D/128, T]) where the caller already has it (the dispatch's packed rows), read instead of quantising x."""
        lim = self.cfg.swiglu_limit if self.cfg.clamp_shared else 0.0
        return _gate_up_act(x_TD, self.gate_up, self.gate_up_scale, lim, quantised)

    def down_chunk(self, h, c: int, C: int, out_TD: torch.Tensor) -> None:
        h_q, h_s = h
        lo, hi = self.chunk_bounds(h_q.shape[0], c, C)
        if hi > lo:         # the GEMM writes the chunk in place where it can (a bf16 out: the layer's)
            into = out_TD.is_contiguous() and out_TD.dtype == torch.bfloat16
            y = fp8_matmul(h_q[lo:hi], h_s[:, lo:hi], self.down, self.down_scale, torch.bfloat16,
                           out=out_TD[lo:hi] if into else None)
            if not into:
                out_TD[lo:hi] = y.to(out_TD.dtype)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x_TD)
        self.down_chunk(self.up(x_TD), 0, 1, out)
        return out


# ------------------------------------------------------------------------ the fused stage (Hopper + DeepGEMM)
def _deep_gemm_grouped(dev: torch.device):
    """deep_gemm where its grouped FP8 GEMMs run on dev (``fp8``'s choice and checks), else None."""
    from .fp8 import _deep_gemm

    dg = _deep_gemm(dev)
    return dg if dg is not None and hasattr(dg, "m_grouped_fp8_gemm_nt_contiguous") else None


def fp8_gemm_grouped_library(dev: torch.device | str) -> str:
    """What runs the FP8 experts' GEMMs on dev: "deepgemm" (the fused stage), else "per-expert" (fp8_matmul per
    expert: cuBLAS on a GPU, the dequantised fp32 product on CPU)."""
    dev = torch.device(dev)
    return "deepgemm" if dev.type == "cuda" and _deep_gemm_grouped(dev) is not None else "per-expert"


def fp8_fused_ok(x_RD: torch.Tensor, experts: nn.Module) -> bool:
    from moe_wave.comm.triton_gate import triton_ok

    return (isinstance(experts, FP8RoutedExperts) and x_RD.is_cuda and triton_ok(x_RD.device)
            and _deep_gemm_grouped(x_RD.device) is not None)


def fp8_gemm_layout(R: int, pairs: int, e: int, choice: str = "auto", distinct: bool = True,
                    masked_ok: bool = True) -> tuple[str, int, int]:
    """(layout, rows of the layout JA, max_m) of the fused stage for R received rows holding at most ``pairs``
    pairs over e experts.

    - "contiguous": the aligned layout (groups at 128-row multiples, DeepGEMM's psum layout; max_m 0).
    - "masked": expert x at rows x * max_m .., max_m = min(R, pairs) rounded up to 128, DeepGEMM's masked GEMMs.
      max_m bounds every expert's count where no row names an expert twice (``distinct``: top-k routing); past
      it (a hash table that repeats an expert in a row, or a capacity overflow, which is reported anyway) the
      rows whose pairs did not fit come out NaN (``fp8_fused_pairs``), never another expert's rows.
    - "auto" (the default): masked where its rows e * max_m are no more than the aligned layout's (decode-sized
      batches), the ids are ``distinct`` and ``masked_ok`` (this deep_gemm has the masked GEMMs); else
      contiguous. At 128 tokens the masked stage measured 1.9-2.8 % faster than the aligned one on one H100
      (V4-Flash with 128 and 32 local experts, V4-Pro with 48; benchmarks/results/experts.md)."""
    from .fp8_expert_kernels import ALIGN, aligned_capacity

    if choice not in GEMM_LAYOUTS:
        raise ValueError(f"FP8RoutedExperts.gemm_layout={choice!r}: must be one of {GEMM_LAYOUTS}")
    max_m = max(ALIGN, -(-min(R, pairs) // ALIGN) * ALIGN)
    JA = aligned_capacity(pairs, e)
    if choice == "masked" or (choice == "auto" and distinct and masked_ok and e * max_m <= JA):
        return "masked", e * max_m, max_m
    return "contiguous", JA, 0


def gate_up_dg_ok(dev: torch.device, e: int, I: int, D: int, masked: bool, src: bool = False) -> bool:
    """Whether ``gate_up_dg`` runs the first GEMM with SwiGLU + requant here (a GPU that ``GATE_UP_DG`` names,
    Hopper, deep_gemm's headers, nvcc; built once a shape; ``src``: its build that reads the rows where they
    arrived)."""
    if dev.type != "cuda" or not GATE_UP_DG:
        return False
    if GATE_UP_DG is not True and not any(c in torch.cuda.get_device_name(dev) for c in GATE_UP_DG):
        return False
    from .gate_up_dg import available
    return available(dev.index if dev.index is not None else torch.cuda.current_device(), e, I, D, masked, src)


def _grouped(dg, q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, g, G,
             expected: int) -> torch.Tensor:
    """One grouped GEMM on DeepGEMM, rows q [JA, K] e4m3 with their scales by weights w [e, N, K] (scales ws):
    masked where G (s [JA/G, K/128, G]), else contiguous with the group ends as the psum layout (s [K/128, JA]);
    [JA, N] bf16."""
    (JA, K), (e, N, _) = q.shape, w.shape
    y = torch.empty(JA, N, dtype=torch.bfloat16, device=q.device)
    if G:
        dg.m_grouped_fp8_gemm_nt_masked((q.view(e, G, K), s.transpose(1, 2)), (w, ws), y.view(e, G, N), g.m, expected)
    else:
        dg.m_grouped_fp8_gemm_nt_contiguous((q, s.t()), (w, ws), y, g.ends, use_psum_layout=True)
    return y


def fp8_fused_pairs(x_RD, expert_RK, experts: FP8RoutedExperts, counts_e, local=None, rows_P=None,
                    packed: bool = False, max_pairs: int | None = None) -> tuple:
    """The FP8 stage on DeepGEMM (see the module docstring) up to the weighted sum: (y_JD bf16, each pair's row
    there, pos_RK, the rows in use n). ``counts_e``: the wave's device pair counts per expert (``Received``'s
    pairs_e_dev); ``packed``: x_RD holds ``fp8_rows``' FP8 rows, read where they are (the fused first GEMM) or
    copied into the layout as they are;
    ``max_pairs``: the most pairs the counts can hold (default R * K; rows that stay over several waves bound a
    wave's by its blocks), where their running sum is clamped. The layout and GEMMs: ``fp8_gemm_layout`` with
    ``experts.gemm_layout`` (ids distinct on top-k layers, not on hash-routed ones, whose table may repeat an
    expert in a row); the groups, their block ends and sizes from one launch (``layout_groups``)."""
    from .expert_kernels import expert_order
    from .fp8_expert_kernels import ALIGN, gate_up_swiglu, gather_pairs, layout_groups, quant_pairs, swiglu_quant

    dg = _deep_gemm_grouped(x_RD.device)
    if dg.get_mk_alignment_for_contiguous_layout() != ALIGN:
        raise RuntimeError(f"deep_gemm aligns contiguous groups to {dg.get_mk_alignment_for_contiguous_layout()} "
                           f"rows; the FP8 expert stage lays them out at {ALIGN}")
    R, K = expert_RK.shape
    I, D, e = experts.cfg.intermediate_size, experts.cfg.hidden_size, experts.num_local
    pairs = R * K if max_pairs is None else max_pairs
    masked_ok = hasattr(dg, "m_grouped_fp8_gemm_nt_masked")
    if experts.gemm_layout == "masked" and not masked_ok:
        raise ValueError("FP8RoutedExperts.gemm_layout='masked': this deep_gemm has no m_grouped_fp8_gemm_nt_masked; "
                         "use 'contiguous' or 'auto'")
    _, JA, max_m = fp8_gemm_layout(R, pairs, e, experts.gemm_layout, not experts.cfg.hash_routing, masked_ok)
    G = max_m or None
    expected = max(1, -(-pairs // e))           # the masked GEMMs' hint: rows an expert
    # masked: each group holds max_m rows; a pair of an expert whose group passed it is not placed and gets pos
    # LOST: the weighted sum makes the rows that lost a pair NaN, the others stay right (the pairs of experts with
    # empty groups here, another wave's on rows that stay over several waves, keep pos -1)
    g = layout_groups(counts_e, pairs, JA, max_m)
    src, pos = expert_order(expert_RK, e, g.offs, rows_P, starts_e=g.starts, capacity=JA,
                            lost=g.over if G else None)
    lim = experts.cfg.swiglu_limit
    small = pairs <= FUSED_SMALL_TILE_ROWS_PER_EXPERT * e
    dg_kernel = not small and not G and gate_up_dg_ok(x_RD.device, e, I, D, False)
    fused = not dg_kernel and pairs <= FUSED_GATE_UP_ROWS_PER_EXPERT * e
    bm = 64 if small else 128
    wq = (experts.gate_up, experts.gate_up_scale, g.starts, g.bend, lim, G)
    dg_src = packed and dg_kernel and GATE_UP_DG_SRC and gate_up_dg_ok(x_RD.device, e, I, D, False, True)
    if (fused and packed) or dg_src:        # the FP8 rows enter the first GEMM where they arrived (src)
        loc = None if local is None or not local[1].numel() else (local[0], *unpack_rows(local[1], D))
        if fused:
            hq, hs = gate_up_swiglu(*unpack_rows(x_RD, D), *wq, src_J=src, local=loc, n=g.n, bm=bm)
        else:
            from .gate_up_dg import gate_up_dg
            hq, hs = gate_up_dg(*unpack_rows(x_RD, D), experts.gate_up, experts.gate_up_scale, g.ends, lim,
                                src_J=src, local=loc)
    else:
        q, s = gather_pairs(x_RD, D, pos, JA, local, G) if packed else quant_pairs(x_RD, pos, JA, local, G)
        if dg_kernel:
            from .gate_up_dg import gate_up_dg
            hq, hs = gate_up_dg(q, s, experts.gate_up, experts.gate_up_scale, g.ends, lim)
        elif fused:
            hq, hs = gate_up_swiglu(q, s, *wq, n=g.n, bm=bm)
        else:
            gu = _grouped(dg, q, s, experts.gate_up, experts.gate_up_scale, g, G, expected)
            hq, hs = swiglu_quant(gu, None, None, lim, G, bend=g.bend)
    return _grouped(dg, hq, hs, experts.down, experts.down_scale, g, G, expected), pos, g.n

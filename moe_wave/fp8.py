"""FP8 block-scaled linear layers in the released DeepSeek-V4 checkpoints' format (spec section 5): the GEMM and
the layers. The format and its quantisation (``act_quant``, ``weight_quant``, the Triton helpers) are in
``moe_wave.fp8_quant``; every public name of it is imported here, so ``moe_wave.fp8`` is the one place to import from.

Legend: M rows (tokens), K input channels, N output channels, G groups of a grouped projection.

On a Hopper GPU the product is DeepGEMM's ``fp8_gemm_nt`` where ``deep_gemm`` is installed (an optional import,
as ``deep_ep`` is; 1.05-1.16 x cuBLAS on the V4 projections at 4096 tokens, the same bits), else
``torch._scaled_mm`` with 1 x 128 (activations) by 128 x 128 (weights) scaling (cuBLAS, CUDA >= 12.9);
``set_fp8_gemm`` (the tools: ``MOE_WAVE_FP8_GEMM``) picks one: auto (the default), cublas, deepgemm. Elsewhere
(CPU, or a GPU whose torch refuses that recipe) the same math runs dequantised in fp32 (``fp8_matmul_ref``),
which is also the tests' oracle.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
from torch import nn

from .comm.triton_gate import triton
from .fp8_quant import (AMAX_FLOOR, BLOCK, FP8, FP8_MAX, act_quant, act_quant_torch, dequant_act,  # noqa: F401
                        dequant_weight, pow2_ceil, weight_quant)

if triton is not None:
    from .fp8_quant import e4m3_rne, pow2_scale_bits  # noqa: F401  (the Triton kernels' helpers, imported from here)

__all__ = ["BLOCK", "FP8_MAX", "pow2_ceil", "act_quant", "act_quant_torch", "weight_quant", "dequant_weight",
           "dequant_act", "fp8_matmul", "fp8_matmul_ref", "FP8_GEMMS", "set_fp8_gemm", "fp8_gemm_choice",
           "fp8_gemm_library", "QAct", "FP8Linear", "GroupedFP8", "hf_fp8_payload",
           "hf_weight", "PRECISIONS", "resolve_precision"]


def fp8_matmul_ref(x_q: torch.Tensor, s_KbM: torch.Tensor, w_q: torch.Tensor, s_w: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """x @ w^T from the quantised pairs, dequantised and multiplied in fp32, rounded once to ``out_dtype``."""
    return (dequant_act(x_q, s_KbM) @ dequant_weight(w_q, s_w).t()).to(out_dtype)


# ------------------------------------------------------------------------------------------- the GEMM
_SCALED_MM_OK: dict = {}     # device -> False once torch._scaled_mm refused the 1x128 x 128x128 recipe


def _pad_k(x_q, s_KbM, w_q, s_w):
    """K padded with zeros to a multiple of 4 blocks of 128: cuBLASLt reads the 128 x 128 weight scales with a
    leading dimension of K/128 rounded up to 4, and some torch versions pass it unrounded (silently wrong
    results; pytorch/pytorch#166752). The V4 shapes (K = 1024, 4096, 8192) never pad."""
    M, K = x_q.shape
    kb = K // BLOCK
    Kp = -(-kb // 4) * 4 * BLOCK
    xp = torch.zeros(M, Kp, dtype=x_q.dtype, device=x_q.device)
    xp[:, :K] = x_q
    wp = torch.zeros(w_q.shape[0], Kp, dtype=w_q.dtype, device=w_q.device)
    wp[:, :K] = w_q
    sp = torch.ones(Kp // BLOCK, M, dtype=s_KbM.dtype, device=s_KbM.device)
    sp[:kb] = s_KbM
    swp = torch.ones(s_w.shape[0], Kp // BLOCK, dtype=s_w.dtype, device=s_w.device)
    swp[:, :kb] = s_w[:, :kb]
    return xp, sp, wp, swp


_SCALED_MM_OUT_OK: dict = {}   # device -> whether torch._scaled_mm(out=) takes the 1 x 128 recipe there


def _scaled_mm(x_q, s_KbM, w_q, s_w, out_dtype, out=None):
    # (a block of rows of a bigger activation has its scales as a column slice of [K/128, M_all], which
    # torch._scaled_mm refuses: the 1 x 128 recipe wants them outer-dim-major, stride (1, M) as [M, K/128])
    s_KbM = s_KbM.contiguous()
    if out is not None:                        # straight into out (a grouped projection's slice): no copy after
        dev = x_q.device
        if (x_q.shape[1] // BLOCK) % 4 == 0 and w_q.shape[0] % 16 == 0 and x_q.shape[0] % 4 == 0 and \
                _SCALED_MM_OUT_OK.get(dev, True):
            try:
                return torch._scaled_mm(x_q, w_q.t(), scale_a=s_KbM.t(), scale_b=s_w.t(), out_dtype=out_dtype, out=out)
            except (RuntimeError, TypeError):
                _SCALED_MM_OUT_OK[dev] = False  # (the copy below, from now on)
        return out.copy_(_scaled_mm(x_q, s_KbM, w_q, s_w, out_dtype))
    if (x_q.shape[1] // BLOCK) % 4:
        x_q, s_KbM, w_q, s_w = _pad_k(x_q, s_KbM, w_q, s_w)
    N = w_q.shape[0]
    if N % 16:                                 # torch._scaled_mm wants N a multiple of 16 (same weight blocks)
        wp = torch.zeros(-(-N // 16) * 16, w_q.shape[1], dtype=w_q.dtype, device=w_q.device)
        wp[:N] = w_q
        return _scaled_mm(x_q, s_KbM, wp, s_w, out_dtype)[:, :N].contiguous()
    M = x_q.shape[0]
    Mp = -(-M // 4) * 4                        # cuBLASLt's 1x128 scales want M a multiple of 4
    if Mp != M:
        x_q = torch.cat([x_q, x_q.new_zeros(Mp - M, x_q.shape[1])])
        s_KbM = torch.cat([s_KbM, s_KbM.new_ones(s_KbM.shape[0], Mp - M)], dim=1)
    y = torch._scaled_mm(x_q, w_q.t(), scale_a=s_KbM.t(), scale_b=s_w.t(), out_dtype=out_dtype)
    return y[:M] if Mp != M else y


def _scaled_mm_retry(x_q, s_KbM, w_q, s_w, out_dtype, out=None):
    """``_scaled_mm``, and where torch refuses it once more with every operand contiguous: (y, None), or (None, the
    first refusal) where both are refused (the recipe itself: the caller falls back for the device). A layout torch
    does not take then costs a copy, not the device's GEMMs."""
    try:
        return _scaled_mm(x_q, s_KbM, w_q, s_w, out_dtype, out), None
    except (RuntimeError, NotImplementedError) as e:
        first = e
    try:
        return _scaled_mm(x_q.contiguous(), s_KbM, w_q.contiguous(), s_w.contiguous(), out_dtype, out), None
    except (RuntimeError, NotImplementedError):
        return None, first


# ------------------------------------------------------------------------------ DeepGEMM (optional)
FP8_GEMMS = ("auto", "cublas", "deepgemm")
_FP8_GEMM: dict = {"choice": "auto"}
_DG: dict = {}                         # device -> the deep_gemm module, or None (cuBLAS there)


def set_fp8_gemm(choice: str | None) -> None:
    """Which library runs the CUDA FP8 products: "auto" (DeepGEMM where ``deep_gemm`` imports and the GPU is a
    Hopper, else cuBLAS), "cublas" (``torch._scaled_mm``), "deepgemm" (an error where deep_gemm does not import,
    the GPU is not a Hopper or a product fails on it). Either way the products DeepGEMM does not take (``_dg_fits``:
    an fp32 output, N not a multiple of 64) run on cuBLAS. None: auto. (The CLI and the launch scripts set it from
    ``MOE_WAVE_FP8_GEMM`` through ``moe_wave.env``; the library reads no variable.)"""
    if choice is not None and choice not in FP8_GEMMS:
        raise ValueError(f"set_fp8_gemm: {choice!r} is not one of {', '.join(FP8_GEMMS)}")
    _FP8_GEMM["choice"] = choice or "auto"
    _DG.clear()


def fp8_gemm_choice() -> str:
    """The choice in force (``set_fp8_gemm``'s; auto until then)."""
    return _FP8_GEMM["choice"]


def _deep_gemm(dev: torch.device):
    """deep_gemm for dev, or None where the choice, the import or the GPU rules it out (cuBLAS then)."""
    if dev in _DG:
        return _DG[dev]
    choice = fp8_gemm_choice()
    mod = None
    if choice != "cublas":
        try:
            import deep_gemm as mod
        except Exception as e:  # noqa: BLE001 - absent, or built for another torch: cuBLAS then
            mod, why = None, f"import deep_gemm failed ({type(e).__name__}: {e})"
        if mod is not None and not hasattr(mod, "fp8_gemm_nt"):
            mod, why = None, "this deep_gemm has no fp8_gemm_nt"
        if mod is not None and torch.cuda.get_device_capability(dev)[0] != 9:
            mod, why = None, f"{torch.cuda.get_device_name(dev)} is not a Hopper GPU (sm_90)"
        if mod is None and choice == "deepgemm":
            raise RuntimeError(f"fp8 GEMM library 'deepgemm' (set_fp8_gemm / MOE_WAVE_FP8_GEMM): DeepGEMM cannot "
                               f"run the FP8 products on {dev}: {why}")
    _DG[dev] = mod
    return mod


PRECISIONS = ("auto", "bf16", "fp8")


def resolve_precision(choice: str | None, dev: torch.device | str) -> str:
    """A layer's precision as run: "bf16" (the model dtype; exact against the oracle) or "fp8" (DeepSeek-V4's own:
    FP8 attention projections and FP8 experts). "auto" (and None) is "fp8" where the FP8 GEMMs run on DeepGEMM
    (a Hopper GPU with ``deep_gemm``, ``fp8_gemm_library``), "bf16" elsewhere: FP8 on CPU or through cuBLAS's
    per-expert products computes V4's numbers but gains no speed."""
    if choice is not None and choice not in PRECISIONS:
        raise ValueError(f"precision={choice!r}: must be one of {', '.join(PRECISIONS)}")
    if choice in (None, "auto"):
        dev = torch.device(dev)
        return "fp8" if dev.type == "cuda" and fp8_gemm_library(dev) == "deepgemm" else "bf16"
    return choice


def fp8_gemm_library(dev: torch.device | str) -> str:
    """The library the FP8 products run on for dev: "deepgemm", "cublas" or "torch-ref" (CPU, or a refused
    recipe)."""
    dev = torch.device(dev)
    if dev.type != "cuda":
        return "torch-ref"
    if _deep_gemm(dev) is not None:
        return "deepgemm"
    return "cublas" if _SCALED_MM_OK.get(dev, True) else "torch-ref"


def _dg_fits(x_q: torch.Tensor, w_q: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """The products DeepGEMM's SM90 kernel takes as they are: unit channel strides, 16-byte row strides, whole
    128-channel blocks along K, N a multiple of 64, a bf16 output (its 1 x 128 by 128 x 128 kernel writes no
    other)."""
    K, N = x_q.shape[1], w_q.shape[0]
    return (K % BLOCK == 0 and N % 64 == 0 and out_dtype == torch.bfloat16
            and x_q.stride(1) == 1 and x_q.stride(0) % 16 == 0 and w_q.stride(1) == 1 and w_q.stride(0) % 16 == 0)


def _dg_matmul(dg, x_q, s_KbM, w_q, s_w, out_dtype, out):
    M, K = x_q.shape
    y = torch.empty(M, w_q.shape[0], dtype=out_dtype, device=x_q.device) if out is None else out
    dg.fp8_gemm_nt((x_q, s_KbM.contiguous().t()), (w_q, s_w[:, :K // BLOCK]), y)
    return y


def fp8_matmul(x_q: torch.Tensor, s_KbM: torch.Tensor, w_q: torch.Tensor, s_w: torch.Tensor,
               out_dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x @ w^T from ``act_quant``'s and ``weight_quant``'s pairs.

    On CUDA: DeepGEMM's ``fp8_gemm_nt`` (see ``set_fp8_gemm``) where it takes the shape, else ``torch._scaled_mm``
    (1 x 128 by 128 x 128 scaling). x_q may be a column slice of a wider matrix
    (unit channel stride, row stride >= K; its scales the matching rows of s), or a block of its rows (its scales
    a column slice of s, which is copied: a few KB). Where DeepGEMM fails at run time the device warns once and
    goes on with cuBLAS (with ``set_fp8_gemm("deepgemm")`` the error is raised). Where torch refuses that recipe
    (no cuBLAS >= 12.9, a GPU before Hopper) the device falls back, with one warning, to ``fp8_matmul_ref``.
    out: a contiguous [M, N] tensor of ``out_dtype`` to write y into (returned); on CUDA the GEMM writes it
    directly where torch takes ``out=`` for this recipe, else y is copied in.
    """
    if out is not None and (tuple(out.shape) != (x_q.shape[0], w_q.shape[0]) or out.dtype != out_dtype
                            or not out.is_contiguous()):
        raise ValueError(f"fp8_matmul: out {tuple(out.shape)} {out.dtype} must be a contiguous "
                         f"[M={x_q.shape[0]}, N={w_q.shape[0]}] tensor of {out_dtype}")
    M, K = x_q.shape
    N = w_q.shape[0]
    if w_q.shape[1] != K or tuple(s_KbM.shape) != (K // BLOCK, M) or s_w.shape[1] < -(-K // BLOCK) \
            or s_w.shape[0] != -(-N // BLOCK):
        raise ValueError(f"fp8_matmul: x_q {tuple(x_q.shape)}, s {tuple(s_KbM.shape)}, w_q {tuple(w_q.shape)}, "
                         f"s_w {tuple(s_w.shape)}: need s [K/128, M], w_q [N, K], s_w [ceil(N/128), ceil(K/128)]")
    dev = x_q.device
    if M == 0:
        return torch.empty(0, N, dtype=out_dtype, device=dev) if out is None else out
    if dev.type == "cuda":
        dg = _deep_gemm(dev)
        if dg is not None and _dg_fits(x_q, w_q, out_dtype):
            try:
                return _dg_matmul(dg, x_q, s_KbM, w_q, s_w, out_dtype, out)
            except RuntimeError as e:
                if fp8_gemm_choice() == "deepgemm":
                    raise
                _DG[dev] = None
                warnings.warn(f"fp8_matmul: DeepGEMM failed on {dev} ({e}); cuBLAS runs the FP8 products from now on",
                              RuntimeWarning, stacklevel=2)
    if dev.type == "cuda" and _SCALED_MM_OK.get(dev, True):
        y, e = _scaled_mm_retry(x_q, s_KbM, w_q, s_w, out_dtype, out)
        if e is None:
            return y
        _SCALED_MM_OK[dev] = False
        warnings.warn(f"fp8_matmul: torch._scaled_mm refused 1x128 x 128x128 block scaling on {dev} ({e}); "
                      "running the dequantised fp32 product instead (slow)", RuntimeWarning, stacklevel=2)
    y = fp8_matmul_ref(x_q, s_KbM, w_q, s_w, out_dtype)
    return y if out is None else out.copy_(y)


class _FP8Module(nn.Module):
    """``module.to(dtype)`` casts every floating buffer, float8 included: here moves keep the FP8 payload and its
    fp32 scales in their dtypes (the round trip through a wider float is exact)."""

    def _apply(self, fn, recurse=True):
        def keep(t):
            out = fn(t)
            return out.to(t.dtype) if out.dtype != t.dtype else out
        return super()._apply(keep, recurse)


def hf_fp8_payload(hf_linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(w_q, scale) of a transformers FP8 linear layer (``integrations.finegrained_fp8.FP8Linear``, as an FP8
    checkpoint loads: ``weight`` e4m3, ``weight_scale_inv`` per 128 x 128 block, fp32 or ue8m0, which multiplies
    like our scale), or None for a dense layer. Other block sizes or formats are refused by name."""
    w = getattr(hf_linear, "weight", None)
    if w is None or w.dtype != FP8:
        return None
    s = getattr(hf_linear, "weight_scale_inv", None)
    block = getattr(hf_linear, "block_size", None)
    if s is None or block is None or tuple(block) != (BLOCK, BLOCK):
        raise ValueError(f"{type(hf_linear).__name__}: FP8 weight with block_size={block!r} and "
                         f"weight_scale_inv={'absent' if s is None else tuple(s.shape)}: moe-wave reads 128 x 128 "
                         "block scales (the DeepSeek-V4 checkpoints' format)")
    N, K = w.shape
    if tuple(s.shape) != (-(-N // BLOCK), -(-K // BLOCK)):
        raise ValueError(f"{type(hf_linear).__name__}: weight_scale_inv {tuple(s.shape)} does not match weight "
                         f"{(N, K)} in 128 x 128 blocks")
    return w.detach(), s.detach().float()


def hf_weight(hf_linear: nn.Module) -> torch.Tensor:
    """A transformers linear layer's weight as a dense tensor: FP8 ones dequantised to fp32, others as they are."""
    payload = hf_fp8_payload(hf_linear)
    return hf_linear.weight.detach() if payload is None else dequant_weight(*payload)


class QAct(NamedTuple):
    """Activations already in the FP8 format, standing for the tensor of ``shape`` and ``dtype`` (the output's):
    ``FP8Linear`` takes one in place of that tensor and skips its ``act_quant`` (the step before quantised, e.g.
    ``attention.kernels.rms_norm_quant``; two projections of one input then share one quantisation)."""

    q: torch.Tensor         # [M, K] e4m3, M = prod(shape[:-1])
    s: torch.Tensor         # [K/128, M] fp32
    shape: torch.Size       # [..., K]
    dtype: torch.dtype


class FP8Linear(_FP8Module):
    """``nn.Linear`` without bias, its weight in the FP8 format: ``y = x @ W^T``, x quantised per call.

    ``FP8Linear.from_linear(lin)`` quantises a trained (bf16) weight as the checkpoints store it;
    ``forward_q`` takes activations already quantised (e.g. by the sparse core's epilogue)."""

    def __init__(self, in_features: int, out_features: int, device=None):
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(f"FP8Linear: in_features={in_features} must be a multiple of {BLOCK} (its input is "
                             f"quantised per {BLOCK} channels)")
        self.in_features, self.out_features = in_features, out_features
        nb, kb = -(-out_features // BLOCK), -(-in_features // BLOCK)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8, device=device))
        self.register_buffer("weight_scale", torch.ones(nb, kb, dtype=torch.float32, device=device))

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> "FP8Linear":
        if lin.bias is not None:
            raise ValueError("FP8Linear.from_linear: a bias is not supported (the V4 projections have none)")
        return cls.from_quantized(*weight_quant(lin.weight.detach()))

    @classmethod
    def from_quantized(cls, w_q: torch.Tensor, scale: torch.Tensor) -> "FP8Linear":
        """From a checkpoint's pair (w_q [N, K] e4m3, scale [ceil(N/128), ceil(K/128)]), copied bit for bit."""
        N, K = w_q.shape
        mod = cls(K, N, device=w_q.device)
        if w_q.dtype != FP8 or tuple(scale.shape) != tuple(mod.weight_scale.shape):
            raise ValueError(f"FP8Linear.from_quantized: w_q {w_q.dtype} {tuple(w_q.shape)}, scale "
                             f"{tuple(scale.shape)}: need float8_e4m3fn and {tuple(mod.weight_scale.shape)} scales")
        mod.weight.copy_(w_q)
        mod.weight_scale.copy_(scale.float())
        return mod

    @classmethod
    def from_hf(cls, hf_linear: nn.Module) -> "FP8Linear":
        """From a transformers linear layer: an FP8 one's payload as it is, a dense one quantised."""
        payload = hf_fp8_payload(hf_linear)
        return cls.from_quantized(*(payload if payload is not None else weight_quant(hf_linear.weight.detach())))

    def forward(self, x: torch.Tensor | QAct) -> torch.Tensor:
        lead = x.shape[:-1]
        if isinstance(x, QAct):
            if x.shape[-1] != self.in_features:
                raise ValueError(f"FP8Linear: QAct of shape {tuple(x.shape)}: its last dim must be in_features="
                                 f"{self.in_features}")
            return self.forward_q(x.q, x.s, x.dtype).view(*lead, self.out_features)
        x_q, s = act_quant(x.reshape(-1, self.in_features))
        return self.forward_q(x_q, s, x.dtype).view(*lead, self.out_features)

    def forward_q(self, x_q: torch.Tensor, s_KbM: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return fp8_matmul(x_q, s_KbM, self.weight, self.weight_scale, out_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 128x128 blocks"


class GroupedFP8(_FP8Module):
    """A grouped projection (V4's ``wo_a``: z[:, g] = x[:, g] @ W_g^T, W [G*R, Kg]) in the FP8 format.

    Each group's rows are whole 128-row weight blocks (R % 128 == 0), so group g's weight and scales are row
    slices of one quantised matrix; its input is the column slice g of the quantised [M, G*Kg] activations."""

    @staticmethod
    def fits(weight_GRK: torch.Tensor, groups: int) -> bool:
        """Whether the weight's groups are whole 128 x 128 blocks (the constructor's rule)."""
        GR, Kg = weight_GRK.shape
        return GR % groups == 0 and (GR // groups) % BLOCK == 0 and Kg % BLOCK == 0

    def __init__(self, weight_GRK: torch.Tensor, groups: int):
        super().__init__()
        GR, Kg = weight_GRK.shape
        if not self.fits(weight_GRK, groups):
            raise ValueError(f"GroupedFP8: weight {tuple(weight_GRK.shape)} with groups={groups}: rows per group "
                             f"and Kg must be multiples of {BLOCK}")
        self.groups, self.rank, self.in_per_group = groups, GR // groups, Kg
        q, s = weight_quant(weight_GRK.detach())
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", s)

    def forward_q(self, x_q: torch.Tensor, s_KbM: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """[G, M, R] (group-major: ``act_quant(z, groups=G)`` reads it as the [M, G*R] input of the next
        projection without a copy)."""
        out = torch.empty(self.groups, x_q.shape[0], self.rank, dtype=out_dtype, device=x_q.device)
        for g in range(self.groups):
            self.forward_group(x_q, s_KbM, g, out_dtype, out=out[g])
        return out

    def forward_group(self, x_q: torch.Tensor, s_KbM: torch.Tensor, g: int, out_dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """Group g's product [M, R] from the quantised [M, G*Kg] activations (its column slice; ``out``: where
        to write it, ``fp8_matmul``'s)."""
        R, Kg = self.rank, self.in_per_group
        nb, kb = R // BLOCK, Kg // BLOCK
        return fp8_matmul(x_q[:, g * Kg:(g + 1) * Kg], s_KbM[g * kb:(g + 1) * kb], self.weight[g * R:(g + 1) * R],
                          self.weight_scale[g * nb:(g + 1) * nb], out_dtype, out=out)

    def forward(self, x_MGK: torch.Tensor) -> torch.Tensor:
        M = x_MGK.shape[0]
        x_q, s = act_quant(x_MGK.reshape(M, -1))
        return self.forward_q(x_q, s, x_MGK.dtype)

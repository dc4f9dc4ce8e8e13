"""A stack of DeepSeek-V4 decoder layers with random weights: the demo's model, no checkpoint needed.

Legend: B batch, S seq, N hc streams, D hidden, E experts, e local experts, K top-k, V vocab.

``build_layer_stack(preset, num_layers, ...)`` builds ``V4DecoderLayer`` s (attention + mHC + WaveMoE)
with the layer types of the real model (``compress_ratios``, hash layers first) and weights drawn from
seeded generators, so every rank builds the same stack without any communication:

- attention, mHC, norms, router and shared expert: one generator per layer, seeded by (seed, layer),
  on the target device; the same values on every rank (same device type);
- routed experts: one generator per (seed, layer, expert), on the target device. A rank draws only its
  own experts, directly on its device: for V4-Flash (256 x 3 x 4096 x 2048 bf16, ~12.9 GB per layer)
  nothing goes through the CPU, and expert j has the same weights whatever the EP size;
- the parameters that the real model initialises to zero are randomised (v4_spec.md 7.1): attention
  sinks, compressor position bias (``ape``), mHC ``base``, the router's ``e_score_correction_bias``,
  and ``tid2eid`` of the hash layers.

Reference: with ``tiny`` the same call with ``EPGroup.single()`` builds the identical stack with all
experts in one process (the EP result must equal it to fp32 rounding). For ``v4-flash`` / ``v4-pro``
one process cannot hold every expert, so there is no single-process reference: the demo checks the
overlapped schedule against the serial one instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_wave.attention import AttnConfig, ScheduleConfig, V4Attention
from moe_wave.attention.rope import RopeConfig
from moe_wave.comm import EPGroup
from moe_wave.config import MoEConfig, WaveConfig
from moe_wave.fp8 import GroupedFP8
from moe_wave.layer import V4DecoderLayer
from moe_wave.mhc import HCConfig, HyperConnection
from moe_wave.moe import WaveMoE

__all__ = ["StackPreset", "STACK_PRESETS", "build_layer_stack", "layer_ratios", "layer_kind", "run_stack",
           "stack_inputs"]

_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention"}  # any other ratio: HCA
_SHORT = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}


@dataclass(frozen=True, kw_only=True)
class StackPreset:
    """Shapes of one V4 model size (v4_spec.md 1.1) for ``build_layer_stack``.

    ``ratios`` is the head of ``compress_ratios``; ``repeat`` continues it cyclically (the body of the
    real pattern). ``single_reference``: small enough to build every expert in one process.
    """

    moe: str
    vocab_size: int
    heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    rope_dim: int
    yarn_orig: int
    yarn_factor: float
    index_heads: int
    index_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    ratios: tuple[int, ...]
    repeat: tuple[int, ...]
    num_hash_layers: int
    single_reference: bool = False
    eps: float = 1e-6


STACK_PRESETS = {
    # v4_spec.md 7.1: one sliding, one CSA (c4 + indexer), one HCA (ratio 8 so that S >= 16 emits entries).
    "tiny": StackPreset(moe="tiny", vocab_size=64, heads=4, head_dim=32, q_lora_rank=128, o_groups=2, o_lora_rank=64,
                        window=8, rope_dim=8, yarn_orig=64, yarn_factor=4.0, index_heads=8, index_dim=16,
                        index_topk=3, hc_mult=2, hc_sinkhorn_iters=3, ratios=(0, 4, 8), repeat=(4, 8),
                        num_hash_layers=1, single_reference=True),
    "v4-flash": StackPreset(moe="v4-flash", vocab_size=129280, heads=64, head_dim=512, q_lora_rank=1024, o_groups=8,
                            o_lora_rank=1024, window=128, rope_dim=64, yarn_orig=65536, yarn_factor=16.0,
                            index_heads=64, index_dim=128, index_topk=512, hc_mult=4, hc_sinkhorn_iters=20,
                            ratios=(0, 0), repeat=(4, 128), num_hash_layers=3),
    "v4-pro": StackPreset(moe="v4-pro", vocab_size=129280, heads=128, head_dim=512, q_lora_rank=1536, o_groups=16,
                          o_lora_rank=1024, window=128, rope_dim=64, yarn_orig=65536, yarn_factor=16.0,
                          index_heads=64, index_dim=128, index_topk=1024, hc_mult=4, hc_sinkhorn_iters=20,
                          ratios=(128, 128), repeat=(4, 128), num_hash_layers=3),
}


def _preset(name: str) -> StackPreset:
    if name not in STACK_PRESETS:
        raise ValueError(f"preset={name!r}: must be one of {sorted(STACK_PRESETS)}")
    return STACK_PRESETS[name]


def layer_ratios(preset: str, num_layers: int) -> list[int]:
    """``compress_ratios`` of the first ``num_layers`` layers (0 sliding, 4 CSA, else HCA)."""
    p = _preset(preset)
    body = max(0, num_layers - len(p.ratios))
    return (list(p.ratios) + [p.repeat[i % len(p.repeat)] for i in range(body)])[:num_layers]


def layer_kind(layer: V4DecoderLayer) -> str:
    """``"csa+topk"``-style label: attention type + MoE routing."""
    return f"{_SHORT[layer.attn.cfg.layer_type]}+{'hash' if layer.moe.cfg.hash_routing else 'topk'}"


def _attn_config(p: StackPreset, hidden: int, ratio: int) -> AttnConfig:
    lt = _TYPES.get(ratio, "heavily_compressed_attention")
    rope = (RopeConfig(dim=p.rope_dim, theta=10000.0) if ratio == 0 else
            RopeConfig(dim=p.rope_dim, theta=160000.0, yarn_orig=p.yarn_orig, yarn_factor=p.yarn_factor))
    csa = ratio == 4
    return AttnConfig(layer_type=lt, hidden=hidden, heads=p.heads, head_dim=p.head_dim, q_lora_rank=p.q_lora_rank,
                      o_groups=p.o_groups, o_lora_rank=p.o_lora_rank, window=p.window, rope=rope, ratio=ratio,
                      index_heads=p.index_heads if csa else 0, index_dim=p.index_dim if csa else 0,
                      index_topk=p.index_topk if csa else 0, eps=p.eps)


def _seed(seed: int, layer: int, expert: int = -1) -> int:
    # Plain integer arithmetic: the same on every process (no salted hash()).
    return (seed * 1_000_003 + layer * 10_007 + expert + 1) % (1 << 62)


def _gen(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


@torch.no_grad()
def _randomise(layer: V4DecoderLayer, g: torch.Generator) -> None:
    """Every parameter but the routed experts, in module order (identical on every rank)."""
    for name, p in layer.named_parameters():
        if name.startswith("moe.experts."):
            continue
        if name.endswith(("sinks", "ape", "hc.base")):      # zero-initialised in the real model
            p.normal_(0.0, 0.5, generator=g)
        elif p.dim() >= 2:                                   # weights: unit-variance activations
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)
    gate = layer.moe.gate
    gate.e_score_correction_bias.normal_(0.0, 0.1, generator=g)
    if gate.tid2eid is not None:                             # K distinct experts per token id
        V, E = gate.tid2eid.shape[0], layer.moe.cfg.num_experts
        keys_VE = torch.rand(V, E, generator=g, device=gate.tid2eid.device)
        gate.tid2eid.copy_(keys_VE.topk(layer.moe.cfg.top_k, dim=-1).indices)


@torch.no_grad()
def _randomise_experts(layer: V4DecoderLayer, seed: int, idx: int) -> None:
    """This rank's experts only, each from its own generator: no full tensor is ever built."""
    moe = layer.moe
    ex = moe.experts
    for j in range(moe.num_local):
        g = _gen(ex.gate_up.device, _seed(seed, idx, moe.expert_offset + j))
        ex.gate_up[j].normal_(0.0, ex.gate_up.shape[-1] ** -0.5, generator=g)
        ex.down[j].normal_(0.0, ex.down.shape[-1] ** -0.5, generator=g)


def build_layer_stack(preset: str, num_layers: int, *, ep=None, wave: WaveConfig | None = None,
                      schedule: ScheduleConfig | None = None, device=None, dtype=torch.float32, seed: int = 0,
                      num_experts: int | None = None, fp8: bool = False) -> nn.ModuleList:
    """``num_layers`` V4 decoder layers with random weights (see the module docstring).

    Args:
        preset: ``tiny`` (CPU tests), ``v4-flash`` or ``v4-pro``.
        num_layers: layers 0..num_layers-1 of the preset's ``compress_ratios``; the first
            ``num_hash_layers`` are hash-routed.
        ep: the expert-parallel group (default: single process); every rank must call this together.
        wave, schedule: the MoE wave pipeline and the attention stream schedule.
        device, dtype: of the weights (default: ``ep.device``); mHC and norms stay fp32.
        seed: same seed, same weights on every rank.
        num_experts: override E (default: the preset's, rounded up to a multiple of the EP size).
        fp8: DeepSeek-V4's own precision: the attention projections and the routed and shared experts in the
            checkpoints' FP8 format (``V4Attention.quantize_fp8`` with ``wo_a_fp8="auto"`` where wo_a's groups are
            whole 128 x 128 blocks, as at V4's shapes: the grouped FP8 wo_a for prefill-sized calls, the faster one
            there (``benchmarks/results/attn.md``, fp8a); and
            ``WaveMoE.quantize_fp8``).
    Returns:
        ``nn.ModuleList`` of ``V4DecoderLayer`` (run it with ``run_stack``).
    """
    p = _preset(preset)
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers}: must be >= 1")
    ep = ep or EPGroup.single(device)
    device = torch.device(device) if device is not None else ep.device
    base = MoEConfig.preset(p.moe, vocab_size=p.vocab_size)
    E = num_experts if num_experts is not None else -(-base.num_experts // ep.size) * ep.size
    hc = HCConfig(hidden=base.hidden_size, mult=p.hc_mult, sinkhorn_iters=p.hc_sinkhorn_iters, norm_eps=p.eps)
    layers = nn.ModuleList()
    for i, ratio in enumerate(layer_ratios(preset, num_layers)):
        cfg = MoEConfig.preset(p.moe, num_experts=E, vocab_size=p.vocab_size, hash_routing=i < p.num_hash_layers)
        with torch.device(device):  # parameters are born on the device: no CPU copy of a big layer
            attn = V4Attention(_attn_config(p, base.hidden_size, ratio), schedule).to(dtype)
            attn_hc, ffn_hc = HyperConnection(hc), HyperConnection(hc)
            ones = torch.ones(base.hidden_size)
        moe = WaveMoE(cfg, ep=ep, wave=wave, device=device, dtype=dtype)
        layer = V4DecoderLayer(attn, moe, attn_hc, ffn_hc, ones, ones, p.eps)
        _randomise(layer, _gen(device, _seed(seed, i)))
        _randomise_experts(layer, seed, i)
        if fp8:
            attn.quantize_fp8(wo_a_fp8="auto" if GroupedFP8.fits(attn.o_a_weight, attn.cfg.o_groups) else False)
            moe.quantize_fp8()
        layers.append(layer)
    return layers


def stack_inputs(layers: nn.ModuleList, tokens: int, seed: int, device=None, dtype=None):
    """Random (X [1, S, N, D], positions [1, S], input_ids [1, S]) for ``tokens`` = S, from ``seed``."""
    first = layers[0]
    N, D = first.attn_hc.cfg.mult, first.attn_hc.cfg.hidden
    w = first.attn.kv_norm
    device, dtype = device or w.device, dtype or w.dtype
    g = _gen(device, seed)
    X = torch.randn(1, tokens, N, D, generator=g, device=device).to(dtype)
    ids = torch.randint(0, first.moe.cfg.vocab_size or 1, (1, tokens), generator=g, device=device)
    pos = torch.arange(tokens, device=device).unsqueeze(0)
    return X, pos, ids


@torch.no_grad()
def run_stack(layers: nn.ModuleList, X: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor, *,
              overlap: bool | None = None, after_layer=None, validate: bool = True) -> torch.Tensor:
    """X [B, S, N, D] through every layer (prefill, no cache) -> [B, S, N, D].

    ``overlap``: None runs each layer's configured schedules; False / True forces both the attention
    branches and the MoE wave pipeline off / on. ``after_layer(i, X)`` is called after layer i.
    """
    for i, layer in enumerate(layers):
        X = layer(X, positions=positions, input_ids=input_ids, validate=validate, overlap=overlap,
                  moe_overlap=overlap)
        if after_layer is not None:
            after_layer(i, X)
    return X

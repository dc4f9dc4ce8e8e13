"""Configuration of the MoE block (shapes and math) and of the wave pipeline (schedule).

Both are frozen, keyword-only and validated on construction. Process groups, devices and
streams are arguments of the modules, never configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from moe_wave.comm.layout import PARTITIONS, SENDS
from moe_wave.comm.options import SymmOptions

__all__ = ["MoEConfig", "WaveConfig", "PRESETS", "PARTITIONS", "require_hf"]


def require_hf(what: str) -> None:
    """Raise an ImportError naming the extra when transformers (what ``from_hf`` copies from) is missing."""
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{what} copies a transformers DeepseekV4 module, and transformers is not installed: "
                          f"pip install 'moe-wave[hf]' (transformers==5.23.0)") from e

BACKENDS = ("auto", "torch", "symm", "deepep")
SHARED_PLACEMENTS = ("bubbles", "alt", "serial")


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """The DeepSeek-V4 MoE block (v4_spec.md section 4).

    Attributes:
        hidden_size: D.
        intermediate_size: I, the width of every routed expert and of the shared expert.
        num_experts: E routed experts (split evenly over the EP ranks).
        top_k: K experts per token.
        routed_scaling_factor: multiplies the renormalised routing weights (1.5 Flash, 2.5 Pro).
        swiglu_limit: the clamp of gate (from above) and up (both ways); 0 disables it.
        clamp_shared: apply the clamp to the shared expert too (official code and HF >= 5.12).
        num_shared_experts: 0 or 1.
        hash_routing: route by ``tid2eid[input_ids]`` (V4's first layers) instead of top-k.
        vocab_size: rows of ``tid2eid`` (hash layers only).
    """

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    clamp_shared: bool = True
    num_shared_experts: int = 1
    hash_routing: bool = False
    vocab_size: int = 0

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_experts", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEConfig.{name}={getattr(self, name)}: must be >= 1")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k}: must be <= num_experts={self.num_experts}")
        if self.num_shared_experts not in (0, 1):
            raise ValueError(f"MoEConfig.num_shared_experts={self.num_shared_experts}: must be 0 or 1")
        if self.hash_routing and self.vocab_size < 1:
            raise ValueError(f"MoEConfig.vocab_size={self.vocab_size}: hash routing needs vocab_size >= 1")

    @classmethod
    def from_hf(cls, hf_config, layer_idx: int | None = None, **overrides) -> "MoEConfig":
        """From a transformers ``DeepseekV4Config``; ``layer_idx`` decides hash vs top-k routing."""
        require_hf("MoEConfig.from_hf")
        is_hash = False
        if layer_idx is not None:
            types = getattr(hf_config, "mlp_layer_types", None) or []
            is_hash = layer_idx < len(types) and types[layer_idx] == "hash_moe"
        kw = dict(hidden_size=hf_config.hidden_size, intermediate_size=hf_config.moe_intermediate_size,
                  num_experts=hf_config.n_routed_experts, top_k=hf_config.num_experts_per_tok,
                  routed_scaling_factor=float(hf_config.routed_scaling_factor),
                  swiglu_limit=float(hf_config.swiglu_limit or 0.0),
                  num_shared_experts=min(1, int(getattr(hf_config, "n_shared_experts", 1) or 0)),
                  hash_routing=is_hash, vocab_size=int(hf_config.vocab_size))
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def preset(cls, name: str, **overrides) -> "MoEConfig":
        """``v4-flash``, ``v4-pro``, ``balanced`` (comm ~ compute on NVLink) or ``tiny`` (CPU tests)."""
        if name not in PRESETS:
            raise ValueError(f"MoEConfig preset {name!r}: must be one of {sorted(PRESETS)}")
        return replace(PRESETS[name], **overrides)


PRESETS = {
    "v4-flash": MoEConfig(hidden_size=4096, intermediate_size=2048, num_experts=256, top_k=6,
                          routed_scaling_factor=1.5),
    "v4-pro": MoEConfig(hidden_size=7168, intermediate_size=3072, num_experts=384, top_k=6,
                        routed_scaling_factor=2.5),
    # Thin experts and a wide hidden size: per routed row 2*3*D*I FLOPs against 2*D bytes each way,
    # which puts expert time close to all-to-all time over NVLink (benchmarks/results/moe.md).
    "balanced": MoEConfig(hidden_size=7168, intermediate_size=512, num_experts=64, top_k=6),
    # 128-channel multiples: the FP8 format quantises activations per 128 channels (--precision fp8 on CPU)
    "tiny": MoEConfig(hidden_size=128, intermediate_size=128, num_experts=8, top_k=2),
}


@dataclass(frozen=True, kw_only=True)
class WaveConfig:
    """The wave pipeline's schedule.

    Attributes:
        num_waves: W, or "auto" (chosen per shape by ``moe_wave.autowave`` when available, else 2).
            With partition "experts" W is clamped to the local expert count.
        experts_per_wave: alternative to num_waves: local experts per wave (partition "experts").
        partition: "experts" (V4: a wave is a block of local experts) or "tokens" (Tutel style).
        sends: how often a (token, peer) row crosses with partition "experts" (``comm.layout``): "wave" (once per
            wave with one of the token's experts there) or "once" (once per layer each way, whatever W: the peer
            keeps the row for its later waves and sends the token's sum home after the last; symm backend,
            sparse blocks).
        backend: "auto" (the default: "symm" on a CUDA group whose ranks share one host, "torch" elsewhere),
            "torch" (NCCL/RCCL/gloo), "symm" (symmetric memory), "deepep" (if installed). Every WaveMoE of a
            process that resolves to the same backend, group and options shares one backend instance, and so one
            set of symmetric buffers (layers run one after another), like DeepEP's single ``Buffer``.
        overlap: the pipelined schedule; False runs the same operations one after another (the
            ``serial`` baseline).
        shared_placement: "bubbles" (alt stream; gate_up, activation and most of down_proj while
            wave 0 travels, the last ``shared_tail_chunks`` of down_proj during the last combine),
            "alt" (all of it on the alt stream at once) or "serial" (after the routed experts).
        shared_chunks: row chunks the shared down_proj is cut into.
        shared_tail_chunks: how many of them run during the last combine (bubbles only).
        grouped_mm: "auto" (torch._grouped_mm on CUDA bf16, a loop elsewhere), "on" or "off".
        expert_streams: how many streams the pipelined schedule's expert stages take turns on (2, the default: every
            other wave on a second stream, so that one wave's kernels and the head of its grouped GEMM start in the
            tail of the last one's; 1: the caller's stream only). The result is the same bit for bit. Two streams
            bring the routed experts of W waves close to one wave's time (benchmarks/results/experts.md; the
            layer's timings: benchmarks/results/moe.md).
        fp8_rows: with FP8 experts (``WaveMoE.quantize_fp8``) and bf16 activations, rows are quantised once before
            dispatch and travel as FP8 + scales (``moe_wave.fp8_rows``: 0.52 x the bytes of a bf16 row; the same
            result bit for bit), True, the default; False sends bf16 rows and quantises them at the expert stage.
        symm: the symm backend's options (``moe_wave.comm.options.SymmOptions``: capacity, data mode, dense
            blocks, signal, timeouts, kernel tuning).
        autowave_cache: num_waves="auto": where the calibrated choices persist, a ``.json`` file or a folder
            (which gets ``autowave.json``); None (the default) keeps them in this process only.
    """

    num_waves: int | str = 2
    experts_per_wave: int | None = None
    partition: str = "experts"
    sends: str = "wave"
    backend: str = "auto"
    overlap: bool = True
    shared_placement: str = "bubbles"
    shared_chunks: int = 4
    shared_tail_chunks: int = 1
    grouped_mm: str = "auto"
    expert_streams: int = 2
    fp8_rows: bool = True
    symm: SymmOptions = field(default_factory=SymmOptions)
    autowave_cache: str | None = None

    def __post_init__(self):
        nw = self.num_waves
        if nw != "auto" and (isinstance(nw, bool) or not isinstance(nw, int) or nw < 1):
            raise ValueError(f"WaveConfig.num_waves={nw!r}: must be an int >= 1 or 'auto'")
        if self.experts_per_wave is not None and self.experts_per_wave < 1:
            raise ValueError(f"WaveConfig.experts_per_wave={self.experts_per_wave}: must be >= 1")
        if self.partition not in PARTITIONS:
            raise ValueError(f"WaveConfig.partition={self.partition!r}: must be one of {PARTITIONS}")
        if self.sends not in SENDS:
            raise ValueError(f"WaveConfig.sends={self.sends!r}: must be one of {SENDS}")
        if self.backend not in BACKENDS:
            raise ValueError(f"WaveConfig.backend={self.backend!r}: must be one of {BACKENDS}")
        if self.shared_placement not in SHARED_PLACEMENTS:
            raise ValueError(f"WaveConfig.shared_placement={self.shared_placement!r}: "
                             f"must be one of {SHARED_PLACEMENTS}")
        if self.shared_chunks < 1:
            raise ValueError(f"WaveConfig.shared_chunks={self.shared_chunks}: must be >= 1")
        if not 0 <= self.shared_tail_chunks <= self.shared_chunks:
            raise ValueError(f"WaveConfig.shared_tail_chunks={self.shared_tail_chunks}: "
                             f"must be in [0, shared_chunks={self.shared_chunks}]")
        if self.grouped_mm not in ("auto", "on", "off"):
            raise ValueError(f"WaveConfig.grouped_mm={self.grouped_mm!r}: must be 'auto', 'on' or 'off'")
        if isinstance(self.expert_streams, bool) or not isinstance(self.expert_streams, int) \
                or not 1 <= self.expert_streams <= 4:
            raise ValueError(f"WaveConfig.expert_streams={self.expert_streams!r}: must be an int in [1, 4]")
        for name in ("overlap", "fp8_rows"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"WaveConfig.{name}={getattr(self, name)!r}: must be True or False")
        if not isinstance(self.symm, SymmOptions):
            raise ValueError(f"WaveConfig.symm={self.symm!r}: must be a moe_wave.comm.options.SymmOptions")

    def waves_for(self, num_local_experts: int) -> int:
        """The requested wave count before clamping (experts_per_wave wins over num_waves)."""
        if self.experts_per_wave is not None:
            return -(-num_local_experts // self.experts_per_wave)
        if self.num_waves == "auto":
            return 2
        return int(self.num_waves)

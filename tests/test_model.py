"""The random-weight V4 layer stack (moe_wave.tools.stack) and the demo built on it: EP on 2 gloo ranks equals
the single-process stack, overlap on equals off, the weights are seeded and independent of the EP size."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_wave.cli import build_parser
from moe_wave.comm import EPGroup
from moe_wave.config import WaveConfig
from moe_wave.tools.demo import print_demo, resolve_defaults, run_demo_rank
from moe_wave.tools.stack import (STACK_PRESETS, _attn_config, build_layer_stack, layer_kind, layer_ratios,
                                  run_stack, stack_inputs)

ROOT = Path(__file__).resolve().parents[1]
S = 24  # > window 8, >= 16 so that CSA (c4, top-3 of 6) prunes and HCA (ratio 8) emits entries


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


# ----------------------------------------------------------------------------- single process

def test_tiny_stack_layer_types_and_randomised_zero_inits():
    layers = build_layer_stack("tiny", 3, seed=0)
    assert [layer_kind(lay) for lay in layers] == ["sliding+hash", "csa+topk", "hca+topk"]
    assert layers[1].attn.indexer is not None and layers[2].attn.compressor.cfg.ratio == 8
    for lay in layers:
        assert lay.attn.sinks.abs().min() > 0 and lay.attn_hc.base.abs().min() > 0
        assert lay.ffn_hc.base.abs().min() > 0
        assert lay.moe.gate.e_score_correction_bias.abs().min() > 0
    assert layers[1].attn.compressor.ape.abs().min() > 0
    tid2eid = layers[0].moe.gate.tid2eid
    assert tid2eid.shape == (64, 2) and (tid2eid[:, 0] != tid2eid[:, 1]).all() and tid2eid.max() < 8
    assert len(set(map(tuple, tid2eid.tolist()))) > 10  # not one fixed pair


def test_same_seed_same_weights_other_seed_differs():
    a, b, c = (build_layer_stack("tiny", 2, seed=s) for s in (3, 3, 4))
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if pa.dim() >= 2:
            assert not torch.equal(pa, pc), n


def test_flash_and_pro_layer_patterns_and_shapes():
    assert layer_ratios("v4-flash", 6) == [0, 0, 4, 128, 4, 128]
    assert layer_ratios("v4-pro", 4) == [128, 128, 4, 128]
    assert layer_ratios("tiny", 5) == [0, 4, 8, 4, 8]
    for name in ("v4-flash", "v4-pro"):  # the attention configs validate (no weights built)
        for ratio in (0, 4, 128):
            cfg = _attn_config(STACK_PRESETS[name], 4096 if name == "v4-flash" else 7168, ratio)
            assert cfg.ratio == ratio
    with pytest.raises(ValueError, match="preset='v5'"):
        layer_ratios("v5", 2)
    with pytest.raises(ValueError, match="num_layers=0"):
        build_layer_stack("tiny", 0)


def test_overlap_on_equals_off_single_process():
    layers = build_layer_stack("tiny", 3, seed=1)
    inputs = stack_inputs(layers, S, seed=2)
    on = run_stack(layers, *inputs, overlap=True)
    off = run_stack(layers, *inputs, overlap=False)
    assert on.shape == inputs[0].shape and torch.isfinite(on).all()
    assert _rel(on, off) < 1e-6


# ----------------------------------------------------------------------------- 2 gloo ranks

def _ep_vs_single(ep: EPGroup, seed: int) -> dict:
    wave = WaveConfig(num_waves=2)
    layers = build_layer_stack("tiny", 3, ep=ep, wave=wave, seed=seed)
    single = build_layer_stack("tiny", 3, wave=wave, seed=seed)
    inputs = stack_inputs(layers, S, seed=seed + 1 + ep.rank)
    lo, hi = ep.rank * 4, ep.rank * 4 + 4
    same_experts = all(torch.equal(a.moe.experts.gate_up, b.moe.experts.gate_up[lo:hi])
                       and torch.equal(a.moe.experts.down, b.moe.experts.down[lo:hi]) for a, b in zip(layers, single))
    on = run_stack(layers, *inputs, overlap=True)
    off = run_stack(layers, *inputs, overlap=False)
    ref = run_stack(single, *inputs)
    return {"local": layers[0].moe.num_local, "same_experts": same_experts, "ep_vs_single": _rel(on, ref),
            "on_vs_off": _rel(on, off)}


@pytest.mark.timeout(120)
def test_ep_stack_equals_single_process_stack(ranks):
    for res in ranks(2).run(_ep_vs_single, 5):
        assert res["local"] == 4 and res["same_experts"]
        assert res["ep_vs_single"] < 1e-5, res
        assert res["on_vs_off"] < 1e-6, res


def _demo(ep: EPGroup, argv: list[str]) -> dict:
    args = build_parser().parse_args(["demo", *argv])
    resolve_defaults(args)
    return run_demo_rank(ep, args)


@pytest.mark.timeout(120)
def test_demo_rank_checks_and_prints_tables(ranks, capsys):
    argv = ["--tokens", "16", "--iters", "1", "--warmup", "0"]
    res = ranks(2).run(_demo, argv)
    assert res[0] == res[1]  # aggregated over the ranks: the same on each
    out = res[0]
    assert out["ranks"] == 2 and out["bytes"] > 0 and len(out["layers"]) == 3
    args = build_parser().parse_args(["demo", *argv])
    resolve_defaults(args)
    assert print_demo(out, args)
    text = capsys.readouterr().out
    for key in ("bytes moved", "max err", "serial ms", "overlapped ms", "sliding+hash", "csa+topk",
                "hca+topk", "stack", "on CPU the timings are not meaningful"):
        assert key in text, text
    assert "speedup " not in text, "no speedup column on CPU: " + text


# ----------------------------------------------------------------------------- CLI

@pytest.mark.timeout(60)
def test_demo_help_lists_overlap_switches():
    proc = subprocess.run([sys.executable, "-m", "moe_wave", "demo", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for key in ("--attn-overlap", "--no-attn-overlap", "MOE_WAVE_ATTN_OVERLAP", "--overlap", "--no-overlap",
                "MOE_WAVE_OVERLAP", "--layers", "--preset"):
        assert key in text, text


def test_demo_defaults_follow_the_preset():
    args = build_parser().parse_args(["demo", "--preset", "tiny", "--no-attn-overlap"])
    resolve_defaults(args)
    assert (args.layers, args.tokens, args.dtype, args.attn_overlap, args.overlap) == (3, 32, "float32", False, True)
    args = build_parser().parse_args(["demo", "--preset", "v4-flash"])
    resolve_defaults(args)
    assert (args.layers, args.tokens, args.dtype) == (4, 2048, "bfloat16")
    with pytest.raises(ValueError, match="--tokens=0"):
        resolve_defaults(argparse.Namespace(**{**vars(args), "tokens": 0}))

"""The ``symm`` backend on CPU (issue 6): the backend contract against the single-process reference on
1-3 gloo ranks (static-capacity receive buffers, device-side counts, both data modes), WaveMoE with
backend="symm" against backend="torch", the capacity-overflow error on every rank, and the Triton
row-copy kernel under TRITON_INTERPRET=1 against its torch twin (when Triton is installed).

The symmetric-memory transport itself needs GPUs: tests/test_gpu_comm.py."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from moe_wave import MoEConfig, WaveConfig, WaveMoE
from moe_wave.comm import EPGroup
from moe_wave.comm.layout import WavePlan, compute_layout
from moe_wave.comm.symm import SymmBackend
from moe_wave.comm.symm_kernels import copy_rows_torch
from moe_wave.pipeline import run_waves
from moe_wave.reference import reference_dispatch_combine
from tests.ranks import RankPool
from tests.test_dispatch import CASES, E_PER_RANK, _expert_fn, _make_case, slot_by_slot

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _symm_path(ep: EPGroup, x, ids, w, num_waves: int, partition: str, overlap: bool, mode: str,
               capacity: int = 16) -> torch.Tensor:
    e = E_PER_RANK
    plan = WavePlan.make(num_ranks=ep.size, num_local_experts=e, num_waves=num_waves, partition=partition)
    backend = SymmBackend(ep, wave=WaveConfig(max_tokens_per_rank=capacity), mode=mode)
    xplan = backend.prepare(compute_layout(ids, w, plan))

    def experts(got):
        assert got.pairs_e is None and got.x_RD.shape[0] == ep.size * capacity   # static capacity, device counts
        y = slot_by_slot(got, ep.rank * e)
        n_valid = int((got.expert_RK >= 0).sum())
        assert n_valid == int(got.pairs_e_dev.sum()), "pairs_e_dev must count the valid slots"
        return y

    out = torch.zeros(x.shape, dtype=torch.float32)
    return run_waves(x, xplan, backend, experts, out, overlap=overlap)


def _check_symm(ep: EPGroup, modes) -> list:
    errs = []
    for case in CASES:
        x, ids, w = _make_case(case, ep.size)[ep.rank]
        ref = reference_dispatch_combine(x, ids, w, _expert_fn)
        for W in (1, 2, 4):
            for part in ("experts", "tokens"):
                for ov in (True, False):
                    for mode in modes:
                        y = _symm_path(ep, x, ids, w, W, part, ov, mode)
                        errs.append((case, W, part, ov, mode, float((y - ref).abs().max()) if y.numel() else 0.0))
    return errs


@pytest.mark.parametrize("P", [1, 2, 3])
def test_symm_dispatch_combine_matches_reference(ranks, P):
    modes = ["copy"]
    results = [_check_symm(EPGroup.single(), modes)] if P == 1 else ranks(P).run(_check_symm, modes)
    for rank, errs in enumerate(results):
        assert len(errs) == len(CASES) * 3 * 2 * 2 * len(modes)
        bad = [e for e in errs if not e[-1] <= 1e-5]
        assert not bad, f"rank {rank}: {bad}"


def _moe_symm_vs_torch(ep: EPGroup, T_per_rank: list) -> list:
    cfg = MoEConfig.preset("tiny", num_experts=12, top_k=3)
    torch.manual_seed(0)
    full = {"gate": torch.randn(12, 64) * 0.3, "bias": torch.randn(12) * 0.1,
            "gate_up": torch.randn(12, 64, 64) * 0.2, "down": torch.randn(12, 64, 32) * 0.2,
            "shared_gate": torch.randn(32, 64) * 0.2, "shared_up": torch.randn(32, 64) * 0.2,
            "shared_down": torch.randn(64, 32) * 0.2}
    g = torch.Generator().manual_seed(10 + ep.rank)
    x = torch.randn(T_per_rank[ep.rank], 64, generator=g)
    outs = {}
    for backend in ("torch", "symm"):
        m = WaveMoE(cfg, ep=ep, wave=WaveConfig(num_waves=2, backend=backend, max_tokens_per_rank=32))
        m.load_full(full)
        outs[backend] = m(x)
    return float((outs["torch"] - outs["symm"]).abs().max()) if x.numel() else 0.0


def test_wavemoe_symm_matches_torch_backend(ranks):
    """WaveMoE(wave=WaveConfig(backend="symm")) gives the torch backend's result (2 ranks, one empty)."""
    assert ranks(2).run(_moe_symm_vs_torch, [21, 0]) == pytest.approx([0.0, 0.0], abs=1e-5)


def _overflow(ep: EPGroup, capacity: int) -> str:
    x, ids, w = _make_case("one_expert", ep.size)[ep.rank]   # 9 tokens per rank, all to rank P-1
    try:
        _symm_path(ep, x, ids, w, 1, "experts", True, "copy", capacity=capacity)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_capacity_overflow_raises_on_every_rank(ranks):
    msgs = ranks(2).run(_overflow, 4)
    assert msgs[0] == msgs[1], msgs      # every rank raises the same error (no rank left hanging)
    found = re.search(r"capacity overflow in wave 0: rank (\d) sent (\d+) rows to rank (\d), capacity is 4 rows", msgs[0])
    assert found, msgs[0]
    count = int(found.group(2))
    assert count > 4 and f"WaveConfig.max_tokens_per_rank >= {count}" in msgs[0]
    assert ranks(2).run(_overflow, 9) == ["no error", "no error"]   # T == C always fits


def test_bad_mode_and_plan_errors():
    with pytest.raises(ValueError, match=r"mode='fast'"):
        SymmBackend(EPGroup.single(), mode="fast")
    backend = SymmBackend(EPGroup.single())
    plan = WavePlan.make(num_ranks=2, num_local_experts=4, num_waves=1)
    lay = compute_layout(torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2), plan)
    with pytest.raises(ValueError, match=r"WavePlan.num_ranks=2: must equal the EP group size 1"):
        backend.prepare(lay)


def test_out_of_range_ids_raise():
    backend = SymmBackend(EPGroup.single())
    plan = WavePlan.make(num_ranks=1, num_local_experts=4, num_waves=1)
    ids = torch.tensor([[0, 4]])
    with pytest.raises(ValueError, match=r"ids in \[0, 4\].*\[0, 4\)"):
        backend.prepare(compute_layout(ids, torch.ones(1, 2), plan))


@pytest.mark.parametrize("partition", ["experts", "tokens"])
def test_deepep_wave_topk_masks_other_waves(partition):
    """DeepEP's per-wave top-k (rebuilt from the layout on the device) keeps exactly the wave's slots."""
    from moe_wave.comm.deepep import wave_topk

    g = torch.Generator().manual_seed(3)
    P, e, W, T, K = 3, 4, 2, 13, 3
    ids = torch.stack([torch.randperm(P * e, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    plan = WavePlan.make(num_ranks=P, num_local_experts=e, num_waves=W, partition=partition)
    ids_WTK, w_WTK = wave_topk(compute_layout(ids, w, plan))
    if partition == "experts":
        wave_TK = plan.wave_of_local_expert("cpu")[ids % e]
    else:
        wave_TK = ((torch.arange(T) * W) // T)[:, None].expand(T, K)
    for wv in range(W):
        mine = wave_TK == wv
        assert torch.equal(ids_WTK[wv], torch.where(mine, ids, -1))
        assert torch.equal(w_WTK[wv], torch.where(mine, w, 0.0))


def test_deepep_missing_gives_install_hint():
    if importlib.util.find_spec("deep_ep") is not None:
        pytest.skip("deep_ep is installed here")
    from moe_wave.comm.deepep import import_deep_ep

    with pytest.raises(ImportError, match="pip install"):
        import_deep_ep()


# ------------------------------------------------------------------------ Triton kernel (interpreter)
def test_copy_rows_torch_never_writes_skipped_rows():
    src = torch.randn(5, 7)
    dst = torch.full((4, 7), 3.0)
    copy_rows_torch(src, dst, torch.tensor([4, 0, 2]), torch.tensor([1, -1, 3]))
    assert torch.equal(dst[1], src[4]) and torch.equal(dst[3], src[2])
    assert torch.equal(dst[[0, 2]], torch.full((2, 7), 3.0))


_INTERP_SCRIPT = r"""
import torch
from moe_wave.comm.symm_kernels import copy_rows, copy_rows_torch, triton_ok
assert triton_ok("cpu")
g = torch.Generator().manual_seed(0)
for dt in (torch.float32, torch.bfloat16, torch.int32):
    for D in (1, 37, 2500):
        src = (torch.randn(9, D, generator=g) * 100).to(dt)
        a = (torch.randn(6, D, generator=g) * 100).to(dt)
        b = a.clone()
        si = torch.randint(0, 9, (8,), generator=g)
        di = torch.tensor([0, 5, -1, 2, -1, 1, 3, -1])
        copy_rows(src, a, si, di)
        copy_rows_torch(src, b, si, di)
        assert torch.equal(a, b), (dt, D)
from moe_wave.comm.symm_kernels import gather_add, gather_add_torch
for dt in (torch.float32, torch.bfloat16):
    for D in (1, 37, 2500):
        out = torch.randn(5, D, generator=g)
        ref = out.clone()
        src = torch.randn(8, D, generator=g).to(dt)
        slot = torch.tensor([[0, 7], [-1, 4], [3, -1], [-1, -1], [1, 6]])
        gather_add(out, src, slot)
        gather_add_torch(ref, src, slot)
        assert torch.equal(out, ref), (dt, D)
print("ok")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
def test_copy_rows_kernel_matches_torch_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _INTERP_SCRIPT], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def _kernel_mode(ep: EPGroup) -> list:
    return _check_symm(ep, ["kernel"])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
def test_symm_kernel_mode_under_interpreter(monkeypatch):
    """The whole backend with the Triton kernel (interpreted) on 2 ranks: same results as the reference.
    Triton reads TRITON_INTERPRET when the kernel is defined, so the ranks start with it set."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with RankPool(2, deadline_s=240.0) as pool:
        results = pool.run(_kernel_mode)
    for rank, errs in enumerate(results):
        bad = [e for e in errs if not e[-1] <= 1e-5]
        assert errs and not bad, f"rank {rank}: {bad}"

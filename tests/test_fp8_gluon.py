"""The Gluon FP8 GEMM (``moe_wave.fp8_gluon``): the block-scaled product against the dequantised fp32 one, on a
Hopper GPU; the switch that picks it (``fp8.set_gemm_kernel``) and its refusals, everywhere."""

from __future__ import annotations

import pytest
import torch

from moe_wave import fp8 as F
from moe_wave import fp8_gluon as G


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability()[0] == 9


def needs_hopper(fn):
    fn = pytest.mark.skipif(not (_hopper() and G.available()), reason="needs a Hopper GPU and Gluon")(fn)
    return pytest.mark.gpu(fn)


@pytest.fixture
def kernel():
    """Restores the process-wide GEMM setting after a test that changes it."""
    before = F.gemm_kernel()
    yield F.set_gemm_kernel
    F.set_gemm_kernel(before)


def operands(M: int, N: int, K: int, dev: str = "cuda", seed: int = 0, groups: int = 1):
    """x [M, G*K] with rows of very different sizes and w [G*N, K] with blocks of very different sizes, so that a
    scale read from the wrong row or block shows up in the product."""
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(M, groups * K, device=dev, generator=g) * torch.exp2(
        torch.randint(-6, 7, (M, groups * K // 128), device=dev, generator=g).float()).repeat_interleave(128, 1)
    w = torch.randn(groups * N, K, device=dev, generator=g) * 0.02 * torch.exp2(
        torch.randint(-4, 5, (groups * N // 128, K // 128), device=dev, generator=g).float()
    ).repeat_interleave(128, 0).repeat_interleave(128, 1)
    return F.act_quant(x.to(torch.bfloat16)), F.weight_quant(w)


def close(got: torch.Tensor, want: torch.Tensor, rtol: float = 4e-3) -> None:
    """Both add products of the same blocks; they differ by the order of the sums, the tensor core's own precision
    within a k-block (a bound of 1e-3 of each row's largest value) and out's rounding (rtol: bf16's half ulp)."""
    err = (got.float() - want).abs()
    bound = rtol * want.abs() + 1e-3 * want.abs().amax(dim=-1, keepdim=True)
    assert bool((err <= bound).all()), f"max err {err.max().item():.3g}, worst ratio {(err / bound).max().item():.3g}"


# ------------------------------------------------------------------------------------------------ everywhere
def test_set_gemm_kernel_names_the_rule(kernel):
    with pytest.raises(ValueError, match=r"kernel='fast' must be one of \('auto', 'gluon', 'cublas'\)"):
        kernel("fast")
    kernel("auto")
    assert F.gemm_kernel() == "auto"


def test_supported_says_why_not():
    (x_q, s), (w_q, ws) = operands(128, 256, 256, dev="cpu")
    out = torch.empty(128, 256, dtype=torch.bfloat16)
    assert G.supported(x_q, s, w_q, ws, out) is not None                   # CPU tensors: never
    assert not F._gluon_gemm(x_q, s, w_q, ws, out)


def test_cpu_products_ignore_the_setting(kernel):
    (x_q, s), (w_q, ws) = operands(64, 256, 384, dev="cpu", seed=3)
    kernel("gluon")
    torch.testing.assert_close(F.fp8_matmul(x_q, s, w_q, ws), F.fp8_matmul_ref(x_q, s, w_q, ws, torch.bfloat16))


# ------------------------------------------------------------------------------------------------ GPU
@needs_hopper
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("M", [1, 100, 128, 1000])
@pytest.mark.parametrize("N,K", [(128, 128), (256, 640), (1024, 4096), (4096, 1024)])
def test_gpu_gluon_gemm_matches_dequantised_product(M, N, K, wide, monkeypatch):
    """Both kernels (WIDE: 128 x 256 tiles where N is a multiple of 256)."""
    monkeypatch.setattr(G, "WIDE", wide)
    (x_q, s), (w_q, ws) = operands(M, N, K, seed=M + N + K)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    assert G.supported(x_q, s, w_q, ws, out) is None
    G.fp8_gemm_gluon(x_q, s, w_q, ws, out)
    close(out, F.fp8_matmul_ref(x_q, s, w_q, ws, torch.float32))


@needs_hopper
@pytest.mark.parametrize("N", [640, 768])
def test_gpu_gluon_gemm_fp32_out_and_few_programs(N):
    """fp32 out (no rounding to hide behind) and a grid of 3 programs, each walking many tiles and k-blocks (N =
    768: the wide kernel, its copies running ahead across tiles)."""
    (x_q, s), (w_q, ws) = operands(384, N, 1024, seed=7)
    out = torch.empty(384, N, device="cuda", dtype=torch.float32)
    G.fp8_gemm_gluon(x_q, s, w_q, ws, out, programs=3)
    close(out, F.fp8_matmul_ref(x_q, s, w_q, ws, torch.float32), rtol=1e-4)


@needs_hopper
def test_gpu_gluon_gemm_is_bit_stable():
    (x_q, s), (w_q, ws) = operands(1024, 1024, 2048, seed=11)
    a = torch.empty(1024, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    G.fp8_gemm_gluon(x_q, s, w_q, ws, a)
    for _ in range(3):
        G.fp8_gemm_gluon(x_q, s, w_q, ws, b)
        assert torch.equal(a, b)


@needs_hopper
def test_gpu_gluon_gemm_reads_column_slices(kernel):
    """A column block of a wider activation (row stride > K), as the grouped wo_a's groups are, through
    fp8_matmul with the switch on."""
    (x_q, s), (w_q, ws) = operands(256, 256, 512, seed=5, groups=2)
    kernel("gluon")
    got = F.fp8_matmul(x_q[:, 512:], s[4:], w_q[256:], ws[2:])
    want = F.fp8_matmul_ref(x_q[:, 512:].contiguous(), s[4:].contiguous(), w_q[256:], ws[2:], torch.float32)
    close(got, want)


@needs_hopper
@pytest.mark.parametrize("M", [128, 512])
def test_gpu_gluon_grouped_equals_per_group(kernel, M):
    """All groups in one launch (GroupedFP8.forward_q with the switch on) against each group's reference."""
    Gn, R, Kg = 4, 256, 384
    (x_q, s), _ = operands(M, R, Kg, seed=M, groups=Gn)
    mod = F.GroupedFP8(torch.randn(Gn * R, Kg, device="cuda") * 0.05, Gn).cuda()
    kernel("gluon")
    got = mod.forward_q(x_q, s, torch.bfloat16)
    kb, nb = Kg // 128, R // 128
    for g in range(Gn):
        want = F.fp8_matmul_ref(x_q[:, g * Kg:(g + 1) * Kg].contiguous(), s[g * kb:(g + 1) * kb].contiguous(),
                                mod.weight[g * R:(g + 1) * R], mod.weight_scale[g * nb:(g + 1) * nb], torch.float32)
        close(got[g], want)


@needs_hopper
def test_gpu_gluon_gemm_replays_from_a_graph(kernel):
    (x_q, s), (w_q, ws) = operands(512, 512, 1024, seed=13)
    kernel("gluon")
    out = torch.empty(512, 512, device="cuda", dtype=torch.bfloat16)
    F.fp8_matmul(x_q, s, w_q, ws, out=out)                   # compiled outside the capture
    want = out.clone()
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        F.fp8_matmul(x_q, s, w_q, ws, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@needs_hopper
def test_gpu_auto_leaves_decode_to_cublas(kernel, monkeypatch):
    """"auto": fewer than GLUON_MIN_M rows never reach the Gluon kernel; more do."""
    calls = []
    monkeypatch.setattr(G, "fp8_gemm_gluon", lambda *a, **k: calls.append(a[0].shape[0]))
    kernel("auto")
    for M in (F.GLUON_MIN_M - 1, F.GLUON_MIN_M):
        (x_q, s), (w_q, ws) = operands(M, 256, 256, seed=M)
        F.fp8_matmul(x_q, s, w_q, ws)
    assert calls == [F.GLUON_MIN_M]

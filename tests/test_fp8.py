"""The FP8 format of the V4 checkpoints (``moe_wave.fp8``) and the attention layer with FP8 projections.

CPU: the format's bookkeeping (scales land on their blocks, powers of two, exact recovery of representable
tensors), the Triton activation kernel against its torch twin (under the interpreter), the layer's FP8 path
against the bf16 layer. On a GPU (``gpu`` tests): ``torch._scaled_mm``'s 1 x 128 by 128 x 128 product against
the dequantised fp32 product, the kernel bit for bit, and the FP8 layer captured in a CUDA graph.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from moe_wave import attention as A
from moe_wave import fp8 as F
from moe_wave.attention.rope import RopeConfig
from moe_wave.comm.triton_gate import triton_ok

KERNEL_DEV = "cuda"
# the activation kernel runs on a GPU only: Triton's CPU interpreter does not round to float8 correctly
def needs_gpu(fn):
    fn = pytest.mark.skipif(not (torch.cuda.is_available() and triton_ok("cuda")), reason="needs a CUDA GPU")(fn)
    return pytest.mark.gpu(fn)


def representable(N: int, K: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight whose every 128 x 128 block is e4m3 values times a power of two, each block's amax exactly
    448 * its scale (so ``weight_quant`` must give these scales and recover it exactly), and those scales."""
    g = torch.Generator().manual_seed(seed)
    nb, kb = -(-N // 128), -(-K // 128)
    scales = torch.exp2(torch.randint(-12, 2, (nb, kb), generator=g).float())
    q = (torch.randn(N, K, generator=g) * 100).clamp(-440, 440).to(F.FP8).float()
    for i in range(nb):
        for j in range(kb):
            q[i * 128, j * 128] = 448.0                   # the block's amax
    return q * scales.repeat_interleave(128, 0).repeat_interleave(128, 1)[:N, :K], scales


def test_pow2_ceil_is_exact():
    x = torch.tensor([1.0, 1.5, 0.75, 2.0, 3.0e-38, 448.0 / 448.0, 1.0000001, 0.4999999])
    got = F.pow2_ceil(x)
    want = torch.exp2(torch.ceil(torch.log2(x.double()))).float()
    assert torch.equal(got, want)
    assert torch.equal(torch.log2(got), torch.round(torch.log2(got)))


@pytest.mark.parametrize("N,K", [(256, 384), (300, 200), (128, 128)])
def test_weight_quant_recovers_representable_weights(N, K):
    w, scales = representable(N, K)
    q, s = F.weight_quant(w)
    assert q.dtype == F.FP8 and q.shape == (N, K) and s.shape == scales.shape
    assert torch.equal(s, scales)
    assert torch.equal(F.dequant_weight(q, s), w)


def test_weight_quant_error_is_bounded():
    w = torch.randn(384, 256) * torch.logspace(-2, 1, 256)     # channels of very different size
    q, s = F.weight_quant(w)
    err = (F.dequant_weight(q, s) - w).abs()
    # e4m3: 3 mantissa bits, so a normal value is off by at most 2^-4 of itself; small ones by half a subnormal
    # step of their block (2^-10 of the block scale)
    bound = torch.maximum(w.abs() * 2 ** -4, s.repeat_interleave(128, 0).repeat_interleave(128, 1) * 2 ** -10)
    assert (err <= bound * (1 + 1e-6)).all()


def test_act_quant_torch_layout_and_scales():
    x = torch.randn(5, 384) * torch.tensor([1e-3, 1.0, 50.0]).repeat_interleave(128)
    q, s = F.act_quant_torch(x)
    assert q.shape == (5, 384) and s.shape == (3, 5) and s.is_contiguous()
    for j in range(3):
        amax = x[:, j * 128:(j + 1) * 128].abs().amax(1)
        assert torch.equal(s[j], F.pow2_ceil(amax / 448))
    assert (F.dequant_act(q, s) - x).abs().le(x.abs() * 2 ** -4 + s.t().repeat_interleave(128, 1) * 2 ** -10).all()


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "the kernel must round like torch"


@pytest.mark.parametrize("M", [1, 37, 64])
def test_act_quant_on_cpu_is_the_torch_twin(M):
    x = torch.randn(M, 256, dtype=torch.bfloat16)
    q, s = F.act_quant(x, kernels=True)
    q_ref, s_ref = F.act_quant_torch(x)
    assert torch.equal(s, s_ref)
    _same(q, q_ref)


@needs_gpu
@pytest.mark.parametrize("M", [1, 37, 64])
def test_act_quant_kernel_matches_torch(M):
    torch.manual_seed(M)
    x = (torch.randn(M, 512) * torch.logspace(-3, 2, 512)).to(torch.bfloat16).to(KERNEL_DEV)
    q, s = F.act_quant(x, kernels=True)
    q_ref, s_ref = F.act_quant_torch(x)
    assert torch.equal(s, s_ref)
    _same(q, q_ref)


@needs_gpu
def test_act_quant_kernel_scale_at_exact_powers_of_two():
    """A block whose amax is exactly 448 * 2^k gets s = 2^k in the kernel as in the torch twin (the division that
    finds the scale is correctly rounded: an approximate one can land one ulp above 2^k and double s)."""
    torch.manual_seed(3)
    k = torch.arange(-12, 12).float()
    x = torch.rand(k.numel(), 256) * (224.0 * 2.0 ** k)[:, None]  # below the planted amax
    x[:, 7] = 448.0 * 2.0 ** k                                  # the amax of block 0, exactly 448 * 2^k
    x[:, 200] = -448.0 * 2.0 ** k                               # and of block 1, negative
    x = x.to(torch.bfloat16).to(KERNEL_DEV)
    q, s = F.act_quant(x, kernels=True)
    q_ref, s_ref = F.act_quant_torch(x)
    assert torch.equal(s_ref[0].cpu(), 2.0 ** k)
    assert torch.equal(s, s_ref)
    _same(q, q_ref)


@needs_gpu
def test_act_quant_kernel_reads_groups_and_row_strides():
    torch.manual_seed(1)
    z = torch.randn(3, 21, 256, dtype=torch.bfloat16, device=KERNEL_DEV)       # group-major [G, M, Kg]
    q, s = F.act_quant(z, groups=3, kernels=True)
    flat = z.permute(1, 0, 2).reshape(21, 768)
    q_ref, s_ref = F.act_quant_torch(flat)
    assert torch.equal(s, s_ref)
    _same(q, q_ref)
    wide = torch.randn(21, 1024, dtype=torch.bfloat16, device=KERNEL_DEV)
    q2, s2 = F.act_quant(wide[:, 256:768], kernels=True)                       # a column slice: row stride 1024
    q2_ref, s2_ref = F.act_quant_torch(wide[:, 256:768].contiguous())
    assert torch.equal(s2, s2_ref)
    _same(q2, q2_ref)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="K=200 must be a multiple of 128"):
        F.act_quant_torch(torch.randn(3, 200))
    with pytest.raises(ValueError, match=r"x \(2, 3, 128\) must be \[G=4, M, Kg\]"):
        F.act_quant(torch.randn(2, 3, 128), groups=4)
    q, s = F.act_quant_torch(torch.randn(4, 256))
    w, ws = F.weight_quant(torch.randn(128, 384))
    with pytest.raises(ValueError, match="fp8_matmul: x_q"):
        F.fp8_matmul(q, s, w, ws)
    with pytest.raises(ValueError, match="rows per group and Kg must be multiples of 128"):
        F.GroupedFP8(torch.randn(200, 256), groups=2)
    with pytest.raises(ValueError, match="bias is not supported"):
        F.FP8Linear.from_linear(torch.nn.Linear(128, 64, bias=True))


@pytest.fixture
def fp8_gemm_reset():
    """The FP8 library choice back to auto after the test."""
    yield
    F.set_fp8_gemm(None)


def test_fp8_gemm_choice_is_named(monkeypatch, fp8_gemm_reset):
    """The library reads no variable: the tools turn MOE_WAVE_FP8_GEMM into set_fp8_gemm through moe_wave.env."""
    from moe_wave.env import read_env
    with pytest.raises(ValueError, match=r"set_fp8_gemm: 'cutlass' is not one of auto, cublas, deepgemm"):
        F.set_fp8_gemm("cutlass")
    monkeypatch.setenv("MOE_WAVE_FP8_GEMM", "cublas")
    F.set_fp8_gemm(None)
    assert F.fp8_gemm_choice() == "auto"                      # the variable alone changes nothing
    assert read_env({"MOE_WAVE_FP8_GEMM": "DeepGemm "}).fp8_gemm == "deepgemm"   # case and spaces forgiven
    assert read_env({}).fp8_gemm is None
    with pytest.raises(ValueError, match=r"MOE_WAVE_FP8_GEMM='fast': must be one of auto, cublas, deepgemm"):
        read_env({"MOE_WAVE_FP8_GEMM": "fast"})
    F.set_fp8_gemm("cublas")
    assert F.fp8_gemm_choice() == "cublas"
    assert F.fp8_gemm_library("cpu") == "torch-ref"


def test_deepgemm_absent(monkeypatch, fp8_gemm_reset):
    """Without deep_gemm, "auto" runs cuBLAS and "deepgemm" stops at the first product with the import's error
    (checked on any machine: the import fails before the GPU is asked anything)."""
    import sys
    monkeypatch.setitem(sys.modules, "deep_gemm", None)      # import deep_gemm -> ModuleNotFoundError
    dev = torch.device("cuda", 0)
    F.set_fp8_gemm("auto")
    assert F._deep_gemm(dev) is None
    F.set_fp8_gemm("cublas")
    assert F._deep_gemm(dev) is None
    F.set_fp8_gemm("deepgemm")
    with pytest.raises(RuntimeError, match=r"'deepgemm' .*DeepGEMM cannot run .*import deep_gemm "
                                           r"failed \(ModuleNotFoundError"):
        F._deep_gemm(dev)


def test_deepgemm_takes_whole_blocks_and_unit_strides():
    x_q, _ = F.act_quant_torch(torch.randn(8, 1024))
    w_q, _ = F.weight_quant(torch.randn(256, 512))
    assert F._dg_fits(x_q[:, 512:], w_q, torch.bfloat16)      # a column slice: row stride 1024
    assert not F._dg_fits(x_q[:, :512], w_q[:200], torch.bfloat16)          # N not a multiple of 64
    assert not F._dg_fits(x_q[:, :512], w_q, torch.float32)                 # its SM90 FP8 kernel writes bf16
    assert not F._dg_fits(x_q[:, 512:].t().contiguous().t(), w_q, torch.bfloat16)   # channel stride != 1
    x3, _ = F.act_quant_torch(torch.randn(8, 384))
    w3, _ = F.weight_quant(torch.randn(128, 200))
    assert not F._dg_fits(x3[:, :200], w3, torch.bfloat16)                  # K not whole 128-blocks


def test_k_padding_keeps_the_product():
    """The GPU path pads K to 4 blocks for cuBLASLt (fp8._pad_k): zeros with unit scales add nothing."""
    torch.manual_seed(7)
    x_q, s = F.act_quant_torch(torch.randn(5, 384))
    w_q, ws = F.weight_quant(torch.randn(200, 384))
    xp, sp, wp, swp = F._pad_k(x_q, s, w_q, ws)
    assert xp.shape == (5, 512) and wp.shape == (200, 512) and sp.shape == (4, 5) and swp.shape == (2, 4)
    torch.testing.assert_close(F.fp8_matmul_ref(xp, sp, wp, swp, torch.float32),
                               F.fp8_matmul_ref(x_q, s, w_q, ws, torch.float32), rtol=1e-6, atol=1e-5)


def _scaled_mm_stand_in(refuse):
    """A CPU stand-in for torch._scaled_mm: raises RuntimeError where refuse(a, scale_a) names a reason, else the
    reference product (into out when given)."""
    def fake(a, b, scale_a, scale_b, out_dtype, out=None):
        why = refuse(a, scale_a)
        if why:
            raise RuntimeError(f"Invalid scaling configuration: {why}")
        y = F.fp8_matmul_ref(a, scale_a.t(), b.t(), scale_b.t(), out_dtype)
        return y if out is None else out.copy_(y)
    return fake


def test_scaled_mm_gets_row_block_scales_outer_dim_major(monkeypatch):
    """A block of an activation's rows (its scales a column slice of [K/128, M]) reaches torch._scaled_mm with
    scale_a outer-dim-major ([M, K/128] with strides (1, M)), as its 1 x 128 recipe requires: passed as a slice,
    torch refused it and fp8_matmul then fell back to the dequantised product for every later call on the device
    (found by dev/bench_fp8_shapes.py on an H200). Checked on CPU with torch._scaled_mm replaced by a stand-in
    that applies torch's stride rule and returns the reference product."""
    torch.manual_seed(8)
    x_q, s = F.act_quant_torch(torch.randn(64, 512))
    w_q, ws = F.weight_quant(torch.randn(256, 512))
    seen = []

    def rule(a, scale_a):
        if scale_a.stride() != (1, scale_a.shape[0]):
            return f"scale_a.stride()={scale_a.stride()}"
        seen.append(scale_a.shape[0])
    monkeypatch.setattr(torch, "_scaled_mm", _scaled_mm_stand_in(rule))
    for lo, hi in ((0, 32), (32, 64), (16, 48)):
        got = F._scaled_mm(x_q[lo:hi], s[:, lo:hi], w_q, ws, torch.float32)
        assert torch.equal(got, F.fp8_matmul_ref(x_q, s, w_q, ws, torch.float32)[lo:hi])
        out = torch.empty(hi - lo, 256)
        assert F._scaled_mm(x_q[lo:hi], s[:, lo:hi], w_q, ws, torch.float32, out=out).data_ptr() == out.data_ptr()
        assert torch.equal(out, got)
    assert seen == [32] * 6


def test_a_refused_layout_is_retried_contiguous(monkeypatch):
    """Where torch._scaled_mm refuses a call, fp8_matmul's GPU path tries once more with every operand contiguous
    and only a second refusal (the recipe itself) sends the device to the dequantised product: a layout torch does
    not take costs a copy, not every later GEMM. Checked on CPU with a stand-in that refuses a strided x."""
    torch.manual_seed(9)
    x_q, s = F.act_quant_torch(torch.randn(32, 1024))
    w_q, ws = F.weight_quant(torch.randn(128, 512))
    calls = []

    def strided_x(a, scale_a):
        calls.append(a.is_contiguous())
        return None if a.is_contiguous() else "a stand-in's refusal of a strided x"
    monkeypatch.setattr(torch, "_scaled_mm", _scaled_mm_stand_in(strided_x))
    y, err = F._scaled_mm_retry(x_q[:, 512:], s[4:], w_q, ws, torch.float32)
    assert err is None and calls == [False, True]
    assert torch.equal(y, F.fp8_matmul_ref(x_q[:, 512:], s[4:], w_q, ws, torch.float32))

    monkeypatch.setattr(torch, "_scaled_mm", _scaled_mm_stand_in(lambda a, scale_a: "the recipe"))
    y, err = F._scaled_mm_retry(x_q[:, 512:], s[4:], w_q, ws, torch.float32)
    assert y is None and "the recipe" in str(err)


def test_fp8_linear_exact_on_representable_inputs():
    """Representable weights and activations (each 128-block amax = 448 * a power of two): the product of the
    format equals the fp64 product of the originals, so every scale sat on its block."""
    w, _ = representable(256, 384, seed=1)
    x, _ = representable(8, 384, seed=2)
    lin = torch.nn.Linear(384, 256, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    f = F.FP8Linear.from_linear(lin)
    got = f(x)
    want = (x.double() @ w.double().t()).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_grouped_fp8_equals_per_group_linears():
    torch.manual_seed(3)
    G, R, Kg, M = 2, 128, 256, 9
    w = torch.randn(G * R, Kg) * 0.05
    x = torch.randn(M, G, Kg)
    mod = F.GroupedFP8(w, G)
    got = mod(x)                                                   # [G, M, R]
    for g in range(G):
        lin = torch.nn.Linear(Kg, R, bias=False)
        with torch.no_grad():
            lin.weight.copy_(w[g * R:(g + 1) * R])
        torch.testing.assert_close(got[g], F.FP8Linear.from_linear(lin)(x[:, g]), rtol=0, atol=0)


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_fp8_matmul_writes_into_out(dev):
    """out= (a grouped projection's slice of its [G, M, R] output) gets the bits the call returns without it, on
    the GPU written by the GEMM itself where torch takes out= for the recipe (with M not a multiple of 4 through a
    copy); a wrong out is refused by name."""
    torch.manual_seed(4)
    for M in (64, 70):
        x_q, s = F.act_quant(torch.randn(M, 1024, device=dev, dtype=torch.bfloat16))
        w_q, ws = F.weight_quant(torch.randn(256, 512, device=dev) * 0.02)
        want = F.fp8_matmul(x_q[:, 512:], s[4:], w_q, ws)
        out = torch.full((2, M, 256), float("nan"), device=dev, dtype=torch.bfloat16)
        got = F.fp8_matmul(x_q[:, 512:], s[4:], w_q, ws, out=out[1])
        assert got.data_ptr() == out[1].data_ptr() and torch.equal(out[1], want) and out[0].isnan().all()
    with pytest.raises(ValueError, match=r"fp8_matmul: out \(70, 128\) torch.bfloat16 must be a contiguous "
                                         r"\[M=70, N=256\]"):
        F.fp8_matmul(x_q[:, 512:], s[4:], w_q, ws, out=out[0, :, :128])


def test_fp8_needs_inputs_in_whole_blocks():
    with pytest.raises(ValueError, match="FP8Linear: in_features=64 must be a multiple of 128"):
        F.FP8Linear.from_linear(torch.nn.Linear(64, 128, bias=False))
    from moe_wave.tools.stack import build_layer_stack
    layer = build_layer_stack("tiny", 1, fp8=True)[0]      # the tiny preset in 128-channel multiples: FP8 builds
    assert layer.attn.fp8 and layer.moe.fp8


def test_fp8_linear_empty_batch():
    f = F.FP8Linear.from_linear(torch.nn.Linear(256, 128, bias=False))
    y = f(torch.randn(0, 7, 256))
    assert y.shape == (0, 7, 128)


def test_module_to_keeps_fp8():
    f = F.FP8Linear.from_linear(torch.nn.Linear(256, 128, bias=False))
    w, s = f.weight.clone(), f.weight_scale.clone()
    f.to(torch.bfloat16)
    assert f.weight.dtype == F.FP8 and f.weight_scale.dtype == torch.float32
    assert torch.equal(f.weight.view(torch.uint8), w.view(torch.uint8)) and torch.equal(f.weight_scale, s)


TYPES = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 8}


def make_attn(layer_type: str, kernels: str = "off") -> A.V4Attention:
    """Dims that are multiples of 128 where the format needs them (every projection's input)."""
    torch.manual_seed(0)
    csa = layer_type == "compressed_sparse_attention"
    cfg = A.AttnConfig(layer_type=layer_type, hidden=256, heads=4, head_dim=128, q_lora_rank=128, o_groups=2,
                       o_lora_rank=128, window=8, rope=RopeConfig(dim=64, theta=10000.0), ratio=TYPES[layer_type],
                       index_heads=4 if csa else 0, index_dim=128 if csa else 0, index_topk=3 if csa else 0)
    attn = A.V4Attention(cfg, A.ScheduleConfig(kernels=kernels))
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name.endswith(("sinks", "ape")):
                p.normal_(0, 0.5)
            elif p.dim() >= 2:
                p.normal_(0, 0.05)
    return attn.eval()


@pytest.mark.parametrize("wo_a_fp8", [False, True])
@pytest.mark.parametrize("layer_type", list(TYPES))
def test_attention_fp8_close_to_bf16_layer(layer_type, wo_a_fp8):
    attn = make_attn(layer_type)
    x = torch.randn(2, 20, 256)
    pos = torch.arange(20)[None].expand(2, -1)
    with torch.no_grad():
        ref = attn(x, positions=pos)
        q8 = copy.deepcopy(attn).quantize_fp8(wo_a_fp8=wo_a_fp8)
        got = q8(x, positions=pos)
    assert q8.fp8 and q8.q_b_proj.weight.dtype == F.FP8
    if wo_a_fp8:
        assert q8.o_a_weight is None and isinstance(q8.o_a_fp8, F.GroupedFP8)
    else:   # the official code's choice: the checkpoint's FP8 wo_a dequantised, the product in the model dtype
        assert q8.o_a_fp8 is None and torch.equal(q8.o_a_weight, F.dequant_weight(*F.weight_quant(attn.o_a_weight)))
    if q8.indexer is not None:
        assert isinstance(q8.indexer.q_b_proj, F.FP8Linear)
    # five quantised products in a row (wq_a, wq_b, wkv, wo_a, wo_b), each ~3.5 % off in norm
    assert ((got - ref).norm() / ref.norm()).item() < 0.15
    # and not a no-op: the FP8 layer differs from the bf16 one
    assert not torch.allclose(got, ref, rtol=1e-3, atol=1e-3)


def test_attention_fp8_quantises_x_once_for_wq_a_and_wkv(monkeypatch):
    """The front-end quantises x once (``x_quant``) and both FP8 projections that read it take that: the same
    bits as each quantising x itself, one act_quant of x a call instead of two; a bf16 layer has none."""
    import moe_wave.attention.attention as attn_mod

    attn = make_attn("sliding_attention")
    q8 = copy.deepcopy(attn).quantize_fp8()
    x = torch.randn(2, 20, 256)
    pos = torch.arange(20)[None].expand(2, -1)
    with torch.no_grad():
        xq = q8.x_quant(x)
        assert attn.x_quant(x) is None and xq[0].dtype == F.FP8 and xq[0].shape == (40, 256)
        assert torch.equal(q8.q_lora(x, xq), q8.q_lora(x))
        assert torch.equal(q8.window_kv(x, pos, xq), q8.window_kv(x, pos))
        want = copy.deepcopy(q8)(x, positions=pos, overlap=False)
        seen = []
        real = F.act_quant

        def spy(t, *a, **k):                    # which act_quant calls get x (wo_b's input has x's shape here)
            seen.append(t.shape == (40, 256) and torch.equal(t, x.reshape(40, 256)))
            return real(t, *a, **k)

        monkeypatch.setattr(F, "act_quant", spy)                 # (FP8Linear.forward's)
        monkeypatch.setattr(attn_mod, "act_quant", spy)          # (x_quant's, project_out's)
        got = q8(x, positions=pos, overlap=False)
    assert sum(seen) == 1 and len(seen) >= 3, seen               # x once; q_lora's output, z, ...
    assert torch.equal(got, want)


@pytest.mark.parametrize("layer_type", list(TYPES))
def test_attention_fp8_auto_wo_a_picks_by_token_count(layer_type):
    """wo_a_fp8="auto" keeps both wo_a products: a call of fewer than ``wo_a_fp8_min_tokens`` tokens gives the
    wo_a_fp8=False layer's bits, a call of at least that many the wo_a_fp8=True layer's."""
    attn = make_attn(layer_type)
    auto = copy.deepcopy(attn).quantize_fp8(wo_a_fp8="auto", wo_a_fp8_min_tokens=40)
    dense = copy.deepcopy(attn).quantize_fp8(wo_a_fp8=False)
    grouped = copy.deepcopy(attn).quantize_fp8(wo_a_fp8=True)
    assert isinstance(auto.o_a_fp8, F.GroupedFP8) and torch.equal(auto.o_a_weight, dense.o_a_weight)
    assert auto.o_a_fp8_min_tokens == 40 and not auto.fp8_out(39) and auto.fp8_out(40) and grouped.fp8_out(1)
    with torch.no_grad():
        for B, S in ((1, 20), (2, 20)):            # 20 tokens: below; 40: at the threshold
            x = torch.randn(B, S, 256)
            pos = torch.arange(S)[None].expand(B, -1)
            want = (grouped if B * S >= 40 else dense)(x, positions=pos)
            assert torch.equal(auto(x, positions=pos), want)
    with pytest.raises(ValueError, match="wo_a_fp8='yes' must be False, True or 'auto'"):
        make_attn(layer_type).quantize_fp8(wo_a_fp8="yes")


@pytest.mark.skipif(not triton_ok("cpu", want=True) and not torch.cuda.is_available(),
                    reason="Triton cannot run here (not installed, or CPU without TRITON_INTERPRET=1)")
@pytest.mark.parametrize("wo_a_fp8", [False, True])
@pytest.mark.parametrize("layer_type", list(TYPES))
def test_attention_fp8_fused_core_matches_unfused(layer_type, wo_a_fp8):
    """kernels="on": the core kernel with the inverse RoPE (and for an FP8 wo_a the quantisation) in its
    epilogue, against the torch ops, both with FP8 projections. A last-bit difference before a quantisation can
    move an element one e4m3 step, hence the tolerance."""
    off = make_attn(layer_type).quantize_fp8(wo_a_fp8=wo_a_fp8)
    on = copy.deepcopy(off)
    on.schedule = A.ScheduleConfig(kernels="on")
    x = torch.randn(2, 20, 256)
    pos = torch.arange(20)[None].expand(2, -1)
    with torch.no_grad():
        want = off(x, positions=pos)
        got = on(x, positions=pos)
    assert ((got - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.skipif(not triton_ok("cpu", want=True) and not torch.cuda.is_available(),
                    reason="Triton cannot run here (not installed, or CPU without TRITON_INTERPRET=1)")
@pytest.mark.parametrize("layer_type", ["sliding_attention", "compressed_sparse_attention"])
def test_attention_fp8_q_lora_leaves_quantised_once(layer_type, monkeypatch):
    """With the kernels, an FP8 layer's q_norm writes q_lora already quantised (``kernels.rms_norm_quant``) and
    wq_b and the indexer's wq_b both take that ``QAct``: the same bits as each quantising the normalised tensor,
    the whole layer too; no act_quant of q_lora's output is left."""
    import moe_wave.attention.attention as attn_mod
    from moe_wave.attention.compressor import rms_norm

    on = make_attn(layer_type, kernels="on").quantize_fp8(wo_a_fp8=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    on = on.to(dev)
    x = torch.randn(2, 20, 256, device=dev)
    pos = torch.arange(20, device=dev)[None].expand(2, -1)
    with torch.no_grad():
        xq = on.x_quant(x)
        qa = on.q_lora(x, xq)
        dense = rms_norm(on.q_a_proj.forward_q(*xq, x.dtype).view(2, 20, -1), on.q_a_norm, on.cfg.eps, "on")
        assert isinstance(qa, F.QAct) and qa.shape == dense.shape and qa.dtype == x.dtype
        assert torch.equal(on.q_heads(qa, pos, raw=True), on.q_heads(dense, pos, raw=True))
        if on.indexer is not None:
            ix = on.indexer
            assert torch.equal(ix.query(qa, pos, on.freq_F, "on"), ix.query(dense, pos, on.freq_F, "on"))
        got = on(x, positions=pos, overlap=False)
        seen = []
        real = F.act_quant

        def spy(t, *a, **k):
            seen.append(tuple(t.shape))
            return real(t, *a, **k)

        monkeypatch.setattr(F, "act_quant", spy)                              # (FP8Linear.forward's)
        assert on.q_b_proj(qa).shape == (2, 20, on.cfg.heads * on.cfg.head_dim) and not seen
        monkeypatch.setattr(attn_mod.V4Attention, "q_lora", lambda self, x_BSD, xq=None: rms_norm(
            self._proj(self.q_a_proj, x_BSD, xq), self.q_a_norm, self.cfg.eps, "on"))
        want = on(x, positions=pos, overlap=False)
    assert (40, 128) in seen                                                  # the unfused chain's
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"QAct of shape \(2, 20, 256\): its last dim must be in_features=128"):
        on.q_b_proj(F.QAct(qa.q, qa.s, torch.Size([2, 20, 256]), x.dtype))


def test_attention_fp8_decode_continues_prefill():
    """The cache path with FP8 projections: prefill then decode == one pass (same quantised weights; the
    activations of a row are quantised per row, so splitting the sequence changes nothing)."""
    attn = make_attn("compressed_sparse_attention").quantize_fp8()
    x = torch.randn(2, 13, 256)
    pos = torch.arange(13)[None].expand(2, -1)
    with torch.no_grad():
        full = attn(x, positions=pos)
        cache = attn.new_cache(2, 16)
        first = attn(x[:, :12], positions=pos[:, :12], cache=cache)
        last = attn(x[:, 12:], positions=pos[:, 12:], cache=cache)
    torch.testing.assert_close(torch.cat([first, last], 1), full, rtol=1e-5, atol=1e-5)
    assert cache.win_BWd.dtype == torch.float32             # the cache keeps the model dtype


# ----------------------------------------------------------------------------------------------- GPU
@needs_gpu
@pytest.mark.parametrize("M", [1, 3, 64, 1000])
@pytest.mark.parametrize("N,K", [(1024, 4096), (4096, 8192), (448, 512), (128, 256), (200, 640)])
def test_gpu_scaled_mm_matches_dequantised_product(M, N, K):
    torch.manual_seed(M + N)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda") * 0.02
    x_q, s = F.act_quant(x)
    w_q, ws = F.weight_quant(w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                      # a fallback to the fp32 product fails the test
        got = F.fp8_matmul(x_q, s, w_q, ws)
    want = F.fp8_matmul_ref(x_q, s, w_q, ws, torch.float32)
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def _have_deep_gemm() -> bool:
    try:
        import deep_gemm
        return hasattr(deep_gemm, "fp8_gemm_nt") and torch.cuda.is_available() and \
            torch.cuda.get_device_capability()[0] == 9
    except Exception:  # noqa: BLE001
        return False


needs_deep_gemm = pytest.mark.skipif(not _have_deep_gemm(), reason="needs deep_gemm on a Hopper GPU "
                                     "(source launch/deepgemm.sh)")


@pytest.fixture
def dg_calls(monkeypatch):
    """A list that grows by one at each call of deep_gemm.fp8_gemm_nt (which still runs)."""
    import deep_gemm
    calls = []
    real = deep_gemm.fp8_gemm_nt
    monkeypatch.setattr(deep_gemm, "fp8_gemm_nt", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


@needs_gpu
@needs_deep_gemm
@pytest.mark.parametrize("M", [1, 3, 64, 1000])
@pytest.mark.parametrize("N,K", [(1024, 4096), (4096, 8192), (512, 1024), (448, 512), (200, 640)])
def test_gpu_deepgemm_runs_the_products(M, N, K, dg_calls, fp8_gemm_reset):
    """With set_fp8_gemm("deepgemm") every product it takes (N a multiple of 64) runs on DeepGEMM, by rows,
    by column slices and into out=, and equals the dequantised product within FP8's tolerance; the others
    (N = 200) run on cuBLAS."""
    calls = dg_calls
    F.set_fp8_gemm("deepgemm")
    assert F.fp8_gemm_library("cuda") == "deepgemm"
    torch.manual_seed(M + N)
    x_q, s = F.act_quant(torch.randn(M, 2 * K, device="cuda", dtype=torch.bfloat16))
    w_q, ws = F.weight_quant(torch.randn(N, K, device="cuda") * 0.02)
    kb = K // 128
    want = F.fp8_matmul_ref(x_q[:, K:].contiguous(), s[kb:].contiguous(), w_q, ws, torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                        # a fallback fails the test
        got = F.fp8_matmul(x_q[:, K:], s[kb:], w_q, ws)       # a column slice, as the grouped wo_a reads
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        assert F.fp8_matmul(x_q[:, K:], s[kb:], w_q, ws, out=out).data_ptr() == out.data_ptr()
        rows = F.fp8_matmul(x_q[M // 2:, K:], s[kb:, M // 2:], w_q, ws) if M > 1 else got
    tol = dict(rtol=2e-2, atol=2e-2 * want.abs().max().item())
    torch.testing.assert_close(got.float(), want, **tol)
    assert torch.equal(out, got)
    torch.testing.assert_close(rows.float(), want[M // 2:] if M > 1 else want, **tol)
    assert len(calls) == (0 if N % 64 else (3 if M > 1 else 2))


@needs_gpu
@needs_deep_gemm
@pytest.mark.parametrize("N,K", [(1024, 4096), (512, 4096), (8192, 1024), (4096, 8192)])
def test_gpu_deepgemm_same_bits_as_cublas_at_prefill(N, K, fp8_gemm_reset):
    """At 4096 tokens DeepGEMM gives cuBLAS's bits for the V4-Flash projections' shapes (both promote the FP8
    partial sums into fp32 once a 128-channel block; dev/probe_deepgemm.py found the same at every shape), so
    a layer's discrete choices do not depend on which library is installed."""
    torch.manual_seed(N)
    x_q, s = F.act_quant(torch.randn(4096, K, device="cuda", dtype=torch.bfloat16))
    w_q, ws = F.weight_quant(torch.randn(N, K, device="cuda") * K ** -0.5)
    F.set_fp8_gemm("cublas")
    ref = F.fp8_matmul(x_q, s, w_q, ws)
    F.set_fp8_gemm("deepgemm")
    assert torch.equal(F.fp8_matmul(x_q, s, w_q, ws), ref)


@needs_gpu
def test_gpu_scaled_mm_on_column_slices():
    """The grouped wo_a reads column slices of one quantised matrix (row stride > K)."""
    torch.manual_seed(5)
    x = torch.randn(70, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 512, device="cuda") * 0.02
    x_q, s = F.act_quant(x)
    w_q, ws = F.weight_quant(w)
    got = F.fp8_matmul(x_q[:, 512:], s[4:], w_q, ws)
    want = F.fp8_matmul_ref(x_q[:, 512:].contiguous(), s[4:].contiguous(), w_q, ws, torch.float32)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def _decode_replays_like_eager(attn, xd, pd, B: int, T: int, prefill: int) -> None:
    """Prefill into a cache, then decode steps replayed from a CUDA graph equal eager decode, bit for bit."""
    cache = attn.new_cache(B, T)
    attn(xd[:, :prefill], positions=pd[:, :prefill], cache=cache)
    cache.join()
    eager_cache = copy.deepcopy(cache)
    static_x, static_pos = xd[:, prefill:prefill + 1].clone(), pd[:, prefill:prefill + 1].clone()
    warm = copy.deepcopy(cache)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            attn(static_x, positions=static_pos, cache=warm, validate=False)
        warm.join()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = attn(static_x, positions=static_pos, cache=cache)
    for t in range(prefill, T):
        static_x.copy_(xd[:, t:t + 1])
        static_pos.copy_(pd[:, t:t + 1])
        graph.replay()
        eager = attn(xd[:, t:t + 1], positions=pd[:, t:t + 1], cache=eager_cache)
        assert torch.equal(static_out, eager)
    torch.cuda.synchronize()


@needs_gpu
@pytest.mark.parametrize("wo_a_fp8", [False, True])
@pytest.mark.parametrize("layer_type", list(TYPES))
def test_gpu_attention_fp8_matches_cpu_and_replays(layer_type, wo_a_fp8, fp8_gemm_reset):
    """The FP8 layer on the GPU (Triton quantisation, cuBLAS FP8 GEMMs, the core's epilogue) against the same
    layer on CPU (torch quantisation, dequantised products), both fp32 (bf16 against fp32 would measure bf16's
    rounding, which flips FP8 roundings and the indexer's picks); then decode steps replayed from a CUDA graph
    against eager decode, bit for bit. (An fp32 layer's products are cuBLAS's: DeepGEMM writes bf16.)"""
    F.set_fp8_gemm("cublas")
    cpu = make_attn(layer_type).quantize_fp8(wo_a_fp8=wo_a_fp8)
    attn = copy.deepcopy(cpu).to("cuda")
    attn.schedule = A.ScheduleConfig(kernels="auto")
    B, T, prefill = 2, 48, 40
    x = torch.randn(B, T, 256)
    pos = torch.arange(T)[None].expand(B, -1).contiguous()
    xd, pd = x.cuda(), pos.cuda()
    with torch.no_grad():
        want = cpu(x[:, :prefill], positions=pos[:, :prefill])
        got = attn(xd[:, :prefill], positions=pd[:, :prefill])
        assert attn.q_b_proj.weight.dtype == F.FP8
        # fp32 on both sides, but the GPU's Triton dots in fp32 (indexer scores, pooling) round like TF32: their
        # ~1e-3 differences flip a few e4m3 roundings at each quantised product, one step (6-12 %) each. Measured
        # on the H200: under 1e-2 with the bf16 wo_a, 0.014-0.017 with the FP8 wo_a (one more quantisation);
        # the K-padding bug this test found gave 0.06-0.61.
        assert ((got.cpu() - want).norm() / want.norm()).item() < 3e-2
        _decode_replays_like_eager(attn, xd, pd, B, T, prefill)


@needs_gpu
@needs_deep_gemm
@pytest.mark.parametrize("wo_a_fp8", [False, True])
@pytest.mark.parametrize("layer_type", list(TYPES))
def test_gpu_attention_fp8_on_deepgemm(layer_type, wo_a_fp8, dg_calls, fp8_gemm_reset):
    """The bf16 FP8 layer with its products on DeepGEMM: the products go there (counted), prefill equals the same
    layer on cuBLAS within bf16's rounding, and decode replays from a CUDA graph bit for bit (DeepGEMM's launches
    are captured on the layer's streams)."""
    calls = dg_calls
    attn = make_attn(layer_type).quantize_fp8(wo_a_fp8=wo_a_fp8).to("cuda", torch.bfloat16)
    attn.schedule = A.ScheduleConfig(kernels="auto")
    B, T, prefill = 2, 48, 40
    torch.manual_seed(1)
    xd = torch.randn(B, T, 256, device="cuda", dtype=torch.bfloat16)
    pd = torch.arange(T, device="cuda")[None].expand(B, -1).contiguous()
    with torch.no_grad():
        F.set_fp8_gemm("cublas")
        want = attn(xd[:, :prefill], positions=pd[:, :prefill]).float()
        assert not calls
        F.set_fp8_gemm("deepgemm")
        got = attn(xd[:, :prefill], positions=pd[:, :prefill]).float()
        assert len(calls) >= 4                        # wq_a, wkv, wq_b, wo_b at least (N = 128, 128, 512, 256)
        assert ((got - want).norm() / want.norm()).item() < 1e-2
        _decode_replays_like_eager(attn, xd, pd, B, T, prefill)


# ------------------------------------------------------------------------- an FP8 checkpoint through HF
def _hf_fp8_layers():
    """A tiny HF DeepSeek-V4 (dims multiples of 128) whose attention projections are transformers' FP8Linear
    holding our quantisation of the random weights (as an FP8 checkpoint loads), and the same model with those
    weights dequantised into plain layers (what the checkpoint's numbers mean)."""
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.finegrained_fp8 import FP8Linear as HFFP8Linear
    torch.manual_seed(0)
    cfg = transformers.DeepseekV4Config(
        vocab_size=64, hidden_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
        head_dim=128, qk_rope_head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=128, sliding_window=8,
        compress_ratios=[0, 4, 128], compress_rates={"compressed_sparse_attention": 4,
                                                     "heavily_compressed_attention": 8},
        index_n_heads=4, index_head_dim=128, index_topk=3, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, moe_intermediate_size=128, num_hash_layers=0, hc_mult=2, hc_sinkhorn_iters=3,
        max_position_embeddings=256, attn_implementation="eager")
    dense = transformers.DeepseekV4Model(cfg).eval()
    with torch.no_grad():
        for n, p in dense.named_parameters():
            if n.endswith("sinks"):
                p.normal_(0, 0.5)
            elif p.dim() >= 2:
                p.normal_(0, 0.05)
    fp8 = copy.deepcopy(dense)
    names = ("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj")
    for layer_d, layer_q in zip(dense.layers, fp8.layers):
        pairs = [(layer_d.self_attn, layer_q.self_attn, n) for n in names]
        if layer_q.self_attn.compressor is not None and getattr(layer_q.self_attn.compressor, "indexer", None):
            pairs.append((layer_d.self_attn.compressor.indexer, layer_q.self_attn.compressor.indexer, "q_b_proj"))
        for mod_d, mod_q, name in pairs:
            lin = getattr(mod_d, name)
            q, s = F.weight_quant(lin.weight.detach())
            hf = HFFP8Linear(lin.in_features, lin.out_features, block_size=(128, 128))
            with torch.no_grad():
                hf.weight.copy_(q)
                hf.weight_scale_inv.copy_(s)
                lin.weight.copy_(F.dequant_weight(q, s))          # the dense model: the checkpoint's values
            setattr(mod_q, name, hf)
    return cfg, dense, fp8


def test_from_hf_keeps_an_fp8_checkpoints_bytes():
    cfg, dense, fp8 = _hf_fp8_layers()
    x = torch.randn(2, 20, cfg.hidden_size)
    pos = torch.arange(20)[None].expand(2, -1)
    for i in range(3):
        hf_attn = fp8.layers[i].self_attn
        ours = A.V4Attention.from_hf(hf_attn, cfg, layer_idx=i)
        assert ours.fp8 and ours.kv_norm.dtype == torch.float32
        for name in ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj"):
            src = getattr(hf_attn, name)
            assert torch.equal(getattr(ours, name).weight.view(torch.uint8), src.weight.view(torch.uint8))
            assert torch.equal(getattr(ours, name).weight_scale, src.weight_scale_inv)
        assert torch.equal(ours.o_a_weight, dense.layers[i].self_attn.o_a_proj.weight)   # wo_a dequantised
        if ours.indexer is not None:
            assert isinstance(ours.indexer.q_b_proj, F.FP8Linear)
        # the same layer loaded from the dense (dequantised) model and quantised by us holds the same numbers
        # (weights) and runs the same FP8 products: equal outputs
        again = A.V4Attention.from_hf(dense.layers[i].self_attn, cfg, layer_idx=i)
        for name in ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj"):
            setattr(again, name, F.FP8Linear.from_hf(getattr(hf_attn, name)))
        if again.indexer is not None:
            again.indexer.q_b_proj = ours.indexer.q_b_proj
        with torch.no_grad():
            got, want = ours(x, positions=pos), again(x, positions=pos)
            dense_out = A.V4Attention.from_hf(dense.layers[i].self_attn, cfg, layer_idx=i)(x, positions=pos)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        # against the checkpoint's numbers in full precision: only the activations' quantisation differs
        assert ((got - dense_out).norm() / dense_out.norm()).item() < 0.15


def test_from_hf_refuses_other_fp8_blocks():
    pytest.importorskip("transformers")
    from transformers.integrations.finegrained_fp8 import FP8Linear as HFFP8Linear
    hf = HFFP8Linear(256, 128, block_size=(1, 128))
    with pytest.raises(ValueError, match=r"block_size=\(1, 128\).*128 x 128 block scales"):
        F.FP8Linear.from_hf(hf)


def test_act_quant_into_column_slices():
    """act_quant(out=(q, s)): each group of a group-major stack quantised into its columns of one [M, G*K] pair (as
    the overlapped wo_a does, ``ScheduleConfig.wo_a_overlap``) gives the whole stack's bits; scales may be any
    strided view; bad outs are named."""
    z = torch.randn(3, 37, 256) * torch.logspace(-2, 2, 256)
    want_q, want_s = F.act_quant(z, groups=3)
    q = torch.zeros(37, 768, dtype=F.FP8)
    s = torch.zeros(6, 37)
    for g in range(3):
        got = F.act_quant(z[g], out=(q[:, 256 * g:256 * (g + 1)], s[2 * g:2 * (g + 1)]))
        assert got[0].data_ptr() == q[:, 256 * g:].data_ptr()
    _same(q, want_q)
    assert torch.equal(s, want_s)
    with pytest.raises(ValueError, match=r"need q \[M=37, K=256\]"):
        F.act_quant(z[0], out=(q[:, :128], s[:2]))
    with pytest.raises(ValueError, match="s \\[K/128, M\\] fp32"):
        F.act_quant(z[0], out=(q[:, :256], torch.zeros(3, 37)))
    beside = torch.zeros(37, 2)             # scales stored beside each row (fp8_rows): the transposed view
    F.act_quant(z[0], out=(q[:, :256], beside.t()))
    assert torch.equal(beside.t(), want_s[:2])

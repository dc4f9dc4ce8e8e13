"""The sparse core's CUDA C++ kernel (``sparse_core.cuda_impl``: one CTA an item and an SM, two math warpgroups;
Hopper only, compiled at run time by NVRTC) against the torch reference, the unfused chain and the Triton kernel.

The kernel runs only on an sm_90 GPU: those tests skip elsewhere. Its argument checks and where it applies are
tested everywhere (CI's CPU included).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from moe_wave.attention.kernels import norm_rope
from moe_wave.attention.sparse_core import CoreTuning, Steps, core_impl, cuda_impl, sparse_attention, \
    sparse_attention_fused
from moe_wave.fp8 import act_quant_torch
from tests.test_attn_kernels import _core_case

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dev"))

needs_cuda_core = pytest.mark.skipif(not cuda_impl.available(), reason="needs a Hopper GPU")


def rel(a, b):
    return ((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm().clamp_min(1e-30)).item()


def _case(B, S, H, D, spec, dtype, key, device):
    """``test_attn_kernels._core_case`` (random picks: "random", "tail" or "none"; query (0, 0) sees nothing) on
    ``device``."""
    q, parts, sinks = _core_case(B, S, H, D, spec, dtype, key)
    return q.to(device), [(kv.to(device), idx.to(device)) for kv, idx in parts], sinks.to(device)


# name: B, S, H, D, parts, dtype. J not a multiple of the 64-key tile; H = 64 (V4-Flash), 128 (V4-Pro).
CASES = {
    "flash two parts random -1": (2, 3, 64, 512, [(150, 130, "random"), (90, 70, "random")], torch.bfloat16),
    "pro window + top-k tails": (1, 5, 128, 512, [(300, 128, "tail"), (200, 200, "tail")], torch.bfloat16),
    "one part, 37 picks": (2, 4, 64, 512, [(100, 37, "random")], torch.bfloat16),
    "every pick masked": (1, 3, 64, 512, [(50, 64, "none"), (40, 33, "none")], torch.bfloat16),
}
D512 = list(CASES)


def run(q, parts, sinks, **kw):
    (kv1, i1), (kv2, i2) = parts[0], parts[-1]
    out = kw.pop("out", None)
    if out is None:
        out = torch.full_like(q, float("nan"))
    if kw.get("defines") or kw.get("trace") is not None:    # an instrumented build (dev/trace_core_cuda.py)
        from trace_core_cuda import instrumented
        instrumented(q, out, sinks.float(), kv1, i1, kv2, i2, q.shape[-1] ** -0.5, len(parts) == 2, **kw)
        return out
    kw.pop("defines", None)
    kw.pop("trace", None)
    cuda_impl.sparse_attention_cuda(q, out, sinks.float(), kv1, i1, kv2, i2, q.shape[-1] ** -0.5, len(parts) == 2,
                                    **kw)
    return out


def run_fp8(q, parts, sinks, **kw):
    """The kernel's FP8 output (act_quant's format): e4m3 bytes [B * S, H * d] as uint8 and the scales."""
    B, S, H, D = q.shape
    o_q = torch.empty(B * S, H * D, dtype=torch.float8_e4m3fn, device=q.device)
    s = torch.full((H * D // 128, B * S), float("nan"), device=q.device)
    run(q, parts, sinks, out=o_q.view(B, S, H, D), scales=s, **kw)
    return o_q.view(torch.uint8), s


def assert_act_quant_of(got, o):
    """got (run_fp8's bytes and scales) is act_quant_torch of the bf16 output o, bit for bit."""
    want_q, want_s = act_quant_torch(o.reshape(-1, o.shape[-2] * o.shape[-1]))
    assert torch.equal(got[0], want_q.view(torch.uint8)) and torch.equal(got[1], want_s)


def test_supported_and_errors_name_the_rule():
    """Off Hopper (here: CPU tensors) the kernel takes nothing; bad arguments fail before any compile, naming the
    field and the rule."""
    q = torch.zeros(1, 2, 64, 512, dtype=torch.bfloat16)
    assert "on a GPU" in cuda_impl.rule(q, 2)
    assert "bf16 q" in cuda_impl.rule(q.float(), 2) and "bf16 q" in cuda_impl.rule(q[..., :256], 2)
    assert "1 or 2" in cuda_impl.rule(q, 3)
    if torch.cuda.is_available():
        g = q.cuda()
        assert "RoPE tails" in cuda_impl.rule(g, 1, qrf=32)
        assert "cuda_max_picks=2048" in cuda_impl.rule(g, 2, picks=2049)
    # fp32 keys are cast to q's dtype (CoreCall.build): on Hopper the CUDA kernel takes them, elsewhere Triton
    # (a GPU, else the CPU interpreter)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    want = "cuda" if dev == "cuda" and cuda_impl.available() else "triton"
    assert core_impl(q.to(dev), [(torch.zeros(1, 4, 512, device=dev),
                                  torch.zeros(1, 2, 3, dtype=torch.int32, device=dev))]) == want
    kv, idx = torch.zeros(1, 8, 512, dtype=torch.bfloat16), torch.zeros(1, 2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q must be bf16 \[B, S, H, 512\] with H a multiple of 64"):
        cuda_impl.sparse_attention_cuda(q[:, :, :32], q[:, :, :32], torch.zeros(32), kv, idx, kv, idx, 0.1, True)
    with pytest.raises(ValueError, match="the picks must both be int32 or int64"):
        cuda_impl.sparse_attention_cuda(q, q, torch.zeros(64), kv, idx.float(), kv, idx, 0.1, True)
    with pytest.raises(ValueError, match=r"out must be q's shape in torch.float8_e4m3fn \(scales given: FP8\)"):
        cuda_impl.sparse_attention_cuda(q, q, torch.zeros(64), kv, idx, kv, idx, 0.1, True,
                                        scales=torch.zeros(256, 2))
    with pytest.raises(ValueError, match="RoPE tails of q \\(48 channels\\)"):
        cuda_impl.sparse_attention_cuda(q, q, torch.zeros(64), kv, idx, kv, idx, 0.1, True,
                                        q_rope=(torch.zeros(2, dtype=torch.int64), torch.zeros(24), 1e-6))
    with pytest.raises(ValueError, match="kv1's last dim must be contiguous"):
        cuda_impl.sparse_attention_cuda(q, q, torch.zeros(64), kv.transpose(1, 2), idx, kv, idx, 0.1, True)
    odd = torch.zeros(1, 8, 516, dtype=torch.bfloat16)[..., 2:514]       # rows 1032 bytes apart: no 16-byte copies
    with pytest.raises(ValueError, match="kv1 must be 16-byte aligned with strides that are multiples of 8"):
        cuda_impl.sparse_attention_cuda(q, q, torch.zeros(64), odd, idx, kv, idx, 0.1, True)
    # the dispatcher's rule for such operands: the next implementation (Triton) takes the call
    assert "kv1 must be 16-byte aligned" in cuda_impl._operand_rule(q, odd, kv, Steps())
    assert cuda_impl._operand_rule(q, kv, kv, Steps()) is None



def test_dispatcher_order_and_an_unsupported_calls_error():
    """The table's order (cuda, chain, triton, reference), and a call no implementation takes (three parts on the
    kernels only) names each implementation with the rule it fails."""
    from moe_wave.attention.sparse_core import IMPLS
    assert [impl.NAME for impl in IMPLS] == ["cuda", "chain", "triton", "reference"]
    dev = "cuda" if torch.cuda.is_available() else "cpu"     # where Triton runs (on CPU: its interpreter)
    q = torch.zeros(1, 2, 4, 64, device=dev)
    parts = [(torch.zeros(1, 3, 64, device=dev), torch.zeros(1, 2, 2, dtype=torch.int32, device=dev))] * 3
    with pytest.raises(ValueError, match="no implementation takes this call") as e:
        sparse_attention_fused(q, parts, torch.zeros(4, device=dev), 0.1)
    lines = str(e.value).splitlines()[1:]
    assert [ln.split(":")[0].strip() for ln in lines] == ["cuda", "chain", "triton", "reference"]
    assert "3 parts: it takes 1 or 2" in lines[2] and "kernel was asked for" in lines[3]
    with pytest.raises(ValueError, match=r"impl='gluon' must be one of \('auto', 'cuda', 'triton'\)"):
        sparse_attention(q, parts[:1], torch.zeros(4, device=dev), 0.1, impl="gluon")


@needs_cuda_core
@pytest.mark.gpu
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("name", D512)
def test_cuda_core_matches_reference(name, idx_dtype):
    """Within bf16 rounding of the fp32 torch reference and of the Triton kernel (V4-Flash and V4-Pro head counts,
    -1 picks, a query with every pick masked, J not a multiple of the tile, one part or two, batch > 1); the bits
    repeat run to run; the same bits from a CUDA graph's replay."""
    B, S, H, D, spec, dtype = CASES[name]
    q, parts, sinks = _case(B, S, H, D, spec, dtype, name, "cuda")
    parts = [(kv, idx.to(idx_dtype)) for kv, idx in parts]
    want = sparse_attention(q.float(), [(kv.float(), idx) for kv, idx in parts], sinks, D ** -0.5, kernels="off")
    got, again = run(q, parts, sinks), run(q, parts, sinks)
    assert torch.equal(got, again)
    assert torch.equal(got[0, 0], torch.zeros_like(got[0, 0]))
    assert rel(got, want) < 1.5e-2
    assert rel(got, sparse_attention_fused(q, parts, sinks, D ** -0.5, impl="triton")) < 1.5e-2
    out = torch.zeros_like(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(q, parts, sinks, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)


@needs_cuda_core
@pytest.mark.gpu
def test_auto_takes_the_cuda_core_on_prefill_grids():
    """sparse_attention_fused's "auto" on a prefill-sized grid (300 queries, d = 512) runs this kernel: its bits,
    plain and with the layer's three steps (as the layer's prefill calls it: fuse=False); ``CoreTuning(cuda=False)``
    gives the call to the Triton kernel, and so do more picks than ``cuda_max_picks`` (set below this call's); a
    decode-sized grid stays with Triton."""
    q, parts, sinks = _case(1, 300, 64, 512, [(400, 128, "tail"), (100, 96, "tail")], torch.bfloat16, "auto", "cuda")
    scale, eps = 512 ** -0.5, 1e-6
    pos, freq = _rope_inputs(1, 300, 3)
    assert core_impl(q, parts) == "cuda" and core_impl(q, parts, impl="triton") == "triton"
    assert torch.equal(sparse_attention_fused(q, parts, sinks, scale), run(q, parts, sinks))
    o_q, s = run_fp8(q, parts, sinks, q_rope=(pos, freq, eps), o_rope=(pos, freq))
    fq, fs = sparse_attention_fused(q, parts, sinks, scale, q_rope=(pos.view(1, 300), freq, eps),
                                    o_rope=(pos.view(1, 300), freq), out_fp8=True, fuse=False)
    assert torch.equal(fq.view(torch.uint8), o_q) and torch.equal(fs, s)
    off = CoreTuning(cuda=False)
    assert core_impl(q, parts, tuning=off) == "triton"
    assert torch.equal(sparse_attention_fused(q, parts, sinks, scale, tuning=off),
                       sparse_attention_fused(q, parts, sinks, scale, impl="triton"))
    assert core_impl(q[:, :1], [(kv, idx[:, :1]) for kv, idx in parts]) == "triton"
    few = CoreTuning(cuda_max_picks=200)                               # (this call has 128 + 96 picks)
    assert core_impl(q, parts, tuning=few) == "triton"
    assert torch.equal(sparse_attention_fused(q, parts, sinks, scale, tuning=few),
                       sparse_attention_fused(q, parts, sinks, scale, impl="triton"))


@needs_cuda_core
@pytest.mark.gpu
def test_cuda_core_at_prefill_picks():
    """benchmarks/bench_core.py's V4-Flash prefill picks of 1000 queries (sliding, CSA's window + top-512, HCA) against
    the torch reference: many items a CTA, S not a multiple of anything."""
    import bench_core as bc

    for kind in ("sliding", "csa", "hca"):
        q, parts, sinks = bc.make(kind, 1000, 64, 512, torch.device("cuda"))
        want = sparse_attention(q.float(), [(kv.float(), idx) for kv, idx in parts], sinks, 512 ** -0.5,
                                kernels="off")
        assert rel(run(q, parts, sinks), want) < 1.5e-2, kind


@needs_cuda_core
@pytest.mark.gpu
def test_cuda_core_at_v4_pro_csa_picks():
    """V4-Pro's CSA layer (128 heads, a 128-key window and 1024 top-k picks: 1152 a query, 18 tiles in 9 rounds)
    runs on this kernel (``CoreTuning.cuda_max_picks``) and matches the torch reference there, -1 picks and a query
    that sees only
    its window included, with the layer's steps (q's norm and RoPE in, the output's inverse RoPE and FP8 out) within
    bf16 rounding of the chain."""
    g = torch.Generator(device="cuda").manual_seed(11)
    S, H, D, M = 300, 128, 512, 3000                                     # (a prefill-sized grid: 600 items)
    q = torch.randn(1, S, H, D, device="cuda", generator=g).to(torch.bfloat16)
    kv1 = torch.randn(1, S + 128, D, device="cuda", generator=g).to(torch.bfloat16)
    kv2 = torch.randn(1, M, D, device="cuda", generator=g).to(torch.bfloat16)
    i1 = (torch.arange(128, device="cuda")[None, :] + torch.arange(S, device="cuda")[:, None])[None].int()
    i2 = torch.rand(S, M, device="cuda", generator=g).topk(1024, dim=1).indices.int()
    i2 = torch.where(torch.rand(S, 1024, device="cuda", generator=g) < 0.1, -1, i2)
    i2[5] = -1                                                            # only its window
    parts, sinks = [(kv1, i1), (kv2, i2[None].contiguous())], torch.randn(H, device="cuda", generator=g)
    assert core_impl(q, parts) == "cuda" and cuda_impl.rule(q, 2, picks=128 + 1024) is None
    want = sparse_attention(q.float(), [(kv.float(), idx) for kv, idx in parts], sinks, D ** -0.5, kernels="off")
    assert rel(run(q, parts, sinks), want) < 1.5e-2
    pos, freq = _rope_inputs(1, S, 13)
    both = run(q, parts, sinks, q_rope=(pos, freq, 1e-6), o_rope=(pos, freq))
    ref = norm_rope(sparse_attention(q.float(), [(kv.float(), idx) for kv, idx in parts], sinks, D ** -0.5,
                                     kernels="off", q_rope=(pos.view(1, S), freq, 1e-6)).to(torch.bfloat16),
                    pos, freq, norm=False, inverse=True)
    assert rel(both, ref) < 1.5e-2
    assert_act_quant_of(run_fp8(q, parts, sinks, q_rope=(pos, freq, 1e-6), o_rope=(pos, freq)), both)


@needs_cuda_core
@pytest.mark.gpu
@pytest.mark.parametrize("H", [64, 128])
def test_cuda_core_window_ring_keeps_rows(H):
    """One part of 128 picks (a sliding window: the kernel's WRING ring, each CTA a run of items): the layer's window
    picks (``kernels.picks``: batch row 0 fresh, row 1 a chunk after a cached ring), one query's picks changed (its
    rows and the next query's copied again), random picks in a last stretch. Within bf16 rounding of the reference;
    the bits of the same kernel copying every row (NOREUSE, an instrumented build of dev/trace_core_cuda.py), plain
    and with the layer's steps; the trace counts the items whose rows stayed (the next query's window; with 128
    heads also the next head block's)."""
    from moe_wave.attention.kernels import picks

    g = torch.Generator(device="cuda").manual_seed(3)
    B, S, D = 2, 300, 512
    pos = torch.stack([torch.arange(S), 500 + torch.arange(S)]).cuda()
    idx = picks(pos, window=128).contiguous()                           # [B, S, 128] rows of [ring | chunk]
    idx[0, 150, 60] = 3
    idx[1, 260:] = torch.randint(-1, 128 + S, (S - 260, 128), device="cuda", generator=g).int()
    q = torch.randn(B, S, H, D, device="cuda", generator=g).to(torch.bfloat16)
    kv = torch.randn(B, 128 + S, D, device="cuda", generator=g).to(torch.bfloat16)
    parts, sinks = [(kv, idx)], torch.randn(H, device="cuda", generator=g)
    want = sparse_attention(q.float(), [(kv.float(), idx)], sinks, D ** -0.5, kernels="off")
    got = run(q, parts, sinks)
    assert rel(got, want) < 1.5e-2
    assert torch.equal(got, run(q, parts, sinks, defines="NOREUSE 1"))
    rope = dict(q_rope=(pos.flatten(), torch.rand(32, device="cuda", generator=g) * 0.5, 1e-6))
    rope["o_rope"] = rope["q_rope"][:2]
    fp8 = run_fp8(q, parts, sinks, **rope)
    assert all(torch.equal(x, y) for x, y in zip(fp8, run_fp8(q, parts, sinks, defines="NOREUSE 1", **rope)))
    n = cuda_impl.ctas_resident(q.device.index)
    items = B * S * H // 64
    tr = torch.zeros(n, 32, dtype=torch.int64, device="cuda")
    run(q, parts, sinks, trace=tr)
    kept = int(tr[:, 24].sum())
    assert int(tr[:, 14].sum()) == items and items // 2 < kept < items
    tr.zero_()
    run(q, parts, sinks, trace=tr, defines="NOREUSE 1")
    assert int(tr[:, 24].sum()) == 0


@needs_cuda_core
@pytest.mark.gpu
def test_cuda_core_fp8_out_by_tma_or_by_threads():
    """A contiguous FP8 out leaves by TMA stores (TMAO: the driver encodes its tensor map), a strided one by the
    threads' 16-byte stores: the same bytes and scales, and nothing written beside the strided rows."""
    B, S, H, D, spec, dtype = CASES["pro window + top-k tails"]
    q, parts, sinks = _case(B, S, H, D, spec, dtype, "tma", "cuda")
    o_q, s = run_fp8(q, parts, sinks)
    assert cuda_impl._tmap_rows(o_q.view(torch.float8_e4m3fn), B * S * H) is not None
    wide = torch.zeros(B, S, H, D + 32, dtype=torch.float8_e4m3fn, device="cuda")
    s2 = torch.full_like(s, float("nan"))
    run(q, parts, sinks, out=wide[..., :D], scales=s2)
    assert torch.equal(wide[..., :D].reshape(B * S, H * D).view(torch.uint8), o_q) and torch.equal(s2, s)
    assert not wide[..., D:].view(torch.uint8).any()


def _rope_inputs(B, S, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pos = torch.randint(0, 5000, (B * S,), device="cuda", generator=g)
    return pos, torch.rand(32, device="cuda", generator=g) * 0.5


@needs_cuda_core
@pytest.mark.gpu
@pytest.mark.parametrize("name", D512)
def test_cuda_core_epilogue_has_the_unfused_chains_bits(name):
    """The layer's steps after the core in the kernel's epilogue: o_rope equals norm_rope(o, inverse) of its own
    plain output (at most 1 in 10 000 elements off, by one ulp); out_fp8 equals
    act_quant_torch of its own bf16 output, with and without o_rope (e4m3 bytes and scales, exactly)."""
    B, S, H, D, spec, dtype = CASES[name]
    q, parts, sinks = _case(B, S, H, D, spec, dtype, name, "cuda")
    pos, freq = _rope_inputs(B, S, 5)
    plain = run(q, parts, sinks)
    unrot = norm_rope(plain, pos, freq, norm=False, inverse=True)
    got = run(q, parts, sinks, o_rope=(pos, freq))
    off = got != unrot
    ulp = (unrot.float().abs() * torch.finfo(dtype).eps).clamp_min(torch.finfo(dtype).tiny)
    assert off.sum().item() <= max(1, got.numel() // 10000)
    assert bool(((got.float() - unrot.float()).abs() <= ulp)[off].all())
    assert torch.equal(got, plain) == bool(plain.eq(0).all())         # the rotation happened (if not all 0)
    for src, rope in ((got, (pos, freq)), (plain, None)):
        assert_act_quant_of(run_fp8(q, parts, sinks, o_rope=rope), src)


@needs_cuda_core
@pytest.mark.gpu
@pytest.mark.parametrize("name", D512)
def test_cuda_core_prologue_is_norm_rope(name):
    """q's per-head RMSNorm (a factor of the head's scores) and RoPE (its tail turned in shared memory) in the
    kernel, against norm_rope then the plain kernel and the fp32 reference: within bf16 rounding, the bits repeat;
    with all three steps the bits of its own output quantised, within bf16 rounding of the Triton chain's."""
    B, S, H, D, spec, dtype = CASES[name]
    q, parts, sinks = _case(B, S, H, D, spec, dtype, name, "cuda")
    g = torch.Generator(device="cuda").manual_seed(7)
    q = (q.float() * torch.rand(B, S, H, 1, device="cuda", generator=g) * 8).to(dtype)   # norms far from 1
    pos, freq = _rope_inputs(B, S, 7)
    eps, scale = 1e-6, D ** -0.5
    want = run(norm_rope(q, pos, freq, eps=eps), parts, sinks)
    got, again = run(q, parts, sinks, q_rope=(pos, freq, eps)), run(q, parts, sinks, q_rope=(pos, freq, eps))
    assert torch.equal(got, again)
    assert rel(got, want) < 1e-2
    ref = sparse_attention(q.float(), [(kv.float(), idx) for kv, idx in parts], sinks, scale, kernels="off",
                           q_rope=(pos.view(B, S), freq, eps))
    assert rel(got, ref) < 1.5e-2
    both = run(q, parts, sinks, q_rope=(pos, freq, eps), o_rope=(pos, freq))
    fq, fs = run_fp8(q, parts, sinks, q_rope=(pos, freq, eps), o_rope=(pos, freq))
    assert_act_quant_of((fq, fs), both)
    fq = fq.view(torch.float8_e4m3fn)
    gq, gs = sparse_attention_fused(q, parts, sinks, scale, q_rope=(pos.view(B, S), freq, eps),
                                    o_rope=(pos.view(B, S), freq), out_fp8=True, fuse=False, impl="triton")
    deq = (fq.float().view(B * S, H * D // 128, 128) * fs.t()[..., None]).view(B * S, -1)
    gdeq = (gq.float().view(B * S, H * D // 128, 128) * gs.t()[..., None]).view(B * S, -1)
    assert rel(deq, gdeq) < 3e-2


_CHILD = r"""
import sys, time, torch
from moe_wave.attention.sparse_core import cuda_build, cuda_impl
compiles = []
if sys.argv[2] == "cached":     # the second process: nothing may compile
    cuda_build.compile_cubin = lambda *a, **k: sys.exit("compiled again")
else:
    _compile = cuda_build.compile_cubin
    cuda_build.compile_cubin = lambda *a, **k: compiles.append(1) or _compile(*a, **k)
q = torch.randn(1, 4, 64, 512, device="cuda").to(torch.bfloat16)
kv = torch.randn(1, 300, 512, device="cuda").to(torch.bfloat16)
idx = torch.randint(0, 300, (1, 4, 200), device="cuda", dtype=torch.int32)
t = time.perf_counter()
cuda_impl.sparse_attention_cuda(q, torch.empty_like(q), torch.zeros(64, device="cuda"), kv, idx, kv, idx, 0.05, True,
                                cache_dir=sys.argv[1])
torch.cuda.synchronize()
print(f"compiled {len(compiles)} first call {1e3 * (time.perf_counter() - t):.1f} ms")
"""


@needs_cuda_core
@pytest.mark.gpu
def test_second_process_loads_the_cached_cubin(tmp_path):
    """The compiled kernel is cached on disk (``CoreTuning.kernel_cache``): a second process's first call compiles
    nothing (its compile is replaced by an exit), where the first process compiled. Both first calls' times are
    printed (run with -s): the figure for the results table, not a test threshold."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    times, compiled = [], []
    for mode in ("fresh", "cached"):
        r = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), mode], capture_output=True, text=True,
                           env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        words = r.stdout.split()
        compiled.append(int(words[words.index("compiled") + 1]))
        times.append(float(words[-2]))
    print(f"first call: {times[0]:.1f} ms compiling, {times[1]:.1f} ms from the disk cache")
    assert compiled[0] >= 1 and compiled[1] == 0, compiled

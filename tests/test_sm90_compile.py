"""The direct kernels of the DeepEP front door (``deepep_compat.normal_kernels``, ``deepep_compat.ll_direct_kernels``)
compile for a Hopper GPU (sm_90) on a machine without one, whatever type Triton gives their wait bound: an int
argument is typed by its value, so ``limit`` (the timeout in ns, or spins) is int32 below 2^31 (a timeout under
about 2.1 s) and int64 above. The interpreter runs kernels untyped, so only a real compile checks that no branch
gives a variable another type. Needs Triton's CUDA backend (its wheel ships ptxas); no GPU, no driver."""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")


def _ptxas() -> bool:
    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


pytestmark = pytest.mark.skipif(not _ptxas(), reason="needs Triton's CUDA backend with ptxas")

NORMAL = "moe_wave.deepep_compat.normal_kernels"
COMMON = {"d16_ptr": "*i64", "head_ptr": "*i32", "tab_ptr": "*i64", "ctrl_ptr": "*i64", "c8_ptr": "*i64",
          "word_ptr": "*i64", "fault_ptr": "*i64"}
# the low-latency kernels take their buffers' addresses as ints (i64), the caller's tensors as pointers
LL = "moe_wave.deepep_compat.ll_direct_kernels"
LL_TENSORS = {"x_ptr": "*bf16", "ids_ptr": "*i64", "out_ptr": "*bf16", "stats_ptr": "*i32", "y_ptr": "*bf16",
              "w_ptr": "*fp32"}


def _ll_consts(kernel: str, fp8: bool) -> dict:
    """The launches' constants of a V4-sized low-latency call (P 4, T 128, H 4096, top-8 of 256), both phases."""
    from types import SimpleNamespace

    from moe_wave.deepep_compat import ll_direct as ld

    P, T, H, K, E = 4, 128, 4096, 8, 256
    rg = SimpleNamespace(P=P, T=T, H=H, K=K, E=E, lay=ld.region_layout(P, T, H, K, E))
    if kernel == "_ZN8moe_wave8dispatchEv":
        return ld._dispatch_consts(rg, True, True, fp8, False, False, True, True, False)
    return ld._combine_consts(rg, True, True, True, True, True, False, ld.LLTune())


def _kernels() -> dict:
    """name: (module, kernel, argument types, constants)."""
    ks = {
        "normal dispatch": (NORMAL, "_dispatch_kernel", {"reg_ptr": "*i64", **COMMON},
                            dict(HAS_B=True, BLOCK_A=256, BLOCK_B=16, ROWS=8, NSEND=4, NRECV=4, PHASE=0, NCHM=64,
                                 CLOCK=True)),
        "normal combine": (NORMAL, "_combine_kernel",
                           {"regb_ptr": "*fp32", "w_ptr": "*fp32", "ow_ptr": "*fp32", **COMMON},
                           dict(HAS_W=True, HAS_B0=True, HAS_B1=True, UA=2, BLOCK_A=256, BLOCK_B=16, ROWS=8,
                                NSEND=4, NRECV=4, PHASE=0, NCHM=64, CLOCK=True)),
    }
    for fp8 in (False, True):
        ks[f"low-latency dispatch {'fp8' if fp8 else 'bf16'}"] = (
            LL, "_ZN8moe_wave8dispatchEv", {**LL_TENSORS, "out_ptr": "*u8" if fp8 else "*bf16"},
            _ll_consts("_ZN8moe_wave8dispatchEv", fp8))
    ks["low-latency combine"] = (LL, "_ZN8moe_wave7combineEv", LL_TENSORS, _ll_consts("_ZN8moe_wave7combineEv", False))
    return ks


KERNELS = _kernels()


SCRIPT = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

for module, kernel, types, consts in json.loads(sys.argv[1]):
    fn = getattr(importlib.import_module(module), kernel)
    sig = {}
    for i, name in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr:
            sig[name] = "constexpr"
        else:   # the normal kernels' pointers default to bf16; an address passed as an int is i64
            dflt = "*bf16" if module.endswith("normal_kernels") else "i64"
            sig[name] = types.get(name, dflt if name.endswith(("_ptr", "_addr")) else "i32")
    k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    print(kernel, types["limit"], "cubin bytes", len(k.asm["cubin"]))
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_direct_kernels_compile_for_sm90_with_either_limit_type(kernel, tmp_path):
    """One process without TRITON_INTERPRET (the tests' interpreter would hand the compiler interpreted functions),
    compiling the kernel with the GPU's clock (CLOCK, as the Buffer launches it) and the bound as int32 and as
    int64."""
    import json
    import subprocess
    import sys

    module, fn, types, consts = KERNELS[kernel]
    assert consts["CLOCK"] is True
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    arg = json.dumps([[module, fn, {**types, "limit": limit}, consts] for limit in ("i32", "i64")])
    proc = subprocess.run([sys.executable, "-c", SCRIPT, arg], cwd=root, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("cubin bytes") == 2, proc.stdout

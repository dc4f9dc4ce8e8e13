"""The direct normal-mode kernels (``deepep_compat.normal_kernels``) compile for a Hopper GPU (sm_90) on a machine
without one, whatever type Triton gives their wait bound: an int argument is typed by its value, so ``limit`` (the
timeout in ns, or spins) is int32 below 2^31 (a timeout under about 2.1 s) and int64 above. The interpreter runs
kernels untyped, so only a real compile checks that no branch gives a variable another type. Needs Triton's CUDA
backend (its wheel ships ptxas); no GPU, no driver."""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")


def _ptxas() -> bool:
    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


pytestmark = pytest.mark.skipif(not _ptxas(), reason="needs Triton's CUDA backend with ptxas")

COMMON = {"d16_ptr": "*i64", "head_ptr": "*i32", "tab_ptr": "*i64", "ctrl_ptr": "*i64", "c8_ptr": "*i64",
          "word_ptr": "*i64", "fault_ptr": "*i64"}
KERNELS = {
    "_dispatch_kernel": ({"reg_ptr": "*i64", **COMMON},
                         dict(HAS_B=True, BLOCK_A=256, BLOCK_B=16, ROWS=8, NSEND=4, NRECV=4, PHASE=0, NCHM=64)),
    "_combine_kernel": ({"regb_ptr": "*fp32", "w_ptr": "*fp32", "ow_ptr": "*fp32", **COMMON},
                        dict(HAS_W=True, HAS_B0=True, HAS_B1=True, UA=2, BLOCK_A=256, BLOCK_B=16, ROWS=8,
                             NSEND=4, NRECV=4, PHASE=0, NCHM=64)),
}


SCRIPT = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moe_wave.deepep_compat import normal_kernels as nk

for kernel, types, consts in json.loads(sys.argv[1]):
    fn = getattr(nk, kernel)
    sig = {}
    for i, name in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr:
            sig[name] = "constexpr"
        else:
            sig[name] = types.get(name, "*bf16" if name.endswith("_ptr") else "i32")
    k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    print(kernel, types["limit"], "cubin bytes", len(k.asm["cubin"]))
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_normal_kernels_compile_for_sm90_with_either_limit_type(kernel, tmp_path):
    """One process without TRITON_INTERPRET (the tests' interpreter would hand the compiler interpreted functions),
    compiling the kernel with the GPU's clock (CLOCK, the Buffer's) and the bound as int32 and as int64."""
    import json
    import subprocess
    import sys

    types, consts = KERNELS[kernel]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    arg = json.dumps([[kernel, {**types, "limit": limit}, {**consts, "CLOCK": True}] for limit in ("i32", "i64")])
    proc = subprocess.run([sys.executable, "-c", SCRIPT, arg], cwd=root, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("cubin bytes") == 2, proc.stdout

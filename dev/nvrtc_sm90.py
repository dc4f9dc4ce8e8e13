"""Compile the CUDA C++ sparse core with NVRTC on a machine without a GPU, as the library does on the GPU host
(``sparse_core.cuda_build``): every variant the tests compile, and instrumented builds (``dev/trace_core_cuda.py``'s
profiling hooks). NVRTC refuses some C++ that nvcc takes (a generic lambda is a host function in JIT mode), so this
catches it before device time is spent. ``dev/nvcc_sm90.sh`` gives registers and spills; this gives NVRTC's
verdict, its log and each cubin's size.

    python dev/nvrtc_sm90.py [--defines "TRACE 1|PROBE 2"] [--out DIR]

NVRTC: torch's CUDA build's, else PyPI's ``nvidia-cuda-nvrtc`` wheel (``pip install nvidia-cuda-nvrtc``). Each
``--defines`` set (';'-separated NAME VALUE pairs) is compiled on the layer's FP8 variant. Exits 1 if any fails.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")))

from moe_wave.attention.sparse_core.cuda_build import Variant, compile_cubin, nvrtc_version  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--defines", default="", help="'|'-separated sets, each a ';'-separated list of NAME VALUE")
    ap.add_argument("--out", default=None, help="write each cubin there (for cuobjdump / nvdisasm)")
    args = ap.parse_args()
    print(f"NVRTC {nvrtc_version()}")
    layer = Variant.layer_variants()[-1]
    jobs = [(v, "") for v in Variant.layer_variants() + Variant.others()]
    jobs += [(layer, "".join(f"#define {d.strip()}\n" for d in defs.split(";") if d.strip()))
             for defs in args.defines.split("|") if defs]
    bad = 0
    for v, extra in jobs:
        name = v.key + (" + " + extra.replace("#define ", "").replace("\n", "; ") if extra else "")
        try:
            cubin = compile_cubin(v, extra)
        except RuntimeError as e:
            bad += 1
            print(f"[{name}]: FAILED\n{str(e)[-2000:]}", flush=True)
            continue
        print(f"[{name}]: ok, {len(cubin)} bytes", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"{v.key}.cubin"), "wb") as f:
                f.write(cubin)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

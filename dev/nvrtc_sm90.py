"""Compile the CUDA C++ sparse core with NVRTC, as ``torch.cuda._compile_kernel`` does on the GPU host, on a machine
without a GPU: NVRTC refuses some C++ that nvcc takes (a generic lambda is a host function in JIT mode), so this
catches it before device time is spent. ``dev/nvcc_sm90.sh`` gives registers and spills; this gives NVRTC's
verdict and its log.

    python dev/nvrtc_sm90.py [--defines "TRACE 1|PROBE 2"]

NVRTC 13.0 comes from PyPI's wheel, unpacked once into .nvcc/ (git-ignored, with dev/nvcc_sm90.sh's compiler,
whose headers it uses: run that script once first). ``core_cuda.SRC`` is compiled with no defines, with the
layer's (q's norm and a 64-channel RoPE tail, the output's inverse RoPE and FP8) and with each ``--defines`` set;
exits 1 if any fails.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import subprocess
import sys
import zipfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)

NV = os.environ.get("MOE_WAVE_NVCC_DIR", os.path.join(ROOT, ".nvcc"))
LIB = os.path.join(NV, "nvidia", "cu13", "lib")
LAYER = "QROPE 1;QRF 64;OROPE 1;ORF 64;FP8 1"


def nvrtc() -> ctypes.CDLL:
    if not os.path.exists(os.path.join(LIB, "libnvrtc.so.13")):
        os.makedirs(os.path.join(NV, "wheels"), exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest",
                        os.path.join(NV, "wheels"), "nvidia-cuda-nvrtc==13.0.88"], check=True)
        for w in glob.glob(os.path.join(NV, "wheels", "nvidia_cuda_nvrtc-*.whl")):
            zipfile.ZipFile(w).extractall(NV)
            os.remove(w)
    ctypes.CDLL(os.path.join(LIB, "libnvrtc-builtins.so.13.0"), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(os.path.join(LIB, "libnvrtc.so.13"))


def compile_src(lib: ctypes.CDLL, src: str) -> tuple[int, str]:
    """(NVRTC's result code, its log) for src at sm_90a with the CUDA headers of .nvcc/."""
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"core.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = [b"--gpu-architecture=sm_90a", f"-I{os.path.join(NV, 'nvidia', 'cu13', 'include')}".encode()]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--defines", default="", help="'|'-separated sets, each a ';'-separated list of NAME VALUE")
    args = ap.parse_args()
    from moe_wave.attention import core_cuda
    lib = nvrtc()
    bad = 0
    for defs in ["", LAYER] + [d for d in args.defines.split("|") if d]:
        head = "".join(f"#define {d.strip()}\n" for d in defs.split(";") if d.strip())
        rc, log = compile_src(lib, head + core_cuda.SRC)
        errors = [ln for ln in log.splitlines() if "error" in ln]
        print(f"[{defs or 'no defines'}]: {'ok' if rc == 0 else f'FAILED ({rc})'}", flush=True)
        if rc:
            bad += 1
            print("\n".join(errors[:10] or log.splitlines()[-10:]))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

"""Compile one Triton or Gluon kernel for a Hopper GPU (sm_90) on a machine without one: registers, spills,
shared memory, instruction counts, and the IR, before spending GPU time.

    python dev/compile_sm90.py moe_wave/attention/sparse_core/triton_kernels.py _combine_kernel \
        D=512 BH=64 BDV=128 RF=0 OROPE=False FP8=False INTERP=False --ptr ws_ml_ptr=*fp32 --ptr ws_acc_ptr=*fp32 \
        --ptr sc_ptr=*fp32 --ptr pos_ptr=*i64 --ptr freq_ptr=*fp32 --warps 4 [--dump /tmp/core]
    (a Gluon kernel too: dev/bench_wgmma.py's; the sparse core's Gluon kernels are in git history)

Positional: the file (a module of this repo is imported by its name), the kernel's name, then its constexpr
values (NAME=VALUE: ints, True/False). Pointers are ``*bf16`` unless ``--ptr NAME=TYPE`` says otherwise; other
runtime arguments ``i32`` unless ``--arg NAME=TYPE``.
Pointers and arguments whose names start with ``s_`` (strides) get Triton's divisibility-by-16 hint, as a launch
with such values would give them: without it, Triton does not turn gathers into ``cp.async`` (16-byte copies need
the alignment), and the compile would not be the one the GPU runs. ``--dump PREFIX`` writes PREFIX.ttgir / .ptx /
.sass. Needs Triton with its CUDA backend (the wheel ships ptxas and cuobjdump); no GPU, no driver.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("kernel")
    ap.add_argument("constexprs", nargs="*", help="NAME=VALUE for every constexpr parameter")
    ap.add_argument("--ptr", action="append", default=[], help="NAME=TYPE of a pointer argument (default *bf16)")
    ap.add_argument("--arg", action="append", default=[], help="NAME=TYPE of a scalar argument (default i32)")
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--maxnreg", type=int, default=None, help="registers per thread at launch (warp-specialized "
                    "kernels: the partitions' budgets are shared out of it)")
    ap.add_argument("--dump", default=None, help="prefix of the .ttgir / .ptx / .sass files to write")
    args = ap.parse_intermixed_args()

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    root = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    sys.path.insert(0, root)
    path = os.path.abspath(args.file)
    if path.startswith(root + os.sep) and path.endswith(".py"):     # a module of the repo: by its name (its
        name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")  # relative imports work then)
        mod = importlib.import_module(name)
    else:
        spec = importlib.util.spec_from_file_location("_kernel_module", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    fn = getattr(mod, args.kernel)
    values = dict(a.split("=", 1) for a in args.constexprs)
    types = dict(a.split("=", 1) for a in args.ptr + args.arg)
    sig, consts = {}, {}
    for i, name in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr:
            sig[name] = "constexpr"
            raw = str(args.warps) if name == "num_warps" and name not in values else values.get(name)
            if raw is None:
                raise SystemExit(f"compile_sm90: constexpr {name} needs a value ({name}=...)")
            consts[name] = int(raw) if raw.lstrip("-").isdigit() else (raw == "True")
        else:
            sig[name] = types.get(name, "*bf16" if name.endswith("_ptr") else "i32")
    hint = [["tt.divisibility", 16]]
    attrs = {(i,): hint for i, name in enumerate(fn.arg_names)
             if sig[name] != "constexpr" and (name.endswith("_ptr") or name.startswith("s_"))}
    is_gluon = getattr(fn, "is_gluon", lambda: False)()
    if is_gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        Source = ASTSource
    k = triton.compile(Source(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=args.warps, num_stages=args.stages,
                                    **({"maxnreg": args.maxnreg} if args.maxnreg else {})))
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    res = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                         text=True).stdout
    sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", res)
    count = {op: len(re.findall(pat, sass)) for op, pat in (
        ("HGMMA", r"\bHGMMA\."), ("LDGSTS", r"\bLDGSTS\b"), ("spill stores", r"\bSTL\b"), ("spill loads", r"\bLDL\b"),
        ("BAR.SYNC", r"\bBAR\.SYNC\b"))}
    print(f"{args.kernel} ({'gluon' if is_gluon else 'triton'}, {args.warps} warps, {args.stages} stages) {consts}")
    print(f"registers {m.group(1) if m else '?'}, stack {m.group(2) if m else '?'} B, shared memory "
          f"{k.metadata.shared} B; " + ", ".join(f"{op} {n}" for op, n in count.items()))
    if args.dump:
        for key in ("ttgir", "ptx"):
            with open(f"{args.dump}.{key}", "w") as f:
                f.write(k.asm[key])
        with open(f"{args.dump}.sass", "w") as f:
            f.write(sass)
        print(f"wrote {args.dump}.ttgir / .ptx / .sass")


if __name__ == "__main__":
    main()

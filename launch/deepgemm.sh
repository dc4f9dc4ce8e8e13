# Source this on a GPU host to make `import deep_gemm` work from the source kit carried in .deps (git-ignored):
#
#   .deps/DeepGEMM-54e2261.tar.gz   DeepGEMM 54e2261 (2026-06-23) with the headers of its submodules, CUTLASS
#                                    f3fde58 (include/) and fmt 553ec11; made here by dev/deepgemm_kit.sh
#   .deps/deepgemm-built.tar.gz      optional: the extension built by an earlier call and its JIT cache, as
#                                    `deepgemm_save $OUT/deepgemm-built.tar.gz` wrote them at that call's end
#
# DeepGEMM compiles its kernels at run time with the host's nvcc (CUDA_HOME); the extension itself (one C++ file)
# takes a minute or two to build. Afterwards: PYTHONPATH holds the kit, DG_JIT_CACHE_DIR its kernel cache, and
# MOE_WAVE_DEEPGEMM_OK=1 when `import deep_gemm` worked (else the build log's tail is printed).
_dg_repo="${REPO_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
_dg_kit="${DEEPGEMM_KIT:-$_dg_repo/.deps/DeepGEMM-54e2261.tar.gz}"
_dg_top=/tmp/deepgemm
_dg_root=$_dg_top/DeepGEMM
export MOE_WAVE_DEEPGEMM_OK=0
if [ ! -f "$_dg_kit" ]; then
    echo "deepgemm.sh: no kit at $_dg_kit (bash dev/deepgemm_kit.sh here, then carry .deps)" >&2
else
    mkdir -p $_dg_top
    [ -d $_dg_root ] || tar -xzf "$_dg_kit" -C $_dg_top
    ln -sfn $_dg_root/third-party/cutlass/include/cutlass $_dg_root/deep_gemm/include/cutlass
    ln -sfn $_dg_root/third-party/cutlass/include/cute $_dg_root/deep_gemm/include/cute
    export DG_JIT_CACHE_DIR=$_dg_top/cache
    mkdir -p $DG_JIT_CACHE_DIR
    if [ -f "$_dg_repo/.deps/deepgemm-built.tar.gz" ] && ! ls $_dg_root/deep_gemm/_C*.so >/dev/null 2>&1; then
        tar -xzf "$_dg_repo/.deps/deepgemm-built.tar.gz" -C $_dg_top
    fi
    export PYTHONPATH=$_dg_root${PYTHONPATH:+:$PYTHONPATH}
    export CUDA_HOME="${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}"
    if ! python3 -c "import deep_gemm" >/dev/null 2>&1; then
        _dg_t0=$(date +%s)
        # with the system's g++ where there is one: a toolchain that links its own libstdc++ into the extension
        # (the GPU host's /opt/gcc, which Python's build settings name) crashes in std::regex / std::locale, two
        # copies of the C++ runtime in one process
        _dg_cc=(); [ -x /usr/bin/g++ ] && _dg_cc=(CC=/usr/bin/gcc CXX=/usr/bin/g++ "LDSHARED=/usr/bin/g++ -shared")
        (cd $_dg_root && env "${_dg_cc[@]}" python3 setup.py build_ext --inplace > $_dg_top/build.log 2>&1)
        echo "deepgemm.sh: built the extension in $(( $(date +%s) - _dg_t0 )) s"
    fi
    if python3 -c "import deep_gemm" > $_dg_top/import.log 2>&1; then
        export MOE_WAVE_DEEPGEMM_OK=1
    else
        echo "deepgemm.sh: import deep_gemm failed:" >&2
        tail -30 $_dg_top/build.log $_dg_top/import.log >&2
    fi
fi
deepgemm_save() {  # the built extension and the JIT-compiled kernels, for the next call's .deps
    (cd $_dg_top && tar -czf "$1" DeepGEMM/deep_gemm/_C*.so cache)
}

#!/usr/bin/env bash
# Packs DeepGEMM's source with its submodules' headers into .deps/DeepGEMM-54e2261.tar.gz (3.5 MB), the kit that
# launch/deepgemm.sh builds on a GPU host (which cannot reach the internet). Run where git can reach GitHub, or
# point the three variables at local clones:
#   DG_GIT=https://github.com/deepseek-ai/DeepGEMM CUTLASS_GIT=https://github.com/NVIDIA/cutlass \
#   FMT_GIT=https://github.com/fmtlib/fmt bash dev/deepgemm_kit.sh
set -euo pipefail
DG_REV=54e2261; CUTLASS_REV=f3fde58372d33e9a5650ba7b80fc48b3b49d40c8; FMT_REV=553ec11ec06fbe0beebfbb45f9dc3c9eabd83d28
REPO_ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DG_GIT="${DG_GIT:-https://github.com/deepseek-ai/DeepGEMM}"
CUTLASS_GIT="${CUTLASS_GIT:-https://github.com/NVIDIA/cutlass}"
FMT_GIT="${FMT_GIT:-https://github.com/fmtlib/fmt}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
src() {  # a local clone as it is, else a fresh clone of the URL
    if [ -d "$1" ]; then echo "$1"; else git clone -q --no-checkout "$1" "$work/$2" && echo "$work/$2"; fi
}
mkdir -p "$work/DeepGEMM/third-party/cutlass" "$work/DeepGEMM/third-party/fmt"
git -C "$(src "$DG_GIT" dg)" archive "$DG_REV" | tar -x -C "$work/DeepGEMM"
git -C "$(src "$CUTLASS_GIT" cutlass)" archive "$CUTLASS_REV" include | tar -x -C "$work/DeepGEMM/third-party/cutlass"
git -C "$(src "$FMT_GIT" fmt)" archive "$FMT_REV" | tar -x -C "$work/DeepGEMM/third-party/fmt"
mkdir -p "$REPO_ROOT/.deps"
tar -czf "$REPO_ROOT/.deps/DeepGEMM-$DG_REV.tar.gz" -C "$work" DeepGEMM
ls -l "$REPO_ROOT/.deps/DeepGEMM-$DG_REV.tar.gz"

#!/usr/bin/env bash
# Compile-check every csrc/*.cu for sm_90 (object files) with nvcc and the include dirs of the
# installed torch (the CPU wheel ships the CUDA headers torch's extensions need). For the multimem
# code, also emit PTX and check it holds multimem.ld_reduce and multimem.st. Exits non-zero on any
# failure. Usage: .ci/compile_csrc.sh [build_dir]   (env: PYTHON, NVCC)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
NVCC=${NVCC:-nvcc}
OUT=${1:-build/compile_check}
mkdir -p "$OUT"
TORCH_INC=$("$PYTHON" -c 'import torch.utils.cpp_extension as c; print(" ".join(c.include_paths()))')
PY_INC=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
ABI=$("$PYTHON" -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')
INCS=(-Icsrc/include -I"$PY_INC")
for d in $TORCH_INC; do INCS+=(-I"$d"); done
# The CPU wheel lacks one generated header of c10/cuda; provide it (what a CUDA build generates).
if ! "$PYTHON" -c 'import os, sys, torch.utils.cpp_extension as c; sys.exit(0 if any(os.path.exists(os.path.join(d, "c10/cuda/impl/cuda_cmake_macros.h")) for d in c.include_paths()) else 1)'; then
  mkdir -p "$OUT/stub_include/c10/cuda/impl"
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$OUT/stub_include/c10/cuda/impl/cuda_cmake_macros.h"
  INCS+=(-I"$OUT/stub_include")
fi
FLAGS=(-O3 -std=c++17 --use_fast_math -gencode arch=compute_90,code=sm_90
       -DTORCH_EXTENSION_NAME=_C -D_GLIBCXX_USE_CXX11_ABI="$ABI" -Xcompiler -fPIC
       -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__
       -U__CUDA_NO_BFLOAT16_CONVERSIONS__ -U__CUDA_NO_HALF2_OPERATORS__)
status=0
for src in csrc/*.cu; do
  obj="$OUT/$(basename "${src%.cu}").o"
  echo "nvcc $src -> $obj"
  if ! "$NVCC" "${FLAGS[@]}" "${INCS[@]}" -Xptxas -v -c "$src" -o "$obj" 2> "$obj.log"; then
    cat "$obj.log"; status=1
  elif grep -q "bytes spill" "$obj.log" && grep -E "[1-9][0-9]* bytes spill (stores|loads)" "$obj.log"; then
    echo "note: register spills above (not an error)"
  fi
done
# PTX of the multimem kernels: must contain the NVLink SHARP instructions (compiled, never run).
ptx="$OUT/ops.ptx"
if "$NVCC" "${FLAGS[@]/code=sm_90/code=compute_90}" "${INCS[@]}" -ptx csrc/ops.cu -o "$ptx"; then
  for insn in multimem.ld_reduce multimem.st; do
    n=$(grep -c "$insn" "$ptx" || true)
    echo "$insn: $n occurrences in $ptx"
    [ "$n" -gt 0 ] || { echo "missing $insn in PTX"; status=1; }
  done
else
  status=1
fi
[ "$status" -eq 0 ] && echo "compile check OK" || echo "compile check FAILED"
exit "$status"

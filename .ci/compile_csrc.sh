#!/usr/bin/env bash
# Compile-check every csrc/*.cu (object files) with nvcc for every arch CI checks: the flags are
# megatron_tokenweave/build_flags.py's (the ones setup.py and the JIT build use; archs: its
# CHECK_ARCHS, "80;90", or TOKENWEAVE_CUDA_ARCHS where set), plus what torch's BuildExtension adds
# and the include dirs of the installed torch (the CPU wheel ships the CUDA headers torch's
# extensions need), one nvcc per source and core at a time. Then the sm_90 PTX (kept from the
# object compiles) of the sources in PTX_NEEDS must hold the instructions named there: the
# multimem code's multimem.ld_reduce and multimem.st, the fitted GEMM's e4m3 wgmma of depth 32
# (per tensor at its largest token extent, 176; in blocks at the largest of each consumer form,
# 104 with 128 weight rows a consumer and 208 with 64; with the tokens as M at its smallest and
# largest weight extents, 64 and 208, and the stmatrix that stages its rows as they are; in
# pairs of CTAs the weight's multicast copy, the release on the other CTA's barrier and the
# cluster barrier). A
# register spill in the fitted GEMM's sources is a failure; elsewhere a note (the fused op's
# kernels of 4 and 8 vectors a thread, for hidden sizes over 8192, spill today).
# Exits non-zero on any failure.
# Usage: .ci/compile_csrc.sh [--print-flags] [build_dir]   (env: PYTHON, NVCC)
#   --print-flags: print the nvcc flags, one per line, and exit (compiles nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
NVCC=${NVCC:-nvcc}
print_only=0
if [ "${1:-}" = "--print-flags" ]; then print_only=1; shift; fi
OUT=${1:-build/compile_check}
mkdir -p "$OUT"
# Ours: optimisation, language, -gencode per arch (the module says why if the arch list is bad).
archs=(--archs check)
[ -z "${TOKENWEAVE_CUDA_ARCHS:-}" ] || archs=()  # the module reads it
mapfile -t OURS < <("$PYTHON" megatron_tokenweave/build_flags.py nvcc "${archs[@]}")
[ "${#OURS[@]}" -gt 0 ] || { echo "no flags from megatron_tokenweave/build_flags.py"; exit 2; }
# torch's: its include dirs, the defines BuildExtension adds, the C++ ABI, and whether the CPU
# wheel lacks the one generated header of c10/cuda (then provide it: what a CUDA build generates).
mapfile -t TORCH < <("$PYTHON" - <<'EOF'
import os, sysconfig, torch, torch.utils.cpp_extension as c
inc = c.include_paths()
print(*("-I" + d for d in [sysconfig.get_paths()["include"], *inc]), sep="\n")
print(*c.COMMON_NVCC_FLAGS, sep="\n")
print(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
if not any(os.path.exists(os.path.join(d, "c10/cuda/impl/cuda_cmake_macros.h")) for d in inc):
    print("NEED_CMAKE_MACROS_STUB")
EOF
)
[ "${#TORCH[@]}" -gt 0 ] || { echo "no include dirs from torch (can $PYTHON import it?)"; exit 2; }
FLAGS=("${OURS[@]}" -DTORCH_EXTENSION_NAME=_C -Xcompiler -fPIC -Icsrc/include)
for f in "${TORCH[@]}"; do
  if [ "$f" = NEED_CMAKE_MACROS_STUB ]; then
    mkdir -p "$OUT/stub_include/c10/cuda/impl"
    printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' \
      > "$OUT/stub_include/c10/cuda/impl/cuda_cmake_macros.h"
    FLAGS+=(-I"$OUT/stub_include")
  else
    FLAGS+=("$f")
  fi
done
if [ "$print_only" -eq 1 ]; then printf '%s\n' "${FLAGS[@]}"; exit 0; fi
echo "nvcc flags: ${OURS[*]}"
status=0
# Sources whose sm_90 PTX must hold these instructions (compiled, never run here).
declare -A PTX_NEEDS=(
  [csrc/launch_multimem.cu]="multimem.ld_reduce multimem.st"
  [csrc/launch_fit_gemm_bf16.cu]="multicast::cluster mapa.shared::cluster.u32 mbarrier.arrive.shared::cluster.b64 barrier.cluster.wait.acquire.aligned wgmma.mma_async.sync.aligned.m64n208k16.f32.bf16.bf16"
  [csrc/launch_fit_gemm_e4m3_bf16.cu]="wgmma.mma_async.sync.aligned.m64n176k32.f32.e4m3.e4m3 wgmma.mma_async.sync.aligned.m64n208k32.f32.e4m3.e4m3"
  [csrc/launch_fit_gemm_e4m3_blocks_bf16.cu]="wgmma.mma_async.sync.aligned.m64n104k32.f32.e4m3.e4m3 wgmma.mma_async.sync.aligned.m64n208k32.f32.e4m3.e4m3"
  [csrc/launch_fit_gemm_e4m3_blocks_tokens_m_bf16.cu]="wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 wgmma.mma_async.sync.aligned.m64n208k32.f32.e4m3.e4m3 stmatrix.sync.aligned.m8n8.x4.shared.b16"
)
# One nvcc per source, as many at once as there are cores (the kernel families' files are
# separate translation units for this: csrc/launch.cuh).
compile() {
  local src=$1 obj="$OUT/$(basename "${1%.cu}").o" extra=()
  # The intermediate files of PTX_NEEDS's sources are kept for the PTX check below.
  local keep="$OUT/keep_$(basename "${1%.cu}")"
  if [ -n "${PTX_NEEDS[$src]:-}" ]; then rm -rf "$keep"; mkdir -p "$keep"; extra=(-keep -keep-dir "$keep"); fi
  local rc=0  # (set -e is on in this job's subshell too)
  "$NVCC" "${FLAGS[@]}" -Xptxas -v "${extra[@]}" -c "$src" -o "$obj" 2> "$obj.log" || rc=$?
  echo "$rc" > "$obj.rc"
}
jobs_max=$(nproc 2>/dev/null || echo 2)
for src in csrc/*.cu; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
  echo "nvcc $src -> $OUT/$(basename "${src%.cu}").o"
  rm -f "$OUT/$(basename "${src%.cu}").o.rc"
  compile "$src" &
done
wait
for src in csrc/*.cu; do
  obj="$OUT/$(basename "${src%.cu}").o"
  if [ "$(cat "$obj.rc" 2>/dev/null)" != 0 ]; then
    echo "FAILED: $src"; cat "$obj.log"; status=1
  elif grep -E "[1-9][0-9]* bytes spill (stores|loads)" "$obj.log"; then
    if [[ $src == csrc/launch_fit_gemm_* ]]; then
      echo "FAILED: register spills above in $src (the fitted GEMM's accumulators must stay in"
      echo "registers: a spill there costs its speed, see fit_gemm.cuh kMaxBN / kMaxWideBN)"
      status=1
    else
      echo "note: register spills above in $src (not an error)"
    fi
  fi
done
# The sm_90 PTX of PTX_NEEDS's sources must hold their instructions (below sm_90 the multimem
# ones are traps and the fitted GEMM is not compiled).
if [[ " ${OURS[*]} " != *compute_90a,* ]]; then
  echo "note: 90 is not among the archs: no PTX check"
elif [ "$status" -eq 0 ]; then
  for src in "${!PTX_NEEDS[@]}"; do
    keep="$OUT/keep_$(basename "${src%.cu}")" ptx=""
    for f in "$keep"/*.ptx; do  # nvcc names it by the number of archs: pick it by its target
      if [ -f "$f" ] && grep -q -m1 "^\.target sm_90a\?\b" "$f"; then ptx=$f; break; fi
    done
    if [ -z "$ptx" ]; then echo "no sm_90 PTX of $src in $keep"; status=1; continue; fi
    for insn in ${PTX_NEEDS[$src]}; do
      n=$(grep -c "$insn" "$ptx" || true)
      echo "$insn: $n occurrences in the sm_90 PTX of $src"
      [ "$n" -gt 0 ] || { echo "missing $insn in the PTX of $src"; status=1; }
    done
  done
fi
rm -rf "$OUT"/keep_*
[ "$status" -eq 0 ] && echo "compile check OK" || echo "compile check FAILED"
exit "$status"

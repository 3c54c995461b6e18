#!/usr/bin/env bash
# Stage, for the GPU machine (Python 3.12, torch 2.11+cu130, x86_64), FlashInfer 0.7.4 for the
# kernel benchmark's comparison (c): flashinfer.comm.trtllm_allreduce_fusion, pattern
# kARResidualRMSNorm (megatron_tokenweave/bench/flashinfer_ar.py). Into .dw/flashinfer (ignored by
# git); the 101 MB wheel is cut into 55 MiB parts, one folder each, in stage.sh's format, so
# .dw/recv.sh joins and installs it. Also receive ../shared/device/stage.sh fa4 there: FlashInfer
# imports apache-tvm-ffi, which that group stages.
#
# FlashInfer's declared dependencies and why none but the wheel itself is staged (checked with
# `import flashinfer, flashinfer.comm` in a venv holding only the wheel and what it asked for):
#   imported, already on the GPU image: torch, numpy, packaging, requests, tqdm, click, einops,
#     tabulate, nvidia-ml-py (pynvml), cuda-bindings (cuda.bindings.driver; cuda-python is only
#     the meta package over it), ninja (the JIT runs the `ninja` binary), plus torch's filelock,
#     jinja2 and typing-extensions
#   imported, staged by `stage.sh fa4`: apache-tvm-ffi (the JIT modules are tvm-ffi libraries);
#     torch-c-dlpack-ext there is optional (torch 2.11 exports the DLPack exchange API itself)
#   tried under try/except only, not used by the trtllm comm path: nvidia-cutlass-dsl (fa4),
#     nvidia-cudnn-frontend (te), cuda-tile, flashinfer-cubin, flashinfer-jit-cache
#   never imported on that path: nccl4py, nccl-extensions
# The comm kernels are JIT-compiled with nvcc (and ninja, c++) from the wheel's own data/csrc and
# data/include, the CCCL and spdlog headers it bundles, tvm-ffi's headers and the CUDA toolkit's;
# no flashinfer-jit-cache / flashinfer-cubin is needed and nothing is downloaded at run time.
#
# Usage: .ci/stage_flashinfer.sh [--aot]   (prints the carry list of each device call)
#   --aot also builds, here, FlashInfer's trtllm_comm module for sm_90a with its own JIT (nvcc from
#   CUDA_HOME or /usr/local/cuda, ~7 min on 2 cores; the GPU machine would spend 4-7 device minutes
#   on it) into .dw/flashinfer/aot/trtllm_comm.so (11 MB). Carried with the wheel parts,
#   megatron_tokenweave/bench/flashinfer_ar.py puts it where FlashInfer loads prebuilt (AOT)
#   modules, so nothing is compiled there. Needs a CPU torch for the throwaway venv
#   (FI_AOT_TORCH, default torch==2.13.0) and apache-tvm-ffi at the fa4 group's version.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
dw="$top/.dw"
grep -qx '/.dw/' .git/info/exclude 2>/dev/null || echo '/.dw/' >> .git/info/exclude
mkdir -p "$dw"
[ -e "$dw/recv.sh" ] || cp "$top/../shared/device/recv.sh" "$dw/recv.sh"

group="$dw/flashinfer"
aot=0; [ "${1:-}" = "--aot" ] && aot=1
rm -rf "$group"
mkdir -p "$group/small"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$group/small" \
  flashinfer-python==0.7.4

# Wheels over 55 MiB -> $group/pN/<wheel>.partNN + <wheel>.nparts (stage.sh's cut_large format).
n=0
for f in "$group"/small/*.whl; do
  [ "$(stat -c %s "$f")" -gt $((55 * 1024 * 1024)) ] || continue
  name=$(basename "$f")
  split -b 55M -d "$f" "$group/$name.part"
  count=$(ls "$group/$name".part* | wc -l)
  for p in "$group/$name".part*; do
    mkdir -p "$group/p$n"; mv "$p" "$group/p$n/"
    echo "$count" > "$group/p$n/$name.nparts"; n=$((n + 1))
  done
  rm "$f"
done
rmdir "$group/small" 2>/dev/null || true

if [ "$aot" = 1 ]; then
  # FlashInfer's own JIT, in a throwaway venv, for sm_90a; the result is the module the GPU
  # machine would build (same nvcc 13.0, wheel csrc, flags), linked like it. It needs no driver
  # symbol, so a stub libcuda.so (soname libcuda.so.1) satisfies -lcuda where the toolkit has none.
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  cuda=${CUDA_HOME:-/usr/local/cuda}
  [ -x "$cuda/bin/nvcc" ] && [ -e "$cuda/lib64/libcudart.so" ] || { echo "no CUDA toolkit at $cuda"; exit 1; }
  python3 -m venv "$tmp/venv"
  "$tmp/venv/bin/pip" install -q "${FI_AOT_TORCH:-torch==2.13.0}" apache-tvm-ffi==0.1.15.post2 \
    packaging requests tqdm numpy nvidia-ml-py "cuda-bindings<14"
  cat "$group"/p*/flashinfer_python-*.whl.part* > "$tmp/flashinfer_python-0.7.4-py3-none-any.whl"
  "$tmp/venv/bin/pip" install -q --no-deps "$tmp/flashinfer_python-0.7.4-py3-none-any.whl"
  ldflags=""
  if [ ! -e "$cuda/lib64/libcuda.so" ] && [ ! -e "$cuda/lib64/stubs/libcuda.so" ]; then
    mkdir -p "$tmp/stub"
    echo 'void tokenweave_libcuda_stub(void) {}' > "$tmp/stub/s.c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$tmp/stub/libcuda.so" "$tmp/stub/s.c"
    ldflags="-L$tmp/stub"
  fi
  start=$(date +%s)
  CUDA_HOME="$cuda" FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE="$tmp" \
    FLASHINFER_EXTRA_LDFLAGS="$ldflags" FLASHINFER_JIT_DEBUG=0 MAX_JOBS=$(nproc) \
    "$tmp/venv/bin/python" -W ignore -c \
    'from flashinfer.comm.trtllm_ar import get_trtllm_comm_module as g; g(); print("built")'
  mkdir -p "$group/aot"
  cp "$tmp"/.cache/flashinfer/0.7.4/90a/cached_ops/trtllm_comm/trtllm_comm.so "$group/aot/"
  echo "aot: trtllm_comm.so built in $(( $(date +%s) - start )) s"
fi

echo "staged .dw/flashinfer ($(du -sh "$group" | cut -f1)):"
for d in "$group"/*/; do
  echo "  $(basename "$d"): $(du -sh "$d" | cut -f1)"
done
echo "Device calls, back to back, each starting with 'bash .dw/recv.sh &&' (after the fa4 group's):"
# Pack the folders into calls of at most 60 MiB (a call carries 64 MiB with the tracked tree).
batch=""; size=0
for d in "$group"/p* "$group"/small "$group"/aot; do
  [ -d "$d" ] || continue
  b=$(du -sb "$d" | cut -f1)
  if [ -n "$batch" ] && [ $((size + b)) -gt $((60 << 20)) ]; then
    echo "  carry [\".dw/recv.sh\"$batch]"; batch=""; size=0
  fi
  batch="$batch, \".dw/flashinfer/$(basename "$d")\""; size=$((size + b))
done
[ -n "$batch" ] && echo "  carry [\".dw/recv.sh\"$batch]"
echo "(apache-tvm-ffi comes from ../shared/device/stage.sh fa4; receive that group first)"

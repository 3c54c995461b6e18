#!/bin/bash
# A/B of the fitted communicating GEMM on one GPU, run from the repo root on the device machine:
# the checkout as it is ("tree") and a copy with BASE's headers overlaid on
# csrc/include/tokenweave/ (a folder of headers: ../ab_builds.sh), both built in place at once;
# the fitted kernel's GPU tests on the tree; then `bench gemm_fused` once per build and pass, each its own process,
# passes in a balanced order (tree, base, base, tree). Results: $OUT/ab_{tree,base}_{0,1}.json
# (combine with ab_json.py).
#   bash docs/results/fit_stages/ab.sh BASE [bench gemm_fused arguments]
set -u
[ $# -ge 1 ] && [ -d "$1" ] || { echo "usage: ab.sh BASE_HEADERS_DIR [bench args]"; exit 2; }
base_headers=$1; shift
args=("$@"); [ ${#args[@]} -gt 0 ] || args=(--dtypes bf16 --tp 2 4 8 --tokens 513 641 1000 1024 1279)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp}
t0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
source "$(dirname "$0")/../ab_builds.sh"
ab_builds "$base_headers" || exit 1
timeout 150 python3 -m pytest -q -rf --tb=short -s tests/gpu/test_gemm_fused.py -k fitted \
  2>&1 | grep -E "cases exact|passed|failed" | tail -8
bench() {  # bench DIR BUILD PASS
  (cd "$1" && timeout 150 python3 -m megatron_tokenweave.bench gemm_fused "${args[@]}" --iters 10 \
     --out "$out/ab_$2_$3.json" > /dev/null 2>&1
   echo "$2 pass $3 rc=$? at $(( $(date +%s) - t0 )) s")
}
bench . tree 0; bench "${dirs[1]}" base 0; bench "${dirs[1]}" base 1; bench . tree 1

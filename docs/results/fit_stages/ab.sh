#!/bin/bash
# A/B of the fitted communicating GEMM on one GPU, run from the repo root on the device machine:
# the checkout as it is ("tree") and a copy with BASE's headers overlaid on
# csrc/include/tokenweave/ (a folder: `git show <commit>:csrc/include/tokenweave/X.cuh` for each
# header a change touches, saved into it), both built in place at once; the fitted kernel's GPU
# tests on the tree; then `bench gemm_fused` once per build and pass, each its own process,
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
dir=/tmp/ab_base
rm -rf "$dir" && mkdir "$dir" && cp -r setup.py README.md megatron_tokenweave csrc "$dir"/
cp "$base_headers"/*.cuh "$dir"/csrc/include/tokenweave/
(MAX_JOBS=8 python3 setup.py build_ext --inplace > /tmp/ab_build_tree.log 2>&1
 echo "tree build rc=$?") &
(cd "$dir" && MAX_JOBS=8 python3 setup.py build_ext --inplace > /tmp/ab_build_base.log 2>&1
 echo "base build rc=$?") &
wait; echo "built at $(( $(date +%s) - t0 )) s"
timeout 150 python3 -m pytest -q -rf --tb=short -s tests/gpu/test_gemm_fused.py -k fitted \
  2>&1 | grep -E "cases exact|passed|failed" | tail -8
bench() {  # bench DIR BUILD PASS
  (cd "$1" && timeout 150 python3 -m megatron_tokenweave.bench gemm_fused "${args[@]}" --iters 10 \
     --out "$out/ab_$2_$3.json" > /dev/null 2>&1
   echo "$2 pass $3 rc=$? at $(( $(date +%s) - t0 )) s")
}
bench . tree 0; bench "$dir" base 0; bench "$dir" base 1; bench . tree 1

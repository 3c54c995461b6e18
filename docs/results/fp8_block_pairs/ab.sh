#!/bin/bash
# A/B of the fused op's FP8-row forms on one GPU, run from the repo root on the device machine:
# builds the checkout as it is ("tree") and a copy with the headers of OTHER_HEADERS overlaid on
# csrc/include/tokenweave/ ("head"; e.g. `git show <commit>:csrc/include/tokenweave/X.cuh`
# for each header the change touches, saved into that folder), both in place, in parallel; then
# `bench fp8_rows` once per build and pass, passes head, tree, tree, head, each its own process.
# Results: $OUT/fp8_rows_{head,tree}_{0,1}.json (combine with pairs_json.py).
#   bash docs/results/fp8_block_pairs/ab.sh OTHER_HEADERS
set -u
other=${1:?usage: ab.sh OTHER_HEADERS}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
t0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
rm -rf /tmp/ab_head && mkdir /tmp/ab_head
cp -r setup.py README.md megatron_tokenweave csrc /tmp/ab_head/
cp "$other"/*.cuh /tmp/ab_head/csrc/include/tokenweave/
(cd /tmp/ab_head && MAX_JOBS=8 python3 setup.py build_ext --inplace > /tmp/ab_head.log 2>&1
 echo "head build rc=$?") &
MAX_JOBS=8 python3 setup.py build_ext --inplace > /tmp/ab_tree.log 2>&1; echo "tree build rc=$?"
wait; echo "built at $(( $(date +%s) - t0 )) s"
bench() {  # bench DIR TAG
  (cd "$1" && timeout 150 python3 -m megatron_tokenweave.bench fp8_rows --tp 2 4 --tokens 1024 8192 \
     --hidden 4096 8192 --iters 20 --out "$out/fp8_rows_$2.json" 2>&1 | grep -v arn | tail -17)
  echo "-- $2 at $(( $(date +%s) - t0 )) s"
}
bench /tmp/ab_head head_0; bench . tree_0; bench . tree_1; bench /tmp/ab_head head_1

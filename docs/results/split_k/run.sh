# Split K on one GPU (fit_gemm.cuh's Work / split_store / split_add, ops/segments.split_k_tiles
# and its rule, bench gemm_fused's `tokenweave_split_<region>` rows), run from the repo root on
# the device machine, one call (~6 min on an H100): the extension built, the GPU tests of the
# fitted kernel (split K's, the whole-tile modes', pairs') and of the op's checks, then bench
# gemm_fused at the counts to 5003 on every dense family's shards, bf16, one process per model,
# split K's regions timed beside the pick and beside their tiles unsplit, until
# SPLIT_K_SECONDS (585) from the start; SPLIT_K_TOKENS: other counts (a space-separated list).
# Results: $OUT/split_k.tgz (the JSONs, the test and bench logs), packed after each step; read
# them with summary.py.
#   [SPLIT_K_SECONDS=S] [SPLIT_K_TOKENS="N ..."] bash docs/results/split_k/run.sh [MODEL...]
set -u
t0=$(date +%s)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1
res=$(mktemp -d)
pack() { (cd "$res" && tar czf "${OUT:-/tmp}/split_k.tgz" ./*); }
at() { echo "$1 at $(( $(date +%s) - t0 )) s"; }
nvidia-smi --query-gpu=name --format=csv,noheader
MAX_JOBS=16 python3 setup.py build_ext --inplace > "$res/build.log" 2>&1; at "build rc=$?"
timeout 240 python3 -m pytest -q -rf --tb=short -s -p no:cacheprovider \
  tests/gpu/test_gemm_fused.py -k "split_k or fitted_gemm_matches or pairs_match or fit_gemm" \
  tests/gpu/test_op_checks.py > "$res/tests.log" 2>&1
at "tests rc=$?"; grep -E "cases exact|passed|failed" "$res/tests.log" | tail -6; pack
read -r -a tokens <<< "${SPLIT_K_TOKENS:-512 513 641 777 1000 1024 1279 1531 2047 2500 3001 5003}"
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(qwen2.5-7b llama-3.3-70b qwen2.5-32b qwen2.5-72b llama-3-8b)
for m in "${models[@]}"; do
  left=$(( ${SPLIT_K_SECONDS:-585} - ($(date +%s) - t0) )); [ $left -lt 30 ] && break
  timeout $left python3 -m megatron_tokenweave.bench gemm_fused --dtypes bf16 --models "$m" \
    --tokens "${tokens[@]}" --iters 10 \
    --out "$res/$m.json" > "$res/$m.log" 2>&1
  at "$m rc=$?"; pack
done

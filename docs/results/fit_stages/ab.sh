#!/bin/bash
# A/B of the fitted communicating GEMM on one GPU, run from the repo root on the device machine:
# the checkout as it is ("tree") and one copy per VARIANT (a folder of headers overlaid on
# csrc/include/tokenweave/, a .patch, or patches joined by '+': ../ab_builds.sh), all built in
# place at once; the fitted kernel's GPU tests on the tree; then `bench gemm_fused` once per
# build and pass, each its own process, passes in a balanced order (tree, variants, variants
# reversed, tree). Results: $OUT/ab.tgz holding ab_<build>_{0,1}.json (after `tar xzf`, combine
# with ab_json.py or ../fit_epilogue/ab_json.py), packed after each pass (a device call returns
# few files, none with a '+' in its name: a build named with a '+' is saved with '_').
#   bash docs/results/fit_stages/ab.sh VARIANT... [-- bench gemm_fused arguments]
set -u
variants=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do variants+=("$1"); shift; done
[ $# -gt 0 ] && shift
[ ${#variants[@]} -ge 1 ] || { echo "usage: ab.sh VARIANT... [-- bench args]"; exit 2; }
args=("$@"); [ ${#args[@]} -gt 0 ] || args=(--dtypes bf16 --tp 2 4 8 --tokens 513 641 1000 1024 1279)
source "$(dirname "$0")/../ab_builds.sh"
ab_setup "${variants[@]}" || exit 1
timeout 150 python3 -m pytest -q -rf --tb=short -s tests/gpu/test_gemm_fused.py -k fitted \
  2>&1 | grep -E "cases exact|passed|failed" | tail -8
bench() {  # bench INDEX PASS
  (cd "${dirs[$1]}" && timeout 150 python3 -m megatron_tokenweave.bench gemm_fused "${args[@]}" \
     --iters 10 --out "$ab_out/ab_${names[$1]//+/_}_$2.json" > /dev/null 2>&1
   echo "${names[$1]} pass $2 rc=$? at $(( $(date +%s) - ab_t0 )) s")
}
ab_passes bench ab.tgz

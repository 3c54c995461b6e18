#!/bin/bash
# A/B of the fused op's FP8-row forms on one GPU, run from the repo root on the device machine:
# the checkout as it is ("tree") and one copy per VARIANT (a .patch, patches joined by '+', or a
# folder of headers: ../ab_builds.sh), all built in place, in parallel; then
# `bench fp8_rows` once per build and pass, each its own process, passes in a balanced order
# (tree, variants, variants reversed, tree).
# Results: $OUT/fp8_rows_ab.tgz holding fp8_rows_<build>_{0,1}.json (combine with ab_json.py
# after `tar xzf`): one file, as the device call returns few files and none with a '+' in its name.
#   bash docs/results/fp8_block_pairs/ab.sh VARIANT...
set -u
[ $# -ge 1 ] || { echo "usage: ab.sh VARIANT... (a .patch or a folder of headers)"; exit 2; }
source "$(dirname "$0")/../ab_builds.sh"
ab_setup "$@" || exit 1
bench() {  # bench INDEX PASS
  (cd "${dirs[$1]}" && timeout 150 python3 -m megatron_tokenweave.bench fp8_rows --tp 2 4 \
     --tokens 1024 8192 --hidden 4096 8192 --iters 20 \
     --out "$ab_out/fp8_rows_${names[$1]}_$2.json" 2>&1 | grep -v arn | tail -17)
  echo "-- ${names[$1]} pass $2 at $(( $(date +%s) - ab_t0 )) s"
}
ab_passes bench fp8_rows_ab.tgz

#!/bin/bash
# A/B of the one-shot path's call check on one GPU, run from the repo root on the device
# machine: the checkout as it is ("tree") and one copy per VARIANT (a folder of headers overlaid
# on csrc/include/tokenweave/, a .patch, or patches joined by '+': ../ab_builds.sh), all built in
# place at once; `bench call_check` once per build, each its own process (the variants first,
# then the tree; the arguments after `--`, default the bench's own: every count); then the
# kernel's protocol tests at TP 2 and 4 (divergence included) in build TEST_BUILD (default 1:
# the first variant, the candidate; 0: the tree, where the candidate is the checkout). Results:
# $OUT/call_check_ab.tgz holding call_check_<build>.json / .png, packed after each step.
#   [TEST_BUILD=I] bash docs/results/call_check/ab.sh VARIANT... [-- call_check arguments]
set -u
variants=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do variants+=("$1"); shift; done
[ $# -gt 0 ] && shift
[ ${#variants[@]} -ge 1 ] || { echo "usage: ab.sh VARIANT... [-- call_check args]"; exit 2; }
args=("$@")
source "$(dirname "$0")/../ab_builds.sh"
ab_setup "${variants[@]}" || exit 1
grep -h " error" /tmp/ab_build_*.log | head -5
check() {  # check INDEX TIMEOUT ARGS...
  local i=$1 t=$2; shift 2
  (cd "${dirs[$i]}" && timeout "$t" python3 -m megatron_tokenweave.bench call_check "$@" \
     --out "$ab_out/call_check_${names[$i]//+/_}.json" 2>&1 | grep -E "^TP|Error" | tail -40)
  echo "-- ${names[$i]} at $(( $(date +%s) - ab_t0 )) s"; ab_pack call_check_ab.tgz
}
for (( i = 1; i < ${#dirs[@]}; i++ )); do check "$i" 170 ${args[@]+"${args[@]}"}; done
check 0 170 ${args[@]+"${args[@]}"}
t=${TEST_BUILD:-1}; [ "$t" -eq 0 ] || cp -r tests "${dirs[$t]}"/  # ab_builds copies no tests
cd "${dirs[$t]}" && timeout $(( 560 - ($(date +%s) - ab_t0) )) python3 -m pytest -x -q \
  "tests/gpu/test_kernel.py::test_kernel_protocol_one_gpu[2]" \
  "tests/gpu/test_kernel.py::test_kernel_protocol_one_gpu[4]" 2>&1 | tail -4
echo "tests at $(( $(date +%s) - ab_t0 )) s"

# Sourced by the A/B scripts under docs/results (run from the repo root on the device machine):
# `ab_builds VARIANT...` builds the checkout as it is ("tree") and one copy per VARIANT, all in
# place and at once, and sets names[] and dirs[] (the tree first). A VARIANT is a .patch (or
# patches joined by '+', applied in order to the copy's csrc/ and megatron_tokenweave/; named by
# the patches' file names) or a folder of headers overlaid on csrc/include/tokenweave/ (named by
# the folder's; e.g. `git show <commit>:csrc/include/tokenweave/X.cuh` for each header a change
# touches, saved into it). Build logs: /tmp/ab_build_<name>.log.
ab_builds() {
  local jobs=$(( 16 / ($# + 1) )) v part name dir i t0
  [ "$jobs" -ge 2 ] || jobs=2
  t0=$(date +%s)
  names=(tree); dirs=(.)
  for v in "$@"; do
    IFS=+ read -ra parts <<< "$v"
    name=""; for part in "${parts[@]}"; do name+="${name:++}$(basename "${part%.patch}")"; done
    dir=/tmp/ab_$name
    rm -rf "$dir" && mkdir "$dir" && cp -r setup.py README.md megatron_tokenweave csrc "$dir"/
    if [ -d "$v" ]; then
      cp "$v"/*.cuh "$dir"/csrc/include/tokenweave/
    else
      for part in "${parts[@]}"; do
        (cd "$dir" && git apply --include='csrc/*' --include='megatron_tokenweave/*' --exclude='*' \
           "$OLDPWD/$part") || { echo "$part does not apply"; return 1; }
      done
    fi
    names+=("$name"); dirs+=("$dir")
  done
  for i in "${!dirs[@]}"; do
    (cd "${dirs[$i]}" && MAX_JOBS=$jobs python3 setup.py build_ext --inplace \
       > "/tmp/ab_build_${names[$i]}.log" 2>&1; echo "${names[$i]} build rc=$?") &
  done
  wait; echo "built at $(( $(date +%s) - t0 )) s"
}

# `ab_setup VARIANT...`: the device call's environment (no NVLink multicast anywhere), a fresh
# results folder `ab_out`, the start time `ab_t0`, the GPU's name, then `ab_builds VARIANT...`.
ab_setup() {
  export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1
  ab_out=$(mktemp -d)
  ab_t0=$(date +%s)
  nvidia-smi --query-gpu=name --format=csv,noheader
  ab_builds "$@"
}

# `ab_passes FN ARCHIVE`: `FN INDEX PASS` for every build, two passes in a balanced order (the
# builds, then the builds reversed), ab_out's JSONs packed into $OUT/ARCHIVE after each (a
# device call returns few files, none with a '+' in its name; one cut short keeps the passes
# before).
ab_passes() {
  local fn=$1 archive=$2 i
  for i in "${!dirs[@]}"; do "$fn" "$i" 0; ab_pack "$archive"; done
  for (( i = ${#dirs[@]} - 1; i >= 0; i-- )); do "$fn" "$i" 1; ab_pack "$archive"; done
}
ab_pack() { (cd "$ab_out" && tar czf "${OUT:-/tmp}/$1" ./*.json); }

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

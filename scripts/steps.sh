# Sourced by scripts/test.sh and scripts/test-pgbouncer.sh: run the test
# steps, some of them side by side, and print how long each took, so that
# every change can see what it adds to the test command's time.
#
#   step NAME FUNC [ARGS...]    runs FUNC now, its output as it comes
#   together NAME FUNC [ARGS...] -- NAME FUNC [ARGS...] -- ...
#                               runs the FUNCs at once, each into a log of
#                               its own; prints each log once all have
#                               ended, and fails if any failed
#
# Each step ends with a line "== NAME: N s" (and "FAILED" if it failed);
# test.sh ends with the table of every step's seconds.

steps_dir=$(mktemp -d /tmp/idem-steps.XXXXXX)
steps_t0=$SECONDS
steps_table=()
trap 'rm -rf "$steps_dir"' EXIT

step() {
  local name=$1 s=$SECONDS
  shift
  echo "== $name"
  if ! (set -euo pipefail; "$@"); then
    echo "== $name: $((SECONDS - s)) s, FAILED"
    return 1
  fi
  echo "== $name: $((SECONDS - s)) s"
  steps_table+=("$(printf '%5d s  %s' $((SECONDS - s)) "$name")")
}

together() {
  local names=() pids=() i=0 s=$SECONDS
  local args=()
  while [ $# -gt 0 ]; do
    args=()
    local name=$1
    shift
    while [ $# -gt 0 ] && [ "$1" != -- ]; do
      args+=("$1")
      shift
    done
    [ $# -gt 0 ] && shift # the --
    names+=("$name")
    (
      t=$SECONDS
      rc=0
      (set -euo pipefail; "${args[@]}") >"$steps_dir/$i.log" 2>&1 || rc=$?
      echo "$((SECONDS - t)) $rc" >"$steps_dir/$i.rc"
    ) &
    pids+=($!)
    i=$((i + 1))
  done
  echo "== side by side: ${names[*]}"
  local failed=0 n secs rc
  for n in "${!pids[@]}"; do
    wait "${pids[$n]}" || true
    read -r secs rc <"$steps_dir/$n.rc"
    echo "== ${names[$n]}"
    cat "$steps_dir/$n.log"
    if [ "$rc" != 0 ]; then
      echo "== ${names[$n]}: $secs s, FAILED (exit $rc)"
      failed=1
    else
      echo "== ${names[$n]}: $secs s"
    fi
    steps_table+=("$(printf '%5d s  %s (side by side)' "$secs" "${names[$n]}")")
  done
  echo "== side by side, all ended: $((SECONDS - s)) s"
  [ "$failed" = 0 ]
}

steps_summary() {
  echo "== seconds per step"
  printf '%s\n' "${steps_table[@]}"
  echo "== total: $((SECONDS - steps_t0)) s"
}

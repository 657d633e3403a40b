#!/usr/bin/env bash
# Runs a command with the Target replica alone on one CPU and every other process on the
# others: the design's separate hardware (the target on its own large GPU, the drafter on a
# cheap one) emulated on one machine, where otherwise the drafter's work (drafting ahead
# while the target verifies) and the router's share the target's cores. Linux (taskset).
#
#   scripts/isolated bench/pin_target.sh bench/draft_ahead.sh OUT 2 -- --target bench-target \
#       --drafter bench-drafter --concurrency 1 --ks 2 --configs draft_k2 --max-tokens 64
#
# TARGET_CPUS (default 0) and OTHER_CPUS (default: every other CPU) are taskset lists. Every
# second, each process not seen before is pinned (all its threads); a process that becomes
# a Target replica (Ray's idle worker, renamed) is moved to TARGET_CPUS. On exit every
# process is let run on every CPU again (one pinned by hand before is not restored).
set -euo pipefail
n=$(nproc)
target_cpus=${TARGET_CPUS:-0}
other_cpus=${OTHER_CPUS:-$([ "$n" -gt 1 ] && echo "1-$((n - 1))" || echo 0)}
pin_loop() {
  declare -A seen
  while true; do
    targets=" $(pgrep -f 'ServeReplica:specserve:Target' | tr '\n' ' ' || true) "
    for p in $(ps -eo pid=); do
      [ -n "${seen[$p]:-}" ] && continue
      case "$targets" in *" $p "*) cpus=$target_cpus ;; *) cpus=$other_cpus ;; esac
      taskset -a -p -c "$cpus" "$p" >/dev/null 2>&1 && seen[$p]=$cpus
    done
    for p in $targets; do
      [ "${seen[$p]:-}" = "$target_cpus" ] && continue
      taskset -a -p -c "$target_cpus" "$p" >/dev/null 2>&1 && seen[$p]=$target_cpus
    done
    sleep 1
  done
}
pin_loop &
loop=$!
unpin() {
  kill "$loop" 2>/dev/null || true
  for p in $(ps -eo pid=); do taskset -a -p -c "0-$((n - 1))" "$p" >/dev/null 2>&1 || true; done
}
trap unpin EXIT
"$@"

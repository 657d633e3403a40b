#!/usr/bin/env bash
# Runs the same `specserve bench` on two checkouts, alternating (A B A B ...), so a change is
# measured before and after in one run on this shared, noisy machine. Each run writes its
# report under OUT/<label>-<i>/. Both checkouts use this checkout's .venv, each put first on
# PYTHONPATH (Ray's workers inherit it), so the working tree may change meanwhile.
#
#   bench/compare_revisions.sh BEFORE_DIR AFTER_DIR OUT ROUNDS -- bench --target ...
#   e.g. git worktree add /tmp/before a20bb1f; git worktree add /tmp/after HEAD
#        bench/compare_revisions.sh /tmp/before /tmp/after bench-results/cmp 2 -- bench --no-hf
# Service benchmarks (`--service`) must run inside scripts/isolated. ROUND_LOGS=1 gives each
# run its own router round log, OUT/<label>-<i>.rounds (for bench/round_plans.py).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
before="$(cd "$1" && pwd)"; after="$(cd "$2" && pwd)"; out="$3"; rounds="$4"; shift 4
[ "$1" = "--" ] && shift
mkdir -p "$out"
for i in $(seq 1 "$rounds"); do
  for label in before after; do
    dir=$([ "$label" = before ] && echo "$before" || echo "$after")
    echo "[compare] $label run $i: $*" >&2
    log=()
    [ "${ROUND_LOGS:-0}" = 1 ] && log=(--round-log "$out/$label-$i.rounds")
    (cd "$dir" && PYTHONPATH="$dir" "$here/.venv/bin/python" -m specserve.cli "$@" "${log[@]}" \
        --out "$out/$label-$i" > "$out/$label-$i.json")
  done
done

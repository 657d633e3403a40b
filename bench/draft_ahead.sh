#!/usr/bin/env bash
# Draft-ahead off and on, alternating (off on off on ...), the same `specserve bench --service`
# otherwise, so the comparison is same-run on this shared, noisy machine. Each run writes its
# report under OUT/<off|on>-<i>/. Run it inside scripts/isolated (it starts local services).
#
#   scripts/isolated bench/draft_ahead.sh OUT ROUNDS -- --target bench-target \
#       --drafter bench-drafter --concurrency 1,16 --ks 2 --configs draft_k2
#
# GUESSES=N in the environment: the on runs guess N next tokens per row (default: the
# config's drafter.draft_ahead_guesses).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="$1"; rounds="$2"; shift 2
[ "$1" = "--" ] && shift
mkdir -p "$out"
for i in $(seq 1 "$rounds"); do
  for label in off on; do
    extra=$([ "$label" = on ] && echo "--draft-ahead ${GUESSES:-}" || true)
    echo "[draft-ahead] $label run $i" >&2
    "$here/.venv/bin/python" -m specserve.cli bench --service "$@" $extra \
        --out "$out/$label-$i" > "$out/$label-$i.json"
  done
done

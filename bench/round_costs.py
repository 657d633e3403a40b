"""What spec=auto's cost model measures of a round, against what each run made.

Run a suite with the router's round log on, then read both:

    scripts/isolated .venv/bin/specserve bench --suite --round-log /tmp/rounds.jsonl \\
        --target bench-target --drafter bench-drafter --concurrency fine --ks 2 \\
        --classes mixed --prompts 4 --no-hf --out /tmp/sweep
    .venv/bin/python bench/round_costs.py /tmp/sweep/report.json /tmp/rounds.jsonl

For every level, configuration and repeat, four ratios to spec-off's in the same repeat:
the run's real tokens/s; tokens a round over the mean of the rounds the cost model
measures, with their gaps (no first round, no catch-up: what auto decides on); over the
median of those that were decoding steps (what it decided on before); over the mean of all
rounds with their gaps. Where the estimates part from the real ratio, the cost model sees a
different order of plans than the runs make (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specserve.bench.analysis import round_costs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", type=Path, help="the suite's report.json")
    ap.add_argument("round_log", type=Path, help="the router.round_log file of that run")
    args = ap.parse_args(argv)
    report = json.loads(args.report.read_text())
    records = [json.loads(line) for line in args.round_log.read_text().splitlines() if line]
    if not records:
        print(f"{args.round_log}: no rounds logged", file=sys.stderr)
        return 1
    for cls, body in report["classes"].items():
        costs = round_costs(body["levels"], records)
        if not costs:
            print(f"{cls}: the report has no run windows (a report from before they were "
                  "kept?)", file=sys.stderr)
            continue
        print(f"## {cls}\n\nx spec-off, repeat by repeat: real tokens/s | mean of measured "
              "rounds | median of decoding rounds | mean of all rounds\n")
        print("| level | config | real | measured mean | decoding median | all rounds mean |")
        print("|---|---|---|---|---|---|")
        for lvl, configs in costs.items():
            for name, rows in configs.items():
                cols = [", ".join("-" if r[k] is None else f"{r[k]:.2f}" for r in rows)
                        for k in ("real", "measured_mean", "decoding_median",
                                  "all_rounds_mean")]
                print(f"| {lvl} | {name} | " + " | ".join(cols) + " |")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

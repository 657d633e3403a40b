"""Which plans each run of a suite ran, from the router's round log: per plan, its share
of the run's round time (with the gaps), rounds, tokens a round, ms a round and the ms of
it that the verify call waited beyond the target's compute (for the step); for auto,
its round time by the reason of its plans (``explore``: the tries) and the plans of each
BIN-second stretch of the run and the tokens/s committed in it; per level, how fast the
target's forward ran in each configuration's windows against the others' at the same batch
shapes (``target_speed``: a reading the shared machine slowed, told from one the plans did).

    scripts/isolated .venv/bin/specserve bench --suite --round-log /tmp/rounds.jsonl ... \\
        --out /tmp/suite
    .venv/bin/python bench/round_plans.py /tmp/suite/report.json /tmp/rounds.jsonl

The stretches of one run are at different times, with different rows and text: a hint of
where the plans differ, not a ranking (docs/benchmarks.md, "A cold router at c=32").
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

from specserve.bench.analysis import runs_rounds, target_speed


def _key(r: dict) -> str:
    return f"{r['proposer']}:{r['k']}" if r["k"] else "none:0"


def _plans(rounds: list[dict]) -> list[str]:
    by: dict[str, list[dict]] = defaultdict(list)
    for r in rounds:
        by[_key(r)].append(r)
    total = sum(r["round_s"] + r["gap_s"] for r in rounds) or 1.0
    out = []
    for key, rs in sorted(by.items(), key=lambda kv: -len(kv[1])):
        t = sum(r["round_s"] + r["gap_s"] for r in rs)
        # the wait for the target's step: the verify call beyond the target's compute
        wait = sum(max(0.0, r["verify_s"] - r.get("verify_compute_s", r["verify_s"]))
                   for r in rs)
        out.append(f"  {key:9s} {100 * t / total:5.1f} % of time, {len(rs):5d} rounds, "
                   f"{sum(r['tokens'] for r in rs) / len(rs):.2f} tokens and "
                   f"{1000 * t / len(rs):7.1f} ms a round, {1000 * wait / len(rs):6.1f} ms "
                   "of it waiting for the step")
    return out


def _reasons(rounds: list[dict]) -> str:
    """The share of the run's round time by the reason its plan was chosen (``explore``: a
    try, alone or the batch's; docs/observability.md lists the reasons)."""
    by: dict[str, float] = defaultdict(float)
    for r in rounds:
        by[r.get("reason") or "?"] += r["round_s"] + r["gap_s"]
    total = sum(by.values()) or 1.0
    return "  by reason: " + ", ".join(f"{k} {100 * t / total:.1f} %"
                                       for k, t in sorted(by.items(), key=lambda kv: -kv[1]))


def _stretches(rounds: list[dict], seconds: float) -> list[str]:
    t0, bins = rounds[0]["t"], defaultdict(list)
    for r in rounds:
        bins[int((r["t"] - t0) // seconds)].append(r)
    return [f"  {b * seconds:5.0f} s: {sum(r['tokens'] for r in rs) / seconds:6.1f} tokens/s, "
            + ", ".join(f"{k} {n}" for k, n in Counter(map(_key, rs)).most_common(3))
            for b, rs in sorted(bins.items())]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", type=Path, help="the suite's report.json")
    ap.add_argument("round_log", type=Path, help="the router.round_log file of that run")
    ap.add_argument("--bin", type=float, default=3.0, help="seconds a stretch (default 3)")
    args = ap.parse_args(argv)
    if args.bin <= 0:
        ap.error("--bin: give a positive number of seconds")
    report = json.loads(args.report.read_text())
    log = sorted((json.loads(line) for line in args.round_log.read_text().splitlines()
                  if line), key=lambda r: r["t"])
    if not log:
        print(f"{args.round_log}: no rounds logged", file=sys.stderr)
        return 1
    for cls, body in report["classes"].items():
        for level, configs in body["levels"].items():
            by_config = runs_rounds(configs, log)
            print(f"## {cls} c={level}: the target's forward at the same batch shapes against "
                  "the other configurations' (1.0: as fast; at c=1 a reading far from 1 is "
                  "the machine): " + ", ".join(f"{name} {x}" for name, x in
                                               target_speed(by_config).items()))
            for name, runs in by_config.items():
                for i, rounds in enumerate(runs):
                    a, b = configs[name]["windows_runs"][i]
                    print(f"## {cls} c={level} {name} run {i}: {len(rounds)} rounds, "
                          f"{b - a:.1f} s")
                    if rounds:
                        print("\n".join(_plans(rounds)))
                        if name == "auto":
                            print(_reasons(rounds))
                            print("\n".join(_stretches(rounds, args.bin)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

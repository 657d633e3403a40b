"""Pure pieces of the benchmark report: ideal speedup, mismatch detection, verdicts."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

SCHEMA = "specserve.bench/v1"
FINE_LEVELS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # `--concurrency fine`: exposes thresholds


def ideal_speedup(tokens_per_round: float, drafter_ms_per_round: float,
                  verify_ms_per_round: float, plain_step_ms: float) -> float:
    """Speedup over plain decoding if nothing but the models cost time:
    tokens per round x cost of one plain step / (drafting + verifying one round)."""
    if tokens_per_round <= 0 or plain_step_ms <= 0:
        raise ValueError("tokens_per_round and plain_step_ms must be > 0")
    round_cost = drafter_ms_per_round + verify_ms_per_round
    if round_cost <= 0:
        raise ValueError("a round must cost something")
    return tokens_per_round * plain_step_ms / round_cost


def find_mismatches(outputs: Mapping[str, Sequence[Sequence[int] | None]],
                    reference: str = "off") -> list[dict]:
    """Greedy outputs of every configuration vs the reference configuration, per request
    index. Returns one record per differing request (first differing position included);
    failed requests (None) are not mismatches, they are errors counted elsewhere."""
    ref = outputs[reference]
    found = []
    for name, outs in outputs.items():
        if name == reference:
            continue
        for i, (a, b) in enumerate(zip(outs, ref, strict=False)):
            if a is None or b is None or list(a) == list(b):
                continue
            first = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                         min(len(a), len(b)))
            found.append({"config": name, "index": i, "first_diff": first,
                          "len": len(a), "reference_len": len(b)})
    return found


def verdict(speedups_by_level: Mapping[int, Mapping[str, float]]) -> dict:
    """Adoption advice for one workload class from speedup-vs-spec-off per level and config.

    on        : the best speculative config is >= 1.1x at every level
    low-load  : >= 1.1x at the lowest level but < 0.95x at some level (turn off when busy)
    off       : < 1.05x even at the lowest level
    neutral   : otherwise
    """
    levels = sorted(speedups_by_level)
    configs = [c for c in speedups_by_level[levels[0]] if c != "off"]
    best_low = max(configs, key=lambda c: speedups_by_level[levels[0]][c])
    low = speedups_by_level[levels[0]][best_low]
    worst = {c: min(speedups_by_level[lv][c] for lv in levels) for c in configs}
    steady = [c for c in configs if worst[c] >= 1.1]
    if steady:
        best = max(steady, key=lambda c: speedups_by_level[levels[0]][c])
        return {"verdict": "on", "config": best, "speedup_low": speedups_by_level[levels[0]][best],
                "speedup_worst": worst[best]}
    if low < 1.05:
        return {"verdict": "off", "config": "off", "speedup_low": low,
                "speedup_worst": worst[best_low]}
    if worst[best_low] < 0.95:
        return {"verdict": "low-load", "config": best_low, "speedup_low": low,
                "speedup_worst": worst[best_low]}
    return {"verdict": "neutral", "config": best_low, "speedup_low": low,
            "speedup_worst": worst[best_low]}


def level_winners(level: Mapping[str, Mapping]) -> dict:
    """Which configuration won one level (aggregate tokens/s), the best fixed one (spec-off
    included, auto excluded), and auto against both. A level run several times (rows with
    ``aggregate_tokens_per_s_runs``; their tokens/s is the median run's) also gets auto
    against the best fixed one repeat by repeat."""
    tps = {name: float(row["aggregate_tokens_per_s"]) for name, row in level.items()}
    fixed = {n: v for n, v in tps.items() if n != "auto"}
    best_fixed = max(fixed, key=lambda n: fixed[n])
    out: dict = {"best": max(tps, key=lambda n: tps[n]), "best_fixed": best_fixed}
    if "auto" in tps:
        out["auto_vs_best_fixed"] = round(tps["auto"] / max(fixed[best_fixed], 1e-9), 3)
        out["auto_vs_off"] = round(tps["auto"] / max(tps.get("off", 0.0), 1e-9), 3)
        runs = {n: level[n].get("aggregate_tokens_per_s_runs") or [] for n in ("auto", best_fixed)}
        if len(runs["auto"]) > 1 and len(runs["auto"]) == len(runs[best_fixed]):
            # repeat r's auto against repeat r's best fixed (run close together in time)
            pairs = zip(runs["auto"], runs[best_fixed], strict=True)
            out["auto_vs_best_fixed_runs"] = [round(a / max(b, 1e-9), 3) for a, b in pairs]
    return out


def run_noise(levels: Mapping[str, Mapping[str, Mapping]]) -> float | None:
    """How far one run's tokens/s strays on this machine: the pooled standard deviation of
    log tokens/s between the repeats of each configuration at each level (None without
    repeats). 0.066 is 6.6 % a run."""
    squares, dof = 0.0, 0
    for level in levels.values():
        for row in level.values():
            logs = [math.log(x) for x in row.get("aggregate_tokens_per_s_runs") or [] if x > 0]
            if len(logs) > 1:
                mean = sum(logs) / len(logs)
                squares += sum((x - mean) ** 2 for x in logs)
                dof += len(logs) - 1
    return math.sqrt(squares / dof) if dof else None


def matched_auto(level: Mapping[str, Mapping], sigma: float, draws: int = 20000,
                 seed: int = 0) -> dict[str, float]:
    """What ``auto_vs_best_fixed_runs`` reads for a controller exactly as fast as the best
    fixed configuration, when every run strays by lognormal noise ``sigma``: the median
    ratio and the share of repeats at >= 0.97 (seeded Monte Carlo, the fixed configurations
    at their median tokens/s). Repeat by repeat the best fixed one is the best of several
    noisy runs, so even that controller reads below 1 and often below 0.97: the yardstick
    for a sweep's per-repeat ratios."""
    rng = np.random.default_rng(seed)
    fixed = np.log([float(row["aggregate_tokens_per_s"]) for name, row in level.items()
                    if name != "auto"])
    auto = fixed.max() + rng.normal(0.0, sigma, draws)
    best = (fixed[None, :] + rng.normal(0.0, sigma, (draws, len(fixed)))).max(axis=1)
    ratio = np.exp(auto - best)
    return {"median": round(float(np.median(ratio)), 3),
            "at_least_0_97": round(float((ratio >= 0.97).mean()), 3)}


def validate_report(report: Mapping) -> list[str]:
    """Problems with a report's shape (empty list = valid). Documented in
    docs/benchmarks.md#report-schema."""
    problems = []
    for key in ("schema", "pair", "settings", "classes", "mismatches", "verdicts"):
        if key not in report:
            problems.append(f"missing key {key!r}")
    if report.get("schema") != SCHEMA:
        problems.append(f"schema is {report.get('schema')!r}, expected {SCHEMA!r}")
    metrics = ("aggregate_tokens_per_s", "speedup_vs_off", "ttft_ms_p50", "ttft_ms_p99",
               "itl_ms_p50", "itl_ms_p99", "latency_ms_p50", "latency_ms_p99",
               "tokens_per_round", "errors")
    for cls, body in (report.get("classes") or {}).items():
        for level, configs in (body.get("levels") or {}).items():
            if "off" not in configs:
                problems.append(f"{cls}/{level}: no spec-off baseline")
            for name, row in configs.items():
                for m in metrics:
                    if m not in row:
                        problems.append(f"{cls}/{level}/{name}: missing {m}")
    return problems


def plan_mix(stats: list[dict]) -> dict[str, dict[str, int]]:
    """The policy's decisions over requests: rounds by k, by proposer and by reason."""
    out: dict[str, dict[str, int]] = {}
    for name in ("k_histogram", "proposer_mix", "decision_reasons"):
        total: dict[str, int] = {}
        for st in stats:
            for key, n in (st.get(name) or {}).items():
                total[str(key)] = total.get(str(key), 0) + n
        out[name] = dict(sorted(total.items()))
    return out


def round_time_estimates(rounds: Sequence[Mapping]) -> dict | None:
    """A run's rounds from a router's round log (``router.round_log``): tokens a round over
    three round times, each a tokens/s estimate. ``measured_mean_ms``: the mean of the
    rounds spec=auto's cost model measures (``policy.measurable``: no first round, no
    catch-up), each with the gap before it; ``decoding_median_ms``: the median of those
    whose target step was a decoding step, what it measured before (left out: other
    requests' prefills); ``all_rounds_mean_ms``: the mean of every round with the gap before
    it, which is what a run's tokens/s comes from."""
    from specserve.policy import decoding, measurable

    if not rounds:
        return None
    tokens = sum(r["tokens"] for r in rounds) / len(rounds)
    measured = [r for r in rounds if measurable(r["round_no"], r["fed"])]
    dec = [r["round_s"] for r in measured if decoding(r["batch_fed"], r["batch_tokens"])]

    def ms(x: float) -> float:
        return round(1e3 * x, 3)

    return {"rounds": len(rounds), "tokens_per_round": round(tokens, 3),
            "decoding_share": round(len(dec) / len(rounds), 3),
            "measured_mean_ms": ms(float(np.mean([r["round_s"] + r["gap_s"]
                                                  for r in measured]))) if measured else None,
            "decoding_median_ms": ms(float(np.median(dec))) if dec else None,
            "all_rounds_mean_ms": ms(float(np.mean([r["round_s"] + r["gap_s"]
                                                    for r in rounds])))}


def runs_rounds(level: Mapping[str, Mapping], records: Sequence[Mapping],
                times: np.ndarray | None = None) -> dict[str, list[list[Mapping]]]:
    """One level's logged rounds by configuration and run: a report's ``windows_runs`` say
    which rounds of the round log (``records``; ``times``: their ``t``) were whose."""
    ts = np.array([r["t"] for r in records]) if times is None else times
    return {name: [[records[i] for i in np.flatnonzero((ts >= a) & (ts <= b))]
                   for a, b in row.get("windows_runs") or []] for name, row in level.items()}


def round_costs(levels: Mapping[str, Mapping[str, Mapping]], records: Sequence[Mapping],
                reference: str = "off") -> dict[str, dict[str, list[dict]]]:
    """Per level and configuration, repeat by repeat: the run's real tokens/s and the three
    estimates of ``round_time_estimates``, each against the reference configuration's in
    the same repeat (a report's ``windows_runs`` say which logged rounds were whose)."""
    def rate(est: dict | None, key: str) -> float | None:
        return est["tokens_per_round"] / est[key] if est and est[key] else None

    ts = np.array([r["t"] for r in records])
    out: dict[str, dict[str, list[dict]]] = {}
    for lvl, level in levels.items():
        if reference not in level or "windows_runs" not in level[reference]:
            continue
        est = {name: [round_time_estimates(rounds) for rounds in runs]
               for name, runs in runs_rounds(level, records, ts).items()}
        real = {name: row["aggregate_tokens_per_s_runs"] for name, row in level.items()}
        for name in level:
            if name == reference:
                continue
            rows = []
            for i, e in enumerate(est[name]):
                base = est[reference][i] if i < len(est[reference]) else None
                row = {"real": round(real[name][i] / real[reference][i], 3)}
                for key in ("measured_mean_ms", "decoding_median_ms", "all_rounds_mean_ms"):
                    a, b = rate(e, key), rate(base, key)
                    row[key.rsplit("_", 1)[0]] = round(a / b, 3) if a and b else None
                rows.append(row)
            out.setdefault(lvl, {})[name] = rows
    return out


def target_speed(runs: Mapping[str, Sequence[Sequence[Mapping]]],
                 min_rounds: int = 3) -> dict[str, float | None]:
    """Per configuration of one level (``runs_rounds``), how long the target's forward took
    against the level's other configurations at the same batch shapes (rows, tokens): for
    each other configuration, the median over the shapes both ran ``min_rounds`` times of
    the ratio of their median compute times (decoding steps only, ``policy.decoding``);
    then the geometric mean over the others. 1.0: the target ran as fast in its windows as
    in the others'. A configuration's tokens/s swings with the shared machine, and this
    tells a window the machine slowed from one its plans made slow: at concurrency 1
    nothing shares the CPUs with the forward (the drafter's call comes before it), so a
    reading far from 1 there is the machine; above it the drafter's steps for other rows
    overlap the target's and take its CPUs, which is the configuration's own cost. None:
    no shape in common with any other."""
    from specserve.policy import decoding

    def medians(rounds: Sequence[Mapping]) -> dict[tuple[int, int], float]:
        by: dict[tuple[int, int], list[float]] = {}
        for r in rounds:
            if r.get("verify_compute_s") and decoding(r["batch_fed"], r["batch_tokens"]):
                by.setdefault((r["rows"], r["batch_tokens"]), []).append(r["verify_compute_s"])
        return {shape: float(np.median(t)) for shape, t in by.items() if len(t) >= min_rounds}

    shapes = {name: medians([r for run in rs for r in run]) for name, rs in runs.items()}
    out: dict[str, float | None] = {}
    for name, mine in shapes.items():
        logs = [math.log(float(np.median([t / their[s] for s, t in mine.items() if s in their])))
                for other, their in shapes.items() if other != name and mine.keys() & their]
        out[name] = round(math.exp(sum(logs) / len(logs)), 3) if logs else None
    return out

"""Pure pieces of the benchmark report."""

from __future__ import annotations

import pytest

from specserve.bench.analysis import (
    SCHEMA,
    find_mismatches,
    ideal_speedup,
    level_winners,
    validate_report,
    verdict,
)
from specserve.bench.workloads import WorkloadError, builtin_workloads, load_jsonl


def test_ideal_speedup_arithmetic():
    # 2.5 tokens per round; a plain step costs 20 ms; a round costs 4 ms drafting + 25 verifying
    assert ideal_speedup(2.5, 4.0, 25.0, 20.0) == pytest.approx(2.5 * 20 / 29)
    assert ideal_speedup(1.0, 0.0, 20.0, 20.0) == pytest.approx(1.0)  # spec-off is 1x
    with pytest.raises(ValueError):
        ideal_speedup(0.0, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError):
        ideal_speedup(1.0, 0.0, 0.0, 1.0)


def test_mismatch_detector_flags_a_different_output():
    outs = {"off": [[1, 2, 3], [4, 5], None], "draft_k2": [[1, 2, 3], [4, 6], [7]],
            "ngram_k4": [[1, 2, 3, 9], [4, 5], [7]]}
    found = find_mismatches(outs)
    assert {(m["config"], m["index"], m["first_diff"]) for m in found} == {
        ("draft_k2", 1, 1), ("ngram_k4", 0, 3)}
    assert find_mismatches({"off": [[1]], "draft_k2": [[1]]}) == []


def test_verdicts():
    on = verdict({1: {"off": 1.0, "draft_k2": 1.6}, 16: {"off": 1.0, "draft_k2": 1.2}})
    assert on["verdict"] == "on" and on["config"] == "draft_k2"
    low = verdict({1: {"off": 1.0, "draft_k2": 1.5}, 16: {"off": 1.0, "draft_k2": 0.8}})
    assert low["verdict"] == "low-load"
    off = verdict({1: {"off": 1.0, "draft_k2": 0.97}, 16: {"off": 1.0, "draft_k2": 0.9}})
    assert off["verdict"] == "off"


def test_level_winners_name_the_best_and_rate_auto():
    level = {"off": {"aggregate_tokens_per_s": 100.0},
             "draft_k2": {"aggregate_tokens_per_s": 125.0},
             "auto": {"aggregate_tokens_per_s": 120.0}}
    assert level_winners(level) == {"best": "draft_k2", "best_fixed": "draft_k2",
                                    "auto_vs_best_fixed": 0.96, "auto_vs_off": 1.2}
    level["auto"]["aggregate_tokens_per_s"] = 130.0
    assert level_winners(level)["best"] == "auto"
    del level["auto"]
    assert level_winners(level) == {"best": "draft_k2", "best_fixed": "draft_k2"}


def test_repeated_levels_interleave_and_report_the_median_run():
    from specserve.bench.suite import _repeated_level

    configs = [("off", {"k": 0}), ("draft_k2", {"k": 2}), ("auto", {"k": 4})]
    order: list[int] = []
    speed = {0: [100.0, 90.0, 110.0], 2: [130.0, 150.0, 120.0], 4: [140.0, 125.0, 135.0]}

    def run(cfg: dict) -> dict:
        order.append(cfg["k"])
        i = sum(1 for k in order if k == cfg["k"]) - 1  # this config's repeat
        return {"aggregate_tokens_per_s": speed[cfg["k"]][i], "repeat": i,
                "window": [len(order), len(order) + 0.5], "outputs": [[cfg["k"], i]]}

    level, outs = _repeated_level(run, configs, 3)
    assert order == [0, 2, 4, 2, 4, 0, 4, 0, 2]  # each config in every position once
    assert level["off"]["aggregate_tokens_per_s"] == 100.0 and level["off"]["repeat"] == 0
    assert level["draft_k2"]["repeat"] == 0 and level["auto"]["repeat"] == 2
    assert level["auto"]["aggregate_tokens_per_s_runs"] == [140.0, 125.0, 135.0]
    assert level["auto"]["windows_runs"] == [[3, 3.5], [5, 5.5], [7, 7.5]]  # repeat order
    assert outs["auto"] == [[4, 0], [4, 1], [4, 2]] and "outputs" not in level["auto"]
    w = level_winners(level)
    assert w["best_fixed"] == "draft_k2" and w["auto_vs_best_fixed"] == round(135 / 130, 3)
    assert w["auto_vs_best_fixed_runs"] == [round(140 / 130, 3), round(125 / 150, 3),
                                            round(135 / 120, 3)]
    assert "auto_vs_best_fixed_runs" not in level_winners(
        {n: {"aggregate_tokens_per_s": r["aggregate_tokens_per_s"]} for n, r in level.items()})


def test_run_noise_and_what_a_matched_controller_reads_repeat_by_repeat():
    """One run's spread is pooled from the repeats of each configuration at each level; a
    controller exactly as fast as the best fixed configuration reads auto / best fixed of
    about 1 with no noise, and below 1 (often below 0.97) with this machine's: the best
    fixed one, repeat by repeat, is the best of several noisy runs."""
    import math

    from specserve.bench.analysis import matched_auto, run_noise
    from specserve.bench.suite import _noise_lines

    def row(*runs: float) -> dict:
        return {"aggregate_tokens_per_s": sorted(runs)[len(runs) // 2],
                "aggregate_tokens_per_s_runs": list(runs)}

    levels = {"1": {"off": row(100.0, 110.0), "draft_k2": row(50.0, 55.0)},
              "4": {"off": row(80.0, 88.0), "auto": row(90.0, 99.0)}}
    assert run_noise(levels) == pytest.approx(math.log(1.1) / math.sqrt(2))
    assert run_noise({"1": {"off": {"aggregate_tokens_per_s_runs": [100.0]}}}) is None
    two = {"off": row(100.0, 100.0), "draft_k2": row(120.0, 120.0),
           "ngram_k4": row(120.0, 120.0), "auto": row(120.0, 120.0)}
    assert matched_auto(two, 1e-6) == {"median": 1.0, "at_least_0_97": 1.0}
    noisy = matched_auto(two, 0.066)  # two equal best fixed configurations, 6.6 % a run
    assert 0.94 < noisy["median"] < 0.98 and 0.35 < noisy["at_least_0_97"] < 0.6
    assert matched_auto(two, 0.066) == noisy  # seeded
    lines = _noise_lines({"run_sigma": 0.066, "matched_auto": {"4": noisy}}, ["4"])
    assert lines[0].startswith("| ... if auto = best fixed | 0.9") and "6.6 %" in lines[2]
    assert _noise_lines(None, ["4"]) == []


def test_validate_report_finds_problems():
    assert validate_report({"schema": "x"})  # many problems
    ok = {"schema": SCHEMA, "pair": {}, "settings": {}, "mismatches": {}, "verdicts": {},
          "classes": {"code": {"levels": {"1": {"draft_k2": {}}}}}}
    problems = validate_report(ok)
    assert "code/1: no spec-off baseline" in problems
    assert any("missing aggregate_tokens_per_s" in p for p in problems)


def test_workloads(tmp_path):
    classes = builtin_workloads(3)
    assert set(classes) == {"code-short", "code-long", "prose", "repetitive"}
    assert all(len(v) == 3 for v in classes.values())
    rep = classes["repetitive"][0].text
    assert rep.split("\n\n")[-1] in rep.split("\n\n")[0]  # the tail repeats the block
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "a", "class": "x"}\n{"prompt": "b", "max_tokens": 5}\n')
    loaded = load_jsonl(path)
    assert loaded["x"][0].max_tokens == 64 and loaded["custom"][0].max_tokens == 5
    path.write_text('{"prompt": ""}\n')
    with pytest.raises(WorkloadError, match=r"w\.jsonl:1"):
        load_jsonl(path)


def test_target_speed_compares_each_configurations_forward_at_the_same_batch_shapes():
    """A configuration's window the shared machine slowed shows as its target's forward
    taking longer than the other configurations' at the same (rows, tokens): per other
    configuration the median of the shapes' ratios, then their geometric mean. Steps with a
    prefill in them, and shapes seen fewer than ``min_rounds`` times, are left out."""
    from specserve.bench.analysis import target_speed

    def rnd(rows, tokens, s, batch_fed=None):
        return {"rows": rows, "batch_tokens": tokens, "verify_compute_s": s,
                "batch_fed": tokens if batch_fed is None else batch_fed}

    fast = [rnd(1, 3, 0.02)] * 3 + [rnd(1, 5, 0.03)] * 3
    slow = [rnd(1, 3, 0.03)] * 3 + [rnd(1, 5, 0.045)] * 3 + [rnd(1, 3, 9.0, batch_fed=300)] * 3
    other = [rnd(1, 3, 0.02)] * 3 + [rnd(2, 2, 0.5)] * 2  # (2, 2): too few to count
    lone = [rnd(4, 4, 0.1)] * 3  # no shape in common
    got = target_speed({"fast": [fast], "slow": [slow[:4], slow[4:]], "other": [other],
                        "lone": [lone]})
    assert got["slow"] == pytest.approx(1.5, abs=1e-3)  # 1.5 against both
    assert got["fast"] == pytest.approx((1 / 1.5) ** 0.5, abs=1e-3)  # 2/3 and 1
    assert got["other"] == pytest.approx((1 / 1.5) ** 0.5, abs=1e-3)  # 1 and 2/3
    assert got["lone"] is None


def test_round_costs_set_the_cost_models_view_beside_each_runs_tokens_per_s():
    """A logged run's rounds by its window: tokens a round over the mean of the rounds the
    cost model measures (other requests' prefills in, first rounds and catch-ups out), over
    the median of decoding rounds (what it measured before), and over the mean of all
    rounds with their gaps, each against spec-off's."""
    from specserve.bench.analysis import round_costs, round_time_estimates

    def rnd(t, tokens, s, no=1, gap=0.0, fed=0, batch_fed=0, batch_tokens=4):
        return {"t": t, "tokens": tokens, "round_s": s, "round_no": no, "gap_s": gap,
                "fed": fed, "batch_fed": batch_fed, "batch_tokens": batch_tokens}

    # spec-off: 1 token a round, 0.1 s decoding, one 1.0 s step that had a prefill in it
    off = [rnd(1 + i / 10, 1, 0.1) for i in range(9)] + [rnd(2, 1, 1.0, batch_fed=300)]
    # lookup: 2 tokens a round, 0.15 s decoding, a first round and a re-fed cache of 1.5 s
    ngram = [rnd(11 + i / 10, 2, 0.15) for i in range(8)] + [
        rnd(12, 2, 1.5, no=0), rnd(12.5, 2, 1.5, fed=200)]
    est = round_time_estimates(off)
    assert est == {"rounds": 10, "tokens_per_round": 1.0, "decoding_share": 0.9,
                   "measured_mean_ms": 190.0, "decoding_median_ms": 100.0,
                   "all_rounds_mean_ms": 190.0}
    assert round_time_estimates(ngram)["measured_mean_ms"] == 150.0  # first, re-fed: out
    assert round_time_estimates(ngram)["decoding_median_ms"] == 150.0
    assert round_time_estimates([]) is None
    levels = {"4": {"off": {"aggregate_tokens_per_s_runs": [10.0], "windows_runs": [[0, 5]]},
                    "ngram_k4": {"aggregate_tokens_per_s_runs": [8.0],
                                 "windows_runs": [[10, 13]]}}}
    got = round_costs(levels, off + ngram + [rnd(50, 1, 9.0)])  # a round of no run
    (row,) = got["4"]["ngram_k4"]
    assert row["real"] == 0.8
    assert row["measured_mean"] == round((2 / 0.15) / (1 / 0.19), 3)  # 2.533
    assert row["decoding_median"] == round((2 / 0.15) / (1 / 0.1), 3)  # 1.333: looks better
    assert row["all_rounds_mean"] == round((2 / 0.42) / (1 / 0.19), 3)  # 0.905: is not
    assert round_costs({"4": {"off": {"aggregate_tokens_per_s_runs": [1.0]}}}, off) == {}

"""`specserve bench --suite`: is speculation worth it, per workload class and load?

Against a running service (``server``) or one it starts, through the SDK: closed-loop
concurrency levels (optionally an open-loop Poisson rate), every workload class separately
and mixed, configurations side by side in the same run (spec-off, draft at each K, ngram, auto),
plus reference points outside the service at concurrency 1 on the same pair (Hugging Face
``generate`` plain and assisted, the naive textbook loop, the single-process engine).
Artifacts in ``out_dir``: report.json (schema: docs/benchmarks.md#report-schema),
outputs.jsonl (every generated output), summary.md (verdicts), and PNG plots.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specserve.bench.analysis import (
    SCHEMA,
    find_mismatches,
    ideal_speedup,
    level_winners,
    matched_auto,
    run_noise,
    verdict,
)
from specserve.bench.service import _level, _one, _pct
from specserve.bench.workloads import Prompt, WorkloadError, builtin_workloads
from specserve.client import Client, SpecServeError
from specserve.ports import free_port


def _configs(ks: list[int], ngram_k: int) -> list[tuple[str, dict]]:
    out = [("off", {"spec": "off", "k": 0})]
    out += [(f"draft_k{k}", {"spec": "draft", "k": k}) for k in ks]
    if ngram_k:
        out.append((f"ngram_k{ngram_k}", {"spec": "ngram", "k": ngram_k}))
    out.append(("auto", {"spec": "auto", "k": max([*ks, ngram_k])}))  # k: its K_max
    return out


def _open_loop(client: Client, prompts: list[Prompt], cfg: dict, rate: float, n: int,
               seed: int = 0) -> dict:
    """Poisson arrivals at ``rate`` requests/s; latency includes queueing."""
    rng = random.Random(seed)
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        p = prompts[i % len(prompts)]
        try:
            r = _one(client, p.text, cfg, p.max_tokens)
            with lock:
                results.append(r)
        except SpecServeError as e:
            errors.append(e.code.name)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=64) as pool:
        t = 0.0
        for i in range(n):
            t += rng.expovariate(rate)
            delay = t0 + t - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pool.submit(run, i)
    wall = time.perf_counter() - t0
    ntok = sum(len(r["tokens"]) for r in results)
    return {"rate_rps": rate, "requests": len(results), "errors": errors,
            "aggregate_tokens_per_s": round(ntok / wall, 2),
            "latency_ms_p50": _pct([r["latency"] * 1000 for r in results], 50),
            "latency_ms_p99": _pct([r["latency"] * 1000 for r in results], 99),
            "ttft_ms_p50": _pct([r["ttft"] * 1000 for r in results], 50)}


def _add_derived(level: dict[str, dict], plain_step_ms: float | None) -> None:
    base = level["off"]
    for name, row in level.items():
        row["speedup_vs_off"] = round(
            row["aggregate_tokens_per_s"] / max(base["aggregate_tokens_per_s"], 1e-9), 3)
        drafts = row.get("drafts") or 0
        row["acceptance_per_position"] = [round(a / drafts, 4) if drafts else 0.0
                                          for a in row.get("accepted_per_position", [])]
        if name != "off" and plain_step_ms:
            ideal = ideal_speedup(row["tokens_per_round"], row["drafter_compute_ms_mean"],
                                  row["target_compute_ms_mean"], plain_step_ms)
            row["ideal_speedup"] = round(ideal, 3)
            row["efficiency"] = round(row["speedup_vs_off"] / ideal, 3)


def _repeated_level(run: Callable[[dict], dict], configs: list[tuple[str, dict]],
                    repeats: int) -> tuple[dict[str, dict], dict[str, list]]:
    """One level, every configuration ``repeats`` times, interleaved: repeat r runs the
    configurations rotated by r, so each takes every position in turn and a slow spell of a
    shared machine falls on all of them, not on the one that happened to run then. A
    configuration's row is its median run (by aggregate tokens/s; the lower middle when
    ``repeats`` is even) with every run's tokens/s in ``aggregate_tokens_per_s_runs`` and its
    wall-clock window (unix seconds) in ``windows_runs`` (repeat order). Returns the rows
    and each configuration's outputs of all runs, repeat after repeat."""
    runs: dict[str, list[dict]] = {name: [] for name, _ in configs}
    for r in range(repeats):
        shift = r % len(configs)
        for name, cfg in configs[shift:] + configs[:shift]:
            runs[name].append(run(cfg))
    level, outs = {}, {}
    for name, rows in runs.items():
        outs[name] = [o for row in rows for o in row.pop("outputs")]
        tps = [row["aggregate_tokens_per_s"] for row in rows]
        level[name] = {**sorted(rows, key=lambda row: row["aggregate_tokens_per_s"])[
            (len(rows) - 1) // 2], "aggregate_tokens_per_s_runs": tps,
            "windows_runs": [row["window"] for row in rows]}
    return level, outs


def _with_cost_model(service: Any, run: Callable[[dict], dict], cfg: dict) -> dict:
    """``run(cfg)``, and for auto what the router's cost model believed at its end (a
    service the bench started: its router's stats are at hand)."""
    row = run(cfg)
    if cfg["spec"] == "auto":
        row["auto_cost_model"] = service.router_stats()["auto_cost_model"]
    return row


def _noise(levels: dict[str, dict]) -> dict | None:
    """With repeats: one run's spread on this machine, and per level what auto / best fixed
    would read repeat by repeat for a controller as fast as the best fixed configuration."""
    sigma = run_noise(levels)
    if sigma is None:
        return None
    return {"run_sigma": round(sigma, 4), "matched_auto": {
        c: matched_auto(level, sigma) for c, level in levels.items() if "auto" in level}}


def _label(cls: str) -> str:
    """A workload class name as a request's ``workload`` ([A-Za-z0-9_.-], at most 32)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", cls)[:32] or "custom"


def run_suite(server: str | Callable[..., Any], target: str, drafter: str, levels: list[int],
              ks: list[int], out_dir: Path, classes: dict[str, list[Prompt]] | None = None,
              requests_per_level: int = 8, ngram_k: int = 4, baselines: bool = True,
              baseline_prompts: int = 3, poisson_rate: float | None = None,
              app_config: dict | None = None, baseline_max_tokens: int = 32,
              only: list[str] | None = None, repeats: int = 1) -> dict:
    """``only``: the classes to run (of ``classes`` and ``mixed``), default all.
    ``repeats``: run every level's configurations this many times, interleaved (see
    ``_repeated_level``)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    classes = classes or builtin_workloads(max(requests_per_level, 4))
    classes = {**classes, "mixed": [p for ps in classes.values() for p in ps[::2]]}
    if only is not None:
        unknown = sorted(set(only) - set(classes))
        if unknown:
            raise WorkloadError(f"unknown classes {unknown}; known: {sorted(classes)}")
        classes = {c: ps for c, ps in classes.items() if c in only}
    configs = _configs(ks, ngram_k)
    service = None
    if callable(server):  # a local service starter (``deployments.local.start_local``)
        service = server({"models": {"target": target, "drafter": drafter},
                          **(app_config or {})}, port=free_port())
        server = service.grpc_address
    n_req = {c: max(requests_per_level, 2 * c) for c in levels}
    total = sum(n_req.values()) * len(configs) * len(classes) * repeats
    if baselines:
        total += (4 + len(ks)) * baseline_prompts * len(classes)
    bar = tqdm(total=total, desc="bench suite", unit="req")
    report: dict = {"schema": SCHEMA, "classes": {}, "verdicts": {}}
    outputs_file = []
    try:
        with Client(server, timeout=900) as client:
            client.generate("import os", max_tokens=4)  # warm-up
            for cls, prompts in classes.items():
                texts = [p.text for p in prompts]
                budgets = [p.max_tokens for p in prompts]
                body: dict = {"prompts": len(prompts), "levels": {}}
                # each request names its class (auto's priors)
                cls_configs = [(n, {**cfg, "workload": _label(cls)}) for n, cfg in configs]
                for c in levels:
                    run = partial(_level, client, texts, concurrency=c, n_requests=n_req[c],
                                  max_tokens=budgets, bar=bar)
                    level, outs = _repeated_level(
                        run if service is None else partial(_with_cost_model, service, run),
                        cls_configs, repeats)
                    step = level["off"]["target_compute_ms_mean"] if c == 1 else None
                    _add_derived(level, step)
                    body.setdefault("mismatches", []).extend(
                        {**m, "level": c} for m in find_mismatches(outs))
                    for name, lst in outs.items():
                        for i, toks in enumerate(lst):
                            outputs_file.append({"class": cls, "level": c, "config": name,
                                                 "repeat": i // n_req[c], "index": i % n_req[c],
                                                 "prompt_index": i % n_req[c] % len(prompts),
                                                 "token_ids": toks})
                    body["levels"][str(c)] = level
                    body.setdefault("winners", {})[str(c)] = level_winners(level)
                    report["classes"][cls] = body
                    _checkpoint(report, out_dir)  # an interrupted run keeps its levels
                if (noise := _noise(body["levels"])) is not None:
                    body["noise"] = noise
                if poisson_rate:
                    body["open_loop"] = {name: _open_loop(client, prompts, cfg, poisson_rate,
                                                          requests_per_level)
                                         for name, cfg in configs}
                report["classes"][cls] = body
                report["verdicts"][cls] = verdict(
                    {int(c): {n: r["speedup_vs_off"] for n, r in lv.items()}
                     for c, lv in body["levels"].items()})
                _checkpoint(report, out_dir)
        if baselines:
            from specserve.bench.baselines import run_baselines
            from specserve.engine.generator import SpeculativeGenerator
            from specserve.models.load import load_pair

            gen = SpeculativeGenerator(load_pair(target, drafter))
            for cls, prompts in classes.items():
                # capped: the naive loop recomputes the whole prefix every round
                sub = [(p.text, min(p.max_tokens, baseline_max_tokens))
                       for p in prompts[:baseline_prompts]]
                base = run_baselines(gen, sub, ks, bar)
                mism = find_mismatches({k: v["outputs"] for k, v in base.items()},
                                       reference="engine_off")
                off = base["engine_off"]["tokens_per_s"]
                report["classes"][cls]["baselines"] = {
                    k: {"tokens_per_s": v["tokens_per_s"],
                        "vs_engine_off": round(v["tokens_per_s"] / off, 3)}
                    for k, v in base.items()}
                report["classes"][cls]["baseline_mismatches"] = mism
    finally:
        bar.close()
        if service is not None:
            service.stop()
    report["pair"] = {"target": target, "drafter": drafter}
    report["complete"] = True
    report["settings"] = {"levels": levels, "ks": ks, "ngram_k": ngram_k,
                          "baseline_prompts": baseline_prompts,
                          "baseline_max_tokens": baseline_max_tokens,
                          "requests_per_level": n_req, "repeats": repeats,
                          "poisson_rate": poisson_rate,
                          "server": "started by the bench" if service else server}
    report["mismatches"] = {
        "total": sum(len(b.get("mismatches", [])) + len(b.get("baseline_mismatches", []))
                     for b in report["classes"].values())}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    with (out_dir / "outputs.jsonl").open("w") as f:
        for rec in outputs_file:
            f.write(json.dumps(rec) + "\n")
    write_plots(report, out_dir)
    (out_dir / "summary.md").write_text(summary_markdown(report))
    return report


def _checkpoint(report: dict, out_dir: Path) -> None:
    """Write what is measured so far (an interrupted run keeps its finished levels)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.partial.json").write_text(json.dumps(report, indent=1) + "\n")


def summary_markdown(report: dict) -> str:
    lines = ["# specserve bench: adoption summary", "",
             f"Pair: target `{report['pair']['target']}`, drafter `{report['pair']['drafter']}`. "
             f"Greedy outputs compared with spec-off: {report['mismatches']['total']} "
             "mismatches.", ""]
    repeats = report.get("settings", {}).get("repeats", 1)
    if repeats > 1:
        lines += [f"Every level ran each configuration {repeats} times, interleaved; tokens/s "
                  "are the median runs, ratios are between medians.", ""]
    for cls, body in report["classes"].items():
        v = report["verdicts"][cls]
        lines += [f"## {cls}: **{v['verdict']}** ({v['config']}: {v['speedup_low']:.2f}x at the "
                  f"lowest load, {v['speedup_worst']:.2f}x at worst)", ""]
        levels = list(body["levels"])
        names = list(body["levels"][levels[0]])
        lines.append("| config | " + " | ".join(f"c={c}" for c in levels) + " |")
        lines.append("|---|" + "---|" * len(levels))
        for n in names:
            cells = []
            for c in levels:
                row = body["levels"][c][n]
                cells.append(f"{row['speedup_vs_off']:.2f}x ({row['aggregate_tokens_per_s']:.0f} "
                             "tok/s)")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        won = [level_winners(body["levels"][c]) for c in levels]
        lines.append("| **won** | " + " | ".join(w["best"] for w in won) + " |")
        if all("auto_vs_best_fixed" in w for w in won):
            lines.append("| auto / best fixed | " + " | ".join(
                f"{w['auto_vs_best_fixed']:.2f} ({w['best_fixed']})" for w in won) + " |")
            if all("auto_vs_best_fixed_runs" in w for w in won):
                lines.append("| ... per repeat | " + " | ".join(
                    ", ".join(f"{x:.2f}" for x in w["auto_vs_best_fixed_runs"]) for w in won)
                    + " |")
            lines += _noise_lines(body.get("noise"), levels)
            worst = min(won, key=lambda w: w["auto_vs_best_fixed"])
            lines += ["", f"auto: at worst {worst['auto_vs_best_fixed']:.2f}x the best fixed "
                      f"configuration and {min(w['auto_vs_off'] for w in won):.2f}x spec-off "
                      "over these levels."]
        below = [(c, n) for c in levels for n in names
                 if body["levels"][c][n]["speedup_vs_off"] < 0.95]
        if below:
            lines += ["", "Below 0.95x spec-off: " + ", ".join(f"{n} at c={c}"
                                                               for c, n in below) +
                      " (the target is saturated; speculation's extra verify work then costs "
                      "more than it saves)."]
        if "baselines" in body:
            b = body["baselines"]
            lines += ["", "Outside the service, concurrency 1: " + ", ".join(
                f"{k} {v['tokens_per_s']:.1f} tok/s" for k, v in b.items())]
        lines.append("")
    return "\n".join(lines)


def _noise_lines(noise: dict | None, levels: list[str]) -> list[str]:
    """The per-repeat yardstick (``_noise``) as a table row and what it means."""
    if not noise or set(noise["matched_auto"]) != set(levels):
        return []
    m = noise["matched_auto"]
    return ["| ... if auto = best fixed | " + " | ".join(
        f"{m[c]['median']:.2f} ({100 * m[c]['at_least_0_97']:.0f} % >= 0.97)" for c in levels)
        + " |", "", f"One run's tokens/s strays by {100 * noise['run_sigma']:.1f} % here (the "
        "spread between repeats); the last row is what auto / best fixed would read repeat "
        "by repeat for a controller exactly as fast as the best fixed configuration (median, "
        "and the share of repeats at >= 0.97): the best fixed one is the best of several "
        "noisy runs."]


def write_plots(report: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    classes = list(report["classes"])
    # 1. speedup vs concurrency per workload class
    fig, axes = plt.subplots(1, len(classes), figsize=(4 * len(classes), 3.2), squeeze=False)
    for ax, cls in zip(axes[0], classes, strict=True):
        levels = report["classes"][cls]["levels"]
        xs = [int(c) for c in levels]
        for name in levels[str(xs[0])]:
            ax.plot(xs, [levels[str(c)][name]["speedup_vs_off"] for c in xs], marker="o",
                    label=name)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(cls)
        ax.set_xlabel("concurrency")
    axes[0][0].set_ylabel("tokens/s vs spec-off")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "speedup_vs_concurrency.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    # 2. acceptance per draft position (lowest level, each class, each draft config)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for cls in classes:
        levels = report["classes"][cls]["levels"]
        low = levels[min(levels, key=int)]
        for name, row in low.items():
            if name.startswith("draft") and row.get("acceptance_per_position"):
                acc = row["acceptance_per_position"]
                ax.plot(range(1, len(acc) + 1), acc, marker=".", label=f"{cls} {name}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | drafted)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    paths.append(out_dir / "acceptance_per_position.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    # 3. latency CDFs (mixed class, lowest and highest level)
    mixed = report["classes"].get("mixed") or report["classes"][classes[0]]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, c in zip(axes, [min(mixed["levels"], key=int), max(mixed["levels"], key=int)],
                     strict=True):
        for name, row in mixed["levels"][c].items():
            lat = sorted(row.get("latencies_ms", []))
            if lat:
                ax.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))], label=name)
        ax.set_title(f"end-to-end latency CDF, c={c}")
        ax.set_xlabel("ms")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "latency_cdf.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    # 4. tokens/s vs K (lowest level)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for cls in classes:
        levels = report["classes"][cls]["levels"]
        low = levels[min(levels, key=int)]
        ks = sorted(int(n.removeprefix("draft_k")) for n in low if n.startswith("draft_k"))
        pts = [(0, low["off"]["aggregate_tokens_per_s"])] + [
            (k, low[f"draft_k{k}"]["aggregate_tokens_per_s"]) for k in ks]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=cls)
    ax.set_xlabel("K (0 = spec-off)")
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "tokens_per_s_vs_k.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    return paths

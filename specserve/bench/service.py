"""Benchmark of the distributed service through the client SDK (closed loop).

Per concurrency level and configuration (spec-off, draft mode at each K, ngram), in one run:
aggregate and per-request tokens/s, TTFT, inter-token latency, end-to-end latency, accepted
tokens per round, and the per-round time split (propose / verify / orchestration overhead).
At concurrency 1 the single-process engine runs the same prompts in the same run, so the
service's speedup can be compared with the engine's. Greedy outputs of every configuration
are compared with spec-off automatically.

With a service the bench started itself, each row also reports the replicas' side
(``replicas``): the target's mean batch rows, its mean forward time per batch and the
fraction of the wall time it computed, the drafter's mean batch, and the CPU cores each
process of the machine used (target, router, proxy, drafter, client, Ray). And every
level's configurations run again in process, the same engines over the same requests
``concurrency`` at a time in lock-step (``engine.lockstep``: every live request in every
step, no transport), after the service stopped, with the target replica's torch threads:
``fraction_of_inprocess`` is the service's aggregate rate over that one.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from specserve.bench.analysis import plan_mix
from specserve.client import Client, SpecServeError
from specserve.models.corpus import heldout_prompts
from specserve.ports import free_port


def _pct(values, q) -> float:
    return round(float(np.percentile(values, q)), 3) if len(values) else 0.0


def _one(client: Client, prompt: str, cfg: dict, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = None
    last = t0
    itl: list[float] = []
    tokens: list[int] = []
    stats: dict = {}
    for chunk in client.stream(prompt, max_tokens=max_tokens, **cfg):
        now = time.perf_counter()
        if chunk.token_ids:
            if first is None:
                first = now - t0
            else:
                itl.extend([(now - last) / len(chunk.token_ids)] * len(chunk.token_ids))
            last = now
        tokens.extend(chunk.token_ids)
        stats = chunk.stats or stats
    total = time.perf_counter() - t0
    return {"tokens": tokens, "ttft": first or total, "itl": itl, "latency": total,
            "stats": stats}


def _level(client: Client, prompts: list[str], cfg: dict, concurrency: int, n_requests: int,
           max_tokens: int | list[int], bar) -> dict:
    """Closed loop: ``concurrency`` workers run ``n_requests`` requests (prompt i mod len)."""
    budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    lock = threading.Lock()
    nxt = iter(range(n_requests))
    results: list[dict | None] = [None] * n_requests
    errors: list[str] = []

    def worker() -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            try:
                j = i % len(prompts)
                results[i] = _one(client, prompts[j], cfg, budgets[j])
            except SpecServeError as e:
                errors.append(f"{e.code.name}: {e.details}")
            bar.update()

    t0, start = time.perf_counter(), time.time()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for _ in range(concurrency):
            pool.submit(worker)
    wall = time.perf_counter() - t0
    done = [r for r in results if r is not None]
    ntok = sum(len(r["tokens"]) for r in done)
    rounds = sum(r["stats"].get("rounds", 0) for r in done) or 1
    sums = {k: sum(r["stats"].get(f"{k}_ms", 0.0) for r in done)
            for k in ("round", "propose", "verify", "drafter_compute", "target_compute")}
    per_req_overhead = [
        (r["stats"]["round_ms"] - r["stats"]["drafter_compute_ms"]
         - r["stats"]["target_compute_ms"]) / r["stats"]["rounds"]
        for r in done if r["stats"].get("rounds")]
    itl = [x * 1000 for r in done for x in r["itl"]]
    return {
        "requests": len(done), "errors": errors,
        "aggregate_tokens_per_s": round(ntok / wall, 2),
        "per_request_tokens_per_s_p50": _pct([len(r["tokens"]) / r["latency"] for r in done],
                                             50),
        "ttft_ms_p50": _pct([r["ttft"] * 1000 for r in done], 50),
        "ttft_ms_p99": _pct([r["ttft"] * 1000 for r in done], 99),
        "itl_ms_p50": _pct(itl, 50), "itl_ms_p99": _pct(itl, 99),
        "latency_ms_p50": _pct([r["latency"] * 1000 for r in done], 50),
        "latency_ms_p99": _pct([r["latency"] * 1000 for r in done], 99),
        "tokens_per_round": round(ntok / rounds, 3),
        "round_ms_mean": round(sums["round"] / rounds, 3),
        "propose_ms_mean": round(sums["propose"] / rounds, 3),
        "verify_ms_mean": round(sums["verify"] / rounds, 3),
        "drafter_compute_ms_mean": round(sums["drafter_compute"] / rounds, 3),
        "target_compute_ms_mean": round(sums["target_compute"] / rounds, 3),
        "overhead_ms_per_round_p50_over_requests": _pct(per_req_overhead, 50),
        "overhead_ms_per_round_p99_over_requests": _pct(per_req_overhead, 99),
        "accepted_per_position": _sum_lists(
            [r["stats"].get("accepted_per_position", []) for r in done]),
        "plans": plan_mix([r["stats"] for r in done]),
        "drafts": sum(r["stats"].get("drafts", 0) for r in done),
        "drafted_ahead": sum(r["stats"].get("drafted_ahead", 0) for r in done),
        "drafted_ahead_pushed": sum(r["stats"].get("drafted_ahead_pushed", 0) for r in done),
        "drafted_ahead_after_rejection": sum(r["stats"].get("drafted_ahead_after_rejection", 0)
                                             for r in done),
        "latencies_ms": [round(r["latency"] * 1000, 3) for r in done],
        "window": [round(start, 3), round(time.time(), 3)],  # unix s: its rounds in a log
        "outputs": [r["tokens"] if r is not None else None for r in results],
    }


_ROLES = (("Target", "target"), ("Drafter", "drafter"), ("Router", "router"),
          ("ProxyActor", "proxy"), ("ServeController", "controller"), ("redis", "redis"),
          ("raylet", "ray"), ("gcs_server", "ray"), ("ray::", "ray"))


def _process_cpu() -> dict[str, float]:
    """CPU seconds used so far by every process of this machine, by role (Ray's process
    titles name the replicas); this process is the client."""
    import os

    import psutil

    out: dict[str, float] = {}
    for p in psutil.process_iter(["cmdline", "cpu_times"]):
        try:
            cmd, t = " ".join(p.info["cmdline"] or []), p.info["cpu_times"]
        except (psutil.Error, TypeError):
            continue
        if t is None:
            continue
        role = "client" if p.pid == os.getpid() else next(
            (r for key, r in _ROLES if key in cmd), "other")
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


def _replica_side(service: Any, run: Callable[[], dict]) -> dict:
    """``run()``'s row plus what the replicas did meanwhile (counters' differences)."""
    t0, d0, c0, w0 = (service.deployment_stats("Target"), service.deployment_stats("Drafter"),
                      _process_cpu(), time.perf_counter())
    row = run()
    t1, d1, c1 = (service.deployment_stats("Target"), service.deployment_stats("Drafter"),
                  _process_cpu())
    wall = time.perf_counter() - w0
    batches = max(1, t1["batches"] - t0["batches"])
    compute = t1["compute_s"] - t0["compute_s"]
    row["replicas"] = {
        "target_mean_batch_rows": round((t1["rows"] - t0["rows"]) / batches, 2),
        "target_forward_ms_mean": round(1000 * compute / batches, 2),
        "target_busy_fraction": round(compute / wall, 3),
        "target_step_waits": t1["step_waits"] - t0["step_waits"],
        "target_step_timeouts": t1["step_timeouts"] - t0["step_timeouts"],
        "turnaround_p90_ms": t1["turnaround_p90_ms"],
        "drafter_mean_batch_rows": round(
            (d1["rows"] - d0["rows"]) / max(1, d1["batches"] - d0["batches"]), 2),
        # draft-ahead: drafter time spent ahead (while the target verified) and the outcomes
        "drafter_compute_s": round(d1.get("compute_s", 0.0) - d0.get("compute_s", 0.0), 3),
        "drafter_ahead_s": round(d1.get("ahead_s", 0.0) - d0.get("ahead_s", 0.0), 3),
        **{f"ahead_{k}": d1.get(f"ahead_{k}", 0) - d0.get(f"ahead_{k}", 0)
           for k in ("drafted", "hits", "hits_other_guess", "hits_rejection", "misses")},
        "cpu_cores": {k: round((c1[k] - c0.get(k, 0.0)) / wall, 3) for k in sorted(c1)
                      if c1[k] - c0.get(k, 0.0) > 0.005 * wall},
    }
    return row


def _inprocess(target: str, drafter: str, prompts: list[str], concurrency: list[int],
               configs: list[tuple[str, dict]], max_tokens: int, threads: int) -> dict:
    """Aggregate tokens/s of the engines alone: per level, ``c`` requests at a time in
    lock-step (each request's prompt, budget and settings as the service got them)."""
    import torch

    from specserve.api import GenerationRequest
    from specserve.engine.drafter import DrafterEngine
    from specserve.engine.lean import LeanLlama
    from specserve.engine.lockstep import run_lockstep
    from specserve.engine.target import TargetEngine
    from specserve.models.load import load_pair

    torch.set_num_threads(threads)
    pair = load_pair(target, drafter)
    ids = [pair.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    lean = LeanLlama(pair.drafter) if pair.drafter is not None else None
    out: dict[str, dict] = {}
    for c in concurrency:
        n = len(prompts) if c > 1 else min(len(prompts), 4)
        for name, cfg in configs:
            tokens, seconds, rows, batches = 0, 0.0, 0, 0
            for start in range(0, n, c):  # cohorts of c requests
                engine = TargetEngine(pair.target, 2 << 30)
                reqs = [GenerationRequest(prompt_ids=ids[j % len(ids)], max_tokens=max_tokens,
                                          **cfg) for j in range(start, min(n, start + c))]
                t0 = time.perf_counter()
                states = run_lockstep(DrafterEngine(lean), engine, reqs, pair.eos_token_id)
                seconds += time.perf_counter() - t0
                tokens += sum(len(st.output) for st in states)
                rows, batches = rows + engine.rows_verified, batches + engine.forward_batches
            out.setdefault(str(c), {})[name] = {
                "aggregate_tokens_per_s": round(tokens / seconds, 2),
                "mean_batch_rows": round(rows / max(1, batches), 2)}
    return out


def _sum_lists(lists: list[list[int]]) -> list[int]:
    out: list[int] = []
    for lst in lists:
        out.extend([0] * (len(lst) - len(out)))
        for i, v in enumerate(lst):
            out[i] += v
    return out


def _single_process(target: str, drafter: str, prompts: list[str], ks: list[int],
                    max_tokens: int) -> dict:
    from specserve.api import GenerationRequest
    from specserve.engine.generator import SpeculativeGenerator
    from specserve.models.load import load_pair

    gen = SpeculativeGenerator(load_pair(target, drafter))
    out = {}
    for name, cfg in [("off", {"spec": "off", "k": 0})] + [
            (f"draft_k{k}", {"spec": "draft", "k": k}) for k in ks]:
        tokens, seconds = 0, 0.0
        for p in prompts:
            _, ids, st = gen.generate(GenerationRequest(prompt=p, max_tokens=max_tokens, **cfg))
            tokens += len(ids)
            seconds += st.total_s
        out[name] = round(tokens / seconds, 2)
    return out


def run_service_bench(
    server: str | Callable[..., Any], target: str, drafter: str, concurrency: list[int],
    ks: list[int], max_tokens: int, out_dir: Path, requests_per_level: int = 8,
    ngram_k: int = 4, only: list[str] | None = None, inprocess: bool = True,
    app_config: dict | None = None,
) -> dict:
    """``server``: HOST:PORT of a running service, or a function that starts one locally
    (``start_local(config, port=...)``; its router's round split, the replicas' side and
    the in-process reference are then reported too). ``only``: the configurations to run
    (names as in the report: off, draft_k2, ngram_k4, auto); spec-off always runs.
    ``app_config``: more of the started service's AppConfig (e.g. draft-ahead on)."""
    service = None
    router_stats = None
    if callable(server):
        service = server({"models": {"target": target, "drafter": drafter},
                          **(app_config or {})}, port=free_port())
        server = service.grpc_address
        router_stats, reset = service.router_stats, service.reset_router_stats
    prompts = heldout_prompts(n=max(requests_per_level, max(concurrency)))
    configs = [("off", {"spec": "off", "k": 0})]
    configs += [(f"draft_k{k}", {"spec": "draft", "k": k}) for k in ks]
    configs.append((f"ngram_k{ngram_k}", {"spec": "ngram", "k": ngram_k}))
    configs.append(("auto", {"spec": "auto", "k": max([*ks, ngram_k])}))  # k: its K_max
    if only:
        configs = [(n, c) for n, c in configs if n == "off" or n in only]
    levels: dict[str, dict] = {}
    total = sum(max(requests_per_level, 2 * c) for c in concurrency) * len(configs)
    bar = tqdm(total=total, desc="service bench", unit="req")
    try:
        with Client(server, timeout=600) as client:
            client.generate(prompts[0], max_tokens=8)  # warm-up
            for c in concurrency:
                n = max(requests_per_level, 2 * c)
                level = {}
                for name, cfg in configs:
                    if router_stats is not None:
                        reset()
                    def run(cfg=cfg, c=c, n=n) -> dict:
                        return _level(client, prompts, cfg, c, n, max_tokens, bar)

                    row = run() if service is None else _replica_side(service, run)
                    if router_stats is not None:
                        rs = router_stats()
                        row["router_round_split"] = {
                            k: rs[k] for k in ("round", "propose", "verify", "drafter_compute",
                                               "target_compute", "orchestration_overhead",
                                               "round_path")}
                    level[name] = row
                base = level["off"]
                for row in level.values():
                    row["speedup_vs_off"] = round(
                        row["aggregate_tokens_per_s"] / base["aggregate_tokens_per_s"], 3)
                    row["greedy_mismatches_vs_off"] = sum(
                        a != b for a, b in zip(row["outputs"], base["outputs"], strict=False))
                levels[str(c)] = level
        bar.close()
        single = None
        if 1 in concurrency:
            single = _single_process(target, drafter, prompts[:requests_per_level], ks,
                                     max_tokens)
            one = levels["1"]
            for k in ks:
                s_speed = single[f"draft_k{k}"] / single["off"]
                svc = one[f"draft_k{k}"]["speedup_vs_off"]
                one[f"draft_k{k}"]["single_process_speedup"] = round(s_speed, 3)
                one[f"draft_k{k}"]["fraction_of_single_process_speedup"] = round(
                    svc / s_speed, 3)
    finally:
        if service is not None:
            service.stop()
    if service is not None and inprocess:
        ref = _inprocess(target, drafter, prompts[: max(requests_per_level, max(concurrency))],
                         concurrency, configs, max_tokens, service.config.target.threads())
        for c, level in levels.items():
            for name, row in level.items():
                row["inprocess"] = ref[c][name]
                row["fraction_of_inprocess"] = round(
                    row["aggregate_tokens_per_s"] / ref[c][name]["aggregate_tokens_per_s"], 3)
    report = {
        "benchmark": "distributed service, closed loop, greedy, through the SDK",
        "server": server if service is None else "started by the bench (local Ray)",
        "pair": {"target": target, "drafter": drafter},
        "max_tokens": max_tokens, "levels": levels, "single_process_tokens_per_s": single,
        "app_config": app_config or {},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "service.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def summarize(report: dict) -> dict:
    """The report without the outputs, for printing."""
    return {c: {name: {k: v for k, v in row.items() if k != "outputs"}
                for name, row in level.items()} for c, level in report["levels"].items()}

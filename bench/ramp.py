"""Load-ramp benchmark of autoscaling by traffic (issue 12): pools and nodes follow the load.

    scripts/isolated .venv/bin/python bench/ramp.py --out DIR [--peak 16] [--minutes 3]

Starts a Ray cluster whose real autoscaler adds and removes (fake) nodes
(``deployments/nodes.py``), the service on it with autoscaling on for the Drafter and
Target pools (each replica needs a node of its pool: ``drafter_pool`` / ``target_pool``),
the Router fixed at 1, then a closed loop of SDK callers, concurrency 1 -> peak -> 1 in
steps. The peak is held until both pools have scaled up and the final level 1 until pools
and nodes are back where they started (each at least its share of ``--minutes``, at most
``--wait-max-s`` more), so the run measures what happened, never a guess of how long it takes.

Recorded: every request (start, end, TTFT, tokens, error, greedy output against spec-off
computed in process first) and, every ~1 s, RUNNING replicas per deployment (``serve.status``)
and alive nodes per node type (``ray.nodes``). Out: ``timeline.json`` (samples, requests,
phases), ``summary.json`` (time to scale up/down per pool and node type, latency, tok/s
per phase, failures, mismatches), ``ramp.png``, and the Serve controller's and the
autoscaler's logs under ``logs/``. Exit status 1 when a request failed or mismatched.

The program runs itself in its own PID namespace (and a loopback-only network namespace
unless already in one), so every process of its cluster ends with it.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from deployments.nodes import (  # noqa: E402
    free_port,
    in_private_namespaces,
    nodes_by_type,
    start_node_cluster,
)

APP = "specserve"
POOLS = {"Drafter": "drafter_node", "Target": "target_node"}  # deployment -> its node type
POOL_RESOURCE = {"Drafter": "drafter_pool", "Target": "target_pool"}


@dataclass
class Phase:
    name: str
    concurrency: int
    min_s: float
    max_s: float
    until: str | None = None  # "scaled_up" / "scaled_down": held until true (or max_s)


def ramp_plan(peak: int, minutes: float, wait_max_s: float) -> list[Phase]:
    """1, 2, 4, ... peak in equal steps (35 % of the time), the peak (25 %, until both
    pools scaled up and none of their replicas is STARTING), then back to 1 (40 %, until
    pools and nodes are back)."""
    total = minutes * 60.0
    levels = [1]
    while levels[-1] * 2 < peak:
        levels.append(levels[-1] * 2)
    step = 0.35 * total / len(levels)
    plan = [Phase("up", n, step, step) for n in levels]
    plan.append(Phase("peak", peak, 0.25 * total, 0.25 * total + wait_max_s, "scaled_up"))
    plan.append(Phase("drop", 1, 0.4 * total, 0.4 * total + wait_max_s, "scaled_down"))
    return plan


def app_config(args: argparse.Namespace, max_replicas: int) -> dict:
    """Autoscaling on for both pools (fast delays for a short run); Router fixed at 1."""
    def pool(name: str) -> dict:
        return {"min_replicas": 1, "max_replicas": max_replicas,
                "target_ongoing_requests": args.per_replica, "target_busy": 1.0,
                "upscale_delay_s": args.upscale_delay_s,
                "downscale_delay_s": args.downscale_delay_s,
                "look_back_period_s": 4.0, "metrics_interval_s": 1.0, "drain_s": 5.0,
                "num_cpus": 0.5, "resources": {POOL_RESOURCE[name]: 1.0}}

    return {"models": {"target": args.target, "drafter": args.drafter},
            "router": {"scaling": {"num_cpus": 0.2, "min_replicas": 1, "max_replicas": 1}},
            "drafter": {"scaling": pool("Drafter"), "session_idle_s": 5.0},
            "target": {"scaling": pool("Target"), "session_idle_s": 5.0}}


def node_types(max_replicas: int) -> dict[str, dict]:
    """One node type per pool, one replica per node; the nodes of the pools' min replicas
    (1) start with the cluster (KubeRay's ``minReplicas``), the rest on demand."""
    return {node: {"resources": {"CPU": 1, POOL_RESOURCE[dep]: 1}, "min_workers": 1,
                   "max_workers": max_replicas} for dep, node in POOLS.items()}


def references(target: str, drafter: str, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Spec-off greedy token ids of every prompt, in process (the expected outputs)."""
    import torch

    from specserve.api import GenerationRequest
    from specserve.engine.generator import SpeculativeGenerator
    from specserve.models.load import load_pair

    torch.set_num_threads(1)
    gen = SpeculativeGenerator(load_pair(target, drafter))
    return [gen.generate(GenerationRequest(prompt=p, max_tokens=max_tokens, spec="off"))[1]
            for p in prompts]


class LoadDriver:
    """Closed-loop SDK callers: worker i runs requests back to back while the level > i."""

    def __init__(self, address: str, prompts: list[str], refs: list[list[int]],
                 args: argparse.Namespace, t0: float):
        from specserve.client import Client

        self.client = Client(address, app_name=APP, timeout=300, retries=8, backoff=0.25)
        self.prompts, self.refs, self.args, self.t0 = prompts, refs, args, t0
        self.level, self.inflight, self.stopped = 0, 0, False
        self.records: list[dict] = []
        self.cond = threading.Condition()
        self.threads = [threading.Thread(target=self._worker, args=(i,), daemon=True)
                        for i in range(args.peak)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def set_level(self, n: int) -> None:
        with self.cond:
            self.level = n
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        for t in self.threads:
            t.join(timeout=360)
        self.client.close()

    def _worker(self, i: int) -> None:
        j = 0
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.stopped or self.level > i)
                if self.stopped:
                    return
                self.inflight += 1
            rec = self._request(i, (i * 7 + j) % len(self.prompts))
            with self.cond:
                self.inflight -= 1
                self.records.append(rec)
            j += 1

    def _request(self, worker: int, p: int) -> dict:
        from specserve.client import SpecServeError

        a = self.args
        start = time.monotonic()
        rec: dict[str, Any] = {"worker": worker, "prompt": p, "start": start - self.t0,
                               "ttft": None, "tokens": 0, "error": None, "mismatch": False}
        ids: list[int] = []
        try:
            for chunk in self.client.stream(self.prompts[p], max_tokens=a.max_tokens,
                                            spec=a.spec, k=a.k):
                if chunk.token_ids and rec["ttft"] is None:
                    rec["ttft"] = time.monotonic() - start
                ids.extend(chunk.token_ids)
        except SpecServeError as e:
            rec["error"] = f"{e.code.name}: {e.details}"
        rec["end"] = time.monotonic() - self.t0
        rec["tokens"] = len(ids)
        rec["mismatch"] = rec["error"] is None and ids != self.refs[p]
        return rec


def running_replicas() -> dict[str, dict[str, int]]:
    """Replica states per deployment, as Serve reports them."""
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None:
        return {}
    return {name: {str(getattr(s, "value", s)): n for s, n in d.replica_states.items()}
            for name, d in app.deployments.items()}


def queue_depths() -> dict[str, float]:
    """The router's view (one router replica): requests in flight there, and per target
    replica the rows its last reply said were queued and in its forward."""
    from ray import serve

    s = serve.get_deployment_handle("Router", APP).stats.remote().result(timeout_s=5)
    targets = s.get("targets", {}).values()
    return {"router_active": s.get("active", 0),
            "target_queued_rows": sum(t["queued_rows"] for t in targets),
            "target_batch_rows": sum(t["batch_rows"] for t in targets)}


class Sampler:
    """Every ``interval_s``: the load level, RUNNING replicas, alive nodes per type and the
    queue depths (``queue_depths``)."""

    def __init__(self, driver: LoadDriver, types: dict[str, dict], t0: float,
                 interval_s: float = 1.0):
        self.driver, self.types, self.t0, self.interval_s = driver, types, t0, interval_s
        self.samples: list[dict] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> dict:
        states = running_replicas()
        return {"t": round(time.monotonic() - self.t0, 3),
                "concurrency": self.driver.level, "inflight": self.driver.inflight,
                "replicas": {n: s.get("RUNNING", 0) for n, s in states.items()},
                "replica_states": states, "nodes": nodes_by_type(self.types),
                "queues": queue_depths()}

    def _loop(self) -> None:
        while not self.done.wait(self.interval_s):
            try:
                self.samples.append(self.sample())
            except Exception as e:  # a slow controller: skip this sample, keep going
                print(f"sample failed: {e!r}", file=sys.stderr)

    def latest(self) -> dict | None:
        return self.samples[-1] if self.samples else None


def conditions(initial: dict) -> dict[str, Callable[[dict], bool]]:
    """The events a phase may wait for, on one sample."""
    def up(s: dict) -> bool:  # both pools above their start, none still STARTING
        return all(s["replicas"].get(d, 0) > initial["replicas"][d]
                   and not s["replica_states"].get(d, {}).get("STARTING") for d in POOLS)

    def down(s: dict) -> bool:
        return (all(s["replicas"].get(d, 0) <= initial["replicas"][d] for d in POOLS)
                and all(s["nodes"].get(t, 0) <= initial["nodes"][t] for t in POOLS.values()))

    return {"scaled_up": up, "scaled_down": down}


def run_phases(plan: list[Phase], driver: LoadDriver, sampler: Sampler,
               initial: dict) -> list[dict]:
    """Drive the plan; returns each phase's window (start, end, level, whether its event
    happened)."""
    conds = conditions(initial)
    windows = []
    for ph in plan:
        driver.set_level(ph.concurrency)
        start = time.monotonic() - sampler.t0
        met = None
        print(f"[ramp] t={start:6.1f}s {ph.name} concurrency {ph.concurrency}", flush=True)
        while True:
            now = time.monotonic() - sampler.t0 - start
            s = sampler.latest()
            if ph.until is not None and s is not None and s["t"] > start:
                met = met or conds[ph.until](s)
            if now >= ph.max_s or (now >= ph.min_s and (ph.until is None or met)):
                break
            time.sleep(0.25)
        windows.append({**asdict(ph), "start": start,
                        "end": time.monotonic() - sampler.t0, "event_met": met})
    return windows


def _pct(values: list[float], q: float) -> float | None:
    import numpy as np

    return round(float(np.percentile(values, q)), 3) if values else None


def _latency(reqs: list[dict]) -> dict:
    ok = [r for r in reqs if r["error"] is None]
    lat = [r["end"] - r["start"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    return {"requests": len(reqs), "p50_s": _pct(lat, 50), "p99_s": _pct(lat, 99),
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99)}


def scale_times(series: list[tuple[float, int]], initial: int, rise_t: float,
                drop_t: float) -> dict:
    """From (t, count) samples: when the count first went above ``initial`` after
    ``rise_t`` (``up_s``) and first reached its peak (``peak_s``), and when (after
    ``drop_t``) it was back at ``initial`` for good (``down_s``)."""
    peak = max((c for _, c in series), default=initial)
    up_at = next((t for t, c in series if t >= rise_t and c > initial), None)
    peak_at = next((t for t, c in series if t >= rise_t and c == peak > initial), None)
    above = [t for t, c in series if c > initial]
    down_at = None
    if above and above[-1] >= drop_t:
        down_at = next((t for t, c in series if t > above[-1]), None)
    elif above or up_at is not None:
        down_at = drop_t  # back before the drop (would be odd; reported as 0)
    return {"initial": initial, "peak": peak,
            "up_at_s": up_at, "up_s": None if up_at is None else round(up_at - rise_t, 2),
            "peak_s": None if peak_at is None else round(peak_at - rise_t, 2),
            "down_at_s": down_at,
            "down_s": None if down_at is None else round(down_at - drop_t, 2)}


def _not_stopping(sample: dict, deployment: str) -> int:
    states = sample["replica_states"].get(deployment, {})
    return sum(n for state, n in states.items() if state != "STOPPING")


def summarize(samples: list[dict], requests: list[dict], windows: list[dict],
              args: argparse.Namespace, initial: dict) -> dict:
    """Time to scale up (from the first level above one replica's target: ``decided_s``
    Serve added a replica, ``up_s`` one more RUNNING) and down (from the drop to 1) per
    pool and node type; latency; per phase the latency of the requests started in it and
    the tokens/s of those that ended in it; failures and mismatches."""
    rise = next((w["start"] for w in windows if w["concurrency"] > args.per_replica),
                windows[0]["start"])
    drop = next(w["start"] for w in windows if w["name"] == "drop")
    pools = {d: scale_times([(s["t"], s["replicas"].get(d, 0)) for s in samples],
                            initial["replicas"][d], rise, drop) for d in POOLS}
    for d, p in pools.items():  # Serve's decision: a replica more, STARTING or RUNNING
        wanted = [(s["t"], _not_stopping(s, d)) for s in samples]
        at = next((t for t, c in wanted if t >= rise and c > p["initial"]), None)
        p["decided_s"] = None if at is None else round(at - rise, 2)
    nodes = {n: scale_times([(s["t"], s["nodes"].get(n, 0)) for s in samples],
                            initial["nodes"][n], rise, drop) for n in POOLS.values()}
    phases = []
    for w in windows:  # latency of the requests started in it, tok/s of those ended
        started = [r for r in requests if w["start"] <= r["start"] < w["end"]]
        ended = [r for r in requests if w["start"] <= r["end"] < w["end"]]
        secs = max(1e-9, w["end"] - w["start"])
        phases.append({"name": w["name"], "concurrency": w["concurrency"],
                       "start_s": round(w["start"], 2), "duration_s": round(secs, 2),
                       "event_met": w["event_met"], **_latency(started),
                       "tok_s": round(sum(r["tokens"] for r in ended) / secs, 2),
                       **_queues([x for x in samples if w["start"] <= x["t"] < w["end"]])})
    return {"load_rise_s": round(rise, 2), "load_drop_s": round(drop, 2),
            "pools": pools, "nodes": nodes, "latency": _latency(requests),
            "phases": phases, "requests": len(requests),
            "failed": sum(r["error"] is not None for r in requests),
            "mismatches": sum(bool(r["mismatch"]) for r in requests),
            "tokens": sum(r["tokens"] for r in requests),
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}


def _queues(samples: list[dict]) -> dict:
    """A phase's queue depths: mean target rows in forward, most rows queued at targets."""
    q = [x["queues"] for x in samples if x.get("queues")]
    if not q:
        return {"target_batch_rows_mean": None, "target_queued_rows_max": None}
    return {"target_batch_rows_mean": round(sum(x["target_batch_rows"] for x in q) / len(q), 2),
            "target_queued_rows_max": max(x["target_queued_rows"] for x in q)}


def tokens_per_s(requests: list[dict], end: float, bin_s: float = 5.0) -> tuple[list, list]:
    """Tokens completed per second in ``bin_s`` bins (by request end time)."""
    n = max(1, int(end // bin_s))  # whole bins only
    bins = [0.0] * n
    for r in requests:
        if r["end"] < n * bin_s:
            bins[int(r["end"] // bin_s)] += r["tokens"]
    return [i * bin_s + bin_s / 2 for i in range(n)], [b / bin_s for b in bins]


def plot(samples: list[dict], requests: list[dict], windows: list[dict], path: Path) -> None:
    """Top: concurrency and tok/s; middle: queue depths; bottom: RUNNING replicas per pool
    and nodes per type."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in samples]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(8, 7.2), sharex=True, dpi=90)
    top.step(t, [s["concurrency"] for s in samples], where="post", color="black",
             label="concurrency")
    top.set_ylabel("concurrency")
    rate = top.twinx()
    x, y = tokens_per_s(requests, t[-1] if t else 1.0)
    rate.plot(x, y, color="tab:green", label="tokens/s (5 s bins)")
    rate.set_ylabel("tokens/s")
    top.legend(loc="upper left", fontsize=8)
    rate.legend(loc="upper right", fontsize=8)
    for dep, node, color in (("Drafter", "drafter_node", "tab:blue"),
                             ("Target", "target_node", "tab:red")):
        bottom.step(t, [s["replicas"].get(dep, 0) for s in samples], where="post",
                    color=color, label=f"{dep} replicas (RUNNING)")
        bottom.step(t, [s["nodes"].get(node, 0) + 0.06 for s in samples], where="post",
                    color=color, linestyle="--", alpha=0.7, label=f"{node} nodes")
    for w in windows:
        bottom.axvline(w["start"], color="grey", linewidth=0.5)
    top.set_ylim(0, max((s["concurrency"] for s in samples), default=1) + 1)
    top.yaxis.get_major_locator().set_params(integer=True)
    rate.set_ylim(0, max(y, default=1) * 1.15)
    middle.step(t, [s.get("queues", {}).get("target_batch_rows", 0) for s in samples],
                where="post", color="tab:purple", label="target rows in forward (all)")
    middle.step(t, [s.get("queues", {}).get("target_queued_rows", 0) for s in samples],
                where="post", color="tab:orange", label="target rows queued (all)")
    middle.step(t, [s.get("queues", {}).get("router_active", 0) for s in samples],
                where="post", color="grey", linestyle=":", label="requests in the router")
    middle.set_ylabel("rows / requests")
    middle.legend(loc="upper left", fontsize=7, ncol=3)
    most = max((max(s["replicas"].get(d, 0), s["nodes"].get(n, 0))
                for s in samples for d, n in POOLS.items()), default=1)
    bottom.set_ylim(0, most + 0.8)
    bottom.yaxis.get_major_locator().set_params(integer=True)
    bottom.set_ylabel("replicas / nodes")
    bottom.set_xlabel("seconds")
    bottom.legend(loc="upper left", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def wait_initial(types: dict[str, dict], timeout_s: float = 300) -> dict:
    """Wait until each pool has its min replicas RUNNING; the starting counts."""
    deadline = time.monotonic() + timeout_s
    while True:
        reps = {n: s.get("RUNNING", 0) for n, s in running_replicas().items()}
        if all(reps.get(d, 0) >= 1 for d in POOLS) or time.monotonic() > deadline:
            return {"replicas": {d: reps.get(d, 0) for d in POOLS},
                    "nodes": nodes_by_type(types)}
        time.sleep(0.5)


def copy_logs(out: Path) -> None:
    """Serve's logs (controller, replicas) and the autoscaler's, for the record."""
    import shutil

    import ray

    if not ray.is_initialized():
        return
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    dest = out / "logs"
    dest.mkdir(parents=True, exist_ok=True)
    for pattern in ("serve/*.log", "monitor.*"):
        for f in logs.glob(pattern):
            shutil.copy(f, dest / f.name)


def start_service(gcs: str, args: argparse.Namespace):
    """Connect to the node cluster and start the service on it; Serve's proxy on the head
    only (every fake node is 127.0.0.1: a proxy per node would fight for the port)."""
    import ray
    from ray import serve

    from deployments.local import SERVICER_FUNCTIONS, start_local

    ray.init(address=gcs, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    port, http_port = free_port(), free_port()
    serve.start(proxy_location="HeadOnly",
                http_options={"host": "127.0.0.1", "port": http_port},
                grpc_options={"port": port, "grpc_servicer_functions": SERVICER_FUNCTIONS})
    return start_local(app_config(args, args.max_replicas), port=port, http_port=http_port)


def ramp(args: argparse.Namespace, out: Path) -> dict:
    """The whole run; writes timeline.json, summary.json, ramp.png; returns the summary."""
    from specserve.models.corpus import heldout_prompts

    types = node_types(args.max_replicas)
    began = time.monotonic()
    gcs, stop_cluster = start_node_cluster(types, {"CPU": 2}, idle_timeout_s=args.idle_s)
    print(f"[ramp] head up at {gcs} in {time.monotonic() - began:.1f} s", flush=True)
    svc = None
    try:  # the expected outputs while the pools' first nodes start
        prompts = heldout_prompts(n=args.prompts)
        refs = references(args.target, args.drafter, prompts, args.max_tokens)
        print(f"[ramp] references at {time.monotonic() - began:.1f} s", flush=True)
        svc = start_service(gcs, args)
        initial = wait_initial(types)
        print(f"[ramp] service up at {time.monotonic() - began:.1f} s: {initial}", flush=True)
        t0 = time.monotonic()
        driver = LoadDriver(svc.grpc_address, prompts, refs, args, t0)
        sampler = Sampler(driver, types, t0)
        sampler.thread.start()
        driver.start()
        try:
            windows = run_phases(ramp_plan(args.peak, args.minutes, args.wait_max_s),
                                 driver, sampler, initial)
        finally:
            driver.stop()
            sampler.done.set()
            sampler.thread.join()
    finally:
        copy_logs(out)
        if svc is not None:
            svc.stop()
        stop_cluster()
    (out / "timeline.json").write_text(json.dumps(
        {"initial": initial, "phases": windows, "samples": sampler.samples,
         "requests": driver.records}, indent=1))
    print(f"[ramp] stopped at {time.monotonic() - began:.1f} s", flush=True)
    summary = summarize(sampler.samples, driver.records, windows, args, initial)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(sampler.samples, driver.records, windows, out / "ramp.png")
    return summary


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--target", default="builtin-target")
    p.add_argument("--drafter", default="builtin-drafter")
    p.add_argument("--peak", type=int, default=16, help="highest concurrency")
    p.add_argument("--minutes", type=float, default=3.0, help="planned length of the ramp")
    p.add_argument("--wait-max-s", type=float, default=120.0, help="longest extra hold of "
                   "the peak (until scaled up) and of the end (until scaled down)")
    p.add_argument("--max-replicas", type=int, default=3, help="per pool (and nodes per type)")
    p.add_argument("--per-replica", type=float, default=6.0,
                   help="target_ongoing_requests of both pools (sessions per replica)")
    p.add_argument("--upscale-delay-s", type=float, default=2.0)
    p.add_argument("--downscale-delay-s", type=float, default=10.0)
    p.add_argument("--idle-s", type=float, default=10.0, help="idle node timeout")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--spec", default="draft", choices=["draft", "auto", "ngram", "off"])
    p.add_argument("--k", type=int, default=2)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    in_private_namespaces()  # returns only inside the namespaces
    args.out.mkdir(parents=True, exist_ok=True)
    s = ramp(args, args.out)
    brief = {k: s[k] for k in ("pools", "nodes", "latency", "requests", "failed",
                               "mismatches")}
    print(json.dumps(brief, indent=1))
    return 1 if s["failed"] or s["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""More live sessions than the target's KV budget holds: does throughput hold or collapse?

    scripts/isolated .venv/bin/python bench/kv_pressure.py --out DIR [--concurrency 32]
        [--spec off] [--cache-bytes N] [--wall-s 300]

Starts the local service (bench pair), then a closed loop of ``--concurrency`` SDK callers
over the code-long prompts (prompt + 128 tokens: the target's pool grows to 640 positions,
~15 MiB a session in float32, so the default 512 MiB budget holds 34 sessions; before the
pool grew by a quarter it doubled to 1024 and held 21: ``--cache-bytes 335544320`` puts this
load back over the budget). Stops after
``--requests`` requests or ``--wall-s`` seconds, whichever comes first, and reports
aggregate tokens/s, requests done, latency, and the target's cache counters (misses,
evictions, rows that waited for KV room, preemptions). Run it on two checkouts to compare:

    PYTHONPATH=/tmp/before .venv/bin/python bench/kv_pressure.py --out DIR/before
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--wall-s", type=float, default=300.0)
    ap.add_argument("--spec", default="off", choices=["off", "draft", "ngram", "auto"])
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--cache-bytes", type=int, default=None, help="target KV budget")
    ap.add_argument("--admit-wait-s", type=float, default=None, help="target.admit_wait_s")
    args = ap.parse_args()
    if args.concurrency < 1 or args.requests < 1 or args.wall_s <= 0:
        ap.error("--concurrency and --requests must be >= 1, --wall-s > 0")

    from deployments.local import start_local
    from deployments.nodes import free_port
    from specserve.bench.workloads import builtin_workloads
    from specserve.client import Client

    prompts = builtin_workloads()["code-long"]
    target = {k: v for k, v in (("cache_bytes", args.cache_bytes),
                                ("admit_wait_s", args.admit_wait_s)) if v is not None}
    service = start_local({"models": {"target": "bench-target", "drafter": "bench-drafter"},
                           "target": target}, port=free_port())
    from ray import serve

    handle = serve.get_deployment_handle("Target", "specserve")
    try:
        with Client(service.grpc_address, timeout=900) as client:
            client.generate(prompts[0].text, max_tokens=8)  # warm-up
            before = handle.stats.remote().result()
            done = _closed_loop(client, prompts, args)
            after = handle.stats.remote().result()
    finally:
        service.stop()
    wall = done.pop("wall_s")
    keys = ("misses", "evictions", "kv_waited", "kv_preempted", "forward_batches",
            "rows_verified")
    report = {
        "concurrency": args.concurrency, "spec": args.spec, "wall_s": round(wall, 1),
        "requests_done": len(done["latencies"]), "errors": done["errors"],
        "aggregate_tokens_per_s": round(done["tokens"] / wall, 2),
        "latency_s_p50": _pct(done["latencies"], 50),
        "latency_s_max": round(max(done["latencies"], default=0.0), 2),
        "target": {k: after.get(k, 0) - before.get(k, 0) for k in keys},
        "target_budget_bytes": after.get("budget_bytes"),
        "rows_per_forward": round((after["rows_verified"] - before["rows_verified"])
                                  / max(after["forward_batches"] - before["forward_batches"],
                                        1), 2),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_pressure.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


def _closed_loop(client, prompts, args) -> dict:
    lock = threading.Lock()
    nxt = iter(range(args.requests))
    out: dict = {"tokens": 0, "latencies": [], "errors": []}
    deadline = time.monotonic() + args.wall_s

    def worker() -> None:
        while time.monotonic() < deadline:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            p = prompts[i % len(prompts)]
            t0 = time.monotonic()
            try:
                res = client.generate(p.text, max_tokens=p.max_tokens, spec=args.spec,
                                      k=0 if args.spec == "off" else args.k,
                                      timeout=max(deadline - t0, 1.0))
            except Exception as e:  # a request still running at the wall counts as not done
                with lock:
                    out["errors"].append(f"{type(e).__name__}: {str(e)[:120]}")
                continue
            with lock:
                out["tokens"] += len(res.token_ids)
                out["latencies"].append(time.monotonic() - t0)

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        for _ in range(args.concurrency):
            pool.submit(worker)
    out["wall_s"] = time.monotonic() - t0
    return out


def _pct(values: list[float], q: float) -> float:
    import numpy as np

    return round(float(np.percentile(values, q)), 2) if values else 0.0


if __name__ == "__main__":
    sys.exit(main())

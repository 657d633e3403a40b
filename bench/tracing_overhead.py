"""Throughput with tracing at 100 % sampling vs tracing off, interleaved in one run.

    scripts/isolated .venv/bin/python bench/tracing_overhead.py --service [--trials 10]
    scripts/isolated .venv/bin/python bench/tracing_overhead.py [--trials 10] [--record-only]

``--service``: the real service on a local Ray cluster with two identical apps, one with
tracing off and one whose replicas (router, drafter, target: separate processes) export
every span over OTLP/gRPC to a receiver in a separate process; trials alternate between the
apps (ABBA), driven through the SDK at ``--concurrency``; also reports the CPU time per token
of each app's three replica processes (Serve's proxy and the receiver not included).

Without ``--service`` (the stress case): the router's round loop runs in this process
against real drafter and target gRPC servers on loopback (``router/inprocess.py``: the
per-round code of the Serve deployment), so the span work of all three components and the
exporter thread share one process and its GIL. "on" = every request sampled
(``parentbased_always_on``), spans exported over OTLP/gRPC by a ``BatchSpanProcessor`` to a
receiver in a separate process that counts them; "off" = no exporter configured (the
default). Trials alternate off/on in ABBA order over the same prompts; each "on" trial
includes flushing its spans; greedy outputs must be identical. This mode also prints the
CPU time per token (this process, all threads, plus the receiver's: on a shared machine
other jobs move the wall clock much more than our own CPU seconds).

Prints tokens/s of each mode and the ratio; writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

log = logging.getLogger("tracing_overhead")


def _receiver() -> None:
    """``--receiver``: an OTLP/gRPC trace receiver that counts spans; prints its port, and the
    count when stdin closes."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import (
        trace_service_pb2,
        trace_service_pb2_grpc,
    )

    count = [0]

    class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            count[0] += sum(len(ss.spans) for rs in request.resource_spans
                            for ss in rs.scope_spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    sys.stdout.write(f"{port}\n")
    sys.stdout.flush()
    sys.stdin.read()
    server.stop(None)
    sys.stdout.write(f"{count[0]}\n")
    sys.stdout.flush()


def _proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int | None) -> float:
    """CPU seconds of this process (all threads) plus the receiver process ``pid``."""
    return time.process_time() + (_proc_cpu_s(pid) if pid is not None else 0.0)


def _replica_pids(app: str) -> list[int]:
    """The processes of ``app``'s three replicas (one each)."""
    from ray import serve

    return [serve.get_deployment_handle(name, app).pid.remote().result()
            for name in ("Router", "Drafter", "Target")]


async def _trial(svc, reqs, concurrency: int,
                 receiver_pid: int | None) -> tuple[float, float, int, list[list[int]]]:
    sem = asyncio.Semaphore(concurrency)

    async def one(req) -> list[int]:
        async with sem:
            chunks = await svc.generate(req)
            return [t for c in chunks for t in c.token_ids]

    from specserve import tracing

    c0, t0 = _cpu_s(receiver_pid), time.perf_counter()
    outs = await asyncio.gather(*(one(r) for r in reqs))
    tracing.force_flush()  # the "on" trial pays for exporting its spans
    dt = time.perf_counter() - t0
    time.sleep(0.05)  # let the receiver finish decoding the last export
    return dt, _cpu_s(receiver_pid) - c0, sum(len(o) for o in outs), outs


async def _main(args: argparse.Namespace, port: int, receiver_pid: int) -> dict:
    import torch

    from router.inprocess import start_inprocess
    from specserve import tracing
    from specserve.api import GenerationRequest
    from specserve.models.corpus import heldout_prompts
    from specserve.models.load import load_pair

    torch.set_num_threads(1)
    pair = load_pair(args.target, args.drafter)
    prompts = heldout_prompts(n=args.requests)
    reqs = [GenerationRequest(prompt=p, max_tokens=args.max_tokens, spec="draft", k=args.k)
            for p in prompts]
    assert tracing.setup_tracing("specserve-bench", endpoint=f"http://127.0.0.1:{port}")
    provider = tracing.provider()
    modes = {"off": None, "on": provider}
    if args.record_only:  # spans created and batched, then dropped: the cost without export
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            SpanExporter,
            SpanExportResult,
        )

        class Drop(SpanExporter):
            def export(self, spans):
                return SpanExportResult.SUCCESS

        modes["record"] = TracerProvider(resource=provider.resource)
        modes["record"].add_span_processor(BatchSpanProcessor(Drop()))
    svc = await start_inprocess(pair)
    results: dict[str, list[float]] = {m: [] for m in modes}
    cpu_ms: dict[str, list[float]] = {m: [] for m in modes}  # CPU ms per token
    reference: list[list[int]] | None = None
    order = list(modes)
    try:
        for mode in order:  # warm-up, not counted
            tracing.use_provider(modes[mode], shutdown_previous=False)
            await _trial(svc, reqs, args.concurrency, receiver_pid)
        for i in range(args.trials):
            for mode in (order if i % 2 == 0 else order[::-1]):
                tracing.use_provider(modes[mode], shutdown_previous=False)
                dt, cpu, tokens, outs = await _trial(svc, reqs, args.concurrency,
                                                     receiver_pid)
                reference = reference or outs
                assert outs == reference, "outputs differ between trials"
                results[mode].append(tokens / dt)
                cpu_ms[mode].append(1000 * cpu / tokens)
                log.info("trial %d %-6s %6.1f tok/s  %.2f CPU-ms/token", i, mode, tokens / dt,
                         1000 * cpu / tokens)
    finally:
        tracing.use_provider(None, shutdown_previous=False)
        await svc.close()
        provider.shutdown()
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    pairs = [b / a for a, b in zip(results["off"], results["on"], strict=True)]
    cpu = {m: statistics.median(v) for m, v in cpu_ms.items()}
    extra = {}
    if "record" in results:
        rec = statistics.median(results["record"])
        extra = {"tokens_per_s_record_only": results["record"], "median_record_only": rec,
                 "ratio_record_only_off": round(rec / off, 4),
                 "cpu_overhead_pct_record_only": round(100 * (cpu["record"] / cpu["off"] - 1),
                                                       2)}
    return {**extra, "setting": "in process", "target": args.target, "drafter": args.drafter,
            "cpu_ms_per_token": cpu_ms,
            "median_cpu_ms_per_token": {m: round(v, 4) for m, v in cpu.items()},
            "cpu_overhead_pct": round(100 * (cpu["on"] / cpu["off"] - 1), 2),
        "trials": args.trials, "requests_per_trial": len(reqs), "max_tokens": args.max_tokens,
        "k": args.k, "concurrency": args.concurrency,
        "tokens_per_trial": sum(len(o) for o in reference or []),
        "tokens_per_s_off": results["off"], "tokens_per_s_on": results["on"],
        "median_off": round(off, 2), "median_on": round(on, 2),
        "ratio_on_off": round(on / off, 4),
        "median_pairwise_ratio": round(statistics.median(pairs), 4),
        "overhead_pct": round(100 * (1 - on / off), 2),
    }


def _service_main(args: argparse.Namespace, port: int) -> dict:
    """``--service``: the real service on a local Ray cluster, two identical apps: "specserve"
    (tracing off) and "specserve-traced" (every replica exports OTLP to the receiver);
    trials alternate between them, driven through the SDK."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from ray import serve

    from deployments.app import build_app
    from deployments.local import start_local
    from specserve.client import Client
    from specserve.models.corpus import heldout_prompts
    from specserve.ports import free_port

    grpc_port = free_port()
    models = {"target": args.target, "drafter": args.drafter}
    svc = start_local(models, port=grpc_port, num_cpus=4)
    apps = {"off": "specserve", "on": "specserve-traced"}
    prompts = heldout_prompts(n=args.requests)
    results: dict[str, list[float]] = {"off": [], "on": []}
    cpu_ms: dict[str, list[float]] = {"off": [], "on": []}  # the app's replicas, per token
    reference: dict[str, list[list[int]]] = {}
    try:
        serve.run(build_app({**models, "otlp_endpoint": f"http://127.0.0.1:{port}",
                             "redis_url": svc.redis_url}),
                  name=apps["on"], route_prefix=f"/{apps['on']}")
        local = threading.local()

        def one(app: str, prompt: str) -> list[int]:
            key = f"client_{app}"
            if not hasattr(local, key):
                setattr(local, key, Client(svc.grpc_address, timeout=600, app_name=app))
            res = getattr(local, key).generate(prompt, max_tokens=args.max_tokens,
                                               spec="draft", k=args.k)
            return res.token_ids

        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            pids = {m: _replica_pids(a) for m, a in apps.items()}

            def trial(mode: str) -> tuple[float, float, list[list[int]]]:
                c0 = sum(_proc_cpu_s(p) for p in pids[mode])
                t0 = time.perf_counter()
                outs = list(pool.map(lambda p: one(apps[mode], p), prompts))
                dt = time.perf_counter() - t0
                return dt, sum(_proc_cpu_s(p) for p in pids[mode]) - c0, outs

            for mode in ("off", "on"):  # warm-up
                trial(mode)
            for i in range(args.trials):
                for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
                    dt, cpu, outs = trial(mode)
                    reference.setdefault("ref", outs)
                    assert outs == reference["ref"], "outputs differ between trials"
                    tokens = sum(len(o) for o in outs)
                    results[mode].append(tokens / dt)
                    cpu_ms[mode].append(1000 * cpu / tokens)
                    log.info("trial %d %-3s %6.1f tok/s  %.2f replica CPU-ms/token", i, mode,
                             tokens / dt, 1000 * cpu / tokens)
        time.sleep(8)  # the replicas' span batches (5 s schedule) reach the receiver
    finally:
        svc.stop()
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    pairs = [b / a for a, b in zip(results["off"], results["on"], strict=True)]
    return {
        "setting": "service (local Ray cluster, two identical apps)",
        "target": args.target, "drafter": args.drafter,
        "trials": args.trials, "requests_per_trial": len(prompts),
        "max_tokens": args.max_tokens, "k": args.k, "concurrency": args.concurrency,
        "tokens_per_s_off": results["off"], "tokens_per_s_on": results["on"],
        "median_off": round(off, 2), "median_on": round(on, 2),
        "ratio_on_off": round(on / off, 4),
        "median_pairwise_ratio": round(statistics.median(pairs), 4),
        "overhead_pct": round(100 * (1 - on / off), 2),
        "cpu_ms_per_token": cpu_ms,
        "median_cpu_ms_per_token": {m: round(statistics.median(v), 4)
                                    for m, v in cpu_ms.items()},
        "cpu_overhead_pct": round(100 * (statistics.median(cpu_ms["on"])
                                         / statistics.median(cpu_ms["off"]) - 1), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--service", action="store_true",
                    help="measure the real service (local Ray cluster) instead of in process")
    ap.add_argument("--trials", type=int, default=10, help="off/on pairs")
    ap.add_argument("--requests", type=int, default=8, help="requests per trial")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--target", default="builtin-target",
                    help="e.g. bench-target: the cost-scaled target of docs/benchmarks.md")
    ap.add_argument("--drafter", default="builtin-drafter")
    ap.add_argument("--record-only", action="store_true",
                    help="in process: also a third mode, spans recorded but not exported")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON results (default bench-results/tracing_overhead[_service].json)")
    args = ap.parse_args()
    if args.receiver:
        _receiver()
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    out = args.out or Path("bench-results") / (
        "tracing_overhead_service.json" if args.service else "tracing_overhead.json")
    recv = subprocess.Popen([sys.executable, __file__, "--receiver"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(recv.stdout.readline())
        res = (_service_main(args, port) if args.service
               else asyncio.run(_main(args, port, recv.pid)))
    finally:
        recv.stdin.close()
        spans = recv.stdout.readline().strip()
        recv.wait(timeout=30)
    res["spans_received"] = int(spans or 0)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    summary = (f"tokens/s: tracing off {res['median_off']}, on (100% sampled, OTLP) "
               f"{res['median_on']}; ratio on/off {res['ratio_on_off']} (overhead "
               f"{res['overhead_pct']}%); median pairwise ratio "
               f"{res['median_pairwise_ratio']}; {res['spans_received']} spans received")
    if "cpu_overhead_pct" in res:
        summary += (f"; CPU per token {res['median_cpu_ms_per_token']} ms (tracing adds "
                    f"{res['cpu_overhead_pct']}%)")
    if "ratio_record_only_off" in res:
        summary += f"; recorded, not exported: ratio {res['ratio_record_only_off']}"
    sys.stdout.write(summary + "\n")


if __name__ == "__main__":
    main()

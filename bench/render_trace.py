"""Render the spans of one real request as a tree (the trace shown in docs/observability.md).

    scripts/isolated .venv/bin/python bench/render_trace.py [--max-tokens 16] [--k 4]
        [--drop-caches-after 2]

Runs the request through the router's round loop against real drafter and target gRPC
servers in this process (``router/inprocess.py``), captures every span with an in-memory
exporter and prints: name, start offset and duration in ms, and the key attributes.
``--drop-caches-after N`` drops both replicas' caches after N rounds (a forced cache miss).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

KEYS = {
    "generate": ("specserve.spec", "specserve.k", "specserve.prompt_tokens",
                 "specserve.output_tokens", "specserve.rounds", "specserve.accepted_tokens",
                 "specserve.draft_tokens", "specserve.mean_acceptance_length",
                 "specserve.finish_reason", "specserve.cache_misses",
                 "specserve.drafter_replica", "specserve.target_replica",
                 "specserve.target_revision", "specserve.drafter_revision"),
    "round": ("specserve.k", "specserve.drafted", "specserve.accepted",
              "specserve.extra_token", "specserve.committed_len", "specserve.batch_size",
              "specserve.drafter_rolled_back", "specserve.target_rolled_back"),
    "propose": ("specserve.tokens_sent", "specserve.cache_miss"),
    "verify": ("specserve.tokens_sent", "specserve.cache_miss"),
    "cache_repair": ("specserve.component", "specserve.cache", "specserve.rolled_back",
                     "specserve.reprefilled", "specserve.fed"),
    "drafter.propose": ("specserve.drafted", "specserve.cache", "specserve.rolled_back",
                        "specserve.fed", "specserve.compute_us"),
    "target.verify_row": ("specserve.accepted", "specserve.cache", "specserve.batch_size",
                          "specserve.rolled_back", "specserve.fed"),
    "target.batch_forward": ("specserve.batch_size", "specserve.compute_us"),
}


def _short(key: str, value: object) -> str:
    k = key.removeprefix("specserve.")
    if isinstance(value, float):
        value = round(value, 3)
    if isinstance(value, str) and len(value) > 16:
        value = value[:12] + "…"
    return f"{k}={value}"


def render(spans) -> str:
    by_parent: dict[int | None, list] = {}
    ids = {s.context.span_id for s in spans}
    for s in spans:
        parent = s.parent.span_id if s.parent is not None and s.parent.span_id in ids else None
        by_parent.setdefault(parent, []).append(s)
    t0 = min(s.start_time for s in spans)
    lines: list[str] = []

    def walk(parent: int | None, depth: int) -> None:
        for s in sorted(by_parent.get(parent, []), key=lambda x: (x.start_time, x.name)):
            attrs = " ".join(_short(k, s.attributes[k]) for k in KEYS.get(s.name, ())
                             if k in s.attributes)
            links = f" links={len(s.links)}" if s.links else ""
            start, dur = (s.start_time - t0) / 1e6, (s.end_time - s.start_time) / 1e6
            lines.append(f"{'  ' * depth}{s.name:<{max(1, 24 - 2 * depth)}} "
                         f"+{start:7.2f} ms {dur:7.2f} ms  {attrs}{links}".rstrip())
            walk(s.context.span_id, depth + 1)

    walk(None, 0)
    return "\n".join(lines)


async def _run(args: argparse.Namespace):
    import torch
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from router.inprocess import start_inprocess
    from specserve import tracing
    from specserve.api import GenerationRequest
    from specserve.models.load import load_pair

    torch.set_num_threads(1)
    exporter = InMemorySpanExporter()
    tracing.setup_tracing("specserve", exporter=exporter)
    svc = await start_inprocess(load_pair("builtin-target", "builtin-drafter"))
    try:
        req = GenerationRequest(prompt=args.prompt, max_tokens=args.max_tokens, spec="draft",
                                k=args.k)
        await svc.generate(req, "warm-up")  # first-call costs out of the picture
        exporter.clear()
        n = 0
        async for _ in svc.router.generate(req, "doc-request-1"):
            n += 1
            if n == args.drop_caches_after:
                for engine in (svc.target, svc.drafter):
                    for sid in list(engine._sessions):
                        engine.release(sid)
    finally:
        await svc.close()
    return exporter.get_finished_spans()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", default="def read_config(path):\n")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--drop-caches-after", type=int, default=0)
    args = ap.parse_args()
    sys.stdout.write(render(asyncio.run(_run(args))) + "\n")


if __name__ == "__main__":
    main()

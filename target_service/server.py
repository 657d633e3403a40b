"""The target replica's gRPC server: a bidi ``Verify`` stream per router, one batcher.

Every Verify message from every open stream goes into one queue; the batcher takes what is
there (waiting up to ``batch_wait_s`` for more when other sessions are active) and runs one
``TargetEngine.verify`` over all of them in a worker thread, so concurrent requests share a
forward pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from specserve import tracing
from specserve.engine.target import TargetEngine
from specserve.proto_gen.specserve.v1 import internal_pb2 as pb
from specserve.proto_gen.specserve.v1 import internal_pb2_grpc as pb_grpc
from specserve.service.wire import verify_item_from_proto, verify_outcome_to_proto

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from specserve.service.metrics import TargetBatchMetrics

log = logging.getLogger(__name__)
_Row = tuple[pb.VerifyRequest, asyncio.Queue, "Span | None"]  # a message, its stream, its span


@dataclass
class TargetMetrics:
    batches: int = 0
    rows: int = 0
    max_batch: int = 0
    batch_sizes: list[int] = field(default_factory=list)

    def observe(self, n: int) -> None:
        self.batches += 1
        self.rows += n
        self.max_batch = max(self.max_batch, n)
        self.batch_sizes.append(n)
        del self.batch_sizes[:-1000]


class TargetServicer(pb_grpc.TargetServicer):
    def __init__(self, engine: TargetEngine, replica: str, max_batch: int = 32,
                 batch_wait_s: float = 0.002, prometheus: TargetBatchMetrics | None = None):
        self.engine = engine
        self.replica = replica
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self.metrics = TargetMetrics()
        self.prometheus = prometheus  # Ray metrics (Serve deployment only)
        self._queue: asyncio.Queue[_Row] = asyncio.Queue()
        self._active: dict[str, float] = {}  # session -> last seen (for the batching wait)
        self._batcher: asyncio.Task | None = None

    def start(self) -> None:
        self._batcher = asyncio.get_running_loop().create_task(self._run())

    async def Verify(self, request_iterator, context):
        replies: asyncio.Queue = asyncio.Queue()

        async def pump() -> None:
            async for msg in request_iterator:
                if msg.release:
                    self.engine.release(msg.session_id)
                    self._active.pop(msg.session_id, None)
                    continue
                self._active[msg.session_id] = time.monotonic()
                tracer = tracing.tracer()
                span = None
                if tracer is not None:  # a span per row, from arrival to reply
                    from opentelemetry.trace import SpanKind

                    span = tracer.start_span(
                        "target.verify_row", kind=SpanKind.SERVER,
                        context=tracing.context_from_traceparent(msg.traceparent))
                await self._queue.put((msg, replies, span))
            await replies.put(None)

        reader = asyncio.get_running_loop().create_task(pump())
        try:
            while (reply := await replies.get()) is not None:
                yield reply
        finally:
            reader.cancel()

    def _expected_rows(self) -> int:
        now = time.monotonic()
        for sid in [s for s, t in self._active.items() if now - t > 1.0]:
            del self._active[sid]
        return len(self._active)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            deadline = loop.time() + self.batch_wait_s
            # Wait briefly for the other active sessions' rounds to arrive.
            while len(batch) < min(self.max_batch, self._expected_rows()):
                try:
                    batch.append(self._queue.get_nowait())
                    continue
                except asyncio.QueueEmpty:
                    pass
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    batch.append(await asyncio.wait_for(self._queue.get(), remaining))
            while len(batch) < self.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            await self._serve(batch)

    async def _serve(self, batch: list[_Row]) -> None:
        items, errors = [], {}
        for i, (msg, _, _) in enumerate(batch):
            try:
                items.append(verify_item_from_proto(msg))
            except ValueError as e:
                errors[i] = str(e)
        good = [i for i in range(len(batch)) if i not in errors]
        outcomes = {}
        compute_us = 0
        if items:
            fspan = _batch_span(batch, len(items)) if tracing.tracer() is not None else None
            try:
                t0 = time.perf_counter()
                results = await asyncio.to_thread(self.engine.verify, items)
                compute_us = int((time.perf_counter() - t0) * 1e6)
                outcomes = dict(zip(good, results, strict=True))
                self.metrics.observe(len(items))
                if fspan is not None and fspan.is_recording():
                    fspan.set_attributes({  # rows in the forward (cache misses skip it)
                        "specserve.batch_size": max(o.batch_size for o in results),
                        "specserve.compute_us": compute_us})
                if self.prometheus is not None:
                    self.prometheus.batch(len(items), compute_us / 1e6)
            except Exception as e:  # a bad row must not take the replica down
                log.exception("verify batch failed")
                # "unavailable: ..." (a failed tensor-parallel group) is passed on as is: the
                # router leases another replica and resends the tokens
                text = str(e) if str(e).startswith("unavailable:") else f"verify failed: {e}"
                errors.update({i: text for i in good})
            finally:
                if fspan is not None:
                    fspan.end()
        for i, (msg, replies, span) in enumerate(batch):
            if i in errors:
                reply = pb.VerifyReply(call_id=msg.call_id, error=errors[i],
                                       replica=self.replica)
            else:
                reply = verify_outcome_to_proto(outcomes[i], msg.call_id, self.replica,
                                                compute_us)
            if span is not None:
                _end_row_span(span, msg, reply)
            await replies.put(reply)


def _batch_span(batch: list[_Row], rows: int) -> Span | None:
    """The batch forward's span: linked to every row's span (the requests it served), a child
    of the first sampled row so it is kept exactly when some request is traced."""
    from opentelemetry import trace

    tracer = tracing.tracer()
    spans = [s for _, _, s in batch if s is not None]
    sampled = [s for s in spans if s.get_span_context().trace_flags.sampled]
    if tracer is None or not sampled:
        return None
    return tracer.start_span(
        "target.batch_forward", context=trace.set_span_in_context(sampled[0]),
        links=[trace.Link(s.get_span_context()) for s in spans],
        attributes={"specserve.rows": rows})


def _end_row_span(span: Span, msg: pb.VerifyRequest, reply: pb.VerifyReply) -> None:
    if span.is_recording():
        rep = reply.repair
        span.set_attributes({  # few (each costs); the replica id: a resource attribute
            "specserve.drafted": len(msg.draft_tokens), "specserve.accepted": reply.num_accepted,
            "specserve.batch_size": reply.batch_size,
            "specserve.cache": "miss" if reply.cache_miss else "hit",
            "specserve.rolled_back": rep.cached_before - rep.kept, "specserve.fed": rep.fed,
            "specserve.compute_us": reply.compute_us})
        if reply.error:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, reply.error))
    span.end()


async def start_target_server(engine: TargetEngine, host: str = "127.0.0.1", port: int = 0,
                              replica: str = "target", **kw) -> tuple[grpc.aio.Server, int,
                                                                      TargetServicer]:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    servicer = TargetServicer(engine, replica, **kw)
    pb_grpc.add_TargetServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    servicer.start()
    return server, bound, servicer

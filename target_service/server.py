"""The target replica's gRPC server: a bidi ``Verify`` stream per router, one batcher.

Every Verify message from every open stream goes into one queue; the batcher starts a step
when every row it expects is in (``specserve.service.scheduler``: the sessions whose replies
are out come back one turnaround later; ``batch_wait_s`` bounds the wait) and runs one
``TargetEngine.verify`` over all of them in a worker thread, so concurrent requests share a
forward pass: full batches under load, no wait at concurrency 1.

KV admission: a row whose session needs a new cache slot runs only while the KV budget holds
one more session (``TargetEngine.admission``); otherwise it waits here, off the queue, until
a release makes room (or it waited ``admit_wait_s``: then the least recently used session
outside the step is evicted for it), so an over-full replica serves as many sessions as fit
at full speed instead of thrashing its cache. Sessions that outgrow the budget are
preempted newest first (their resend waits like a new session).

Bounded and private: the queue holds at most ``max_queue`` rows (beyond it a row is answered
``overloaded: ...`` at once, RESOURCE_EXHAUSTED for its request); with a ``secret`` every
stream must carry it (``specserve.auth.PeerAuthInterceptor``); messages are limited to
``max_message_bytes``. Sessions are released by the router's message, when the stream that
used them ends (a router that died) or after ``idle_s`` unused (``SessionTracker``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from specserve import tracing
from specserve.auth import PeerAuthInterceptor
from specserve.engine.target import TargetEngine
from specserve.proto_gen.specserve.v1 import internal_pb2 as pb
from specserve.proto_gen.specserve.v1 import internal_pb2_grpc as pb_grpc
from specserve.service.peers import SessionTracker, packed
from specserve.service.scheduler import StepScheduler, by_session, gather
from specserve.service.wire import verify_item_from_proto, verify_outcome_to_proto

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from specserve.service.metrics import TargetBatchMetrics

log = logging.getLogger(__name__)
# a message, its stream, its span, when it was read (time.time_ns: the reply's received_ns)
_Row = tuple[pb.VerifyRequest, asyncio.Queue, "Span | None", int]


@dataclass
class TargetMetrics:
    batches: int = 0
    rows: int = 0
    max_batch: int = 0
    compute_s: float = 0.0  # the engine's time in verify calls
    batch_sizes: list[int] = field(default_factory=list)

    def observe(self, n: int, compute_s: float) -> None:
        self.batches += 1
        self.compute_s += compute_s
        self.rows += n
        self.max_batch = max(self.max_batch, n)
        self.batch_sizes.append(n)
        del self.batch_sizes[:-1000]


class TargetServicer(pb_grpc.TargetServicer):
    def __init__(self, engine: TargetEngine, replica: str, max_batch: int = 32,
                 batch_wait_s: float = 0.05, prometheus: TargetBatchMetrics | None = None,
                 max_queue: int = 1024, idle_s: float = 10.0, admit_wait_s: float = 20.0,
                 prefill_chunk: int | None = None, prefill_budget: int | None = None):
        self.engine = engine
        self.prefill_chunk, self.prefill_budget = prefill_chunk, prefill_budget
        self.replica = replica
        self.max_batch = max_batch
        self.scheduler = StepScheduler(max_wait_s=batch_wait_s)
        self.metrics = TargetMetrics()
        self.prometheus = prometheus  # Ray metrics (Serve deployment only)
        self._queue: asyncio.Queue[_Row] = asyncio.Queue(maxsize=max_queue)
        self._batcher: asyncio.Task | None = None
        self._reaper: asyncio.Task | None = None
        self.sessions = SessionTracker(self._release, idle_s)
        self.overloaded = 0  # rows refused because the queue was full
        self.admit_wait_s = admit_wait_s
        self._waiting: list[_Row] = []  # rows waiting for KV room, oldest first
        self._since: dict[int, float] = {}  # id(message) -> when it first waited
        self.kv = {"waited": 0, "preempted": 0}  # rows that waited; sessions preempted
        self._streams = itertools.count(1)
        self._carried: list[_Row] = []  # rows whose prefill goes on in the next step
        # steps a row's prefill went on into (a chunk fed, or waiting for the step's budget)
        self.chunks = 0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._batcher = loop.create_task(self._run())
        self._reaper = loop.create_task(self._reap())

    @property
    def queued(self) -> int:
        """Rows waiting for a forward (all streams), for KV room included."""
        return self._queue.qsize() + len(self._waiting) + len(self._carried)

    @property
    def waiting(self) -> int:
        """Rows waiting for KV room."""
        return len(self._waiting)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.sessions.idle_s / 4, self.admit_wait_s / 4))
            self.sessions.reap()
            now = time.monotonic()
            if any(now - self._since[id(r[0])] >= self.admit_wait_s for r in self._waiting):
                self._requeue()

    def _release(self, session_id: str) -> None:
        self.engine.release(session_id)
        self.scheduler.released(session_id)
        self._requeue()  # room for a waiting row, maybe

    def _requeue(self) -> None:
        while self._waiting and not self._queue.full():
            self._queue.put_nowait(self._waiting.pop(0))

    def _admission(self, batch: list[_Row], items: list, good: list[int]) -> list[int]:
        """KV admission of a step's valid rows: preempts what must go and returns the rows
        (of ``good``) that wait; they are put aside, oldest first."""
        now = time.monotonic()
        plan = self.engine.admission(items, [
            now - self._since.get(id(batch[i][0]), now) >= self.admit_wait_s for i in good]
            if self._since else None)
        for sid in plan.preempt:
            self.engine.release(sid)
            self.kv["preempted"] += 1
        wait = [i for i, ok in zip(good, plan.run, strict=True) if not ok]
        for i in wait:
            self.kv["waited"] += id(batch[i][0]) not in self._since
            self._since.setdefault(id(batch[i][0]), now)
        if wait:
            self._waiting = sorted([*self._waiting, *(batch[i] for i in wait)],
                                   key=lambda r: self._since[id(r[0])])
        if self._since:  # rows that waited before and run now
            for i in good:
                if i not in wait:
                    self._since.pop(id(batch[i][0]), None)
        return wait

    def _admit(self, msg: pb.VerifyRequest, replies: asyncio.Queue, stream: int) -> bool:
        """Release messages and the queue bound; True when ``msg`` is a row to verify."""
        if msg.release:
            self.sessions.release(msg.session_id)
            return False
        self.sessions.touch(msg.session_id, stream)
        if self._queue.full():
            self.overloaded += 1
            self.sessions.answered(msg.session_id)
            replies.put_nowait(pb.VerifyReply(
                call_id=msg.call_id, replica=self.replica,
                error=f"overloaded: target queue full ({self._queue.maxsize} rows)"))
            return False
        self.scheduler.arrived(msg.session_id, time.monotonic())
        return True

    async def Verify(self, request_iterator, context):
        replies: asyncio.Queue = asyncio.Queue()
        stream = next(self._streams)

        async def pump() -> None:
            async for batch in request_iterator:
                received_ns = time.time_ns()
                for msg in batch.rows:
                    if not self._admit(msg, replies, stream):
                        continue
                    tracer = tracing.tracer()
                    span = None
                    if tracer is not None:  # a span per row, from arrival to reply
                        from opentelemetry.trace import SpanKind

                        span = tracer.start_span(
                            "target.verify_row", kind=SpanKind.SERVER,
                            context=tracing.context_from_traceparent(msg.traceparent))
                    await self._queue.put((msg, replies, span, received_ns))
            await replies.put(None)

        reader = asyncio.get_running_loop().create_task(pump())
        try:
            async for message in packed(replies, lambda rs: pb.VerifyReplies(replies=rs)):
                yield message
        finally:
            reader.cancel()
            self.sessions.stream_closed(stream)  # its router is gone: free its sessions

    async def _run(self) -> None:
        while True:
            carried, self._carried = self._carried, []
            batch = await gather(self._queue, self.scheduler, self.max_batch, carried)
            for rows in by_session(batch, lambda row: row[0].session_id):
                await self._serve(rows)

    async def _serve(self, batch: list[_Row]) -> None:
        items, errors = [], {}
        for i, (msg, *_) in enumerate(batch):
            try:  # alone: a bad row is answered with its error and never fails the batch
                item = verify_item_from_proto(msg)
                self.engine.validate(item)
                items.append(item)
            except ValueError as e:
                errors[i] = str(e)
        good = [i for i in range(len(batch)) if i not in errors]
        wait = set(self._admission(batch, items, good)) if items else set()
        items = [it for i, it in zip(good, items, strict=True) if i not in wait]
        good = [i for i in good if i not in wait]
        outcomes = {}
        compute_us = 0
        if items:
            fspan = _batch_span(batch, len(items)) if tracing.tracer() is not None else None
            try:
                t0 = time.perf_counter()
                self.sessions.busy = True
                try:
                    results = await asyncio.to_thread(self.engine.verify, items,
                                                      self.prefill_chunk,
                                                      self.prefill_budget)
                finally:
                    self.sessions.busy = False
                    self.sessions.apply()
                compute_us = int((time.perf_counter() - t0) * 1e6)
                self.scheduler.stepped(compute_us / 1e6)
                outcomes = dict(zip(good, results, strict=True))
                self.metrics.observe(len(items), compute_us / 1e6)
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
        # the load each reply reports (spec=auto reads it): rows that can join the next steps;
        # rows waiting for KV room cannot (autoscaling still counts them: ``queued``)
        queued = self._queue.qsize()
        for i, (msg, replies, span, received_ns) in enumerate(batch):
            if i in wait:
                continue
            if i in outcomes and outcomes[i].pending:  # its prefill's next chunk: next step
                self._carried.append(batch[i])
                self.chunks += 1
                continue
            if i in errors:
                reply = pb.VerifyReply(call_id=msg.call_id, error=errors[i],
                                       replica=self.replica)
            else:
                outcomes[i].queue_rows = queued
                reply = verify_outcome_to_proto(outcomes[i], msg.call_id, self.replica,
                                                compute_us)
            reply.received_ns, reply.sent_ns = received_ns, time.time_ns()
            if span is not None:
                _end_row_span(span, msg, reply)
            if not reply.error:
                self.scheduler.replied(msg.session_id, time.monotonic())
            self.sessions.answered(msg.session_id)
            await replies.put(reply)


def _batch_span(batch: list[_Row], rows: int) -> Span | None:
    """The batch forward's span: linked to every row's span (the requests it served), a child
    of the first sampled row so it is kept exactly when some request is traced."""
    from opentelemetry import trace

    tracer = tracing.tracer()
    spans = [s for _, _, s, _ in batch if s is not None]
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
                              replica: str = "target", secret: str | None = None,
                              max_message_bytes: int = 32 << 20,
                              **kw) -> tuple[grpc.aio.Server, int, TargetServicer]:
    server = grpc.aio.server(
        interceptors=[PeerAuthInterceptor(secret)] if secret else None,
        options=[("grpc.max_receive_message_length", max_message_bytes),
                 ("grpc.max_send_message_length", max_message_bytes)])
    servicer = TargetServicer(engine, replica, **kw)
    pb_grpc.add_TargetServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    servicer.start()
    return server, bound, servicer

"""The drafter replica's gRPC server: a bidi ``Propose`` stream per router, one batcher.

Every Propose message from every open stream is checked on its own (a bad item is answered
with its error and never joins a batch), then goes into one queue; the batcher takes what
is there plus every row the scheduler expects (``specserve.service.scheduler``, as the
target's: sessions whose replies are out; ``batch_wait_s`` and one step bound the wait) and
runs one ``DrafterEngine.propose`` over all of them in a worker thread, so concurrent
sessions share each draft step's forward (``sessions.propose_batch``). A session that is
twice in the queue is served in order, in consecutive engine calls. ``batches`` / ``rows``
count the engine calls and the items they served (mean drafter batch = rows / batches).
With draft-ahead on (``DrafterEngine(draft_ahead=True)``), whenever the queue is empty
after a batch the batcher drafts ahead for the replies just sent (one engine call while the
target verifies; ``ahead_s`` counts its time, apart from ``compute_s``): a proposal that
arrives meanwhile waits for that call, the price of a miss. While it drafts ahead for one
session alone, each block is pushed at once, unasked, to the stream of its session (a
``ProposeReply`` with call_id 0 and the committed tokens it is for): a router whose verify
outcome matches sends it to the target without waiting for a drafter hop.

Private and bounded like the target's server: a shared ``secret`` on every stream, a
message size limit, k at most ``MAX_K``, and sessions released by message, by their stream
ending, or after ``idle_s`` unused.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import grpc

from specserve import tracing
from specserve.api import MAX_K
from specserve.auth import PeerAuthInterceptor
from specserve.contract import ProposeItem, ProposeOutcome
from specserve.engine.drafter import DrafterEngine
from specserve.proto_gen.specserve.v1 import internal_pb2 as pb
from specserve.proto_gen.specserve.v1 import internal_pb2_grpc as pb_grpc
from specserve.service.load import DRAFTING_WINDOW_S, RecentSessions
from specserve.service.peers import SessionTracker, packed
from specserve.service.scheduler import StepScheduler, by_session, gather
from specserve.service.wire import (
    prepared_to_proto,
    propose_item_from_proto,
    propose_outcome_to_proto,
)

log = logging.getLogger(__name__)
_Job = tuple[ProposeItem, "asyncio.Future[tuple[ProposeOutcome, int]]"]  # an item, its answer


class DrafterServicer(pb_grpc.DrafterServicer):
    def __init__(self, engine: DrafterEngine, replica: str, idle_s: float = 10.0,
                 max_batch: int = 64, batch_wait_s: float = 0.05):
        self.engine = engine
        self.replica = replica
        self.proposals = 0
        self.max_batch = max_batch
        self.scheduler = StepScheduler(max_wait_s=batch_wait_s)
        self.batches = 0  # engine calls
        self.rows = 0  # items they served
        self.compute_s = 0.0  # time in engine calls
        self.ahead_s = 0.0  # time drafting ahead (not in compute_s)
        # held sessions a draft model served lately (the autoscaling signal)
        self.drafting = RecentSessions(DRAFTING_WINDOW_S)
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._batcher: asyncio.Task | None = None
        self.sessions = SessionTracker(self._release, idle_s)
        self._streams = itertools.count(1)
        self._outbox: dict[int, asyncio.Queue] = {}  # stream -> its replies (for pushes)
        self.pushed = 0  # blocks drafted ahead and pushed to their router
        self._reaper: asyncio.Task | None = None

    def _release(self, session_id: str) -> None:
        self.engine.release(session_id)
        self.scheduler.released(session_id)
        self.drafting.forget(session_id)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._reaper = loop.create_task(self._reap())
        self._batcher = loop.create_task(self._run())

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.sessions.idle_s / 4))
            self.sessions.reap()

    async def _propose(self, msg: pb.ProposeRequest) -> pb.ProposeReply:
        tracer = tracing.tracer()
        if tracer is None:  # tracing off
            return await self._propose_untraced(msg)
        from opentelemetry.trace import SpanKind

        span = tracer.start_span("drafter.propose", kind=SpanKind.SERVER,
                                 context=tracing.context_from_traceparent(msg.traceparent))
        try:
            reply = await self._propose_untraced(msg)
            if span.is_recording():
                rep = reply.repair
                span.set_attributes({  # few (each costs); the replica id: a resource attribute
                    "specserve.k": msg.k, "specserve.drafted": len(reply.draft_tokens),
                    "specserve.cache": "miss" if reply.cache_miss else "hit",
                    "specserve.rolled_back": rep.cached_before - rep.kept,
                    "specserve.fed": rep.fed, "specserve.compute_us": reply.compute_us,
                    "specserve.ahead": reply.ahead})
                if reply.error:
                    from opentelemetry.trace import Status, StatusCode

                    span.set_status(Status(StatusCode.ERROR, reply.error))
            return reply
        finally:
            span.end()

    async def _propose_untraced(self, msg: pb.ProposeRequest) -> pb.ProposeReply:
        try:
            if msg.k > MAX_K:
                raise ValueError(f"k: {msg.k} drafts asked, at most {MAX_K}")
            item = propose_item_from_proto(msg)
            self.engine.validate(item)  # alone: a bad item must not fail its batch
            if self._batcher is None:  # a servicer nobody started
                self._batcher = asyncio.get_running_loop().create_task(self._run())
            answer: asyncio.Future[tuple[ProposeOutcome, int]] = (
                asyncio.get_running_loop().create_future())
            self.scheduler.arrived(item.session_id, time.monotonic())
            await self._queue.put((item, answer))
            o, compute_us = await answer
        except Exception as e:
            log.warning("propose failed: %s", e)
            return pb.ProposeReply(call_id=msg.call_id, error=str(e), replica=self.replica)
        self.proposals += 1
        return propose_outcome_to_proto(o, msg.call_id, self.replica, compute_us)

    async def _run(self) -> None:
        while True:
            if self._queue.empty() and self.engine.draft_ahead_on and self.engine.ahead_pending:
                await self._draft_ahead()
                continue
            batch = await gather(self._queue, self.scheduler, self.max_batch)
            for jobs in by_session(batch, lambda job: job[0].session_id):
                await self._serve(jobs)

    async def _draft_ahead(self) -> None:
        t0 = time.perf_counter()
        self.sessions.busy = True
        try:
            await asyncio.to_thread(self.engine.draft_ahead)
        except Exception:  # an optimisation: it never ends the batcher
            log.exception("draft-ahead failed")
        finally:
            self.sessions.busy = False
            self.sessions.apply()
            self.ahead_s += time.perf_counter() - t0
        blocks = self.engine.take_prepared()
        if len({b.session_id for b in blocks}) > 1:
            # several sessions drafting: their routers would not send a pushed block (its row
            # would reach the target ahead of its cohort), so they are not sent (a sampled
            # row's block carries q, k x vocab floats); the calls are answered from them
            return
        for block in blocks:  # to the router now, unasked
            outbox = self._outbox.get(self.sessions.stream_of(block.session_id))
            if outbox is not None:
                outbox.put_nowait(prepared_to_proto(block, self.replica))
                self.pushed += 1

    async def _serve(self, jobs: list[_Job]) -> None:
        """One engine call for ``jobs``; each answer (or the call's error) to its future."""
        try:
            t0 = time.perf_counter()
            self.sessions.busy = True
            try:
                outcomes = await asyncio.to_thread(self.engine.propose, [it for it, _ in jobs])
            finally:
                self.sessions.busy = False
                self.sessions.apply()
            compute_us = int((time.perf_counter() - t0) * 1e6)
            self.scheduler.stepped(compute_us / 1e6)
            self.compute_s += compute_us / 1e6
            self.batches += 1
            self.rows += len(jobs)
            for item, _ in jobs:
                if item.mode == "draft" and item.k > 0:
                    self.drafting.mark(item.session_id)
        except Exception as e:  # a failed call answers its items, never ends the batcher
            for _, answer in jobs:
                if not answer.done():
                    answer.set_exception(e)
            return
        now = time.monotonic()
        for (item, answer), o in zip(jobs, outcomes, strict=True):
            if not answer.done():  # its stream may be gone
                answer.set_result((o, compute_us))
                self.scheduler.replied(item.session_id, now)

    async def Propose(self, request_iterator, context):
        replies: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task] = set()
        stream = next(self._streams)
        self._outbox[stream] = replies

        async def handle(msg: pb.ProposeRequest, received_ns: int) -> None:
            reply = await self._propose(msg)
            reply.received_ns, reply.sent_ns = received_ns, time.time_ns()
            self.sessions.answered(msg.session_id)
            await replies.put(reply)

        async def pump() -> None:
            async for batch in request_iterator:
                received_ns = time.time_ns()
                for msg in batch.rows:
                    if msg.release:
                        self.sessions.release(msg.session_id)
                        continue
                    self.sessions.touch(msg.session_id, stream)
                    t = loop.create_task(handle(msg, received_ns))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)
            await replies.put(None)

        reader = loop.create_task(pump())
        try:
            async for message in packed(replies, lambda rs: pb.ProposeReplies(replies=rs)):
                yield message
        finally:
            reader.cancel()
            self._outbox.pop(stream, None)
            self.sessions.stream_closed(stream)  # its router is gone: free its sessions


async def start_drafter_server(engine: DrafterEngine, host: str = "127.0.0.1", port: int = 0,
                               replica: str = "drafter", secret: str | None = None,
                               max_message_bytes: int = 32 << 20, idle_s: float = 10.0,
                               max_batch: int = 64, batch_wait_s: float = 0.05):
    server = grpc.aio.server(
        interceptors=[PeerAuthInterceptor(secret)] if secret else None,
        options=[("grpc.max_receive_message_length", max_message_bytes),
                 ("grpc.max_send_message_length", max_message_bytes)])
    servicer = DrafterServicer(engine, replica, idle_s, max_batch, batch_wait_s)
    pb_grpc.add_DrafterServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    servicer.start()
    return server, bound, servicer

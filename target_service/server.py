"""The target replica's gRPC server: a bidi ``Verify`` stream per router, one batcher.

Every Verify message from every open stream goes into one queue; the batcher takes what is
there (waiting up to ``batch_wait_s`` for more when other sessions are active) and runs one
``BatchedTarget.verify`` over all of them in a worker thread, so concurrent requests share a
forward pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import grpc

from specserve.proto_gen.specserve.v1 import internal_pb2 as pb
from specserve.proto_gen.specserve.v1 import internal_pb2_grpc as pb_grpc
from specserve.service.wire import probs_from_bytes, repair_to_proto, sampling_from_proto
from target_service.engine import BatchedTarget, VerifyItem

log = logging.getLogger(__name__)


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
    def __init__(self, engine: BatchedTarget, replica: str, max_batch: int = 32,
                 batch_wait_s: float = 0.002):
        self.engine = engine
        self.replica = replica
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self.metrics = TargetMetrics()
        self._queue: asyncio.Queue[tuple[pb.VerifyRequest, asyncio.Queue]] = asyncio.Queue()
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
                await self._queue.put((msg, replies))
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

    async def _serve(self, batch: list[tuple[pb.VerifyRequest, asyncio.Queue]]) -> None:
        items, errors = [], {}
        for i, (msg, _) in enumerate(batch):
            try:
                items.append(VerifyItem(
                    session_id=msg.session_id, committed_len=msg.committed_len,
                    tokens_start=msg.tokens_start, tokens=list(msg.tokens),
                    draft_tokens=list(msg.draft_tokens),
                    draft_probs=probs_from_bytes(msg.draft_probs, len(msg.draft_tokens)),
                    sampling=sampling_from_proto(msg.sampling),
                ))
            except ValueError as e:
                errors[i] = str(e)
        good = [i for i in range(len(batch)) if i not in errors]
        outcomes = {}
        compute_us = 0
        if items:
            try:
                t0 = time.perf_counter()
                results = await asyncio.to_thread(self.engine.verify, items)
                compute_us = int((time.perf_counter() - t0) * 1e6)
                outcomes = dict(zip(good, results, strict=True))
                self.metrics.observe(len(items))
            except Exception as e:  # a bad row must not take the replica down
                log.exception("verify batch failed")
                errors.update({i: f"verify failed: {e}" for i in good})
        for i, (msg, replies) in enumerate(batch):
            if i in errors:
                await replies.put(pb.VerifyReply(call_id=msg.call_id, error=errors[i],
                                                 replica=self.replica))
                continue
            o = outcomes[i]
            await replies.put(pb.VerifyReply(
                call_id=msg.call_id, num_accepted=o.num_accepted, extra_token=o.extra_token,
                bonus=o.bonus, cache_miss=o.cache_miss, repair=repair_to_proto(o.repair),
                batch_size=o.batch_size, replica=self.replica, compute_us=compute_us))


async def start_target_server(engine: BatchedTarget, host: str = "127.0.0.1", port: int = 0,
                              replica: str = "target", **kw) -> tuple[grpc.aio.Server, int,
                                                                      TargetServicer]:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    servicer = TargetServicer(engine, replica, **kw)
    pb_grpc.add_TargetServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    servicer.start()
    return server, bound, servicer

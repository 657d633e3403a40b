"""One long-lived bidirectional gRPC stream per replica, shared by every request.

Each round is one row each way on an already open stream (measured ~0.5 ms p50 per hop
on loopback, vs ~1.8 ms for a unary call and ~2.5-3.9 ms through Serve handles), so the
per-round orchestration cost stays small. Rows travel packed: one stream message carries
every call queued at that moment (``pack``), and a replica answers a whole step in one
message (``unpack``), so a step's replies resume their rounds together. Calls are paired
with replies by ``call_id``; a reply with call_id 0 was pushed unasked (a drafter's block
drafted ahead, one per guessed outcome) and waits in ``pushed`` under its session, those
drafted ahead after its latest round only, until the session's request takes them or releases
the session (at most ``MAX_PUSHED`` sessions held).
A broken stream fails its pending calls with ``StreamBroken``; the caller reconnects (to the
same or another replica) and the receiver's cache repair makes the retry converge.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from specserve.auth import PEER_KEY
from specserve.service.peers import packed

CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]


MAX_PUSHED = 4096  # pushed replies held at most (one per session; the oldest go first)


def _base(reply: Any) -> int:
    """The committed length a pushed block was drafted ahead from (its tail follows it)."""
    return reply.committed_len - len(reply.tail)


class StreamBroken(ConnectionError):
    """The stream to a replica ended or failed; pending calls cannot complete on it."""


class StreamMux:
    def __init__(self, address: str, open_stream: Callable[[grpc.aio.Channel], Callable],
                 secret: str | None = None, max_message_bytes: int = 32 << 20,
                 pack: Callable[[list[Any]], Any] = list,
                 unpack: Callable[[Any], Any] = lambda msg: msg):
        """``open_stream(channel)`` returns the stub's bidi method, e.g.
        ``lambda ch: TargetStub(ch).Verify``; ``pack(rows)``: the stream message carrying
        ``rows``, ``unpack(message)``: the replies one carries; ``secret``: the data plane's
        shared secret, sent with the stream (``specserve.auth.PEER_KEY``)."""
        self._pack, self._unpack = pack, unpack
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=[
            *CHANNEL_OPTIONS, ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)])
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self.pushed: dict[str, list[Any]] = {}  # session -> the replies pushed for it
        metadata = ((PEER_KEY, secret),) if secret else None
        self._call = open_stream(self._channel)(self._outgoing(), metadata=metadata)
        self._reader = asyncio.get_running_loop().create_task(self._read())
        self.broken: BaseException | None = None

    def _outgoing(self) -> AsyncIterator[Any]:
        return packed(self._queue, self._pack)  # every call queued at once, one message

    async def _read(self) -> None:
        try:
            async for msg in self._call:
                for reply in self._unpack(msg):
                    if not reply.call_id:
                        self._hold(reply)
                        continue
                    fut = self._pending.pop(reply.call_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(reply)
            err: BaseException = StreamBroken(f"stream to {self.address} ended")
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            err = StreamBroken(f"stream to {self.address} failed: {e}")
        self.broken = err
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()

    def _hold(self, reply: Any) -> None:
        sid = getattr(reply, "session_id", "")
        if sid:
            held = self.pushed.pop(sid, [])
            if held and _base(held[0]) != _base(reply):
                held = []  # drafted ahead after an earlier round: stale
            self.pushed[sid] = [*held, reply]
            while len(self.pushed) > MAX_PUSHED:
                del self.pushed[next(iter(self.pushed))]

    async def call(self, msg: Any, timeout: float) -> Any:
        if self.broken is not None:
            raise self.broken
        msg.call_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[msg.call_id] = fut
        await self._queue.put(msg)
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._pending.pop(msg.call_id, None)

    def send_nowait(self, msg: Any) -> None:
        """Fire-and-forget (session release); no reply is awaited."""
        if self.broken is None:
            msg.call_id = 0
            self._queue.put_nowait(msg)
        if getattr(msg, "release", False):
            self.pushed.pop(msg.session_id, None)

    async def close(self) -> None:
        await self._queue.put(None)
        self._reader.cancel()
        await self._channel.close()

"""Which sessions a data-plane server holds for whom, so none outlives its request.

A session is *held* from its lease (or first call) until it is released: by the router's
release message, when the stream that used it ends (its router died or went away: the
connection closes), or when it was idle for ``idle_s`` (a lost release; a later call just
rebuilds the cache by the contract's resend rule, so releasing early is always safe). Idle
means: no row of it here and none answered for ``idle_s``; a row waiting in the queue or
in a long step is not idle (releasing it there made every session of a step longer than
``idle_s`` miss and re-prefill, which made the next step longer: spec-off at concurrency
32 on long prompts served nothing in 4 minutes).
Releases are applied by the server between engine calls (``apply``), never while an engine
call runs in its worker thread. ``packed`` is the data plane's stream writer (both ends).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any


class SessionTracker:
    def __init__(self, release: Callable[[str], object], idle_s: float = 10.0):
        self._release = release
        self.idle_s = idle_s
        self.busy = False  # an engine call is running: releases wait for ``apply``
        self._seen: dict[str, float] = {}  # session -> last use
        self._stream: dict[str, int] = {}  # session -> the stream that used it last
        self._pending: set[str] = set()
        self._in_flight: set[str] = set()  # a row of it is here, not answered yet
        self.released = {"message": 0, "stream_closed": 0, "idle": 0}

    def touch(self, session_id: str, stream: int = 0) -> None:
        """A row of ``session_id`` arrived: held, and not idle until it is ``answered``."""
        self._seen[session_id] = time.monotonic()
        if stream:
            self._stream[session_id] = stream
        self._pending.discard(session_id)
        self._in_flight.add(session_id)

    def answered(self, session_id: str) -> None:
        """Its row was answered: its idle time counts from now."""
        if session_id in self._seen:
            self._seen[session_id] = time.monotonic()
        self._in_flight.discard(session_id)

    def stream_of(self, session_id: str) -> int:
        """The stream that used ``session_id`` last (0: none known)."""
        return self._stream.get(session_id, 0)

    def held(self, session_id: str) -> bool:
        return session_id in self._seen

    def __len__(self) -> int:
        return len(self._seen)

    def release(self, session_id: str, why: str = "message") -> None:
        if self._seen.pop(session_id, None) is None and why != "message":
            return
        self._stream.pop(session_id, None)
        self._in_flight.discard(session_id)
        self.released[why] = self.released.get(why, 0) + 1
        if self.busy:
            self._pending.add(session_id)
        else:
            self._release(session_id)

    def stream_closed(self, stream: int) -> None:
        for sid in [s for s, st in self._stream.items() if st == stream]:
            self.release(sid, "stream_closed")

    def reap(self) -> None:
        cutoff = time.monotonic() - self.idle_s
        for sid in [s for s, t in self._seen.items() if t < cutoff and s not in self._in_flight]:
            self.release(sid, "idle")

    def apply(self) -> None:
        """Releases that waited for the engine call to end."""
        while self._pending:
            self._release(self._pending.pop())


async def packed(replies: asyncio.Queue, pack: Callable[[list], Any]) -> AsyncIterator[Any]:
    """A stream's outgoing side: every row queued at the moment in one message (``pack``);
    ends at ``None``. A replica's step puts all its replies before this runs again, so a
    step is one message per stream; the router's mux sends its queued calls the same way."""
    while True:
        rows = [await replies.get()]
        while not replies.empty():
            rows.append(replies.get_nowait())
        end = None in rows
        rows = [r for r in rows if r is not None]
        if rows:
            yield pack(rows)
        if end:
            return

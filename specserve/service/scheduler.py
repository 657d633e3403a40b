"""When a data-plane replica starts its next step: as soon as every row it expects is in.

A replica serves sessions whose rounds come back to it: a session's next row arrives one
*turnaround* after its last reply left (the router commits, streams, asks the drafter, sends
again). Under load the rows of many sessions come back staggered, and a batcher that runs
whatever is queued fragments its batches (issue 14 measured 4.6 rows at concurrency 16).
So the scheduler tracks each held session:

* *out*: its reply left at ``t`` and its next row is expected around ``t + turnaround``,
* *in*: its row is queued (part of the next step),
* *late*: it did not come back by the last deadline (a finished request whose release is
  still on its way, a long drafter call): not waited for again until it returns,
* released: forgotten.

``deadline(first_arrival, ready)`` says until when to wait before starting the step: ``None``
(start now) when no session is out; otherwise until the latest expected return of the out
sessions (reply time + the p90 of the turnarounds observed recently), but never more than
``forward * out / ready`` after the step's first row arrived: waiting w delays the ``ready``
rows by w each, not waiting delays each of the ``out`` rows by about one step (they wait for
the step that just started), so a wait pays while ``ready * w < out * forward``. And never
more than ``max_wait_s``. At concurrency 1 nothing is out while the row waits: the step
starts at once.

Pure bookkeeping (no asyncio, no gRPC): ``gather`` below runs it over an asyncio queue for
the target's and the drafter's servers alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

_SAMPLES = 256
_DEFAULT_TURNAROUND_S = 0.002  # until some turnaround was observed


class StepScheduler:
    def __init__(self, max_wait_s: float = 0.05):
        self.max_wait_s = max_wait_s
        self._out: dict[str, float] = {}  # session -> when its last reply left
        self._late: set[str] = set()
        self._turnarounds: deque[float] = deque(maxlen=_SAMPLES)
        self._p90 = _DEFAULT_TURNAROUND_S
        self.forward_s = 0.0  # EWMA of the step's own compute time
        self.waits = 0  # steps that waited for some row
        self.timeouts = 0  # steps whose deadline passed with rows still out

    # ---------------------------------------------------------------- events
    def arrived(self, session_id: str, now: float) -> None:
        sent = self._out.pop(session_id, None)
        self._late.discard(session_id)
        if sent is not None:
            self._turnarounds.append(now - sent)
            if len(self._turnarounds) % 16 == 0 or len(self._turnarounds) < 16:
                ordered = sorted(self._turnarounds)
                self._p90 = ordered[int(0.9 * (len(ordered) - 1))]

    def replied(self, session_id: str, now: float) -> None:
        self._out[session_id] = now

    def released(self, session_id: str) -> None:
        self._out.pop(session_id, None)
        self._late.discard(session_id)

    def stepped(self, compute_s: float) -> None:
        a = 0.3
        self.forward_s = compute_s if not self.forward_s else (1 - a) * self.forward_s + \
            a * compute_s

    # ---------------------------------------------------------------- decision
    def expected(self) -> int:
        """Sessions whose next row is on its way."""
        return sum(1 for s in self._out if s not in self._late)

    def deadline(self, first_arrival: float, ready: int) -> float | None:
        """When to start the step whose first row arrived at ``first_arrival`` with ``ready``
        rows in; None: now."""
        out = [t for s, t in self._out.items() if s not in self._late]
        if not out:
            return None
        worth = (self.forward_s or self.max_wait_s) * len(out) / max(ready, 1)
        return min(max(out) + self._p90, first_arrival + min(self.max_wait_s, worth))

    def give_up(self) -> None:
        """The deadline passed: the sessions still out are late (not waited for again)."""
        self._late.update(self._out)
        self.timeouts += 1

    @property
    def turnaround_p90_s(self) -> float:
        return self._p90


Row = TypeVar("Row")


async def gather(queue: asyncio.Queue[Row], scheduler: StepScheduler, max_rows: int,
                 carried: list[Row] | None = None) -> list[Row]:
    """The next step's rows: ``carried`` (rows the last step left unfinished) or the first
    queued row, then every row the scheduler expects, until they are in, ``max_rows`` is
    reached or the deadline passes. (The server reports each row's arrival to the
    scheduler when it is queued, not here.)"""
    batch = list(carried) if carried else [await queue.get()]
    start = time.monotonic()
    waited = False
    while len(batch) < max_rows:
        while len(batch) < max_rows and not queue.empty():
            batch.append(queue.get_nowait())
        until = scheduler.deadline(start, len(batch)) if len(batch) < max_rows else None
        if until is None:
            break
        remaining = until - time.monotonic()
        if remaining <= 0:
            scheduler.give_up()
            break
        waited = True
        with contextlib.suppress(TimeoutError):  # the next pass gives up
            batch.append(await asyncio.wait_for(queue.get(), remaining))
    scheduler.waits += waited
    return batch


def by_session(batch: list[Row], session_of: Callable[[Row], str]) -> list[list[Row]]:
    """The engine calls that serve ``batch``: a session queued twice (a resend behind its
    first call) gets its calls in order, one per engine call; every other row goes with the
    first (an engine call refuses a session twice)."""
    calls: list[list[Row]] = []
    seen: list[set[str]] = []
    for row in batch:
        sid = session_of(row)
        i = next((j for j, s in enumerate(seen) if sid not in s), len(calls))
        if i == len(calls):
            calls.append([])
            seen.append(set())
        calls[i].append(row)
        seen[i].add(sid)
    return calls

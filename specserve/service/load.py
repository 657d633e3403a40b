"""A replica's autoscaling signals (``deployments/autoscaling.py`` reads them).

``BusyMeter``: the fraction of wall time the engine computed since the last reading.
``RecentSessions``: the sessions seen doing something (drafting) in the last window and
not released since: open sessions, not a count of requests (a closed loop of short requests
passes many session ids through a window).
"""

from __future__ import annotations

import time
from collections.abc import Callable

DRAFTING_WINDOW_S = 5.0  # a session drafted for this recently counts as drafting


class BusyMeter:
    """``read()``: engine seconds per wall second since the previous ``read()`` (0..1)."""

    def __init__(self, compute_s: Callable[[], float], clock: Callable[[], float] = time.monotonic):
        self._compute_s, self._clock = compute_s, clock
        self._last = (clock(), compute_s())

    def read(self) -> float:
        now, spent = self._clock(), self._compute_s()
        t0, s0 = self._last
        self._last = (now, spent)
        if now <= t0:
            return 0.0
        return min(1.0, max(0.0, (spent - s0) / (now - t0)))


class RecentSessions:
    """Sessions marked within the last ``window_s`` seconds."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic):
        self.window_s, self._clock = window_s, clock
        self._seen: dict[str, float] = {}

    def mark(self, session_id: str) -> None:
        self._seen[session_id] = self._clock()

    def forget(self, session_id: str) -> None:
        self._seen.pop(session_id, None)

    def count(self) -> int:
        cutoff = self._clock() - self.window_s
        for sid in [s for s, t in self._seen.items() if t < cutoff]:
            del self._seen[sid]
        return len(self._seen)

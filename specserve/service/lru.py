"""Per-session state bounded by a byte budget, least recently used evicted first.

Shared by the drafter and target engines. Eviction is always safe: a session that is gone
answers the next call with a cache miss and is rebuilt from the tokens the router sends.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Protocol, TypeVar


class _Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


S = TypeVar("S", bound=_Sized)


class LRUSessions(Generic[S]):
    def __init__(self, cache_budget_bytes: int):
        if cache_budget_bytes < 0:
            raise ValueError(f"cache_budget_bytes must be >= 0, got {cache_budget_bytes}")
        self.cache_budget_bytes = cache_budget_bytes
        self._sessions: OrderedDict[str, S] = OrderedDict()  # LRU order, oldest first
        self.evictions = 0
        self.misses = 0

    def release(self, session_id: str) -> bool:
        """Drop a session's state; True if it existed."""
        sess = self._sessions.pop(session_id, None)
        if sess is not None:
            self._dropped(sess)
        return sess is not None

    def _dropped(self, session: S) -> None:
        """Hook: a session was released or evicted (the engine frees what it held)."""

    def has_session(self, session_id: str) -> bool:
        return session_id in self._sessions

    @property
    def cache_bytes(self) -> int:
        return sum(s.nbytes for s in self._sessions.values())

    def lru_stats(self) -> dict[str, int]:
        return {"sessions": len(self._sessions), "bytes": self.cache_bytes,
                "budget_bytes": self.cache_budget_bytes, "evictions": self.evictions,
                "misses": self.misses}

    def _evict(self, protect: set[str]) -> None:
        """Evict oldest sessions (never those in ``protect``) until within budget."""
        total = self.cache_bytes
        for sid in [s for s in self._sessions if s not in protect]:  # oldest first
            if total <= self.cache_budget_bytes:
                break
            sess = self._sessions.pop(sid)
            total -= sess.nbytes
            self._dropped(sess)
            self.evictions += 1

"""The fleet's acceptance priors for spec=auto, in Redis: per model pair (the target's and
the drafter's revisions) and proposer, how often draft position i was tried and accepted,
summed over every router replica's finished requests. A request starts from them (the
policy's ``priors``) instead of a fixed guess.

One small hash per (revisions, proposer), ``{prefix}{target_rev}:{drafter_rev}:{proposer}``,
fields ``t{i}`` (tried) and ``a{i}`` (accepted); and one per workload class a request names
(``...:{proposer}:w:{class}``), which a request of that class starts from where it has
enough observations. Off the per-round path: read at request
start (cached for ``cache_s`` per router), added to at request end by a background task.
Redis away or failing: the request uses the built-in prior; failures are counted
(``failures``, and ``on_error(op)`` for the metrics), never raised.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from specserve.policy import PROPOSERS

log = logging.getLogger(__name__)

MIN_TRIED = 16  # a position with fewer fleet observations keeps the built-in prior
TTL_S = 7 * 24 * 3600


class PriorStore:
    def __init__(self, redis_url: str | None, prefix: str = "specserve:priors:",
                 cache_s: float = 5.0, on_error: Callable[[str], None] | None = None):
        self.prefix, self.cache_s, self.on_error = prefix, cache_s, on_error
        self.failures = 0
        self._cache: dict[tuple[tuple[str, str], str | None],
                          tuple[float, dict[str, list[float]]]] = {}
        self._tasks: set[asyncio.Task] = set()
        self._redis = None
        if redis_url:
            import redis.asyncio as aioredis

            self._redis = aioredis.from_url(redis_url, socket_timeout=0.5,
                                            socket_connect_timeout=0.5)

    def key(self, revisions: tuple[str, str], proposer: str,
            workload: str | None = None) -> str:
        base = f"{self.prefix}{revisions[0]}:{revisions[1]}:{proposer}"
        return base if workload is None else f"{base}:w:{workload}"

    async def read(self, revisions: tuple[str, str],
                   workload: str | None = None) -> dict[str, list[float]] | None:
        """Per proposer, the fleet's acceptance rate at each draft position (a position
        with too few observations, and those after it, are left out); None: no store. With
        a workload class: the class's rates where it has enough observations, the pair's
        beyond them."""
        if self._redis is None:
            return None
        hit = self._cache.get((revisions, workload))
        if hit is not None and time.monotonic() - hit[0] < self.cache_s:
            return hit[1]
        classes = [None] if workload is None else [None, workload]
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for w in classes:
                    for p in PROPOSERS:
                        pipe.hgetall(self.key(revisions, p, w))
                raw = await pipe.execute()
        except Exception as e:
            self._fail("read", e)
            return None
        pair = [rates(h) for h in raw[: len(PROPOSERS)]]
        own = [rates(h) for h in raw[len(PROPOSERS):]] or [[] for _ in PROPOSERS]
        priors = {p: [*mine, *fleet[len(mine):]]
                  for p, fleet, mine in zip(PROPOSERS, pair, own, strict=True)}
        self._cache[(revisions, workload)] = (time.monotonic(), priors)
        return priors

    def add(self, revisions: tuple[str, str], counts: dict[str, list[list[int]]],
            workload: str | None = None) -> None:
        """Add one request's (tried, accepted) per position and proposer, in the background
        (to the pair's totals, and to its workload class's when it has one)."""
        if self._redis is None or not any(any(t) for t, _ in counts.values()):
            return
        task = asyncio.get_running_loop().create_task(self._add(revisions, counts, workload))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _add(self, revisions: tuple[str, str], counts: dict[str, list[list[int]]],
                   workload: str | None) -> None:
        assert self._redis is not None
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for w in [None] if workload is None else [None, workload]:
                    for p, (tried, accepted) in counts.items():
                        key = self.key(revisions, p, w)
                        for i, (t, a) in enumerate(zip(tried, accepted, strict=True)):
                            if t:
                                pipe.hincrby(key, f"t{i}", t)
                                pipe.hincrby(key, f"a{i}", a)
                        pipe.expire(key, TTL_S)
                await pipe.execute()
        except Exception as e:
            self._fail("write", e)

    def _fail(self, op: str, e: Exception) -> None:
        self.failures += 1
        log.warning("spec=auto priors: %s failed (redis unavailable?): %s", op, e)
        if self.on_error is not None:
            self.on_error(op)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._redis is not None:
            await self._redis.aclose()


def rates(fields: dict) -> list[float]:
    """Acceptance rate per position from a hash's t{i} / a{i} counts (bytes or str)."""
    h = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in fields.items()}
    out = []
    for i in range(len(h)):
        tried = h.get(f"t{i}", 0)
        if tried < MIN_TRIED:
            break
        out.append(min(max(h.get(f"a{i}", 0) / tried, 0.0), 1.0))
    return out

"""The request journal in Redis: committed tokens per request id.

A client retry (same request id) or a router restart resumes from the journal: tokens that
were committed are never generated twice and never lost. Redis being briefly unavailable
degrades the service (no resume) but never fails a request; ``degraded`` counts that.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

TTL_S = 3600


class Journal:
    def __init__(self, redis_url: str | None, prefix: str = "specserve:journal:"):
        self.prefix = prefix
        self.degraded = 0
        self._redis = None
        if redis_url:
            import redis.asyncio as aioredis

            self._redis = aioredis.from_url(redis_url, socket_timeout=0.5,
                                            socket_connect_timeout=0.5)

    async def load(self, request_id: str) -> tuple[list[int], str | None]:
        """(committed output tokens, finish reason or None) journaled for this request."""
        if self._redis is None:
            return [], None
        try:
            key = self.prefix + request_id
            raw, finish = await self._redis.lrange(key, 0, -1), await self._redis.get(key + ":done")
        except Exception as e:
            self._degrade(e)
            return [], None
        tokens = [int(x) for chunk in raw for x in chunk.split(b",") if x]
        return tokens, finish.decode() if finish else None

    async def append(self, request_id: str, tokens: list[int]) -> None:
        if self._redis is None or not tokens:
            return
        try:
            key = self.prefix + request_id
            async with self._redis.pipeline(transaction=False) as p:
                p.rpush(key, ",".join(map(str, tokens)))
                p.expire(key, TTL_S)
                await p.execute()
        except Exception as e:
            self._degrade(e)

    async def finish(self, request_id: str, reason: str) -> None:
        if self._redis is None:
            return
        try:
            await self._redis.set(self.prefix + request_id + ":done", reason, ex=TTL_S)
        except Exception as e:
            self._degrade(e)

    def _degrade(self, e: Exception) -> None:
        self.degraded += 1
        log.warning("journal degraded (redis unavailable): %s", e)

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()

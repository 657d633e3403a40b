"""The request journal in Redis: a cache of each request's committed tokens.

It is never the only truth. Generation is deterministic given (prompt, parameters, seed,
model revisions), so a missing or short entry means "regenerate", never "answer with what is
there". An entry is keyed by caller and request id and bound to a digest of the request's
content: the same request id with other content is refused (``AlreadyExists``), never
answered with another request's tokens.

One Redis hash per request, ``{prefix}{caller}:{request_id}``:

    d  digest of the request's content     s  the effective seed
    n  tokens journaled                    t  the tokens, "1,2,3,"      f  finish reason

Every write is one Lua script that checks ``n`` first (an append says which count it extends),
so a write after the entry was lost (Redis restarted or flushed) or from a stale second
router can never leave a gap or a duplicate: it is refused, and the request stops journaling
(its tokens are still reproducible). Write failures are counted (``write_failures``), each
retried once; Redis being away degrades the service (no resume without regenerating) but
never fails a request; ``degraded`` counts that. Memory is bounded: every entry has a TTL,
entries hold at most ``max_tokens`` (65,536) tokens, and the embedded Redis runs with
``maxmemory`` (``deployments/local.py``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from specserve.errors import AlreadyExists

log = logging.getLogger(__name__)

TTL_S = 3600

# Create the entry bound to (digest, seed), or return the one there: {created, d, s, n, t, f}.
_OPEN = """
redis.call('DEL', KEYS[2])  -- a new attempt: an earlier cancel is over
local d = redis.call('HGET', KEYS[1], 'd')
if not d then
  redis.call('HSET', KEYS[1], 'd', ARGV[1], 's', ARGV[2], 'n', '0', 't', '')
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  return {1, ARGV[1], ARGV[2], '0', '', ''}
end
local v = redis.call('HMGET', KEYS[1], 's', 'n', 't', 'f')
return {0, d, v[1] or '', v[2] or '0', v[3] or '', v[4] or ''}
"""

# Append tokens (and a finish reason) iff the entry exists, is bound to this digest and
# holds exactly ARGV[2] tokens. Returns 1, 0 when refused, 2 when the caller cancelled the
# request (KEYS[2] set by ``cancel``: any router replica may receive the cancel).
_APPEND = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 2 end
local v = redis.call('HMGET', KEYS[1], 'd', 'n', 't', 'f')
if v[1] ~= ARGV[1] or v[2] ~= ARGV[2] or (v[4] and v[4] ~= '') then return 0 end
redis.call('HSET', KEYS[1], 't', (v[3] or '') .. ARGV[3], 'n', ARGV[4])
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'f', ARGV[5]) end
redis.call('EXPIRE', KEYS[1], ARGV[6])
return 1
"""


@dataclass
class Entry:
    """One request's journal entry as this router sees it."""

    key: str
    digest: str
    seed: int
    tokens: list[int] = field(default_factory=list)  # journaled before this attempt
    finish: str | None = None
    count: int = 0  # tokens the entry holds now (what the next append extends)
    broken: bool = False  # a write was refused or failed: no more writes for this request
    cancelled: bool = False  # the caller cancelled it (``Journal.cancel``, any router)


class Journal:
    def __init__(self, redis_url: str | None, prefix: str = "specserve:journal:",
                 ttl_s: int = TTL_S):
        self.prefix = prefix
        self.ttl_s = int(ttl_s)
        self.degraded = 0  # calls that found Redis unavailable
        self.write_failures = 0  # appends that failed or were refused (entry lost, raced)
        self._redis = None
        if redis_url:
            import redis.asyncio as aioredis

            self._redis = aioredis.from_url(redis_url, socket_timeout=0.5,
                                            socket_connect_timeout=0.5)
            self._open = self._redis.register_script(_OPEN)
            self._append = self._redis.register_script(_APPEND)

    def key(self, caller: str, request_id: str) -> str:
        return f"{self.prefix}{caller}:{request_id}"

    async def open(self, caller: str, request_id: str, digest: str, seed: int) -> Entry | None:
        """The request's entry: created bound to ``digest`` and ``seed``, or the existing one
        with the tokens it holds. Raises ``AlreadyExists`` when the request id was used for
        other content. None when there is no journal or Redis is unavailable."""
        if self._redis is None:
            return None
        key = self.key(caller, request_id)
        try:
            _, d, s, n, t, f = await self._open(keys=[key, key + ":cancel"],
                                                args=[digest, str(seed), self.ttl_s])
        except Exception as e:
            self._degrade(e)
            return None
        if d.decode() != digest:
            raise AlreadyExists(
                f"request_id {request_id!r} was already used for a request with other "
                "content (prompt or parameters); use a new request_id")
        tokens = [int(x) for x in t.split(b",") if x]
        entry = Entry(key, digest, int(s or seed), count=int(n))
        if len(tokens) != entry.count:  # torn entry: trust nothing, stop writing to it
            log.warning("journal entry %s holds %d tokens, says %d; ignored", key,
                        len(tokens), entry.count)
            entry.broken = True
            return entry
        entry.tokens, entry.finish = tokens, (f.decode() or None)
        return entry

    async def append(self, entry: Entry | None, tokens: list[int],
                     finish: str | None = None) -> bool:
        """Journal ``tokens`` (and the finish reason) after the ``entry.count`` already there.
        False (counted) when it could not: the request then stops journaling."""
        if entry is None or entry.broken or self._redis is None or not (tokens or finish):
            return False
        args = [entry.digest, str(entry.count), "".join(f"{t}," for t in tokens),
                str(entry.count + len(tokens)), finish or "", self.ttl_s]
        for attempt in range(2):
            try:
                ok = await self._append(keys=[entry.key, entry.key + ":cancel"], args=args)
                break
            except Exception as e:
                if attempt == 1:
                    self._degrade(e)
                    ok = 0
                else:
                    await asyncio.sleep(0.05)
        if ok == 2:
            entry.cancelled = True
            return False
        if not ok:
            self.write_failures += 1
            entry.broken = True
            log.warning("journal write for %s refused or failed (entry lost or raced); the "
                        "request continues unjournaled", entry.key)
            return False
        entry.count += len(tokens)
        return True

    async def cancel(self, caller: str, request_id: str) -> bool:
        """Mark the request cancelled: whichever router runs it stops at its next write (one
        round). For callers whose cancellation Serve's proxy does not pass on (a client
        cancel can be lost there); the SDK sends it when a stream is closed early."""
        if self._redis is None:
            return False
        try:
            await self._redis.set(self.key(caller, request_id) + ":cancel", "1",
                                  ex=min(self.ttl_s, 600))
            return True
        except Exception as e:
            self._degrade(e)
            return False

    def _degrade(self, e: Exception) -> None:
        self.degraded += 1
        log.warning("journal degraded (redis unavailable): %s", e)

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()

"""Authentication of the public API (API keys) and of the data plane (a shared secret).

API keys: ``name: key`` pairs from a file (YAML/JSON mapping, or ``name:key`` lines; read
again when it changes, so keys rotate without a restart) and/or an environment variable
(``SPECSERVE_API_KEYS="alice:k1,bob:k2"``). A call presents ``authorization: Bearer KEY``;
the key's *name* is the caller (it scopes the caller's journal entries). Keys are compared
in constant time (sha256 digests, ``hmac.compare_digest`` against every key), and only
their digests are kept in memory.

Data plane: every router -> drafter / target stream carries ``x-specserve-peer: SECRET``
(``PEER_KEY``); the replicas' servers refuse any stream without it (``PeerAuthInterceptor``).

No torch here.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import threading
import time
from collections.abc import Iterable

import grpc

from specserve.errors import Unauthenticated

PEER_KEY = "x-specserve-peer"
ENV_KEYS = "SPECSERVE_API_KEYS"
MAX_KEY_LEN = 512


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys(text: str) -> dict[str, str]:
    """``name -> key`` from a file's text: a JSON/YAML mapping or ``name:key`` lines/pairs
    (comma- or newline-separated; ``#`` comments)."""
    text = text.strip()
    if text.startswith("{"):
        data = json.loads(text)
    else:
        data = {}
        for part in text.replace(",", "\n").splitlines():
            part = part.split("#", 1)[0].strip()
            if not part:
                continue
            name, sep, key = part.partition(":")
            if not sep:
                raise ValueError("API keys: expected 'name: key' entries")
            data[name.strip()] = key.strip().strip("'\"")
    if not isinstance(data, dict):
        raise ValueError("API keys: expected a mapping of caller name to key")
    out = {}
    for name, key in data.items():
        if not name or not isinstance(key, str) or not 16 <= len(key) <= MAX_KEY_LEN:
            raise ValueError(f"API keys: {name!r}: keys must be strings of 16..512 characters")
        out[str(name)] = key
    return out


class KeyStore:
    """The API keys in force. ``check`` is called on every public call."""

    def __init__(self, path: str | None = None, env: str | None = ENV_KEYS,
                 reload_s: float = 1.0):
        self.path = path
        self.env = env
        self.reload_s = reload_s
        self._lock = threading.Lock()
        self._stamp: tuple[float, int] | None = None
        self._checked = 0.0
        self._keys: list[tuple[bytes, str]] = []
        self._load(force=True)

    @property
    def enabled(self) -> bool:
        return bool(self._keys) or self.path is not None

    def _load(self, force: bool = False) -> None:
        keys: dict[str, str] = {}
        if self.env and os.environ.get(self.env):
            keys.update(parse_keys(os.environ[self.env]))
        if self.path is not None:
            st = os.stat(self.path)
            stamp = (st.st_mtime, st.st_size)
            if not force and stamp == self._stamp:
                return
            with open(self.path) as f:
                keys.update(parse_keys(f.read()))
            self._stamp = stamp
        self._keys = [(_digest(k), name) for name, k in keys.items()]

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if self.path is None or now - self._checked < self.reload_s:
            return
        with self._lock:
            self._checked = now
            with contextlib.suppress(OSError, ValueError):  # half-written: keep the old keys
                self._load()

    def caller(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """The caller's name for this call's ``authorization`` metadata, or
        ``Unauthenticated``."""
        self._maybe_reload()
        token = None
        for k, v in metadata or ():
            if k.lower() == "authorization":
                token = v.decode(errors="replace") if isinstance(v, bytes) else v
                break
        if token is None:
            raise Unauthenticated("missing API key: send 'authorization: Bearer <key>'")
        scheme, _, key = token.partition(" ")
        if scheme.lower() != "bearer" or not key or len(key) > MAX_KEY_LEN:
            raise Unauthenticated("malformed authorization: expected 'Bearer <key>'")
        presented = _digest(key.strip())
        found = None
        for digest, name in self._keys:  # every key, so the time says nothing
            if hmac.compare_digest(digest, presented) and found is None:
                found = name
        if found is None:
            raise Unauthenticated("unknown API key")
        return found


def peer_ok(metadata: Iterable[tuple[str, str | bytes]] | None, secret: str) -> bool:
    want = _digest(secret)
    for k, v in metadata or ():
        if k == PEER_KEY:
            value = v.decode(errors="replace") if isinstance(v, bytes) else v
            return hmac.compare_digest(_digest(value), want)
    return False


class PeerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call to a data-plane server that lacks the shared secret."""

    def __init__(self, secret: str):
        self.secret = secret

    async def intercept_service(self, continuation, handler_call_details):
        if peer_ok(handler_call_details.invocation_metadata, self.secret):
            return await continuation(handler_call_details)
        return _refuse_handler()


def _refuse_handler() -> grpc.RpcMethodHandler:
    async def refuse_stream(request_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            f"data plane: missing or wrong {PEER_KEY}")
        yield  # pragma: no cover - abort raises

    return grpc.stream_stream_rpc_method_handler(refuse_stream)

"""Exactly-once delivery across retries: what a client and the service agree on.

* The request's content digest (every field but ``request_id``) binds a journal entry to the
  request; a request id reused for other content is refused.
* The effective seed: the request's, else derived from (caller, request id, digest), so a
  regenerated request samples the same tokens with or without the journal.
* A retried stream tells the service what the caller already holds (metadata
  ``specserve-resume: TOKENS,CHARS,DIGEST``: token count, text length in characters and a
  digest of those token ids); the service sends only the rest, and checks the regenerated
  tokens against the digest (``DataLoss`` if they differ, never a silent mismatch).
* ``specserve-cancel: 1`` (with ``request_id``): stop that request wherever it runs; the SDK
  sends it when a stream is closed early, because Ray Serve's proxy does not always pass a
  client's cancellation on to the replica.
* ``specserve-deadline-ms``: the caller's remaining deadline when it sent the call; the
  service stops the request when it passes (gRPC's own deadline is not visible behind Ray
  Serve's proxy).

No torch, no gRPC: the light client install imports it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

RESUME_KEY = "specserve-resume"
DEADLINE_KEY = "specserve-deadline-ms"
CANCEL_KEY = "specserve-cancel"  # "1": cancel the request named by request_id (any router)
CALLER_ANONYMOUS = "anonymous"


def tokens_digest(token_ids: Sequence[int]) -> str:
    """A short digest of a token id sequence (what a caller holds)."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:32]


def request_digest(content: dict[str, Any]) -> str:
    """The digest of a request's content (a ``GenerationRequest.model_dump()`` without the
    request id and the workload class, which change nothing it produces): canonical JSON,
    so field order and defaults do not matter."""
    content = {k: v for k, v in content.items() if k not in ("request_id", "workload")}
    blob = json.dumps(content, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def derive_seed(caller: str, request_id: str, digest: str) -> int:
    """The seed of a request that gave none: fixed by who asked what under which id."""
    h = hashlib.sha256(f"{caller}\0{request_id}\0{digest}".encode()).digest()
    return int.from_bytes(h[:8], "little") >> 1


@dataclass(frozen=True)
class ResumePoint:
    """What the caller already holds of this request's output."""

    tokens: int = 0
    chars: int = 0
    digest: str = ""

    def header(self) -> str:
        return f"{self.tokens},{self.chars},{self.digest}"

    @classmethod
    def parse(cls, value: str | None) -> ResumePoint:
        """From the metadata value; raises ValueError when malformed."""
        if not value:
            return cls()
        parts = value.split(",")
        if len(parts) != 3 or len(value) > 128:
            raise ValueError(f"{RESUME_KEY}: expected 'TOKENS,CHARS,DIGEST'")
        tokens, chars = int(parts[0]), int(parts[1])
        if not (0 <= tokens <= 1 << 20 and 0 <= chars <= 1 << 26):
            raise ValueError(f"{RESUME_KEY}: counts out of range")
        if tokens and not _is_digest(parts[2]):
            raise ValueError(f"{RESUME_KEY}: a digest of the held tokens (32 hex digits) is "
                             "required")
        return cls(tokens, chars, parts[2])


def _is_digest(text: str) -> bool:
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)


def parse_deadline_ms(value: str | None) -> float | None:
    """Seconds left, from ``specserve-deadline-ms``; None when absent. ValueError if bad."""
    if not value:
        return None
    ms = float(value)
    if not 0 <= ms <= 1e10:
        raise ValueError(f"{DEADLINE_KEY}: out of range")
    return ms / 1000.0

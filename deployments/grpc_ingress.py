"""The public ``specserve.v1.SpecServe`` methods on the Router deployment.

Every call is, in order: authenticated (``Ingress.keys``: UNAUTHENTICATED without a known
API key), decoded from raw bytes (``grpc_raw.py``: garbage is INVALID_ARGUMENT, bounded by
``max_message_bytes``), validated (``GenerationRequest``, the one validation path; the
prompt's byte size is checked before anything tokenizes it), then generated. The metadata's
``request_id``, ``specserve-resume`` and ``specserve-deadline-ms`` are validated the same
way. Errors map to gRPC status codes through the one mapping
(``specserve.grpc_api.status_of``). Ray Serve's gRPC context cannot abort: a status is set on
it and an exception raised, which Serve's proxy turns into that status.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from router.router import Call, Router
from specserve.api import GenerationRequest
from specserve.auth import KeyStore
from specserve.errors import RequestError
from specserve.grpc_api import (
    abort_with_status,
    chunk_to_proto,
    request_from_proto,
    response_to_proto,
)
from specserve.proto_gen.specserve.v1 import specserve_pb2 as pb
from specserve.resume import (
    CALLER_ANONYMOUS,
    CANCEL_KEY,
    DEADLINE_KEY,
    RESUME_KEY,
    ResumePoint,
    parse_deadline_ms,
)
from specserve.tracing import context_from_metadata, tracer


class RequestFailed(Exception):
    """Raised after a status was set on the Serve gRPC context."""


@dataclass
class Ingress:
    """What the public methods need besides the router: the API keys (None: open) and the
    input bounds."""

    router: Router
    keys: KeyStore | None = None
    max_message_bytes: int = 4 << 20
    max_prompt_bytes: int = 256 << 10

    def caller(self, ctx) -> str:
        if self.keys is None or not self.keys.enabled:
            return CALLER_ANONYMOUS
        return self.keys.caller(ctx.invocation_metadata() if ctx is not None else ())


async def _fail(ctx, err: BaseException) -> RequestFailed:
    if ctx is not None:
        await abort_with_status(ctx, err)
    return RequestFailed(str(err))


def _metadata(ctx) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in (ctx.invocation_metadata() or ()) if ctx is not None else ():
        out.setdefault(key, value if isinstance(value, str) else value.decode("latin-1"))
    return out


def decode(ing: Ingress, request) -> GenerationRequest:
    """Raw bytes (or a message) -> the validated request. The prompt's size is checked on
    the wire message, before validation or tokenization touch it."""
    if isinstance(request, (bytes, bytearray, memoryview)):
        if len(request) > ing.max_message_bytes:
            raise RequestError(f"request: {len(request)} bytes, at most "
                               f"{ing.max_message_bytes}")
        try:
            request = pb.GenerateRequest.FromString(bytes(request))
        except (DecodeError, ValueError) as e:
            raise RequestError(f"request: not a specserve.v1.GenerateRequest ({e})") from None
    n = len(request.prompt.encode("utf-8", "surrogatepass")) if request.prompt else 0
    if n > ing.max_prompt_bytes:
        raise RequestError(f"prompt: {n} bytes, at most {ing.max_prompt_bytes}; shorten it")
    return request_from_proto(request)


def call_of(ing: Ingress, req: GenerationRequest, ctx) -> tuple[str | None, Call]:
    """The request id (body, else metadata, validated like the body's) and the call's
    caller, resume point and deadline."""
    caller = ing.caller(ctx)
    md = _metadata(ctx)
    request_id = req.request_id
    if request_id is None and md.get("request_id"):
        request_id = GenerationRequest.model_validate(
            {"prompt": "x", "request_id": md["request_id"]}).request_id
    try:
        resume = ResumePoint.parse(md.get(RESUME_KEY))
        left = parse_deadline_ms(md.get(DEADLINE_KEY))
    except ValueError as e:
        raise RequestError(str(e)) from None
    deadline = time.monotonic() + left if left is not None else None
    return request_id, Call(caller, resume, deadline)


async def cancel_call(ing: Ingress, ctx) -> bool:
    """A ``specserve-cancel`` call: mark the caller's request cancelled (the router running
    it stops at its next round). False when this call is no cancel."""
    md = _metadata(ctx)
    if md.get(CANCEL_KEY) != "1":
        return False
    caller = ing.caller(ctx)
    request_id = GenerationRequest.model_validate(
        {"prompt": "x", "request_id": md.get("request_id") or None}).request_id
    if not request_id:
        raise RequestError(f"{CANCEL_KEY}: name the request in the request_id metadata")
    await ing.router.journal.cancel(caller, request_id)
    return True


def _parent(ctx):
    """The client's trace context (W3C ``traceparent`` metadata), when tracing is on."""
    if ctx is None or tracer() is None:
        return None
    return context_from_metadata(ctx.invocation_metadata())


async def generate_stream(ing: Ingress, request, ctx):
    try:
        if await cancel_call(ing, ctx):
            yield chunk_to_proto("", [], "abort", None)
            return
        req = decode(ing, request)
        request_id, call = call_of(ing, req, ctx)
        async with contextlib.aclosing(  # a cancelled stream stops the request now
                ing.router.generate(req, request_id, _parent(ctx), call)) as chunks:
            async for ch in chunks:
                yield chunk_to_proto(ch.text, ch.token_ids, ch.finish_reason, ch.stats,
                                     ch.logprobs)
    except RequestFailed:
        raise
    except Exception as e:
        ing.router.count_error(e)
        raise await _fail(ctx, e) from e


async def generate_unary(ing: Ingress, request, ctx):
    text, ids, finish, stats, lps = [], [], "", None, []
    try:
        if await cancel_call(ing, ctx):
            return response_to_proto("", [], "abort", {})
        req = decode(ing, request)
        request_id, call = call_of(ing, req, ctx)
        call.resume = ResumePoint()  # a unary caller holds nothing
        async with contextlib.aclosing(
                ing.router.generate(req, request_id, _parent(ctx), call)) as chunks:
            async for ch in chunks:
                text.append(ch.text)
                ids.extend(ch.token_ids)
                lps.extend(ch.logprobs or ())
                finish, stats = ch.finish_reason or finish, ch.stats or stats
    except Exception as e:
        ing.router.count_error(e)
        raise await _fail(ctx, e) from e
    return response_to_proto("".join(text), ids, finish, stats,
                             lps if req.logprobs is not None else None)


class Health:
    """``grpc.health.v1.Health/Check``: SERVING only when a target replica answers (asked
    at most once a second), and, with API keys, only for an authenticated caller."""

    SERVICES = ("", "specserve.v1.SpecServe")

    def __init__(self, ing: Ingress, target_handle, timeout_s: float = 2.0):
        self.ing, self.target, self.timeout_s = ing, target_handle, timeout_s
        self._last: tuple[float, bool] = (0.0, False)

    async def _target_ok(self) -> bool:
        import asyncio

        at, ok = self._last
        if time.monotonic() - at < 1.0:
            return ok
        try:
            ok = bool(await asyncio.wait_for(self.target.ping.remote(), self.timeout_s))
        except Exception:
            ok = False
        self._last = (time.monotonic(), ok)
        return ok

    async def check(self, request, ctx):
        from grpc_health.v1 import health_pb2

        status = health_pb2.HealthCheckResponse
        try:
            self.ing.caller(ctx)
            if isinstance(request, (bytes, bytearray)):
                try:
                    request = health_pb2.HealthCheckRequest.FromString(bytes(request))
                except (DecodeError, ValueError) as e:
                    raise RequestError(f"request: not a HealthCheckRequest ({e})") from None
        except Exception as e:
            raise await _fail(ctx, e) from e
        if request.service not in self.SERVICES:
            return status(status=status.SERVICE_UNKNOWN)
        return status(status=status.SERVING if await self._target_ok() else status.NOT_SERVING)

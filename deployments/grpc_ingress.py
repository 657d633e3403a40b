"""The public ``specserve.v1.SpecServe`` methods on the Router deployment.

Errors map to gRPC status codes through the one mapping (``specserve.grpc_api.status_of``).
Ray Serve's gRPC context cannot abort: a status is set on it and an exception raised, which
Serve's proxy turns into that status.
"""

from __future__ import annotations

from router.router import Router
from specserve.grpc_api import (
    abort_with_status,
    chunk_to_proto,
    request_from_proto,
    response_to_proto,
)
from specserve.tracing import context_from_metadata, tracer


class RequestFailed(Exception):
    """Raised after a status was set on the Serve gRPC context."""


async def _fail(ctx, err: BaseException) -> RequestFailed:
    if ctx is not None:
        await abort_with_status(ctx, err)
    return RequestFailed(str(err))


def _request_id(request, ctx) -> str | None:
    if request.request_id:
        return request.request_id
    if ctx is not None:
        for key, value in ctx.invocation_metadata() or ():
            if key == "request_id" and value:
                return value
    return None


def _parent(ctx):
    """The client's trace context (W3C ``traceparent`` metadata), when tracing is on."""
    if ctx is None or tracer() is None:
        return None
    return context_from_metadata(ctx.invocation_metadata())


async def generate_stream(router: Router, request, ctx):
    try:
        req = request_from_proto(request)
        async for ch in router.generate(req, _request_id(request, ctx), _parent(ctx)):
            yield chunk_to_proto(ch.text, ch.token_ids, ch.finish_reason, ch.stats)
    except RequestFailed:
        raise
    except Exception as e:
        raise await _fail(ctx, e) from e


async def generate_unary(router: Router, request, ctx):
    text, ids, finish, stats = [], [], "", None
    try:
        req = request_from_proto(request)
        async for ch in router.generate(req, _request_id(request, ctx), _parent(ctx)):
            text.append(ch.text)
            ids.extend(ch.token_ids)
            finish, stats = ch.finish_reason or finish, ch.stats or stats
    except Exception as e:
        raise await _fail(ctx, e) from e
    return response_to_proto("".join(text), ids, finish, stats)

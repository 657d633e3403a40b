"""The public ``specserve.v1.SpecServe`` methods on the Router deployment.

Maps domain errors to gRPC status codes. Ray Serve's gRPC context cannot abort: a status is
set on it and an exception raised, which Serve's proxy turns into that status.
"""

from __future__ import annotations

import grpc
from pydantic import ValidationError

from router.core import Overloaded, RequestInvalid, RequestOutOfRange, RouterCore, TargetUnavailable
from specserve.api import describe_validation_error
from specserve.grpc_api import chunk_to_proto, request_from_proto, response_to_proto
from specserve.tracing import context_from_metadata, tracer


class RequestFailed(Exception):
    """Raised after a status was set on the Serve gRPC context."""


def status_of(err: BaseException) -> tuple[grpc.StatusCode, str] | None:
    if isinstance(err, ValidationError):
        return grpc.StatusCode.INVALID_ARGUMENT, describe_validation_error(err)
    for cls, code in ((RequestInvalid, grpc.StatusCode.INVALID_ARGUMENT),
                      (RequestOutOfRange, grpc.StatusCode.OUT_OF_RANGE),
                      (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
                      (TargetUnavailable, grpc.StatusCode.UNAVAILABLE)):
        if isinstance(err, cls):
            return code, str(err)
    return None


def _fail(ctx, err: BaseException) -> RequestFailed:
    status = status_of(err)
    if status is None:
        status = (grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}: {err}")
    if ctx is not None:
        ctx.set_code(status[0])
        ctx.set_details(status[1])
    return RequestFailed(status[1])


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


async def generate_stream(core: RouterCore, request, ctx):
    try:
        req = request_from_proto(request)
        async for ch in core.generate(req, _request_id(request, ctx), _parent(ctx)):
            yield chunk_to_proto(ch.text, ch.token_ids, ch.finish_reason, ch.stats)
    except RequestFailed:
        raise
    except Exception as e:
        raise _fail(ctx, e) from e


async def generate_unary(core: RouterCore, request, ctx):
    text, ids, finish, stats = [], [], "", None
    try:
        req = request_from_proto(request)
        async for ch in core.generate(req, _request_id(request, ctx), _parent(ctx)):
            text.append(ch.text)
            ids.extend(ch.token_ids)
            finish, stats = ch.finish_reason or finish, ch.stats or stats
    except Exception as e:
        raise _fail(ctx, e) from e
    return response_to_proto("".join(text), ids, finish, stats)

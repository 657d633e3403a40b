"""The specserve client SDK: sync ``Client`` and ``AsyncClient`` over gRPC.

Light install only (grpcio, protobuf, pydantic, numpy): no torch, ray or transformers.

    with Client("localhost:9000") as c:
        print(c.generate("Once upon a time", max_tokens=32).text)
        for chunk in c.stream("Once upon a time"):
            print(chunk.text, end="")

    async with AsyncClient("localhost:9000") as c:
        result = await c.generate("Once upon a time")
        async for chunk in c.stream("Once upon a time"):
            ...

Every call has a deadline (``timeout``: per call, else the client's); for a stream it covers
the whole stream. UNAVAILABLE, and a router replica that died (whatever status Ray Serve
gives it), are retried with exponential backoff and the same request_id (a uuid4 when none is
given), within the call's deadline, streams included: a retried stream tells the service
what it already holds (``specserve-resume``: tokens, characters, a digest of the token ids)
and receives only the rest, so every token reaches the caller exactly once; the service
checks that the rest continues what the caller holds. The remaining deadline goes with every
attempt (``specserve-deadline-ms``) and the service stops the work when it passes.
Stop a stream early by closing it (``close()`` / ``aclose()``, or leave
a ``for`` loop over it): the server-side call is cancelled. Every gRPC failure is raised as
``SpecServeError``. The server validates requests; the client checks only argument types.

Tracing: when the caller has an active OpenTelemetry span (``opentelemetry-api`` installed
and a span current), its W3C ``traceparent`` goes with the call as gRPC metadata, so the
server's spans of the request join the caller's trace. Nothing is imported otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import time
import uuid
from collections.abc import AsyncGenerator, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from specserve.api import TokenLogprob
from specserve.grpc_api import SPEC_TO_PROTO, logprobs_from_proto, stats_from_proto
from specserve.proto_gen.specserve.v1 import specserve_pb2 as pb
from specserve.proto_gen.specserve.v1 import specserve_pb2_grpc as pb_grpc
from specserve.resume import CANCEL_KEY, DEADLINE_KEY, RESUME_KEY, ResumePoint, tokens_digest

__all__ = ["AsyncClient", "Chunk", "Client", "Result", "SpecServeError", "health_check"]

_MAX_BACKOFF_S = 5.0
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})
# How Ray Serve reports a replica (the router) that died during a call: INTERNAL or UNKNOWN
# with Ray's actor-death error in the details. The request is retried like UNAVAILABLE.
_DEAD_REPLICA = ("actordiederror", "actor died", "the actor is dead", "rayactorerror",
                 "actorunavailableerror", "actor unavailable", "worker died",
                 "died unexpectedly", "replica died", "the replica is dead")


def _retryable(err: grpc.RpcError) -> bool:
    code_fn, details_fn = getattr(err, "code", None), getattr(err, "details", None)
    code = code_fn() if callable(code_fn) else None
    if code in _RETRYABLE:
        return True
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        details = (details_fn() if callable(details_fn) else "") or ""
        return any(m in details.lower() for m in _DEAD_REPLICA)
    return False


class _Held:
    """What a stream's caller holds so far (the resume point of a retry)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.chars = 0

    def add(self, chunk: Chunk) -> Chunk:
        self.tokens.extend(chunk.token_ids)
        self.chars += len(chunk.text)
        return chunk

    def metadata(self) -> tuple[tuple[str, str], ...]:
        if not self.tokens and not self.chars:
            return ()
        point = ResumePoint(len(self.tokens), self.chars, tokens_digest(self.tokens))
        return ((RESUME_KEY, point.header()),)


class SpecServeError(Exception):
    """A failed call: ``code`` is the grpc.StatusCode, ``details`` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str, request_id: str | None = None):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.request_id = request_id

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError, request_id: str | None = None) -> SpecServeError:
        code_fn = getattr(err, "code", None)
        details_fn = getattr(err, "details", None)
        code = code_fn() if callable(code_fn) else None
        details = details_fn() if callable(details_fn) else None
        return cls(code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN,
                   details or str(err), request_id)


@dataclass
class Result:
    """A whole generation."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict[str, Any]
    request_id: str = ""
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked


@dataclass
class Chunk:
    """A streamed delta; finish_reason and stats are set on the last chunk only."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked


def _check(name: str, value: Any, types: type | tuple[type, ...], *, minimum: float | None = None,
           optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, types):
        want = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
        raise TypeError(f"{name}: expected {want}, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}")


def _build_request(
    prompt: str | None, prompt_ids: Sequence[int] | None, max_tokens: int, temperature: float,
    top_k: int, top_p: float, seed: int | None, stop: Sequence[str], spec: str, k: int,
    request_id: str | None, logprobs: int | None = None, workload: str | None = None,
) -> pb.GenerateRequest:
    """The wire request; light type checks only (the server validates values)."""
    _check("prompt", prompt, str, optional=True)
    if prompt_ids is not None:
        if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence):
            raise TypeError("prompt_ids: expected a sequence of int")
        for t in prompt_ids:
            _check("prompt_ids", t, int)
    # max_tokens 0 means "default" on the wire, so 0 would silently become 64: refuse it here.
    _check("max_tokens", max_tokens, int, minimum=1)
    _check("temperature", temperature, (int, float))
    _check("top_k", top_k, int, minimum=0)
    _check("top_p", top_p, (int, float))
    _check("seed", seed, int, minimum=0, optional=True)
    if isinstance(stop, str) or not isinstance(stop, Sequence):
        raise TypeError("stop: expected a sequence of str")
    for s in stop:
        _check("stop", s, str)
    _check("spec", spec, str)
    spec_num = SPEC_TO_PROTO.get(str(spec).lower())
    if spec_num is None:
        raise ValueError(f"spec: expected one of {sorted(SPEC_TO_PROTO)}, got {spec!r}")
    _check("k", k, int, minimum=0)
    _check("request_id", request_id, str, optional=True)
    msg = pb.GenerateRequest(
        prompt=prompt or "", prompt_ids=list(prompt_ids or ()), max_tokens=max_tokens,
        temperature=float(temperature), top_k=top_k, top_p=float(top_p), stop=list(stop),
        spec=spec_num, k=k, request_id=request_id or str(uuid.uuid4()),
    )
    if seed is not None:
        msg.seed = seed
    _check("logprobs", logprobs, int, minimum=0, optional=True)
    if logprobs is not None:
        msg.logprobs = logprobs
    _check("workload", workload, str, optional=True)
    msg.workload = workload or ""
    return msg


def _trace_metadata() -> tuple[tuple[str, str], ...]:
    """The current span's W3C context (``traceparent``, ``tracestate``) as metadata; empty
    without an active span. A caller without OpenTelemetry imported has no span: no cost."""
    if "opentelemetry.trace" not in sys.modules:
        return ()
    from opentelemetry import propagate, trace

    if not trace.get_current_span().get_span_context().is_valid:
        return ()
    carrier: dict[str, str] = {}
    propagate.inject(carrier)  # the configured propagators (OTEL_PROPAGATORS)
    return tuple(carrier.items())


def _attempt_metadata(metadata: tuple[tuple[str, str], ...], left: float,
                      held: _Held | None = None) -> tuple[tuple[str, str], ...]:
    """One attempt's metadata: the call's, its remaining deadline, what the caller holds."""
    return (*metadata, (DEADLINE_KEY, str(int(left * 1000))),
            *(held.metadata() if held is not None else ()))


def _chunk(msg: pb.GenerateChunk) -> Chunk:
    return Chunk(msg.text, list(msg.token_ids), msg.finish_reason or None,
                 stats_from_proto(msg.stats) if msg.HasField("stats") else None,
                 logprobs_from_proto(msg.logprobs) if len(msg.logprobs) else None)


def _result(msg: pb.GenerateResponse, request_id: str) -> Result:
    return Result(msg.text, list(msg.token_ids), msg.finish_reason, stats_from_proto(msg.stats),
                  request_id, logprobs_from_proto(msg.logprobs) if len(msg.logprobs) else None)


class _Base:
    """Configuration shared by Client and AsyncClient."""

    def __init__(self, address: str, *, timeout: float = 60.0, tls: bool = False,
                 root_certificates: bytes | str | None = None, token: str | None = None,
                 retries: int = 5, backoff: float = 0.25, app_name: str | None = "specserve"):
        _check("address", address, str)
        _check("timeout", timeout, (int, float))
        if timeout <= 0:
            raise ValueError("timeout: must be > 0 (every call has a deadline)")
        _check("retries", retries, int, minimum=0)
        _check("backoff", backoff, (int, float), minimum=0)
        _check("token", token, str, optional=True)
        _check("app_name", app_name, str, optional=True)
        if root_certificates is not None and not tls:
            raise ValueError("root_certificates: given without tls=True")
        self.address = address
        self.timeout = float(timeout)
        self.retries = retries
        self.backoff = float(backoff)
        self._tls = tls
        self._root_certificates = (root_certificates.encode() if isinstance(root_certificates, str)
                                   else root_certificates)
        self._base_metadata: tuple[tuple[str, str], ...] = tuple(
            [("authorization", f"Bearer {token}")] if token else []
        ) + tuple([("application", app_name)] if app_name else [])

    def _credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self._root_certificates)

    def _metadata(self, request_id: str) -> tuple[tuple[str, str], ...]:
        return (*self._base_metadata, ("request_id", request_id), *_trace_metadata())

    def _cancel_args(self, request_id: str) -> tuple[pb.GenerateRequest, dict]:
        """A best-effort cancel of a stream the caller closed early: Serve's proxy does not
        always pass the client's cancellation on, so the service is told explicitly."""
        return pb.GenerateRequest(request_id=request_id), {
            "timeout": 2.0, "metadata": (*self._base_metadata, ("request_id", request_id),
                                         (CANCEL_KEY, "1"))}

    def _deadline(self, timeout: float | None) -> float:
        _check("timeout", timeout, (int, float), optional=True)
        t = self.timeout if timeout is None else float(timeout)
        if t <= 0:
            raise ValueError("timeout: must be > 0")
        return time.monotonic() + t

    def _retry_delay(self, attempt: int, err: grpc.RpcError, deadline: float) -> float | None:
        """Seconds to wait before retrying after ``err``, or None to give up."""
        code_fn = getattr(err, "code", None)
        if attempt >= self.retries or not callable(code_fn) or not _retryable(err):
            return None
        delay = min(self.backoff * 2**attempt, _MAX_BACKOFF_S) * random.uniform(0.5, 1.0)
        # Retry only if the attempt after the wait still has some of the deadline left.
        if time.monotonic() + delay >= deadline - 0.01:
            return None
        return delay


class Client(_Base):
    """Synchronous client. Use as a context manager, or call ``close()``.

    ``retries``: how many times a failure is retried (UNAVAILABLE or a router that died;
    after the first attempt, streams included, resuming where they stopped); the n-th
    retry waits about ``backoff * 2**n`` seconds (jittered, at most 5 s). ``token`` is sent as
    a bearer token, ``app_name`` as the "application" metadata Ray Serve's gRPC proxy routes
    by (None to omit).
    """

    def __init__(self, address: str, *, timeout: float = 60.0, tls: bool = False,
                 root_certificates: bytes | str | None = None, token: str | None = None,
                 retries: int = 5, backoff: float = 0.25, app_name: str | None = "specserve"):
        super().__init__(address, timeout=timeout, tls=tls, root_certificates=root_certificates,
                         token=token, retries=retries, backoff=backoff, app_name=app_name)
        self._channel = (grpc.secure_channel(address, self._credentials()) if tls
                         else grpc.insecure_channel(address))
        self._stub = pb_grpc.SpecServeStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompt: str | None = None, *, prompt_ids: Sequence[int] | None = None,
                 max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] = (),
                 spec: str = "auto", k: int = 4, request_id: str | None = None,
                 timeout: float | None = None, logprobs: int | None = None,
                 workload: str | None = None) -> Result:
        """The whole generation in one call (the unary RPC)."""
        req = _build_request(prompt, prompt_ids, max_tokens, temperature, top_k, top_p, seed,
                             stop, spec, k, request_id, logprobs, workload)
        deadline = self._deadline(timeout)
        metadata = self._metadata(req.request_id)
        attempt = 0
        while True:
            try:
                left = max(deadline - time.monotonic(), 0.0)
                resp = self._stub.GenerateUnary(req, timeout=left,
                                                metadata=_attempt_metadata(metadata, left))
                return _result(resp, req.request_id)
            except grpc.RpcError as err:
                delay = self._retry_delay(attempt, err, deadline)
                if delay is None:
                    raise SpecServeError.from_rpc_error(err, req.request_id) from None
            time.sleep(delay)
            attempt += 1

    def stream(self, prompt: str | None = None, *, prompt_ids: Sequence[int] | None = None,
               max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] = (),
               spec: str = "auto", k: int = 4, request_id: str | None = None,
               timeout: float | None = None,
               logprobs: int | None = None,
               workload: str | None = None) -> Generator[Chunk, None, None]:
        """Text deltas as they are generated. Arguments are checked now; the call starts at
        the first ``next()``. ``close()`` the generator to cancel the call."""
        req = _build_request(prompt, prompt_ids, max_tokens, temperature, top_k, top_p, seed,
                             stop, spec, k, request_id, logprobs, workload)
        return self._stream(req, self._deadline(timeout))

    def _stream(self, req: pb.GenerateRequest, deadline: float) -> Generator[Chunk, None, None]:
        metadata = self._metadata(req.request_id)
        attempt, held = 0, _Held()
        while True:
            left = max(deadline - time.monotonic(), 0.0)
            call = self._stub.Generate(req, timeout=left,
                                       metadata=_attempt_metadata(metadata, left, held))
            try:
                for msg in call:
                    yield held.add(_chunk(msg))
                return
            except GeneratorExit:  # closed by the caller before the end
                call.cancel()
                msg, kw = self._cancel_args(req.request_id)
                with contextlib.suppress(grpc.RpcError):
                    self._stub.GenerateUnary(msg, **kw)
                raise
            except grpc.RpcError as err:
                delay = self._retry_delay(attempt, err, deadline)
                if delay is None:
                    raise SpecServeError.from_rpc_error(err, req.request_id) from None
            finally:
                call.cancel()  # no-op once the call has ended; cancels it on close()
            time.sleep(delay)
            attempt += 1


class AsyncClient(_Base):
    """The asyncio client (grpc.aio): same arguments and behaviour as ``Client``.

    Use ``async with`` or ``await close()``. The channel is created on first use, inside the
    running event loop.
    """

    _channel: grpc.aio.Channel | None = None
    _stub_obj: pb_grpc.SpecServeStub

    def _stub(self) -> pb_grpc.SpecServeStub:
        if self._channel is None:
            self._channel = (grpc.aio.secure_channel(self.address, self._credentials())
                             if self._tls else grpc.aio.insecure_channel(self.address))
            self._stub_obj = pb_grpc.SpecServeStub(self._channel)
        return self._stub_obj

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def generate(self, prompt: str | None = None, *,
                       prompt_ids: Sequence[int] | None = None, max_tokens: int = 64,
                       temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                       seed: int | None = None, stop: Sequence[str] = (), spec: str = "auto",
                       k: int = 4, request_id: str | None = None,
                       timeout: float | None = None, logprobs: int | None = None,
                       workload: str | None = None) -> Result:
        """The whole generation in one call (the unary RPC)."""
        req = _build_request(prompt, prompt_ids, max_tokens, temperature, top_k, top_p, seed,
                             stop, spec, k, request_id, logprobs, workload)
        deadline = self._deadline(timeout)
        metadata = self._metadata(req.request_id)
        attempt = 0
        while True:
            try:
                left = max(deadline - time.monotonic(), 0.0)
                resp = await self._stub().GenerateUnary(
                    req, timeout=left, metadata=_attempt_metadata(metadata, left))
                return _result(resp, req.request_id)
            except grpc.RpcError as err:
                delay = self._retry_delay(attempt, err, deadline)
                if delay is None:
                    raise SpecServeError.from_rpc_error(err, req.request_id) from None
            await asyncio.sleep(delay)
            attempt += 1

    def stream(self, prompt: str | None = None, *, prompt_ids: Sequence[int] | None = None,
               max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] = (),
               spec: str = "auto", k: int = 4, request_id: str | None = None,
               timeout: float | None = None,
               logprobs: int | None = None,
               workload: str | None = None) -> AsyncGenerator[Chunk, None]:
        """Text deltas as an async iterator (``async for``). Arguments are checked now; the
        call starts at the first ``__anext__``. ``await it.aclose()`` to cancel the call
        (leaving an ``async for`` early cancels it only when the generator is finalized)."""
        req = _build_request(prompt, prompt_ids, max_tokens, temperature, top_k, top_p, seed,
                             stop, spec, k, request_id, logprobs, workload)
        return self._stream(req, self._deadline(timeout))

    async def _stream(self, req: pb.GenerateRequest,
                      deadline: float) -> AsyncGenerator[Chunk, None]:
        metadata = self._metadata(req.request_id)
        attempt, held = 0, _Held()
        while True:
            left = max(deadline - time.monotonic(), 0.0)
            call = self._stub().Generate(req, timeout=left,
                                         metadata=_attempt_metadata(metadata, left, held))
            try:
                async for msg in call:
                    yield held.add(_chunk(msg))
                return
            except GeneratorExit:  # closed by the caller before the end
                call.cancel()
                msg, kw = self._cancel_args(req.request_id)
                with contextlib.suppress(grpc.RpcError):
                    await self._stub().GenerateUnary(msg, **kw)
                raise
            except grpc.RpcError as err:
                delay = self._retry_delay(attempt, err, deadline)
                if delay is None:
                    raise SpecServeError.from_rpc_error(err, req.request_id) from None
            finally:
                call.cancel()
            await asyncio.sleep(delay)
            attempt += 1


def health_check(address: str, *, service: str = "", timeout: float = 5.0, tls: bool = False,
                 root_certificates: bytes | None = None, token: str | None = None) -> bool:
    """Whether the server at ``address`` reports SERVING on the standard gRPC health service
    (grpc.health.v1; ``service`` "" is the whole server). False when it is unreachable, not
    serving or does not know ``service``; other failures raise SpecServeError. Needs the
    grpcio-health-checking package."""
    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("health_check needs grpcio-health-checking: "
                          "pip install grpcio-health-checking") from e
    channel = (grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates))
               if tls else grpc.insecure_channel(address))
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    try:
        with channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout,
                metadata=metadata)
    except grpc.RpcError as err:
        e = SpecServeError.from_rpc_error(err)
        if e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                      grpc.StatusCode.NOT_FOUND):
            return False
        raise e from None
    return resp.status == health_pb2.HealthCheckResponse.SERVING


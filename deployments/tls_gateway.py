"""TLS on the public port: a gRPC front that terminates TLS and forwards each call, as raw
bytes, to Ray Serve's gRPC proxy.

Ray Serve 2.60's proxy only listens in plaintext (``add_insecure_port``), so with
``security.tls_cert`` / ``tls_key`` the public port is this gateway and Serve's proxy listens
on an internal port. The gateway forwards the public methods, the health check and server
reflection (so ``grpcurl``-style clients can list and call the API over TLS), passes the
caller's metadata on (the router authenticates it), bounds message size, and turns the
caller's gRPC deadline into ``specserve-deadline-ms`` so the service stops the work when it
passes. Cancelling a call here cancels it upstream.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import grpc

from specserve.resume import DEADLINE_KEY

UNARY = "unary_unary"
STREAM = "unary_stream"
BIDI = "stream_stream"
METHODS = {
    "/specserve.v1.SpecServe/Generate": STREAM,
    "/specserve.v1.SpecServe/GenerateUnary": UNARY,
    "/grpc.health.v1.Health/Check": UNARY,
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": BIDI,
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": BIDI,
}


def _forward_metadata(context) -> tuple[tuple[str, str], ...]:
    md = [(k, v) for k, v in context.invocation_metadata() or ()
          if not k.startswith((":", "grpc-")) and k not in ("user-agent", "te")]
    left = context.time_remaining()
    if left is not None and not any(k == DEADLINE_KEY for k, _ in md):
        md.append((DEADLINE_KEY, str(int(left * 1000))))
    return tuple(md)


class _Forward(grpc.GenericRpcHandler):
    def __init__(self, channel: grpc.aio.Channel):
        self.channel = channel

    def service(self, details):
        kind = METHODS.get(details.method)
        if kind is None:
            return None
        method, ch = details.method, self.channel

        async def unary(request: bytes, context):
            try:
                return await ch.unary_unary(method)(
                    request, metadata=_forward_metadata(context),
                    timeout=context.time_remaining())
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details() or "")

        async def stream(request: bytes, context):
            call = ch.unary_stream(method)(request, metadata=_forward_metadata(context),
                                           timeout=context.time_remaining())
            try:
                async for reply in call:
                    yield reply
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details() or "")
            finally:
                call.cancel()

        async def bidi(request_iterator, context):
            call = ch.stream_stream(method)(request_iterator,
                                            metadata=_forward_metadata(context))
            try:
                async for reply in call:
                    yield reply
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details() or "")
            finally:
                call.cancel()

        if kind == UNARY:
            return grpc.unary_unary_rpc_method_handler(unary)
        if kind == STREAM:
            return grpc.unary_stream_rpc_method_handler(stream)
        return grpc.stream_stream_rpc_method_handler(bidi)


@dataclass
class TLSGateway:
    """A running gateway (its own thread and event loop)."""

    port: int
    _loop: asyncio.AbstractEventLoop = field(repr=False)
    _server: grpc.aio.Server = field(repr=False)
    _thread: threading.Thread = field(repr=False)

    def stop(self) -> None:
        fut = asyncio.run_coroutine_threadsafe(self._server.stop(0.5), self._loop)
        fut.result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


def start_tls_gateway(listen: str, upstream: str, cert_pem: bytes, key_pem: bytes,
                      max_message_bytes: int = 4 << 20) -> TLSGateway:
    """Serve TLS on ``listen`` ("host:port"), forwarding to ``upstream`` in plaintext."""
    loop = asyncio.new_event_loop()
    started: dict = {}
    ready = threading.Event()

    async def start() -> None:
        opts = [("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", 64 << 20)]
        channel = grpc.aio.insecure_channel(upstream, options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", 64 << 20)])
        server = grpc.aio.server(options=opts)
        server.add_generic_rpc_handlers((_Forward(channel),))
        creds = grpc.ssl_server_credentials([(key_pem, cert_pem)])
        started["port"] = server.add_secure_port(listen, creds)
        await server.start()
        started["server"] = server

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(start())
        except BaseException as e:
            started["error"] = e
            ready.set()
            return
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name="specserve-tls-gateway", daemon=True)
    thread.start()
    ready.wait(timeout=30)
    if "error" in started:
        raise started["error"]
    return TLSGateway(started["port"], loop, started["server"], thread)

"""The client SDK's transport behaviour against a real grpc.aio server on loopback.

The servicer here is a fake (it echoes the prompt in three chunks): these tests are about
the SDK (deadlines, retries, cancellation, metadata, errors) and the proto conversions, not
about the model.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2_grpc
from pydantic import ValidationError

from specserve.api import GenerationRequest, describe_validation_error
from specserve.client import AsyncClient, Chunk, Client, SpecServeError, health_check
from specserve.errors import OutOfRange, Overloaded, RequestError, Unavailable
from specserve.grpc_api import (
    abort_with_status,
    chunk_to_proto,
    request_from_proto,
    request_to_proto,
    response_to_proto,
    stats_from_proto,
    stats_to_proto,
    status_of,
)
from specserve.proto_gen.specserve.v1 import specserve_pb2 as pb
from specserve.proto_gen.specserve.v1 import specserve_pb2_grpc as pb_grpc


def _pieces(text: str) -> list[str]:
    n = max(len(text) // 3, 1)
    return [text[:n], text[n:2 * n], text[2 * n:]]


class FakeSpecServe(pb_grpc.SpecServeServicer):
    """Echoes the prompt. Special prompts: "slow" never answers; "hang" sends one chunk and
    waits for cancellation; "unavailable:N" fails the first N calls of a request_id."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, str, dict[str, str]]] = []  # (method, request_id, metadata)
        self._cancelled: dict[str, threading.Event] = {}

    def cancelled(self, request_id: str) -> threading.Event:
        with self.lock:
            return self._cancelled.setdefault(request_id, threading.Event())

    def seen(self, request_id: str) -> list[tuple[str, str, dict[str, str]]]:
        with self.lock:
            return [c for c in self.calls if c[1] == request_id]

    async def _admit(self, method: str, request: pb.GenerateRequest,
                     context: grpc.aio.ServicerContext) -> GenerationRequest:
        metadata = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        with self.lock:
            self.calls.append((method, request.request_id, metadata))
            n_seen = sum(1 for c in self.calls if c[1] == request.request_id)
        try:
            req = request_from_proto(request)
        except ValidationError as err:
            await abort_with_status(context, err)
            raise AssertionError("abort_with_status returned") from err
        prompt = req.prompt or ""
        if prompt.startswith("unavailable:") and n_seen <= int(prompt.split(":")[1]):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
        if prompt == "slow":
            await asyncio.sleep(5)
        return req

    @staticmethod
    def _stats(req: GenerationRequest, text: str) -> dict[str, Any]:
        return {"spec": str(req.spec), "k": req.k, "prompt_tokens": len(text),
                "output_tokens": len(text), "rounds": 2, "drafts": 2, "draft_tokens": 8,
                "accepted_tokens": 4, "acceptance_rate": 0.5, "mean_acceptance_length": 3.0,
                "tokens_per_round": 2.5, "ttft_s": 0.001, "total_s": 0.25,
                "seed": req.seed if req.seed is not None else 7, "target_revision": "t1",
                "accepted_per_position": [2, 2], "tokens_per_s": 1.0, "finish_reason": "x"}

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        req = await self._admit("Generate", request, context)
        text = req.prompt or ""
        if text == "hang":
            yield chunk_to_proto("h", [104])
            try:
                for _ in range(250):
                    if context.cancelled():
                        break
                    await asyncio.sleep(0.02)
            except asyncio.CancelledError:
                self.cancelled(request.request_id).set()
                raise
            if context.cancelled():
                self.cancelled(request.request_id).set()
            return
        parts = _pieces(text)
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            yield chunk_to_proto(part, [ord(c) for c in part], "length" if last else None,
                                 self._stats(req, text) if last else None)

    async def GenerateUnary(self, request: pb.GenerateRequest,
                            context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        req = await self._admit("GenerateUnary", request, context)
        text = req.prompt or ""
        return response_to_proto(text, [ord(c) for c in text], "length", self._stats(req, text))


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, FakeSpecServe]]:
    servicer = FakeSpecServe()
    state: dict[str, Any] = {}
    started = threading.Event()

    async def main() -> None:
        srv = grpc.aio.server()
        pb_grpc.add_SpecServeServicer_to_server(servicer, srv)
        health_pb2_grpc.add_HealthServicer_to_server(grpc_health.aio.HealthServicer(), srv)
        state["port"] = srv.add_insecure_port("127.0.0.1:0")
        await srv.start()
        state["loop"], state["stop"] = asyncio.get_running_loop(), asyncio.Event()
        started.set()
        await state["stop"].wait()
        await srv.stop(0)

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    assert started.wait(10), "test server did not start"
    yield f"127.0.0.1:{state['port']}", servicer
    state["loop"].call_soon_threadsafe(state["stop"].set)
    thread.join(5)


@pytest.fixture()
def client(server: tuple[str, FakeSpecServe]) -> Iterator[Client]:
    with Client(server[0], timeout=5.0, backoff=0.01, token="s3cret") as c:
        yield c


def test_unary_generate_returns_text_and_stats(client: Client,
                                                server: tuple[str, FakeSpecServe]) -> None:
    r = client.generate("hello world", seed=11, spec="ngram", k=3, request_id="u1")
    assert (r.text, r.finish_reason, r.request_id) == ("hello world", "length", "u1")
    assert r.token_ids == [ord(c) for c in "hello world"]
    s = r.stats
    assert (s["spec"], s["k"], s["seed"], s["output_tokens"]) == ("ngram", 3, 11, 11)
    assert (s["acceptance_rate"], s["mean_acceptance_length"], s["tokens_per_round"]) == (
        0.5, 3.0, 2.5)
    assert (s["ttft_ms"], s["total_ms"]) == (1.0, 250.0)
    assert s["accepted_per_position"] == [2, 2]
    assert s["speculation_disabled_reason"] == ""
    [(_, rid, md)] = server[1].seen("u1")
    assert rid == md["request_id"] == "u1"
    assert md["authorization"] == "Bearer s3cret"  # the bearer token arrives
    assert md["application"] == "specserve"


def test_request_id_is_generated_when_missing(client: Client) -> None:
    a, b = client.generate("abc"), client.generate("abc")
    assert a.request_id and b.request_id and a.request_id != b.request_id


def test_stream_yields_deltas_in_order(client: Client) -> None:
    chunks = list(client.stream("abcdefghi", request_id="s1"))
    assert [c.text for c in chunks] == ["abc", "def", "ghi"]
    assert all(c.finish_reason is None and c.stats is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].stats is not None and chunks[-1].stats["output_tokens"] == 9
    assert [t for c in chunks for t in c.token_ids] == [ord(c) for c in "abcdefghi"]


def test_closing_the_stream_cancels_the_server_call(client: Client,
                                                    server: tuple[str, FakeSpecServe]) -> None:
    it = client.stream("hang", request_id="c1")
    assert next(it) == Chunk("h", [104])
    it.close()
    assert server[1].cancelled("c1").wait(3), "the server did not see the cancellation"
    # Leaving a for loop early does the same (CPython finalizes the generator at once).
    for _chunk in client.stream("hang", request_id="c2"):
        break
    assert server[1].cancelled("c2").wait(3)


def test_deadline_exceeded(client: Client) -> None:
    with pytest.raises(SpecServeError) as e:
        client.generate("slow", timeout=0.2)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(SpecServeError) as e:
        list(client.stream("slow", timeout=0.2))
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_unavailable_is_retried_with_the_same_request_id(
        client: Client, server: tuple[str, FakeSpecServe]) -> None:
    r = client.generate("unavailable:2")
    assert r.text == "unavailable:2"
    assert len(server[1].seen(r.request_id)) == 3
    chunks = list(client.stream("unavailable:1", request_id="r2"))
    assert "".join(c.text for c in chunks) == "unavailable:1"
    assert [m for m, *_ in server[1].seen("r2")] == ["Generate", "Generate"]


def test_retries_are_bounded(server: tuple[str, FakeSpecServe]) -> None:
    with Client(server[0], timeout=5.0, retries=1, backoff=0.01) as c, \
            pytest.raises(SpecServeError) as e:
        c.generate("unavailable:5", request_id="r3")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.details == "warming up"
    assert len(server[1].seen("r3")) == 2


def test_invalid_argument_propagates_with_details(client: Client) -> None:
    with pytest.raises(SpecServeError) as e:
        client.generate("hi", top_p=1.5)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details.startswith("top_p:")
    with pytest.raises(SpecServeError) as e:
        list(client.stream("hi", k=17))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "k:" in e.value.details


def test_client_checks_types_only() -> None:
    with Client("127.0.0.1:1") as c:
        with pytest.raises(TypeError, match="max_tokens"):
            c.generate("hi", max_tokens="5")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="spec"):
            c.stream("hi", spec="fast")


def test_async_client_generate_and_stream(server: tuple[str, FakeSpecServe]) -> None:
    async def go() -> None:
        async with AsyncClient(server[0], timeout=5.0, backoff=0.01, token="t") as c:
            r = await c.generate("abcdef", request_id="a1")
            assert (r.text, r.finish_reason, r.stats["ttft_ms"]) == ("abcdef", "length", 1.0)
            chunks = [ch async for ch in c.stream("abcdef")]
            assert [ch.text for ch in chunks] == ["ab", "cd", "ef"]
            assert chunks[-1].finish_reason == "length" and chunks[-1].stats is not None
            r = await c.generate("unavailable:2", request_id="a2")
            assert r.text == "unavailable:2"
            it = c.stream("hang", request_id="a3")
            assert (await it.__anext__()).text == "h"
            await it.aclose()
            with pytest.raises(SpecServeError) as e:
                await c.generate("slow", timeout=0.2)
            assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED

    asyncio.run(go())
    assert server[1].seen("a1")[0][2]["authorization"] == "Bearer t"
    assert len(server[1].seen("a2")) == 3
    assert server[1].cancelled("a3").wait(3)


def test_health_check(server: tuple[str, FakeSpecServe]) -> None:
    assert health_check(server[0])
    assert not health_check(server[0], service="no.such.Service")
    assert not health_check("127.0.0.1:1", timeout=1.0)


def test_request_from_proto_defaults() -> None:
    req = request_from_proto(pb.GenerateRequest(prompt="hi", temperature=0.7))
    assert req.model_dump() == GenerationRequest(prompt="hi", temperature=0.7).model_dump()
    assert (req.max_tokens, req.top_p, req.k, req.seed, req.spec, req.request_id) == (
        64, 1.0, 4, None, "auto", None)
    req = request_from_proto(pb.GenerateRequest(
        prompt_ids=[1, 2], k=0, seed=0, top_p=0.9, spec=pb.SPEC_MODE_NGRAM, stop=["\n"],
        request_id="x"))
    assert (req.prompt, req.prompt_ids, req.k, req.seed, req.top_p, req.spec, req.stop) == (
        None, [1, 2], 0, 0, 0.9, "ngram", ["\n"])
    assert request_from_proto(request_to_proto(req)) == req
    classed = request_from_proto(pb.GenerateRequest(prompt="hi", workload="code"))
    assert classed.workload == "code" and request_from_proto(request_to_proto(classed)) == classed
    # the class steers spec=auto's priors only: the request's content digest ignores it
    from specserve.resume import request_digest

    assert request_digest(classed.model_dump(mode="json")) == request_digest(
        classed.model_copy(update={"workload": None}).model_dump(mode="json"))


@pytest.mark.parametrize(("fields", "field"), [
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "hi", "k": 17}, "k"),
    ({"prompt": "hi", "prompt_ids": [1]}, "prompt"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "seed": 2**63}, "seed"),
    ({"prompt": "hi", "workload": "no spaces"}, "workload"),
    ({"prompt": "hi", "workload": "x" * 33}, "workload"),
])
def test_request_from_proto_rejects_bad_values(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as e:
        request_from_proto(pb.GenerateRequest(**fields))
    assert field in describe_validation_error(e.value)
    code, message = status_of(e.value)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field in message


def test_one_error_to_status_mapping() -> None:
    """Every domain error maps to its status with its message; anything else INTERNAL."""
    err = OutOfRange("max_tokens: prompt (9 tokens) + max_tokens (64) exceeds the context")
    assert status_of(err) == (grpc.StatusCode.OUT_OF_RANGE, str(err))
    for cls, code in ((RequestError, grpc.StatusCode.INVALID_ARGUMENT),
                      (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
                      (Unavailable, grpc.StatusCode.UNAVAILABLE)):
        assert status_of(cls("why")) == (code, "why")
    code, message = status_of(RuntimeError("boom"))
    assert code == grpc.StatusCode.INTERNAL and "boom" in message

    class RayContext:  # Ray Serve's context sets the status instead of aborting
        code: Any = None
        details: Any = None

        def set_code(self, c: Any) -> None:
            self.code = c

        def set_details(self, d: Any) -> None:
            self.details = d

    ctx = RayContext()
    asyncio.run(abort_with_status(ctx, err))
    assert (ctx.code, ctx.details) == (grpc.StatusCode.OUT_OF_RANGE, str(err))


def test_stats_round_trip() -> None:
    d = {"spec": "draft", "k": 4, "prompt_tokens": 3, "output_tokens": 5, "ttft_s": 0.5,
         "total_s": 1.5, "seed": 2**63 - 1, "accepted_per_position": [3, 1],
         "acceptance_rate": 0.3333, "drafted_per_position": [3, 3], "tokens_per_s": 3.3}
    out = stats_from_proto(stats_to_proto(d))
    assert (out["ttft_ms"], out["total_ms"], out["seed"]) == (500.0, 1500.0, 2**63 - 1)
    assert (out["acceptance_rate"], out["accepted_per_position"]) == (0.3333, [3, 1])
    assert "drafted_per_position" not in out


def test_client_import_is_light() -> None:
    code = ("import sys, specserve.client, specserve.grpc_api; "
            "heavy = {'torch', 'ray', 'transformers'} & set(sys.modules); "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

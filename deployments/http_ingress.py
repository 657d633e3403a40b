"""The OpenAI-compatible HTTP API on the Router deployment (Serve's HTTP proxy), beside the
gRPC API: the same router, the same validated request, the same outputs.

``build_http_app(router, model)`` returns the FastAPI app the Router deployment serves
(``@serve.ingress()`` + ``__serve_build_asgi_app__``). Mappings live in
``specserve/openai_api.py``; this module only moves bytes.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from router.router import Call, Router, RouterChunk
from specserve import openai_api as oa
from specserve.api import GenerationRequest
from specserve.errors import RequestError

MAX_BODY_BYTES = 8 << 20

# the caller's name (it scopes the caller's journal entries); raises Unauthenticated to refuse
Authorize = Callable[[Request], Awaitable[str]]


class _Kind:
    """How one endpoint shapes its choices (completions vs chat)."""

    def __init__(self, chat: bool, token_text: Callable[[int], str]):
        self.chat, self.token_text = chat, token_text
        self.obj = "chat.completion" if chat else "text_completion"
        self.chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        self.prefix = "chatcmpl" if chat else "cmpl"

    def logprobs(self, chunk: RouterChunk, offset: int) -> dict[str, Any] | None:
        if chunk.logprobs is None:
            return None
        if self.chat:
            return oa.chat_logprobs(chunk.logprobs, self.token_text)
        return oa.completion_logprobs(chunk.logprobs, self.token_text, offset)

    def choice(self, text: str, lps: dict[str, Any] | None, finish: str | None,
               delta: bool, first: bool = False) -> dict[str, Any]:
        c: dict[str, Any] = {"index": 0, "logprobs": lps, "finish_reason": oa.finish_reason(finish)}
        if not self.chat:
            return {**c, "text": text}
        if delta:
            return {**c, "delta": {"role": "assistant", "content": text} if first
                    else {"content": text}}
        return {**c, "message": {"role": "assistant", "content": text}}


def _merge_logprobs(acc: dict[str, Any] | None, part: dict[str, Any] | None,
                    chat: bool) -> dict[str, Any] | None:
    if part is None:
        return acc
    if acc is None:
        return part
    keys = ("content",) if chat else ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: acc[k] + part[k] for k in keys}


async def _whole(kind: _Kind, chunks: AsyncIterator[RouterChunk], first: RouterChunk,
                 rid: str, model: str) -> dict[str, Any]:
    text, lps, last = [first.text], kind.logprobs(first, 0), first
    n_tokens = len(first.token_ids)
    async with contextlib.aclosing(chunks):  # a client gone: the request stops now
        async for ch in chunks:
            lps = _merge_logprobs(lps, kind.logprobs(ch, len("".join(text))), kind.chat)
            text.append(ch.text)
            n_tokens += len(ch.token_ids)
            last = ch
    stats = last.stats or {}
    return oa.envelope(kind.obj, rid, model,
                       [kind.choice("".join(text), lps, last.finish_reason, delta=False)],
                       usage=oa.usage(stats.get("prompt_tokens", 0), n_tokens),
                       specserve=stats)


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


async def _events(kind: _Kind, chunks: AsyncIterator[RouterChunk], first: RouterChunk,
                  rid: str, model: str, include_usage: bool) -> AsyncIterator[bytes]:
    offset, n_tokens, prompt_tokens, ch, is_first = 0, 0, 0, first, True
    try:
        while ch is not None:
            choice = kind.choice(ch.text, kind.logprobs(ch, offset), ch.finish_reason,
                                 delta=True, first=is_first)
            extra = {"specserve": ch.stats} if ch.stats else {}
            yield _sse(oa.envelope(kind.chunk_obj, rid, model, [choice], **extra))
            offset, n_tokens, is_first = offset + len(ch.text), n_tokens + len(ch.token_ids), False
            prompt_tokens = (ch.stats or {}).get("prompt_tokens", prompt_tokens)
            ch = await anext(chunks, None)
        if include_usage:
            yield _sse(oa.envelope(kind.chunk_obj, rid, model, [],
                                   usage=oa.usage(prompt_tokens, n_tokens)))
    except Exception as e:  # after the 200: the error travels as an event
        yield _sse(oa.error_body(e)[1])
    finally:  # a client that went away cancels the request within a round
        await chunks.aclose()
    yield _sse("[DONE]")


async def _json(request: Request) -> Any:
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        raise _TooLarge(f"request body of {len(body)} bytes exceeds {MAX_BODY_BYTES}")
    try:
        return json.loads(body)
    except ValueError as e:
        raise RequestError(f"body: not valid JSON ({e})") from None


class _TooLarge(RequestError):
    pass


def _error_response(err: BaseException) -> JSONResponse:
    status, body = (413, oa.error_body(RequestError(str(err)))[1]) if isinstance(
        err, _TooLarge) else oa.error_body(err)
    return JSONResponse(body, status_code=status)


async def _serve(router: Router, kind: _Kind, req: GenerationRequest, model: str,
                 stream: bool, include_usage: bool, call: Call) -> Any:
    rid = oa.new_id(kind.prefix)
    chunks = router.generate(req, rid, None, call)
    first = await anext(chunks)  # errors before any output become an HTTP status
    if stream:
        return StreamingResponse(_events(kind, chunks, first, rid, model, include_usage),
                                 media_type="text/event-stream")
    return JSONResponse(await _whole(kind, chunks, first, rid, model))


def build_http_app(router: Router, model: str, revisions: tuple[str, str] = ("", ""),
                   authorize: Authorize | None = None,
                   healthy: Callable[[], Awaitable[bool]] | None = None) -> FastAPI:
    """The FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health."""
    app = FastAPI(title="specserve", docs_url=None, redoc_url=None, openapi_url=None)

    def token_text(t: int) -> str:
        return router.tok.decode([t])

    def check_model(name: str | None) -> None:
        if name not in (None, model):
            raise oa.InvalidField("model", f"{name!r} is not served here; use {model!r}")

    async def endpoint(request: Request, chat: bool) -> Any:
        try:
            call = Call(caller=await authorize(request)) if authorize is not None else Call()
            body = await _json(request)
            if chat:
                creq = oa.parse(oa.ChatRequest, body)
                prompt = oa.chat_prompt(creq.messages, router.tok)
                n_prompt = len(router.tok(prompt, add_special_tokens=False)["input_ids"])
                greq = oa.chat_request(creq, prompt, router.cfg.max_context - n_prompt)
            else:
                creq = oa.parse(oa.CompletionRequest, body)
                greq = oa.completion_request(creq)
            check_model(creq.model)
            usage = bool((creq.stream_options or {}).get("include_usage"))
            return await _serve(router, _Kind(chat, token_text), greq, model, creq.stream, usage,
                                call)
        except Exception as e:  # every failure in OpenAI's error shape
            router.count_error(e)
            return _error_response(e)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await endpoint(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await endpoint(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": model, "object": "model", "created": 0, "owned_by": "specserve",
            "specserve": {"target_revision": revisions[0], "drafter_revision": revisions[1]}}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = True if healthy is None else await healthy()
        return JSONResponse({"status": "ok" if ok else "no target replica answers"},
                            status_code=200 if ok else 503)

    return app

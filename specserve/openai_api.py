"""The OpenAI-compatible HTTP API, as pure mappings (no Ray, no web framework): request
bodies to the one validated ``GenerationRequest``, results to OpenAI's response, stream
chunk and error shapes. ``deployments/http_ingress.py`` serves them.

Supported: ``POST /v1/completions`` and ``/v1/chat/completions`` (``stream`` as server-sent
events, ``stream_options.include_usage``), ``max_tokens`` (chat: also
``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``, ``stop``, ``n`` = 1,
logprobs (completions: ``logprobs`` = top-n; chat: ``logprobs`` + ``top_logprobs``), and the
extensions ``top_k``, ``spec``, ``k`` and ``workload``. Defaults are OpenAI's (temperature
1; completions 16 tokens; chat: up to the context). Parameters this server cannot honour exactly
(``n`` > 1, ``echo``, ``best_of``, penalties, ``logit_bias``, tools, ...) get a 400 naming
the field, never a silent approximation.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from specserve.api import MAX_LOGPROBS, GenerationRequest, TokenLogprob
from specserve.errors import OutOfRange, RequestError, ServiceError

HTTP_STATUS = {"INVALID_ARGUMENT": 400, "OUT_OF_RANGE": 400, "UNAUTHENTICATED": 401,
               "PERMISSION_DENIED": 403, "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503,
               "DEADLINE_EXCEEDED": 504, "ALREADY_EXISTS": 409, "FAILED_PRECONDITION": 400}


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="ignored beyond a check: one model is served")
    temperature: float = Field(1.0, description="0 = greedy (OpenAI's default is 1)")
    top_p: float = 1.0
    n: int = Field(1, description="only 1")
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(None, max_length=256)
    # extensions
    top_k: int = 0
    spec: str | None = Field(None, description="speculation mode: auto (default), off, draft, "
                             "ngram")
    k: int | None = Field(None, description="draft tokens per round")
    workload: str | None = Field(None, description="workload class (spec=auto's priors)")

    def unsupported(self) -> list[str]:
        """Fields set to what this server cannot do exactly."""
        bad = [name for name, ok in (("n", self.n == 1),
                                     ("presence_penalty", self.presence_penalty == 0),
                                     ("frequency_penalty", self.frequency_penalty == 0),
                                     ("logit_bias", not self.logit_bias)) if not ok]
        if self.stream_options and set(self.stream_options) - {"include_usage"}:
            bad.append("stream_options")
        return bad


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    logprobs: int | None = Field(None, description="top-n logprobs per token (0..20)")
    echo: bool = False
    best_of: int = 1
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        return [*super().unsupported(),
                *(name for name, ok in (("echo", not self.echo), ("best_of", self.best_of == 1),
                                        ("suffix", self.suffix is None)) if not ok)]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, v: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        if isinstance(v, list) and any(p.get("type") != "text" for p in v):
            raise ValueError("only text content parts are supported")
        return v

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(str(p.get("text", "")) for p in self.content)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body; raises ``ValidationError`` (the field is in the message)."""
    return model.model_validate(body)


class InvalidField(RequestError):
    """A field this API refuses (a 400 with ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def _prompt(req: CompletionRequest) -> dict[str, Any]:
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], list):  # [[ids]]
        if len(p) != 1:
            raise InvalidField("prompt", "one prompt per request (a batch is not supported)")
        return {"prompt_ids": p[0]}
    if isinstance(p, list) and p and isinstance(p[0], str):
        if len(p) != 1:
            raise InvalidField("prompt", "one prompt per request (a batch is not supported)")
        return {"prompt": p[0]}
    if isinstance(p, list):
        return {"prompt_ids": p}
    return {"prompt": p}


def _sampling(req: _Common) -> dict[str, Any]:
    bad = req.unsupported()
    if bad:
        raise InvalidField(bad[0], "not supported by this server (only the OpenAI default)")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    out: dict[str, Any] = {"temperature": req.temperature, "top_p": req.top_p,
                           "top_k": req.top_k, "seed": req.seed, "stop": stop}
    if req.spec is not None:
        out["spec"] = req.spec
    if req.k is not None:
        out["k"] = req.k
    if req.workload is not None:
        out["workload"] = req.workload
    return out


def completion_request(req: CompletionRequest) -> GenerationRequest:
    """The validated request (raises ``ValidationError`` / ``ServiceError``)."""
    return GenerationRequest.model_validate({**_prompt(req), **_sampling(req),
                                             "max_tokens": req.max_tokens,
                                             "logprobs": req.logprobs})


def chat_prompt(messages: list[ChatMessage], tokenizer: Any) -> str:
    """The checkpoint's own chat template when it has one; else a plain one:
    ``<role>: <content>`` lines, then ``assistant:`` to prompt the reply."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": m.role, "content": m.text()}
                                              for m in messages],
                                             tokenize=False, add_generation_prompt=True)
    return "".join(f"{m.role}: {m.text()}\n" for m in messages) + "assistant:"


def chat_request(req: ChatRequest, prompt: str, budget: int) -> GenerationRequest:
    """``budget``: the tokens the context leaves after the prompt (the default length)."""
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidField("top_logprobs", "needs logprobs: true")
    max_tokens = req.max_completion_tokens or req.max_tokens or max(1, budget)
    return GenerationRequest.model_validate({
        "prompt": prompt, **_sampling(req), "max_tokens": max_tokens,
        "logprobs": (req.top_logprobs or 0) if req.logprobs else None})


def error_body(err: BaseException) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI error object) for a failed request."""
    from specserve.api import describe_validation_error

    if isinstance(err, ValidationError):
        message = describe_validation_error(err)
        param = message.split(":", 1)[0].split(".")[0] or None
        return 400, _error(message, "invalid_request_error", param)
    if isinstance(err, ServiceError):
        status = HTTP_STATUS.get(err.code, 500)
        param = getattr(err, "param", None) or (str(err).split(":", 1)[0]
                                                if status == 400 else None)
        kind = "invalid_request_error" if status < 500 else "server_error"
        code = "context_length_exceeded" if isinstance(err, OutOfRange) else None
        return status, _error(str(err), kind, param, code)
    return 500, _error(f"internal error: {type(err).__name__}: {err}", "server_error")


def _error(message: str, kind: str, param: str | None = None,
           code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def finish_reason(reason: str | None) -> str | None:
    """Ours -> OpenAI's: stop (EOS or a stop string), length (max_tokens)."""
    return None if not reason else ("length" if reason == "length" else "stop")


def completion_logprobs(lps: list[TokenLogprob], token_text: Any,
                        offset: int) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for these tokens."""
    tokens = [token_text(t.token) for t in lps]
    offsets, pos = [], offset
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": [t.logprob for t in lps],
            "top_logprobs": [{token_text(i): v for i, v in t.top} for t in lps],
            "text_offset": offsets}


def chat_logprobs(lps: list[TokenLogprob], token_text: Any) -> dict[str, Any]:
    """The chat ``logprobs`` object (``content``: one entry per token)."""
    def entry(tok: int, lp: float) -> dict[str, Any]:
        s = token_text(tok)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(t.token, t.logprob),
                         "top_logprobs": [entry(i, v) for i, v in t.top]} for t in lps]}


def envelope(kind: str, rid: str, model: str, choices: list[dict[str, Any]],
             **extra: Any) -> dict[str, Any]:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model,
            "choices": choices, **extra}


__all__ = ["MAX_LOGPROBS", "ChatRequest", "CompletionRequest", "chat_logprobs", "chat_prompt",
           "chat_request", "completion_logprobs", "completion_request", "envelope", "error_body",
           "finish_reason", "new_id", "parse", "usage"]

"""The public request model, validated the same way by the CLI, the engine and the server.

No torch here: the light client install imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_K = 16
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256  # per stop string
MAX_PROMPT_CHARS = 16 << 20  # a backstop; the service's byte limit is lower
MAX_PROMPT_IDS = 1 << 20
MAX_LOGPROBS = 20


class SpecMode(StrEnum):
    OFF = "off"  # plain target decoding: the baseline path
    DRAFT = "draft"  # a draft model proposes
    NGRAM = "ngram"  # prompt lookup proposes (q one-hot)
    AUTO = "auto"  # every round: the draft model, prompt lookup or nobody, and k <= k, by
    #                expected goodput of the target batch (specserve.policy)


@dataclass
class TokenLogprob:
    """The target's log-probability of one generated token and the top-n of its position
    (``core/logprobs.py`` says which distribution)."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # most likely first


class GenerationRequest(BaseModel):
    """One generation. Either ``prompt`` (text) or ``prompt_ids`` (token ids)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS, description="prompt text")
    prompt_ids: list[int] | None = Field(None, max_length=MAX_PROMPT_IDS,
                                         description="prompt as token ids")
    max_tokens: int = Field(64, ge=1, le=1 << 16, description="tokens to generate at most")
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="0 = greedy")
    top_k: int = Field(0, ge=0, le=1 << 20, description="0 = off")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="1 = off")
    seed: int | None = Field(None, ge=0, lt=2**63, description="makes sampling reproducible")
    stop: list[str] = Field(default_factory=list, description="stop strings (not emitted)")
    spec: SpecMode = Field(SpecMode.AUTO, description="speculation mode")
    k: int = Field(4, ge=0, le=MAX_K, description="draft tokens per round (auto: the most)")
    request_id: str | None = Field(None, max_length=128)
    workload: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.-]{1,32}$", description="workload class, e.g. 'code' or "
        "'chat' (letters, digits, '_', '.', '-'; at most 32): spec=auto starts from the "
        "fleet's acceptance for this class; never changes the output")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="the target's logprob of each generated "
        "token and the top-n alternatives (0..20); None = none")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: list[str]) -> list[str]:
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in v):
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters")
        return v

    @model_validator(mode="after")
    def _prompt(self) -> GenerationRequest:
        if (self.prompt is None) == (self.prompt_ids is None):
            raise ValueError("prompt: give exactly one of prompt or prompt_ids")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt: must not be empty")
        if self.prompt_ids is not None and not self.prompt_ids:
            raise ValueError("prompt_ids: must not be empty")
        return self


def prepare_prompt(req: GenerationRequest, tokenizer: Any, vocab_size: int,
                   max_context: int) -> list[int]:
    """The request's prompt token ids, checked against the model (the one validation path
    after the pydantic model: CLI, engine and service ingress all call it). Raises
    ``RequestError`` (a bad token id) or ``OutOfRange`` (over the context)."""
    from specserve.errors import OutOfRange, RequestError

    if req.prompt_ids is not None:
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"prompt_ids: token id {bad[0]} outside the vocabulary "
                               f"[0, {vocab_size})")
        ids = list(req.prompt_ids)
    else:
        ids = tokenizer(req.prompt, add_special_tokens=False)["input_ids"]
    if len(ids) >= max_context:
        raise OutOfRange(f"prompt: {len(ids)} tokens, but the context holds {max_context}; "
                         "shorten the prompt")
    if len(ids) + req.max_tokens > max_context:
        raise OutOfRange(
            f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) exceeds "
            f"the context ({max_context}); lower max_tokens to at most {max_context - len(ids)}")
    return ids


def describe_validation_error(err: Exception) -> str:
    """One line per problem, naming the field: 'max_tokens: Input should be ...'."""
    errors = getattr(err, "errors", None)
    if not callable(errors):
        return str(err)
    parts = []
    for e in errors():
        field = ".".join(str(p) for p in e.get("loc", ()))
        msg = e.get("msg", "invalid").removeprefix("Value error, ")
        # model-level checks put the field name in the message ("prompt: must not be empty")
        parts.append(f"{field}: {msg}" if field else msg)
    return "; ".join(parts)

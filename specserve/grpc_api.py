"""Conversions between the public gRPC messages and specserve's own types, for the server.

The server validates every request with ``specserve.api.GenerationRequest`` (the same model
the CLI and the engine use), so the wire format adds no rules of its own: proto3 "unset"
becomes the model's default and everything else is the model's to accept or reject.

No torch here (the light client install imports it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grpc
import numpy as np
from pydantic import ValidationError

from specserve.api import GenerationRequest, TokenLogprob, describe_validation_error
from specserve.errors import ServiceError
from specserve.proto_gen.specserve.v1 import specserve_pb2 as pb

DEFAULT_MAX_TOKENS = 64
DEFAULT_K = 4
DEFAULT_TOP_P = 1.0

# Proto enum <-> the mode's name in specserve.api.SpecMode. UNSPECIFIED means auto (the
# default).
SPEC_FROM_PROTO: dict[int, str] = {
    pb.SPEC_MODE_UNSPECIFIED: "auto",
    pb.SPEC_MODE_OFF: "off",
    pb.SPEC_MODE_DRAFT: "draft",
    pb.SPEC_MODE_NGRAM: "ngram",
    pb.SPEC_MODE_AUTO: "auto",
}
SPEC_TO_PROTO: dict[str, int] = {
    "off": pb.SPEC_MODE_OFF,
    "draft": pb.SPEC_MODE_DRAFT,
    "ngram": pb.SPEC_MODE_NGRAM,
    "auto": pb.SPEC_MODE_AUTO,
}

_UINT_STATS = ("prompt_tokens", "output_tokens", "rounds", "drafts", "draft_tokens",
               "accepted_tokens", "k", "seed", "drafted_ahead",
               "drafted_ahead_pushed", "drafted_ahead_after_rejection")
_FLOAT_STATS = ("acceptance_rate", "mean_acceptance_length", "tokens_per_round")
_STR_STATS = ("spec", "speculation_disabled_reason", "target_revision", "drafter_revision")
_MAP_STATS = ("k_histogram", "proposer_mix", "decision_reasons")


def _from_f32(x: float) -> float:
    """A proto float as the shortest decimal that round-trips: 0.7, not 0.699999988."""
    return float(str(np.float32(x)))


def logprobs_to_proto(lps: Sequence[TokenLogprob] | None) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token=t.token, logprob=t.logprob, top_tokens=[i for i, _ in t.top],
                            top_logprobs=[v for _, v in t.top]) for t in lps or ()]


def logprobs_from_proto(msgs: Iterable[pb.TokenLogprob]) -> list[TokenLogprob]:
    return [TokenLogprob(m.token, m.logprob, list(zip(m.top_tokens, m.top_logprobs,
                                                      strict=True))) for m in msgs]


def request_from_proto(msg: pb.GenerateRequest) -> GenerationRequest:
    """The validated request; raises pydantic.ValidationError naming the offending field."""
    prompt_ids = list(msg.prompt_ids)
    # proto3 strings have no presence: an empty prompt with prompt_ids means "not given",
    # an empty prompt without them is an empty prompt (rejected by the model).
    prompt: str | None = msg.prompt if (msg.prompt or not prompt_ids) else None
    spec: int | str = SPEC_FROM_PROTO.get(msg.spec, msg.spec)  # unknown numbers: rejected
    data: dict[str, Any] = {
        "prompt": prompt,
        "prompt_ids": prompt_ids or None,
        "max_tokens": msg.max_tokens or DEFAULT_MAX_TOKENS,
        "temperature": _from_f32(msg.temperature),
        "top_k": msg.top_k,
        "top_p": _from_f32(msg.top_p) if msg.HasField("top_p") else DEFAULT_TOP_P,
        "seed": msg.seed if msg.HasField("seed") else None,
        "stop": list(msg.stop),
        "spec": spec,
        "k": msg.k if msg.HasField("k") else DEFAULT_K,
        "request_id": msg.request_id or None,
        "logprobs": msg.logprobs if msg.HasField("logprobs") else None,
        "workload": msg.workload or None,
    }
    return GenerationRequest.model_validate(data)


def request_to_proto(req: GenerationRequest) -> pb.GenerateRequest:
    """The wire form of a validated request (the inverse of request_from_proto)."""
    msg = pb.GenerateRequest(
        prompt=req.prompt or "", prompt_ids=req.prompt_ids or [], max_tokens=req.max_tokens,
        temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, stop=req.stop,
        spec=SPEC_TO_PROTO[str(req.spec)], k=req.k, request_id=req.request_id or "",
        workload=req.workload or "",
    )
    if req.seed is not None:
        msg.seed = req.seed
    if req.logprobs is not None:
        msg.logprobs = req.logprobs
    return msg


def stats_to_proto(stats: Mapping[str, Any] | Any) -> pb.GenerateStats:
    """GenerateStats from a stats dict (``GenerationStats.to_dict()``) or an object with
    ``to_dict()``. Seconds (ttft_s, total_s) become milliseconds unless ttft_ms/total_ms are
    given; keys the message has no field for (tokens_per_s, drafted_per_position, ...) and
    None values are ignored."""
    if isinstance(stats, pb.GenerateStats):
        return stats
    d: Mapping[str, Any] = stats if isinstance(stats, Mapping) else stats.to_dict()
    msg = pb.GenerateStats()
    for name in _UINT_STATS:
        if d.get(name) is not None:
            setattr(msg, name, int(d[name]))
    for name in _FLOAT_STATS:
        if d.get(name) is not None:
            setattr(msg, name, float(d[name]))
    for name in _STR_STATS:
        if d.get(name) is not None:
            setattr(msg, name, str(d[name]))
    for name in ("ttft", "total", "round", "propose", "verify", "drafter_compute",
                 "target_compute"):
        if d.get(f"{name}_ms") is not None:
            setattr(msg, f"{name}_ms", float(d[f"{name}_ms"]))
        elif d.get(f"{name}_s") is not None:
            setattr(msg, f"{name}_ms", float(d[f"{name}_s"]) * 1000.0)
    msg.accepted_per_position.extend(int(c) for c in d.get("accepted_per_position") or ())
    for name in _MAP_STATS:
        getattr(msg, name).update({(int(k) if name == "k_histogram" else str(k)): int(v)
                                   for k, v in (d.get(name) or {}).items()})
    return msg


def stats_from_proto(msg: pb.GenerateStats) -> dict[str, Any]:
    """Every GenerateStats field as a plain dict (floats as the shortest float32 decimal)."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.name in _FLOAT_STATS:
            value = _from_f32(value)
        elif field.name == "accepted_per_position":
            value = list(value)
        elif field.name in _MAP_STATS:
            value = dict(sorted(value.items()))
        out[field.name] = value
    return out


def chunk_to_proto(text: str, token_ids: Iterable[int], finish_reason: str | None = None,
                   stats: Mapping[str, Any] | Any | None = None,
                   logprobs: Sequence[TokenLogprob] | None = None) -> pb.GenerateChunk:
    """One streamed chunk; give finish_reason and stats on the last chunk only."""
    msg = pb.GenerateChunk(text=text, token_ids=list(token_ids), finish_reason=finish_reason or "",
                           logprobs=logprobs_to_proto(logprobs))
    if stats is not None:
        msg.stats.CopyFrom(stats_to_proto(stats))
    return msg


def response_to_proto(text: str, token_ids: Sequence[int], finish_reason: str,
                      stats: Mapping[str, Any] | Any,
                      logprobs: Sequence[TokenLogprob] | None = None) -> pb.GenerateResponse:
    """The GenerateUnary answer."""
    return pb.GenerateResponse(text=text, token_ids=list(token_ids), finish_reason=finish_reason,
                               stats=stats_to_proto(stats), logprobs=logprobs_to_proto(logprobs))


def status_of(err: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one mapping of a failed request to a gRPC status (every public entry point).

    pydantic's ValidationError and ``RequestError`` become INVALID_ARGUMENT naming the field
    ("top_p: Input should be less than or equal to 1"), ``OutOfRange`` OUT_OF_RANGE
    ("max_tokens: prompt (90 tokens) + max_tokens (64) exceeds the context (128); ..."),
    ``Overloaded`` RESOURCE_EXHAUSTED, ``Unavailable`` UNAVAILABLE; anything else INTERNAL.
    """
    if isinstance(err, ValidationError):
        return grpc.StatusCode.INVALID_ARGUMENT, describe_validation_error(err)
    if isinstance(err, ServiceError):
        return grpc.StatusCode[err.code], str(err)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}: {err}"


async def abort_with_status(context: Any, err: BaseException) -> None:
    """Ends the RPC with ``status_of(err)``.

    With a grpc(.aio) ServicerContext this aborts (raises, so it never returns). With a
    context that cannot abort (Ray Serve's RayServegRPCContext) it sets the code and details
    and returns: the handler must then raise or return an empty response.
    """
    code, message = status_of(err)
    abort = getattr(context, "abort", None)
    if abort is not None:
        result = abort(code, message)
        if hasattr(result, "__await__"):
            await result
        return
    context.set_code(code)
    context.set_details(message)

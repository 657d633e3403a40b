from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpecMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPEC_MODE_UNSPECIFIED: _ClassVar[SpecMode]
    SPEC_MODE_OFF: _ClassVar[SpecMode]
    SPEC_MODE_DRAFT: _ClassVar[SpecMode]
    SPEC_MODE_NGRAM: _ClassVar[SpecMode]
    SPEC_MODE_AUTO: _ClassVar[SpecMode]
SPEC_MODE_UNSPECIFIED: SpecMode
SPEC_MODE_OFF: SpecMode
SPEC_MODE_DRAFT: SpecMode
SPEC_MODE_NGRAM: SpecMode
SPEC_MODE_AUTO: SpecMode

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_ids", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "spec", "k", "request_id", "logprobs", "workload")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WORKLOAD_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    spec: SpecMode
    k: int
    request_id: str
    logprobs: int
    workload: str
    def __init__(self, prompt: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., spec: _Optional[_Union[SpecMode, str]] = ..., k: _Optional[int] = ..., request_id: _Optional[str] = ..., logprobs: _Optional[int] = ..., workload: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token", "logprob", "top_tokens", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprob: float
    top_tokens: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token: _Optional[int] = ..., logprob: _Optional[float] = ..., top_tokens: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: GenerateStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[GenerateStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: GenerateStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[GenerateStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateStats(_message.Message):
    __slots__ = ("prompt_tokens", "output_tokens", "rounds", "drafts", "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_acceptance_length", "tokens_per_round", "ttft_ms", "total_ms", "spec", "k", "speculation_disabled_reason", "target_revision", "drafter_revision", "seed", "accepted_per_position", "round_ms", "propose_ms", "verify_ms", "drafter_compute_ms", "target_compute_ms", "k_histogram", "proposer_mix", "decision_reasons", "drafted_ahead", "drafted_ahead_pushed", "drafted_ahead_after_rejection")
    class KHistogramEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    class ProposerMixEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class DecisionReasonsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_DISABLED_REASON_FIELD_NUMBER: _ClassVar[int]
    TARGET_REVISION_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_REVISION_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    ROUND_MS_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    TARGET_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    K_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_MIX_FIELD_NUMBER: _ClassVar[int]
    DECISION_REASONS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_AHEAD_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_AHEAD_PUSHED_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_AHEAD_AFTER_REJECTION_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    output_tokens: int
    rounds: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_acceptance_length: float
    tokens_per_round: float
    ttft_ms: float
    total_ms: float
    spec: str
    k: int
    speculation_disabled_reason: str
    target_revision: str
    drafter_revision: str
    seed: int
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    round_ms: float
    propose_ms: float
    verify_ms: float
    drafter_compute_ms: float
    target_compute_ms: float
    k_histogram: _containers.ScalarMap[int, int]
    proposer_mix: _containers.ScalarMap[str, int]
    decision_reasons: _containers.ScalarMap[str, int]
    drafted_ahead: int
    drafted_ahead_pushed: int
    drafted_ahead_after_rejection: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., drafts: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_acceptance_length: _Optional[float] = ..., tokens_per_round: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., spec: _Optional[str] = ..., k: _Optional[int] = ..., speculation_disabled_reason: _Optional[str] = ..., target_revision: _Optional[str] = ..., drafter_revision: _Optional[str] = ..., seed: _Optional[int] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., round_ms: _Optional[float] = ..., propose_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., drafter_compute_ms: _Optional[float] = ..., target_compute_ms: _Optional[float] = ..., k_histogram: _Optional[_Mapping[int, int]] = ..., proposer_mix: _Optional[_Mapping[str, int]] = ..., decision_reasons: _Optional[_Mapping[str, int]] = ..., drafted_ahead: _Optional[int] = ..., drafted_ahead_pushed: _Optional[int] = ..., drafted_ahead_after_rejection: _Optional[int] = ...) -> None: ...

from specserve.proto_gen.specserve.v1 import specserve_pb2 as _specserve_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class CacheRepair(_message.Message):
    __slots__ = ("cached_before", "kept", "fed")
    CACHED_BEFORE_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    FED_FIELD_NUMBER: _ClassVar[int]
    cached_before: int
    kept: int
    fed: int
    def __init__(self, cached_before: _Optional[int] = ..., kept: _Optional[int] = ..., fed: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("call_id", "request_id", "session_id", "committed_len", "tokens_start", "tokens", "k", "mode", "sampling", "release", "traceparent")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    request_id: str
    session_id: str
    committed_len: int
    tokens_start: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    k: int
    mode: str
    sampling: Sampling
    release: bool
    traceparent: str
    def __init__(self, call_id: _Optional[int] = ..., request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., committed_len: _Optional[int] = ..., tokens_start: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ..., mode: _Optional[str] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., release: _Optional[bool] = ..., traceparent: _Optional[str] = ...) -> None: ...

class ProposeReply(_message.Message):
    __slots__ = ("call_id", "draft_tokens", "draft_probs", "cache_miss", "repair", "replica", "error", "compute_us", "ahead", "received_ns", "sent_ns", "session_id", "committed_len", "tail")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISS_FIELD_NUMBER: _ClassVar[int]
    REPAIR_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_NS_FIELD_NUMBER: _ClassVar[int]
    SENT_NS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: bytes
    cache_miss: bool
    repair: CacheRepair
    replica: str
    error: str
    compute_us: int
    ahead: bool
    received_ns: int
    sent_ns: int
    session_id: str
    committed_len: int
    tail: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, call_id: _Optional[int] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[bytes] = ..., cache_miss: _Optional[bool] = ..., repair: _Optional[_Union[CacheRepair, _Mapping]] = ..., replica: _Optional[str] = ..., error: _Optional[str] = ..., compute_us: _Optional[int] = ..., ahead: _Optional[bool] = ..., received_ns: _Optional[int] = ..., sent_ns: _Optional[int] = ..., session_id: _Optional[str] = ..., committed_len: _Optional[int] = ..., tail: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("call_id", "request_id", "session_id", "committed_len", "tokens_start", "tokens", "draft_tokens", "draft_probs", "sampling", "release", "traceparent", "logprobs")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    request_id: str
    session_id: str
    committed_len: int
    tokens_start: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: bytes
    sampling: Sampling
    release: bool
    traceparent: str
    logprobs: int
    def __init__(self, call_id: _Optional[int] = ..., request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., committed_len: _Optional[int] = ..., tokens_start: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[bytes] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., release: _Optional[bool] = ..., traceparent: _Optional[str] = ..., logprobs: _Optional[int] = ...) -> None: ...

class VerifyReply(_message.Message):
    __slots__ = ("call_id", "num_accepted", "extra_token", "bonus", "cache_miss", "repair", "batch_size", "replica", "error", "compute_us", "logprobs", "batch_tokens", "queue_rows", "batch_fed", "received_ns", "sent_ns")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    EXTRA_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISS_FIELD_NUMBER: _ClassVar[int]
    REPAIR_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_ROWS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FED_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_NS_FIELD_NUMBER: _ClassVar[int]
    SENT_NS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    num_accepted: int
    extra_token: int
    bonus: bool
    cache_miss: bool
    repair: CacheRepair
    batch_size: int
    replica: str
    error: str
    compute_us: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_specserve_pb2.TokenLogprob]
    batch_tokens: int
    queue_rows: int
    batch_fed: int
    received_ns: int
    sent_ns: int
    def __init__(self, call_id: _Optional[int] = ..., num_accepted: _Optional[int] = ..., extra_token: _Optional[int] = ..., bonus: _Optional[bool] = ..., cache_miss: _Optional[bool] = ..., repair: _Optional[_Union[CacheRepair, _Mapping]] = ..., batch_size: _Optional[int] = ..., replica: _Optional[str] = ..., error: _Optional[str] = ..., compute_us: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_specserve_pb2.TokenLogprob, _Mapping]]] = ..., batch_tokens: _Optional[int] = ..., queue_rows: _Optional[int] = ..., batch_fed: _Optional[int] = ..., received_ns: _Optional[int] = ..., sent_ns: _Optional[int] = ...) -> None: ...

class ProposeBatch(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[ProposeRequest]
    def __init__(self, rows: _Optional[_Iterable[_Union[ProposeRequest, _Mapping]]] = ...) -> None: ...

class ProposeReplies(_message.Message):
    __slots__ = ("replies",)
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[ProposeReply]
    def __init__(self, replies: _Optional[_Iterable[_Union[ProposeReply, _Mapping]]] = ...) -> None: ...

class VerifyBatch(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[VerifyRequest]
    def __init__(self, rows: _Optional[_Iterable[_Union[VerifyRequest, _Mapping]]] = ...) -> None: ...

class VerifyReplies(_message.Message):
    __slots__ = ("replies",)
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[VerifyReply]
    def __init__(self, replies: _Optional[_Iterable[_Union[VerifyReply, _Mapping]]] = ...) -> None: ...

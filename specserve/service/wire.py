"""The only mapping between the internal protos (``specserve.v1`` Propose / Verify) and the
contract types (``specserve.contract``): the router encodes items and decodes outcomes, the
drafter and target servers decode items and encode outcomes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from specserve.contract import (
    CallInfo,
    DraftProbs,
    ProposeItem,
    ProposeOutcome,
    RepairRecord,
    VerifyItem,
    VerifyOutcome,
)
from specserve.core.sampling import SamplingParams
from specserve.grpc_api import logprobs_from_proto, logprobs_to_proto
from specserve.proto_gen.specserve.v1 import internal_pb2 as pb

if TYPE_CHECKING:
    from specserve.engine.drafter import Prepared


def sampling_from_proto(s: pb.Sampling) -> SamplingParams:
    return SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p or 1.0,
                          seed=s.seed)


def sampling_to_proto(s: SamplingParams) -> pb.Sampling:
    return pb.Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed or 0)


def probs_to_bytes(q: DraftProbs) -> bytes:
    if q is None:
        return b""
    if isinstance(q, bytes):  # already wire form (the router passes the drafter's q on)
        return q
    return q.float().contiguous().numpy().astype("<f4").tobytes()


def probs_from_bytes(data: bytes, k: int) -> torch.Tensor | None:
    if not data or k == 0:
        return None
    arr = np.frombuffer(data, dtype="<f4")
    if arr.size % k:
        raise ValueError(f"draft_probs holds {arr.size} floats, not a multiple of k={k}")
    return torch.from_numpy(arr.reshape(k, -1).copy())


def repair_to_proto(r: RepairRecord | None) -> pb.CacheRepair | None:
    if r is None:
        return None
    return pb.CacheRepair(cached_before=r.cached_before, kept=r.kept, fed=r.fed)


def repair_from_proto(msg: pb.ProposeReply | pb.VerifyReply) -> RepairRecord | None:
    if not msg.HasField("repair"):
        return None
    r = msg.repair
    return RepairRecord(r.cached_before, r.kept, r.fed)


def _call_info(msg: pb.ProposeReply | pb.VerifyReply) -> CallInfo:
    return CallInfo(replica=msg.replica, compute_s=msg.compute_us / 1e6,
                    received_ns=msg.received_ns, sent_ns=msg.sent_ns)


# ----------------------------------------------------------------- drafter
def propose_item_to_proto(it: ProposeItem) -> pb.ProposeRequest:
    return pb.ProposeRequest(
        request_id=it.request_id, session_id=it.session_id, committed_len=it.committed_len,
        tokens_start=it.tokens_start, tokens=it.tokens, k=it.k, mode=it.mode,
        sampling=sampling_to_proto(it.sampling), traceparent=it.traceparent)


def propose_item_from_proto(msg: pb.ProposeRequest) -> ProposeItem:
    return ProposeItem(
        session_id=msg.session_id, committed_len=msg.committed_len,
        tokens_start=msg.tokens_start, tokens=list(msg.tokens), k=msg.k,
        mode=msg.mode or "draft", sampling=sampling_from_proto(msg.sampling),  # type: ignore[arg-type]
        request_id=msg.request_id, traceparent=msg.traceparent)


def propose_outcome_to_proto(o: ProposeOutcome, call_id: int, replica: str,
                             compute_us: int) -> pb.ProposeReply:
    return pb.ProposeReply(
        call_id=call_id, draft_tokens=o.draft_tokens, draft_probs=probs_to_bytes(o.draft_probs),
        cache_miss=o.cache_miss, repair=repair_to_proto(o.repair), replica=replica,
        compute_us=compute_us, ahead=o.ahead)


def prepared_to_proto(p: Prepared, replica: str) -> pb.ProposeReply:
    """A block drafted ahead, pushed unasked (call_id 0; ``DrafterEngine.take_prepared``)."""
    return pb.ProposeReply(
        call_id=0, draft_tokens=p.drafts, draft_probs=probs_to_bytes(p.q), replica=replica,
        ahead=True, session_id=p.session_id, committed_len=p.committed_len, tail=p.tail)


def prepared_matches(msg: pb.ProposeReply, committed: list[int], k: int) -> bool:
    """A pushed block is this round's proposal: it is for exactly these committed tokens
    (their length and their end: every token after the previous call's, its drafts
    accepted up to the outcome and the token the drafter guessed after them; the rest is
    what that call carried) and has k drafts."""
    n = len(msg.tail)
    return (msg.committed_len == len(committed) and len(msg.draft_tokens) == k and n > 0
            and committed[-n:] == list(msg.tail))


def propose_outcome_from_proto(msg: pb.ProposeReply) -> ProposeOutcome:
    """q stays in wire form (bytes): the router passes it to the target untouched."""
    return ProposeOutcome(
        list(msg.draft_tokens), msg.draft_probs or None, msg.cache_miss, repair_from_proto(msg),
        _call_info(msg), ahead=msg.ahead)


# ----------------------------------------------------------------- target
def verify_item_to_proto(it: VerifyItem) -> pb.VerifyRequest:
    msg = pb.VerifyRequest(
        request_id=it.request_id, session_id=it.session_id, committed_len=it.committed_len,
        tokens_start=it.tokens_start, tokens=it.tokens, draft_tokens=it.draft_tokens,
        draft_probs=probs_to_bytes(it.draft_probs), sampling=sampling_to_proto(it.sampling),
        traceparent=it.traceparent)
    if it.logprobs is not None:
        msg.logprobs = it.logprobs
    return msg


def verify_item_from_proto(msg: pb.VerifyRequest) -> VerifyItem:
    """Raises ValueError on malformed q (answered as that row's error)."""
    return VerifyItem(
        session_id=msg.session_id, committed_len=msg.committed_len,
        tokens_start=msg.tokens_start, tokens=list(msg.tokens),
        draft_tokens=list(msg.draft_tokens),
        draft_probs=probs_from_bytes(msg.draft_probs, len(msg.draft_tokens)),
        sampling=sampling_from_proto(msg.sampling), request_id=msg.request_id,
        traceparent=msg.traceparent,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None)


def verify_outcome_to_proto(o: VerifyOutcome, call_id: int, replica: str,
                            compute_us: int) -> pb.VerifyReply:
    return pb.VerifyReply(
        call_id=call_id, num_accepted=o.num_accepted, extra_token=o.extra_token, bonus=o.bonus,
        cache_miss=o.cache_miss, repair=repair_to_proto(o.repair), batch_size=o.batch_size,
        replica=replica, compute_us=compute_us, logprobs=logprobs_to_proto(o.logprobs),
        batch_tokens=o.batch_tokens, queue_rows=o.queue_rows, batch_fed=o.batch_fed)


def verify_outcome_from_proto(msg: pb.VerifyReply) -> VerifyOutcome:
    return VerifyOutcome(
        msg.num_accepted, msg.extra_token, msg.bonus, msg.cache_miss, repair_from_proto(msg),
        msg.batch_size, _call_info(msg),
        logprobs_from_proto(msg.logprobs) if len(msg.logprobs) else None,
        msg.batch_tokens, msg.queue_rows, msg.batch_fed)


def release_message(component: str, session_id: str,
                    request_id: str) -> pb.ProposeRequest | pb.VerifyRequest:
    """The fire-and-forget message that frees a session's cache at a replica."""
    cls = pb.ProposeRequest if component == "drafter" else pb.VerifyRequest
    return cls(session_id=session_id, request_id=request_id, release=True)

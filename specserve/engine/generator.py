"""Single-process speculative generation: the one round (``specserve.rounds``) over the
drafter and target engines called directly, one request at a time, streamed.

The engines are the ones the service's replicas run (``DrafterEngine``, ``TargetEngine``);
only the transport differs (a direct call instead of a gRPC stream).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from specserve.api import GenerationRequest, SpecMode, TokenLogprob, prepare_prompt
from specserve.contract import SessionProposer, SessionVerifier
from specserve.core import rng
from specserve.core.sampling import SamplingParams
from specserve.engine.detok import IncrementalDetokenizer
from specserve.engine.drafter import DrafterEngine
from specserve.engine.lean import LeanLlama
from specserve.engine.target import TargetEngine
from specserve.errors import RequestError
from specserve.models.load import ModelPair
from specserve.policy import CostModel, policy_for
from specserve.rounds import Observer, RequestState, RequestStats, iterate_sync, speculate

__all__ = ["Chunk", "GenerationStats", "RequestError", "SpeculativeGenerator", "new_state"]

GenerationStats = RequestStats  # the name the engine's callers know
ItemT = TypeVar("ItemT")
OutT = TypeVar("OutT")


@dataclass
class Chunk:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stats: RequestStats | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked


def direct(call: Callable[[list[ItemT]], list[OutT]]) -> Callable[[ItemT], Any]:
    """An in-process transport: one item straight to an engine method."""

    async def send(item: ItemT) -> OutT:
        return call([item])[0]

    return send


def new_state(req: GenerationRequest, prompt: list[int], max_context: int,
              eos_token_id: int | None, revisions: tuple[str, str],
              request_id: str | None = None) -> RequestState:
    """A request's round state: the effective seed is fixed here (recorded in its stats)."""
    seed = req.seed if req.seed is not None else rng.random_seed()
    spec = req.spec.value if req.k > 0 else SpecMode.OFF.value
    stats = RequestStats(spec=spec, k=req.k if spec != "off" else 0, seed=seed,
                         prompt_tokens=len(prompt), target_revision=revisions[0],
                         drafter_revision=revisions[1])
    return RequestState(
        request_id=request_id or uuid.uuid4().hex, session_id=uuid.uuid4().hex,
        committed=list(prompt), max_tokens=req.max_tokens,
        sampling=SamplingParams(req.temperature, req.top_k, req.top_p, seed), spec=spec,
        k=req.k, max_context=max_context, eos_token_id=eos_token_id, stats=stats,
        logprobs=req.logprobs)


class SpeculativeGenerator:
    def __init__(self, pair: ModelPair, drafter_cache_bytes: int = 256 << 20,
                 target_cache_bytes: int = 512 << 20):
        self.pair = pair
        self.lean = LeanLlama(pair.drafter) if pair.drafter is not None else None
        self.drafter = DrafterEngine(self.lean, drafter_cache_bytes)
        self.target = TargetEngine(pair.target, target_cache_bytes)
        self.cost = CostModel()  # spec=auto's cost model, learned over this engine's rounds

    def encode(self, req: GenerationRequest) -> list[int]:
        return prepare_prompt(req, self.pair.tokenizer, self.pair.vocab_size,
                              self.pair.max_context)

    def generate(self, req: GenerationRequest) -> tuple[str, list[int], RequestStats]:
        text, ids, stats = [], [], None
        for chunk in self.stream(req):
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            stats = chunk.stats or stats
        assert stats is not None
        return "".join(text), ids, stats

    def stream(self, req: GenerationRequest) -> Iterator[Chunk]:
        prompt = self.encode(req)
        if req.spec == SpecMode.DRAFT and req.k and self.lean is None:
            raise RequestError("spec: 'draft' needs a drafter model; use 'ngram' or 'off'")
        state = new_state(req, prompt, self.pair.max_context, self.pair.eos_token_id,
                          (self.pair.target_revision, self.pair.drafter_revision or ""))
        proposer = SessionProposer(direct(self.drafter.propose)) if state.spec != "off" else None
        verifier = SessionVerifier(direct(self.target.verify))
        detok = IncrementalDetokenizer(self.pair.tokenizer, req.stop)
        policy = policy_for(state, self.cost, self.lean is not None)
        rounds = speculate(state, proposer, verifier, policy, Observer(), detok)
        try:
            for o in iterate_sync(rounds):
                yield Chunk(o.text, list(o.tokens), o.finish,
                            state.stats if o.finish is not None else None, o.logprobs)
        finally:
            self.drafter.release(state.session_id)
            self.target.release(state.session_id)

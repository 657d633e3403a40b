"""Single-process speculative generation: propose -> verify -> commit, streamed.

The same pure functions the distributed service uses (``specserve.core``); here the
drafter and target live in this process, one sequence at a time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.api import MAX_K, GenerationRequest, SpecMode
from specserve.core import rng
from specserve.core.commit import decide_commit, truncate_at_stop
from specserve.core.sampling import SamplingParams
from specserve.core.stats import AcceptanceStats
from specserve.core.verify import one_hot_q, verify_batch
from specserve.engine.detok import IncrementalDetokenizer
from specserve.engine.lean import LeanLlama
from specserve.engine.sessions import DraftModelSession, NgramSession, TargetSession
from specserve.models.load import ModelPair


class RequestError(ValueError):
    """The request cannot be served as given; the message says what to change."""


@dataclass
class GenerationStats:
    spec: str
    k: int
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str = ""
    ttft_s: float = 0.0
    total_s: float = 0.0
    propose_s: float = 0.0
    verify_s: float = 0.0
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    target_revision: str = ""
    drafter_revision: str = ""
    seed: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "acceptance"}
        d.update(tokens_per_s=round(self.tokens_per_s, 2), **self.acceptance.to_dict())
        return d


@dataclass
class Chunk:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stats: GenerationStats | None = None


class SpeculativeGenerator:
    def __init__(self, pair: ModelPair):
        self.pair = pair
        self.lean = LeanLlama(pair.drafter) if pair.drafter is not None else None

    def encode(self, req: GenerationRequest) -> list[int]:
        if req.prompt_ids is not None:
            bad = [t for t in req.prompt_ids if not 0 <= t < self.pair.vocab_size]
            if bad:
                raise RequestError(
                    f"prompt_ids: token id {bad[0]} outside the vocabulary [0, "
                    f"{self.pair.vocab_size})")
            return list(req.prompt_ids)
        return self.pair.tokenizer(req.prompt, add_special_tokens=False)["input_ids"]

    def check(self, req: GenerationRequest, prompt_ids: list[int]) -> None:
        ctx = self.pair.max_context
        if len(prompt_ids) >= ctx:
            raise RequestError(
                f"prompt: {len(prompt_ids)} tokens, but the context holds {ctx}; "
                "shorten the prompt")
        if len(prompt_ids) + req.max_tokens > ctx:
            raise RequestError(
                f"max_tokens: prompt ({len(prompt_ids)} tokens) + max_tokens "
                f"({req.max_tokens}) exceeds the context ({ctx}); lower max_tokens to at most "
                f"{ctx - len(prompt_ids)}")
        if req.k > MAX_K:
            raise RequestError(f"k: at most {MAX_K}")
        if req.spec == SpecMode.DRAFT and self.lean is None:
            raise RequestError("spec: 'draft' needs a drafter model; use 'ngram' or 'off'")

    def generate(self, req: GenerationRequest) -> tuple[str, list[int], GenerationStats]:
        text, ids, stats = [], [], None
        for chunk in self.stream(req):
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            stats = chunk.stats or stats
        assert stats is not None
        return "".join(text), ids, stats

    def stream(self, req: GenerationRequest) -> Iterator[Chunk]:
        t0 = time.perf_counter()
        prompt_ids = self.encode(req)
        self.check(req, prompt_ids)
        seed = req.seed if req.seed is not None else rng.random_seed()
        sampling = SamplingParams(req.temperature, req.top_k, req.top_p, seed)
        spec = req.spec
        k_req = req.k if spec != SpecMode.OFF else 0
        proposer = None
        if spec == SpecMode.DRAFT and k_req:
            proposer = DraftModelSession(self.lean)
        elif spec == SpecMode.NGRAM and k_req:
            proposer = NgramSession()
        target = TargetSession(self.pair.target)
        detok = IncrementalDetokenizer(self.pair.tokenizer, req.stop)
        stats = GenerationStats(
            spec=spec.value, k=k_req, prompt_tokens=len(prompt_ids), seed=seed,
            target_revision=self.pair.target_revision,
            drafter_revision=self.pair.drafter_revision or "",
        )
        committed = list(prompt_ids)
        v = self.pair.vocab_size
        seeds = np.array([seed], dtype=np.uint64)
        params = (torch.tensor([sampling.temperature]), torch.tensor([sampling.top_k]),
                  torch.tensor([sampling.top_p]))
        finish = None
        while finish is None:
            remaining = req.max_tokens - stats.output_tokens
            k = min(k_req, remaining - 1)
            tp = time.perf_counter()
            drafts, q = [], None
            if proposer is not None and k > 0:
                drafts, q, _ = proposer.propose(committed, k, sampling, seed)
            tv = time.perf_counter()
            logits, _ = target.logits_for_block(committed, drafts)
            kk = len(drafts)
            if q is None and kk and not sampling.greedy:
                q = one_hot_q(torch.tensor(drafts), v)
            res = verify_batch(
                logits[None], torch.tensor([drafts], dtype=torch.int64).reshape(1, kk),
                None if q is None else q[None], torch.tensor([kk]), *params, seeds,
                np.array([len(committed)]),
            )
            te = time.perf_counter()
            stats.propose_s += tv - tp
            stats.verify_s += te - tv
            decision = decide_commit(
                len(committed), drafts, int(res.num_accepted[0]), int(res.extra_token[0]))
            stats.acceptance.observe(kk, decision.num_accepted, len(decision.tokens),
                                     decision.bonus)
            out, finish = truncate_at_stop(decision.tokens, remaining, self.pair.eos_token_id)
            committed.extend(out)
            stats.output_tokens += len(out)
            text = detok.push(out)
            if detok.stopped:
                finish = "stop"
            if finish is not None:
                text += detok.flush()
            if stats.ttft_s == 0.0:
                stats.ttft_s = time.perf_counter() - t0
            if finish is None:
                yield Chunk(text, list(out))
            else:
                stats.finish_reason = finish
                stats.total_s = time.perf_counter() - t0
                yield Chunk(text, list(out), finish, stats)

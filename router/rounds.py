"""Lock-step speculative rounds for many requests over a DraftEngine and a BatchedTarget.

Pure Python: the engines are called directly here; the router calls the same methods over
gRPC. One round = one ``propose`` call for every request that drafts, then one ``verify``
call (one target forward) for every active request, then ``decide_commit`` and
``truncate_at_stop`` per request. Each engine is sent only the committed tokens it has not
seen (``tokens_start``); a ``cache_miss`` answer is retried once with the full list.

Stop strings need the tokenizer and are the caller's business; EOS and ``max_tokens`` are
handled here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from drafter_service.engine import ProposeItem, ProposeOutcome
from specserve.core.commit import decide_commit, truncate_at_stop
from specserve.core.sampling import SamplingParams
from target_service.engine import VerifyItem, VerifyOutcome

RoundMode = Literal["draft", "ngram", "off"]


class Proposer(Protocol):
    """What the driver needs of a drafter: ``DraftEngine`` here, a gRPC client later."""

    def propose(self, items: list[ProposeItem]) -> list[ProposeOutcome]: ...

    def release(self, session_id: str) -> bool: ...


class Verifier(Protocol):
    """What the driver needs of a target: ``BatchedTarget`` here, a gRPC client later."""

    def verify(self, items: list[VerifyItem]) -> list[VerifyOutcome]: ...

    def release(self, session_id: str) -> bool: ...


@dataclass(frozen=True)
class RoundRequest:
    request_id: str  # also the engines' session id
    prompt_ids: tuple[int, ...]
    max_tokens: int
    k: int = 4
    mode: RoundMode = "draft"
    sampling: SamplingParams = field(default_factory=SamplingParams)  # seed needed to sample


@dataclass
class RequestProgress:
    request: RoundRequest
    committed: list[int]
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    target_misses: int = 0
    drafter_misses: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # target forward size per round
    sent_target: int = 0  # committed tokens the target session was last sent
    sent_drafter: int = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class LockstepDriver:
    """Drives requests round by round. ``drafter`` / ``target`` may be replaced between
    ``step`` calls (a restarted replica); the sessions then repair themselves."""

    def __init__(self, drafter: Proposer, target: Verifier,
                 requests: list[RoundRequest], eos_token_id: int | None,
                 max_batch: int | None = None):
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request_id values must be unique")
        for r in requests:
            if not r.prompt_ids:
                raise ValueError(f"request {r.request_id!r}: prompt_ids is empty")
            if r.max_tokens < 1 or r.k < 0:
                raise ValueError(f"request {r.request_id!r}: need max_tokens >= 1 and k >= 0")
            if not r.sampling.greedy and r.sampling.seed is None:
                raise ValueError(f"request {r.request_id!r}: sampling needs a seed")
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.drafter, self.target = drafter, target
        self.eos_token_id = eos_token_id
        self.max_batch = max_batch
        self.progress = [RequestProgress(r, list(r.prompt_ids)) for r in requests]

    @property
    def done(self) -> bool:
        return all(p.done for p in self.progress)

    def _propose(self, active: list[RequestProgress], ks: list[int]) -> list[ProposeOutcome]:
        def item(p: RequestProgress, k: int, start: int) -> ProposeItem:
            r = p.request
            assert r.mode != "off"
            return ProposeItem(r.request_id, len(p.committed), start, p.committed[start:], k,
                               r.mode, r.sampling)

        outs = self.drafter.propose(
            [item(p, k, p.sent_drafter) for p, k in zip(active, ks, strict=True)])
        miss = [i for i, o in enumerate(outs) if o.cache_miss]
        if miss:
            again = self.drafter.propose([item(active[i], ks[i], 0) for i in miss])
            for i, o in zip(miss, again, strict=True):
                if o.cache_miss:
                    raise RuntimeError(
                        f"drafter missed a full resend of {active[i].request.request_id!r}")
                active[i].drafter_misses += 1
                outs[i] = o
        for p in active:
            p.sent_drafter = len(p.committed)
        return outs

    def _verify(self, active: list[RequestProgress],
                proposals: list[ProposeOutcome | None]) -> list[VerifyOutcome]:
        def item(p: RequestProgress, prop: ProposeOutcome | None, start: int) -> VerifyItem:
            drafts = prop.draft_tokens if prop is not None else []
            q = prop.draft_probs if prop is not None else None
            return VerifyItem(p.request.request_id, len(p.committed), start,
                              p.committed[start:], list(drafts), q, p.request.sampling)

        outs = self.target.verify(
            [item(p, prop, p.sent_target) for p, prop in zip(active, proposals, strict=True)])
        miss = [i for i, o in enumerate(outs) if o.cache_miss]
        if miss:
            again = self.target.verify([item(active[i], proposals[i], 0) for i in miss])
            for i, o in zip(miss, again, strict=True):
                if o.cache_miss:
                    raise RuntimeError(
                        f"target missed a full resend of {active[i].request.request_id!r}")
                active[i].target_misses += 1
                outs[i] = o
        for p in active:
            p.sent_target = len(p.committed)
        return outs

    def step(self) -> bool:
        """One round for every unfinished request; False once all are finished."""
        active = [p for p in self.progress if not p.done]
        if not active:
            return False
        groups = [active]
        if self.max_batch is not None:
            groups = [active[i : i + self.max_batch]
                      for i in range(0, len(active), self.max_batch)]
        for group in groups:
            self._round(group)
        return not self.done

    def _round(self, active: list[RequestProgress]) -> None:
        ks = [0 if p.request.mode == "off"
              else min(p.request.k, p.request.max_tokens - len(p.output) - 1)
              for p in active]
        proposals: list[ProposeOutcome | None] = [None] * len(active)
        drafting = [i for i, k in enumerate(ks) if k > 0]
        if drafting:
            outs = self._propose([active[i] for i in drafting], [ks[i] for i in drafting])
            for i, o in zip(drafting, outs, strict=True):
                proposals[i] = o
        verdicts = self._verify(active, proposals)
        for p, prop, v in zip(active, proposals, verdicts, strict=True):
            drafts = prop.draft_tokens if prop is not None else []
            decision = decide_commit(len(p.committed), drafts, v.num_accepted, v.extra_token)
            remaining = p.request.max_tokens - len(p.output)
            out, finish = truncate_at_stop(decision.tokens, remaining, self.eos_token_id)
            p.committed.extend(out)
            p.output.extend(out)
            p.rounds += 1
            p.drafted += len(drafts)
            p.accepted += decision.num_accepted
            p.batch_sizes.append(v.batch_size)
            if finish is not None:
                p.finish_reason = finish
                self.drafter.release(p.request.request_id)
                self.target.release(p.request.request_id)

    def run(self) -> list[RequestProgress]:
        while self.step():
            pass
        return self.progress


def run_rounds(drafter: Proposer, target: Verifier, requests: list[RoundRequest],
               eos_token_id: int | None, max_batch: int | None = None
               ) -> list[RequestProgress]:
    """Generate for all ``requests`` in lock-step; one verify batch per round (or per
    ``max_batch`` requests). Returns each request's progress, output and counters."""
    return LockstepDriver(drafter, target, requests, eos_token_id, max_batch).run()

"""One speculative round, in one place. Every path runs it: the single-process engine, the
in-process loop over real gRPC servers and the distributed router.

    plan     = policy.choose(state)                    # proposer + k (0: plain decoding)
    q, x     = proposer.propose(state, k, mode)        # drafter / lookup: k tokens x ~ q
    n, y     = verifier.verify(state, x, q)            # target: p at k+1 positions, accept
                                                       # x_i w.p. min(1, p/q); y recovered
                                                       # from norm(max(0, p - q)) or bonus
    commit   = truncate_at_stop(decide_commit(...))    # x_1..x_n, y (cut at EOS / budget)
    policy.observe(state, outcome)                     # feedback (HF update_candidate_strategy)
    repairs  = account_repair(...)                     # what each cache rolled back / re-fed

Vocabulary (vLLM's): output tokens = *accepted* drafts + one *recovered* (first rejection)
or *bonus* (all k accepted) token; p = target, q = drafter. The proposer and verifier are
per-request objects (``Proposer`` / ``Verifier`` protocols) over any transport; the policy
picks the proposer and k (``FixedK``: the request's own; ``policy.GoodputPolicy``: spec=auto)
and says why (``Plan.reason``, counted in the stats); observers (tracing, metrics, timing)
receive the round's events and are never consulted: the round contains no span or metric code.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from specserve.api import TokenLogprob
from specserve.contract import NO_PROPOSAL, ProposeOutcome, VerifyOutcome
from specserve.core.commit import CommitDecision, decide_commit, truncate_at_stop
from specserve.core.sampling import SamplingParams
from specserve.core.stats import AcceptanceStats
from specserve.errors import ProposerFailed

if TYPE_CHECKING:
    from specserve.engine.detok import IncrementalDetokenizer

COMPONENTS = ("drafter", "target")


@dataclass
class RepairTally:
    """One request's cache repairs at one component (caches rebuilt or re-fed)."""

    repairs: int = 0
    misses: int = 0
    rolled_back: int = 0
    reprefilled: int = 0


@dataclass
class RequestStats:
    """A request's statistics: what the last chunk carries and traces / metrics report."""

    spec: str
    k: int
    seed: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str = ""
    speculation_disabled_reason: str = ""
    ttft_s: float = 0.0
    total_s: float = 0.0
    propose_s: float = 0.0  # router-side wall time of the propose calls
    verify_s: float = 0.0
    round_s: float = 0.0
    drafter_compute_s: float = 0.0  # the replicas' own compute
    target_compute_s: float = 0.0
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    target_revision: str = ""
    drafter_revision: str = ""
    k_histogram: dict[int, int] = field(default_factory=dict)  # the plans' k -> rounds
    proposer_mix: dict[str, int] = field(default_factory=dict)  # "draft"/"ngram"/"none"
    decision_reasons: dict[str, int] = field(default_factory=dict)  # Plan.reason -> rounds
    drafted_ahead: int = 0  # rounds whose drafts were prepared ahead (draft-ahead hits)
    drafted_ahead_pushed: int = 0  # of those, pushed before the round: no drafter call
    drafted_ahead_after_rejection: int = 0  # of those, prepared for a rejection's outcome

    def record_plan(self, plan: Plan) -> None:
        def bump(d: dict, key: int | str) -> None:
            d[key] = d.get(key, 0) + 1

        bump(self.k_histogram, plan.k)
        bump(self.proposer_mix, plan.proposer or "none")
        bump(self.decision_reasons, plan.reason)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()
             if k != "acceptance"}
        d.update(tokens_per_s=round(self.tokens_per_s, 2), **self.acceptance.to_dict())
        return d


@dataclass
class RequestState:
    """Everything the round reads and writes for one request."""

    request_id: str
    session_id: str
    committed: list[int]  # prompt + output
    max_tokens: int
    sampling: SamplingParams
    spec: str  # "off" | "draft" | "ngram" | "auto": the mode in effect (off once disabled)
    k: int  # the requested draft length, the policy's upper bound
    max_context: int
    eos_token_id: int | None
    stats: RequestStats
    logprobs: int | None = None  # top-n logprobs of committed tokens wanted (None: none)
    output: list[int] = field(default_factory=list)
    finish: str | None = None
    round_no: int = 0
    target_rows: int = 0  # rows of the last verify's forward plus the target's queue then
    rejected: bool = False  # the last round drafted and its verify rejected a draft
    t0: float = field(default_factory=time.perf_counter)
    last_commit_t: float = 0.0
    repairs: dict[str, RepairTally] = field(
        default_factory=lambda: {c: RepairTally() for c in COMPONENTS})
    replicas: dict[str, str] = field(default_factory=lambda: dict.fromkeys(COMPONENTS, ""))

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.output)

    def commit(self, tokens: tuple[int, ...] | list[int]) -> None:
        self.committed.extend(tokens)
        self.output.extend(tokens)
        self.stats.output_tokens = len(self.output)

    def disable_speculation(self, reason: str) -> None:
        self.spec = self.stats.spec = "off"
        self.stats.k = 0
        self.stats.speculation_disabled_reason = reason

    def finish_with(self, reason: str) -> None:
        self.finish = self.stats.finish_reason = reason
        self.stats.total_s = time.perf_counter() - self.t0


class Proposer(Protocol):
    async def propose(self, state: RequestState, k: int, traceparent: str,
                      mode: str | None = None) -> ProposeOutcome:
        """k draft tokens for ``state.committed`` by ``mode`` ("draft" / "ngram"; None: the
        request's ``state.spec``); raises ``ProposerFailed``."""
        ...


class Verifier(Protocol):
    async def verify(self, state: RequestState, proposal: ProposeOutcome,
                     traceparent: str) -> VerifyOutcome: ...


@dataclass
class RepairEvent:
    """A cache that rolled back, was re-fed or rebuilt during one call."""

    component: str
    miss: bool
    rolled_back: int
    reprefilled: int
    start_ns: int
    end_ns: int
    replica: str
    cached_before: int
    kept: int
    fed: int


@dataclass(frozen=True)
class Plan:
    """A policy's choice for one round: who proposes (None: nobody, plain decoding), how
    many tokens, and why; with a cost model, the committed tokens and the round time it
    predicts (0: no prediction)."""

    proposer: str | None
    k: int
    reason: str
    expected: float = 0.0
    cost_s: float = 0.0


NO_SPECULATION = Plan(None, 0, "off")


@dataclass
class RoundOutcome:
    round_no: int
    k: int  # the policy's choice
    proposal: ProposeOutcome
    verdict: VerifyOutcome
    decision: CommitDecision
    tokens: tuple[int, ...]  # committed this round (after EOS / budget)
    finish: str | None
    propose_s: float
    verify_s: float
    round_s: float
    repairs: list[RepairEvent]
    text: str = ""  # detokenized, when the loop has a detokenizer
    logprobs: list[TokenLogprob] | None = None  # one per committed token, when asked
    plan: Plan = NO_SPECULATION  # the policy's choice this round
    gap_s: float = 0.0  # since the request's previous round ended (0: its first round)
    # drafts prepared ahead (a draft-ahead hit): for which outcome of the round before,
    # "all_accepted" (then a guessed extra token) or "rejection" (a guessed correction)
    ahead_after: str = ""

    @property
    def drafted(self) -> int:
        return len(self.proposal.draft_tokens)

    @property
    def caught_up(self) -> int:
        """Positions the drafter's or the target's cache fed for this row beyond what they
        held (the larger): 1-2 in a steady round, more after a miss or rounds away."""
        return max((r.fed for r in (self.proposal.repair, self.verdict.repair)
                    if r is not None), default=0)


class Policy(Protocol):
    def choose(self, state: RequestState) -> Plan:
        """The proposer and k for this round, k in 0..state.k (0: the last token alone);
        no proposer when ``state.spec`` is off."""
        ...

    def observe(self, state: RequestState, outcome: RoundOutcome) -> None:
        """Every round's outcome (accepted counts, timings): adapt the next choice."""
        ...


class FixedK:
    """k = the request's k, bounded by the budget and the context, by the request's mode;
    no speculation when spec is off."""

    def choose(self, state: RequestState) -> Plan:
        if state.spec == "off":
            return NO_SPECULATION
        k = max_k(state)
        return Plan(state.spec if k > 0 else None, k, "fixed")

    def observe(self, state: RequestState, outcome: RoundOutcome) -> None:
        pass


def max_k(state: RequestState) -> int:
    """The most drafts this round may carry: the request's k, the budget, the context."""
    return max(0, min(state.k, state.remaining - 1, state.max_context - len(state.committed) - 1))


class Observer:
    """Receives the round's events; the no-op base (tracing, metrics and timing override)."""

    def round_start(self, state: RequestState, k: int) -> None:
        pass

    def call_start(self, state: RequestState, component: str) -> str:
        """Before a propose / verify call; returns the W3C traceparent to send ('' = none)."""
        return ""

    def call_end(self, state: RequestState, component: str,
                 outcome: ProposeOutcome | VerifyOutcome | None,
                 error: BaseException | None) -> None:
        pass

    def round_end(self, state: RequestState, outcome: RoundOutcome) -> None:
        pass

    def request_end(self, state: RequestState, error: BaseException | None) -> None:
        pass


class Observers(Observer):
    """Fan-out to several observers; traceparent from the first that gives one."""

    def __init__(self, *observers: Observer):
        self.observers = [o for o in observers if o is not None]

    def round_start(self, state: RequestState, k: int) -> None:
        for o in self.observers:
            o.round_start(state, k)

    def call_start(self, state: RequestState, component: str) -> str:
        tps = [o.call_start(state, component) for o in self.observers]
        return next((tp for tp in tps if tp), "")

    def call_end(self, state, component, outcome, error) -> None:
        for o in self.observers:
            o.call_end(state, component, outcome, error)

    def round_end(self, state: RequestState, outcome: RoundOutcome) -> None:
        for o in self.observers:
            o.round_end(state, outcome)

    def request_end(self, state: RequestState, error: BaseException | None) -> None:
        for o in self.observers:
            o.request_end(state, error)


def account_repair(state: RequestState, component: str,
                   outcome: ProposeOutcome | VerifyOutcome) -> RepairEvent | None:
    """One reply's cache repair, tallied on the request. Rolled-back entries (the previous
    round's rejected drafts) are routine; a cache re-fed or rebuilt (a miss, a re-leased
    replica) is a repair. The session's first call is its prefill, not a repair."""
    rep, info = outcome.repair, outcome.call
    if rep is None:
        return None
    miss = info.miss_ns is not None or (not info.first and rep.kept == 0 and rep.fed > 2)
    rolled_back = rep.cached_before - rep.kept
    reprefilled = max(0, rep.fed - 2) if (miss or not info.first) else 0
    if not (miss or rolled_back or reprefilled):
        return None
    tally = state.repairs[component]
    tally.repairs += int(miss or reprefilled > 0)
    tally.misses += int(miss)
    tally.rolled_back += rolled_back
    tally.reprefilled += reprefilled
    start = info.miss_ns if info.miss_ns is not None else info.call_ns
    end = info.reply_ns if info.miss_ns is not None else info.call_ns
    return RepairEvent(component, miss, rolled_back, reprefilled, start, end, info.replica,
                       rep.cached_before, rep.kept, rep.fed)


async def _propose(state: RequestState, proposer: Proposer, plan: Plan,
                   observer: Observer) -> ProposeOutcome:
    traceparent = observer.call_start(state, "drafter")
    try:
        proposal = await proposer.propose(state, plan.k, traceparent, plan.proposer)
    except ProposerFailed as e:  # the request goes on without speculation
        observer.call_end(state, "drafter", None, e)
        state.disable_speculation(f"drafter failed: {e}")
        return NO_PROPOSAL
    observer.call_end(state, "drafter", proposal, None)
    return proposal


async def _verify(state: RequestState, verifier: Verifier, proposal: ProposeOutcome,
                  observer: Observer) -> VerifyOutcome:
    traceparent = observer.call_start(state, "target")
    try:
        verdict = await verifier.verify(state, proposal, traceparent)
    except BaseException as e:
        observer.call_end(state, "target", None, e)
        raise
    observer.call_end(state, "target", verdict, None)
    return verdict


async def speculative_round(state: RequestState, proposer: Proposer | None,
                            verifier: Verifier, policy: Policy,
                            observer: Observer) -> RoundOutcome:
    """One round: plan -> propose -> verify -> commit -> feedback -> repair accounting."""
    t0 = time.perf_counter()
    gap = t0 - state.last_commit_t if state.last_commit_t else 0.0
    plan = policy.choose(state)  # no proposer: speculation is off (the plan says why)
    k = plan.k if proposer is not None and plan.proposer is not None else 0
    state.stats.record_plan(plan)
    observer.round_start(state, k)
    proposal = await _propose(state, proposer, plan, observer) if k > 0 else NO_PROPOSAL
    t1 = time.perf_counter()
    verdict = await _verify(state, verifier, proposal, observer)
    t2 = time.perf_counter()
    state.target_rows = verdict.batch_size + verdict.queue_rows
    decision = decide_commit(len(state.committed), proposal.draft_tokens, verdict.num_accepted,
                             verdict.extra_token)
    tokens, finish = truncate_at_stop(decision.tokens, state.remaining, state.eos_token_id)
    state.commit(tokens)
    ahead_after = ("" if not (proposal.ahead and proposal.draft_tokens)
                   else "rejection" if state.rejected else "all_accepted")
    state.rejected = bool(proposal.draft_tokens) and not decision.bonus
    state.stats.acceptance.observe(len(proposal.draft_tokens), decision.num_accepted,
                                   len(decision.tokens), decision.bonus)
    repairs = [e for c, o in (("drafter", proposal), ("target", verdict))
               if (e := account_repair(state, c, o)) is not None]
    outcome = RoundOutcome(state.round_no, k, proposal, verdict, decision, tokens, finish,
                           t1 - t0, t2 - t1, time.perf_counter() - t0, repairs,
                           logprobs=(verdict.logprobs[: len(tokens)]
                                     if verdict.logprobs is not None else None), plan=plan,
                           gap_s=gap, ahead_after=ahead_after)
    _account_time(state, outcome)
    policy.observe(state, outcome)
    observer.round_end(state, outcome)
    state.round_no += 1
    return outcome


def _account_time(state: RequestState, o: RoundOutcome) -> None:
    st = state.stats
    st.propose_s += o.propose_s
    st.verify_s += o.verify_s
    st.round_s += o.round_s
    st.drafter_compute_s += o.proposal.call.compute_s if o.drafted else 0.0
    st.drafted_ahead += int(o.proposal.ahead and o.drafted > 0)
    st.drafted_ahead_pushed += int(o.proposal.pushed and o.drafted > 0)
    st.drafted_ahead_after_rejection += o.ahead_after == "rejection"
    st.target_compute_s += o.verdict.call.compute_s
    for c, o_ in (("drafter", o.proposal), ("target", o.verdict)):
        if o_.call.replica:
            state.replicas[c] = o_.call.replica
    now = time.perf_counter()
    if not st.ttft_s:
        st.ttft_s = now - state.t0
    state.last_commit_t = now


async def speculate(state: RequestState, proposer: Proposer | None, verifier: Verifier,
                    policy: Policy, observer: Observer,
                    detok: IncrementalDetokenizer | None = None) -> AsyncIterator[RoundOutcome]:
    """Rounds until the request finishes (EOS, max_tokens, or a stop string found by
    ``detok``); each outcome carries the committed tokens and, with ``detok``, their text."""
    while state.finish is None:
        outcome = await speculative_round(state, proposer, verifier, policy, observer)
        finish = outcome.finish
        if detok is not None:
            outcome.text = detok.push(outcome.tokens)
            if detok.stopped:
                finish = outcome.finish = "stop"
            if finish is not None:
                outcome.text += detok.flush()
        if finish is not None:
            state.finish_with(finish)
        yield outcome


T = TypeVar("T")


def iterate_sync(agen: AsyncIterator[T]) -> Iterator[T]:
    """Drive an async iterator from synchronous code (the single-process engine, whose
    proposer and verifier never await): one private event loop per iteration."""
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                yield loop.run_until_complete(agen.__anext__())
            except StopAsyncIteration:
                return
    finally:
        loop.run_until_complete(agen.aclose())
        loop.close()


async def run_ahead(source: AsyncIterator[T], depth: int) -> AsyncIterator[T]:
    """Iterate ``source`` in its own task, up to ``depth`` items ahead of the consumer: the
    next round runs while the consumer journals and streams this one (the journal still
    precedes the stream of every token, in the consumer). An error of the source is raised
    here, in order; closing this iterator cancels the source."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=depth)
    done = object()

    async def produce() -> None:
        try:
            async for item in source:
                await queue.put((item, None))
            await queue.put((done, None))
        except Exception as e:  # handed to the consumer (cancellation is not)
            await queue.put((done, e))

    task = asyncio.get_running_loop().create_task(produce())
    try:
        while True:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                return
            yield item
    finally:  # the source's own cleanup (releases, spans) runs before the caller's
        while not task.done():  # again until it ends: asyncio.wait_for in 3.11 can swallow
            task.cancel()       # a cancel whose inner call completes at the same moment
            await asyncio.wait({task}, timeout=0.05)

"""``spec=auto``: a goodput controller that picks the proposer and k every round
(SmartSpec / TurboSpec). Pure: no Ray, gRPC or Redis; the round calls it, the router and
the engines share one ``CostModel`` between their requests.

Every round, for one request, each candidate (nobody, prompt lookup with k up to its match,
the draft model with k up to K_max) is scored by the goodput of the target batch it joins::

    E(k)      = 1 + sum_{j=1..k} prod_{i<j} alpha_i          (expected committed tokens)
    time(k)   = overhead + propose(k) * share + verify(others + 1, tokens + k + 1)
    goodput   = (others * m + E(k)) / time(k)

alpha_i: this request's acceptance estimate at draft position i for that proposer (an
exponential moving estimate starting from a prior, the fleet's when Redis has one);
verify(rows, tokens): the target's forward time (a + b_row rows + b_draft drafts, fitted
online to the replies' compute times); propose(k): the proposer's call, for the draft model
a per-token time (online), for prompt lookup its call alone; others, tokens, m:
the other rows of the batch plus the target's queue (from the last verify reply) and the
committed tokens each gets per round; share: how much of the proposer's time the batch
waits for. The target's step waits for every row whose reply is out (its cohort), so a
row that drafts while no other row of its batch does holds up the whole batch (share 1),
while rows that draft together are served in one drafter step (share 1 / rows). Under
load the others dominate and extra tokens only slow them, so k falls smoothly to 0
(spec-off); there is no table of steps.

Each plan says why: ``goodput`` (speculating pays), ``low_acceptance`` (it would not pay
even alone), ``saturated`` (it would pay alone, not in this batch), ``no_lookup_match``
(no drafter and the prompt lookup found nothing), ``drafter_unavailable`` (the drafter
failed or is missing), ``budget`` (no room for a draft: max_tokens or the context).

Greedy requests only: their output is the target's whatever the plan. A sampled request's
tokens depend on where drafts were proposed, so its plans must not depend on timing or load
(its seed must reproduce it, DESIGN §2): it gets ``reproducible`` plans (reason ``sampled``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from specserve.core.ngram import propose_ngram
from specserve.rounds import NO_SPECULATION, FixedK, Plan, Policy, max_k

if TYPE_CHECKING:
    from specserve.rounds import RequestState, RoundOutcome

PROPOSERS = ("draft", "ngram")
REASONS = ("goodput", "low_acceptance", "saturated", "no_lookup_match", "drafter_unavailable",
           "budget", "sampled", "fixed", "off")
PRIOR_ACCEPTANCE = {"draft": 0.6, "ngram": 0.5}  # before any observation, fleet or own
PRIOR_WEIGHT = 4.0  # the prior counts as this many observations per position
MIN_STEP = 0.1  # the moving estimate never weighs a new observation less than this


class Acceptance:
    """Per-position conditional acceptance alpha_i = P(accept i | accepted 0..i-1) of one
    proposer for one request: a moving estimate that starts at ``prior`` (weight
    ``PRIOR_WEIGHT`` observations) and then follows the request (step >= ``MIN_STEP``)."""

    def __init__(self, prior: Sequence[float]):
        self.alpha = list(prior)
        self.seen = [0] * len(prior)

    def observe(self, drafted: int, accepted: int) -> None:
        for i in range(min(drafted, accepted + 1, len(self.alpha))):  # positions reached
            self.seen[i] += 1
            step = max(1.0 / (self.seen[i] + PRIOR_WEIGHT), MIN_STEP)
            self.alpha[i] += step * (float(i < accepted) - self.alpha[i])

    def expected(self, k: int) -> float:
        """Expected committed tokens of a round with k drafts (accepted + the extra one)."""
        total, run = 1.0, 1.0
        for a in self.alpha[:k]:
            run *= a
            total += run
        return total


@dataclass
class _VerifyFit:
    """The target's forward time = a + b_row * rows + b_draft * drafts (``drafts``: the
    tokens beyond one per row), by exponentially weighted least squares with a ridge of two
    pseudo-observations per coefficient towards the prior ``a * (1, rel_row, rel_draft)``:
    a coefficient the data does not determine (every row with k = 0; always one row) keeps
    the prior's, so a k not tried lately looks as cheap as the prior says and gets tried.
    And b_draft <= b_row: a draft token in a row never costs more than a new row (when rows
    and drafts rise together the fit alone cannot tell them apart)."""

    rel: tuple[float, float] = (0.3, 0.08)
    decay: float = 0.98
    xtx: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)))
    xty: np.ndarray = field(default_factory=lambda: np.zeros(3))
    _theta: np.ndarray | None = None  # the solution for the sums as they are

    def observe(self, rows: int, tokens: float, seconds: float) -> None:
        x = np.array([1.0, rows, tokens - rows])
        self.xtx = self.xtx * self.decay + np.outer(x, x)
        self.xty = self.xty * self.decay + x * seconds
        self._theta = None

    @property
    def known(self) -> bool:
        return bool(self.xtx[0, 0] > 0)

    def coef(self) -> np.ndarray:
        if self._theta is None:
            self._theta = self._solve()
        return self._theta

    def _solve(self) -> np.ndarray:
        w = self.xtx[0, 0]
        ratios = np.array([1.0, *self.rel])
        prior = ratios * (self.xty[0] / w) / float(ratios @ (self.xtx[0] / w))
        lam = 2.0 * np.maximum(np.diag(self.xtx) / w, 1e-9)
        a, b_row, b_draft = np.linalg.solve(self.xtx + np.diag(lam), self.xty + lam * prior)
        b_row = max(b_row, 0.0)
        return np.array([max(a, 1e-6), b_row, min(max(b_draft, 0.0), b_row)])


def _ema(old: float | None, new: float, w: float = 0.1) -> float:
    return new if old is None else (1 - w) * old + w * new


def _ema_low(old: float | None, new: float) -> float:
    """Follows decreases fast, increases slowly: the proposer's own cost, not the queue
    that forms when every request drafts at once (which would make drafting look dear
    for good: a proposer no longer chosen is no longer measured)."""
    return _ema(old, new, 0.5 if old is None or new < old else 0.05)


@dataclass
class CostModel:
    """What a round costs, shared by the requests of one router (or engine): the target's
    verify time by batch tokens, each proposer's call (a fixed part: transport, lookup; and
    for the draft model a per-token part), the rest of the round (verify transport,
    scheduling) and the committed tokens per row of other requests. Starts from
    ``default_verify_s`` (a conservative guess, or a measured profile) and learns online."""

    default_verify_s: float = 0.02
    draft_rel_cost: float = 0.1  # prior: a draft token costs 10% of a target forward
    verify: _VerifyFit = field(default_factory=_VerifyFit)
    draft_token_s: float | None = None
    call_s: dict[str, float] = field(default_factory=dict)  # proposer -> fixed call time
    overhead_s: float = 0.0
    row_tokens: float = 1.5  # committed tokens per row per round, over recent rounds
    profiled: int = 0  # verify points seeded from replicas' start-up profiles

    def verify_s(self, rows: float, tokens: float) -> float:
        x = np.array([1.0, rows, tokens - rows])
        if not self.verify.known:
            return self.default_verify_s * float(np.array([1.0, *self.verify.rel]) @
                                                 (x - [0.0, 1.0, 0.0]))
        return float(self.verify.coef() @ x)

    def snapshot(self) -> dict:
        """What the model believes now, in milliseconds (``router_stats``)."""
        ms = [round(1000 * float(x), 3) for x in self.verify.coef()] \
            if self.verify.known else None
        return {"verify_ms_a_row_draft": ms, "draft_token_ms":
                round(1000 * self.draft_token_s, 3) if self.draft_token_s else None,
                "call_ms": {p: round(1000 * v, 3) for p, v in self.call_s.items()},
                "overhead_ms": round(1000 * self.overhead_s, 3),
                "row_tokens": round(self.row_tokens, 3), "profiled": self.profiled}

    def seed(self, verify: Sequence[tuple[int, int, float]],
             draft_token_s: float | None = None) -> None:
        """Start from replicas' start-up profiles (``specserve.engine.profile``): verify
        seconds by (rows, batch tokens) over a grid, and the draft model's per-token time.
        Online observations then take over (the fit decays old ones)."""
        for rows, tokens, seconds in verify:
            if rows > 0 and tokens >= rows and seconds > 0:
                self.verify.observe(rows, tokens, seconds)
                self.profiled += 1
        if draft_token_s and self.draft_token_s is None:
            self.draft_token_s = draft_token_s

    def propose_s(self, proposer: str | None, k: int) -> float:
        if proposer is None or k == 0:
            return 0.0
        fixed = self.call_s.get(proposer, 0.0)
        if proposer == "ngram":
            return fixed  # a search over the committed tokens, plus the call
        per = self.draft_token_s
        return fixed + k * (per if per is not None else
                            self.draft_rel_cost * self.verify_s(1, 1))

    def observe(self, o: RoundOutcome) -> None:
        v, p = o.verdict, o.plan.proposer
        verify = v.call.compute_s or o.verify_s  # in process: no replica reports compute
        if v.batch_size > 0 and verify > 0:
            self.verify.observe(v.batch_size, v.batch_tokens or v.batch_size * (o.drafted + 1),
                                verify)
        compute = (o.proposal.call.compute_s or o.propose_s) if o.drafted else 0.0
        if p == "draft" and o.drafted and compute > 0:
            self.draft_token_s = _ema_low(self.draft_token_s, compute / o.drafted)
        if p is not None and o.drafted:
            fixed = max(0.0, o.propose_s - (compute if p == "draft" else 0.0))
            self.call_s[p] = _ema_low(self.call_s.get(p), fixed)
        self.overhead_s = _ema(self.overhead_s, max(0.0, o.round_s - o.propose_s - verify))
        self.row_tokens = _ema(self.row_tokens, len(o.decision.tokens), 0.05)


@dataclass
class Load:
    """The other rows in the target batch this request's next row joins, and the tokens
    they feed: the last verify reply's batch less this row, plus the queue behind it."""

    rows: int = 0
    tokens: float = 0.0
    drafting: bool = False  # some other row of the batch carried drafts


class GoodputPolicy:
    """``spec=auto`` for one request (``rounds.Policy``). ``priors``: per proposer, the
    fleet's per-position acceptance (``PriorStore``); missing: ``PRIOR_ACCEPTANCE``."""

    def __init__(self, cost: CostModel, k_max: int, has_drafter: bool,
                 priors: dict[str, list[float]] | None = None,
                 ngram_max_n: int = 4, ngram_min_n: int = 1):
        self.cost, self.k_max, self.has_drafter = cost, k_max, has_drafter
        self.ngram_n = (ngram_max_n, ngram_min_n)
        priors = priors or {}
        self.acceptance = {
            p: Acceptance([*priors.get(p, []), *[PRIOR_ACCEPTANCE[p]] * k_max][:k_max])
            for p in PROPOSERS}
        self.load = Load()
        self.counts = {p: [[0] * k_max, [0] * k_max] for p in PROPOSERS}  # tried, accepted

    def candidates(self, state: RequestState, k_cap: int) -> list[tuple[str, int]]:
        out = []
        if self.has_drafter:
            out += [("draft", k) for k in range(1, k_cap + 1)]
        match = propose_ngram(state.committed, k_cap, *self.ngram_n)
        out += [("ngram", k) for k in range(1, len(match) + 1)]
        return out

    def score(self, proposer: str | None, k: int, load: Load) -> tuple[float, Plan]:
        """The batch's goodput (tokens / s) with this row's plan (its expected committed
        tokens and the round time). The proposer's time: shared by the batch's drafting
        rows when others draft too (one drafter step serves them all), the whole batch's
        wait when this row would be the only one (the cohort waits for it)."""
        c = self.cost
        e = self.acceptance[proposer].expected(k) if proposer else 1.0
        share = 1.0 / (1 + load.rows) if load.drafting else 1.0
        t = c.overhead_s + c.propose_s(proposer, k) * share + \
            c.verify_s(load.rows + 1, load.tokens + 1 + k)
        return (load.rows * c.row_tokens + e) / t, Plan(proposer, k, "goodput", e, t)

    def best(self, cands: list[tuple[str, int]], load: Load) -> Plan:
        best, plan = self.score(None, 0, load)
        for p, k in cands:
            g, candidate = self.score(p, k, load)
            if g > best * (1 + 1e-9):
                best, plan = g, candidate
        return plan

    def choose(self, state: RequestState) -> Plan:
        if state.spec == "off":
            return Plan(None, 0, "drafter_unavailable") \
                if state.stats.speculation_disabled_reason else NO_SPECULATION
        k_cap = min(max_k(state), self.k_max)
        if k_cap == 0:
            return Plan(None, 0, "budget", 1.0)
        if not state.sampling.greedy:
            return self.reproducible(state, k_cap)
        cands = self.candidates(state, k_cap)
        if not cands:
            return Plan(None, 0, "no_lookup_match", 1.0)
        plan = self.best(cands, self.load)
        if plan.k > 0:
            return plan
        alone = self.best(cands, Load())  # would it pay without the others?
        return replace(plan, reason="saturated" if alone.k > 0 else "low_acceptance")

    def reproducible(self, state: RequestState, k_cap: int) -> Plan:
        """A sampled request's plan: a function of its committed tokens alone, so that its
        seed reproduces it (a retry, a resume from the journal; DESIGN §2), whatever the
        timing and load: the draft model (what spec=draft does), else a lookup match, else
        nobody. (Prompt lookup's q is one-hot: sampled, it is accepted with p(x) only.)"""
        if self.has_drafter:
            return Plan("draft", k_cap, "sampled")
        match = propose_ngram(state.committed, k_cap, *self.ngram_n)
        if match:
            return Plan("ngram", len(match), "sampled")
        return Plan(None, 0, "no_lookup_match")

    def observe(self, state: RequestState, o: RoundOutcome) -> None:
        self.cost.observe(o)
        v = o.verdict
        if v.batch_size > 0:
            own = o.drafted + 1
            others = (v.batch_tokens or v.batch_size * own) - own
            per_row = others / (v.batch_size - 1) if v.batch_size > 1 else 1.0
            self.load = Load(v.batch_size - 1 + v.queue_rows,
                             others + v.queue_rows * max(per_row, 1.0),
                             drafting=others > v.batch_size - 1)
        p = o.plan.proposer
        if p is not None and o.drafted:
            self.acceptance[p].observe(o.drafted, o.decision.num_accepted)
            tried, acc = self.counts[p]
            for i in range(min(o.drafted, o.decision.num_accepted + 1, self.k_max)):
                tried[i] += 1
                acc[i] += int(i < o.decision.num_accepted)


def policy_for(state: RequestState, cost: CostModel, has_drafter: bool,
               priors: dict[str, list[float]] | None = None) -> Policy:
    """The request's policy: ``GoodputPolicy`` for spec=auto, else its fixed mode and k."""
    if state.spec == "auto":
        return GoodputPolicy(cost, state.k, has_drafter, priors)
    return FixedK()

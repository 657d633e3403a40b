"""``spec=auto``: a goodput controller that picks the proposer and k every round
(SmartSpec / TurboSpec). Pure: no Ray, gRPC or Redis; the round calls it, the router and
the engines share one ``CostModel`` between their requests.

Every round, for one request, each candidate (nobody, prompt lookup with k up to its match,
the draft model with k up to K_max) is scored by the goodput of the target batch it joins::

    E(k)      = 1 + sum_{j=1..k} prod_{i<j} alpha_i          (expected committed tokens)
    time(k)   = overhead + draft(k) + verify(tokens_others + k + 1)
    goodput   = (others * m + E(k)) / time(k)

alpha_i: this request's acceptance estimate at draft position i for that proposer (an
exponential moving estimate starting from a prior, the fleet's when Redis has one);
verify(x): the target's forward time for x tokens in the batch (a + b x, fitted online to
the replies' compute times); draft(k): the drafter's per-token time (online); others, m:
the other rows of the batch plus the target's queue (from the last verify reply) and the
committed tokens each gets per round. Under load the others dominate and extra tokens
only slow them, so k falls smoothly to 0 (spec-off); there is no table of steps.

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
class _Linear:
    """y = a + b x by exponentially weighted least squares, shrunk towards b = rel * a
    (``rel``: the prior's relative cost of one more token) while x has barely varied, and
    with 0 <= b <= a: one forward over x tokens costs at most x forwards of one (a noisy
    fit beyond that is noise, not the model)."""

    rel: float
    decay: float = 0.98
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # w, wx, wy, wxx, wxy

    def observe(self, x: float, y: float) -> None:
        s = self.sums
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            s[i] = s[i] * self.decay + v

    @property
    def known(self) -> bool:
        return self.sums[0] > 0

    def coef(self) -> tuple[float, float]:
        w, wx, wy, wxx, wxy = self.sums
        mx, my = wx / w, wy / w
        var = wxx / w - mx * mx
        a_prior = my / (1.0 + self.rel * mx)
        b = a_prior * self.rel
        if var > 1e-9:  # a fit over spread-out x, weighed against the prior's 2 points
            b_fit = (wxy / w - mx * my) / var
            b = (w * var * b_fit + 2.0 * b) / (w * var + 2.0)
        b = min(max(b, 0.0), my / (1.0 + mx))
        return max(my - b * mx, 1e-6), b


def _ema(old: float | None, new: float, w: float = 0.1) -> float:
    return new if old is None else (1 - w) * old + w * new


@dataclass
class CostModel:
    """What a round costs, shared by the requests of one router (or engine): the target's
    verify time by batch tokens, each proposer's call (a fixed part: transport, lookup; and
    for the draft model a per-token part), the rest of the round (verify transport,
    scheduling) and the committed tokens per row of other requests. Starts from
    ``default_verify_s`` (a conservative guess, or a measured profile) and learns online."""

    default_verify_s: float = 0.02
    token_rel_cost: float = 0.05  # prior: one more token in the forward costs 5% of a row
    draft_rel_cost: float = 0.1  # prior: a draft token costs 10% of a target forward
    verify: _Linear = field(default_factory=lambda: _Linear(0.05))
    draft_token_s: float | None = None
    call_s: dict[str, float] = field(default_factory=dict)  # proposer -> fixed call time
    overhead_s: float = 0.0
    row_tokens: float = 1.5  # committed tokens per row per round, over recent rounds

    def __post_init__(self) -> None:
        self.verify.rel = self.token_rel_cost

    def verify_s(self, tokens: float) -> float:
        if not self.verify.known:
            return self.default_verify_s * (1.0 + self.token_rel_cost * (tokens - 1.0))
        a, b = self.verify.coef()
        return a + b * tokens

    def propose_s(self, proposer: str | None, k: int) -> float:
        if proposer is None or k == 0:
            return 0.0
        fixed = self.call_s.get(proposer, 0.0)
        if proposer == "ngram":
            return fixed  # a search over the committed tokens, plus the call
        per = self.draft_token_s
        return fixed + k * (per if per is not None else self.draft_rel_cost * self.verify_s(1))

    def observe(self, o: RoundOutcome) -> None:
        v, p = o.verdict, o.plan.proposer
        verify = v.call.compute_s or o.verify_s  # in process: no replica reports compute
        if v.batch_size > 0 and verify > 0:
            self.verify.observe(v.batch_tokens or v.batch_size * (o.drafted + 1), verify)
        compute = (o.proposal.call.compute_s or o.propose_s) if o.drafted else 0.0
        if p == "draft" and o.drafted and compute > 0:
            self.draft_token_s = _ema(self.draft_token_s, compute / o.drafted)
        if p is not None and o.drafted:
            fixed = max(0.0, o.propose_s - (compute if p == "draft" else 0.0))
            self.call_s[p] = _ema(self.call_s.get(p), fixed)
        self.overhead_s = _ema(self.overhead_s, max(0.0, o.round_s - o.propose_s - verify))
        self.row_tokens = _ema(self.row_tokens, len(o.decision.tokens), 0.05)


@dataclass
class Load:
    """The other rows in the target batch this request's next row joins, and the tokens
    they feed: the last verify reply's batch less this row, plus the queue behind it."""

    rows: int = 0
    tokens: float = 0.0


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
        tokens and the round time)."""
        c = self.cost
        e = self.acceptance[proposer].expected(k) if proposer else 1.0
        t = c.overhead_s + c.propose_s(proposer, k) + c.verify_s(load.tokens + 1 + k)
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
        timing and load: a full-length lookup match, else the draft model, else a shorter
        match, else nobody."""
        match = propose_ngram(state.committed, k_cap, *self.ngram_n)
        if len(match) == k_cap or (match and not self.has_drafter):
            return Plan("ngram", len(match), "sampled")
        if self.has_drafter:
            return Plan("draft", k_cap, "sampled")
        return Plan(None, 0, "no_lookup_match")

    def observe(self, state: RequestState, o: RoundOutcome) -> None:
        self.cost.observe(o)
        v = o.verdict
        if v.batch_size > 0:
            own = o.drafted + 1
            others = (v.batch_tokens or v.batch_size * own) - own
            per_row = others / (v.batch_size - 1) if v.batch_size > 1 else 1.0
            self.load = Load(v.batch_size - 1 + v.queue_rows,
                             others + v.queue_rows * max(per_row, 1.0))
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

"""``spec=auto``: a goodput controller that picks the proposer and k every round
(SmartSpec / TurboSpec). Pure: no Ray, gRPC or Redis; the round calls it, the router and
the engines share one ``CostModel`` between their requests.

Every round, for one request, each candidate (nobody, prompt lookup with k up to its match,
the draft model with k up to K_max) is scored by the goodput of the target batch it joins,
as if every row of that batch made the same choice::

    E(k)      = 1 + sum_{j=1..k} prod_{i<j} alpha_i          (expected committed tokens)
    time(k)   = overhead + propose(R, k) + verify(R, R (1 + k))
    goodput   = R E(k) / time(k)                             (R: rows, this one included)

alpha_i: this request's acceptance estimate at draft position i for that proposer (an
exponential moving estimate starting from a prior, the fleet's when Redis has one);
verify(rows, tokens): the target's forward time (a + b_row rows + b_draft drafts, fitted
online to the replies' compute times, seeded by the replicas' start-up profiles);
propose(R, k): the proposer's call, for the draft model k drafter steps over the batch's
drafting rows (c + d_row rows per step, likewise fitted and seeded), for prompt lookup its
call alone; R: the rows of the verify replies' batches plus the target's queue, smoothed
over the batch's last rounds, and never below the router's own requests in flight
(``CostModel.load``, ``admitted``); overhead: the rest of a round beyond propose and verify
compute, a moving average that weighs a batch round 0.1 (``OVERHEAD_STEP``), each round's
rest counted up to ``STALL`` x the estimate (or ``OVERHEAD_FLOOR_S``). A plan that has run
lately at this load (on a grid: exact up to 4 rows, 25 % apart above) has its own measured
round time, and that replaces time(k): the linear model misprices some plans (a draft's
verify cost grows with the context; where the drafter and the target share CPUs, drafting
slows the target's forward, which no term of the model has), so it proposes and the
measurements decide (``CostModel.round_s``). The fit does not learn from a target step
that had a prefill in it (its time is no function of rows and drafts: ``decoding``); a
plan's measured time does (per round, a plan that commits more tokens has more arrivals'
prefills in its steps).

Why the whole batch: the target's step waits for every row of its cohort, and the drafter
serves the rows that draft together in one step, so drafting pays or costs per batch. A
row that scored itself alone against the batch as it is (others plain) would charge one
row's gain with the whole drafter step and never start drafting in a batch that does not
draft yet. And the rows of a batch must keep in step: one that skips the proposer while
the others draft arrives early at the target and splits the cohort, one with more drafts
than the others lengthens every row (attention pads them to the longest). So among others
(``in_batch``) every row takes the batch's shared k, decided once a batch round on what all
of them see alike (the router's pooled acceptance, the shared costs, the batch's rows) and
changed only for a clearly better one within reach: a batch climbs one draft at a time,
each rung measured at its load before the next, from spec-off where nothing is measured
(``CostModel.towards``); a row alone chooses its proposer and k freely, by its own
acceptance. Under load the verify time of the extra tokens outgrows their gain, so the
batch turns to k = 0 (spec-off); there is no table of steps. (A request among rows that
never draft, fixed spec-off traffic, is scored as if they followed it: the model's one
known blind spot.)

Each plan says why: ``goodput`` (speculating pays), ``low_acceptance`` (it would not pay
even alone), ``saturated`` (it would pay alone, not in this batch), ``no_lookup_match``
(no drafter and the prompt lookup found nothing), ``drafter_unavailable`` (the drafter
failed or is missing), ``budget`` (no room for a draft: max_tokens or the context),
``explore`` (a row alone that found speculation not worth it ``EXPLORE_AFTER`` rounds in a
row drafts once, its best candidate: its acceptance and the drafts' cost are measured only
where it drafts, and an estimate made on a bad stretch, or a cost model that overprices
drafts, would otherwise keep it at k = 0 for good; and a batch's try of the plan one draft
down, which the model overprices, of the other proposer's plan at its k, never measured
near the load, or of a plan it left on a stretch of its rounds, a burst's: ``try_down``),
``climb`` (a batch on a rung below its best plan, which is out of reach until the rung is
measured: ``CostModel.towards``).

Greedy requests only: their output is the target's whatever the plan. A sampled request's
tokens depend on where drafts were proposed, so its plans must not depend on timing or load
(its seed must reproduce it, DESIGN §2): it gets ``reproducible`` plans (reason ``sampled``).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from specserve.api import MAX_K
from specserve.core.ngram import NgramIndex
from specserve.rounds import NO_SPECULATION, FixedK, Plan, Policy, max_k

if TYPE_CHECKING:
    from specserve.contract import CallInfo, VerifyOutcome
    from specserve.rounds import RequestState, RoundOutcome

PROPOSERS = ("draft", "ngram")
REASONS = ("goodput", "low_acceptance", "saturated", "no_lookup_match", "drafter_unavailable",
           "budget", "sampled", "fixed", "off", "explore", "climb")
EXPLORE_AFTER = 16  # rounds alone at k = 0 (low_acceptance) before one round drafts
PRIOR_ACCEPTANCE = {"draft": 0.6, "ngram": 0.5}  # before any observation, fleet or own
PRIOR_WEIGHT = 4.0  # the prior counts as this many observations per position
MIN_STEP = 0.1  # the moving estimate never weighs a new observation less than this
POOLED_STEP = 0.02  # the same for the router's pooled estimate (all its requests' rounds)
DRIFT_WINDOW = 16  # a pooled estimate keeps each position's last this many observations;
DRIFT_MIN = 8  # from this many on, where their count accepted is this unlikely at the
DRIFT_P = 1e-6  # estimate (either tail), it restarts from them (``Acceptance.restart``)
DRAFT_PROFILE_WEIGHT = 4  # observations per point of a drafter's start-up profile
HYSTERESIS = 0.03  # a batch's shared plan changes only for a better score by this much
CATCH_UP = 0.10  # and to the draft model from another plan by this much more (see in_batch)
NOISE_Z = 1.0  # and by this many standard errors of the two plans' measured times and
# expected tokens more
PRIOR_MATCH = 0.5  # before any observation: the share of prompt lookups that find a match
MATCH_STEP = 0.05  # the weight of a search in the moving share of those that matched
MEASURED_AFTER = 2  # batch rounds of a plan at a load before its measured time replaces
# the model's prediction (``CostModel.round_s``)
MEASURED_STALE = 32  # a plan's measured time older than this many batch rounds expires
MEASURED_WINDOW = 8  # a plan's measured time is the mean of its last this many batch rounds
LEVELS = 64  # batch rounds of a plan's window means kept for its usual time (``_Measured``)
RATIO_HALF_LIFE = 128  # batch rounds over which a stale plan's measured / predicted time
# fades halfway to 1 (``CostModel._correction``)
STEADY_FED = 2  # a round whose caches fed more than its 1-2 committed tokens caught up
# (a miss, rounds without the drafter): its time is not its plan's cost
RELAX_ROUNDS = 32  # a pooled acceptance not observed for this many batch rounds has gone
# halfway back to its prior (``CostModel.relax``)
PREFILL_FED = 8  # a target step that fed more positions than its rows' drafts and next
# tokens by more than this had a prefill or a cache rebuild in it: not a decoding round
PREFILLS_KEPT = 16  # the replies of the last this many such steps the cost model remembers
SAME_STEP_NS = 5_000_000  # replies this close together came from one step
LOAD_STEP = 0.2  # a batch's plan is scored at its rows smoothed over ~1 / LOAD_STEP rounds
OVERHEAD_STEP = 0.1  # the round overhead's moving estimate weighs a batch round this much
OVERHEAD_FLOOR_S = 0.005  # a round's overhead counts up to STALL x this, or x the estimate
STALL = 3.0  # an online time above this many times the fit's prediction counts as this much
TRY_AFTER = 24  # batch rounds on one plan before the batch tries the plan one draft down
TRY_FLOOR = 0.85  # only if the model scores it this close to the plan
TRY_ROUNDS = 8  # batch rounds a try lasts at most (its measurement needs MEASURED_AFTER + 1)
TRY_AGAIN = 4  # batch rounds after a try the batch took before it tries the next one down
TRY_HELD = 4  # batch rounds the load held its grid point before a plan never measured
# near it is tried at once (``try_down``)
LOOKUP_EVERY = 8  # in a batch a row searches its prompt lookup every this many rounds (the
# pooled match rate and acceptance). A search costs ~15 us with the index; every round was
# measured worse (paired -0.018: the batches ran the lookup more; docs/benchmarks.md, "A
# sixth machine")


def _binomial_tail(n: int, x: int, a: float) -> float:
    """P(X <= x) for x below n a, else P(X >= x), X ~ Binomial(n, a)."""
    low = x < n * a
    if abs(x - n * a) <= 2.0 * math.sqrt(n * a * (1.0 - a)) + 1.0:
        return 1.0  # (most calls: nowhere near a tail)
    js = range(0, x + 1) if low else range(x, n + 1)
    return sum(math.comb(n, j) * a ** j * (1.0 - a) ** (n - j) for j in js)


def _squared_weights(w2: float, step: float) -> float:
    """A moving estimate's sum of its observations' squared weights after one more
    observation at ``step`` (its variance is that times one observation's)."""
    return (1.0 - step) ** 2 * w2 + step * step


class Acceptance:
    """Per-position conditional acceptance alpha_i = P(accept i | accepted 0..i-1) of one
    proposer for one request: a moving estimate that starts at ``prior`` (weight
    ``PRIOR_WEIGHT`` observations) and then follows the request (step >= ``min_step``)."""

    def __init__(self, prior: Sequence[float], min_step: float = MIN_STEP):
        self.alpha = list(prior)
        self.seen = [0] * len(prior)
        self.min_step = min_step
        # per position, the sum of the squared weights of the observations in the
        # estimate: its variance over alpha (1 - alpha). The prior counts as exact: a
        # position not observed yet is scored on the prior's word, as a plan not measured
        # is on the model's (``GoodputPolicy._acceptance_se``)
        self.w2 = [0.0] * len(prior)
        # a pooled estimate's last observations per position (``restart``); a request's own
        # moves 0.1 an observation and needs none
        self.recent = [deque(maxlen=DRIFT_WINDOW) for _ in prior] if min_step < MIN_STEP \
            else None
        self.untested: set[int] = set()  # positions observed since ``restart`` last ran

    def observe(self, drafted: int, accepted: int) -> None:
        for i in range(min(drafted, accepted + 1, len(self.alpha))):  # positions reached
            self.observe_at(i, i < accepted)

    def observe_at(self, i: int, accepted: bool) -> None:
        """One observation of position ``i`` alone (its drafts before it accepted)."""
        if i < len(self.alpha):
            self.seen[i] += 1
            step = max(1.0 / (self.seen[i] + PRIOR_WEIGHT), self.min_step)
            if self.recent is not None:  # with the estimate it was made against
                self.recent[i].append((accepted, self.alpha[i]))
                self.untested.add(i)
            self.alpha[i] += step * (float(accepted) - self.alpha[i])
            self.w2[i] = _squared_weights(self.w2[i], step)

    def restart(self) -> list[int]:
        """Restart each position whose last observations (the last ``DRIFT_MIN``, 12 or
        ``DRIFT_WINDOW`` of them: a change shows in the newest first) the estimate cannot have
        made: their count accepted in a tail of its binomial below ``DRIFT_P``, at the estimate
        before them (it moves towards them a little with each). It then starts from their mean, as
        if it had seen only them (its next steps 1 / (n + ``PRIOR_WEIGHT``) down to its floor, its
        variance a mean of n's, which widens a batch's margin on it:
        ``GoodputPolicy._acceptance_se``). At the floor step a pooled estimate weighs a hundred
        observations: a level's new requests, whose lookup matched nothing yet, ran lookup k = 4 at
        1.07 tokens a round where the estimate, from the rows before, expected 2.2-3.2, for the
        first second of a 4.5 s level before the batch left it (docs/benchmarks.md, "The Intel Xeon
        of family 6, model 167 again"). Returns the positions restarted. A window already
        tested and not added to since gives the same answer: only those observed since are
        tested (a batch decides every round, and the proposer it is not running is seldom
        observed)."""
        out = []
        for i in sorted(self.untested):
            seen = self.recent[i]  # (only a pooled estimate's positions are ever untested)
            x, hit = 0, 0  # accepted among the last n, counted newest first in one pass
            for n, (ok, _) in enumerate(reversed(seen), 1):
                x += ok
                if n >= DRIFT_MIN and n % (DRIFT_MIN // 2) == 0 \
                        and _binomial_tail(n, x, seen[-n][1]) < DRIFT_P:  # the estimate before
                    hit = n
                    break
            if hit:
                self.alpha[i] = (x + 0.5) / (hit + 1.0)  # never 0 or 1: its variance is real
                self.seen[i], self.w2[i] = hit, 1.0 / hit
                seen.clear()
                out.append(i)
        self.untested.clear()
        return out

    def relax(self, prior: float, w: float) -> None:
        """Forget a share ``w`` of what was learned below ``prior``: each position under it
        moves that much of the way back up (``CostModel.relax``)."""
        for i, a in enumerate(self.alpha):
            if a < prior:
                self.alpha[i] = a + w * (prior - a)
                self.w2[i] *= (1.0 - w) ** 2
                if self.recent is not None:  # what it forgets is not evidence against it
                    self.recent[i].clear()

    def expected(self, k: int) -> float:
        """Expected committed tokens of a round with k drafts (accepted + the extra one)."""
        total, run = 1.0, 1.0
        for a in self.alpha[:k]:
            run *= a
            total += run
        return total

    def gradient(self, k: int) -> list[float]:
        """d expected(k) / d alpha_i for i < k: the drafts from i + 1 on reached (each
        j > i reached with the product of alpha_l, l < j, but alpha_i)."""
        out = []
        for i in range(min(k, len(self.alpha))):
            total, run = 0.0, 1.0
            for j in range(k):  # run: the product of alpha_l over l <= j, l != i
                run *= self.alpha[j] if j != i else 1.0
                total += run if j >= i else 0.0
            out.append(total)
        return out

    def variance(self, i: int) -> float:
        """The variance of the estimate of alpha_i (Bernoulli observations, weighted)."""
        a = self.alpha[i]
        return a * (1.0 - a) * self.w2[i]


def _dot(coefs: Sequence[float], x: Sequence[float]) -> float:
    """``coefs @ (1, *x)``."""
    total = coefs[0]
    for c, v in zip(coefs[1:], x, strict=True):
        total += c * v
    return float(total)


def _solve_spd(a: list[list[float]], b: list[float]) -> list[float]:
    """``a^-1 b`` for a small symmetric positive definite ``a`` (Gaussian elimination; no
    pivoting needed), in place."""
    n = len(b)
    for i in range(n):
        for r in range(i + 1, n):
            f = a[r][i] / a[i][i]
            for c in range(i, n):
                a[r][c] -= f * a[i][c]
            b[r] -= f * b[i]
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        x[i] = (b[i] - sum(a[i][c] * x[c] for c in range(i + 1, n))) / a[i][i]
    return x


@dataclass
class _Fit:
    """A linear time model ``y = theta @ (1, x_1, ...)`` by exponentially weighted least
    squares with a ridge of ``ridge`` pseudo-observations per coefficient towards the prior
    ``a * (1, *rel)``: a coefficient the data does not determine (always one row; every row
    with k = 0) keeps the prior's, so a k not tried lately looks as cheap as the prior
    says and gets tried. Coefficients are >= 0; ``ordered``: each slope <= the one before
    (for verify, a draft token never costs more than a new row: when rows and drafts rise
    together the fit alone cannot tell them apart).

    In floats, not numpy: 2-3 coefficients, observed and solved every round and read for
    every plan scored, on the router's event loop before the round's proposer call, where
    numpy's per-call overhead was a third of a row's plan choice (with the prompt lookup's
    index, a row alone's round of ``observe`` + ``choose`` went from 185 to 91 us at 600
    tokens: ``bench/policy_decision.py --rows 1 --context 600``)."""

    rel: tuple[float, ...]
    ordered: bool = False
    ridge: float = 2.0  # the prior's weight, in pseudo-observations per coefficient
    decay: float = 0.98
    xtx: list[list[float]] = field(init=False)
    xty: list[float] = field(init=False)
    _theta: tuple[float, ...] | None = field(default=None, init=False)  # the last solved
    _fresh: bool = field(default=False, init=False)  # _theta includes every observation

    def __post_init__(self) -> None:
        n = len(self.rel) + 1
        self.xtx, self.xty = [[0.0] * n for _ in range(n)], [0.0] * n

    def observe(self, x: Sequence[float], seconds: float) -> None:
        v, d = (1.0, *(float(e) for e in x)), self.decay
        for i, row in enumerate(self.xtx):
            for j in range(len(row)):
                row[j] = row[j] * d + v[i] * v[j]
            self.xty[i] = self.xty[i] * d + v[i] * seconds
        self._fresh = False

    def learn(self, x: Sequence[float], seconds: float) -> None:
        """``observe`` an online time, clipped at ``STALL`` times the prediction: a stall of
        the shared machine (a drafter catching up a whole batch's contexts takes the
        target's CPUs; a pause) is not what a forward costs, and one 1 s point among 30 ms
        ones moved the least squares' intercept to seconds, which priced every plan not
        measured lately at seconds and flipped the batch to the one that was. A real rise
        still gets through, by ``STALL`` x at a time. The prediction is the last solved
        one (a round's observations come between two solves; solving again for each
        would double the fit's cost on the router)."""
        if self._theta is not None:
            seconds = min(seconds, STALL * max(_dot(self._theta, x), 1e-4))
        self.observe(x, seconds)

    @property
    def known(self) -> bool:
        return self.xtx[0][0] > 0

    def predict(self, x: Sequence[float], default: float) -> float:
        """The time at ``x``; before any observation, the prior with ``a = default``."""
        if not self.known:
            return default * _dot((1.0, *self.rel), x)
        return _dot(self.coef(), x)

    def coef(self) -> tuple[float, ...]:
        if self._theta is None or not self._fresh:
            self._theta, self._fresh = self._solve(), True
        return self._theta

    def _solve(self) -> tuple[float, ...]:
        xtx, xty, n = self.xtx, self.xty, len(self.xty)
        w = xtx[0][0]
        ratios = (1.0, *self.rel)
        # the prior a * (1, *rel), its a from the mean time over the mean of (1, *rel) @ x
        scale = xty[0] / sum(r * v for r, v in zip(ratios, xtx[0], strict=True))
        lam = [self.ridge * max(xtx[i][i] / w, 1e-9) for i in range(n)]
        theta = [max(t, 0.0) for t in _solve_spd(
            [[xtx[i][j] + (lam[i] if i == j else 0.0) for j in range(n)] for i in range(n)],
            [xty[i] + lam[i] * ratios[i] * scale for i in range(n)])]
        theta[0] = max(theta[0], 1e-6)
        if self.ordered:
            for i in range(2, n):
                theta[i] = min(theta[i], theta[i - 1])
        return tuple(theta)


@dataclass
class _Measured:
    """A plan's round times at one load: the mean of its last rounds, each with the gap
    before it (what a row's tokens/s is made of), kept as each round is added (it is read
    for every plan scored, every round), how many were measured, and the tick of the last.
    A mean, not a median: the long rounds (another request's prefill in the step, a wait
    for the KV budget) are rare but much of the time under load, and their share per round
    depends on the plan (a plan that commits more tokens a round finishes, and admits,
    more requests a round). A median left them out and read speculation up to 30 % too
    good at concurrency 2-16 (docs/benchmarks.md, the round log)."""

    times: deque[float]
    rows: int = 1  # a batch round's rows at this load: their times move together
    seconds: float = 0.0
    rse: float = 0.0  # the mean's relative standard error, a batch round as one sample
    n: int = 0
    tick: int = 0
    ratio: float | None = None  # ``usual`` over the model's prediction, when last fresh
    # ``seconds`` once a batch round, the last ``LEVELS`` (``usual``)
    levels: deque[float] = field(default_factory=lambda: deque(maxlen=LEVELS))
    _sum: float = field(default=0.0, init=False)  # of ``times`` and of their squares: the
    _sq: float = field(default=0.0, init=False)  # window's mean and spread in O(1) a round

    def __post_init__(self) -> None:
        self._sum, self._sq = sum(self.times), sum(t * t for t in self.times)

    def add(self, seconds: float, tick: int) -> None:
        if len(self.times) == self.times.maxlen:  # the oldest leaves the window
            old = self.times[0]
            self._sum, self._sq = self._sum - old, self._sq - old * old
        self.times.append(seconds)
        self._sum, self._sq = self._sum + seconds, self._sq + seconds * seconds
        n = len(self.times)
        self.seconds = mean = self._sum / n
        if n > 1 and mean > 0:
            var = max(0.0, self._sq - n * mean * mean) / (n - 1)
            self.rse = math.sqrt(var / max(1.0, n / self.rows)) / mean
        self.n += 1
        self.tick = tick
        if self.n % self.rows == 0:  # one a batch round
            self.levels.append(mean)

    @property
    def usual(self) -> float:
        """The plan's usual measured time here: the median of its last windows' means, one
        a batch round (a burst's windows, a second or two of them, are not the usual)."""
        return statistics.median(self.levels) if self.levels else self.seconds


def _window(b: int, ratio: float | None = None, tick: int = 0) -> _Measured:
    """A new measured window for a plan at load ``b`` (``MEASURED_WINDOW`` batch rounds),
    keeping a ``ratio`` to the model from before as its evidence until measured again."""
    return _Measured(deque(maxlen=max(8, MEASURED_WINDOW * b)), rows=b, tick=tick, ratio=ratio)


def _plan_name(plan: tuple[str | None, int]) -> str:
    """A plan as the round log names it: ``draft:2``, ``ngram:1``, ``off``."""
    return f"{plan[0]}:{plan[1]}" if plan[1] else "off"


def _plan_key(plan: Plan) -> tuple[str | None, int]:
    """A plan as its measured times are kept: k = 0 is nobody, whoever was asked."""
    return (plan.proposer if plan.k else None, plan.k)


def _bucket(rows: float) -> int:
    """A load as measured round times are kept: exact up to 4 rows, above on a grid 25 %
    apart (5, 6, 7, 9, 12, 15, 18, 23, 28, 36, ...: large loads recur only roughly)."""
    if rows < 4.5:
        return max(1, round(rows))
    return round(1.25 ** round(math.log(rows, 1.25)))


def _neighbours(b: int) -> tuple[int, int]:
    """The load grid's points either side of bucket ``b`` (``_bucket``)."""
    return (b - 1 if b <= 5 else _bucket(b / 1.25)), (b + 1 if b < 4 else _bucket(b * 1.25))


def _ema(old: float | None, new: float, w: float = 0.1) -> float:
    return new if old is None else (1 - w) * old + w * new


def _ema_low(old: float | None, new: float) -> float:
    """Follows decreases fast, increases slowly: the call's own cost, not the queue that
    forms when every request calls at once (which would make a proposer look dear for
    good: a proposer no longer chosen is no longer measured)."""
    return _ema(old, new, 0.5 if old is None or new < old else 0.05)


def _drafter_profile(points: object) -> list[tuple[int, float]]:
    """A drafter replica's profile: (rows, seconds per draft step) points; a bare number
    (a replica of the release before) is its one-row time."""
    if isinstance(points, int | float):
        return [(1, float(points))] if points > 0 else []
    return [(int(r), float(s)) for r, s in points or [] if r > 0 and s > 0]


@dataclass
class CostModel:
    """What a round costs, shared by the requests of one router (or engine): the target's
    verify time by batch rows and tokens, the draft model's step time by the rows drafting
    together, each proposer's fixed call time (transport, lookup) and the rest of the round
    (verify transport, scheduling). Starts from ``default_verify_s`` (a conservative
    guess), or from the replicas' measured profiles, and learns online."""

    default_verify_s: float = 0.02
    draft_rel_cost: float = 0.1  # prior: a draft step costs 10% of a one-row target forward
    verify: _Fit = field(default_factory=lambda: _Fit((0.3, 0.08), ordered=True))
    # a drafter step by its rows; a light prior: two profiled points (1 and 8 rows) fix it
    draft: _Fit = field(default_factory=lambda: _Fit((0.3,), ridge=0.25))
    call_s: dict[str, float] = field(default_factory=dict)  # proposer -> fixed call time
    overhead_s: float = 0.0
    profiled: int = 0  # points seeded from replicas' start-up profiles
    # every request's rounds together, per proposer: what a batch's rows decide on together.
    # An unbiased sample of the rows: prompt lookup's from every round that searched it
    # (chosen or not, ``shadow_acceptance``); the draft model's only from rounds whose plan
    # the batch decided, all its rows drafting. A row alone chooses its proposer by its own
    # acceptance, so it drafts with the model where the lookup found nothing to repeat, the
    # harder text: its rounds had the pooled draft acceptance at 0.47 where the fixed
    # draft model's rounds implied ~0.63, and batches seldom tried the draft model
    # (greedy rows only: a sampled row's acceptance, min(1, p/q), is another quantity).
    # Prompt lookup's is scored blind (a batch's rows do not search before the plan), so
    # its position i is P(the match reaches i and it is accepted | positions before were):
    # a match that ended before what was searched for, all of it accepted, counts as a
    # rejection at its next position (``lookup_ended``). Acceptance given the draft and a
    # separate share of matches reaching i assumed the two independent; short matches
    # (the text repeats with a short period) are accepted more than long ones, and that
    # read lookup k = 3-4 2-4 % too good on mixed (docs/benchmarks.md, "A third machine")
    pooled: dict[str, Acceptance] = field(default_factory=lambda: {
        p: Acceptance([PRIOR_ACCEPTANCE[p]] * MAX_K, POOLED_STEP) for p in PROPOSERS})
    # A pooled estimate not observed for a while goes back up towards its prior, so that a
    # proposer the batches stopped choosing is tried again (``relax``)
    pooled_at: dict[str, int] = field(default_factory=dict)  # proposer -> ``rounds`` then
    # and ``starts`` then: no row of a batch that many requests on contributed (``stale``)
    pooled_starts: dict[str, int] = field(default_factory=dict)
    starts: int = 0  # the router's requests that had their first round (``started``)
    rounds: int = 0  # rounds observed (every row's)
    # the share of prompt lookups that found a match, over the rounds that searched without
    # knowing (rows alone, every round; in a batch, every LOOKUP_EVERY-th and its lookup plans)
    lookup_match: float = PRIOR_MATCH
    match_w2: float = 0.0  # its observations' squared weights' sum (``Acceptance.w2``)
    # the same searches' match lengths: per draft position j, the share of matches that
    # reach it (as far as each search's k saw); position 0 is every match's. A batch's
    # lookup plan with k drafts proposes only as many as a row's match has: the drafts the
    # target verifies (on prose 54 % of ngram_k4's rounds proposed 2)
    match_len: list[float] = field(default_factory=lambda: [1.0] * MAX_K)
    rows: int = 1  # rows of the last verify reply's batch plus the target's queue
    active: int = 0  # the router's own requests in flight (``admitted``)
    arriving: int = 0  # those of them that have not had their first round (``started``)
    bursting: bool = False  # a burst of them arrived and more than one still waits (``burst``)
    load: float = 1.0  # the same smoothed over the batch's last rounds: what its plan is for
    load_since: int = 0  # ``rounds`` when ``load`` last moved to another grid point (``_bucket``)
    batch_plan: tuple[str | None, int] = (None, 0)  # what a batch's rows share (``in_batch``)
    plan_since: int = 0  # ``rounds`` when the batch's plan last changed or was tried against
    trying: tuple[tuple[str | None, int], tuple[str | None, int]] | None = None  # a try
    # of the plan one draft down or of the other proposer's, and the plan to return to
    # (``GoodputPolicy.try_down``)
    try_calm: bool = False  # that try began outside a burst of arrivals (``burst``)
    left: tuple[tuple[str | None, int], int, int] | None = None  # a plan the batch left on
    # a stretch of its rounds, its load and ``rounds`` then: to be measured again (``leaving``)
    # the batch's last decision per (has a drafter, K_max): ``rounds`` then, the rows it
    # was for, the plan (``GoodputPolicy.in_batch``)
    decided: dict[tuple[bool, int], tuple[int, int, Plan]] = field(default_factory=dict)
    # the batch's last decision, kept only while a round log reads it (``explaining``, set
    # by ``RoundLog``): 35-45 us of a decision's 100-150 on the router's loop (``explain``)
    explaining: bool = False
    decision: dict | None = None
    # (proposer, k, load bucket) -> what a plan's last rounds took there; see ``round_s``
    measured: dict[tuple[str | None, int, int], _Measured] = field(default_factory=dict)
    ticks: int = 0  # rounds measured
    # when the replies of the target's last steps that fed a prefill came back (the
    # router's clock, ns): a verify call out then waited behind such a step (``_measure``)
    prefills: deque[int] = field(default_factory=lambda: deque(maxlen=PREFILLS_KEPT))
    # those of them that came back during a burst (``burst``): a call out then waited for
    # the burst's prefills, even if it came back after the burst ended (``_measure``)
    burst_prefills: deque[int] = field(default_factory=lambda: deque(maxlen=PREFILLS_KEPT))

    def observe_pooled(self, proposer: str, drafted: int, accepted: int) -> None:
        self.pooled[proposer].observe(drafted, accepted)
        self.pooled_at[proposer], self.pooled_starts[proposer] = self.rounds, self.starts

    def observe_pooled_at(self, proposer: str, i: int, accepted: bool) -> None:
        self.pooled[proposer].observe_at(i, accepted)
        self.pooled_at[proposer], self.pooled_starts[proposer] = self.rounds, self.starts

    def stale(self, proposer: str) -> bool:
        """Whether the proposer's pooled acceptance is another batch's: a batch's worth of
        the router's requests started since it was last observed, so likely none of the
        rows now decoding contributed to it. The prompt lookup's is observed by the rows'
        searches whatever the batch runs; the draft model's only where the batch drafts
        with it, and a batch that carried the lookup from one workload into the next kept
        the draft model's estimate from the text before (``GoodputPolicy.try_down``)."""
        return self.starts - self.pooled_starts.get(proposer, 0) >= max(2, round(self.load))

    def lookup_ended(self, drafted: int, accepted: int, searched: int) -> None:
        """A prompt lookup's match of ``drafted`` tokens, searched for ``searched``: if it
        ended short of that, all of it accepted, the next position had no draft, a rejection
        for the pooled estimate of a blind match (``pooled``)."""
        if 0 < drafted == accepted < searched:
            self.observe_pooled_at("ngram", drafted, False)

    def relax(self) -> None:
        """Move each pooled estimate not observed in the batch's last round back towards its
        prior, by half over ``RELAX_ROUNDS`` batch rounds. The draft model's is observed only
        where a batch drafts with it, so an unlucky start (two rejections put it at
        [0.4, 0.6] where the fixed configuration's rounds implied [0.65, 0.60]) kept every
        batch of a sweep off the draft model, at every load after, and nothing corrected
        it. Relaxed, it comes back up to the prior, a batch tries it again, and its rounds
        decide; where drafting does not pay, that is one short try every few dozen batch
        rounds. Only up: an estimate above its prior is not pulled down, for a proposer
        read too good is chosen and its rounds correct it, and one read too bad is not and
        they cannot. Pulled down as well, the draft model's estimate on repetitive text
        (its rounds accepted ~0.70 a position: 2.17 tokens at k = 2) went back to 0.60
        within a few dozen batch rounds of the batch leaving it, and the batch ran the
        prompt lookup, 7-15 % slower there, at every load (auto 0.82-0.89x the best fixed
        configuration; docs/benchmarks.md, "A fourth machine")."""
        w = 1.0 - 0.5 ** (1.0 / (RELAX_ROUNDS * max(1, self.rows)))  # per row's round
        for p, acc in self.pooled.items():
            if self.rounds - self.pooled_at.get(p, 0) > self.rows:
                acc.relax(PRIOR_ACCEPTANCE[p], w)

    def admitted(self, active: int) -> None:
        """The router's own requests in flight, told on every arrival and departure: a
        floor on the rows a plan is scored for. Those come from the verify replies
        (``rows``) and their smoothed ``load``, which learn of a burst of arrivals a round
        later and several rounds later: every arrival of a burst into a quiet router chose
        its first round alone (the draft model's k = 3-4 for some, the lookup's k = 4 for
        others), and the batch decided its next rounds at the load of the rows before, on
        the plans measured there (docs/benchmarks.md, "Another machine"). Departures change
        nothing: the replies bring the load down."""
        self.arriving = min(self.arriving + max(0, active - self.active), active)
        self.active = active
        if active > self.load:
            self._move_load(float(active))
        self.rows = max(self.rows, active)
        self.bursting = self.bursting or self.arriving > max(1, self.rows // 4)

    def started(self) -> None:
        """One of the router's requests had its first round (or left before it)."""
        self.starts += 1
        self.arriving = max(0, self.arriving - 1)
        self.bursting = self.bursting and self.arriving > 1

    def burst(self) -> bool:
        """Whether the target's steps now carry a burst's prefills: more of the router's
        requests came to wait for their first round than a steady stream has at once (one,
        or a quarter of the rows: requests that finish together are replaced together), and
        more than one of them still does. A burst lasts until its last arrivals started:
        the target feeds a burst's prefills in chunks over several steps, and its last few
        arrivals, a quarter of the rows or fewer, waited 1.6 s more, fed in steps of 380-420
        positions; measured as a steady stream's, they put lookup k = 2 at 368 ms a round at
        23 rows, where its rounds of decoding alone took 281 (a median; docs/benchmarks.md,
        "A fifth machine")."""
        return self.bursting

    def _move_load(self, load: float) -> None:
        """Set ``load``, noting when it moves to another grid point (``load_since``)."""
        if _bucket(load) != _bucket(self.load):
            self.load_since = self.rounds
        self.load = load

    def saw_lookup(self, matched: bool, length: int = 0, k: int = 0) -> None:
        """A prompt lookup searched for up to ``k`` tokens, and the ``length`` it found."""
        self.lookup_match = _ema(self.lookup_match, float(matched), MATCH_STEP)
        self.match_w2 = _squared_weights(self.match_w2, MATCH_STEP)
        if matched:
            for j in range(1, min(k, MAX_K)):
                self.match_len[j] = _ema(self.match_len[j], float(length > j), 0.05)

    def round_s(self, proposer: str | None, k: int, rows: int, predicted: float) -> float:
        """A round's time for this plan at this load: what its last rounds took, once it
        has run ``MEASURED_AFTER`` batch rounds there (``rows`` rounds each) and not
        ``MEASURED_STALE`` batch rounds ago, else ``predicted`` (the model's). The linear
        model misprices some plans (a draft's verify cost grows with the context; the fit
        cannot tell a draft's cost where k barely varies, nor sees the CPU a drafter takes
        from the target beside it); a plan it underprices is tried, measured and then
        priced at its real time, and a measurement expires (the context and the load move
        on: a plan not run lately is tried again, about one batch round in
        ``MEASURED_STALE``), so the model proposes and the measurements decide. Reading a
        fresh measurement records its usual time's ratio to the prediction, which prices
        the plan once the measurement has expired (``_correction``): its usual, not its last
        window's, for a batch leaves a plan when its last window reads dear, often a stretch
        of prefill stalls, and that one window then priced it, and the plans of its proposer
        with more drafts, at that load and the neighbouring ones for a level's rest
        (docs/benchmarks.md, "A fourth machine")."""
        b = _bucket(rows)
        m = self.measured.get((proposer, k, b))
        if m is None or not self._fresh(m, b):
            return predicted * self._correction(proposer, k, b)
        m.ratio = m.usual / max(predicted, 1e-6)
        return m.seconds

    def fresh_at(self, proposer: str | None, k: int, rows: int) -> _Measured | None:
        """The plan's measured round times at this load, if they price it (``round_s``)."""
        b = _bucket(rows)
        m = self.measured.get((proposer, k, b))
        return m if m is not None and self._fresh(m, b) else None

    def noise(self, proposer: str | None, k: int, rows: int) -> float:
        """The relative standard error of the plan's measured time at this load (0 where it
        is priced by the model: ``round_s``)."""
        m = self.fresh_at(proposer, k, rows)
        return m.rse if m is not None else 0.0

    def _fresh(self, m: _Measured, b: int) -> bool:
        return m.n >= MEASURED_AFTER * b and self.ticks - m.tick <= MEASURED_STALE * b

    def _correction(self, proposer: str | None, k: int, b: int) -> float:
        """What a plan not measured lately at load ``b`` takes over the model's prediction:
        its measured / predicted ratio when last measured there (else at a neighbouring
        load: under load the rows wander between grid points), fading to 1 by half every
        ``RATIO_HALF_LIFE`` batch rounds. The bare prediction has no prefill stalls or
        drafter contention and read every plan not run lately better than the one running,
        measured with them: under load the batch went back to plans it had just found dear
        as soon as their measurement expired (at c=32 it ran 9 plans, a third of its rounds
        changed plan). A plan never measured near this load takes the ratio of its
        proposer's nearest plan with fewer drafts that was (spec-off the last: every
        proposer's first rung, ``towards``): the model's unmodelled costs
        (drafter contention, prefill stalls) grow with the drafts, so a plan with more
        drafts is no cheaper against the model than one with fewer, and on the bare
        prediction a batch at c=24 moved from a measured plan to draft:4 and draft:3,
        never measured, at 0.73-0.86 s a round where draft_k2's took 0.46. With none
        measured, it is tried on the model's word; a plan found dear is tried again once
        the evidence has aged."""
        for x in self._near(proposer, k, b, below=True):
            if x.ratio is not None:
                return 1.0 + (x.ratio - 1.0) * 0.5 ** ((self.ticks - x.tick)
                                                       / (RATIO_HALF_LIFE * b))
        return 1.0

    def _near(self, proposer: str | None, k: int, b: int,
              below: bool = False) -> Iterator[_Measured]:
        """The plan's measured times at load ``b`` and either side of it; ``below``: then
        those of its proposer's plans with fewer drafts, nearest first, and spec-off's last
        (it is read for every plan scored, every round: the grid points are worked out
        once)."""
        loads = (b, *_neighbours(b))
        for j in range(k, -1, -1) if below and k else (k,):
            p = proposer if j else None  # below k = 1: spec-off
            for nb in loads:
                x = self.measured.get((p, j, nb))
                if x is not None:
                    yield x

    def towards(self, best: tuple[str | None, int], current: tuple[str | None, int],
                rows: int) -> tuple[str | None, int]:
        """The plan a batch running ``current`` moves to when ``best`` scores better: ``best``
        if it has fewer drafts than ``current`` or was measured near the load, else at most
        one draft more than a plan of its proposer measured near it (spec-off counts as
        every proposer's zero) or than ``current`` once that is measured here: the rung of
        its proposer towards it, if that has more drafts than ``current``, else
        ``current`` (until it is measured). So a batch climbs one draft at a time, each rung
        measured before the next, and a rung found dear prices the plans above it
        (``_correction``): it never jumps on the model's word to a plan with more drafts
        than anything measured. The model has no drafter contention and no prefill stalls,
        so it prices the plans with the most drafts best, and a cold batch at c=24-32 began
        on draft:4 and draft:3 at 0.6-1.1 s a round where draft_k2's took 0.3-0.5 s
        (0.67-0.75x spec-off). A batch with nothing measured starts at spec-off, the one
        plan never slower than spec-off. A rung need not score better than ``current``
        itself: the first draft's gain may be within the margin where four drafts' is not."""
        p, k = best
        if k < current[1] or self.seen_near(p, k, rows):
            return best
        top = current[1] + 1 if self.fresh_at(*current, rows) is not None else 0
        for j in range(k - 1, top - 1, -1):
            if self.seen_near(*((p, j) if j else (None, 0)), rows):
                top = j + 1
                break
        if k <= top:
            return best
        return (p, top) if top > current[1] else current

    def leaving(self, plan: tuple[str | None, int], score: float, best: float,
                rows: int) -> None:
        """The batch leaves ``plan`` (goodput ``score``) for a plan scored ``best``, with
        fewer drafts or of another proposer: if at its usual measured time here the plan
        would have scored within ``HYSTERESIS`` of ``best``, it left on a stretch of its
        rounds, not on what it costs, and it is measured again ``TRY_AFTER`` batch rounds
        later (``recheck``). A measured time is the mean of the plan's last few batch
        rounds, and a burst of arrivals (their prefills in the target's steps, and the
        drafter's) put a batch's rounds at 2-5x for a second or two: a batch at c=4 on code
        left the draft model in such a burst for the lookup, and its draft rounds, priced
        once their measurement expired at that stretch's ratio to the model
        (``_correction``), never got it back (16.4 tokens/s a row on the lookup against
        22.7 on the draft model). Measured again after the burst, the two plans' times
        decide. One plan at a time, the first one left."""
        m = self.fresh_at(*plan, rows)
        if self.left is None and m is not None and self.rounds - self.load_since > TRY_HELD \
                * rows and score * m.seconds / m.usual * (1 + HYSTERESIS) >= best:
            self.left = (plan, _bucket(rows), self.rounds)

    def recheck(self, rows: int) -> tuple[str | None, int] | None:
        """The plan to measure again now (``leaving``): one left ``TRY_AFTER`` batch rounds
        ago, if the load is still where it was left."""
        if self.left is None or self.rounds - self.left[2] <= TRY_AFTER * rows:
            return None
        (plan, b, _), self.left = self.left, None
        return plan if b == _bucket(rows) else None

    def remeasure(self, proposer: str | None, k: int, rows: int) -> None:
        """Forget the plan's measured times at this load (its ratio to the model stays, as
        evidence until it is measured again: ``_correction``)."""
        key = (proposer, k, _bucket(rows))
        if (m := self.measured.get(key)) is not None:
            self.measured[key] = _window(m.rows, m.ratio, m.tick)

    def seen_near(self, proposer: str | None, k: int, rows: int) -> bool:
        """Whether the plan's time was ever measured (``MEASURED_AFTER`` batch rounds) at
        this load or either side of it: if not, its price is the model's word alone
        (``_correction``)."""
        return any(x.ratio is not None or x.n >= MEASURED_AFTER * x.rows
                   for x in self._near(proposer, k, _bucket(rows)))

    def _measure(self, o: RoundOutcome, steady: bool) -> None:
        """A round's time with the gap before it, under its plan and load; not a request's
        first round (its prefill), nor one whose drafter or target fed more than a round's
        1-2 committed tokens (catching up after rounds without the drafter, a cache miss),
        nor the first round after the row's plan changed (the batch changes together, and
        its first round waits for the rows that catch up): those are not the plan's cost,
        and a plan priced too dear is not tried again until it expires. A round whose
        target step had another request's prefill in it is: arrivals come with finished
        requests, so a plan that commits more tokens a round has more of them a round
        (left out, they read speculation up to 30 % too good at concurrency 2-16). But not
        while a burst of arrivals waits for its first rounds (``burst``): their prefills
        stall every row's steps for a second or two whatever the plan, and the plan that
        ran then was priced out for the rest of the load (at c=16 on mixed, lookup k = 3
        read 354 ms a round where ngram_k4's rounds took 164, and the batch ran the draft
        model's k = 4, at 230 ms, for a third of its rounds). A burst's rounds of decoding
        alone are measured: where requests wait long for KV room, a burst lasts. Of decoding
        alone, and not waiting behind such a step either (``_waited``): a row of another
        cohort whose step of decoding ran after a burst's prefill step took it in its round
        (at c=24 on mixed lookup k = 2 read 528 ms a round at 23 rows, its verify calls
        1.3 s of which 0.13 s its own step, where lookup k = 1's took 268 and ngram_k4's
        rounds 290, and it priced the lookup's plans with more drafts for the level's rest:
        the batch ran lookup k = 1 and spec-off, 0.88x ngram_k4; docs/benchmarks.md, "A
        fifth machine"). Nor, after the burst, a round that was out while one of the
        burst's prefill steps ran: a burst ends as its last arrivals have their first
        round, in the step that prefilled them, and a row of another cohort (often the
        level's first request, decoding alone before the others came) comes back after it.
        Measured, one such round (2.1 s, its own step 85 ms) put lookup k = 3 at 1.77x the
        model at repetitive c=16, and that ratio priced it for the level and, at 1.67x,
        for the next class's level at that load (docs/benchmarks.md, "The Intel Xeon of
        family 6, model 167 a third time")."""
        v = o.verdict
        if v.batch_size <= 0 or o.round_s <= 0 or not steady \
                or not measurable(o.round_no, o.caught_up) \
                or (self.burst() and not decoding(v.batch_fed, v.batch_tokens)) \
                or self._waited(v.call, self.prefills if self.burst() else self.burst_prefills):
            return
        self.ticks += 1
        b = _bucket(self.load)
        key = (*_plan_key(o.plan), b)
        m = self.measured.get(key)
        if m is None or self.ticks - m.tick > MEASURED_STALE * b:
            m = self.measured[key] = _window(b, m.ratio if m is not None else None)
        m.add(o.round_s + o.gap_s, self.ticks)

    def _prefilled(self, v: VerifyOutcome) -> None:
        """Note when a verify reply whose step fed a prefill came back (once a step: its
        rows' replies come back within a few ms of one another), and, apart, a burst's."""
        t = v.call.reply_ns
        if t and not decoding(v.batch_fed, v.batch_tokens) and (
                not self.prefills or t - self.prefills[-1] > SAME_STEP_NS):
            self.prefills.append(t)
            if self.burst():
                self.burst_prefills.append(t)

    @staticmethod
    def _waited(call: CallInfo, replies: Iterable[int]) -> bool:
        """Whether a verify call was out while a step that fed a prefill ran: that step's
        reply (one of ``replies``) came back after the call left and before its own."""
        return any(call.call_ns < t < call.reply_ns for t in replies)

    def verify_s(self, rows: float, tokens: float) -> float:
        return self.verify.predict((rows, tokens - rows), self.default_verify_s)

    def draft_step_s(self, rows: float) -> float:
        """One draft token for ``rows`` rows in one drafter step."""
        default = 0.0 if self.draft.known else self.draft_rel_cost * self.verify_s(1, 1)
        return self.draft.predict((rows,), default)  # (the default only prices a cold fit)

    def snapshot(self) -> dict:
        """What the model believes now, in milliseconds (``router_stats``)."""
        def ms(fit: _Fit) -> list[float] | None:
            return [round(1000 * float(x), 3) for x in fit.coef()] if fit.known else None
        return {"verify_ms_a_row_draft": ms(self.verify), "draft_step_ms_a_row":
                ms(self.draft), "call_ms": {p: round(1000 * v, 3)
                                            for p, v in self.call_s.items()},
                "overhead_ms": round(1000 * self.overhead_s, 3), "profiled": self.profiled,
                "pooled_acceptance": {p: [round(a, 3) for a in acc.alpha]
                                      for p, acc in self.pooled.items()},
                "lookup_match": round(self.lookup_match, 3),
                "lookup_reach": [round(x, 3) for x in self.match_len], "rows": self.rows,
                "load": round(self.load, 2), "arriving": self.arriving,
                "batch_plan": list(self.batch_plan),
                "measured_round_ms": {f"{p or 'none'}:{k}@{rows}": round(1000 * m.seconds, 3)
                                      for (p, k, rows), m in self.measured.items()
                                      if m.n >= MEASURED_AFTER * rows}}

    def seed(self, verify: Sequence[tuple[int, int, float]], draft: object = None) -> None:
        """Start from replicas' start-up profiles (``specserve.engine.profile``): verify
        seconds by (rows, batch tokens) over a grid, and the draft model's step seconds by
        rows. Online observations then take over (the fits decay old points)."""
        for rows, tokens, seconds in verify:
            if rows > 0 and tokens >= rows and seconds > 0:
                self.verify.observe((rows, tokens - rows), seconds)
                self.profiled += 1
        points = _drafter_profile(draft)
        for _ in range(DRAFT_PROFILE_WEIGHT):  # few points: each counts as several, in turn
            for rows, seconds in points:
                self.draft.observe((rows,), seconds)
        self.profiled += len(points)

    def propose_s(self, proposer: str | None, k: int, rows: float = 1) -> float:
        """The proposer's call for k tokens, ``rows`` rows drafting together."""
        if proposer is None or k == 0:
            return 0.0
        fixed = self.call_s.get(proposer, 0.0)
        if proposer == "ngram":
            return fixed  # a search over the committed tokens, plus the call
        return fixed + k * self.draft_step_s(rows)

    def observe(self, o: RoundOutcome, steady: bool = True) -> None:
        """A round's outcome; ``steady``: the row's plan was the same the round before
        (else the round is not measured as the plan's time)."""
        v, p = o.verdict, o.plan.proposer
        verify = v.call.compute_s or o.verify_s  # in process: no replica reports compute
        tokens = v.batch_tokens or v.batch_size * (o.drafted + 1)
        if v.batch_size > 0 and verify > 0 and decoding(v.batch_fed, v.batch_tokens):
            self.verify.learn((v.batch_size, tokens - v.batch_size), verify)
        compute = (o.proposal.call.compute_s or o.propose_s) if o.drafted else 0.0
        repair = o.proposal.repair
        if p == "draft" and o.drafted and compute > 0 and (repair is None
                                                           or repair.fed <= STEADY_FED):
            # not from a call that first caught the drafter up (after rounds of lookup or
            # none, a batch's switch feeds every row's new tokens): such calls were most of
            # what the fit saw of the draft model under load (at c=32 auto's draft rounds
            # proposed in 249 ms a token, draft_k2's steady ones in 38), and the fit priced
            # the model out of every batch after. The rows that drafted with this one: the
            # batch's drafts over this row's k
            drafting = min(max(v.batch_size, 1), max(1, round((tokens - v.batch_size)
                                                              / o.drafted)))
            self.draft.learn((drafting,), compute / o.drafted)
        if p is not None and o.drafted:
            fixed = o.propose_s - (compute if p == "draft" else 0.0)
            if p == "ngram" and (hops := o.proposal.call.hops()):  # not its wait behind
                fixed -= hops[1]  # other rows' draft steps (a batch sharing it has none)
            self.call_s[p] = _ema_low(self.call_s.get(p), max(0.0, fixed))
        # per batch round, not per row (every row of a batch reports the same round), and a
        # stalled round counts as STALL x the usual: one slow round no longer re-prices
        # every plan, which moved the batch between proposers on noise
        rest = min(max(0.0, o.round_s - o.propose_s - verify),
                   STALL * max(self.overhead_s, OVERHEAD_FLOOR_S))
        self.overhead_s = _ema(self.overhead_s, rest, OVERHEAD_STEP / max(1, v.batch_size))
        self._measure(o, steady)
        if v.batch_size > 0:
            self._prefilled(v)
            self.rows = v.batch_size + v.queue_rows
            # every row of a batch reports it: about LOAD_STEP a batch round whatever its size
            self._move_load(_ema(self.load, self.rows, LOAD_STEP / self.rows))
            self.rounds += 1
            self.relax()


class GoodputPolicy:
    """``spec=auto`` for one request (``rounds.Policy``). ``priors``: per proposer, the
    fleet's per-position acceptance (``PriorStore``); missing: ``PRIOR_ACCEPTANCE``."""

    def __init__(self, cost: CostModel, k_max: int, has_drafter: bool,
                 priors: dict[str, list[float]] | None = None,
                 ngram_max_n: int = 4, ngram_min_n: int = 1):
        self.cost, self.k_max, self.has_drafter = cost, k_max, has_drafter
        self.lookup = NgramIndex(ngram_max_n, ngram_min_n)  # the request's prompt lookup
        priors = priors or {}
        prior = {p: [*priors.get(p, []), *[PRIOR_ACCEPTANCE[p]] * k_max][:k_max]
                 for p in PROPOSERS}
        self.acceptance = {p: Acceptance(prior[p]) for p in PROPOSERS}
        # prompt lookup's after a round whose lookup was accepted whole (``own``)
        self.copy_acceptance = Acceptance(prior["ngram"])
        self.copying = False  # the last round's lookup (searched or proposed) accepted whole
        self.counts = {p: [[0] * k_max, [0] * k_max] for p in PROPOSERS}  # tried, accepted
        self.idle = 0  # rounds alone in a row at k = 0 because speculating did not pay
        self.batch_rounds = 0  # rounds in a batch (every LOOKUP_EVERY-th searches)
        self.blind_lookup = False  # this round's plan is the batch's prompt lookup
        self.batched = False  # this round's plan is the batch's (``in_batch``)
        self.shadow: list[int] | None = None  # this round's lookup match, when searched
        self.searched = 0  # for how many tokens it was searched (the round's k cap)
        self.last_plan: tuple[str | None, int] | None = None  # the round before's

    def own(self, proposer: str) -> Acceptance:
        """This request's acceptance estimate for ``proposer`` in its next round. Prompt
        lookup's hits come in runs (the text copies an earlier passage, and the match goes
        on where the last one was accepted), so after a round whose lookup was accepted
        whole its next one is another quantity, with its own estimate: on code at c=1,
        fixed ``ngram_k4``'s rounds after such a round accepted 2.4 drafts (87 % at least
        one), after any other 0.4-1.5 (30-50 %); one estimate over both read every round
        as their mix, and a row alone chose the lookup at k = 2 for ~1.9 tokens a round
        where the draft model made 2.1 (docs/benchmarks.md, "A sixth machine")."""
        return self.copy_acceptance if proposer == "ngram" and self.copying \
            else self.acceptance[proposer]

    def candidates(self, state: RequestState, k_cap: int) -> list[tuple[str, int]]:
        out = []
        if self.has_drafter:
            out += [("draft", k) for k in range(1, k_cap + 1)]
        match = self._search(state, k_cap)
        out += [("ngram", k) for k in range(1, len(match) + 1)]
        return out

    def _search(self, state: RequestState, k_cap: int) -> list[int]:
        """This round's prompt lookup for up to ``k_cap`` tokens, searched before the plan:
        kept (``shadow``) and told to the cost model (its match rate and reach)."""
        match = self.shadow = self.lookup.propose(state.committed, k_cap)
        self.searched = k_cap
        self.cost.saw_lookup(bool(match), len(match), k_cap)
        return match

    def score(self, proposer: str | None, k: int, others: int,
              acceptance: dict[str, Acceptance] | None = None,
              match: float | None = None) -> tuple[float, Plan]:
        """The goodput (tokens / s) of a batch of this row and ``others`` in which every
        row takes this plan: its expected committed tokens (by ``acceptance``, default
        this request's) and the round's time (one drafter step for the rows drafting
        together, one target forward). A prompt lookup's ``match``: None, this row's own
        match, at least k long (``candidates``); else the batch's, searched blind: found
        with probability ``match``, its tokens by the pooled estimate of a blind match
        (each position reached and accepted: ``CostModel.pooled``), its drafts as far as
        the router's searches' matches reach (``CostModel.match_len``)."""
        c, rows = self.cost, others + 1
        if proposer is None:
            e = 1.0
        else:
            blind = proposer == "ngram" and match is not None
            m = match if blind and match is not None else 1.0  # (None: not blind)
            own = acceptance[proposer] if acceptance else self.own(proposer)
            e = 1.0 + m * (own.expected(k) - 1.0)
        t = c.round_s(proposer if k else None, k, rows, self.model_s(proposer, k, rows, match))
        return rows * e / t, Plan(proposer, k, "goodput", e, t)

    def model_s(self, proposer: str | None, k: int, rows: int,
                match: float | None = None) -> float:
        """The model's round time for a batch of ``rows`` on this plan (``score``), before
        any measurement or ratio prices it (``CostModel.round_s``)."""
        c = self.cost
        if proposer is None:
            drafts = 0.0
        elif proposer == "ngram" and match is not None:  # blind: as far as matches reach
            drafts = match * sum(c.match_len[:k])
        else:
            drafts = float(k)
        return c.overhead_s + c.propose_s(proposer, k, rows) + c.verify_s(
            rows, rows * (1 + drafts))

    def best(self, cands: list[tuple[str, int]], others: int) -> Plan:
        """The best of ``cands`` and of nobody proposing."""
        best, plan = self.score(None, 0, others)
        for p, k in cands:
            g, candidate = self.score(p, k, others)
            if g > best * (1 + 1e-9):
                best, plan = g, candidate
        return plan

    def choose(self, state: RequestState) -> Plan:
        self.blind_lookup, self.shadow, self.batched = False, None, False
        if state.spec == "off":
            return Plan(None, 0, "drafter_unavailable") \
                if state.stats.speculation_disabled_reason else NO_SPECULATION
        k_cap = min(max_k(state), self.k_max)
        if k_cap == 0:
            return Plan(None, 0, "budget", 1.0)
        if not state.sampling.greedy:
            return self.reproducible(state, k_cap)
        if self.cost.rows > 1:
            self.batch_rounds += 1
            if self.batch_rounds % LOOKUP_EVERY == 0:
                self._search(state, k_cap)
            self.batched = True
            return self.in_batch(k_cap)
        cands = self.candidates(state, k_cap)
        if not cands:
            return Plan(None, 0, "no_lookup_match", 1.0)
        plan = self.best(cands, 0)  # alone: its own best, nobody included
        if plan.k > 0:
            self.idle = 0
            return plan
        self.idle += 1
        if self.idle < EXPLORE_AFTER:
            return replace(plan, reason="low_acceptance")
        self.idle = 0
        return replace(max((self.score(p, k, 0) for p, k in cands),
                           key=lambda s: s[0])[1], reason="explore")

    def in_batch(self, k_cap: int) -> Plan:
        """A row among others takes the plan the batch shares: the target's step waits for
        its whole cohort and pads attention to the longest row, so a row that skipped the
        proposer while the others drafted would arrive early and split the cohort (measured:
        a third fewer rows per forward at concurrency 16), and one with more drafts than
        the others would lengthen every row. So the batch's proposer and k are decided on
        what all its rows see alike, the router's pooled acceptance and lookup match rate,
        the shared costs and the batch's rows, and kept until another plan scores
        ``HYSTERESIS`` better, or ``HYSTERESIS + CATCH_UP`` for a change to the draft model:
        its cache is fed only where it drafts, so after rounds of lookup or none it first
        catches up every row's new tokens, a prefill of the whole batch's that no plan's
        score has (under load it took the target's CPUs too, and the batch flipped between
        lookup and draft model every few seconds, each flip paying it). Prompt lookup is a
        candidate too: every row asks (a drafter call, so the rows stay in step) and those
        with a match propose. The margin grows by ``NOISE_Z`` standard errors of the two
        plans' measured times (a mean of a few batch rounds, some of them stalled by a
        prefill: under load the errors were larger than the plans' differences, and the
        batch hopped among lookup k's every few seconds, a third of its rows' rounds
        changing plan); a plan priced by the model has none, so it is tried on its word.
        Likewise the standard error of the two plans' expected tokens from the pooled
        estimates' own noise (``_acceptance_se``): a batch took lookup k = 4 as the
        lookup's pooled estimate swung, and ran it at 0.66x spec-off.

        Decided once a batch round (and again when the load moves to another grid point),
        by the first of its rows to ask, and taken by the others (capped by their budgets):
        every row would score the same plans on the same state, and the router runs its
        rows' policies on one event loop, where each row's scoring (nine plans, 80-130 us)
        delayed every other row's call to the proposer, whose step waits for its cohort:
        1-2 ms a batch round at c=8-24 (docs/benchmarks.md)."""
        c = self.cost
        key = (self.has_drafter, self.k_max)
        at, rows, plan = c.decided.get(key, (0, 0, None))
        now = max(1, round(c.load))  # the rows it shares, not the last step's cohort
        if plan is None or c.rounds - at >= rows or _bucket(now) != _bucket(rows):
            rows = now
            plan = self._decide(rows - 1)
            c.decided[key] = (c.rounds, rows, plan)
        if plan.k > k_cap:
            plan = replace(self.score(plan.proposer, k_cap, rows - 1, c.pooled,
                                      c.lookup_match)[1], reason=plan.reason)
        self.blind_lookup = plan.proposer == "ngram"
        return plan

    def _decide(self, others: int) -> Plan:
        """The batch's plan for a batch of ``others`` and one row (``in_batch``)."""
        c = self.cost
        restarted = [f"{p}:{i}" for p, acc in c.pooled.items() for i in acc.restart()]
        plans = [(None, 0), *((p, k) for p in ("draft", "ngram")[not self.has_drafter:]
                              for k in range(1, self.k_max + 1))]
        scores = {plan: self.score(*plan, others, c.pooled, c.lookup_match) for plan in plans}
        ended = c.trying is not None  # a try ends in this call, unless it goes on
        current = self.try_down(scores, others + 1)
        if c.trying is not None:  # the batch's try (``explore``)
            return replace(scores.get(c.trying[0], scores[current])[1], reason="explore")
        cur_noise, cur_sense = c.noise(*current, others + 1), self._sensitivity(current)
        floor = scores[current][0] * (1 + HYSTERESIS)  # (the noise only for plans above it)
        better = [plan for plan in plans if scores[plan][0] > floor and scores[plan][0] > (
            scores[current][0] * (1 + HYSTERESIS + CATCH_UP * (plan[0] == "draft" != current[0])
                                  + NOISE_Z * math.hypot(cur_noise, c.noise(*plan, others + 1),
                                                         self._acceptance_se(plan, cur_sense))))]
        climb = False  # held below the best plan, which is out of reach (``towards``)
        if better:  # the best of those that clear their margin, or the rung towards it
            best = max(better, key=lambda plan: scores[plan][0])
            step = c.towards(best, current, others + 1)
            climb = step != best
            if step != current:
                if step[1] <= current[1] or step[0] != current[0]:  # not a climb
                    c.leaving(current, scores[current][0], scores[best][0], others + 1)
                c.batch_plan = current = step
                if not ended:  # (the one after a try keeps its ``TRY_AGAIN``)
                    c.plan_since = c.rounds
        if c.explaining:
            self.explain(scores, current, others + 1, restarted)
        if current[1] > 0:
            plan = scores[current][1]
            return replace(plan, reason="climb") if climb else plan
        if climb:
            return replace(scores[(None, 0)][1], reason="climb")
        alone = max((self.score(p, j, 0, c.pooled, c.lookup_match) for p, j in plans[1:]),
                    key=lambda s: s[0])  # would it pay without the others?
        reason = "saturated" if alone[0] > self.score(None, 0, 0)[0] else "low_acceptance"
        return replace(scores[(None, 0)][1], reason=reason)

    def _sensitivity(self, plan: tuple[str | None, int]) -> dict[tuple[str, int], float]:
        """d log(expected tokens) / d x of a batch's plan, x each pooled estimate it is
        scored on (``score``): the proposer's acceptance at each draft position, and for
        the prompt lookup its match rate (``("match", 0)``), its tokens 1 + m (E - 1)."""
        p, k = plan
        if p is None or k == 0:
            return {}
        acc = self.cost.pooled[p]
        m = self.cost.lookup_match if p == "ngram" else 1.0
        e = acc.expected(k)
        share = 1.0 + m * (e - 1.0)
        out = {(p, i): m * g / share for i, g in enumerate(acc.gradient(k))}
        if p == "ngram":
            out[("match", 0)] = (e - 1.0) / share
        return out

    def _acceptance_se(self, plan: tuple[str | None, int],
                       against: dict[tuple[str, int], float]) -> float:
        """The standard error of log(plan's expected tokens / the running plan's) from the
        pooled estimates' own noise (``against``: the running plan's ``_sensitivity``). A
        pooled estimate is a moving one, about a hundred observations' worth at a
        position at its floor step and fewer early, so two plans' expected tokens differ by
        chance as their measured times do (``noise``); the plans of one proposer share its
        estimates, and only where their sensitivities differ does the noise count
        (docs/benchmarks.md, "The AMD EPYC of family 25, model 17 again")."""
        c, sense = self.cost, self._sensitivity(plan)
        var = 0.0
        for key in sense.keys() | against.keys():
            d = sense.get(key, 0.0) - against.get(key, 0.0)
            if d:
                p, i = key
                v = c.lookup_match * (1.0 - c.lookup_match) * c.match_w2 if p == "match" \
                    else c.pooled[p].variance(i)
                var += d * d * v
        return math.sqrt(var)

    def explain(self, scores: dict[tuple[str | None, int], tuple[float, Plan]],
                current: tuple[str | None, int], rows: int, restarted: list[str]) -> None:
        """Keep the batch's decision for the round log (``CostModel.decision``): the rows
        it was for, the plan it kept or took, the round's overhead the model prices every
        plan with (``overhead_s``), and every plan's goodput with how its time was
        priced: ``m`` measured here lately (with the mean's relative standard error, the
        noise in the margin), ``c`` the model's times a ratio measured near this load
        (``CostModel._correction``), ``p`` never measured near it (the model's, times the
        ratio of a plan with fewer drafts where one was); then the expected committed
        tokens a row and the round's time (ms) the goodput divides, so a close call shows
        whether acceptance or time decided it, and the model's own time (ms): the factor
        the measurements put on the plan is the one over the other."""
        c = self.cost

        def priced(plan: tuple[str | None, int]) -> list:
            m = c.fresh_at(*plan, rows)
            how = "m" if m is not None else "c" if c.seen_near(*plan, rows) else "p"
            g, p = scores[plan]
            model = self.model_s(*plan, rows, c.lookup_match)
            return [round(g, 2), how, round(m.rse, 3) if m else 0.0, round(p.expected, 3),
                    round(1e3 * p.cost_s, 2), round(1e3 * model, 2)]

        c.decision = {"at": c.rounds, "rows": rows, "plan": _plan_name(current),
                      "overhead_ms": round(1e3 * c.overhead_s, 2),
                      "scores": {_plan_name(plan): priced(plan) for plan in scores}}
        if restarted:  # pooled positions this decision restarted (``Acceptance.restart``)
            c.decision["restarted"] = restarted

    def try_down(self, scores: dict[tuple[str | None, int], tuple[float, Plan]],
                 rows: int) -> tuple[str | None, int]:
        """The batch's plan, after starting or ending a try of the plan one draft down (or of
        the other proposer's at the running k, or of a plan left in a burst: the last two
        paragraphs). A
        plan priced by the model carries the running plan's unmodelled costs: the shared
        ``overhead_s`` has the running plan's drafter contention in it, and a fit cannot
        tell a draft from a row where k does not vary. Those costs grow with the drafts (a
        drafter beside the target slows its forward; a plan that commits more a round has
        more arrivals' prefills a round), so the model overprices the plans with fewer
        drafts than the running one and may never measure them (the unit test's batch of
        16 kept k = 3 or 4 for good in 5 of 12 seeds, where k = 1 made 22-51 % more);
        plans with more drafts it underprices (unless one with fewer was measured near the
        load: ``CostModel._correction``). So after
        ``TRY_AFTER`` batch rounds on one plan, the batch runs the plan one draft down (the
        same proposer; below k = 1, nobody), if not measured lately at this load and scored
        within ``TRY_FLOOR`` of the plan, until its time is measured there (at most
        ``TRY_ROUNDS`` batch rounds), and goes back; then the measured times decide as for
        any plan (``in_batch``). If it took the tried plan, the next one down is tried
        ``TRY_AGAIN`` batch rounds later. A plan one down never measured near this load is
        tried as soon as the running plan is measured there, once the load has held its
        grid point ``TRY_HELD`` batch rounds: a batch carries the plan it climbed to at a
        lighter load into a heavier one (and before ``CostModel.towards`` a cold batch
        started at the plan with the most drafts: at c=32 draft:4, then draft:3 for 15 s,
        rounds of 0.6-1.2 s where draft:2's took 0.3-0.5 s), and one step down every
        ``TRY_AFTER`` batch rounds was a step every 24 s there. Not while the load moves:
        it passes a new grid point every few batch rounds on the way up and down, and
        trying at each one put 12-30 % of auto's rounds in tries (against 0-4 %) and
        measured worse (docs/benchmarks.md).

        Likewise the other proposer's plan at the running k, if none of that proposer's
        plans was measured near this load (and scored within ``TRY_FLOOR``, expecting more
        than spec-off's one token: a lookup that never matches is spec-off), is tried as
        soon as the running plan is measured there and the load has held: the batch climbs
        from spec-off along one proposer (a cold one, the draft model, whose prior is the
        higher), and the other one's first rung, priced by the model against a measured
        plan that carries its noise in the margin, was not reached: a cold batch at c=4
        stayed on the draft model where the lookup made 10-20 % more, unless its first
        decisions, taken while its load still climbed from a burst's tail of 1-2 rows, had
        run the lookup. Once one of its plans was measured near the load, its ratio to the
        model prices the others (``CostModel._correction``): tried at every k the batch
        climbed to, on prose at c=8-24 the draft model's tries were 14-15 % of auto's
        rounds, each a drafter catch-up of every row (rounds of 160-200 ms against the
        lookup's 70-100; docs/benchmarks.md, "A third machine"). It is tried again, its
        times here measured afresh, once its pooled acceptance is another batch's
        (``CostModel.stale``): a batch that carried the lookup from prose into repetitive
        text at c=4 scored the draft model on the prose rows' estimate and never tried it
        (0.85-0.96x ``draft_k2``; docs/benchmarks.md, "The AMD EPYC of family 25, model 17
        a fourth time").

        And a plan the batch left on a stretch of its rounds (a burst of arrivals), one it
        would have kept at its usual measured time, is measured again ``TRY_AFTER`` batch
        rounds later, once, before any other try (``CostModel.leaving``).

        A try that a burst of arrivals (``CostModel.burst``) interrupts ends there: a
        burst's rounds are measured only where a step decoded alone, so such a try went on
        for ``TRY_ROUNDS`` batch rounds of the burst's dear rounds. A try begun as one
        level's requests drained went on into the next level's burst: 12 of 88 auto levels
        of one stop's runs began in a try, for 1-9 s (draft:3 at 840 ms a round for 3.3 s
        of a 15 s level, where ``draft_k2``'s rounds took 216), and those levels read 0.940x
        the best fixed configuration on average. A try begun within a burst goes on:
        ending every try in a burst and starting none there read -0.045 (standard error
        0.033) over three pairs of runs, ending only the one a burst interrupts +0.005
        (0.016), with 9.4 % of auto's round time in tries against 14.8 (docs/benchmarks.md,
        "The same AMD EPYC model again")."""
        c = self.cost
        current = c.batch_plan if c.batch_plan in scores else (None, 0)
        if c.trying is not None:
            tried, home = c.trying
            if (c.try_calm and c.burst()) or c.fresh_at(*tried, rows) is not None \
                    or c.rounds - c.plan_since > TRY_ROUNDS * rows:
                c.trying, c.batch_plan = None, home
                c.plan_since = c.rounds - (TRY_AFTER - TRY_AGAIN) * rows
                return home if home in scores else (None, 0)
            return current
        recheck = c.recheck(rows)
        if recheck in scores and recheck != current:  # a plan left on a stretch of its rounds
            c.remeasure(*recheck, rows)
            return self._start_try(recheck, current)
        if current[1] == 0:
            return current
        down = (current[0], current[1] - 1) if current[1] > 1 else (None, 0)
        # a load held lately, the running plan measured there (cheapest tests first)
        held = c.rounds > c.plan_since and c.rounds - c.load_since > TRY_HELD * rows \
            and c.fresh_at(*current, rows) is not None
        other = "ngram" if current[0] == "draft" else "draft"
        across = (other, current[1])

        def worth(plan: tuple[str | None, int]) -> bool:  # scored within TRY_FLOOR
            return plan in scores and scores[plan][0] >= TRY_FLOOR * scores[current][0]

        if held and worth(across) and scores[across][1].expected > 1.0 and (
                c.stale(other) or not any(c.seen_near(other, j, rows)
                                          for j in range(1, self.k_max + 1))):
            tried = across  # the other proposer, none of its plans measured near this load
            c.remeasure(*across, rows)  # or its acceptance another batch's: until measured
        elif c.rounds - c.plan_since > TRY_AFTER * rows or (
                # a plan never measured near a load held lately, below one measured there
                held and not c.seen_near(*down, rows)):
            tried = down if c.fresh_at(*down, rows) is None and worth(down) else None
        else:
            return current
        return self._start_try(tried, current)

    def _start_try(self, tried: tuple[str | None, int] | None,
                   current: tuple[str | None, int]) -> tuple[str | None, int]:
        """Run ``tried`` until measured, then go back to ``current`` (``try_down``); with
        nothing to try, the next try is due ``TRY_AFTER`` batch rounds on."""
        c = self.cost
        c.plan_since = c.rounds
        if tried is not None:
            c.trying, c.batch_plan = (tried, current), tried
            c.try_calm = not c.burst()
        return current

    def reproducible(self, state: RequestState, k_cap: int) -> Plan:
        """A sampled request's plan: a function of its committed tokens alone, so that its
        seed reproduces it (a retry, a resume from the journal; DESIGN §2), whatever the
        timing and load: the draft model (what spec=draft does), else a lookup match, else
        nobody. (Prompt lookup's q is one-hot: sampled, it is accepted with p(x) only.)"""
        if self.has_drafter:
            return Plan("draft", k_cap, "sampled")
        match = self.lookup.propose(state.committed, k_cap)
        if match:
            return Plan("ngram", len(match), "sampled")
        return Plan(None, 0, "no_lookup_match")

    def observe(self, state: RequestState, o: RoundOutcome) -> None:
        plan = _plan_key(o.plan)
        self.cost.observe(o, steady=plan == self.last_plan)
        self.last_plan = plan
        p = o.plan.proposer
        lookup, self.copying = self.own("ngram"), False  # this round's, then the next's
        if self.blind_lookup and p == "ngram":  # planned without knowing: an honest sample
            self.cost.saw_lookup(o.drafted > 0, o.drafted, o.plan.k)
        if self.shadow and not (p == "ngram" and o.drafted):
            # the lookup this round searched but did not propose: how much of it the
            # target would have accepted (greedy: the committed tokens are the target's)
            drafted, accepted = shadow_acceptance(self.shadow, o.tokens)
            lookup.observe(drafted, accepted)
            self.copying = accepted == drafted
            self.cost.observe_pooled("ngram", drafted, accepted)
            self.cost.lookup_ended(drafted, accepted, self._searched(drafted))
        if p is not None and o.drafted:
            (lookup if p == "ngram" else self.acceptance[p]).observe(
                o.drafted, o.decision.num_accepted)
            if p == "ngram":
                self.copying = o.decision.num_accepted == o.drafted
            if self.batched or p == "ngram":  # see ``CostModel.pooled``
                self.cost.observe_pooled(p, o.drafted, o.decision.num_accepted)
            if p == "ngram":
                self.cost.lookup_ended(o.drafted, o.decision.num_accepted, o.plan.k
                                       if self.blind_lookup else self._searched(o.drafted))
            if p == "ngram" and self.shadow and (past := lookup_past_k(
                    self.shadow, o.proposal.draft_tokens, o.tokens)) is not None:
                lookup.observe_at(o.drafted, past)
                self.copying = past  # the match went on past the drafts, or ended
                self.cost.observe_pooled_at("ngram", o.drafted, past)
            tried, acc = self.counts[p]
            for i in range(min(o.drafted, o.decision.num_accepted + 1, self.k_max)):
                tried[i] += 1
                acc[i] += int(i < o.decision.num_accepted)


    def _searched(self, length: int) -> int:
        """For how many tokens this round's search found a match of ``length`` tokens (its
        whole match: else a prefix of it, proposed or seen, says nothing of its end)."""
        return self.searched if self.shadow is not None and len(self.shadow) == length else 0


def decoding(batch_fed: int, batch_tokens: int) -> bool:
    """Whether a verify reply's target step was a round of decoding: it fed (``batch_fed``)
    its rows' drafts and next tokens (``batch_tokens``) and a few catch-up ones, no prefill
    or cache rebuild, whose cost (hundreds of positions) has nothing to do with the plans of
    the rows it stalled. A replica of the release before reports no fed positions: taken as
    decoding."""
    return batch_fed <= batch_tokens + PREFILL_FED or not batch_fed


def measurable(round_no: int, caught_up: int) -> bool:
    """Whether a round's time can be its plan's cost (``CostModel._measure``, and the bench's
    reading of a round log): not a request's first round, nor one whose caches caught up
    more than ``STEADY_FED`` positions."""
    return round_no > 0 and caught_up <= STEADY_FED


def shadow_acceptance(match: Sequence[int], committed: Sequence[int]) -> tuple[int, int]:
    """What a prompt lookup's ``match``, searched at a round's start but not proposed, would
    have had accepted, as (drafted, accepted) for ``Acceptance.observe``: a greedy round
    commits the target's own tokens, so draft i would have been accepted exactly when it
    equals committed token i, as far as the round committed tokens. A match longer than
    the round's tokens, all of them equal, is censored there: positions past the round's
    tokens were not seen (observed as that many drafted, all accepted). Prompt lookup
    costs nothing, so its acceptance is learned in every round that searches, not only in
    the rounds that chose it (a batch that never chose it would never correct its prior)."""
    n = min(len(match), len(committed))
    same = next((i for i in range(n) if match[i] != committed[i]), n)
    if same < n or len(match) <= len(committed):
        return len(match), same
    return n, n


def lookup_past_k(match: Sequence[int], drafts: Sequence[int],
                  committed: Sequence[int]) -> bool | None:
    """Whether the prompt lookup's next token past a round's drafts would have been
    accepted, where that is known for free: the round proposed the lookup's first
    ``len(drafts)`` tokens of ``match`` (the same search: its continuation does not depend
    on k), all of them were accepted, and the match goes on; the round's extra token
    (greedy: the target's own) is then the answer. A batch on lookup k < K_max sees its
    acceptance at positions past k nowhere else (rounds commit at most k + 1 tokens), so an
    unlucky estimate there stayed for good: a sweep's batch at c=32 had position 4's at 0.40
    where the other runs' read 0.72-0.81, and seldom ran k = 4 after. None: not known."""
    d = len(drafts)
    if len(match) <= d or len(committed) != d + 1 or list(match[:d]) != list(drafts) \
            or list(committed[:d]) != list(drafts):
        return None
    return match[d] == committed[d]


def policy_for(state: RequestState, cost: CostModel, has_drafter: bool,
               priors: dict[str, list[float]] | None = None) -> Policy:
    """The request's policy: ``GoodputPolicy`` for spec=auto, else its fixed mode and k."""
    if state.spec == "auto":
        return GoodputPolicy(cost, state.k, has_drafter, priors)
    return FixedK()

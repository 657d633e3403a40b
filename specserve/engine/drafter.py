"""The drafter service's multi-session proposer.

Each session keeps the committed tokens it was last sent (for the ``tokens_start``
protocol and for n-gram lookup) and, once a draft-model call arrives, a
``DraftModelSession`` (lean static KV cache, repaired by content with ``repair_plan``).
A call's draft-model items are drafted together (``sessions.propose_batch``): one batched
forward feeds every row its repair, then one per draft step for the rows that still need
drafts (a row with a smaller k drops out; k = 0 only repairs). Greedy rows share their
matmuls; a sampled row's logits, drafts and q are bitwise those it gets alone. N-gram items
need no forward. Same ``tokens_start`` / ``cache_miss`` protocol as the target
(``specserve.engine.target``): an unknown session, or one that holds fewer than
``tokens_start`` committed tokens, answers ``cache_miss`` and the caller resends the full
committed list with ``tokens_start = 0``.

Draft-ahead (``draft_ahead=True``; issue 16, after SSD/Saguaro and PEARL): once a draft-model
reply is out, ``draft_ahead()`` (the server calls it while the target verifies) prepares
the next round for the likeliest outcomes: "all k drafts accepted, then one of the
drafter's ``guesses`` likeliest next tokens as the extra one" (it guesses those tokens b, a
sampled row its own draw only, then drafts k tokens after committed + drafts + b) and,
from two guesses, for a greedy row "draft j rejected, the drafter's runner-up at j as the
correction" for each j (the runner-ups are kept when the reply is drafted,
``DraftJob.runners_up``). One batched call drafts every outcome (the first in the session's
own cache, the others in copies of it, ``DraftModelSession.fork``), and only while it
drafts ahead for at most ``AHEAD_ROWS`` sessions (light load). The next call that arrives
with exactly one of those committed lists, the same k and the same sampling gets its
prepared block at once (``ProposeOutcome.ahead``; a copy's cache becomes the session's);
any other call (a miss) first crops the cache back to where it stood before drafting
ahead.
``take_prepared()`` hands the blocks just drafted ahead to the server, which pushes each to
its router (``Prepared``): a router whose verify outcome matches (its request alone at the
target) sends it to the target at once, and makes the same call as without the push
alongside (answered from this block), so the drafter and its next draft-ahead stay in step.
Both ways the cache and every draft are what drafting on request would have given: the
prepared block is drafted after the same cache state and the same fed chunk (the last
draft and b together) as a call would feed, with the same counter-based draws (seed,
position), so a sampled row's q is bitwise the same and seeded outputs do not change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from specserve.contract import ProposeItem, ProposeOutcome, RepairRecord
from specserve.core.commit import check_tokens_window
from specserve.core.ngram import NgramIndex
from specserve.core.sampling import SamplingParams
from specserve.engine.lean import LeanLlama
from specserve.engine.sessions import DraftJob, DraftModelSession, guess_batch, propose_batch
from specserve.service.lru import LRUSessions

__all__ = ["DrafterEngine", "ProposeItem", "ProposeOutcome"]
_TOKEN_BYTES = 8
# draft ahead only for at most this many sessions at once (light load). Under load a hit
# saves little: the call's batch still drafts for its other rows, at about the same step
# time, while drafting ahead for many rows keeps the drafter busy when the next calls come
# (measured at concurrency 16: draft K=2 0.93-0.99x spec-off with draft-ahead, 1.03-1.07x
# without)
AHEAD_ROWS = 4


@dataclass
class _Block:
    """Drafts for ``committed`` (k of them, with ``sampling`` and ``seed``): a reply's
    block to draft ahead from, or a block drafted ahead; ``base``: the model cache's length
    before drafting ahead (a miss crops back to it)."""

    committed: list[int]
    k: int
    sampling: SamplingParams
    seed: int
    drafts: list[int]
    q: object = None  # torch.Tensor [k, V] | None (greedy)
    base: int = 0
    model: DraftModelSession | None = None  # a guess drafted in a copy (None: the session's)
    runners_up: list[int] = field(default_factory=list)  # per draft (greedy, when branching)
    outcome: str = "accept"  # drafted ahead for: "accept" (all k, the first guess after),
    # "guess" (all k, another guess after), "reject" (a rejection, the runner-up there)


@dataclass(frozen=True)
class Prepared:
    """A block drafted ahead, for pushing to the router: the drafts (and q) for
    ``session_id`` once its committed tokens are ``committed_len`` long and end with ``tail``
    (the last reply's drafts, then the guessed extra token)."""

    session_id: str
    committed_len: int
    tail: list[int]
    drafts: list[int]
    q: object = None


@dataclass
class _Session:
    committed: list[int]
    model: DraftModelSession | None = None
    aheads: list[_Block] = field(default_factory=list)  # drafted ahead, for the next call
    lookup: NgramIndex | None = None  # its prompt lookup's index, once it was asked one

    @property
    def nbytes(self) -> int:
        """Its cache, the copies its outcomes drafted ahead were drafted in, its tokens."""
        models = [self.model, *(a.model for a in self.aheads)]
        return sum(m.nbytes for m in models if m is not None) + _TOKEN_BYTES * len(
            self.committed) + (self.lookup.nbytes if self.lookup is not None else 0)


class DrafterEngine(LRUSessions):
    """Draft-model and n-gram proposals for many sessions, with an LRU byte budget."""

    def __init__(self, lean: LeanLlama | None, cache_budget_bytes: int = 256 << 20,
                 ngram_max_n: int = 4, ngram_min_n: int = 1, draft_ahead: bool = False,
                 guesses: int = 1):
        super().__init__(cache_budget_bytes)
        self.draft_ahead_on = draft_ahead and lean is not None
        self.guesses = max(1, guesses)
        # rows drafted ahead; calls that got a block (of them: for a guess other than the
        # first after all accepted; for a rejection) and calls that did not
        self.ahead = {"drafted": 0, "hits": 0, "hits_other_guess": 0, "hits_rejection": 0,
                      "misses": 0}
        self._replied: dict[str, _Block] = {}  # session -> its last reply, to draft ahead from
        self._to_push: list[Prepared] = []  # drafted ahead, not yet taken (take_prepared)
        self.lean = lean
        self.ngram_max_n, self.ngram_min_n = ngram_max_n, ngram_min_n
        self.vocab_size = int(lean.config.vocab_size) if lean is not None else None
        self.proposals = 0

    # ----------------------------------------------------------------- sessions
    def stats(self) -> dict[str, int]:
        return {
            **self.lru_stats(),
            "proposals": self.proposals,
            **{f"ahead_{k}": v for k, v in self.ahead.items()},
        }

    # ----------------------------------------------------------------- propose
    def _check(self, items: Sequence[ProposeItem]) -> None:
        seen: set[str] = set()
        for it in items:
            sid = it.session_id
            if sid in seen:
                raise ValueError(f"session {sid!r} appears twice in one propose call")
            seen.add(sid)
            check_tokens_window(sid, it.committed_len, it.tokens_start, it.tokens)
            if it.k < 0:
                raise ValueError(f"session {sid!r}: k must be >= 0, got {it.k}")
            if it.mode not in ("draft", "ngram"):
                raise ValueError(f"session {sid!r}: mode must be 'draft' or 'ngram', "
                                 f"got {it.mode!r}")
            if it.mode == "draft":
                if self.lean is None:
                    raise ValueError(f"session {sid!r}: mode 'draft' needs a drafter model; "
                                     "this engine has none (use 'ngram')")
                if it.committed_len > self.lean.max_len:
                    raise ValueError(f"session {sid!r}: committed_len ({it.committed_len}) "
                                     f"exceeds the drafter's context ({self.lean.max_len})")
                bad = [t for t in it.tokens if not 0 <= t < (self.vocab_size or 0)]
                if bad:
                    raise ValueError(f"session {sid!r}: token id {bad[0]} outside the "
                                     f"vocabulary [0, {self.vocab_size})")
                if not it.sampling.greedy and it.sampling.seed is None:
                    raise ValueError(f"session {sid!r}: a sampled row needs sampling.seed")

    def validate(self, item: ProposeItem) -> None:
        """Raise ValueError if ``item`` alone would be refused (``propose`` checks the
        whole list at once; a server checks each item first so a bad one fails alone)."""
        self._check([item])

    def propose(self, items: list[ProposeItem]) -> list[ProposeOutcome]:
        self._check(items)
        outcomes: list[ProposeOutcome | None] = [None] * len(items)
        served: set[str] = set()
        jobs: list[DraftJob] = []
        slots: list[int] = []
        for i, it in enumerate(items):
            sess = self._admit(it, served)
            if sess is None:
                outcomes[i] = ProposeOutcome([], None, cache_miss=True)
            elif it.mode == "ngram":
                self._replied.pop(it.session_id, None)  # nothing to draft ahead from
                if sess.lookup is None:
                    sess.lookup = NgramIndex(self.ngram_max_n, self.ngram_min_n)
                drafts = sess.lookup.propose(sess.committed, it.k)
                outcomes[i] = ProposeOutcome(drafts, None)
            else:
                assert self.lean is not None  # checked
                if sess.model is None:
                    sess.model = DraftModelSession(self.lean)
                hit = self._prepared(it.session_id, sess, it)
                if hit is not None:
                    outcomes[i] = hit
                    continue
                jobs.append(DraftJob(sess.model, sess.committed, it.k, it.sampling,
                                     it.sampling.seed or 0))
                slots.append(i)
        if jobs:
            assert self.lean is not None
            self._ask_runners_up(jobs, len(jobs))
            for i, job, (drafts, q, record) in zip(slots, jobs, propose_batch(self.lean, jobs),
                                                   strict=True):
                outcomes[i] = ProposeOutcome(drafts, q, repair=record)
                if self.draft_ahead_on and drafts:
                    self._replied[items[i].session_id] = _Block(
                        list(job.committed), job.k, job.sampling, job.seed, drafts, q,
                        len(job.session.tokens), runners_up=job.runners_up or [])
        self._evict(served)
        return outcomes  # type: ignore[return-value]  # every slot is filled

    # ----------------------------------------------------------------- draft-ahead
    def release(self, session_id: str) -> bool:
        self._replied.pop(session_id, None)
        return super().release(session_id)

    def _prepared(self, sid: str, sess: _Session, it: ProposeItem) -> ProposeOutcome | None:
        """The block drafted ahead for this call, if one is this call's (the same committed
        tokens, k and sampling; drafted in a copy: the copy becomes the session's cache);
        else None, the cache cropped back to before the ahead."""
        aheads, sess.aheads = sess.aheads, []
        self._replied.pop(sid, None)
        if not aheads or sess.model is None:
            return None
        for ahead in aheads:
            if (ahead.committed == sess.committed and ahead.k == it.k
                    and ahead.sampling == it.sampling
                    and ahead.seed == (it.sampling.seed or 0)):
                self.ahead["hits"] += 1
                self.ahead["hits_other_guess"] += ahead.outcome == "guess"
                self.ahead["hits_rejection"] += ahead.outcome == "reject"
                if ahead.model is not None:
                    sess.model = ahead.model
                model = sess.model
                record = RepairRecord(len(model.tokens), len(model.tokens), 0)
                if self.draft_ahead_on:  # the next ahead starts from this block
                    self._replied[sid] = replace(ahead, base=len(model.tokens), model=None,
                                                 outcome="accept")
                return ProposeOutcome(list(ahead.drafts), ahead.q, repair=record, ahead=True)
        self.ahead["misses"] += 1
        model = sess.model
        keep = min(aheads[0].base, len(model.tokens))
        model.cache.crop(keep)
        model.tokens = model.tokens[:keep]
        return None

    @property
    def ahead_pending(self) -> bool:
        return bool(self._replied)

    def _branching(self, rows: int) -> bool:
        """Whether a draft-ahead over ``rows`` rows prepares more than one outcome per
        greedy row (light load: the drafter has time to spare)."""
        return self.draft_ahead_on and self.guesses > 1 and rows <= AHEAD_ROWS

    def _ask_runners_up(self, jobs: list[DraftJob], rows: int) -> None:
        """Have ``propose_batch`` keep each greedy job's runner-up per draft (the guesses for
        a rejection) when the draft-ahead after these ``rows`` rows will branch."""
        if self._branching(rows):
            for job in jobs:
                if job.sampling.greedy:
                    job.runners_up = []

    def _outcomes(self, r: _Block, bs: list[int], branch: bool) -> list[tuple[list[int], str]]:
        """The committed lists drafted ahead for after reply ``r``: all its drafts accepted
        then each guess b; when branching, also each rejection, the runner-up in its place."""
        out = [([*r.committed, *r.drafts, b], "accept" if n == 0 else "guess")
               for n, b in enumerate(bs)]
        if branch:
            out += [([*r.committed, *r.drafts[:j], t], "reject")
                    for j, t in enumerate(r.runners_up[:len(r.drafts)])]
        return out

    def draft_ahead(self) -> int:
        """Draft ahead for every session whose last draft-model reply is out (see the
        module's doc): one batched step guesses each row's extra token b after its drafts,
        then each cache is cropped back to where the reply left it and k steps draft after
        committed + drafts + b, the last draft and b fed together as a call would feed
        them (and, when branching, after each rejection's runner-up, in a copy of the cache
        cropped to before the rejected draft). Returns the rows drafted ahead."""
        assert self.lean is not None or not self.ahead_pending
        todo = []
        replied, self._replied = self._replied, {}
        for sid, r in replied.items():
            sess = self._sessions.get(sid)
            if sess is None or sess.model is None or sess.model.tokens != (
                    r.committed + r.drafts)[:r.base]:
                continue  # evicted, or a later call got there first
            if len(r.committed) + 2 * r.k + 1 > self.lean.max_len:
                continue
            todo.append((sid, sess, r))
        if not todo or len(todo) > AHEAD_ROWS:
            return 0  # (under load: the next calls are served as without draft-ahead)
        branch = self._branching(len(todo))
        guesses = guess_batch(self.lean, [
            DraftJob(s.model, r.committed + r.drafts, 1, r.sampling, r.seed)
            for _, s, r in todo], self.guesses if branch else 1)
        jobs, owners = [], []
        for (sid, s, r), bs in zip(todo, guesses, strict=True):
            s.model.cache.crop(r.base)
            s.model.tokens = s.model.tokens[:r.base]
            s.aheads = []
            for n, (committed, outcome) in enumerate(self._outcomes(r, bs, branch)):
                model = s.model if n == 0 else s.model.fork(min(r.base, len(committed) - 1))
                jobs.append(DraftJob(model, committed, r.k, r.sampling, r.seed))
                owners.append((sid, s, r, None if n == 0 else model, outcome))
        self._ask_runners_up(jobs, len(todo))
        for (sid, s, r, model, outcome), job, (drafts, q, _) in zip(
                owners, jobs, propose_batch(self.lean, jobs), strict=True):
            s.aheads.append(_Block(list(job.committed), r.k, r.sampling, r.seed, drafts, q,
                                   r.base, model, job.runners_up or [], outcome))
            if drafts:
                self._to_push.append(Prepared(
                    sid, len(job.committed), list(job.committed[len(r.committed):]),
                    list(drafts), q))
        self.ahead["drafted"] += len(todo)
        return len(todo)

    def take_prepared(self) -> list[Prepared]:
        """The blocks drafted ahead since the last take, still this engine's next answer
        (a session released or already called since is left out)."""
        out, self._to_push = self._to_push, []
        return [p for p in out if (s := self._sessions.get(p.session_id)) is not None
                and any(len(b.committed) == p.committed_len
                        and b.committed[-len(p.tail):] == p.tail for b in s.aheads)]

    def _admit(self, it: ProposeItem, served: set[str]) -> _Session | None:
        """The item's session with its committed tokens updated; None on a cache miss."""
        sess = self._sessions.get(it.session_id)
        if it.tokens_start > 0 and (sess is None or len(sess.committed) < it.tokens_start):
            self.misses += 1
            return None
        if sess is None:
            sess = self._sessions[it.session_id] = _Session([])
        sess.committed = [*sess.committed[: it.tokens_start], *it.tokens]
        self._sessions.move_to_end(it.session_id)
        served.add(it.session_id)
        self.proposals += 1
        return sess

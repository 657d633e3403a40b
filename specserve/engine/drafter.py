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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specserve.contract import ProposeItem, ProposeOutcome
from specserve.core.commit import check_tokens_window
from specserve.core.ngram import propose_ngram
from specserve.engine.lean import LeanLlama
from specserve.engine.sessions import DraftJob, DraftModelSession, propose_batch
from specserve.service.lru import LRUSessions

__all__ = ["DrafterEngine", "ProposeItem", "ProposeOutcome"]
_TOKEN_BYTES = 8


@dataclass
class _Session:
    committed: list[int]
    model: DraftModelSession | None = None

    @property
    def nbytes(self) -> int:
        return (self.model.nbytes if self.model is not None else 0) + _TOKEN_BYTES * len(
            self.committed)


class DrafterEngine(LRUSessions):
    """Draft-model and n-gram proposals for many sessions, with an LRU byte budget."""

    def __init__(self, lean: LeanLlama | None, cache_budget_bytes: int = 256 << 20,
                 ngram_max_n: int = 4, ngram_min_n: int = 1):
        super().__init__(cache_budget_bytes)
        self.lean = lean
        self.ngram_max_n, self.ngram_min_n = ngram_max_n, ngram_min_n
        self.vocab_size = int(lean.config.vocab_size) if lean is not None else None
        self.proposals = 0

    # ----------------------------------------------------------------- sessions
    def stats(self) -> dict[str, int]:
        return {
            **self.lru_stats(),
            "proposals": self.proposals,
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
                drafts = propose_ngram(sess.committed, it.k, self.ngram_max_n, self.ngram_min_n)
                outcomes[i] = ProposeOutcome(drafts, None)
            else:
                assert self.lean is not None  # checked
                if sess.model is None:
                    sess.model = DraftModelSession(self.lean)
                jobs.append(DraftJob(sess.model, sess.committed, it.k, it.sampling,
                                     it.sampling.seed or 0))
                slots.append(i)
        if jobs:
            assert self.lean is not None
            for i, (drafts, q, record) in zip(slots, propose_batch(self.lean, jobs),
                                              strict=True):
                outcomes[i] = ProposeOutcome(drafts, q, repair=record)
        self._evict(served)
        return outcomes  # type: ignore[return-value]  # every slot is filled

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

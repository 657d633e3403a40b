"""The drafter service's multi-session proposer.

Each session keeps the committed tokens it was last sent (for the ``tokens_start``
protocol and for n-gram lookup) and, once a draft-model call arrives, a
``DraftModelSession`` (lean static KV cache, repaired by content with ``repair_plan``).
Calls are served one item after another: a drafter step is a single-token forward of a
small model, so batching it would not pay on CPU. Same ``tokens_start`` / ``cache_miss``
protocol as the target (``specserve.engine.target``): an unknown session, or one that holds
fewer than ``tokens_start`` committed tokens, answers ``cache_miss`` and the caller resends
the full committed list with ``tokens_start = 0``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specserve.contract import ProposeItem, ProposeOutcome
from specserve.core.commit import check_tokens_window
from specserve.core.ngram import propose_ngram
from specserve.engine.lean import LeanLlama
from specserve.engine.sessions import DraftModelSession
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

    def propose(self, items: list[ProposeItem]) -> list[ProposeOutcome]:
        self._check(items)
        outcomes: list[ProposeOutcome] = []
        served: set[str] = set()
        for it in items:
            sess = self._sessions.get(it.session_id)
            if it.tokens_start > 0 and (sess is None or len(sess.committed) < it.tokens_start):
                self.misses += 1
                outcomes.append(ProposeOutcome([], None, cache_miss=True))
                continue
            if sess is None:
                sess = self._sessions[it.session_id] = _Session([])
            sess.committed = [*sess.committed[: it.tokens_start], *it.tokens]
            self._sessions.move_to_end(it.session_id)
            served.add(it.session_id)
            self.proposals += 1
            if it.mode == "ngram":
                drafts = propose_ngram(sess.committed, it.k, self.ngram_max_n, self.ngram_min_n)
                outcomes.append(ProposeOutcome(drafts, None))
                continue
            assert self.lean is not None  # checked
            if sess.model is None:
                sess.model = DraftModelSession(self.lean)
            drafts, q, record = sess.model.propose(
                sess.committed, it.k, it.sampling, it.sampling.seed or 0)
            outcomes.append(ProposeOutcome(drafts, q, repair=record))
        self._evict(served)
        return outcomes

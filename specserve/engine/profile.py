"""A replica's cost profile, measured when it starts, so that ``spec=auto``'s cost model
(``specserve.policy.CostModel``) begins calibrated instead of from a guess.

``profile_target``: verify calls over a grid of batch rows x draft tokens, through the
engine's own ``verify`` (any engine: plain or tensor-parallel), each row with a cached past
and feeding 1 + k tokens as a real round does. The online fit cannot separate the cost of a
row from the cost of a draft token when both rise together under load; the grid varies them
independently. ``profile_drafter``: the draft model's time per draft step, by the rows drafting
together (one drafter step serves them all).

Profile sessions are private (``PROFILE_PREFIX``) and released afterwards.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

from specserve.contract import ProposeItem, VerifyItem
from specserve.core.sampling import SamplingParams

PROFILE_PREFIX = "__specserve-profile-"
ROWS = (1, 4, 16)
DRAFTS = (0, 2, 4)
DRAFT_ROWS = (1, 8)
PAST = 64


class _Rows:
    """The profile's sessions: random committed tokens that grow by one per call."""

    def __init__(self, n: int, vocab: int, past: int):
        self.rng = random.Random(0)
        self.vocab = vocab
        self.ids = [f"{PROFILE_PREFIX}{i}" for i in range(n)]
        self.committed = {s: self._draw(past) for s in self.ids}

    def _draw(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def items(self, rows: int, k: int) -> list[VerifyItem]:
        out = []
        for sid in self.ids[:rows]:
            c = self.committed[sid]
            c.append(self.rng.randrange(self.vocab))  # the last round's extra token
            out.append(VerifyItem(sid, len(c), len(c) - 1, c[-1:], self._draw(k), None,
                                  SamplingParams(seed=0)))
        return out


def profile_target(engine: Any, rows: Sequence[int] = ROWS, drafts: Sequence[int] = DRAFTS,
                   past: int = PAST, repeats: int = 2) -> list[tuple[int, int, float]]:
    """(rows, batch tokens, seconds) per grid point: the fastest of ``repeats`` verify
    calls (the first call of all, the prefill, is not timed)."""
    sessions = _Rows(max(rows), int(engine.vocab_size), past)
    try:
        engine.verify([VerifyItem(s, past, 0, sessions.committed[s], [], None,
                                  SamplingParams(seed=0)) for s in sessions.ids])
        out = []
        for r in rows:
            for k in drafts:
                best = float("inf")
                for _ in range(repeats):
                    items = sessions.items(r, k)
                    t0 = time.perf_counter()
                    engine.verify(items)
                    best = min(best, time.perf_counter() - t0)
                out.append((r, r * (1 + k), best))
        return out
    finally:
        for s in sessions.ids:
            engine.release(s)


def profile_drafter(engine: Any, rows: Sequence[int] = DRAFT_ROWS, k: int = 4,
                    past: int = PAST, repeats: int = 3) -> list[tuple[int, float]] | None:
    """(rows, seconds per draft step) of the draft model, for ``rows`` rows drafting
    together in one call: the fastest of ``repeats`` calls of k steps (None: the engine
    has no draft model)."""
    if getattr(engine, "lean", None) is None:
        return None
    rng = random.Random(0)
    sids = [f"{PROFILE_PREFIX}draft-{i}" for i in range(max(rows))]
    committed = {s: [rng.randrange(int(engine.vocab_size)) for _ in range(past)] for s in sids}

    def items(n: int, first: bool) -> list[ProposeItem]:
        out = []
        for sid in sids[:n]:
            c = committed[sid]
            out.append(ProposeItem(sid, len(c), 0 if first else len(c) - 1,
                                   list(c) if first else c[-1:], k, "draft",
                                   SamplingParams()))
            c.append(rng.randrange(int(engine.vocab_size)))
        return out

    try:
        engine.propose(items(len(sids), first=True))  # prefill, untimed
        out = []
        for n in rows:
            best = float("inf")
            for _ in range(repeats):
                batch = items(n, first=False)
                t0 = time.perf_counter()
                engine.propose(batch)
                best = min(best, time.perf_counter() - t0)
            out.append((n, best / k))
        return out
    finally:
        for sid in sids:
            engine.release(sid)

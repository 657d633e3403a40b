"""Per-sequence drafter and target state: a KV cache plus the tokens it holds.

Both repair themselves by content: each call passes the committed tokens, the session keeps
the longest agreeing prefix of its cache (``repair_plan``) and feeds the rest. So a normal
round feeds 1-2 tokens, and a retry, an eviction or a fresh replica converges the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specserve.contract import RepairRecord
from specserve.core import rng
from specserve.core.commit import repair_plan
from specserve.core.sampling import SamplingParams, probs_from_logits, sample_tokens
from specserve.engine.lean import LeanLlama


def _sampling_tensors(s: SamplingParams, n: int = 1):
    return (
        torch.full((n,), s.temperature),
        torch.full((n,), s.top_k, dtype=torch.int64),
        torch.full((n,), s.top_p),
    )


class DraftModelSession:
    """Drafts with a lean static-cache forward of the drafter (see ``lean.py``)."""

    def __init__(self, lean: LeanLlama):
        self.lean = lean
        self.cache = lean.new_cache()
        self.tokens: list[int] = []

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def propose(
        self, committed: Sequence[int], k: int, sampling: SamplingParams, seed: int
    ) -> tuple[list[int], torch.Tensor | None, RepairRecord]:
        """k draft tokens and q [k, V] (None when greedy: q is one-hot on the drafts)."""
        plan = repair_plan(self.tokens, committed)
        record = RepairRecord(len(self.tokens), plan.keep, len(committed) - plan.keep)
        self.cache.crop(plan.keep)
        self.tokens = list(committed[: plan.keep])
        if k == 0:
            return [], None, record
        k = min(k, self.lean.max_len - len(committed))
        logits = self.lean.forward(self.cache, torch.tensor(committed[plan.keep :]))[-1:]
        self.tokens = list(committed)
        temps, tks, tps = _sampling_tensors(sampling)
        seeds = np.array([seed], dtype=np.uint64)
        drafts: list[int] = []
        qs: list[torch.Tensor] = []
        for j in range(k):
            if sampling.greedy:
                d = int(logits[0].argmax())
            else:
                q = probs_from_logits(logits, temps, tks, tps)  # [1, V]
                d = int(sample_tokens(q, seeds, rng.DRAFT, np.array([len(committed) + j]))[0])
                qs.append(q[0])
            drafts.append(d)
            if j < k - 1:
                logits = self.lean.forward(self.cache, torch.tensor([d]))
                self.tokens.append(d)
        return drafts, (torch.stack(qs) if qs else None), record

"""Per-sequence drafter and target state: a KV cache plus the tokens it holds.

Both repair themselves by content: each call passes the committed tokens, the session keeps
the longest agreeing prefix of its cache (``repair_plan``) and feeds the rest. So a normal
round feeds 1-2 tokens, and a retry, an eviction or a fresh replica converges the same way.

``propose_batch`` drafts for several drafter sessions at once: step 0 feeds every row its
repair (``committed[keep:]``), then each draft step feeds every row that still needs drafts
its previous draft, one ``LeanLlama.forward_batch`` per step. A sampled row's logits are
bitwise those it gets alone (``exact`` rows) and it draws with its own seed, position and
settings, so its drafts and q do not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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

    def repair(self, committed: Sequence[int]) -> RepairRecord:
        """Crop the cache to its longest prefix agreeing with ``committed``."""
        plan = repair_plan(self.tokens, committed)
        record = RepairRecord(len(self.tokens), plan.keep, len(committed) - plan.keep)
        self.cache.crop(plan.keep)
        self.tokens = list(committed[: plan.keep])
        return record

    def propose(
        self, committed: Sequence[int], k: int, sampling: SamplingParams, seed: int
    ) -> tuple[list[int], torch.Tensor | None, RepairRecord]:
        """k draft tokens and q [k, V] (None when greedy: q is one-hot on the drafts)."""
        return propose_batch(self.lean, [DraftJob(self, committed, k, sampling, seed)])[0]

    def fork(self, length: int) -> DraftModelSession:
        """A new session holding this one's first ``length`` cache entries (a copy)."""
        out = DraftModelSession.__new__(DraftModelSession)
        out.lean, out.cache = self.lean, self.cache.prefix_copy(length)
        out.tokens = self.tokens[:out.cache.length]
        return out


@dataclass
class DraftJob:
    session: DraftModelSession
    committed: Sequence[int]
    k: int
    sampling: SamplingParams
    seed: int
    # a list: a greedy row's runner-up at each draft position (the drafter's likeliest token
    # other than the draft) is appended to it, the guess for a rejection there (draft-ahead)
    runners_up: list[int] | None = None


def propose_batch(
    lean: LeanLlama, jobs: Sequence[DraftJob]
) -> list[tuple[list[int], torch.Tensor | None, RepairRecord]]:
    """Each job's drafts, q and repair, as ``DraftModelSession.propose`` one by one would
    give them; one batched forward per draft step. Sessions must be distinct."""
    records = [job.session.repair(job.committed) for job in jobs]
    # k = 0: repair only; k > 0: feed the repair, draft at most up to the context
    ks = [min(j.k, lean.max_len - len(j.committed)) if j.k > 0 else 0 for j in jobs]
    drafts: list[list[int]] = [[] for _ in jobs]
    qs: list[list[torch.Tensor]] = [[] for _ in jobs]
    rows = [i for i, job in enumerate(jobs) if job.k > 0]
    feeds = [list(jobs[i].committed[records[i].kept :]) for i in rows]
    while rows:
        logits = lean.forward_batch(
            [jobs[i].session.cache for i in rows], feeds,
            exact=[not jobs[i].sampling.greedy for i in rows], last_only=True)  # [R, V]
        for i, fed in zip(rows, feeds, strict=True):
            jobs[i].session.tokens.extend(fed)
        _pick(jobs, rows, logits, ks, drafts, qs)
        rows = [i for i in rows if len(drafts[i]) < ks[i]]
        feeds = [[drafts[i][-1]] for i in rows]
    return [(drafts[i], torch.stack(qs[i]) if qs[i] else None, records[i])
            for i in range(len(jobs))]


def guess_batch(lean: LeanLlama, jobs: Sequence[DraftJob], m: int) -> list[list[int]]:
    """Each job's next token after its committed tokens, in one batched forward (the
    repair fed as ``propose_batch`` feeds it): a greedy row's ``m`` likeliest, its argmax
    first; a sampled row's own draw (its seed, at its position), alone."""
    records = [job.session.repair(job.committed) for job in jobs]
    feeds = [list(job.committed[rec.kept:]) for job, rec in zip(jobs, records, strict=True)]
    logits = lean.forward_batch([job.session.cache for job in jobs], feeds,
                                exact=[not job.sampling.greedy for job in jobs],
                                last_only=True)  # [R, V]
    drafts: list[list[int]] = [[] for _ in jobs]
    rows = list(range(len(jobs)))
    for job, fed in zip(jobs, feeds, strict=True):
        job.session.tokens.extend(fed)
    _pick(jobs, rows, logits, [1] * len(jobs), drafts, [[] for _ in jobs])
    for r, job in enumerate(jobs):
        if job.sampling.greedy and m > 1:
            top = logits[r].topk(min(m, logits.shape[-1])).indices.tolist()
            drafts[r] += [int(t) for t in top if t != drafts[r][0]][: m - 1]
    return drafts


def _runners_up(jobs: Sequence[DraftJob], rows: list[int], greedy: list[int],
                logits: torch.Tensor, best: torch.Tensor) -> None:
    """Append each greedy row's runner-up (its likeliest token but the argmax ``best``) to
    its job's ``runners_up``, for the rows that ask for them."""
    want = [(n, r) for n, r in enumerate(greedy) if jobs[rows[r]].runners_up is not None]
    if not want:
        return
    picked = logits[[r for _, r in want]].clone()
    picked[torch.arange(len(want)), best[[n for n, _ in want]]] = float("-inf")
    for (_, r), t in zip(want, picked.argmax(-1).tolist(), strict=True):
        jobs[rows[r]].runners_up.append(int(t))  # type: ignore[union-attr]


def _pick(jobs: Sequence[DraftJob], rows: list[int], logits: torch.Tensor, ks: list[int],
          drafts: list[list[int]], qs: list[list[torch.Tensor]]) -> None:
    """Each row's next draft: greedy rows by one argmax, sampled rows each with its own
    settings and its counter-based draw at position ``committed_len + j``."""
    want = [r for r, i in enumerate(rows) if len(drafts[i]) < ks[i]]
    greedy = [r for r in want if jobs[rows[r]].sampling.greedy]
    if greedy:
        best = logits[greedy].argmax(-1)
        for r, d in zip(greedy, best.tolist(), strict=True):
            drafts[rows[r]].append(int(d))
        _runners_up(jobs, rows, greedy, logits, best)
    for r in want:
        i = rows[r]
        job = jobs[i]
        if job.sampling.greedy:
            continue
        q = probs_from_logits(logits[r : r + 1], *_sampling_tensors(job.sampling))  # [1, V]
        position = np.array([len(job.committed) + len(drafts[i])])
        seeds = np.array([job.seed], dtype=np.uint64)
        drafts[i].append(int(sample_tokens(q, seeds, rng.DRAFT, position)[0]))
        qs[i].append(q[0])

"""Per-sequence drafter and target state: a KV cache plus the tokens it holds.

Both repair themselves by content: each call passes the committed tokens, the session keeps
the longest agreeing prefix of its cache (``repair_plan``) and feeds the rest. So a normal
round feeds 1-2 tokens, and a retry, an eviction or a fresh replica converges the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.core import rng
from specserve.core.commit import repair_plan
from specserve.core.ngram import propose_ngram
from specserve.core.sampling import SamplingParams, probs_from_logits, sample_tokens
from specserve.engine.lean import LeanLlama


@dataclass
class RepairRecord:
    """What one call's cache repair did (traced and counted)."""

    cached_before: int  # entries the cache held
    kept: int  # entries kept
    fed: int  # tokens fed before the new work (1 normally; more after a miss)

    @property
    def rolled_back(self) -> int:
        return self.cached_before - self.kept

    @property
    def reprefilled(self) -> int:
        """Committed tokens fed again beyond the normal 1-2 of a round."""
        return max(0, self.fed - 2)

    @property
    def miss(self) -> bool:
        return self.kept == 0 and self.fed > 2


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


class NgramSession:
    """Prompt lookup; q is one-hot (the verifier builds it), no cache."""

    nbytes = 0

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, committed: Sequence[int], k: int, sampling: SamplingParams, seed: int):
        drafts = propose_ngram(committed, k, self.max_n, self.min_n)
        return drafts, None, RepairRecord(0, 0, 0)


class TargetSession:
    """The target's per-sequence Hugging Face ``DynamicCache``; repair = ``crop``."""

    def __init__(self, model: torch.nn.Module):
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.tokens: list[int] = []

    def _crop(self, keep: int) -> None:
        from transformers import DynamicCache

        held = self.cache.get_seq_length()
        if keep == 0 and held:
            self.cache = DynamicCache(config=self.model.config)
        elif keep < held:
            self.cache.crop(keep - held)  # transformers 5: a negative count to remove

    @property
    def nbytes(self) -> int:
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
        return per_token * len(self.tokens)

    @torch.inference_mode()
    def logits_for_block(
        self, committed: Sequence[int], drafts: Sequence[int]
    ) -> tuple[torch.Tensor, RepairRecord]:
        """Target logits [k+1, V] at the positions after the last committed token and after
        each draft, in one forward pass."""
        plan = repair_plan(self.tokens, committed)
        record = RepairRecord(len(self.tokens), plan.keep, len(committed) - plan.keep)
        self._crop(plan.keep)
        feed = [*committed[plan.keep :], *drafts]
        out = self.model(
            input_ids=torch.tensor([feed]), past_key_values=self.cache, use_cache=True,
            logits_to_keep=len(drafts) + 1,
        )
        self.tokens = [*committed, *drafts]
        return out.logits[0].float(), record

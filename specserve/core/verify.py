"""Batched verification of draft blocks: greedy match and exact rejection sampling.

Vocabulary (vLLM's): the tokens a round commits are the *accepted* drafts plus one more,
the *recovered* token (sampled from norm(max(0, p - q)) at the first rejection) or the
*bonus* token (sampled from p after the last draft when all drafts pass). p is the target's
distribution, q the drafter's, both after the same sampling transforms.

Rows of one batch may have different numbers of drafts (k, padded to K) and different
sampling settings; greedy rows (temperature 0) accept while the draft equals the target's
argmax. For a proof that the output is distributed as p, see ``docs/algorithm.md`` and the
exact-enumeration tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specserve.core import rng
from specserve.core.sampling import probs_from_logits, sample_from_probs


def acceptance_prob(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)); a draft the drafter could not have sampled (q = 0) is accepted
    iff p(x) > 0 (the ratio is then infinite)."""
    ratio = torch.where(q_x > 0, p_x / q_x.clamp(min=1e-38), (p_x > 0).to(p_x.dtype) * 2.0)
    return ratio.clamp(max=1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) along the last axis; where p == q (no residual mass, so a
    rejection had probability 0) it falls back to p."""
    r = (p - q).clamp(min=0.0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp(min=1e-38), p)


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [B] int64, accepted drafts per row (0..k)
    extra_token: torch.Tensor  # [B] int64, the recovered (n < k) or bonus (n == k) token
    bonus: torch.Tensor  # [B] bool, True if the extra token is a bonus token


def one_hot_q(draft_tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q for a model-free proposer (n-gram): the draft is certain."""
    # draft_tokens: [B, K] -> [B, K, V]
    return torch.nn.functional.one_hot(draft_tokens.clamp(min=0), vocab_size).float()


def verify_batch(
    target_logits: torch.Tensor,  # [B, K+1, V] target logits at the k+1 positions of each row
    draft_tokens: torch.Tensor,  # [B, K] int64, padded past k with any value
    draft_probs: torch.Tensor | None,  # [B, K, V] q; None when every row is greedy
    num_drafts: torch.Tensor,  # [B] int64, k per row (0..K)
    temperature: torch.Tensor,  # [B] float, 0 = greedy
    top_k: torch.Tensor,  # [B] int, 0 = off
    top_p: torch.Tensor,  # [B] float, 1 = off
    seeds: np.ndarray,  # [B] uint64 per-request seeds
    positions: np.ndarray,  # [B] int, absolute position of each row's first draft
) -> VerifyResult:
    b, kp1, v = target_logits.shape
    k_max = kp1 - 1
    greedy = temperature <= 0  # [B]
    slot = torch.arange(k_max)[None, :]  # [1, K]
    in_block = slot < num_drafts[:, None]  # [B, K]

    rows = torch.arange(b)
    target_argmax = target_logits.argmax(-1)  # [B, K+1]
    accept = draft_tokens == target_argmax[:, :k_max]  # greedy rule, [B, K]
    if bool(greedy.all()):  # no probabilities needed
        accept = accept & in_block
        num_accepted = accept.long().cumprod(dim=1).sum(dim=1) if k_max else num_drafts * 0
        return VerifyResult(num_accepted, target_argmax[rows, num_accepted],
                            num_accepted == num_drafts)

    # p for every row and position, after the row's transforms.
    flat = target_logits.reshape(b * kp1, v)
    p = probs_from_logits(
        flat,
        temperature.repeat_interleave(kp1),
        top_k.repeat_interleave(kp1),
        top_p.repeat_interleave(kp1),
    ).reshape(b, kp1, v)  # [B, K+1, V]

    # Accept / reject each draft slot.
    if k_max:
        if draft_probs is None:
            raise ValueError("draft_probs (q) is required when a row samples")
        tok = draft_tokens.clamp(min=0)[..., None]  # [B, K, 1]
        p_x = p[:, :k_max].gather(2, tok).squeeze(2)  # [B, K]
        q_x = draft_probs.gather(2, tok).squeeze(2).float()  # [B, K]
        pos = positions[:, None].astype(np.int64) + np.arange(k_max)[None, :]  # [B, K]
        u = rng.uniforms(seeds[:, None], rng.ACCEPT, pos)  # [B, K] float64
        sampled_accept = u < acceptance_prob(p_x.double(), q_x.double())
        accept = torch.where(greedy[:, None], accept, sampled_accept)
    accept = accept & in_block
    # number of leading accepted slots
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1) if k_max else num_drafts * 0  # [B]

    # The extra token's distribution: residual at the first rejection, p after the block.
    bonus = num_accepted == num_drafts  # [B]
    p_at = p[rows, num_accepted]  # [B, V]
    dist = p_at
    if k_max and draft_probs is not None:
        q_at = draft_probs[rows, num_accepted.clamp(max=k_max - 1)].float()  # [B, V]
        dist = torch.where(bonus[:, None], p_at, residual_distribution(p_at, q_at))
    u_extra = rng.uniforms(seeds, rng.SAMPLE, positions.astype(np.int64) + num_accepted.numpy())
    sampled = sample_from_probs(dist, u_extra)
    extra = torch.where(greedy, target_argmax[rows, num_accepted], sampled)
    return VerifyResult(num_accepted=num_accepted, extra_token=extra, bonus=bonus)

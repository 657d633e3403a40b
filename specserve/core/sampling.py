"""Sampling transforms and sampling, shared by drafter and target.

``probs_from_logits`` returns *exactly* the distribution a token is sampled from, after
temperature, top-k and top-p (applied in that order, like Hugging Face ``generate``). The
drafter samples from it and reports it as q; the target computes p with the same function,
so the acceptance rule compares like with like (DESIGN §2).

Temperature 0 means greedy: the distribution is one-hot on the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MAX_TOP_K = 1 << 20


class SamplingError(ValueError):
    """A sampling parameter is out of range; the message names the parameter."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. ``seed`` None means the caller draws one at random."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0  # 1.0 = disabled
    seed: int | None = None

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise SamplingError(f"top_k must be in [0, {MAX_TOP_K}] (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise SamplingError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs_from_logits(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # [N] float, 0 = greedy
    top_k: torch.Tensor,  # [N] int, 0 = off
    top_p: torch.Tensor,  # [N] float, 1 = off
) -> torch.Tensor:  # [N, V] float32, rows sum to 1
    """The exact distribution each row samples from. Rows may have different settings."""
    logits = logits.float()
    v = logits.shape[-1]
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]

    # top-k: keep logits >= the k-th largest (ties at the boundary are kept).
    k = torch.where((top_k <= 0) | (top_k >= v), torch.full_like(top_k, v), top_k)
    if bool((k < v).any()):
        sorted_desc = scaled.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (k - 1).clamp(min=0).long()[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))

    probs = torch.softmax(scaled, dim=-1)

    # top-p: keep the smallest prefix (by descending prob) whose mass reaches top_p.
    if bool((top_p < 1.0).any()):
        sp, idx = probs.sort(dim=-1, descending=True)
        mass_before = sp.cumsum(-1) - sp
        # rows with top_p = 1 keep everything (float32 mass can round up to 1 early)
        drop_sorted = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)

    if bool(greedy.any()):
        onehot = torch.zeros_like(probs)
        onehot.scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def params_tensors(params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperature [N], top_k [N], top_p [N]) for a list of per-row settings."""
    return (
        torch.tensor([p.temperature for p in params], dtype=torch.float32),
        torch.tensor([p.top_k for p in params], dtype=torch.int64),
        torch.tensor([p.top_p for p in params], dtype=torch.float32),
    )


def sample_from_probs(
    probs: torch.Tensor,  # [N, V]
    u: torch.Tensor,  # [N] float64 uniforms in [0, 1)
) -> torch.Tensor:  # [N] int64
    """Inverse-CDF sampling. A token with probability 0 is never returned."""
    cdf = probs.double().cumsum(-1)  # [N, V]
    target = (u.double() * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp(max=probs.shape[-1] - 1)


def sample_tokens(
    probs: torch.Tensor,  # [N, V]
    seeds: np.ndarray,  # [N] per-request seeds
    stream: int,
    positions: np.ndarray,  # [N] absolute position of the token being sampled
) -> torch.Tensor:  # [N] int64
    """Sample each row with the request's counter-based uniform for (stream, position)."""
    from specserve.core import rng

    return sample_from_probs(probs, rng.uniforms(seeds, stream, positions))

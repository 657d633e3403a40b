"""The target's log-probabilities of committed tokens, from the verify logits (no extra
forward).

Which distribution: temperature > 0 gives log p after the request's temperature, top-k and
top-p, i.e. the log of exactly the distribution speculative decoding samples from (tokens
removed by top-k / top-p get -inf). Temperature 0 (greedy) would make that distribution
one-hot, which says nothing, so greedy rows get the model's own log-softmax (temperature 1,
no top-k / top-p), as vLLM and the OpenAI API report for greedy requests.
"""

from __future__ import annotations

import torch

from specserve.core.sampling import probs_from_logits


def logprobs_from_logits(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # [N] float, 0 = greedy
    top_k: torch.Tensor,  # [N] int, 0 = off
    top_p: torch.Tensor,  # [N] float, 1 = off
) -> torch.Tensor:  # [N, V] float32 log-probabilities (-inf where removed)
    logits = logits.float()
    greedy = temperature <= 0
    if bool(greedy.all()):
        return torch.log_softmax(logits, dim=-1)
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / t[:, None]
    filtered = ~greedy & ((top_k > 0) | (top_p < 1.0))
    if bool(filtered.any()):  # the sampled distribution's support under top-k / top-p
        p = probs_from_logits(logits, torch.where(greedy, 1.0, temperature),
                              torch.where(filtered, top_k, 0),
                              torch.where(filtered, top_p, 1.0))
        scaled = scaled.masked_fill(filtered[:, None] & (p <= 0), float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def top_logprobs(
    logp: torch.Tensor,  # [N, V]
    tokens: torch.Tensor,  # [N] int64, the committed token of each row
    n: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp[token] [N], top-n token ids [N, n], their logprobs [N, n]), most likely first."""
    chosen = logp.gather(1, tokens[:, None].long())[:, 0]
    top = logp.topk(n, dim=-1) if n > 0 else None
    if top is None:
        empty = torch.zeros((logp.shape[0], 0))
        return chosen, empty.long(), empty
    return chosen, top.indices, top.values

"""Sampling transforms, commit decision, repair plans, n-gram proposer, stats."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specserve.core import rng
from specserve.core.commit import decide_commit, repair_plan, truncate_at_stop
from specserve.core.ngram import NgramIndex, propose_ngram
from specserve.core.sampling import SamplingError, SamplingParams, probs_from_logits
from specserve.core.stats import AcceptanceStats


def _p(logits, t=1.0, k=0, p=1.0):
    x = torch.tensor([logits], dtype=torch.float32)
    return probs_from_logits(x, torch.tensor([t]), torch.tensor([k]), torch.tensor([p]))[0]


def test_transforms():
    logits = [3.0, 2.0, 1.0, 0.0]
    full = torch.softmax(torch.tensor(logits), -1)
    assert torch.allclose(_p(logits), full)
    assert torch.allclose(_p(logits, t=2.0), torch.softmax(torch.tensor(logits) / 2, -1))
    top2 = _p(logits, k=2)
    assert top2[2:].sum() == 0 and torch.isclose(top2.sum(), torch.tensor(1.0))
    assert torch.allclose(top2[:2], full[:2] / full[:2].sum())
    # top-p keeps the smallest prefix reaching the mass: 0.643 < 0.7 -> two tokens
    nuc = _p(logits, p=0.7)
    assert (nuc > 0).sum() == 2
    assert (_p(logits, p=1e-6) > 0).sum() == 1
    assert _p(logits, t=0.0).tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.01}, {"top_k": -2},
               {"seed": -1}, {"temperature": float("nan")}])
def test_sampling_params_validation(kwargs):
    with pytest.raises(SamplingError):
        SamplingParams(**kwargs)


def test_commit_decision():
    d = decide_commit(10, [5, 6, 7], 1, 9)
    assert d.tokens == (5, 9) and not d.bonus and d.rolled_back == 2 and d.committed_len == 12
    d = decide_commit(10, [5, 6], 2, 8)
    assert d.tokens == (5, 6, 8) and d.bonus and d.rolled_back == 0
    d = decide_commit(10, [], 0, 4)
    assert d.tokens == (4,) and d.bonus
    with pytest.raises(ValueError):
        decide_commit(10, [1], 2, 3)


def test_truncate_at_stop():
    assert truncate_at_stop([1, 2, 3], 10, eos_token_id=2) == ((1, 2), "stop")
    assert truncate_at_stop([1, 2, 3], 2, eos_token_id=None) == ((1, 2), "length")
    assert truncate_at_stop([1, 2], 5, eos_token_id=9) == ((1, 2), None)


def test_repair_plan():
    assert repair_plan([1, 2, 3, 9, 9], [1, 2, 3, 4]).keep == 3  # rolled back 2
    assert repair_plan([1, 2, 3], [1, 2, 3, 4, 5]).keep == 3  # feed 4, 5
    assert repair_plan([], [1, 2, 3]).keep == 0  # miss: full prefill
    assert repair_plan([1, 2, 3], [1, 2, 3]).keep == 2  # last token is always fed
    assert repair_plan([7, 2], [1, 2, 3]).keep == 0  # diverged cache is dropped
    with pytest.raises(ValueError):
        repair_plan([1], [])


def test_ngram():
    toks = [1, 2, 3, 4, 9, 1, 2, 3]
    assert propose_ngram(toks, 3) == [4, 9, 1]
    assert propose_ngram(toks, 0) == []
    assert propose_ngram([1, 2, 3], 2) == []  # nothing repeats
    # the most recent occurrence wins; shorter n-grams are the fallback
    assert propose_ngram([5, 1, 7, 5, 1, 8, 0, 1], 1) == [8]
    with pytest.raises(ValueError):
        propose_ngram(toks, 2, max_n=1, min_n=2)


def _lookup_by_definition(tokens, k, max_n, min_n):
    """The latest earlier occurrence of the longest suffix (max_n .. min_n tokens) that has
    one, and the k tokens after it."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - 1 - n, -1, -1):
            if tokens[start:start + n] == tokens[len(tokens) - n:]:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_index_searches_a_growing_context_as_a_fresh_search_would():
    """One index across calls (as a request's policy and a drafter session keep it) finds
    what the definition finds, whether the context grew, was rolled back or replaced."""
    rng = random.Random(7)
    for _ in range(400):
        vocab, max_n = rng.choice([2, 3, 5, 20]), rng.randint(1, 5)
        min_n = rng.randint(1, max_n)
        index, tokens = NgramIndex(max_n, min_n), []
        for _ in range(30):
            u = rng.random()
            if u < 0.1 and tokens:  # rolled back
                tokens = tokens[: rng.randrange(len(tokens))]
            elif u < 0.15:  # another sequence
                tokens = [rng.randrange(vocab) for _ in range(rng.randrange(10))]
            else:
                tokens = tokens + [rng.randrange(vocab) for _ in range(rng.randrange(4))]
            k = rng.randrange(6)
            want = _lookup_by_definition(tokens, k, max_n, min_n)
            assert index.propose(tokens, k) == want == propose_ngram(tokens, k, max_n, min_n)


def test_stats():
    s = AcceptanceStats()
    s.observe(4, 4, 5, True)
    s.observe(4, 1, 2, False)
    s.observe(0, 0, 1, True)
    assert s.rounds == 3 and s.drafts == 2 and s.draft_tokens == 8 and s.accepted_tokens == 5
    assert s.acceptance_rate == 5 / 8
    assert s.mean_acceptance_length == 1 + 5 / 2
    assert s.accepted_per_position == [2, 1, 1, 1]
    assert s.per_position_rate() == [1.0, 0.5, 0.5, 0.5]
    t = AcceptanceStats()
    t.merge(s)
    t.merge(s)
    assert t.accepted_per_position == [4, 2, 2, 2] and t.emitted_tokens == 16
    with pytest.raises(ValueError):
        s.observe(2, 3, 1, False)


def test_rng_is_counter_based_and_uniform():
    a = rng.uniforms(np.uint64(7), rng.ACCEPT, np.arange(100_000))
    b = rng.uniforms(np.uint64(7), rng.ACCEPT, np.arange(100_000))
    c = rng.uniforms(np.uint64(7), rng.DRAFT, np.arange(100_000))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.min() >= 0 and a.max() < 1
    from scipy import stats

    assert stats.kstest(a.numpy(), "uniform").pvalue > 1e-3
    assert abs(np.corrcoef(a.numpy(), c.numpy())[0, 1]) < 0.02

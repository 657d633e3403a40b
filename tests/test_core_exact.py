"""Exactness of the acceptance rule: exact enumeration, statistics, and hand-built cases."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy import stats as sps

from specserve.core import rng
from specserve.core.sampling import probs_from_logits, sample_tokens
from specserve.core.verify import acceptance_prob, residual_distribution, verify_batch

TRANSFORMS = [
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.3, 3, 1.0),
    (1.0, 0, 0.8),
    (0.9, 4, 0.7),
]


def _probs(logits: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    n = logits.shape[0]
    return probs_from_logits(
        logits, torch.full((n,), t), torch.full((n,), k, dtype=torch.int64), torch.full((n,), p)
    )


def _output_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(committed token = x) for one draft slot, from the algorithm's own terms:
    sum_d q(d) [accept(d) 1{x=d}] + (1 - sum_d q(d) accept(d)) residual(x)."""
    acc = acceptance_prob(p, q)
    return q * acc + (1 - (q * acc).sum(-1, keepdim=True)) * residual_distribution(p, q)


@pytest.mark.parametrize(("t", "k", "top_p"), TRANSFORMS)
def test_exact_enumeration_single_slot(t, k, top_p):
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        v = int(torch.randint(2, 9, (1,), generator=g))
        lt = torch.randn(1, v, generator=g) * 2
        ld = torch.randn(1, v, generator=g) * 2
        lt[0, torch.rand(v, generator=g) < 0.25] = float("-inf")  # zeros in p
        ld[0, torch.rand(v, generator=g) < 0.25] = float("-inf")  # zeros in q
        if torch.isinf(lt).all():
            lt[0, 0] = 0.0
        if torch.isinf(ld).all():
            ld[0, -1] = 0.0
        p, q = _probs(lt, t, k, top_p)[0].double(), _probs(ld, t, k, top_p)[0].double()
        out = _output_distribution(p, q)
        assert torch.allclose(out, p, atol=1e-6), (p, q, out)


def test_exact_enumeration_identities():
    p = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    # p == q: everything accepted, residual never used
    assert torch.allclose(_output_distribution(p, p.clone()), p)
    assert torch.allclose(acceptance_prob(p, p), torch.tensor([1.0, 1.0, 0.0, 0.0]).double())
    # disjoint supports: everything rejected, residual = p
    q = torch.tensor([0.0, 0.0, 0.3, 0.7], dtype=torch.float64)
    assert torch.allclose(acceptance_prob(p, q)[2:], torch.zeros(2, dtype=torch.float64))
    assert torch.allclose(_output_distribution(p, q), p)
    # q(x) = 0 where p(x) > 0: a draft q could not produce is still accepted, never rejected
    assert acceptance_prob(torch.tensor([0.3]), torch.tensor([0.0])).item() == 1.0
    assert acceptance_prob(torch.tensor([0.0]), torch.tensor([0.0])).item() == 0.0


def test_exact_enumeration_two_slots_joint():
    """Two draft slots of a Markov toy model: the joint of the first two committed tokens
    equals p(x1) p(x2 | x1), enumerating every draft path and every accept/reject branch."""
    g = torch.Generator().manual_seed(1)
    v = 4
    wt, wd = torch.randn(v + 1, v, generator=g), torch.randn(v + 1, v, generator=g)
    wd[:, 0] = float("-inf")  # the drafter never proposes token 0
    pt = torch.softmax(wt.double(), -1)  # p(. | prev)
    qd = torch.softmax(wd.double(), -1)
    start = v  # start-of-sequence row
    joint = torch.zeros(v, v, dtype=torch.float64)
    for d1, d2 in itertools.product(range(v), range(v)):
        path = qd[start, d1] * qd[d1, d2]
        if path == 0:
            continue
        a1 = acceptance_prob(pt[start, d1], qd[start, d1])
        # slot 1 rejected: x1 from the residual; x2 then comes from a fresh round, which is
        # exact by the single-slot identity, so its law is p(. | x1).
        r1 = residual_distribution(pt[start], qd[start])
        for x1 in range(v):
            joint[x1] += path * (1 - a1) * r1[x1] * pt[x1]
        # slot 1 accepted (x1 = d1); slot 2 decides x2.
        a2 = acceptance_prob(pt[d1, d2], qd[d1, d2])
        joint[d1, d2] += path * a1 * a2
        joint[d1] += path * a1 * (1 - a2) * residual_distribution(pt[d1], qd[d1])
    expected = pt[start][:, None] * pt[:v]
    assert torch.allclose(joint, expected, atol=1e-9)


# ---------------------------------------------------------------------------- statistics

V = 6
N = 200_000


def _toy(seed: int):
    g = torch.Generator().manual_seed(seed)
    wt = torch.randn(V + 1, V, generator=g) * 1.5
    wd = wt + torch.randn(V + 1, V, generator=g)  # a drafter that roughly agrees
    wt[:, 2] -= 3.0
    return wt, wd


def _simulate(wt, wd, transform, k: int, seeds: np.ndarray, always_accept: bool = False):
    """Generate 2 tokens for every row with the real verify_batch, K drafts per round."""
    t, top_k, top_p = transform
    n = len(seeds)
    last = torch.full((n,), V, dtype=torch.int64)  # start token
    pos = np.zeros(n, dtype=np.int64)
    out = [[] for _ in range(n)]
    active = np.arange(n)
    while active.size:
        b = active.size
        temps = torch.full((b,), t)
        tks = torch.full((b,), top_k, dtype=torch.int64)
        tps = torch.full((b,), top_p)
        drafts, qs, prev = [], [], last[active]
        for j in range(k):
            q = probs_from_logits(wd[prev], temps, tks, tps)
            d = sample_tokens(q, seeds[active], rng.DRAFT, pos[active] + j)
            drafts.append(d)
            qs.append(q)
            prev = d
        inputs = torch.stack([last[active], *drafts], 1)  # [b, k+1]
        logits = wt[inputs]  # [b, k+1, V]
        res = verify_batch(
            logits,
            torch.stack(drafts, 1) if k else torch.zeros(b, 0, dtype=torch.int64),
            torch.stack(qs, 1) if k else None,
            torch.full((b,), k, dtype=torch.int64),
            temps, tks, tps, seeds[active], pos[active],
        )
        n_acc = torch.full((b,), k) if always_accept else res.num_accepted
        still = []
        for i, row in enumerate(active):
            toks = [int(drafts[j][i]) for j in range(int(n_acc[i]))] + [int(res.extra_token[i])]
            out[row].extend(toks)
            if len(out[row]) < 2:
                still.append(i)
        still = np.asarray(still, dtype=np.int64)
        active_next = active[still]
        last[active_next] = torch.tensor([out[r][-1] for r in active_next], dtype=torch.int64)
        pos[active_next] += 1
        active = active_next
    return np.asarray([o[:2] for o in out])


def _chi2_pvalue(observed: np.ndarray, expected_p: np.ndarray) -> float:
    expected_p = expected_p / expected_p.sum()
    expected = expected_p * observed.sum()
    zero = expected_p == 0
    assert observed[zero].sum() == 0, "sampled a token with probability 0"
    return float(sps.chisquare(observed[~zero], expected[~zero]).pvalue)


@pytest.mark.parametrize("transform", [(1.0, 0, 1.0), (0.8, 4, 0.9)])
@pytest.mark.parametrize("k", [2, 3])
def test_statistical_equivalence(transform, k):
    wt, wd = _toy(7)
    seeds = np.arange(N, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(k)
    toks = _simulate(wt, wd, transform, k, seeds)
    t, top_k, top_p = transform
    p1 = probs_from_logits(wt[V : V + 1], torch.tensor([t]), torch.tensor([top_k]),
                           torch.tensor([top_p]))[0].double().numpy()
    p2 = probs_from_logits(wt[:V], torch.full((V,), t), torch.full((V,), top_k),
                           torch.full((V,), top_p)).double().numpy()  # [x1, x2]
    first = np.bincount(toks[:, 0], minlength=V)
    assert _chi2_pvalue(first, p1) > 1e-3
    joint = np.bincount(toks[:, 0] * V + toks[:, 1], minlength=V * V)
    assert _chi2_pvalue(joint, (p1[:, None] * p2).ravel()) > 1e-3
    # second position, marginally
    second = np.bincount(toks[:, 1], minlength=V)
    assert _chi2_pvalue(second, p1 @ p2) > 1e-3


def test_statistical_test_has_power():
    """The same test rejects a wrong sampler (one that accepts every draft, i.e. samples q)."""
    wt, wd = _toy(7)
    seeds = np.arange(N, dtype=np.uint64)
    toks = _simulate(wt, wd, (1.0, 0, 1.0), 2, seeds, always_accept=True)
    p1 = torch.softmax(wt[V], -1).double().numpy()
    assert _chi2_pvalue(np.bincount(toks[:, 0], minlength=V), p1) < 1e-6


def test_seeded_determinism():
    wt, wd = _toy(3)
    seeds = np.arange(2000, dtype=np.uint64)
    a = _simulate(wt, wd, (1.0, 0, 1.0), 3, seeds)
    b = _simulate(wt, wd, (1.0, 0, 1.0), 3, seeds)
    c = _simulate(wt, wd, (1.0, 0, 1.0), 3, seeds + np.uint64(10_000))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    # a row's result does not depend on the rest of the batch
    single = _simulate(wt, wd, (1.0, 0, 1.0), 3, seeds[17:18])
    assert np.array_equal(single[0], a[17])


# ---------------------------------------------------------------------------- by construction


def _logits_favoring(tokens: list[int], v: int = 8) -> torch.Tensor:
    out = torch.full((len(tokens), v), -10.0)
    for i, t in enumerate(tokens):
        out[i, t] = 10.0
    return out


def _run(logits, drafts, q=None, temp=0.0, k=None):
    b = 1
    kk = len(drafts)
    return verify_batch(
        logits[None], torch.tensor([drafts], dtype=torch.int64).reshape(1, kk),
        q, torch.tensor([kk if k is None else k]), torch.tensor([temp]),
        torch.tensor([0]), torch.tensor([1.0]), np.array([5], dtype=np.uint64),
        np.zeros(b, dtype=np.int64),
    )


def test_greedy_accept_accept_reject():
    res = _run(_logits_favoring([3, 4, 6, 1]), [3, 4, 5])
    assert res.num_accepted.tolist() == [2]
    assert res.extra_token.tolist() == [6]  # recovered = target argmax
    assert res.bonus.tolist() == [False]


def test_greedy_all_accepted_gives_bonus():
    res = _run(_logits_favoring([3, 4, 5, 1]), [3, 4, 5])
    assert (res.num_accepted.item(), res.extra_token.item(), res.bonus.item()) == (3, 1, True)


def test_k_zero_is_plain_decoding():
    res = _run(_logits_favoring([7]), [])
    assert (res.num_accepted.item(), res.extra_token.item(), res.bonus.item()) == (0, 7, True)


def test_sampled_forced_accept_accept_reject():
    """Hugging Face's construction: p certain where drafts agree, p(x)=0 on the third."""
    v = 8
    logits = torch.full((4, v), float("-inf"))
    logits[0, 3] = logits[1, 4] = logits[2, 6] = logits[3, 1] = 0.0
    q = torch.nn.functional.one_hot(torch.tensor([3, 4, 5]), v).float()[None]
    res = _run(logits, [3, 4, 5], q=q, temp=1.0)
    assert (res.num_accepted.item(), res.extra_token.item(), res.bonus.item()) == (2, 6, False)


def test_mixed_batch_rows_are_independent():
    """Different k, greedy and sampled rows together: each row equals its solo run."""
    v = 8
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 4, v, generator=g) * 3
    drafts = torch.randint(0, v, (3, 3), generator=g)
    q = torch.softmax(torch.randn(3, 3, v, generator=g), -1)
    ks = torch.tensor([3, 1, 0])
    temps = torch.tensor([0.0, 1.0, 0.7])
    seeds = np.array([11, 12, 13], dtype=np.uint64)
    pos = np.array([5, 9, 2])
    args = (torch.tensor([0, 0, 0]), torch.tensor([1.0, 1.0, 1.0]))
    batch = verify_batch(logits, drafts, q, ks, temps, *args, seeds, pos)
    for i in range(3):
        ki = int(ks[i])
        solo = verify_batch(
            logits[i : i + 1, : ki + 1], drafts[i : i + 1, :ki], q[i : i + 1, :ki], ks[i : i + 1],
            temps[i : i + 1], args[0][:1], args[1][:1], seeds[i : i + 1], pos[i : i + 1],
        )
        assert solo.num_accepted.item() == batch.num_accepted[i].item()
        assert solo.extra_token.item() == batch.extra_token[i].item()

"""Multi-session engines of the drafter and target services, on the committed built-in pair.

Driven in lock-step (``specserve.engine.lockstep``: the one round per request, every live
request's call in one engine call; no Ray, no gRPC, no mocks).
"""

from __future__ import annotations

import pytest
import torch

from specserve.api import GenerationRequest
from specserve.core.sampling import SamplingParams
from specserve.engine.drafter import DrafterEngine, ProposeItem
from specserve.engine.lockstep import Lockstep, run_lockstep
from specserve.engine.target import TargetEngine, VerifyItem
from specserve.service.wire import verify_outcome_from_proto, verify_outcome_to_proto

MAX_NEW = 24
N_PROMPTS = 8


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The models are tiny: one intra-op thread is as fast, and it avoids the large stalls
    of oversubscribed OpenMP threads when other jobs share the CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prompts(generator, heldout) -> list[list[int]]:
    ids = [generator.encode(GenerationRequest(prompt=p)) for p in heldout[:N_PROMPTS]]
    assert len({len(i) for i in ids}) > 1  # rows of different cache lengths
    return ids


@pytest.fixture(scope="module")
def references(generator, prompts) -> list[list[int]]:
    """Greedy output of the single-sequence engine (equal to HF greedy, see test_engine)."""
    return [generator.generate(GenerationRequest(prompt_ids=ids, max_tokens=MAX_NEW, k=4))[1]
            for ids in prompts]


def greedy_requests(prompts: list[list[int]]) -> list[GenerationRequest]:
    """draft / ngram and k 2 / 4 mixed across rows."""
    return [GenerationRequest(prompt_ids=ids, max_tokens=MAX_NEW, k=2 if j % 2 else 4,
                              spec="draft" if j % 4 < 2 else "ngram")
            for j, ids in enumerate(prompts)]


SAMPLED = [  # (mode, k, temperature, top_k, top_p, seed)
    ("draft", 4, 0.8, 50, 1.0, 11),
    ("ngram", 3, 1.0, 0, 1.0, 12),
    ("draft", 2, 0.7, 0, 0.9, 13),
    ("ngram", 4, 0.6, 20, 0.95, 14),
]


def sampled_requests(prompts: list[list[int]]) -> list[GenerationRequest]:
    return [GenerationRequest(prompt_ids=prompts[j], max_tokens=MAX_NEW, k=k, spec=mode,
                              temperature=t, top_k=tk, top_p=tp, seed=seed)
            for j, (mode, k, t, tk, tp, seed) in enumerate(SAMPLED)]


def engines(builtin_pair, generator, target_budget: int = 512 << 20,
            drafter_budget: int = 256 << 20) -> tuple[DrafterEngine, TargetEngine]:
    return (DrafterEngine(generator.lean, drafter_budget),
            TargetEngine(builtin_pair.target, target_budget))


@pytest.fixture(scope="module")
def sampled_alone(builtin_pair, generator, prompts) -> list[list[int]]:
    """Each sampled request run alone through fresh engines (batch of one)."""
    outs = []
    for req in sampled_requests(prompts):
        drafter, target = engines(builtin_pair, generator)
        res = run_lockstep(drafter, target, [req], builtin_pair.eos_token_id)
        assert target.max_batch_size_seen == 1
        outs.append(res[0].output)
    return outs


def test_greedy_mixed_batch_equals_single_sequence(builtin_pair, generator, prompts,
                                                   references):
    drafter, target = engines(builtin_pair, generator)
    res = run_lockstep(drafter, target, greedy_requests(prompts), builtin_pair.eos_token_id)
    assert [r.output for r in res] == references
    assert {r.spec for r in res} == {"draft", "ngram"}
    assert {r.k for r in res} == {2, 4}
    # all rows in one forward per round: batches really had several rows
    assert target.max_batch_size_seen == N_PROMPTS
    assert target.forward_batches == max(r.stats.acceptance.rounds for r in res)
    assert target.misses == 0 and drafter.misses == 0
    assert sum(r.stats.acceptance.accepted_tokens for r in res) > 0  # it did speculate
    assert target.stats()["sessions"] == 0  # finished requests were released


def test_sampled_rows_do_not_depend_on_batch(builtin_pair, generator, prompts, references,
                                             sampled_alone):
    mixed = sampled_requests(prompts) + greedy_requests(prompts)[len(SAMPLED):]
    drafter, target = engines(builtin_pair, generator)
    res = run_lockstep(drafter, target, mixed, builtin_pair.eos_token_id)
    assert target.max_batch_size_seen == N_PROMPTS
    assert [r.output for r in res[: len(SAMPLED)]] == sampled_alone
    assert [r.output for r in res[len(SAMPLED):]] == references[len(SAMPLED):]
    # the same seed through the single-process engine gives the same tokens too
    for req, alone in zip(sampled_requests(prompts), sampled_alone, strict=True):
        _, out, _ = generator.generate(req)
        assert out == alone
    assert len({tuple(o) for o in sampled_alone}) == len(SAMPLED)


def test_draft_ahead_changes_no_output(builtin_pair, generator, prompts, references,
                                      sampled_alone):
    """Draft-ahead on (the drafter prepares each row's next round while the target
    verifies): greedy rows still equal the single-sequence engine and seeded sampled rows
    give the same tokens as without it, while rounds were served from prepared blocks."""
    mixed = sampled_requests(prompts) + greedy_requests(prompts)[len(SAMPLED):]
    drafter = DrafterEngine(generator.lean, draft_ahead=True)
    target = TargetEngine(builtin_pair.target)
    res = run_lockstep(drafter, target, mixed, builtin_pair.eos_token_id)
    assert [r.output for r in res[: len(SAMPLED)]] == sampled_alone
    assert [r.output for r in res[len(SAMPLED):]] == references[len(SAMPLED):]
    st = drafter.stats()
    assert sum(r.stats.drafted_ahead for r in res) == st["ahead_hits"] > 0
    assert st["ahead_misses"] > 0 and st["ahead_drafted"] >= st["ahead_hits"]


def test_evictions_force_misses_and_outputs_are_unchanged(builtin_pair, generator, prompts,
                                                          references, sampled_alone):
    reqs = greedy_requests(prompts)[:4] + sampled_requests(prompts)[:2]
    # a budget below one session: after each call every session outside it is evicted
    drafter, target = engines(builtin_pair, generator, target_budget=1, drafter_budget=1)
    res = run_lockstep(drafter, target, reqs, builtin_pair.eos_token_id, max_batch=3)
    assert [r.output for r in res[:4]] == references[:4]
    assert [r.output for r in res[4:]] == sampled_alone[:2]
    assert all(r.repairs["target"].misses > 0 for r in res if r.stats.acceptance.rounds > 1)
    assert sum(r.repairs["drafter"].misses for r in res) > 0
    assert target.stats()["evictions"] > 0 and target.stats()["misses"] > 0
    assert drafter.stats()["evictions"] > 0 and drafter.stats()["misses"] > 0
    assert target.max_batch_size_seen == 3


def test_restarted_engines_mid_request(builtin_pair, generator, prompts, references,
                                       sampled_alone):
    reqs = greedy_requests(prompts)[:4] + sampled_requests(prompts)[:2]
    fresh = engines(builtin_pair, generator)

    def restart(lockstep: Lockstep) -> None:  # fresh replicas after the third round
        if lockstep.rounds == 3 and lockstep.target is not fresh[1]:
            lockstep.drafter, lockstep.target = fresh

    res = run_lockstep(*engines(builtin_pair, generator), reqs, builtin_pair.eos_token_id,
                       before_flush=restart)
    assert [r.output for r in res[:4]] == references[:4]
    assert [r.output for r in res[4:]] == sampled_alone[:2]
    # one full resend each, then incremental again
    assert all(r.repairs["target"].misses == 1 for r in res)
    assert sum(r.repairs["drafter"].misses for r in res) >= 1
    assert fresh[1].stats()["misses"] == len(reqs)


def test_cache_miss_protocol_and_lru(builtin_pair, generator, prompts):
    ids = prompts[0]
    target = TargetEngine(builtin_pair.target, cache_budget_bytes=1)
    greedy = SamplingParams()

    def vitem(sid: str, start: int, committed: list[int]) -> VerifyItem:
        return VerifyItem(sid, len(committed), start, committed[start:], [], None, greedy)

    miss = target.verify([vitem("a", 5, ids)])[0]
    assert miss.cache_miss and miss.repair is None and target.forward_batches == 0
    full = target.verify([vitem("a", 0, ids), vitem("b", 0, ids[:7])])
    assert not any(o.cache_miss for o in full) and full[0].batch_size == 2
    assert full[0].repair.fed == len(ids)
    # two prefills: every position fed, beyond the one verified per row (spec=auto's clue)
    assert (full[0].batch_tokens, full[0].batch_fed) == (2, len(ids) + 7)
    wired = verify_outcome_from_proto(verify_outcome_to_proto(full[0], 1, "t", 1000))
    assert (wired.batch_tokens, wired.batch_fed) == (2, len(ids) + 7)
    # both sessions of the batch survive the tiny budget; the next call evicts them
    assert target.has_session("a") and target.has_session("b")
    committed = [*ids, full[0].extra_token]
    nxt = target.verify([vitem("a", len(ids), committed)])[0]
    assert not nxt.cache_miss and nxt.repair.fed == 1 and nxt.repair.kept == len(ids)
    assert nxt.batch_tokens == nxt.batch_fed == 1  # decoding: only its next token
    assert not target.has_session("b") and target.stats()["evictions"] == 1
    assert target.release("a") and not target.release("a")

    drafter = DrafterEngine(generator.lean)
    assert drafter.propose([ProposeItem("x", len(ids), 3, ids[3:], 4, "draft", greedy)])[
        0].cache_miss
    out = drafter.propose([ProposeItem("x", len(ids), 0, ids, 4, "draft", greedy)])[0]
    assert len(out.draft_tokens) == 4 and out.draft_probs is None and not out.cache_miss
    sampled = drafter.propose([ProposeItem("y", len(ids), 0, ids, 3, "draft",
                                           SamplingParams(0.9, 0, 1.0, 5))])[0]
    assert sampled.draft_probs is not None
    assert sampled.draft_probs.shape == (3, builtin_pair.vocab_size)
    assert torch.allclose(sampled.draft_probs.sum(-1), torch.ones(3))
    ng = drafter.propose([ProposeItem("z", 6, 0, [1, 2, 3, 1, 2, 3], 2, "ngram", greedy)])[0]
    assert ng.draft_tokens == [1, 2] and ng.draft_probs is None


def test_bad_windows_raise(builtin_pair, generator, prompts):
    ids = prompts[0]
    target = TargetEngine(builtin_pair.target)
    drafter = DrafterEngine(generator.lean)
    g = SamplingParams()
    with pytest.raises(ValueError, match="tokens_start=9 must be in"):
        target.verify([VerifyItem("a", 5, 9, [], [], None, g)])
    with pytest.raises(ValueError, match=r"len\(tokens\)=3 must equal committed_len"):
        target.verify([VerifyItem("a", 5, 1, ids[1:4], [], None, g)])
    with pytest.raises(ValueError, match="tokens_start=9 must be in"):
        drafter.propose([ProposeItem("a", 5, 9, [], 2, "draft", g)])
    with pytest.raises(ValueError, match=r"len\(tokens\)=3 must equal committed_len"):
        drafter.propose([ProposeItem("a", 5, 0, ids[:3], 2, "ngram", g)])
    with pytest.raises(ValueError, match="draft_probs has shape"):
        target.verify([VerifyItem("a", 2, 0, ids[:2], [1, 2], torch.zeros(1, 5), g)])
    with pytest.raises(ValueError, match=r"needs sampling\.seed"):
        target.verify([VerifyItem("a", 2, 0, ids[:2], [], None, SamplingParams(1.0))])
    with pytest.raises(ValueError, match="appears twice"):
        target.verify([VerifyItem("a", 2, 0, ids[:2], [], None, g)] * 2)
    assert target.stats()["sessions"] == 0 and drafter.stats()["sessions"] == 0

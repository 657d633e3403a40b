"""The drafter drafts for all its sessions at once: one batched forward per draft step, with
every row's drafts, q and repair exactly those it gets alone (issue 14, "the drafter too")."""

from __future__ import annotations

import asyncio

import pytest
import torch

from specserve.core.sampling import SamplingParams
from specserve.engine.drafter import DrafterEngine, ProposeItem
from specserve.engine.lean import LeanLlama

GREEDY = SamplingParams()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def lean(builtin_pair):
    return LeanLlama(builtin_pair.drafter)


@pytest.fixture(scope="module")
def prompts(builtin_pair, heldout):
    tok = builtin_pair.tokenizer
    return [tok(p, add_special_tokens=False)["input_ids"] for p in heldout[:8]]


def _cache(lean, tokens):
    cache = lean.new_cache()
    if tokens:
        lean.forward(cache, torch.tensor(tokens))
    return cache


@pytest.mark.parametrize("gather", [512, 0])
def test_forward_batch_matches_forward(lean, prompts, monkeypatch, gather):
    """Mixed cache lengths and fed tokens: a 40-token prefill beside 1-token rows (shared
    1-token rows attending together over their gathered caches, or each on its own)."""
    monkeypatch.setattr("specserve.engine.lean.GATHER_MAX_CONTEXT", gather)
    rows = [(prompts[0][:40], 0), (prompts[1][:13], 12), (prompts[2][:9], 8),
            (prompts[3][:30], 27), (prompts[4][:6], 5), (prompts[5][:20], 19)]
    refs = [lean.forward(_cache(lean, seq[:kept]), torch.tensor(seq[kept:]))
            for seq, kept in rows]
    for exact in ([False] * 6, [True] * 6, [True, False, False, True, True, False]):
        caches = [_cache(lean, seq[:kept]) for seq, kept in rows]
        out = lean.forward_batch(caches, [seq[kept:] for seq, kept in rows], exact)
        assert out.shape == (6, 40, lean.config.vocab_size)
        for r, ((seq, kept), ref) in enumerate(zip(rows, refs, strict=True)):
            t = len(seq) - kept
            assert caches[r].length == len(seq)
            assert torch.allclose(out[r, :t], ref, atol=1e-5)
            assert not out[r, t:].any()  # right padding
            if exact[r]:  # bitwise the single-sequence forward, whatever the batch
                assert torch.equal(out[r, :t], ref)
        # the caches hold what a single forward would have written: the next step agrees
        nxt = lean.forward_batch(caches, [[7]] * 6, exact, last_only=True)
        for r, (seq, kept) in enumerate(rows):
            cache = _cache(lean, seq[:kept])  # the same history, one sequence
            lean.forward(cache, torch.tensor(seq[kept:]))
            alone = lean.forward(cache, torch.tensor([7]))[0]
            assert torch.allclose(nxt[r], alone, atol=1e-5)
            assert not exact[r] or torch.equal(nxt[r], alone)


def test_forward_batch_refuses_overflow(lean):
    full = lean.new_cache()
    full.length = lean.max_len
    fine = lean.new_cache()
    with pytest.raises(ValueError, match="exceeds the context"):
        lean.forward_batch([fine, full], [[1], [2]])
    assert fine.length == 0  # nothing fed


def _sequential(lean, session, committed, k, sampling):
    """The one-at-a-time drafting loop (single-sequence ``forward`` per step), as
    ``DraftModelSession.propose`` drafted before the batched forward."""
    import numpy as np

    from specserve.core import rng
    from specserve.core.commit import repair_plan
    from specserve.core.sampling import params_tensors, probs_from_logits, sample_tokens

    keep = repair_plan(session.tokens, committed).keep
    session.cache.crop(keep)
    session.tokens = list(committed[:keep])
    if k == 0:
        return [], None
    logits = lean.forward(session.cache, torch.tensor(committed[keep:]))[-1:]
    session.tokens = list(committed)
    drafts, qs = [], []
    for j in range(k):
        if sampling.greedy:
            d = int(logits[0].argmax())
        else:
            q = probs_from_logits(logits, *params_tensors([sampling]))
            d = int(sample_tokens(q, np.array([sampling.seed], dtype=np.uint64), rng.DRAFT,
                                  np.array([len(committed) + j]))[0])
            qs.append(q[0])
        drafts.append(d)
        if j < k - 1:
            logits = lean.forward(session.cache, torch.tensor([d]))
            session.tokens.append(d)
    return drafts, torch.stack(qs) if qs else None


def test_batched_drafts_are_bitwise_the_sequential_ones(lean, prompts):
    """Three rounds of 6 sessions (greedy and sampled, k 0-5, repairs): the batched drafts
    and q equal, bitwise, those of the single-sequence loop."""
    from specserve.engine.sessions import DraftJob, DraftModelSession, propose_batch

    samplings = [GREEDY, SamplingParams(0.8, 0, 1.0, 1), SamplingParams(1.0, 30, 0.9, 2),
                 GREEDY, SamplingParams(0.7, 0, 0.95, 3), SamplingParams(1.1, 8, 1.0, 4)]
    committed = [prompts[i][: 3 + 7 * i] for i in range(6)]
    mine = [DraftModelSession(lean) for _ in committed]
    ref = [DraftModelSession(lean) for _ in committed]
    for rnd in range(3):
        ks = [(i + rnd) % 6 for i in range(6)]
        out = propose_batch(lean, [DraftJob(m, c, k, s, s.seed or 0) for m, c, k, s in
                                   zip(mine, committed, ks, samplings, strict=True)])
        for i, (drafts, q, _) in enumerate(out):
            want, want_q = _sequential(lean, ref[i], committed[i], ks[i], samplings[i])
            assert drafts == want
            assert (q is None and want_q is None) or torch.equal(q, want_q)
            assert mine[i].tokens == ref[i].tokens
            assert mine[i].cache.length == ref[i].cache.length
            other = (1 + (drafts[1:] or [0])[0]) % lean.config.vocab_size
            committed[i] = [*committed[i], *drafts[:1], other]


def _item(sid, committed, k, sampling=GREEDY, start=0, mode="draft"):
    return ProposeItem(sid, len(committed), start, list(committed[start:]), k, mode, sampling)


def _same(a, b):
    assert a.cache_miss == b.cache_miss
    assert a.draft_tokens == b.draft_tokens
    assert (a.draft_probs is None) == (b.draft_probs is None)
    if a.draft_probs is not None:
        assert torch.equal(a.draft_probs, b.draft_probs)
    assert a.repair == b.repair


def _alone(engines: dict, items):
    """Each item proposed on its own, in its session's own engine."""
    return [engines[it.session_id].propose([it])[0] for it in items]


def test_batched_propose_equals_alone(lean, prompts):
    samplings = {
        "g1": GREEDY, "g2": GREEDY, "g3": GREEDY,
        "s1": SamplingParams(0.8, 0, 1.0, 11), "s2": SamplingParams(1.0, 40, 0.9, 12),
        "s3": SamplingParams(0.6, 0, 0.95, 13), "s4": SamplingParams(1.2, 5, 1.0, 14),
        "n1": GREEDY,
    }
    ks = {"g1": 4, "g2": 1, "g3": 0, "s1": 4, "s2": 2, "s3": 5, "s4": 0, "n1": 3}
    committed = {sid: prompts[i][: 6 + 5 * i] for i, sid in enumerate(samplings)}
    batched = DrafterEngine(lean)
    alone = {sid: DrafterEngine(lean) for sid in [*samplings, "miss"]}
    calls = []
    forward = lean.forward_batch

    def counted(caches, tokens, *a, **kw):
        calls.append(len(caches))
        return forward(caches, tokens, *a, **kw)

    # round 1: fresh sessions, prefills of different lengths
    first = [_item(sid, committed[sid], ks[sid], samplings[sid],
                   mode="ngram" if sid == "n1" else "draft") for sid in samplings]
    lean.forward_batch = counted
    try:
        out = batched.propose(first)
    finally:
        del lean.forward_batch
    assert calls == [5, 4, 3, 3, 1]  # one forward per step; rows drop out when done
    for a, b in zip(out, _alone(alone, first), strict=True):
        _same(a, b)
    # round 2: some drafts accepted, then another token (a repair); a miss; k changed
    second = []
    for i, (sid, o) in enumerate(zip(samplings, out, strict=True)):
        n = min(i % 3, len(o.draft_tokens))
        other = (1 + (o.draft_tokens[n:] or [0])[0]) % lean.config.vocab_size
        nxt = [*committed[sid], *o.draft_tokens[:n], other]
        second.append(_item(sid, nxt, (ks[sid] + i) % 5, samplings[sid],
                            start=len(committed[sid]) - 2,
                            mode="ngram" if sid == "n1" else "draft"))
    second.append(_item("miss", prompts[7][:10], 3, start=4))
    out2 = batched.propose(second)
    for a, b in zip(out2, _alone(alone, second), strict=True):
        _same(a, b)
    assert out2[-1].cache_miss and not any(o.cache_miss for o in out2[:-1])
    rolled = [o.repair.rolled_back for o in out2[:-1] if o.repair is not None]
    assert max(rolled) > 0  # a divergent committed list was repaired in the batch
    assert batched.stats()["sessions"] == len(samplings) and batched.misses == 1


def test_batched_propose_keeps_the_byte_budget(lean, prompts):
    """Every session of the call survives it; the next call evicts the oldest."""
    engine = DrafterEngine(lean, cache_budget_bytes=1)
    out = engine.propose([_item(f"s{i}", prompts[i][:8], 2) for i in range(3)])
    assert all(len(o.draft_tokens) == 2 for o in out)
    assert all(engine.has_session(f"s{i}") for i in range(3))
    engine.propose([_item("t", prompts[3][:8], 1)])
    assert engine.stats()["sessions"] == 1 and engine.evictions == 3


def test_servicer_batches_and_answers_each_item(lean, prompts):
    """Concurrent proposals share engine calls; a bad item is answered alone; a session
    twice in the queue is served in order."""
    from drafter_service.server import DrafterServicer
    from specserve.proto_gen.specserve.v1 import internal_pb2 as pb
    from specserve.service.wire import propose_item_from_proto, propose_outcome_from_proto

    def msg(call_id, sid, ids, k, seed=0, temperature=0.0):
        return pb.ProposeRequest(
            call_id=call_id, session_id=sid, committed_len=len(ids), tokens_start=0,
            tokens=ids, k=k, mode="draft",
            sampling=pb.Sampling(temperature=temperature, top_p=1.0, seed=seed))

    msgs = [msg(i, f"s{i}", prompts[i][:10], 3, seed=i, temperature=0.7 * (i % 2))
            for i in range(6)]
    msgs.append(msg(6, "bad", [10**6], 2))  # outside the vocabulary
    msgs.append(msg(7, "s0", prompts[0][:12], 2))  # s0 again: after its first call

    async def run():
        servicer = DrafterServicer(DrafterEngine(lean), "d0", batch_wait_s=0.05)
        servicer.start()
        try:
            return servicer, await asyncio.gather(*(servicer._propose(m) for m in msgs))
        finally:
            servicer._batcher.cancel()
            servicer._reaper.cancel()

    servicer, replies = asyncio.run(run())
    assert [r.call_id for r in replies] == list(range(8))
    assert "outside the vocabulary" in replies[6].error
    assert not any(r.error for r in replies[:6] + replies[7:])
    assert servicer.rows == 7 and servicer.batches == 2  # 6 rows, then s0's second call
    ref = DrafterEngine(lean)
    for m, r in zip(msgs[:6] + msgs[7:], replies[:6] + replies[7:], strict=True):
        want = ref.propose([propose_item_from_proto(m)])[0]
        got = propose_outcome_from_proto(r)
        assert got.draft_tokens == want.draft_tokens
        assert got.repair == want.repair

"""Draft-ahead (issue 16): while the target verifies, the drafter prepares the next round for
"all k accepted, then the drafter's own next token" (with two guesses: its runner-up too, and
each rejection with the runner-up at the rejected draft). A call whose committed tokens are
one of those outcomes gets the prepared block; any other call is served as if nothing had
been drafted ahead. Either way every reply (drafts, q bitwise, repair of the cache) equals a
drafter without draft-ahead given the same calls: greedy and seeded sampled rows, hits and
misses (a rejection with another correction; all accepted but another extra token; k
changed; prompt lookup between)."""

from __future__ import annotations

import pytest
import torch

from specserve.core.sampling import SamplingParams
from specserve.engine.drafter import AHEAD_ROWS, DrafterEngine, ProposeItem


@pytest.fixture(scope="module")
def lean(generator):
    return generator.lean  # the built-in pair's lean drafter


@pytest.fixture(scope="module")
def prompts(builtin_pair, heldout):
    return [builtin_pair.tokenizer(p, add_special_tokens=False)["input_ids"][:40]
            for p in heldout[:3]]


# each round: (accepted drafts, the extra token: "guess" = the drafter's first guess, the one
# drafted ahead for; "guess2": its second (drafted ahead for with 2 guesses, a greedy row);
# "runner": after a rejection, the drafter's runner-up there (drafted ahead for with 2
# guesses, a greedy row); "other": none of them), k, mode
SCRIPT = [(4, "guess", 4, "draft"), (4, "guess2", 4, "draft"), (1, "other", 4, "draft"),
          (4, "other", 4, "draft"), (4, "guess", 4, "draft"), (0, "runner", 4, "draft"),
          (4, "guess2", 4, "draft"), (1, "runner", 2, "draft"), (2, "guess", 2, "draft"),
          (2, "guess", 2, "ngram"), (0, "other", 2, "draft"), (2, "guess2", 2, "draft")]


def _item(sid, committed, start, k, mode, sampling):
    return ProposeItem(sid, len(committed), start, committed[start:], k, mode, sampling)


def _extra(aheads, prefix: list[int], rejected: int | None, extra: str, vocab: int) -> int:
    """The token committed after ``prefix`` (committed + the accepted drafts), in place of
    the draft ``rejected`` (None: all accepted, the extra token)."""
    guesses = [a.committed[-1] for a in aheads if a.committed[:-1] == prefix]
    if extra in ("guess", "runner") and guesses:
        return guesses[0]
    if extra == "guess2" and len(guesses) > 1:
        return guesses[1]
    return next(t for t in range(vocab) if t not in guesses and t != rejected)


@pytest.mark.parametrize("guesses", [1, 2])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9,
                                                                        top_p=0.95, seed=7)])
def test_draft_ahead_replies_equal_drafting_on_request(lean, prompts, sampling, guesses):
    """Replies with draft-ahead on are those without it, hits (on any guess) and misses
    alike, and the cache a miss leaves is what drafting on request left."""
    on = DrafterEngine(lean, draft_ahead=True, guesses=guesses)
    off = DrafterEngine(lean)
    vocab = int(lean.config.vocab_size)
    committed = {f"s{i}": list(p) for i, p in enumerate(prompts)}
    sent = dict.fromkeys(committed, 0)
    hits = 0
    for accepted, extra, k, mode in SCRIPT:
        items = [_item(sid, c, sent[sid], k, mode, sampling) for sid, c in committed.items()]
        got, want = on.propose(items), off.propose(items)
        for g, w in zip(got, want, strict=True):
            assert g.draft_tokens == w.draft_tokens
            assert (g.draft_probs is None) == (w.draft_probs is None)
            if w.draft_probs is not None:
                assert torch.equal(g.draft_probs, w.draft_probs)  # bitwise
            hits += g.ahead
        assert on.draft_ahead() == (len(committed) if mode == "draft" else 0)
        for (sid, c), o in zip(committed.items(), want, strict=True):
            sent[sid] = len(c)
            aheads = on._sessions[sid].aheads
            branch = guesses > 1 and sampling.greedy  # rejections prepared too
            if mode == "draft":  # (after a lookup round the last ahead is still there)
                assert len(aheads) == (guesses + len(o.draft_tokens) if branch else 1)
                assert sum(a.outcome == "reject" for a in aheads) == branch * len(o.draft_tokens)
            drafts = o.draft_tokens[:accepted]
            whole = len(drafts) == len(o.draft_tokens)
            rejected = None if whole else o.draft_tokens[accepted]
            if whole == (extra == "runner"):
                extra = "other"  # (a "runner" where all were accepted, a guess where not)
            c += [*drafts, _extra(aheads, [*c, *drafts], rejected, extra, vocab)]
        for sid in committed:  # the cache a miss leaves is what drafting on request left
            a, b = on._sessions[sid].model, off._sessions[sid].model
            assert a.tokens[:len(b.tokens)] == b.tokens
    stats = on.stats()
    assert hits == stats["ahead_hits"] > 0 and stats["ahead_misses"] > 0
    assert stats["ahead_drafted"] == 11 * len(committed)
    second = guesses > 1 and sampling.greedy  # the second guesses hit only then
    assert (stats["ahead_hits_other_guess"] > 0) == second
    assert (stats["ahead_hits_rejection"] > 0) == second  # and the rejections' runners-up
    assert off.stats()["ahead_drafted"] == 0


def test_under_load_nothing_is_drafted_ahead(lean, prompts):
    """Replies out for more than AHEAD_ROWS sessions: no draft-ahead (a hit would save
    little, the drafter's time would delay the next calls); the calls are served as
    without it."""
    on, off = DrafterEngine(lean, draft_ahead=True, guesses=2), DrafterEngine(lean)
    items = [_item(f"s{i}", prompts[i % len(prompts)], 0, 2, "draft", SamplingParams())
             for i in range(AHEAD_ROWS + 1)]
    first = on.propose(items)
    assert on.ahead_pending and on.draft_ahead() == 0 and not on.ahead_pending
    assert not any(s.aheads for s in on._sessions.values())
    nxt = [_item(it.session_id, [*it.tokens, *o.draft_tokens, 7], len(it.tokens), 2, "draft",
                 SamplingParams()) for it, o in zip(items, first, strict=True)]
    off.propose(items)
    assert [o.draft_tokens for o in on.propose(nxt)] == [
        o.draft_tokens for o in off.propose(nxt)]
    assert on.stats()["ahead_drafted"] == on.stats()["ahead_hits"] == 0


def test_a_released_session_is_not_drafted_ahead(lean, prompts):
    on = DrafterEngine(lean, draft_ahead=True)
    on.propose([_item("a", prompts[0], 0, 3, "draft", SamplingParams())])
    assert on.ahead_pending
    on.release("a")
    assert not on.ahead_pending and on.draft_ahead() == 0


def test_the_drafter_server_drafts_ahead_between_calls(lean, prompts):
    """Through the drafter's gRPC servicer: after a reply the batcher drafts ahead; the
    next call for that outcome is answered from it (``ahead`` on the wire), with the drafts
    a drafter without draft-ahead gives."""
    import asyncio

    from drafter_service.server import DrafterServicer
    from specserve.proto_gen.specserve.v1 import internal_pb2 as pb
    from specserve.service.wire import propose_item_from_proto, propose_outcome_from_proto

    def msg(call_id, ids, start):
        return pb.ProposeRequest(call_id=call_id, session_id="s", committed_len=len(ids),
                                 tokens_start=start, tokens=ids[start:], k=3, mode="draft",
                                 sampling=pb.Sampling(top_p=1.0))

    async def run():
        servicer = DrafterServicer(DrafterEngine(lean, draft_ahead=True), "d0")
        servicer.start()
        try:
            committed = list(prompts[0])
            first = await servicer._propose(msg(1, committed, 0))
            while not servicer.engine._sessions["s"].aheads:  # the batcher's next step
                await asyncio.sleep(0.001)
            guess = servicer.engine._sessions["s"].aheads[0].committed[-1]
            nxt = [*committed, *first.draft_tokens, guess]
            second = await servicer._propose(msg(2, nxt, len(committed)))
            return servicer, [(msg(1, committed, 0), first), (msg(2, nxt, 0), second)]
        finally:
            servicer._batcher.cancel()
            servicer._reaper.cancel()

    servicer, calls = asyncio.run(run())
    assert [r.ahead for _, r in calls] == [False, True]
    ref = DrafterEngine(lean)
    for m, r in calls:
        assert not r.error
        got = propose_outcome_from_proto(r)
        assert got.ahead == r.ahead
        assert got.draft_tokens == ref.propose([propose_item_from_proto(m)])[0].draft_tokens
    assert servicer.ahead_s > 0 and servicer.engine.stats()["ahead_hits"] == 1


def test_take_prepared_hands_over_each_block_once(lean, prompts):
    """The blocks the server pushes: for committed + drafts + guess, the drafts the next
    call gets; taken once; a session released meanwhile is left out."""
    on = DrafterEngine(lean, draft_ahead=True)
    items = [_item(s, p, 0, 3, "draft", SamplingParams()) for s, p in zip("ab", prompts,
                                                                           strict=False)]
    first = on.propose(items)
    assert on.draft_ahead() == 2
    on.release("b")
    (block,) = on.take_prepared()
    assert on.take_prepared() == []
    guess = on._sessions["a"].aheads[0].committed[-1]
    assert block.session_id == "a" and block.tail == [*first[0].draft_tokens, guess]
    nxt = [*prompts[0], *block.tail]
    assert block.committed_len == len(nxt)
    (hit,) = on.propose([_item("a", nxt, len(prompts[0]), 3, "draft", SamplingParams())])
    assert hit.ahead and hit.draft_tokens == block.drafts


def test_the_router_sends_pushed_blocks_without_a_drafter_call(builtin_pair, generator):
    """In process over real gRPC (router, drafter and target servers): with draft-ahead
    on, rounds take the block the drafter pushed, and the outputs are those without it:
    greedy equal to spec-off, a seeded sampled request identical on and off."""
    import asyncio

    from router.inprocess import start_inprocess
    from specserve.api import GenerationRequest

    prompt = "def parse_args(argv):\n    parser = argparse."
    greedy = GenerationRequest(prompt=prompt, max_tokens=48, spec="draft", k=2)
    sampled = GenerationRequest(prompt=prompt, max_tokens=48, spec="draft", k=2,
                                temperature=0.8, seed=11)

    async def run(ahead: bool):
        svc = await start_inprocess(builtin_pair, draft_ahead=ahead, guesses=2)
        try:
            out = []
            for i, req in enumerate((greedy, sampled)):
                chunks = await svc.generate(req, f"push-{ahead}-{i}")
                out.append(([t for c in chunks for t in c.token_ids], chunks[-1].stats))
            return out, svc.drafter_servicer.pushed
        finally:
            await svc.close()

    on, pushed = asyncio.run(run(True))
    off, _ = asyncio.run(run(False))
    _, ref, _ = generator.generate(GenerationRequest(prompt=prompt, max_tokens=48, spec="off"))
    assert on[0][0] == ref == off[0][0]
    assert on[1][0] == off[1][0]  # seeded: the same draws on and off
    used = sum(st["drafted_ahead_pushed"] for _, st in on)
    assert pushed >= used > 0
    assert all(st["drafted_ahead_pushed"] <= st["drafted_ahead"] for _, st in on)
    # with two guesses a greedy row is also prepared for each rejection (the runner-up)
    assert 0 < on[0][1]["drafted_ahead_after_rejection"] < on[0][1]["drafted_ahead"]
    assert on[1][1]["drafted_ahead_after_rejection"] == 0  # sampled: all-accepted only
    assert all(st["drafted_ahead"] == 0 for _, st in off)


def test_the_router_holds_every_outcome_pushed_after_the_latest_round():
    """Blocks pushed after one round (its all-accepted and rejection outcomes: different
    committed lengths, one base) are held together; one pushed after a later round drops
    them."""
    from types import SimpleNamespace

    from router.mux import StreamMux
    from specserve.proto_gen.specserve.v1 import internal_pb2 as pb

    mux = SimpleNamespace(pushed={})

    def block(n: int, tail: list[int]) -> pb.ProposeReply:
        return pb.ProposeReply(session_id="s", committed_len=n, tail=tail)

    for b in (block(13, [1, 2, 3]), block(11, [9]), block(12, [1, 8])):  # after 10 tokens
        StreamMux._hold(mux, b)
    assert [b.committed_len for b in mux.pushed["s"]] == [13, 11, 12]
    StreamMux._hold(mux, block(15, [4, 5]))  # after the next round (13 tokens)
    assert [b.committed_len for b in mux.pushed["s"]] == [15]

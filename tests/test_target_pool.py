"""The target's slot pool: rows in consecutive slots, moved into place, freed and reused, the
pool grown under live sessions; every row's verify logits equal a plain Hugging Face forward
of that sequence alone, whatever else is in the batch or where its slot is."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.contract import VerifyItem
from specserve.core.sampling import SamplingParams
from specserve.engine import target as target_module
from specserve.engine.target import TargetEngine, _feeds


def _plain_logits(model, tokens: list[int], k: int) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0, -(k + 1):].float()


def _capture(engine: TargetEngine) -> dict:
    seen: dict = {}
    decide = engine._decide

    def wrapped(rows, lg):
        for i, r in enumerate(rows):
            k = len(r.item.draft_tokens)
            seen[r.item.session_id] = (r.committed + r.item.draft_tokens, k, lg[i, : k + 1])
        return decide(rows, lg)

    engine._decide = wrapped
    return seen


@pytest.mark.parametrize(("chunk", "budget"), [(None, None), (16, None), (16, 24)])
def test_pool_rows_equal_plain_forward_under_slot_churn(builtin_pair, monkeypatch, chunk,
                                                       budget):
    """With ``prefill_chunk``, a row with more than a chunk to feed feeds one chunk a step
    and answers ``pending``; it comes back in the next step beside the others (as the
    target service carries it) until its verdict, whose logits are still the plain
    forward's and whose repair record covers the whole call. With ``prefill_budget`` the
    prefills of a step feed that many tokens at most, and a row past it waits unfed."""
    model = builtin_pair.target
    vocab = int(model.config.vocab_size)
    rnd = random.Random(3)
    engine = TargetEngine(model, cache_budget_bytes=1 << 30)
    seen = _capture(engine)
    packed = []
    run_packed = engine._packed
    engine._packed = lambda *a: (packed.append(1), run_packed(*a))[1]
    swaps = []
    swap = engine.pool._swap
    engine.pool._swap = lambda a, b: (swaps.append((a, b)), swap(a, b))
    catch_up = []
    forward = engine._forward
    engine._forward = lambda rows: (catch_up.append(  # per forward, each row's
        [len(r.feed) - len(r.item.draft_tokens) for r in rows]), forward(rows))[1]
    steps = []  # per call: each row's catch-up and what it fed (``_feeds``)
    feeds = target_module._feeds
    monkeypatch.setattr(target_module, "_feeds", lambda needs, *a: (
        steps.append((needs, feeds(needs, *a))), steps[-1][1])[1])
    seqs: dict[str, list[int]] = {}
    windows: dict[str, int] = {}
    carried: list[VerifyItem] = []
    pending = 0
    for step in range(40):
        busy = {it.session_id for it in carried}
        live = [s for s in seqs if s not in busy]
        if step % 2 == 0 or not seqs:  # a new session (a prefill beside 1-token rows)
            sid = f"s{step}"
            seqs[sid] = [rnd.randrange(1, vocab) for _ in range(rnd.randrange(3, 90))]
            windows[sid] = 0
            live.append(sid)
        if step % 7 == 6 and len(live) > 1:  # a released session frees its slot
            gone = live.pop(rnd.randrange(len(live)))
            engine.release(gone)
            del seqs[gone], windows[gone]
        batch = [s for s in live if rnd.random() < 0.6] or live[:1]
        rnd.shuffle(batch)  # another order each step: rows move into consecutive slots
        items = list(carried)
        for sid in batch:
            k = rnd.randrange(0, 4)
            drafts = [rnd.randrange(1, vocab) for _ in range(k)]
            toks = seqs[sid]
            items.append(VerifyItem(sid, len(toks), windows[sid], toks[windows[sid]:], drafts,
                                    None, SamplingParams()))
        outs = engine.verify(items, chunk, budget)
        carried = [it for it, out in zip(items, outs, strict=True) if out.pending]
        pending += len(carried)
        for it, out in zip(items, outs, strict=True):
            assert not out.cache_miss
            if out.pending:
                continue
            assert out.repair.kept + out.repair.fed == it.committed_len
            fed, k, lg = seen.pop(it.session_id)
            torch.testing.assert_close(lg, _plain_logits(model, fed, k), atol=2e-4, rtol=1e-4)
            toks = seqs[it.session_id]
            toks += [*it.draft_tokens[: out.num_accepted], out.extra_token]
            windows[it.session_id] = len(toks) - 1 - out.num_accepted  # resend a tail
    assert packed, "no step had rows of different pasts or feeds"
    assert swaps, "no row was ever moved into place: the churn did not exercise _swap"
    assert engine.pool.capacity > 64  # grew under live sessions
    assert engine.pool.buf.shape[2] >= len(seqs)
    live_slots = [s.slot for s in engine._sessions.values()]
    assert len(set(live_slots)) == len(live_slots) and -1 not in live_slots
    owners = [o for o in engine.pool.owner if o is not None]
    assert len(owners) == len(engine._sessions)
    beside = [max(c) for c in catch_up if min(c) <= 2]  # forwards with a decoding row
    if chunk is None:
        assert pending == 0 and max(beside) > 16
    else:  # beside decoding rows a chunk at most (a prompt alone is fed whole)
        assert pending > 5 and max(beside) == chunk
    prefill = [sum(f for n, f in zip(needs, fed, strict=True) if n > (chunk or n))
               for needs, fed in steps]
    waited = sum(f == 0 for _, fed in steps for f in fed)
    if budget is None:
        assert waited == 0
    else:  # every step's prefills within the budget; some row waited a step for it
        assert max(prefill) == budget and waited > 0


def test_a_steps_prefills_share_its_budget_first_come_first_served():
    """``_feeds``: what each row feeds of what it has to catch up, with chunk 64."""
    # no budget: today's rule (whole prompts with nobody decoding, a chunk beside a decoder)
    assert _feeds([300, 150], [False, False], 64, None) == [300, 150]
    assert _feeds([3, 300, 150], [False] * 3, 64, None) == [3, 64, 64]
    assert _feeds([300, 150], [False, False], None, 512) == [300, 150]  # no chunks: whole
    # a burst with nobody decoding: the first prompts whole, the next one's start, then wait
    assert _feeds([200, 150, 300, 100], [False] * 4, 64, 512) == [200, 150, 162, 0]
    assert _feeds([900, 100], [False, False], 64, 512) == [512, 0]  # the first always feeds
    # beside a decoder: a chunk each, within the budget; the decoder's own tokens are free
    assert _feeds([3, 300, 150, 90], [False] * 4, 64, 128) == [3, 64, 64, 0]
    # a batch-invariant sampled row: exactly a chunk or nothing (its bounds never move)
    assert _feeds([100, 300], [False, True], 64, 128) == [100, 0]
    assert _feeds([300, 100], [True, False], 64, 128) == [64, 64]


def test_unused_pool_entries_never_reach_a_row(builtin_pair):
    """Entries past a row's length (stale drafts, other sessions' lengths, pads) are read by
    attention under a zero weight: whatever finite values they hold must not change any row
    (the pool only ever holds computed entries or the zeros it grew with: never NaN)."""
    model = builtin_pair.target
    engine = TargetEngine(model, cache_budget_bytes=1 << 30)
    seen = _capture(engine)
    seqs = {f"s{i}": list(range(5 + 7 * i, 5 + 7 * i + 10 + 9 * i)) for i in range(4)}
    engine.verify([VerifyItem(sid, len(t), 0, t, [7, 8], None, SamplingParams())
                   for sid, t in seqs.items()])
    buf = engine.pool.buf
    assert torch.isfinite(buf).all()
    with torch.inference_mode():  # garbage everywhere past each row's length
        for sess in engine._sessions.values():
            tail = buf[:, :, sess.slot, :, sess.length:]
            tail.copy_(1e3 * torch.randn(tail.shape))
        for s in range(buf.shape[2]):
            if engine.pool.owner[s] is None:
                buf[:, :, s].copy_(1e3 * torch.randn(buf[:, :, s].shape))
    items = [VerifyItem(sid, len(t), len(t) - 1, t[-1:], [9, 10, 11][: i % 3], None,
                        SamplingParams()) for i, (sid, t) in enumerate(seqs.items())]
    engine.verify(items)
    for it in items:
        fed, k, lg = seen[it.session_id]
        torch.testing.assert_close(lg, _plain_logits(model, fed, k), atol=2e-4, rtol=1e-4)


def test_a_prefill_beside_a_long_row_grows_the_pool_to_the_longest_row_only(builtin_pair):
    """A step with a new session's prefill (a long feed, no past) beside a row with a long
    past: the pool grows to the longest row's end, in quarter steps, not to the longest past
    plus the longest feed. (It grew to their sum, doubled: at the bench's mixed load a 599-
    token session put every slot at 2048 positions and the budget held 10 sessions, not
    21.) Every row's logits stay those of a plain forward."""
    model = builtin_pair.target
    engine = TargetEngine(model, cache_budget_bytes=1 << 30)
    seen = _capture(engine)
    old, new = list(range(5, 205)), list(range(300, 490))  # 200 and 190 tokens
    engine.verify([_item("old", old)])
    assert engine.pool.capacity == 256  # 200 positions, in blocks of 64
    longer = old + list(range(600, 640))  # 240 tokens
    engine.verify([_item("old", longer, start=len(old), drafts=[7, 8]), _item("new", new)])
    assert engine.pool.capacity == 256  # the longest row ends at 242 (past 200 + feed 190)
    for sid, toks, drafts in (("old", longer, [7, 8]), ("new", new, [])):
        fed, k, lg = seen[sid]
        assert fed == toks + drafts
        torch.testing.assert_close(lg, _plain_logits(model, fed, k), atol=2e-4, rtol=1e-4)
    engine.verify([_item("old", longer + [1] * 20, start=len(longer))])  # needs 260
    assert engine.pool.capacity == 320  # a quarter more, not twice


def test_eviction_frees_slots(builtin_pair):
    engine = TargetEngine(builtin_pair.target, cache_budget_bytes=1)  # evict all but the batch
    for i in range(5):
        engine.verify([VerifyItem(f"s{i}", 4, 0, [5, 6, 7, 8], [9], None, SamplingParams())])
    assert len(engine._sessions) == 1
    assert sum(o is not None for o in engine.pool.owner) == 1
    assert engine.pool.buf.shape[2] <= 4  # slots reused, not one per session ever seen


def _budget_for(engine: TargetEngine, sessions: int, length: int = 64) -> int:
    engine.pool.reserve(0, length)  # the pool's shape, for its slot size (no slot yet)
    return sessions * (engine.pool.slot_bytes_at(length) + 8 * length)


def _item(sid: str, tokens: list[int], start: int = 0, drafts=()) -> VerifyItem:
    return VerifyItem(sid, len(tokens), start, tokens[start:], list(drafts), None,
                      SamplingParams())


def test_admission_makes_new_sessions_wait_instead_of_evicting_live_ones(builtin_pair):
    """A budget of two sessions: a third waits (nobody is evicted, nobody misses) until a
    release makes room; the pool never holds more slots than the budget."""
    engine = TargetEngine(builtin_pair.target)
    engine.cache_budget_bytes = engine.pool.budget_bytes = _budget_for(engine, 2)
    seqs = {s: list(range(3 + i, 13 + i)) for i, s in enumerate("abc")}
    first = [_item(s, seqs[s]) for s in "ab"]
    assert engine.admission(first).run == [True, True]
    engine.verify(first)
    step = [_item(s, seqs[s], start=len(seqs[s]) - 1) if s in "ab" else _item(s, seqs[s])
            for s in "abc"]
    plan = engine.admission(step)
    assert plan.run == [True, True, False] and plan.preempt == []
    outs = engine.verify(step[:2])
    assert not any(o.cache_miss for o in outs) and engine.evictions == 0
    engine.release("a")
    plan = engine.admission([step[2]])
    assert plan.run == [True] and plan.preempt == []
    engine.verify([step[2]])
    assert engine.has_session("b") and engine.has_session("c") and engine.misses == 0
    assert engine.pool.buf.shape[2] <= 2


def test_sessions_that_outgrow_the_budget_preempt_the_newest(builtin_pair):
    """Two sessions fit at pool length 64, one at 128: when a row needs 128, the newest
    session is preempted (its next row misses and its resend waits); the oldest keeps its
    cache, and the one that grew is served correctly from a compacted pool."""
    model = builtin_pair.target
    engine = TargetEngine(model)
    engine.cache_budget_bytes = engine.pool.budget_bytes = _budget_for(engine, 2)
    seen = _capture(engine)
    old, new = list(range(5, 25)), list(range(40, 60))
    engine.verify([_item("old", old), _item("new", new)])
    assert engine.pool.buf.shape[2] == 2
    grown = old + list(range(100, 180))  # 100 tokens: the pool must reach 128
    step = [_item("old", grown, start=len(old)), _item("new", new, start=len(new) - 1)]
    plan = engine.admission(step)
    assert plan.run == [True, True] and plan.preempt == ["new"]
    for sid in plan.preempt:
        engine.release(sid)
    outs = engine.verify(step)
    assert not outs[0].cache_miss and outs[1].cache_miss
    assert engine.pool.capacity >= 128 and engine.pool.buf.shape[2] == 1
    fed, k, lg = seen["old"]
    torch.testing.assert_close(lg, _plain_logits(model, fed, k), atol=2e-4, rtol=1e-4)
    resend = _item("new", new)  # the miss's resend: a new session, and there is no room
    assert engine.admission([resend]).run == [False]


def test_the_pool_shrinks_when_its_longest_session_leaves(builtin_pair):
    """A budget of four sessions at 128 positions. A 300-token session grows the pool to 320
    and a new short one must wait; once the long one is released, the next step fits the
    pool to the sessions left (a quarter over their longest, in blocks of 64), the new one
    is admitted, and both rows stay those of a plain forward. (The pool used to keep its
    longest length for good: one long request left a replica holding few sessions.) A pool
    whose budget holds more sessions keeps its length: a shrink costs a copy."""
    model = builtin_pair.target
    engine = TargetEngine(model)
    engine.cache_budget_bytes = engine.pool.budget_bytes = _budget_for(engine, 4, 128)
    seen = _capture(engine)
    a, long, b = list(range(3, 23)), list(range(30, 330)), list(range(400, 420))
    engine.verify([_item("a", a), _item("long", long)])
    assert engine.pool.capacity == 320
    a2 = [*a, 50]
    step = [_item("a", a2, start=len(a)), _item("b", b)]
    assert engine.admission(step).run == [True, False]  # 3 x 320 is over the budget
    engine.release("long")
    plan = engine.admission(step)
    assert plan.run == [True, True] and plan.preempt == []
    outs = engine.verify(step)
    assert not any(o.cache_miss for o in outs)
    assert engine.pool.capacity == 64
    for sid, toks in (("a", a2), ("b", b)):
        fed, k, lg = seen[sid]
        assert fed == toks
        torch.testing.assert_close(lg, _plain_logits(model, fed, k), atol=2e-4, rtol=1e-4)
    roomy = TargetEngine(model, cache_budget_bytes=1 << 30)  # room to spare: no copy
    roomy.verify([_item("a", a), _item("long", long)])
    roomy.release("long")
    roomy.verify([_item("a", a2, start=len(a))])
    assert roomy.pool.capacity == 320


def test_an_overdue_row_evicts_the_least_recently_used_session_outside_its_step(builtin_pair):
    engine = TargetEngine(builtin_pair.target)
    engine.cache_budget_bytes = engine.pool.budget_bytes = _budget_for(engine, 2)
    a, b, c = list(range(3, 13)), list(range(20, 30)), list(range(40, 50))
    engine.verify([_item("a", a)])
    engine.verify([_item("b", b)])  # "a" is now the least recently used
    step = [_item("b", b, start=len(b) - 1), _item("c", c)]
    assert engine.admission(step, [False, False]).run == [True, False]
    plan = engine.admission(step, [False, True])
    assert plan.run == [True, True] and plan.preempt == ["a"]
    lone = TargetEngine(builtin_pair.target, cache_budget_bytes=1)  # below one session
    assert lone.admission([_item("x", a)]).run == [True]  # one always runs


def _verify_stream(port: int):
    """A Verify stream: (send, next_replies, close)."""
    import asyncio

    import grpc

    from specserve.proto_gen.specserve.v1 import internal_pb2 as pb
    from specserve.proto_gen.specserve.v1 import internal_pb2_grpc as pb_grpc

    outbox: asyncio.Queue = asyncio.Queue()

    async def outgoing():  # a list: rows of one message (queued at the server together)
        while (m := await outbox.get()) is not None:
            yield pb.VerifyBatch(rows=m if isinstance(m, list) else [m])

    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    replies = pb_grpc.TargetStub(ch).Verify(outgoing()).__aiter__()

    async def nxt():
        return (await replies.__anext__()).replies

    async def close():
        await outbox.put(None)
        await ch.close()

    return outbox.put, nxt, close


def test_a_step_longer_than_the_idle_timeout_releases_nobody(builtin_pair):
    """A session whose row sits in a long step (slowed here, as a long prefill of many
    sessions is) is not idle: its next round still finds its cache (before, the reaper
    released it during the step, every session missed and re-prefilled, and the next step
    was longer still)."""
    import asyncio
    import time

    from specserve.proto_gen.specserve.v1 import internal_pb2 as pb
    from target_service.server import start_target_server

    engine = TargetEngine(builtin_pair.target)
    verify = engine.verify
    engine.verify = lambda *a: (time.sleep(0.6), verify(*a))[1]  # injected slowness
    toks = list(range(3, 20))

    async def main():
        server, port, servicer = await start_target_server(engine, "127.0.0.1", 0, "t",
                                                           batch_wait_s=0.0, idle_s=0.1)
        send, nxt, close = _verify_stream(port)
        try:
            await send(pb.VerifyRequest(call_id=1, session_id="s", committed_len=len(toks),
                                        tokens=toks, sampling=pb.Sampling(top_p=1.0)))
            (first,) = await nxt()
            more = [*toks, first.extra_token]
            await send(pb.VerifyRequest(call_id=2, session_id="s", committed_len=len(more),
                                        tokens_start=len(toks), tokens=more[len(toks):],
                                        sampling=pb.Sampling(top_p=1.0)))
            (second,) = await nxt()
            assert not first.error and not second.error
            assert not second.cache_miss and engine.misses == 0
            assert servicer.sessions.released["idle"] == 0
            await close()
        finally:
            await server.stop(0)

    asyncio.run(asyncio.wait_for(main(), 120))


def test_the_target_server_holds_a_row_until_a_release_makes_room(builtin_pair):
    """Through gRPC: with room for two sessions a third session's row is held (not answered,
    nobody evicted) until the router releases one; then it is served, no miss anywhere."""
    import asyncio

    from specserve.proto_gen.specserve.v1 import internal_pb2 as pb
    from specserve.service.wire import release_message
    from target_service.server import start_target_server

    engine = TargetEngine(builtin_pair.target)
    engine.cache_budget_bytes = engine.pool.budget_bytes = _budget_for(engine, 2)

    def row(call: int, sid: str) -> pb.VerifyRequest:
        toks = list(range(3 + call, 13 + call))
        return pb.VerifyRequest(call_id=call, session_id=sid, committed_len=len(toks),
                                tokens=toks, sampling=pb.Sampling(top_p=1.0))

    async def main():
        server, port, servicer = await start_target_server(engine, "127.0.0.1", 0, "t",
                                                           batch_wait_s=0.0)
        send, nxt, close = _verify_stream(port)
        try:
            for i, sid in enumerate("ab", 1):
                await send(row(i, sid))
                got = await nxt()
                assert [r.call_id for r in got] == [i] and not got[0].cache_miss
            await send(row(3, "c"))
            while servicer.waiting == 0:  # the event: the row was put aside
                await asyncio.sleep(0.01)
            assert servicer.queued == 1 and engine.evictions == 0
            b = row(2, "b")  # a held session's next round is served meanwhile
            b.call_id, b.tokens_start = 4, b.committed_len
            b.tokens.append(7)
            b.committed_len += 1
            del b.tokens[:-1]
            await send(b)
            got = await nxt()
            assert [r.call_id for r in got] == [4] and not got[0].cache_miss
            assert got[0].queue_rows == 0  # the waiting row is not load the step can take
            await send(release_message("target", "a", "r"))
            got = await nxt()
            assert [r.call_id for r in got] == [3] and not got[0].error
            assert not got[0].cache_miss and servicer.kv == {"waited": 1, "preempted": 0}
            assert engine.misses == 0 and engine.evictions == 0
            await close()
        finally:
            await server.stop(0)

    asyncio.run(asyncio.wait_for(main(), 120))


def test_the_target_server_runs_a_long_prefill_in_chunks_beside_decoding_rows(builtin_pair):
    """Through gRPC with ``prefill_chunk``: a 70-token prompt that arrives in one message
    with a decoding session's row is fed 16 tokens in that step, the session's round is
    answered at once, and the prompt is carried on; in the next steps nothing decodes
    beside it, so its rest is fed whole. The verdict and its repair record are the
    unchunked ones. (Which later steps have a decoding row depends on when rows come
    back: the engine test above covers chunks carried beside rows step after step.)"""
    import asyncio

    from specserve.proto_gen.specserve.v1 import internal_pb2 as pb
    from target_service.server import start_target_server

    prompt = [3 + (7 * i) % 50 for i in range(70)]
    (ref,) = TargetEngine(builtin_pair.target).verify(
        [VerifyItem("b", len(prompt), 0, prompt, [5, 6], None, SamplingParams())])
    engine = TargetEngine(builtin_pair.target)

    def row(call: int, sid: str, toks: list[int], start: int = 0, drafts=()) -> pb.VerifyRequest:
        return pb.VerifyRequest(call_id=call, session_id=sid, committed_len=len(toks),
                                tokens_start=start, tokens=toks[start:],
                                draft_tokens=list(drafts), sampling=pb.Sampling(top_p=1.0))

    async def main():
        server, port, servicer = await start_target_server(
            engine, "127.0.0.1", 0, "t", batch_wait_s=0.0, prefill_chunk=16)
        send, nxt, close = _verify_stream(port)
        buffered: list = []

        async def one():  # the next reply (a message may pack several)
            while not buffered:
                buffered.extend(await nxt())
            return buffered.pop(0)

        try:
            a = list(range(3, 9))
            await send(row(1, "a", a))
            got = await one()
            a.append(got.extra_token)
            # one message: both rows are queued before the batcher runs, so one step
            await send([row(2, "a", a, start=len(a) - 1), row(3, "b", prompt, drafts=[5, 6])])
            first, verdict = await one(), await one()
            assert [first.call_id, verdict.call_id] == [2, 3]  # a did not wait for b's prompt
            assert not first.error and not verdict.error and not verdict.cache_miss
            assert (verdict.num_accepted, verdict.extra_token, verdict.bonus) == \
                (ref.num_accepted, ref.extra_token, ref.bonus)
            assert (verdict.repair.kept, verdict.repair.fed) == (0, 70)
            assert servicer.chunks == 1  # 16 beside a; the other 54 and the drafts alone
            assert servicer.queued == 0 and engine.misses == 0
            await close()
        finally:
            await server.stop(0)

    asyncio.run(asyncio.wait_for(main(), 120))


def test_the_target_server_feeds_a_burst_of_prompts_within_the_step_budget(builtin_pair):
    """Through gRPC with ``prefill_chunk=16, prefill_budget=32``: three prompts (20, 30 and
    25 tokens) that arrive in one message, with nothing decoding, are fed 32 tokens a step,
    first come first served. The first is answered after one step, the second after two,
    the third after three (it waits unfed in the first), each with its unchunked verdict."""
    import asyncio

    from specserve.proto_gen.specserve.v1 import internal_pb2 as pb
    from target_service.server import start_target_server

    prompts = {f"p{n}": [3 + (5 * i + n) % 60 for i in range(n)] for n in (20, 30, 25)}
    refs = {sid: TargetEngine(builtin_pair.target).verify(
        [VerifyItem(sid, len(p), 0, p, [5, 6], None, SamplingParams())])[0]
        for sid, p in prompts.items()}
    engine = TargetEngine(builtin_pair.target)
    steps: list[list[bool]] = []  # per step, each row's pending
    verify = engine.verify

    def recorded(items, *args):
        out = verify(items, *args)
        steps.append([o.pending for o in out])
        return out

    engine.verify = recorded

    async def main():
        server, port, servicer = await start_target_server(
            engine, "127.0.0.1", 0, "t", batch_wait_s=0.0, prefill_chunk=16,
            prefill_budget=32)
        send, nxt, close = _verify_stream(port)
        try:
            await send([pb.VerifyRequest(call_id=i, session_id=sid, committed_len=len(p),
                                         tokens=p, draft_tokens=[5, 6],
                                         sampling=pb.Sampling(top_p=1.0))
                         for i, (sid, p) in enumerate(prompts.items())])
            got = []
            while len(got) < 3:
                got.extend(await nxt())
            assert [r.call_id for r in got] == [0, 1, 2]
            for r, ref in zip(got, refs.values(), strict=True):
                assert not r.error and not r.cache_miss
                assert (r.num_accepted, r.extra_token, r.bonus) == \
                    (ref.num_accepted, ref.extra_token, ref.bonus)
            assert [(r.repair.kept, r.repair.fed) for r in got] == [(0, 20), (0, 30), (0, 25)]
            # 20 + 12; the 18 left + 14 (the third waited); the third's last 11 and drafts
            assert steps == [[False, True, True], [False, True], [False]]
            assert servicer.chunks == 3 and engine.misses == 0
            await close()
        finally:
            await server.stop(0)

    asyncio.run(asyncio.wait_for(main(), 120))

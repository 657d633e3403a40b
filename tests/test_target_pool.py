"""The target's slot pool: rows in consecutive slots, moved into place, freed and reused, the
pool grown under live sessions; every row's verify logits equal a plain Hugging Face forward
of that sequence alone, whatever else is in the batch or where its slot is."""

from __future__ import annotations

import random

import torch

from specserve.contract import VerifyItem
from specserve.core.sampling import SamplingParams
from specserve.engine.target import TargetEngine


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


def test_pool_rows_equal_plain_forward_under_slot_churn(builtin_pair):
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
    seqs: dict[str, list[int]] = {}
    windows: dict[str, int] = {}
    for step in range(30):
        live = list(seqs)
        if step % 2 == 0 or not live:  # a new session (a prefill beside 1-token rows)
            sid = f"s{step}"
            seqs[sid] = [rnd.randrange(1, vocab) for _ in range(rnd.randrange(3, 90))]
            windows[sid] = 0
        if step % 7 == 6:  # a released session frees its slot for the next one
            gone = live[rnd.randrange(len(live))]
            engine.release(gone)
            del seqs[gone], windows[gone]
        batch = [s for s in seqs if rnd.random() < 0.6] or list(seqs)[:1]
        rnd.shuffle(batch)  # another order each step: rows move into consecutive slots
        items = []
        for sid in batch:
            k = rnd.randrange(0, 4)
            drafts = [rnd.randrange(1, vocab) for _ in range(k)]
            toks = seqs[sid]
            items.append(VerifyItem(sid, len(toks), windows[sid], toks[windows[sid]:], drafts,
                                    None, SamplingParams()))
        outs = engine.verify(items)
        for it, out in zip(items, outs, strict=True):
            assert not out.cache_miss
            fed, k, lg = seen[it.session_id]
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


def test_eviction_frees_slots(builtin_pair):
    engine = TargetEngine(builtin_pair.target, cache_budget_bytes=1)  # evict all but the batch
    for i in range(5):
        engine.verify([VerifyItem(f"s{i}", 4, 0, [5, 6, 7, 8], [9], None, SamplingParams())])
    assert len(engine._sessions) == 1
    assert sum(o is not None for o in engine.pool.owner) == 1
    assert engine.pool.buf.shape[2] <= 4  # slots reused, not one per session ever seen

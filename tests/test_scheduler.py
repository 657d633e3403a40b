"""The step scheduler (when a replica starts its next batch) and the router's run-ahead of
rounds over journal writes: pure logic, then over a real asyncio queue."""

from __future__ import annotations

import asyncio
import time

import pytest

from specserve.rounds import run_ahead
from specserve.service.scheduler import StepScheduler, by_session, gather


def test_nothing_out_starts_at_once():
    s = StepScheduler()
    assert s.deadline(0.0, 1) is None  # concurrency 1: the only session is the one here
    s.replied("a", 0.0)
    s.arrived("a", 0.004)
    assert s.deadline(0.004, 1) is None
    assert s.turnaround_p90_s == pytest.approx(0.004)


def test_waits_for_sessions_out_until_their_expected_return():
    s = StepScheduler(max_wait_s=1.0)
    s.stepped(0.060)  # a step computes 60 ms
    for sid in "abcd":
        s.replied(sid, 0.0)
    for sid in "abc":
        s.arrived(sid, 0.010)  # turnarounds of 10 ms
    # d is out: expected back at 0 + p90 (10 ms); 3 ready, 1 out: worth 60 * 1/3 = 20 ms
    assert s.expected() == 1
    assert s.deadline(0.010, 3) == pytest.approx(0.010)
    s.replied("e", 0.009)  # another one out, later
    assert s.deadline(0.010, 3) == pytest.approx(0.019)


def test_wait_is_bounded_by_what_it_costs_the_ready_rows():
    s = StepScheduler(max_wait_s=1.0)
    s.stepped(0.060)
    for i in range(16):
        s.replied(f"s{i}", 0.0)
    for i in range(16):
        s.arrived(f"s{i}", 0.5)  # slow turnarounds: p90 500 ms
    for i in range(16):
        s.replied(f"s{i}", 1.0)
    for i in range(15):
        s.arrived(f"s{i}", 1.001)
    # 15 ready, 1 out: waiting w costs 15 w, pays while 15 w < 1 * 60 ms -> 4 ms at most
    assert s.deadline(1.001, 15) == pytest.approx(1.001 + 0.060 / 15)
    s.stepped(0.060)
    assert s.deadline(1.001, 1) == pytest.approx(1.001 + 0.060)  # one ready: one step


def test_give_up_marks_late_until_the_session_returns_and_release_forgets():
    s = StepScheduler()
    s.replied("a", 0.0)
    s.replied("b", 0.0)
    s.give_up()
    assert s.deadline(0.1, 1) is None and s.timeouts == 1
    s.arrived("a", 0.2)
    s.replied("a", 0.3)
    assert s.expected() == 1  # a is out again; b stays late
    s.released("a")
    assert s.expected() == 0 and s.deadline(0.4, 1) is None


def _run(coro):
    return asyncio.run(coro)


def test_gather_takes_the_expected_row_and_starts_at_once_without_one():
    async def main():
        s = StepScheduler(max_wait_s=5.0)
        s.stepped(5.0)
        q: asyncio.Queue = asyncio.Queue()
        await q.put("a")
        assert await gather(q, s, 8) == ["a"]  # nothing out: no wait
        now = asyncio.get_running_loop().time()  # = time.monotonic()
        s.replied("a", now)
        s.replied("b", now)
        await q.put("a")
        s.arrived("a", now + 0.001)
        s._p90 = 5.0  # b is expected within 5 s: gather must wait for it

        async def later():
            await asyncio.sleep(0.01)
            s.arrived("b", asyncio.get_running_loop().time())
            await q.put("b")

        task = asyncio.create_task(later())
        rows = await gather(q, s, 8)
        await task
        return rows, s.waits, s.timeouts

    rows, waits, timeouts = _run(main())
    assert rows == ["a", "b"] and waits == 1 and timeouts == 0


def test_gather_gives_up_on_a_row_that_does_not_come():
    async def main():
        s = StepScheduler(max_wait_s=0.02)
        q: asyncio.Queue = asyncio.Queue()
        now = __import__("time").monotonic()
        s.replied("gone", now)
        s._p90 = 10.0
        await q.put("a")
        first = await gather(q, s, 8)
        await q.put("a")
        second = await gather(q, s, 8)  # "gone" is late now: no wait
        return first, second, s.timeouts, s.waits

    first, second, timeouts, waits = _run(main())
    assert first == ["a"] and second == ["a"] and timeouts == 1 and waits == 1


def test_gather_stops_at_max_rows():
    async def main():
        s = StepScheduler()
        q: asyncio.Queue = asyncio.Queue()
        for i in range(5):
            await q.put(i)
        return await gather(q, s, 3), q.qsize()

    assert _run(main()) == ([0, 1, 2], 2)


async def _numbers(n: int, log: list, fail_at: int | None = None):
    try:
        for i in range(n):
            if i == fail_at:
                raise ValueError(f"round {i} failed")
            log.append(("made", i))
            yield i
            await asyncio.sleep(0)
    finally:
        log.append(("closed",))


def test_run_ahead_yields_in_order_and_stays_within_depth():
    async def main():
        log: list = []
        got = []
        async for i in run_ahead(_numbers(20, log), 2):
            made = sum(1 for e in log if e[0] == "made")
            assert made - len(got) <= 2 + 2  # queued + the one in hand + the one being put
            got.append(i)
            await asyncio.sleep(0.001)
        return got, log

    got, log = _run(main())
    assert got == list(range(20)) and log[-1] == ("closed",)


def test_run_ahead_raises_the_source_error_in_order():
    async def main():
        log: list = []
        got = []
        with pytest.raises(ValueError, match="round 3 failed"):
            async for i in run_ahead(_numbers(10, log, fail_at=3), 4):
                got.append(i)
        return got

    assert _run(main()) == [0, 1, 2]


def test_closing_the_consumer_closes_the_source_first():
    async def main():
        log: list = []
        agen = run_ahead(_numbers(1000, log), 4)
        assert await agen.__anext__() == 0
        await agen.aclose()
        return log

    log = _run(main())
    assert log[-1] == ("closed",)  # the source's cleanup ran before aclose returned
    assert sum(1 for e in log if e[0] == "made") < 10


def test_closing_ends_a_source_that_swallows_one_cancel():
    """asyncio.wait_for (3.11) can swallow a cancel whose inner call completes at the same
    moment; the round loop then goes on. Closing the consumer must still end the source."""
    async def stubborn(log: list):
        i = 0
        swallowed = False
        try:
            while True:
                try:
                    await asyncio.sleep(0.001)
                except asyncio.CancelledError:
                    if swallowed:
                        raise
                    swallowed = True  # as wait_for does when its inner call just finished
                log.append(i)
                yield i
                i += 1
        finally:
            log.append("closed")

    async def main():
        log: list = []
        agen = run_ahead(stubborn(log), 2)
        assert await agen.__anext__() == 0
        await asyncio.wait_for(agen.aclose(), 5)  # a hang here is the bug
        return log

    assert _run(main())[-1] == "closed"


def test_by_session_serves_a_repeated_session_in_order():
    rows = [("a", 1), ("b", 1), ("a", 2), ("c", 1), ("a", 3), ("b", 2)]
    calls = by_session(rows, lambda r: r[0])
    assert calls == [[("a", 1), ("b", 1), ("c", 1)], [("a", 2), ("b", 2)], [("a", 3)]]
    assert by_session(rows[:2], lambda r: r[0]) == [rows[:2]]


def test_target_batch_survives_a_bad_row_and_a_repeated_session(builtin_pair):
    """A row the engine would refuse is answered alone; a session queued twice (a resend
    behind its first call) is served in order; the other rows of the step are verified."""
    from specserve.contract import VerifyItem
    from specserve.core.sampling import SamplingParams
    from specserve.engine.target import TargetEngine
    from specserve.proto_gen.specserve.v1 import internal_pb2 as pb
    from specserve.service.wire import verify_item_to_proto
    from target_service.server import TargetServicer

    def msg(call_id, sid, toks):
        m = verify_item_to_proto(VerifyItem(sid, len(toks), 0, toks, [], None,
                                            SamplingParams(seed=1)))
        m.call_id = call_id
        return m

    async def main():
        servicer = TargetServicer(TargetEngine(builtin_pair.target), "t0")
        replies: asyncio.Queue = asyncio.Queue()
        now = time.time_ns()  # when each row was read (the replies' received_ns)
        batch = [(msg(1, "a", [5, 6, 7]), replies, None, now),
                 (msg(2, "bad", [5, 10**6]), replies, None, now),  # outside the vocabulary
                 (msg(3, "a", [5, 6, 7, 8]), replies, None, now),  # a again, behind its first
                 (msg(4, "b", [9, 10]), replies, None, now)]
        for rows in by_session(batch, lambda r: r[0].session_id):
            await servicer._serve(rows)
        out: list[pb.VerifyReply] = []
        while not replies.empty():
            out.append(replies.get_nowait())
        return {r.call_id: r for r in out}

    got = asyncio.run(main())
    assert "outside the vocabulary" in got[2].error
    assert not any(got[i].error for i in (1, 3, 4))
    assert got[3].repair.cached_before == 3  # served after call 1, from its cache

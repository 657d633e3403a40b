"""Many requests in lock-step over in-process engines: the one round per request
(``specserve.rounds.speculate``), with transports that hold every call until all live
requests are waiting, then call the engine once for all of them (one drafter call, then one
target forward per round; a drafter with draft-ahead drafts ahead before each target call,
as its server does while the target verifies). What the multi-session engine tests drive;
no Ray, no gRPC.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from specserve.api import GenerationRequest
from specserve.contract import SessionProposer, SessionVerifier
from specserve.engine.drafter import DrafterEngine
from specserve.engine.generator import new_state
from specserve.engine.target import TargetEngine
from specserve.policy import CostModel, policy_for
from specserve.rounds import Observer, RequestState, speculate


class Lockstep:
    """Holds calls until every live request waits; then flushes the drafter queue (one
    ``propose`` per ``max_batch`` rows), else the target queue (one ``verify`` each).
    ``drafter`` / ``target`` may be replaced between flushes (a restarted replica): the
    sessions then repair themselves by the contract's resend rule."""

    def __init__(self, drafter: DrafterEngine, target: TargetEngine, max_batch: int | None,
                 before_flush: Callable[[Lockstep], None] | None = None):
        self.drafter, self.target = drafter, target
        self.max_batch = max_batch
        self.before_flush = before_flush
        self.live = 0
        self.rounds = 0  # target flushes
        self.cost = CostModel()  # spec=auto's, shared by the requests
        self._queues: dict[str, list[tuple[Any, asyncio.Future]]] = {"drafter": [],
                                                                      "target": []}

    def send(self, component: str) -> Callable[[Any], Any]:
        async def send(item: Any) -> Any:
            fut = asyncio.get_running_loop().create_future()
            self._queues[component].append((item, fut))
            self._step()
            return await fut

        return send

    def finished(self) -> None:
        self.live -= 1
        self._step()

    def _step(self) -> None:
        d, t = self._queues["drafter"], self._queues["target"]
        if not (d or t) or len(d) + len(t) < self.live:
            return
        if self.before_flush is not None:
            self.before_flush(self)
        component = "drafter" if d else "target"
        calls, self._queues[component] = self._queues[component], []
        engine_call = self.drafter.propose if d else self.target.verify
        self.rounds += component == "target"
        if not d and self.drafter.draft_ahead_on:  # the drafter's server does it meanwhile
            self.drafter.draft_ahead()
        size = self.max_batch or len(calls)
        for i in range(0, len(calls), size):
            group = calls[i : i + size]
            try:
                outs = engine_call([item for item, _ in group])
            except Exception as e:
                for _, fut in group:
                    fut.set_exception(e)
                continue
            for (_, fut), out in zip(group, outs, strict=True):
                fut.set_result(out)


async def _run(lockstep: Lockstep, state: RequestState) -> RequestState:
    proposer = SessionProposer(lockstep.send("drafter")) if state.spec != "off" else None
    verifier = SessionVerifier(lockstep.send("target"))
    try:
        policy = policy_for(state, lockstep.cost, lockstep.drafter.lean is not None)
        async for _ in speculate(state, proposer, verifier, policy, Observer()):
            pass
    finally:
        lockstep.finished()
        lockstep.drafter.release(state.session_id)
        lockstep.target.release(state.session_id)
    return state


def run_lockstep(drafter: DrafterEngine, target: TargetEngine,
                 requests: list[GenerationRequest], eos_token_id: int | None,
                 max_batch: int | None = None,
                 before_flush: Callable[[Lockstep], None] | None = None) -> list[RequestState]:
    """Generate every request (``prompt_ids`` given; a seed when sampling) in lock-step;
    returns each request's final state (output, stats, repairs)."""
    if max_batch is not None and max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    lockstep = Lockstep(drafter, target, max_batch, before_flush)
    states = []
    for j, req in enumerate(requests):
        if req.prompt_ids is None:
            raise ValueError(f"request {j}: give prompt_ids")
        if req.temperature > 0 and req.seed is None:
            raise ValueError(f"request {j}: sampling needs a seed")
        states.append(new_state(req, req.prompt_ids, target.max_context, eos_token_id,
                                ("", ""), f"r{j}"))
    lockstep.live = len(states)

    async def main() -> list[RequestState]:
        return list(await asyncio.gather(*(_run(lockstep, s) for s in states)))

    return asyncio.run(main())

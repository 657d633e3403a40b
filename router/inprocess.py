"""The router in one process, against real drafter and target gRPC servers on loopback (no
Ray, no Serve): what the observability tests, the tracing-overhead benchmark and the docs'
trace rendering run. Same code path per round as the Serve deployment: the ``Router``, its
``StreamMux`` bidi streams, the drafter server and the target batcher.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from drafter_service.server import DrafterServicer, start_drafter_server
from router.leases import StaticPool
from router.router import Router, RouterChunk, RouterConfig
from specserve.api import GenerationRequest
from specserve.engine.drafter import DrafterEngine
from specserve.engine.target import TargetEngine
from target_service.server import TargetServicer, start_target_server

if TYPE_CHECKING:
    import grpc
    from opentelemetry.context import Context

    from specserve.engine.lean import LeanLlama
    from specserve.models.load import ModelPair


@dataclass
class InProcessService:
    router: Router
    drafter: DrafterEngine
    target: TargetEngine
    drafter_servicer: DrafterServicer
    target_servicer: TargetServicer
    _servers: list[grpc.aio.Server] = field(default_factory=list)
    _pools: list[StaticPool] = field(default_factory=list)

    async def generate(self, req: GenerationRequest, request_id: str | None = None,
                       parent: Context | None = None) -> list[RouterChunk]:
        return [c async for c in self.router.generate(req, request_id, parent)]

    async def close(self) -> None:
        for pool in self._pools:
            await pool.close()
        for servicer in (self.target_servicer, self.drafter_servicer):
            for task in (servicer._batcher, servicer._reaper):
                if task is not None:
                    task.cancel()
        await asyncio.gather(*(s.stop(None) for s in self._servers))


async def start_inprocess(pair: ModelPair, lean: LeanLlama | None = None, *,
                          target_cache_bytes: int = 512 << 20,
                          drafter_cache_bytes: int = 256 << 20,
                          batch_wait_s: float = 0.05,
                          draft_ahead: bool = False, guesses: int = 1) -> InProcessService:
    """Start a drafter and a target gRPC server on 127.0.0.1 and a router over them."""
    if lean is None and pair.drafter is not None:
        from specserve.engine.lean import LeanLlama

        lean = LeanLlama(pair.drafter)
    drafter = DrafterEngine(lean, drafter_cache_bytes, draft_ahead=draft_ahead,
                            guesses=guesses)
    target = TargetEngine(pair.target, target_cache_bytes)
    dserver, dport, dservicer = await start_drafter_server(drafter, replica="drafter-0",
                                                           batch_wait_s=batch_wait_s)
    tserver, tport, tservicer = await start_target_server(target, replica="target-0",
                                                          batch_wait_s=batch_wait_s)
    dpool = StaticPool("drafter", [f"127.0.0.1:{dport}"])
    tpool = StaticPool("target", [f"127.0.0.1:{tport}"])
    router = Router(
        pair.tokenizer,
        RouterConfig(max_context=pair.max_context, eos_token_id=pair.eos_token_id,
                     vocab_size=pair.vocab_size),
        drafters=dpool, targets=tpool,
        revisions=(pair.target_revision, pair.drafter_revision or ""))
    return InProcessService(router, drafter, target, dservicer, tservicer, [dserver, tserver],
                            [dpool, tpool])

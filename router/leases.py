"""Replica leases: which drafter / target replica serves a request, and its stream.

A lease pins a request's session to one replica (session affinity) and releases it at the
end. ``ServeLeasePool`` leases through a streaming Serve call (see ``deployments/app.py``);
``StaticPool`` leases from fixed addresses (tests and single-host setups).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from router.mux import StreamMux
from specserve.proto_gen.specserve.v1 import internal_pb2 as pb
from specserve.proto_gen.specserve.v1 import internal_pb2_grpc as pb_grpc

# per kind: the stream's method, how rows are packed into a message, how replies unpack
OPENERS = {
    "drafter": (lambda ch: pb_grpc.DrafterStub(ch).Propose,
                lambda rows: pb.ProposeBatch(rows=rows), lambda msg: msg.replies),
    "target": (lambda ch: pb_grpc.TargetStub(ch).Verify,
               lambda rows: pb.VerifyBatch(rows=rows), lambda msg: msg.replies),
}


@dataclass
class Lease:
    mux: StreamMux
    _release: Callable[[], None] | None = field(default=None, repr=False)

    def close(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None


class _MuxCache:
    def __init__(self, kind: str, secret: str | None = None, max_message_bytes: int = 32 << 20):
        self._open = OPENERS[kind]
        self._muxes: dict[str, StreamMux] = {}
        self._secret, self._max = secret, max_message_bytes

    def mux(self, address: str) -> StreamMux:
        m = self._muxes.get(address)
        if m is None or m.broken is not None:
            open_stream, pack, unpack = self._open
            m = StreamMux(address, open_stream, self._secret, self._max, pack, unpack)
            self._muxes[address] = m
        return m

    async def close(self) -> None:
        for m in self._muxes.values():
            await m.close()
        self._muxes.clear()


class StaticPool(_MuxCache):
    """Round-robin over fixed addresses."""

    def __init__(self, kind: str, addresses: list[str], secret: str | None = None):
        super().__init__(kind, secret)
        self._cycle = itertools.cycle(list(addresses))

    async def acquire(self, session_id: str) -> Lease:
        return Lease(self.mux(next(self._cycle)))

    async def profile(self) -> None:
        return None  # fixed addresses: no replica to ask


class ServeLeasePool(_MuxCache):
    """Leases through the deployment's streaming ``session`` method."""

    def __init__(self, handle, kind: str, secret: str | None = None,
                 max_message_bytes: int = 32 << 20):
        super().__init__(kind, secret, max_message_bytes)
        self._plain = handle
        self._handle = handle.options(stream=True)

    async def profile(self) -> object:
        """A replica's start-up cost profile (``specserve.engine.profile``)."""
        return await self._plain.profile.remote()

    async def acquire(self, session_id: str) -> Lease:
        gen = self._handle.session.remote(session_id)
        address = await gen.__anext__()
        return Lease(self.mux(address), gen.cancel)

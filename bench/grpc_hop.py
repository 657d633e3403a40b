"""The floor under the round path's hops: one loopback gRPC bidi stream between two processes,
the data plane's own messages and writer (``peers.packed``), no model, no batching.

A client process sends one VerifyBatch row at a time on an open stream to an echo server in
another process, which stamps when it read the row and when it handed back the reply (as the
replicas do, ``received_ns`` / ``sent_ns``); each call's send hop (client -> server) and
return hop (server -> client) are read off the stamps. Twice: back to back, and with an idle
``--gap-ms`` between calls (a round's model call: both processes sleep in between, as the
router and a replica do while the other computes). Prints one JSON object.

    .venv/bin/python bench/grpc_hop.py --calls 2000 --gap-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specserve.proto_gen.specserve.v1 import internal_pb2 as pb
from specserve.proto_gen.specserve.v1 import internal_pb2_grpc as pb_grpc
from specserve.service.peers import packed


class _Echo(pb_grpc.TargetServicer):
    async def Verify(self, request_iterator, context):
        replies: asyncio.Queue = asyncio.Queue()

        async def pump() -> None:
            async for batch in request_iterator:
                received = time.time_ns()
                for m in batch.rows:
                    replies.put_nowait(pb.VerifyReply(call_id=m.call_id, received_ns=received,
                                                      sent_ns=time.time_ns()))
            replies.put_nowait(None)

        task = asyncio.get_running_loop().create_task(pump())
        async for message in packed(replies, lambda rs: pb.VerifyReplies(replies=rs)):
            yield message
        await task


async def _serve() -> None:
    server = grpc.aio.server()
    pb_grpc.add_TargetServicer_to_server(_Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


def _pct(ms: list[float]) -> dict[str, float]:
    return {"p50_ms": round(float(np.percentile(ms, 50)), 3),
            "p99_ms": round(float(np.percentile(ms, 99)), 3)}


async def _client(port: int, calls: int, gap_s: float) -> dict:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        queue: asyncio.Queue = asyncio.Queue()
        stream = pb_grpc.TargetStub(channel).Verify(
            packed(queue, lambda rows: pb.VerifyBatch(rows=rows)))
        send, back = [], []
        for i in range(1, calls + 1):
            t0 = time.time_ns()
            await queue.put(pb.VerifyRequest(call_id=i, session_id="s", tokens=[1] * 8,
                                             draft_tokens=[2, 3]))
            (reply,) = (await stream.read()).replies
            t1 = time.time_ns()
            send.append((reply.received_ns - t0) / 1e6)
            back.append((t1 - reply.sent_ns) / 1e6)
            if gap_s:
                await asyncio.sleep(gap_s)
        await queue.put(None)
    warm = calls // 10  # the first calls open the connection
    return {"send": _pct(send[warm:]), "return": _pct(back[warm:]),
            "one_round_trip_p50_ms": round(float(np.percentile(
                np.add(send[warm:], back[warm:]), 50)), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--gap-ms", type=float, default=20.0)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        asyncio.run(_serve())
        return
    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE,
                              text=True)
    try:
        port = int(server.stdout.readline())
        out = {"back_to_back": asyncio.run(_client(port, args.calls, 0.0)),
               f"idle_{args.gap_ms:g}_ms_between_calls": asyncio.run(
                   _client(port, args.calls // 4, args.gap_ms / 1000))}
    finally:
        server.terminate()
        server.wait()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""Verify latency of the target, TP=1 vs TP=2 on CPU (gloo), batch 1 and 8, k=4.

    .venv/bin/python bench/tp_verify_latency.py [--iters 40] [--target builtin-target]

TP=1 is ``TargetEngine`` in this process. TP=2 runs the service's own code path without
Ray: rank 1 is a ``TPWorker`` in a subprocess (``setup`` + ``serve``), rank 0 a
``TPTargetEngine`` here (broadcast op, then the sharded forward with its collectives).
Steady state per step: every session sends 1 newly committed token + 4 drafts on a 64-token
prompt (the repair crops the previous drafts). Reported per step (median ms): the whole
verify, the op broadcast alone, the forward alone, and microbenchmarks of the collectives
one forward does (an all-reduce of [B, T, hidden] after each row-parallel projection, two
per layer, and the LM head's all-gather of the kept logits). Writes
bench-results/tp_verify_latency.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

K = 4
PROMPT = 64
BATCHES = (1, 8)


def _items(b: int, step: int, vocab: int) -> list:
    from specserve.core.sampling import SamplingParams
    from specserve.engine.target import VerifyItem

    out = []
    for i in range(b):
        prompt = [(7 * i + j) % (vocab - 1) + 1 for j in range(PROMPT)]
        committed = prompt + [(11 * i + s) % (vocab - 1) + 1 for s in range(step)]
        drafts = [(13 * i + step + d) % (vocab - 1) + 1 for d in range(K)]
        start = 0 if step == 0 else len(committed) - 1
        out.append(VerifyItem(f"s{b}-{i}", len(committed), start, committed[start:], drafts,
                              None, SamplingParams()))
    return out


def _timed(engine, iters: int) -> dict:
    """Median ms per verify step, and of its forward (``engine._forward``)."""
    inner = getattr(engine, "engine", engine)
    fwd: list[float] = []
    forward = inner._forward

    def timed_forward(rows):
        t = time.perf_counter()
        try:
            return forward(rows)
        finally:
            fwd.append(time.perf_counter() - t)

    inner._forward = timed_forward
    import torch.distributed as dist

    # time spent inside the forward's all-reduces (transformers calls dist.all_reduce after
    # each row-parallel projection), including waiting for the other rank to get there
    ar_s = [0.0]
    all_reduce = dist.all_reduce

    def timed_all_reduce(*a, **kw):
        t = time.perf_counter()
        try:
            return all_reduce(*a, **kw)
        finally:
            ar_s[0] += time.perf_counter() - t

    dist.all_reduce = timed_all_reduce
    res = {}
    for b in BATCHES:
        vocab = inner.vocab_size
        engine.verify(_items(b, 0, vocab))  # prefill
        for s in range(1, 4):
            engine.verify(_items(b, s, vocab))  # warm up
        fwd.clear()
        total, in_ar = [], []
        for s in range(4, 4 + iters):
            ar_s[0] = 0.0
            t = time.perf_counter()
            engine.verify(_items(b, s, vocab))
            total.append(time.perf_counter() - t)
            in_ar.append(ar_s[0])
        res[f"batch{b}"] = {"verify_ms": 1e3 * statistics.median(total),
                            "forward_ms": 1e3 * statistics.median(fwd),
                            "in_forward_all_reduce_ms": 1e3 * statistics.median(in_ar)}
    inner._forward = forward
    dist.all_reduce = all_reduce
    return res


def _collectives(b: int, hidden: int, vocab: int, layers: int, iters: int) -> dict:
    """Per-forward collective cost at batch b, measured on the live group (rank 0 view)."""
    import torch.distributed as dist

    from target_service.tp import _broadcast

    world = dist.get_world_size()
    t_new = K + 1
    x = torch.randn(b, t_new, hidden)
    shard = torch.randn(b, t_new, vocab // world)
    gathered = [torch.empty_like(shard) for _ in range(world)]
    ar, ag, bc = [], [], []
    for _ in range(iters):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(x)
        ar.append(time.perf_counter() - t)
        t = time.perf_counter()
        dist.all_gather(gathered, shard)
        ag.append(time.perf_counter() - t)
        t = time.perf_counter()
        _broadcast(("ping", [], None))
        bc.append(time.perf_counter() - t)
    ar_ms = 1e3 * statistics.median(ar)
    return {"all_reduce_ms": ar_ms, "all_reduces_per_forward": 2 * layers,
            "all_gather_logits_ms": 1e3 * statistics.median(ag),
            "collectives_per_forward_ms": 2 * layers * ar_ms + 1e3 * statistics.median(ag),
            "broadcast_ping_ms": 1e3 * statistics.median(bc)}


def _verify_op_broadcast(b: int, vocab: int, iters: int) -> float:
    from target_service.tp import _broadcast

    op = ("bench", [], _items(b, 10, vocab))
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        _broadcast(op)
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def rank_main(rank: int, world: int, port: int, target: str, iters: int, out: str) -> None:
    from specserve.models.load import resolve_model
    from target_service.tp import _broadcast, setup_rank

    path = str(resolve_model(target))
    engine = setup_rank(rank, world, "127.0.0.1", port, "gloo", 120.0, path, 1 << 30)
    cfg = engine.config
    if rank != 0:  # a TPWorker's loop, plus the microbenchmarks' partner side
        from target_service.tp import TPWorker

        w = TPWorker.__new__(TPWorker)
        w.rank, w.world, w.engine = rank, world, engine
        w._close = lambda: None  # keep the group for the microbenchmarks below
        w.serve()  # until rank 0 broadcasts "stop" (verify phase)
        import torch.distributed as dist

        for b in BATCHES:  # partner of _collectives / _verify_op_broadcast
            x = torch.randn(b, K + 1, cfg.hidden_size)
            shard = torch.randn(b, K + 1, cfg.vocab_size // world)
            gathered = [torch.empty_like(shard) for _ in range(world)]
            for _ in range(iters):
                dist.barrier()
                dist.all_reduce(x)
                dist.all_gather(gathered, shard)
                _broadcast(None)
            for _ in range(iters):
                _broadcast(None)
        dist.destroy_process_group()
        return
    from target_service.tp import TPTargetEngine

    tp = TPTargetEngine(engine, [None] * (world - 1), heartbeat_s=3600)
    res = _timed(tp, iters)
    with tp._lock:
        _broadcast(("stop", [], None))
    tp._closed.set()
    for b in BATCHES:
        res[f"batch{b}"].update(_collectives(b, cfg.hidden_size, cfg.vocab_size,
                                             cfg.num_hidden_layers, iters))
        res[f"batch{b}"]["verify_op_broadcast_ms"] = _verify_op_broadcast(b, cfg.vocab_size,
                                                                          iters)
    import torch.distributed as dist

    dist.destroy_process_group()
    Path(out).write_text(json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--target", default="builtin-target")
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "tp_verify_latency.json"))
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--rank-out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from specserve.engine.quiet import quiet_libraries

    quiet_libraries()
    if args.rank is not None:
        rank_main(args.rank, 2, args.port, args.target, args.iters, args.rank_out)
        return
    from specserve.engine.target import TargetEngine
    from specserve.models.load import load_model, resolve_model
    from target_service.tp import free_port

    tp1 = _timed(TargetEngine(load_model(resolve_model(args.target)), 1 << 30), args.iters)
    port = free_port("127.0.0.1")
    rank_out = Path(args.out).with_suffix(".rank0.tmp")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(port),
                               "--iters", str(args.iters), "--target", args.target,
                               "--rank-out", str(rank_out)], env=env) for r in range(2)]
    if any(p.wait(timeout=900) for p in procs):
        raise SystemExit("a TP=2 rank failed")
    tp2 = json.loads(rank_out.read_text())
    rank_out.unlink()
    result = {"target": args.target, "k": K, "prompt": PROMPT, "iters": args.iters,
              "torch_threads_per_rank": 1, "cpu_count": os.cpu_count(), "tp1": tp1, "tp2": tp2}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    for b in BATCHES:
        a, c = tp1[f"batch{b}"], tp2[f"batch{b}"]
        sys.stdout.write(
            f"batch {b}: TP=1 verify {a['verify_ms']:.2f} ms (forward {a['forward_ms']:.2f}) | "
            f"TP=2 verify {c['verify_ms']:.2f} ms (forward {c['forward_ms']:.2f}, op "
            f"broadcast {c['verify_op_broadcast_ms']:.2f}, collectives "
            f"{c['collectives_per_forward_ms']:.2f} = {c['all_reduces_per_forward']} x "
            f"all-reduce {c['all_reduce_ms']:.3f} + logits all-gather "
            f"{c['all_gather_logits_ms']:.3f}; inside the forward the all-reduces took "
            f"{c['in_forward_all_reduce_ms']:.2f} incl. waiting for rank 1) | TP=2/TP=1 "
            f"{c['verify_ms'] / a['verify_ms']:.2f}x\n")


if __name__ == "__main__":
    main()

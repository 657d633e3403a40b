"""Do the drafter and the target share this machine's CPU? The target's verify forward
(1 torch thread, one row, k = 2 drafts: the concurrency-1 round) timed alone and while a
drafter process drafts in a loop on its own thread, as draft-ahead makes it do while the
target verifies. On separate hardware (the design's cheap and large GPUs) the second number
equals the first; here it shows what drafting ahead costs the target.

The drafter process drafts k = 2 for one session per batch (the all-accepted and the
rejection outcomes of draft-ahead are 4 rows: ``--rows 4``) with ``--duty`` of its time
busy (1.0: back to back; 0.1: about what draft-ahead spends at concurrency 1). Prints one
JSON object: the verify forward's p50 / mean ms alone and under each load.

    .venv/bin/python bench/cpu_contention.py --calls 200
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _drafter_loop(drafter: str, target: str, rows: int, duty: float, stop, ready) -> None:
    import torch

    from specserve.core.sampling import SamplingParams
    from specserve.engine.drafter import DrafterEngine, ProposeItem
    from specserve.engine.lean import LeanLlama
    from specserve.models.load import load_pair

    torch.set_num_threads(1)
    pair = load_pair(target, drafter)
    engine = DrafterEngine(LeanLlama(pair.drafter))
    start = {f"s{i}": list(range(10 + i, 74 + i)) for i in range(rows)}
    committed = dict(start)
    ready.set()
    while not stop.is_set():
        t0 = time.perf_counter()
        items = [ProposeItem(s, len(c), 0, c, 2, "draft", SamplingParams())
                 for s, c in committed.items()]
        for s, o in zip(committed, engine.propose(items), strict=True):
            grown = [*committed[s], *o.draft_tokens[:1]]  # one accepted, then on
            committed[s] = grown if len(grown) < 256 else start[s]
        busy = time.perf_counter() - t0
        if duty < 1.0:
            time.sleep(busy * (1 - duty) / duty)


def _verify_times(engine, calls: int) -> list[float]:
    from specserve.contract import VerifyItem
    from specserve.core.sampling import SamplingParams
    from specserve.engine.profile import _Rows

    sessions = _Rows(1, int(engine.vocab_size), 64)
    (sid,) = sessions.ids
    first = engine.verify([VerifyItem(sid, 64, 0, sessions.committed[sid], [], None,
                                      SamplingParams(seed=0))])  # the prefill, untimed
    assert not first[0].cache_miss
    out = []
    for _ in range(calls):
        items = sessions.items(1, 2)
        t0 = time.perf_counter()
        (o,) = engine.verify(items)
        out.append(time.perf_counter() - t0)
        assert not o.cache_miss
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="bench-target")
    ap.add_argument("--drafter", default="bench-drafter")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--duty", type=float, nargs="+", default=[0.1, 0.3, 1.0])
    args = ap.parse_args()

    import torch

    from specserve.engine.target import TargetEngine
    from specserve.models.load import load_pair

    torch.set_num_threads(1)
    pair = load_pair(args.target, args.drafter)

    def measure() -> dict:
        times = _verify_times(TargetEngine(pair.target, 2 << 30), args.calls)
        return {"p50_ms": round(1000 * statistics.median(times), 3),
                "mean_ms": round(1000 * statistics.fmean(times), 3)}

    out = {"alone": measure()}
    ctx = mp.get_context("spawn")
    for duty in args.duty:
        stop, ready = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=_drafter_loop, args=(args.drafter, args.target, args.rows,
                                                       duty, stop, ready))
        proc.start()
        ready.wait(120)
        out[f"drafter_duty_{duty}"] = measure()
        stop.set()
        proc.join(30)
    out["alone_again"] = measure()
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""One batched drafter propose for B sessions vs B one-at-a-time proposes (issue 14).

    .venv/bin/python bench/drafter_batch.py [--reps 20] [--threads 1] [--prompt 64]

The bench pair's drafter (``bench-drafter``, falls back to ``builtin-drafter`` when it is
not built). For B in 1, 4, 16 sessions with a ``--prompt``-token context, each rep is one
steady-state round: every session's committed list grew by one accepted draft and one other
token (a 2-token repair), then k = 4 drafts for all B sessions: one ``DrafterEngine.propose``
of B items, vs B calls of one item on a second engine in the same state. Greedy and seeded
sampling (sampled rows are computed batch-invariantly, see ``specserve/engine/lean.py``).
Prints one JSON line per (B, sampling): median ms of each and their ratio. The drafts of
both ways are checked equal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

K = 4


def _lean():
    from specserve.engine.lean import LeanLlama
    from specserve.models.load import load_model, resolve_model

    try:
        name, model = "bench-drafter", load_model(resolve_model("bench-drafter"))
    except Exception as e:  # not built here
        print(f"bench-drafter unavailable ({e}); using builtin-drafter", file=sys.stderr)
        name, model = "builtin-drafter", load_model(resolve_model("builtin-drafter"))
    return name, LeanLlama(model)


def _items(committed: dict[str, list[int]], sampled: bool) -> list:
    from specserve.core.sampling import SamplingParams
    from specserve.engine.drafter import ProposeItem

    out = []
    for i, (sid, toks) in enumerate(committed.items()):
        s = SamplingParams(0.8, 0, 0.95, 100 + i) if sampled else SamplingParams()
        out.append(ProposeItem(sid, len(toks), 0, list(toks), K, "draft", s))
    return out


def _run(lean, b: int, sampled: bool, reps: int, prompt: int) -> dict:
    from specserve.engine.drafter import DrafterEngine

    vocab = int(lean.config.vocab_size)
    gen = torch.Generator().manual_seed(b)
    committed = {f"s{i}": torch.randint(1, vocab, (prompt,), generator=gen).tolist()
                 for i in range(b)}
    batched, single = DrafterEngine(lean), DrafterEngine(lean)
    t_batch, t_single = [], []
    for rep in range(reps + 2):  # 2 warm-up rounds (the first one is the prefill)
        items = _items(committed, sampled)
        t0 = time.perf_counter()
        out = batched.propose(items)
        t1 = time.perf_counter()
        alone = [single.propose([it])[0] for it in items]
        t2 = time.perf_counter()
        if [o.draft_tokens for o in out] != [o.draft_tokens for o in alone]:
            raise AssertionError("batched drafts differ from one-at-a-time drafts")
        if rep >= 2:
            t_batch.append((t1 - t0) * 1e3)
            t_single.append((t2 - t1) * 1e3)
        for sid, o in zip(committed, out, strict=True):  # accept 1 draft, then another token
            committed[sid] += [o.draft_tokens[0], (o.draft_tokens[1] + 1) % vocab]
    mb, ms = statistics.median(t_batch), statistics.median(t_single)
    return {"sessions": b, "k": K, "sampling": "seeded" if sampled else "greedy",
            "batched_ms": round(mb, 3), "one_at_a_time_ms": round(ms, 3),
            "speedup": round(ms / mb, 2), "reps": reps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--sessions", default="1,4,16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    name, lean = _lean()
    for b in [int(x) for x in args.sessions.split(",")]:
        for sampled in (False, True):
            row = _run(lean, b, sampled, args.reps, args.prompt)
            print(json.dumps({"drafter": name, "threads": args.threads, **row}), flush=True)


if __name__ == "__main__":
    main()

"""The target engine's verify against a plain Hugging Face forward of the same batch.

For B rows that each hold a ``--context``-token cache, one step feeds every row ``k + 1``
new tokens (k drafts) and reads their logits. The plain forward is the floor: a
``DynamicCache`` already holding the rows' past (equal lengths, no padding), one
``model(...)`` call, then the cache cropped back. The engine's step is a whole
``TargetEngine.verify`` (repair, forward, KV bookkeeping, the acceptance decision), its
rows' caches rolled back by resending the same tokens window each time.

    .venv/bin/python bench/engine_vs_hf.py --rows 1,4,16 --k 0 --reps 10

Prints one JSON line per row count: median ms of each and their ratio; the goal of issue 14
is ``engine / hf <= 1.15``. Both run in this process with the same torch threads, alternated
rep by rep so machine noise hits both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import DynamicCache

from specserve.contract import VerifyItem
from specserve.core.sampling import SamplingParams
from specserve.engine.target import TargetEngine
from specserve.models.load import load_model, resolve_model


def _items(rows: int, context: int, k: int, vocab: int, start: int) -> list[VerifyItem]:
    g = torch.Generator().manual_seed(0)
    out = []
    for r in range(rows):
        toks = torch.randint(1, vocab, (context + 1,), generator=g).tolist()
        drafts = torch.randint(1, vocab, (k,), generator=g).tolist()
        out.append(VerifyItem(f"s{r}", context + 1, start, toks[start:], drafts,
                              None, SamplingParams()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="bench-target")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--k", type=int, default=0)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(resolve_model(args.model))
    vocab = int(model.config.vocab_size)
    for rows in [int(x) for x in args.rows.split(",")]:
        engine = TargetEngine(model, cache_budget_bytes=4 << 30)
        engine.verify(_items(rows, args.context, args.k, vocab, 0))  # prefill the sessions
        step = _items(rows, args.context, args.k, vocab, args.context)  # feeds k + 1 tokens
        ids = torch.randint(1, vocab, (rows, args.context))
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            model(input_ids=ids, cache=cache, use_cache=True)
            new = torch.randint(1, vocab, (rows, args.k + 1))
            pos = torch.arange(args.context, args.context + args.k + 1).expand(rows, -1)
        eng, hf = [], []
        for rep in range(args.reps + 2):
            t0 = time.perf_counter()
            engine.verify(step)
            t1 = time.perf_counter()
            with torch.inference_mode():
                model(input_ids=new, position_ids=pos, cache=cache, use_cache=True,
                      logits_to_keep=args.k + 1)
                cache.crop(-(args.k + 1))
            t2 = time.perf_counter()
            if rep >= 2:  # warm-up
                eng.append((t1 - t0) * 1e3)
                hf.append((t2 - t1) * 1e3)
        e, h = statistics.median(eng), statistics.median(hf)
        print(json.dumps({"rows": rows, "context": args.context, "k": args.k,
                          "threads": args.threads, "engine_ms": round(e, 2),
                          "hf_ms": round(h, 2), "engine_over_hf": round(e / h, 3)}), flush=True)


if __name__ == "__main__":
    main()

"""A burst of prompts arriving at once at the target engine: how long until all are
answered, and the mean time to each prompt's answer (its first token), per step budget.

``--prompts`` prompts of ``--min``-``--max`` tokens arrive together with nothing decoding;
each case feeds them over as many ``verify`` steps as it takes (a pending row is sent again,
as the target service carries it):

* ``whole``: no chunks (``prefill_chunk=None``): every prompt in one step;
* ``chunk<C>_beside_decoder``: chunks of ``--chunk`` beside one 1-token decoding row (what a
  burst gets when the level's first request already decodes);
* ``budget<B>``: ``prefill_budget=B`` (with ``prefill_chunk=--chunk``), nothing decoding.

Cases alternate rep by rep; prints one JSON line with the medians and each case's ratio to
``whole`` from the same run.

    PYTHONPATH=<checkout> .venv/bin/python bench/prefill_burst.py --model bench-target
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from specserve.contract import VerifyItem
from specserve.core.sampling import SamplingParams
from specserve.engine.target import TargetEngine
from specserve.models.load import load_model, resolve_model


def _burst(engine: TargetEngine, prompts: list[list[int]], chunk: int | None,
           budget: int | None, decoder: bool) -> tuple[float, float, int]:
    """(seconds until all answered, mean seconds to an answer, steps)."""
    tag = random.random()
    items = [VerifyItem(f"p{tag}-{i}", len(p), 0, p, [], None, SamplingParams())
             for i, p in enumerate(prompts)]
    answered: list[float] = []
    steps, dec = 0, [1]
    t0 = time.perf_counter()
    while items:
        extra = [VerifyItem(f"d{tag}", len(dec), len(dec) - 1, dec[-1:], [], None,
                            SamplingParams())] if decoder else []
        outs = engine.verify([*items, *extra], chunk, budget)[: len(items)]
        dec.append(1)
        steps += 1
        now = time.perf_counter() - t0
        answered += [now for o in outs if not o.pending]
        items = [it for it, o in zip(items, outs, strict=True) if o.pending]
    for i in range(len(prompts)):
        engine.release(f"p{tag}-{i}")
    engine.release(f"d{tag}")
    return answered[-1], statistics.mean(answered), steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench-target", help="target model (name or path)")
    ap.add_argument("--prompts", type=int, default=23, help="prompts in the burst")
    ap.add_argument("--min", type=int, default=100, help="shortest prompt (tokens)")
    ap.add_argument("--max", type=int, default=200, help="longest prompt (tokens)")
    ap.add_argument("--chunk", type=int, default=64, help="prefill_chunk")
    ap.add_argument("--budgets", default="256,512,1024", help="prefill_budget values")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(resolve_model(args.model))
    engine = TargetEngine(model, cache_budget_bytes=1 << 31)
    rnd = random.Random(0)
    vocab = int(model.config.vocab_size)
    prompts = [[rnd.randrange(vocab) for _ in range(rnd.randint(args.min, args.max))]
               for _ in range(args.prompts)]
    cases = {"whole": (None, None, False),
             f"chunk{args.chunk}_beside_decoder": (args.chunk, None, True)}
    cases |= {f"budget{b}": (args.chunk, int(b), False) for b in args.budgets.split(",")}
    _burst(engine, prompts[:2], None, None, False)  # warm-up
    got: dict[str, list[tuple[float, float, int]]] = {c: [] for c in cases}
    for _ in range(args.reps):
        for name, case in cases.items():
            got[name].append(_burst(engine, prompts, *case))
    out: dict = {"prompts": args.prompts, "tokens": sum(map(len, prompts)), "reps": args.reps}
    whole = [statistics.median(v[j] for v in got["whole"]) for j in (0, 1)]
    for name, vals in got.items():
        last, mean = (statistics.median(v[j] for v in vals) for j in (0, 1))
        out[name] = {"all_answered_s": round(last, 2), "mean_answer_s": round(mean, 2),
                     "steps": vals[0][2], "all_vs_whole": round(last / whole[0], 3),
                     "mean_vs_whole": round(mean / whole[1], 3)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

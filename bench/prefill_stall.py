"""What arriving prompts cost in the target engine: one beside decoding rows, or a burst.

``--rows`` sessions hold a ``--past``-token cache and decode (``k`` drafts + 1 new token a
row a step). A new session's ``--prompt``-token prompt arrives beside them; it is fed in
one step (``whole``) or, where the engine has ``prefill_chunk``, a ``--chunk`` a step
until its verdict (``chunked``). Per case, the median over ``--reps`` of: the longest step
with the prompt in it and the prompt's extra time over all its steps (each step minus a
plain decoding step measured right before it). Cases are alternated rep by rep.

    PYTHONPATH=<checkout> .venv/bin/python bench/prefill_stall.py --model bench-target

Run it on two checkouts (before / after) in turn: prints one JSON line.

``--burst N``: instead, N prompts of ``--min``-``--max`` tokens arrive together with nothing
decoding, and each case feeds them over as many steps as it takes (a pending row is sent
again, as the target service carries it): ``whole`` (no chunks: every prompt in one
step), ``chunk<C>_beside_decoder`` (chunks of ``--chunk`` beside one 1-token decoding row:
what a burst gets when the level's first request already decodes) and ``budget<B>`` per
``--budgets`` (``prefill_budget=B``, nothing decoding). Per case, the medians of the time
until all are answered and of the mean time to an answer (a prompt's first token), and
their ratios to ``whole`` from the same run.

    PYTHONPATH=<checkout> .venv/bin/python bench/prefill_stall.py --burst 23
"""

from __future__ import annotations

import argparse
import inspect
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


def _bursts(engine: TargetEngine, args: argparse.Namespace, rnd: random.Random,
            vocab: int) -> dict:
    prompts = [[rnd.randrange(vocab) for _ in range(rnd.randint(args.min, args.max))]
               for _ in range(args.burst)]
    cases = {"whole": (None, None, False),
             f"chunk{args.chunk}_beside_decoder": (args.chunk, None, True)}
    cases |= {f"budget{b}": (args.chunk, int(b), False) for b in args.budgets.split(",")}
    _burst(engine, prompts[:2], None, None, False)  # warm-up
    got: dict[str, list[tuple[float, float, int]]] = {c: [] for c in cases}
    for _ in range(args.reps):
        for name, case in cases.items():
            got[name].append(_burst(engine, prompts, *case))
    out: dict = {"prompts": args.burst, "tokens": sum(map(len, prompts)), "reps": args.reps}
    whole = [statistics.median(v[j] for v in got["whole"]) for j in (0, 1)]
    for name, vals in got.items():
        last, mean = (statistics.median(v[j] for v in vals) for j in (0, 1))
        out[name] = {"all_answered_s": round(last, 2), "mean_answer_s": round(mean, 2),
                     "steps": vals[0][2], "all_vs_whole": round(last / whole[0], 3),
                     "mean_vs_whole": round(mean / whole[1], 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench-target", help="target model (name or path)")
    ap.add_argument("--rows", type=int, default=32, help="decoding rows")
    ap.add_argument("--past", type=int, default=300, help="their cached tokens")
    ap.add_argument("--k", type=int, default=2, help="drafts per decoding row")
    ap.add_argument("--prompt", type=int, default=400, help="the arrival's prompt tokens")
    ap.add_argument("--chunk", type=int, default=64, help="prefill_chunk (if supported)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--burst", type=int, default=0, help="prompts arriving together (0: the "
                    "arrival beside decoding rows)")
    ap.add_argument("--min", type=int, default=100, help="--burst: shortest prompt (tokens)")
    ap.add_argument("--max", type=int, default=200, help="--burst: longest prompt (tokens)")
    ap.add_argument("--budgets", default="256,512,1024", help="--burst: prefill_budget values")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(resolve_model(args.model))
    engine = TargetEngine(model, cache_budget_bytes=1 << 31)
    rnd = random.Random(0)
    vocab = int(model.config.vocab_size)
    if args.burst:
        print(json.dumps(_bursts(engine, args, rnd, vocab)))
        return
    seqs = {f"s{i}": [rnd.randrange(vocab) for _ in range(args.past)] for i in range(args.rows)}
    engine.verify([VerifyItem(s, len(t), 0, t, [], None, SamplingParams())
                   for s, t in seqs.items()])
    chunks = "prefill_chunk" in inspect.signature(engine.verify).parameters

    def decoding() -> list[VerifyItem]:
        out = []
        for sid, t in seqs.items():
            t.append(rnd.randrange(vocab))
            out.append(VerifyItem(sid, len(t), len(t) - 1, t[-1:],
                                  [rnd.randrange(vocab) for _ in range(args.k)], None,
                                  SamplingParams()))
        return out

    def timed(items: list[VerifyItem], *chunk: int) -> tuple[float, list]:
        t0 = time.perf_counter()
        outs = engine.verify(items, *chunk)
        return time.perf_counter() - t0, outs

    def arrival(chunk: tuple[int, ...]) -> tuple[float, float]:
        prompt = [rnd.randrange(vocab) for _ in range(args.prompt)]
        new = VerifyItem(f"new{rnd.random()}", len(prompt), 0, prompt, [], None,
                         SamplingParams())
        longest = extra = 0.0
        while True:
            plain, _ = timed(decoding(), *chunk)
            dt, outs = timed([*decoding(), new], *chunk)
            longest, extra = max(longest, dt), extra + dt - plain
            if not getattr(outs[-1], "pending", False):
                break
        engine.release(new.session_id)
        return longest, extra

    cases = {"whole": ()} | ({"chunked": (args.chunk,)} if chunks else {})
    got: dict[str, list[tuple[float, float]]] = {c: [] for c in cases}
    plain = [timed(decoding())[0] for _ in range(args.reps)]
    for _ in range(args.reps):
        for name, chunk in cases.items():
            got[name].append(arrival(chunk))
    out = {"rows": args.rows, "past": args.past, "k": args.k, "prompt": args.prompt,
           "chunk": args.chunk if chunks else None,
           "decoding_step_ms": round(statistics.median(plain) * 1e3, 1)}
    for name, vals in got.items():
        out[f"{name}_longest_step_ms"] = round(statistics.median(v[0] for v in vals) * 1e3, 1)
        out[f"{name}_extra_ms"] = round(statistics.median(v[1] for v in vals) * 1e3, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Reference points outside the service, on the same model pair, batch 1, greedy.

- ``hf_generate``: Hugging Face ``generate`` (plain greedy decoding).
- ``hf_assisted``: Hugging Face ``generate(assistant_model=drafter)``.
- ``naive``: the textbook draft-then-verify loop that recomputes the whole prefix every
  round (no KV cache in drafter or target). A baseline written to be simple, not fast.
- ``engine_off`` / ``engine_draft_k*``: specserve's single-process engine.
"""

from __future__ import annotations

import time

import torch

from specserve.api import GenerationRequest
from specserve.engine.generator import SpeculativeGenerator


@torch.inference_mode()
def naive_speculative(pair, ids: list[int], max_tokens: int, k: int) -> list[int]:
    seq = list(ids)
    out: list[int] = []
    eos = pair.eos_token_id
    while len(out) < max_tokens:
        kk = min(k, max_tokens - len(out) - 1)
        drafts: list[int] = []
        for _ in range(kk):  # the drafter recomputes the full prefix for every token
            logits = pair.drafter(torch.tensor([seq + drafts])).logits[0, -1]
            drafts.append(int(logits.argmax()))
        # the target recomputes the full prefix plus the drafts
        logits = pair.target(torch.tensor([seq + drafts])).logits[0, len(seq) - 1 :]
        target_choice = logits.argmax(-1).tolist()
        n = 0
        while n < kk and drafts[n] == target_choice[n]:
            n += 1
        new = [*drafts[:n], target_choice[n]]
        for t in new:
            if len(out) < max_tokens:
                out.append(t)
                seq.append(t)
                if t == eos:
                    return out
    return out


def run_baselines(gen: SpeculativeGenerator, prompts: list[tuple[str, int]], ks: list[int],
                  bar=None) -> dict:
    pair = gen.pair
    names = ["hf_generate", "hf_assisted", "engine_off", *[f"engine_draft_k{k}" for k in ks],
             f"naive_k{ks[0]}"]
    res = {n: {"tokens": 0, "seconds": 0.0, "outputs": []} for n in names}
    for text, max_tokens in prompts:
        ids = gen.encode(GenerationRequest(prompt=text))
        for name in names:
            t = time.perf_counter()
            if name.startswith("hf_"):
                kw = {"assistant_model": pair.drafter} if name == "hf_assisted" else {}
                out = pair.target.generate(torch.tensor([ids]), max_new_tokens=max_tokens,
                                           do_sample=False, pad_token_id=pair.eos_token_id,
                                           **kw)[0, len(ids):].tolist()
                if pair.eos_token_id in out:
                    out = out[: out.index(pair.eos_token_id) + 1]
            elif name.startswith("naive_k"):
                out = naive_speculative(pair, ids, max_tokens, int(name.removeprefix("naive_k")))
            else:
                spec, k = ("off", 0) if name == "engine_off" else (
                    "draft", int(name.removeprefix("engine_draft_k")))
                _, out, _ = gen.generate(GenerationRequest(prompt_ids=ids, max_tokens=max_tokens,
                                                           spec=spec, k=k))
            res[name]["seconds"] += time.perf_counter() - t
            res[name]["tokens"] += len(out)
            res[name]["outputs"].append(out)
            if bar is not None:
                bar.update()
    return {n: {"tokens_per_s": round(r["tokens"] / r["seconds"], 2), "outputs": r["outputs"]}
            for n, r in res.items()}

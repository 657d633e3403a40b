"""Single-process benchmark at batch 1: spec-off vs draft (K sweep) vs ngram, and Hugging Face
``generate`` plain and with ``assistant_model`` on the same pair, interleaved per prompt in one
run (this machine is shared and noisy: only same-run ratios mean anything).
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.api import GenerationRequest
from specserve.bench.analysis import plan_mix
from specserve.contract import VerifyItem
from specserve.core.sampling import SamplingParams
from specserve.engine.generator import SpeculativeGenerator
from specserve.models.corpus import heldout_prompts
from specserve.models.load import load_pair


@torch.inference_mode()
def measure_costs(gen: SpeculativeGenerator, prompt_ids: list[int], ks: list[int],
                  reps: int = 25) -> dict:
    """Median cost of one drafter step (lean, 1 token) and of one target forward over n
    tokens. Sizes are interleaved within each repetition so machine noise hits all alike."""
    lean = gen.lean
    ctx = prompt_ids[:64]
    cache = lean.new_cache()
    lean.forward(cache, torch.tensor(ctx))

    def draft_step():
        cache.crop(len(ctx))
        lean.forward(cache, torch.tensor([ctx[-1]]))

    target = gen.target
    greedy = SamplingParams()

    def target_block(n: int):
        def run():  # the cache keeps ctx[:-1]: feeds the last token + n - 1 drafts
            target.verify([VerifyItem("cost", len(ctx), 0, ctx, [ctx[0]] * (n - 1), None,
                                      greedy)])
        return run

    target_block(1)()

    fns = {"drafter_step_s": draft_step}
    for n in sorted({1, *(k + 1 for k in ks)}):
        fns[f"target_forward_{n}_s"] = target_block(n)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(reps + 1):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            if rep:  # the first repetition warms up
                times[name].append(time.perf_counter() - t)
    out = {name: statistics.median(ts) for name, ts in times.items()}
    out["cost_ratio_target_over_drafter"] = out["target_forward_1_s"] / out["drafter_step_s"]
    return out


def ideal_speedup(tokens_per_round: float, k: int, costs: dict) -> float:
    """Speedup over plain decoding with zero overhead, from measured acceptance and costs:
    tokens per round x cost of a 1-token target step / (k drafter steps + a (k+1)-token
    verify)."""
    round_cost = k * costs["drafter_step_s"] + costs[f"target_forward_{k + 1}_s"]
    return tokens_per_round * costs["target_forward_1_s"] / round_cost


def run_single_process_bench(
    target: str, drafter: str, ks: list[int], n_prompts: int, max_tokens: int, out_dir: Path,
    with_hf: bool = True, ngram_k: int = 4,
) -> dict:
    pair = load_pair(target, drafter)
    gen = SpeculativeGenerator(pair)
    prompts = heldout_prompts(n=n_prompts)
    configs: list[tuple[str, dict]] = [("off", {"spec": "off", "k": 0})]
    configs += [(f"draft_k{k}", {"spec": "draft", "k": k}) for k in ks]
    configs.append((f"ngram_k{ngram_k}", {"spec": "ngram", "k": ngram_k}))
    configs.append(("auto", {"spec": "auto", "k": max([*ks, ngram_k])}))  # k: its K_max
    if with_hf:
        configs += [("hf_generate", {}), ("hf_assisted", {})]
    results = {name: {"tokens": 0, "seconds": 0.0, "rounds": 0, "emitted": 0,
                      "propose_s": 0.0, "verify_s": 0.0, "outputs": [], "stats": []}
               for name, _ in configs}

    def hf(ids: list[int], assisted: bool) -> list[int]:
        kwargs = dict(max_new_tokens=max_tokens, do_sample=False,
                      pad_token_id=pair.tokenizer.eos_token_id)
        if assisted:
            kwargs["assistant_model"] = pair.drafter
        out = pair.target.generate(torch.tensor([ids]), **kwargs)
        return out[0, len(ids):].tolist()

    # warm-up
    gen.generate(GenerationRequest(prompt=prompts[0], max_tokens=8, spec="draft", k=4))
    bar = tqdm(total=len(prompts) * len(configs), desc="bench", unit="run")
    for prompt in prompts:
        ids = gen.encode(GenerationRequest(prompt=prompt))
        for name, cfg in configs:
            r = results[name]
            t = time.perf_counter()
            if name.startswith("hf_"):
                out = hf(ids, assisted=name == "hf_assisted")
                r["seconds"] += time.perf_counter() - t
            else:
                _, out, st = gen.generate(GenerationRequest(
                    prompt_ids=ids, max_tokens=max_tokens, **cfg))
                r["seconds"] += st.total_s
                r["rounds"] += st.acceptance.rounds
                r["emitted"] += st.acceptance.emitted_tokens
                r["propose_s"] += st.propose_s
                r["verify_s"] += st.verify_s
                r["stats"].append(st.to_dict())
            r["tokens"] += len(out)
            r["outputs"].append(out)
            bar.update()
    bar.close()

    costs = measure_costs(gen, gen.encode(GenerationRequest(prompt=prompts[0])), ks)
    base = results["off"]["tokens"] / results["off"]["seconds"]
    summary = {"costs": {k: round(v, 6) for k, v in costs.items()}, "configs": {}}
    mismatches = 0
    for name, _ in configs:
        r = results[name]
        tps = r["tokens"] / r["seconds"]
        row = {"tokens_per_s": round(tps, 2), "speedup_vs_off": round(tps / base, 3)}
        same = sum(o == ref for o, ref in zip(r["outputs"], results["off"]["outputs"],
                                              strict=True))
        row["outputs_equal_to_off"] = f"{same}/{len(prompts)}"
        mismatches += len(prompts) - same
        if r["rounds"]:
            row["tokens_per_round"] = round(r["emitted"] / r["rounds"], 3)
            row["propose_ms_per_round"] = round(1000 * r["propose_s"] / r["rounds"], 3)
            row["verify_ms_per_round"] = round(1000 * r["verify_s"] / r["rounds"], 3)
            row["overhead_ms_per_round"] = round(
                1000 * (r["seconds"] - r["propose_s"] - r["verify_s"]) / r["rounds"], 3)
        if name.startswith("draft_k"):
            k = int(name.removeprefix("draft_k"))
            ideal = ideal_speedup(r["emitted"] / r["rounds"], k, costs)
            row["ideal_speedup"] = round(ideal, 3)
            row["efficiency"] = round(tps / base / ideal, 3)
        if name == "auto":
            row["plans"] = plan_mix(r["stats"])
        summary["configs"][name] = row
    summary["greedy_mismatches_vs_off"] = mismatches
    report = {
        "benchmark": "single-process, batch 1, greedy",
        "pair": {"target": target, "drafter": drafter, "target_revision": pair.target_revision,
                 "drafter_revision": pair.drafter_revision,
                 "target_parameters": sum(p.numel() for p in pair.target.parameters()),
                 "drafter_parameters": sum(p.numel() for p in pair.drafter.parameters())},
        "workload": {"prompts": len(prompts), "max_tokens": max_tokens,
                     "source": "held-out Python stdlib files"},
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "processor": platform.processor()},
        "summary": summary,
        "outputs": {name: results[name]["outputs"] for name, _ in configs},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "single_process.json").write_text(json.dumps(report, indent=1) + "\n")
    return report

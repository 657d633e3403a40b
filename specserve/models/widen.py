"""The benchmark pair: a *cost-scaled* target, widened function-preservingly.

On this CPU a model we can train in minutes is so small that per-call overhead dominates its
forward, which makes speculation look worse than it is on real hardware. The bench target
is the trained target with (a) its MLPs widened, the new hidden units feeding zero columns
of ``down_proj``, and (b) extra decoder layers whose ``o_proj`` and ``down_proj`` are zero, so
they add exactly nothing to the residual stream (Net2Net-style). Its logits equal the trained
target's (checked at build time and recorded), while a forward costs what a model of its
size costs. It is labelled "cost-scaled" in its manifest and in every report.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


@torch.no_grad()
def widen_llama(model, layers: int, intermediate: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = model.config
    if layers < cfg.num_hidden_layers or intermediate < cfg.intermediate_size:
        raise ValueError("the cost-scaled target can only grow")
    new_cfg = LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": layers,
                             "intermediate_size": intermediate})
    torch.manual_seed(seed)
    wide = LlamaForCausalLM(new_cfg).float().eval()
    src, dst = model.model, wide.model
    dst.embed_tokens.weight.copy_(src.embed_tokens.weight)
    dst.norm.weight.copy_(src.norm.weight)
    i0 = cfg.intermediate_size
    for j, layer in enumerate(dst.layers):
        if j < cfg.num_hidden_layers:
            old = src.layers[j]
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, name).weight.copy_(getattr(old.self_attn, name).weight)
            layer.input_layernorm.weight.copy_(old.input_layernorm.weight)
            layer.post_attention_layernorm.weight.copy_(old.post_attention_layernorm.weight)
            layer.mlp.gate_proj.weight[:i0].copy_(old.mlp.gate_proj.weight)
            layer.mlp.up_proj.weight[:i0].copy_(old.mlp.up_proj.weight)
            layer.mlp.down_proj.weight.zero_()
            layer.mlp.down_proj.weight[:, :i0].copy_(old.mlp.down_proj.weight)
        else:  # an extra layer: computes, contributes zero
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    if not new_cfg.tie_word_embeddings:
        wide.lm_head.weight.copy_(model.lm_head.weight)
    return wide


def build_bench_pair(source: Path, out: Path, layers: int = 12, intermediate: int = 4096) -> dict:
    from specserve.models.load import load_model
    from specserve.models.revision import model_revision

    target = load_model(source / "target")
    wide = widen_llama(target, layers, intermediate)
    ids = torch.randint(0, target.config.vocab_size, (2, 64), generator=torch.Generator()
                        .manual_seed(0))
    max_diff = (wide(ids).logits - target(ids).logits).abs().max().item()
    out.mkdir(parents=True, exist_ok=True)
    wide.to(torch.float16).save_pretrained(out / "target")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / "target" / name).exists():
            shutil.copy(source / "target" / name, out / "target" / name)
    if (out / "drafter").exists():
        shutil.rmtree(out / "drafter")
    shutil.copytree(source / "drafter", out / "drafter")
    src_manifest = json.loads((source / "manifest.json").read_text())
    manifest = {
        "preset": "bench",
        "note": ("COST-SCALED target: the trained target widened function-preservingly "
                 "(zero-output extra layers and MLP units); its outputs equal the trained "
                 "target's, its compute is that of its parameter count"),
        "source": str(source),
        "source_target_revision": src_manifest["target"]["revision"],
        "max_logit_diff_vs_source": max_diff,
        "target": {
            "path": "target",
            "parameters": sum(p.numel() for p in wide.parameters()),
            "trained_parameters": src_manifest["target"]["parameters"],
            "layers": layers,
            "intermediate_size": intermediate,
            "revision": model_revision(out / "target"),
        },
        "drafter": {**src_manifest["drafter"], "revision": model_revision(out / "drafter")},
        "corpus": src_manifest["corpus"],
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest

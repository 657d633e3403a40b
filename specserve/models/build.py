"""Deterministic builder of a real model pair: BPE tokenizer, Llama target, distilled drafter.

Everything is trained here, offline, on the Python standard library sources (see
``corpus.py``), with fixed seeds, and saved with ``save_pretrained`` so the pair loads through
``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` like any Hugging Face checkpoint.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field
from tqdm import tqdm

from specserve.models.corpus import CorpusFile, corpus_hash, list_corpus
from specserve.models.revision import model_revision

EOS = "<|endoftext|>"


class ModelShape(BaseModel):
    hidden_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)


class BuildConfig(BaseModel):
    """What `specserve models build` trains. Presets below; every field overridable."""

    vocab_size: int = Field(4096, ge=300, description="BPE vocabulary size (incl. 256 bytes)")
    context: int = Field(256, ge=16, description="training sequence length")
    max_position_embeddings: int = Field(1024, description="context limit the models accept")
    target: ModelShape
    drafter: ModelShape
    target_steps: int = Field(gt=0)
    drafter_steps: int = Field(gt=0)
    batch_size: int = Field(16, gt=0)
    lr: float = 3e-3
    seed: int = 1234
    max_files: int | None = Field(None, description="use only the first N corpus files")
    tokenizer_chars: int = Field(4_000_000, description="characters used to train the BPE")
    dtype: Literal["float16", "bfloat16", "float32"] = Field(
        "float16", description="storage dtype; computation is always fp32 on CPU"
    )


PRESETS: dict[str, BuildConfig] = {
    # The committed pair (specserve/assets/builtin): ~3.6 M target, ~0.95 M drafter.
    "builtin": BuildConfig(
        target=ModelShape(
            hidden_size=256, num_hidden_layers=3, num_attention_heads=4, intermediate_size=768
        ),
        drafter=ModelShape(
            hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=384
        ),
        target_steps=700,
        drafter_steps=500,
    ),
    # Seconds to build; for tests of the builder and of code paths that need *a* pair.
    "tiny": BuildConfig(
        vocab_size=384,
        context=64,
        max_position_embeddings=256,
        target=ModelShape(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
        ),
        drafter=ModelShape(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
        ),
        target_steps=30,
        drafter_steps=20,
        batch_size=8,
        max_files=40,
        tokenizer_chars=300_000,
        dtype="float32",
    ),
}


def train_tokenizer(texts: list[str], vocab_size: int, max_chars: int):
    """Byte-level BPE (GPT-2 style) wrapped as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def chunks():
        used = 0
        for t in texts:
            if used >= max_chars:
                return
            yield t
            used += len(t)

    tok.train_from_iterator(chunks(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS, unk_token=None,
        model_max_length=10**6, clean_up_tokenization_spaces=False,
    )


def _encode_stream(tokenizer, files: list[CorpusFile]) -> np.ndarray:
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for f in files:
        ids.extend(tokenizer(f.read(), add_special_tokens=False)["input_ids"])
        ids.append(eos)
    return np.asarray(ids, dtype=np.int32)


def _llama(cfg: BuildConfig, shape: ModelShape, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_attention_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config)


def _batches(stream: np.ndarray, cfg: BuildConfig, steps: int, seed: int):
    rng = np.random.default_rng(seed)
    span = cfg.context + 1
    for _ in range(steps):
        starts = rng.integers(0, len(stream) - span, size=cfg.batch_size)
        yield torch.from_numpy(np.stack([stream[s : s + span] for s in starts]).astype(np.int64))


def _lr_at(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


@torch.no_grad()
def _eval(model, stream: np.ndarray, cfg: BuildConfig, teacher=None, n_batches: int = 8):
    """Held-out loss, and (with a teacher) the top-1 agreement rate drafter vs target."""
    model.eval()
    losses, agree, total = [], 0, 0
    for batch in _batches(stream, cfg, n_batches, seed=cfg.seed + 99):
        logits = model(batch[:, :-1]).logits
        losses.append(F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item())
        if teacher is not None:
            t_logits = teacher(batch[:, :-1]).logits
            agree += (logits.argmax(-1) == t_logits.argmax(-1)).sum().item()
            total += logits.shape[0] * logits.shape[1]
    model.train()
    return float(np.mean(losses)), (agree / total if total else None)


def _train(model, stream, cfg: BuildConfig, steps: int, desc: str, teacher=None, seed=0):
    """AdamW with warmup + cosine; with a teacher: 0.5 CE + 0.5 KL(teacher || model)."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    model.train()
    bar = tqdm(_batches(stream, cfg, steps, seed), total=steps, desc=desc, unit="step")
    for step, batch in enumerate(bar):
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, steps, cfg.lr)
        logits = model(batch[:, :-1]).logits.flatten(0, 1)
        loss = F.cross_entropy(logits, batch[:, 1:].flatten())
        if teacher is not None:
            with torch.no_grad():
                t_logp = F.log_softmax(teacher(batch[:, :-1]).logits.flatten(0, 1), -1)
            kl = F.kl_div(F.log_softmax(logits, -1), t_logp, log_target=True, reduction="batchmean")
            loss = 0.5 * loss + 0.5 * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()


def build_pair(out: Path, cfg: BuildConfig, preset: str = "custom") -> dict:
    """Train tokenizer, target and drafter; save both under ``out`` with a manifest."""
    t0 = time.time()
    torch.manual_seed(cfg.seed)
    files = list_corpus(max_files=cfg.max_files)
    train_files = [f for f in files if not f.heldout]
    held_files = [f for f in files if f.heldout] or files[-2:]
    texts = [f.read() for f in train_files]
    tokenizer = train_tokenizer(texts, cfg.vocab_size, cfg.tokenizer_chars)
    train_stream = _encode_stream(tokenizer, train_files)
    held_stream = _encode_stream(tokenizer, held_files)

    torch.manual_seed(cfg.seed)
    target = _llama(cfg, cfg.target, tokenizer)
    _train(target, train_stream, cfg, cfg.target_steps, "target", seed=cfg.seed)
    torch.manual_seed(cfg.seed + 1)
    drafter = _llama(cfg, cfg.drafter, tokenizer)
    _train(drafter, train_stream, cfg, cfg.drafter_steps, "drafter (distill)",
           teacher=target, seed=cfg.seed + 1)

    t_loss, _ = _eval(target, held_stream, cfg)
    d_loss, agreement = _eval(drafter, held_stream, cfg, teacher=target)

    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, cfg.dtype)
    entries = {}
    for name, model in (("target", target), ("drafter", drafter)):
        path = out / name
        model.to(dtype).save_pretrained(path)
        tokenizer.save_pretrained(path)
        model.float()
        entries[name] = {
            "path": name,
            "parameters": sum(p.numel() for p in model.parameters()),
            "shape": getattr(cfg, name).model_dump(),
            "revision": model_revision(path),
        }
    manifest = {
        "preset": preset,
        "build_config": cfg.model_dump(),
        "corpus": {
            "source": "python-stdlib",
            "hash": corpus_hash(files),
            "train_files": len(train_files),
            "heldout_files": len(held_files),
            "train_tokens": len(train_stream),
        },
        "target": {**entries["target"], "heldout_loss": round(t_loss, 4)},
        "drafter": {**entries["drafter"], "heldout_loss": round(d_loss, 4),
                    "greedy_agreement": round(agreement or 0.0, 4)},
        "torch": torch.__version__,
        "build_seconds": round(time.time() - t0, 1),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest

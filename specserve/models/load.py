"""Loading a (target, drafter) pair from local Hugging Face checkpoints."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUILTIN = ASSETS / "builtin"


class IncompatiblePairError(ValueError):
    """The drafter cannot serve this target (different tokenizers)."""


def default_home() -> Path:
    return Path(os.environ.get("SPECSERVE_HOME", Path.home() / ".cache" / "specserve"))


def resolve_model(name: str) -> Path:
    """``builtin-target`` / ``builtin-drafter`` / ``bench-target`` or a local directory."""
    aliases = {
        "builtin-target": BUILTIN / "target",
        "builtin-drafter": BUILTIN / "drafter",
        "bench-target": default_home() / "models" / "bench" / "target",
        "bench-drafter": default_home() / "models" / "bench" / "drafter",
    }
    path = aliases.get(name, Path(name))
    if not (path / "config.json").exists():
        hint = ""
        if name.startswith("bench-"):
            hint = " (build it with `specserve models build --preset bench`)"
        raise FileNotFoundError(f"model {name!r}: no config.json in {path}{hint}")
    return path


def check_tokenizers(target_tok, drafter_tok, target_name: str, drafter_name: str) -> None:
    tv, dv = target_tok.get_vocab(), drafter_tok.get_vocab()
    if tv != dv:
        differ = len(set(tv.items()) ^ set(dv.items()))
        raise IncompatiblePairError(
            f"drafter {drafter_name!r} and target {target_name!r} have different tokenizers "
            f"(vocab sizes {len(dv)} vs {len(tv)}, {differ} differing entries); "
            "speculative decoding needs a drafter that shares the target's tokenizer"
        )


@dataclass
class ModelPair:
    target: torch.nn.Module
    drafter: torch.nn.Module | None
    tokenizer: object
    target_name: str
    drafter_name: str | None
    target_revision: str
    drafter_revision: str | None

    @property
    def vocab_size(self) -> int:
        return int(self.target.config.vocab_size)

    @property
    def max_context(self) -> int:
        return int(self.target.config.max_position_embeddings)

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id


def load_model(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


def load_pair(target: str = "builtin-target", drafter: str | None = "builtin-drafter") -> ModelPair:
    """Load through ``AutoModelForCausalLM`` / ``AutoTokenizer`` and refuse mismatched pairs."""
    from transformers import AutoTokenizer

    from specserve.models.revision import model_revision

    tpath = resolve_model(target)
    tok = AutoTokenizer.from_pretrained(tpath)
    dmodel, drev = None, None
    if drafter is not None:
        dpath = resolve_model(drafter)
        check_tokenizers(tok, AutoTokenizer.from_pretrained(dpath), target, drafter)
        dmodel, drev = load_model(dpath), model_revision(dpath)
    return ModelPair(
        target=load_model(tpath), drafter=dmodel, tokenizer=tok, target_name=target,
        drafter_name=drafter, target_revision=model_revision(tpath), drafter_revision=drev,
    )

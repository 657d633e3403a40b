"""Benchmark workloads: classes built from held-out data, or a user's JSONL.

Built-in classes (each from held-out Python stdlib files the models never trained on):
- ``code-short``: a short code prompt (function/class start, ~200 chars), short output (32).
- ``code-long``: a long code prompt (~1200 chars), long output (128).
- ``prose``: English docstrings (>= 200 chars) cut to ~300 chars, medium output (64).
- ``repetitive``: a code block followed by the start of the same block again, so the
  continuation repeats text already in the prompt (prompt-lookup friendly), output 64.
User JSONL: one object per line, ``{"prompt": str, "max_tokens": int?, "class": str?}``.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path

from specserve.models.corpus import heldout_prompts, list_corpus


@dataclass(frozen=True)
class Prompt:
    text: str
    max_tokens: int
    cls: str


class WorkloadError(ValueError):
    pass


def _heldout_texts() -> list[str]:
    return [f.read() for f in list_corpus() if f.heldout]


def _docstrings(texts: list[str], n: int) -> list[str]:
    out: list[str] = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 200:
                    out.append(doc[:300])
                    if len(out) >= n:
                        return out
    return out


def _long_code(texts: list[str], n: int, chars: int = 1200) -> list[str]:
    out = []
    for text in texts:
        start = text.find("\ndef ")
        if start > 0 and len(text) > start + chars:
            out.append(text[start + 1 : start + 1 + chars])
        if len(out) >= n:
            break
    return out


def _repetitive(texts: list[str], n: int) -> list[str]:
    out = []
    for text in texts:
        i = text.find("\nclass ")
        if i < 0:
            continue
        block = text[i + 1 : i + 1 + 400]
        out.append(block + "\n\n" + block[:120])
        if len(out) >= n:
            break
    return out


BUILTIN_CLASSES = ("code-short", "code-long", "prose", "repetitive")  # and "mixed" of them


def builtin_workloads(n_per_class: int = 8) -> dict[str, list[Prompt]]:
    texts = _heldout_texts()
    classes = {
        "code-short": [Prompt(p, 32, "code-short") for p in heldout_prompts(n=n_per_class)],
        "code-long": [Prompt(p, 128, "code-long") for p in _long_code(texts, n_per_class)],
        "prose": [Prompt(p, 64, "prose") for p in _docstrings(texts, n_per_class)],
        "repetitive": [Prompt(p, 64, "repetitive") for p in _repetitive(texts, n_per_class)],
    }
    assert tuple(classes) == BUILTIN_CLASSES
    empty = [k for k, v in classes.items() if not v]
    if empty:
        raise WorkloadError(f"no held-out prompts for classes {empty}")
    return classes


def load_jsonl(path: Path, default_max_tokens: int = 64) -> dict[str, list[Prompt]]:
    classes: dict[str, list[Prompt]] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            prompt = obj["prompt"]
            if not isinstance(prompt, str) or not prompt:
                raise ValueError("prompt must be a non-empty string")
            mt = int(obj.get("max_tokens", default_max_tokens))
            if mt < 1:
                raise ValueError("max_tokens must be >= 1")
        except (ValueError, KeyError, TypeError) as e:
            raise WorkloadError(f"{path}:{n}: {e}") from None
        cls = str(obj.get("class", "custom"))
        classes.setdefault(cls, []).append(Prompt(prompt, mt, cls))
    if not classes:
        raise WorkloadError(f"{path}: no prompts")
    return classes

"""A model's revision: a content hash of its weights and config, like a git blob id."""

from __future__ import annotations

import hashlib
from pathlib import Path

_HASHED = ("config.json", "tokenizer.json")


def model_revision(path: str | Path) -> str:
    """sha256 over the checkpoint's weight files, config and tokenizer (first 12 hex chars)."""
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
    files += [path / n for n in _HASHED if (path / n).exists()]
    if not files:
        raise FileNotFoundError(f"{path} holds no model weights (*.safetensors or *.bin)")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]

"""The offline training corpus: the Python standard library sources of the running interpreter.

They are present on every machine that runs specserve, they are real code (a realistic
speculative-decoding workload), and a deterministic split keeps held-out files for
evaluation and benchmarks.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

_EXCLUDED_PARTS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}
HELDOUT_EVERY = 20  # 1 file in 20 (by hash of its path) is held out


@dataclass(frozen=True)
class CorpusFile:
    path: Path
    relpath: str
    heldout: bool

    def read(self) -> str:
        return self.path.read_text(encoding="utf-8", errors="replace")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_heldout(relpath: str) -> bool:
    digest = hashlib.sha256(relpath.encode()).digest()
    return int.from_bytes(digest[:4], "little") % HELDOUT_EVERY == 0


def list_corpus(root: Path | None = None, max_files: int | None = None) -> list[CorpusFile]:
    """All ``.py`` files under ``root`` (default: the stdlib), sorted, with a held-out flag."""
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if _EXCLUDED_PARTS.intersection(rel.split("/")[:-1]):
            continue
        files.append(CorpusFile(path, rel, _is_heldout(rel)))
    if max_files is not None:
        files = files[:max_files]
    if not files:
        raise FileNotFoundError(f"no Python sources found under {root}")
    return files


def corpus_hash(files: list[CorpusFile]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.relpath.encode())
        h.update(b"\0")
        h.update(f.path.read_bytes())
    return h.hexdigest()[:16]


def heldout_prompts(
    files: list[CorpusFile] | None = None, n: int = 20, prompt_chars: int = 200
) -> list[str]:
    """Deterministic code prompts cut from held-out files (function/class starts)."""
    files = [f for f in (files or list_corpus()) if f.heldout]
    prompts: list[str] = []
    for f in files:
        lines = f.read().splitlines(keepends=True)
        for i, line in enumerate(lines):
            if line.lstrip().startswith(("def ", "class ")) and i + 3 < len(lines):
                text = "".join(lines[max(0, i - 2) : i + 4])[:prompt_chars]
                if len(text) > 40:
                    prompts.append(text)
                break
        if len(prompts) >= n:
            break
    return prompts

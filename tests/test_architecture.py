"""The code base's shape, enforced: a one-way package graph, one round loop, short functions.

Read from the source with ``ast`` (every import, at module or function level).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("router", "deployments", "drafter_service", "target_service")


def _sources(*folders: str) -> list[Path]:
    return [p for f in folders for p in (ROOT / f).rglob("*.py") if "proto_gen" not in p.parts]


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
    return out


def test_specserve_never_imports_the_services_above_it():
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}"
           for p in _sources("specserve") for line, mod in _imports(p)
           if mod.split(".")[0] in SERVICES]
    assert not bad, bad
    assert len(_sources("specserve")) > 30  # the scan saw the package


def test_the_pure_core_imports_only_numpy_and_torch():
    allowed = {"numpy", "torch", "specserve", "__future__", "dataclasses", "collections",
               "typing", "math", "os", "random", "itertools", "hashlib", "struct"}
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}"
           for p in _sources("specserve/core") for line, mod in _imports(p)
           if mod.split(".")[0] not in allowed]
    assert not bad, bad


def test_one_propose_verify_commit_loop():
    """Only the round module decides a commit; every path runs it."""
    callers = sorted({str(p.relative_to(ROOT)) for p in _sources("specserve", *SERVICES, "bench")
                      if "decide_commit(" in p.read_text()})
    assert callers == ["specserve/core/commit.py", "specserve/rounds.py"], callers
    for path in ("specserve/engine/generator.py", "specserve/engine/lockstep.py",
                 "router/router.py"):
        assert "speculate(" in (ROOT / path).read_text(), path


def test_functions_stay_short():
    long = []
    folders = ("router", "specserve/engine", "drafter_service", "target_service", "deployments")
    for p in [*_sources(*folders), ROOT / "specserve/rounds.py"]:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long

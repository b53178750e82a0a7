"""Which test modules reach vLLM's code: those that name vllm, or import (at any depth,
at module level or inside a function) a module of this repository that imports vllm or
names a vllm module in a string (``importlib``, ``monkeypatch``).

The unit tests run a second time on vLLM 0.33.0's Python (``make test-vllm033``); a module
that never reaches vLLM proves nothing new there, so that pass keeps only the ones that do
(``VLLM_REACH_ONLY=1``, read by ``tests/conftest.py``). Over-inclusion is safe: a test
module whose text names ``vllm`` at all counts."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_NAMES_VLLM = re.compile(r"""["']vllm(\.|["'])""")  # a string naming vllm or one of its modules
PROJECT = ("kv_connector", "hybrid", "scripts", "tests")


def _file_of(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (``from a.b import c`` gives a.b and a.b.c)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def reaches_vllm(path: Path) -> bool:
    """Whether the test module at ``path`` reaches vLLM (see the module's docstring)."""
    if "vllm" in path.read_text():
        return True
    todo, seen = list(_direct(path.resolve())[1]), set()
    while todo:  # every project module its imports lead to, each looked at once
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        names_vllm, imported = _direct(module)
        if names_vllm:
            return True
        todo.extend(imported)
    return False


@functools.cache
def _direct(path: Path) -> tuple[bool, tuple[Path, ...]]:
    """Whether a module imports vllm or names one of its modules in a string, and the
    modules of this repository it imports."""
    imports = _imports(path)
    names_vllm = bool(_NAMES_VLLM.search(path.read_text())) or any(m.split(".")[0] == "vllm" for m in imports)
    files = (_file_of(m) for m in sorted(imports) if m.split(".")[0] in PROJECT)
    return names_vllm, tuple(f for f in files if f is not None)

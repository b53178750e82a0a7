"""Measures the package's prose and size: words per docstring sentence, lines per wing, largest modules.

The figures are the house's yardsticks for readable docstrings and modules that end where their
idea ends (docs/design.md); the standard library alone computes them, so any checkout can.

    python -m scripts.prose_stats [ROOT ...]      (default: kv_connector hybrid)
"""

from __future__ import annotations

import ast
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

# A sentence ends at . ? or ! followed by whitespace, whatever comes next: docstrings often start
# a sentence with a lowercase name (``vLLM``, an option such as ``pool_bytes:``), and the
# abbreviations that would split wrongly are masked first.
_SENTENCE_END = re.compile(r"(?<=[.?!])\s+(?=\S)")
# Indented or bulleted lines inside a docstring (usage examples, tables) are not prose.
_NOT_PROSE = re.compile(r"^\s{2,}\S|^\s*[-*]\s|^\s*>>>|^\s*\|")
_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.")


def _docstrings(tree: ast.Module) -> list[str]:
    """Every module, class and function docstring of one parsed file."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node, clean=True)
            if text:
                found.append(text)
    return found


def _sentences(docstring: str) -> list[str]:
    """The prose sentences of one docstring, with examples and tables left out."""
    paragraphs: list[str] = []
    for paragraph in docstring.split("\n\n"):
        lines = [line for line in paragraph.splitlines() if not _NOT_PROSE.match(line)]
        if lines:
            paragraphs.append(" ".join(line.strip() for line in lines))
    out: list[str] = []
    for paragraph in paragraphs:
        text = paragraph
        for abbreviation in _ABBREVIATIONS:
            text = text.replace(abbreviation, abbreviation.replace(".", ""))
        out.extend(s for s in _SENTENCE_END.split(text) if s.strip())
    return out


def _code_lines(source: str) -> int:
    """Lines that are neither blank nor comments (docstrings count: they are part of the module)."""
    return sum(1 for line in source.splitlines() if line.strip() and not line.strip().startswith("#"))


def main(argv: list[str]) -> int:
    roots = [Path(p) for p in (argv or ["kv_connector", "hybrid"])]
    words_per_sentence: list[int] = []
    parentheses = 0
    wing_lines: dict[str, int] = defaultdict(int)
    wing_files: dict[str, int] = defaultdict(int)
    modules: list[tuple[int, str]] = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            for docstring in _docstrings(ast.parse(source)):
                for sentence in _sentences(docstring):
                    words_per_sentence.append(len(sentence.split()))
                    parentheses += sentence.count("(")
            wing = str(path.parent)
            wing_lines[wing] += _code_lines(source)
            wing_files[wing] += 1
            modules.append((len(source.splitlines()), str(path)))
    words = sum(words_per_sentence)
    print(f"docstring sentences: {len(words_per_sentence)}, words: {words}")
    if words_per_sentence:
        print(
            f"words per sentence: median {statistics.median(words_per_sentence):.1f}, "
            f"mean {statistics.mean(words_per_sentence):.1f}; "
            f"parentheses per 100 words: {100 * parentheses / max(words, 1):.1f}"
        )
    print("\nlines of code per wing (non-blank, non-comment; files):")
    for wing in sorted(wing_lines):
        print(f"  {wing:<32} {wing_lines[wing]:>6}  ({wing_files[wing]})")
    print(f"  {'total':<32} {sum(wing_lines.values()):>6}  ({sum(wing_files.values())})")
    print("\nten largest modules (lines):")
    for lines, name in sorted(modules, reverse=True)[:10]:
        print(f"  {lines:>5}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

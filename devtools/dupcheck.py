"""The duplicate-code check of ``make lint`` and ``make test``: one fact, one place.

Fails when six or more lines of code appear in two files (the threshold of the
``duplicates`` scanner; five identical lines are still allowed: below that, the tree holds
only a script's ``main`` boilerplate). Lines are compared stripped of indentation,
comments, docstrings and imports, and lines without a word character (a lone bracket) are
left out: the rule pylint's ``symilar --duplicates=5`` applies, found by hashing every run
of six lines instead of comparing every pair of files (``symilar`` took four minutes of a
two-core CI host; this takes two seconds).

Usage: ``python -m devtools.dupcheck FILE...`` (the Makefile passes the tracked Python
files outside tests/).
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

MIN_LINES = 6


@dataclass(frozen=True)
class Duplicate:
    """``count`` code lines equal at ``first`` and ``second``: (path, first line, last line)."""

    count: int
    first: tuple[str, int, int]
    second: tuple[str, int, int]

    def __str__(self) -> str:
        (a, a0, a1), (b, b0, b1) = self.first, self.second
        return f"{self.count} similar lines: {a}:{a0}-{a1} and {b}:{b0}-{b1}"


def code_lines(source: str) -> list[tuple[int, str]]:
    """(line number, stripped text) of every line the check compares."""
    tree = ast.parse(source)
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            skipped.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        elif isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    skipped.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    comment_at = {
        tok.start[0]: tok.start[1]
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    lines = []
    for number, line in enumerate(source.splitlines(), start=1):
        if number in skipped:
            continue
        text = line[: comment_at.get(number, len(line))].strip()
        if any(c.isalnum() or c == "_" for c in text):
            lines.append((number, text))
    return lines


def find_duplicates(files: dict[str, str], min_lines: int = MIN_LINES) -> list[Duplicate]:
    """Every maximal run of ``min_lines`` or more code lines found in two of ``files``
    (path -> source)."""
    lines = {path: code_lines(source) for path, source in files.items()}
    seen: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
    for path, numbered in lines.items():
        texts = [text for _, text in numbered]
        for start in range(len(texts) - min_lines + 1):
            seen[tuple(texts[start : start + min_lines])].append((path, start))
    pairs: set[tuple[str, int, str, int]] = set()
    for places in seen.values():
        for i, (a, ai) in enumerate(places):
            for b, bi in places[i + 1 :]:
                if a != b:
                    pairs.add((a, ai, b, bi))
    return [_extend(lines, pairs, pair, min_lines) for pair in sorted(pairs) if _starts_run(pairs, pair)]


def _starts_run(pairs: set[tuple[str, int, str, int]], pair: tuple[str, int, str, int]) -> bool:
    a, ai, b, bi = pair
    return (a, ai - 1, b, bi - 1) not in pairs


def _extend(
    lines: dict[str, list[tuple[int, str]]],
    pairs: set[tuple[str, int, str, int]],
    pair: tuple[str, int, str, int],
    min_lines: int,
) -> Duplicate:
    a, ai, b, bi = pair
    windows = 1
    while (a, ai + windows, b, bi + windows) in pairs:
        windows += 1
    count = windows + min_lines - 1
    first = (a, lines[a][ai][0], lines[a][ai + count - 1][0])
    second = (b, lines[b][bi][0], lines[b][bi + count - 1][0])
    return Duplicate(count, first, second)


def main(paths: Iterable[str]) -> int:
    files = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            files[path] = f.read()
    duplicates = find_duplicates(files)
    for duplicate in duplicates:
        print(duplicate)
    if duplicates:
        print(f"duplicate code ({MIN_LINES}+ lines in two files): factor it into one place")
        return 1
    print(f"duplicate code: none ({MIN_LINES}+ lines, {len(files)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

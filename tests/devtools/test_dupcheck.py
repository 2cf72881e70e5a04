"""The duplicate-code check: MIN_LINES code lines in two files fail it, whatever their
indentation, comments, docstrings and imports; one fewer does not, nor do lone brackets."""

from __future__ import annotations

from devtools.dupcheck import MIN_LINES, Duplicate, find_duplicates

# Its first 4 to 7 lines are a function body of their own (MIN_LINES - 1 and MIN_LINES).
BODY = [
    "total = 0",
    "for item in items:",
    "    if not item.ok:",
    "        skipped.append(item)",
    "        continue",
    "    total += item.size",
    "return total, skipped",
]


def _function(name: str, body: list[str], *, noise: bool) -> str:
    lines = [f"def {name}(items, skipped):"]
    if noise:
        lines.append('    """A docstring the other copy lacks."""')
    for i, line in enumerate(body):
        if noise and i == 1:
            lines.append("    import os  # an import between the lines")
            lines.append("    # a comment line")
        lines.append(f"    {line}  # trailing comment" if noise else f"    {line}")
    return "\n".join(lines) + "\n"


def test_min_lines_in_two_files_are_found_with_their_line_numbers() -> None:
    body = BODY[:MIN_LINES]
    files = {
        "a.py": "x = 1\n\n" + _function("count", body, noise=False),
        "b.py": "class C:\n    pass\n\n\n" + _function("tally", body, noise=True).replace("\n", "\n    "),
    }
    # b.py: the body from line 7 on, its second line after an import and a comment line.
    expected = Duplicate(MIN_LINES, ("a.py", 4, 3 + MIN_LINES), ("b.py", 7, 8 + MIN_LINES))
    assert find_duplicates(files) == [expected]


def test_fewer_lines_lone_brackets_and_one_file_are_not_duplicates() -> None:
    body = BODY[: MIN_LINES - 1]
    fewer = {"a.py": _function("f", body, noise=False), "b.py": _function("g", body, noise=True)}
    assert find_duplicates(fewer) == []
    entries = (f"    '{c}'," for c in "abcdefgh"[: MIN_LINES - 2])
    listed = ["names = [", *entries, "]"]  # MIN_LINES - 1 code lines and a bracket
    assert (
        find_duplicates(
            {"a.py": _function("f", listed, noise=False), "b.py": _function("g", listed, noise=False)}
        )
        == []
    )
    twice = _function("f", BODY, noise=False) + _function("g", BODY, noise=False)
    assert find_duplicates({"a.py": twice}) == []

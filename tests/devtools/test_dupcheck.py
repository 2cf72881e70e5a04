"""The duplicate-code check: seven code lines in two files fail it, whatever their
indentation, comments, docstrings and imports; six do not, nor do lone brackets."""

from __future__ import annotations

from devtools.dupcheck import Duplicate, find_duplicates

BODY = [
    "total = 0",
    "for item in items:",
    "    if item.ok:",
    "        total += item.size",
    "    else:",
    "        skipped.append(item)",
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


def test_seven_lines_in_two_files_are_found_with_their_line_numbers() -> None:
    files = {
        "a.py": "x = 1\n\n" + _function("count", BODY, noise=False),
        "b.py": "class C:\n    pass\n\n\n" + _function("tally", BODY, noise=True).replace("\n", "\n    "),
    }
    assert find_duplicates(files) == [Duplicate(7, ("a.py", 4, 10), ("b.py", 7, 15))]


def test_six_lines_lone_brackets_and_one_file_are_not_duplicates() -> None:
    six = {"a.py": _function("f", BODY[:6], noise=False), "b.py": _function("g", BODY[:6], noise=True)}
    assert find_duplicates(six) == []
    listed = ["names = [", *(f"    '{c}'," for c in "abcde"), "]"]  # 6 code lines and a bracket
    assert (
        find_duplicates(
            {"a.py": _function("f", listed, noise=False), "b.py": _function("g", listed, noise=False)}
        )
        == []
    )
    twice = _function("f", BODY, noise=False) + _function("g", BODY, noise=False)
    assert find_duplicates({"a.py": twice}) == []
